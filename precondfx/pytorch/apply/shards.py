"""Sharded parameters (DTensor, FSDP2 ``fully_shard``) and constants that survive
``model.to_empty``: the pieces ``apply.reinit`` needs to write a plan on any rank.

The two random streams (``rng=``) are described in :mod:`precondfx.pytorch.distributed`.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import sys
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from precondfx.core import draw as core
from precondfx.pytorch.draws import torch_ops
from precondfx.pytorch.apply.common import PREFIX
from precondfx.core.plan import ParamInit

CONSTANTS = PREFIX + "constants"
ALIASES = PREFIX + "aliases"
BALANCEABLE = PREFIX + "balanceable"
#: set on a result planned on the meta device: its values come from ``to_empty`` + ``reinit``
NO_DATA = PREFIX + "planned_on_meta"
RNGS = ("stream", "counter")
#: set by ``reinit`` on a model planned on the meta device: the token and position parameters
#: (rule ``match``) whose std is measured on data, drawn by ``distributed.calibrate``
PENDING_MATCHES = PREFIX + "pending_matches"


# -- constants --------------------------------------------------------------------------------
def record_constants(model: nn.Module, planned: dict[str, float], read: bool = True) -> None:
    """Keep every inserted constant (buffer name -> value) as a plain attribute of the model.

    ``model.to_empty(device=...)`` (how a model built on the meta device, or sharded by FSDP2,
    gets storage) leaves buffers uninitialized; :func:`restore_constants` writes them back from
    this record.  ``read`` takes the final values from the buffers (after calibration and
    balancing); a model on the meta device keeps the planned values."""
    out = dict(planned)
    if read:
        for name, b in model.named_buffers():
            if name.rpartition(".")[2].startswith(PREFIX) and b.numel() == 1 and \
                    b.is_floating_point():
                out[name] = float(b.detach().float().cpu())
    setattr(model, CONSTANTS, out)
    setattr(model, NO_DATA, not read)


def record_balanceable(model: nn.Module, ok: dict[str, list[str]], left: dict[str, str]
                       ) -> None:
    """Keep, as a plain attribute of the model, which weights measured balancing may rescale
    (weight -> its alpha buffers) and why the others may not, so that
    ``precondfx.distributed.balance`` can balance the materialized model without the graph."""
    setattr(model, BALANCEABLE, ({w: list(b) for w, b in ok.items()}, dict(left)))


def record_aliases(model: nn.Module, aliases: dict[str, str]) -> None:
    """Keep the plan's tied parameters (alias -> name) as a plain attribute of the model, so
    that :func:`untied` can tell, without the plan, that ``to_empty`` separated them."""
    setattr(model, ALIASES, dict(aliases))


def untied(model: nn.Module) -> list[tuple[str, str]]:
    """The recorded tied pairs (alias, name) that are now different tensors with different
    values (``model.to_empty`` unties them and leaves the alias uninitialized)."""
    rec: dict[str, str] = getattr(model, ALIASES, None) or {}
    named = dict(model.named_parameters(remove_duplicate=False))
    out = []
    for a, c in rec.items():
        pa, pc = named.get(a), named.get(c)
        if pa is None or pc is None or pa is pc or pa.shape != pc.shape:
            continue
        la, lc = local(pa), local(pc)
        if la.device.type == "meta" or la.shape != lc.shape or not torch.equal(la, lc):
            out.append((a, c))
    return out


def restore_constants(model: nn.Module) -> list[str]:
    """Write the recorded constants back into their buffers; returns the names written."""
    rec: dict[str, float] = getattr(model, CONSTANTS, None) or {}
    done = []
    with torch.no_grad():
        for name, v in rec.items():
            try:
                b = model.get_buffer(name)
            except AttributeError:
                continue
            if b.device.type != "meta":
                b.fill_(v)
                done.append(name)
    return done


# -- sharded re-initialization ---------------------------------------------------------------
def _dtensor_cls() -> Any:
    """The DTensor class, or None.  A DTensor exists only once ``torch.distributed.tensor``
    is imported (by whoever built, sharded or loaded it): before that nothing is a DTensor,
    and the check does not import it (the import took 2.2 s of a 2.3 s first call on a
    small MLP)."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter is a DTensor (FSDP2 ``fully_shard``, tensor parallel)."""
    cls = _dtensor_cls()
    return cls is not None and any(isinstance(p, cls) for p in model.parameters())


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` was applied to (FSDP2; none before ``torch.distributed.fsdp``
    is imported, and the check does not import it: see :func:`_dtensor_cls`)."""
    if "torch.distributed.fsdp" not in sys.modules:
        return []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Every FSDP2 unit's parameters all-gathered and kept whole through forward and backward
    passes (FSDP2's ``unshard``, resharding after forward and backward off), so that
    ``model.get_parameter`` gives the full tensors the forward uses and autograd can
    differentiate with respect to them; on the way out the units are resharded and their
    resharding settings restored.  No collective runs inside (each rank may run its own
    passes); the parameters' memory is that of the unsharded model.  Nothing happens to a
    model without FSDP2 units.  Writes to the parameters inside are lost: change the sharded
    parameters after."""
    units = fsdp_units(model)
    if not units:
        yield
        return
    saved = []
    for m in units:
        st = m._get_fsdp_state()
        saved.append((st, st._auto_reshard_after_forward,
                      [(g, g.post_forward_mesh_info, g.reshard_after_backward)
                       for g in st._fsdp_param_groups]))
    try:
        for m in units:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
        for m in units:
            m.unshard()
        yield
    finally:
        for m in units:
            m.reshard()
        for st, auto, groups in saved:
            st._auto_reshard_after_forward = auto
            for g, fwd, bwd in groups:
                g.post_forward_mesh_info, g.reshard_after_backward = fwd, bwd


def _local_box(p: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(local shape, offset in the full tensor) of this rank's block of ``p``; None when the
    placements are not plain Shard/Replicate blocks."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if not all(type(pl) in (Shard, Replicate) for pl in p.placements):
        return None
    return compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)


def _write(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the full tensor ``full`` (CPU) into parameter ``p``."""
    cls = _dtensor_cls()
    if cls is None or not isinstance(p, cls):
        p.copy_(full.to(dtype=p.dtype, device=p.device))
        return
    local = p.to_local()
    box = _local_box(p)
    if box is not None:
        shape, off = box
        part = full[tuple(slice(o, o + n) for o, n in zip(off, shape))]
    else:  # any other placement: let DTensor cut the full tensor, without communication
        from torch.distributed.tensor import distribute_tensor
        part = distribute_tensor(full.to(local.device), p.device_mesh, p.placements,
                                 src_data_rank=None).to_local()
    local.copy_(part.reshape(local.shape).to(dtype=local.dtype, device=local.device))


def _key(seed: int, name: str) -> list[int]:
    h = hashlib.blake2b(f"{int(seed)}:{name}".encode(), digest_size=16).digest()
    return [int.from_bytes(h[:8], "little"), int.from_bytes(h[8:], "little")]


def counter_normal(seed: int, name: str, start: int, n: int) -> torch.Tensor:
    """Standard normals (float32) at flat positions ``start .. start+n-1`` of parameter
    ``name``'s full tensor: Philox4x64-10 keyed by (seed, name); elements 2j and 2j+1 are the
    Box-Muller pair of words 2j and 2j+1 (uniforms in float64, the transform in float32 as
    ``torch.randn`` does).  Any slice equals the same slice of the full draw."""
    if n <= 0:
        return torch.zeros(0)
    p0 = start // 2
    pairs = (start + n + 1) // 2 - p0
    w0 = 2 * p0
    gen = np.random.Generator(np.random.Philox(key=_key(seed, name), counter=[w0 // 4, 0, 0, 0]))
    if w0 % 4:
        gen.bit_generator.random_raw(w0 % 4)
    u = gen.random(2 * pairs)                                  # [0, 1), one word each
    r = torch.from_numpy(1.0 - u[0::2]).float().log_().mul_(-2.0).sqrt_()   # 1-u in (0, 1]
    theta = torch.from_numpy(u[1::2]).float().mul_(2.0 * math.pi)
    z = torch.stack([r * theta.cos(), r * theta.sin()], 1).flatten()
    return z[start % 2: start % 2 + n]


def _counter_block(seed: int, name: str, full: tuple[int, ...], shape: tuple[int, ...],
                   off: tuple[int, ...]) -> torch.Tensor:
    """The block ``[off, off+shape)`` of the full counter-based draw, as contiguous runs."""
    if math.prod(shape) == 0:
        return torch.zeros(shape)
    sharded = [d for d in range(len(full)) if shape[d] != full[d]]
    last = sharded[-1] if sharded else 0
    inner = math.prod(full[last + 1:])            # full trailing dims
    run = shape[last] * inner if sharded else math.prod(full)
    strides = [math.prod(full[d + 1:]) for d in range(len(full))]
    outer = [range(off[d], off[d] + shape[d]) for d in range(last)]
    runs = []
    for idx in np.ndindex(*[len(r) for r in outer]) if outer else [()]:
        start = sum((outer[d][i]) * strides[d] for d, i in enumerate(idx)) + \
            (off[last] * strides[last] if sharded else 0)
        runs.append(counter_normal(seed, name, start, run))
    return torch.cat(runs).reshape(shape)


def _sum_all(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """All-reduce ``x`` over every rank of ``p``'s device mesh (a plain tensor: no-op)."""
    cls = _dtensor_cls()
    if cls is None or not isinstance(p, cls):
        return x
    mesh = p.device_mesh
    dev = p.to_local().device
    x = x.to(dev)
    for d in range(mesh.ndim):
        dist.all_reduce(x, group=mesh.get_group(d))
    return x.cpu()


def _counter_param(p: torch.Tensor, pi: ParamInit, seed: int, name: str) -> None:
    full = tuple(p.shape)
    cls = _dtensor_cls()
    box = _local_box(p) if cls is not None and isinstance(p, cls) else (full, (0,) * len(full))
    if pi.rule == "orthogonal" or box is None:  # needs the whole tensor: same on every rank
        if pi.rule == "orthogonal":
            gen = torch.Generator().manual_seed(_key(seed, name)[0] & (2 ** 63 - 1))
            whole = core.draw(pi, full, torch_ops(gen))
        else:
            whole = core.moment_matched(_counter_block(seed, name, full, full, (0,) * len(full)),
                                        float(pi.std), torch_ops(None))
        _write(p, whole)
        return
    shape, off = box
    block = _counter_block(seed, name, full, shape, off)
    # Moment matching over the full tensor: every element is counted as often in the sum as
    # in the count (replicated mesh dimensions repeat both), so the ratio is the full moment.
    stats = _sum_all(torch.tensor([float(block.double().pow(2).sum()), float(block.numel())],
                                  dtype=torch.float64), p)
    m2 = float(stats[0] / stats[1]) if stats[1] > 0 else 0.0
    if m2 > 0:
        block = block * (float(pi.std) / m2 ** 0.5)
    local = p.to_local() if cls is not None and isinstance(p, cls) else p
    local.copy_(block.reshape(local.shape).to(dtype=local.dtype, device=local.device))


#: rules the counter-based stream draws per shard (the others need no random draw)
COUNTER_RULES = ("geometric", "fan_in", "fan_out", "xavier", "orthogonal")


def local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``p`` (``p`` itself when it is a plain tensor)."""
    cls = _dtensor_cls()
    return p.to_local() if cls is not None and isinstance(p, cls) else p


write = _write
counter_param = _counter_param

