"""Large models: constants that survive materialization, sharded re-initialization, and the
output scale calibrated with a distributed forward (FSDP2 ``fully_shard``, DTensor).

Recipe (README, ``examples/fsdp_torchrun.py``): plan and apply on the meta device, shard with
``fully_shard``, ``model.to_empty(device=...)``, then :func:`reinit` (each rank writes only its
shard) and :func:`calibrate` (the output statistics are all-reduced, so every rank ends with the
same constant).

Two random streams give the full tensors:

- ``rng="stream"`` (what ``precondfx.reinit`` uses): the single-process draw, one
  ``torch.Generator`` walking the plan in order.  Each rank generates every parameter (one at a
  time, on the CPU) and keeps its shard, so the result is bit-identical to ``precondition`` and
  to ``reinit`` on the unsharded model; the cost per rank is that of the whole model.
- ``rng="counter"``: a counter-based generator (Philox4x64-10, numpy) keyed by the seed and the
  parameter's name, indexed by the element's position in the full tensor.  Each rank draws only
  its shard; the full tensor does not depend on the number of ranks or the sharding, and equals
  ``reinit(..., rng="counter")`` in one process.  Moment matching uses the full tensor's second
  moment, all-reduced from the shards' sums of squares.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from precondfx.apply.common import PREFIX
from precondfx.capture.common import main_output, make_sample
from precondfx.errors import PrecondError
from precondfx.plan import ParamInit, Plan

CONSTANTS = PREFIX + "constants"
RNGS = ("stream", "counter")


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
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter is a DTensor (FSDP2 ``fully_shard``, tensor parallel)."""
    cls = _dtensor_cls()
    return cls is not None and any(isinstance(p, cls) for p in model.parameters())


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
        from precondfx import draw as core
        if pi.rule == "orthogonal":
            gen = torch.Generator().manual_seed(_key(seed, name)[0] & (2 ** 63 - 1))
            whole = core.draw(pi, full, core.torch_ops(gen))
        else:
            whole = core.moment_matched(_counter_block(seed, name, full, full, (0,) * len(full)),
                                        float(pi.std), core.torch_ops(None))
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


@torch.no_grad()
def reinit(model: nn.Module, plan: Plan, seed: int, rng: str = "stream") -> list[str]:
    """Apply the plan's parameter inits to a model whose parameters may be DTensors (FSDP2,
    tensor parallel) or plain tensors; each rank writes only its shard.  ``rng``: see the
    module docstring.  The recorded constants (scales) are written back too, so this is the
    one call after ``model.to_empty(device=...)``.  Returns the names changed."""
    from precondfx.apply.reinit import draw
    if rng not in RNGS:
        raise PrecondError(f"rng={rng!r} is not one of {RNGS}")
    gen = torch.Generator().manual_seed(int(seed))
    named = dict(model.named_parameters(remove_duplicate=False))
    cls = _dtensor_cls()
    changed = []
    for name, pi in plan.inits.items():
        p = named.get(name)
        if p is None:
            continue
        if pi.rule == "scale":
            (p.to_local() if cls is not None and isinstance(p, cls) else p).mul_(float(pi.std))
            changed.append(name)
            continue
        if rng == "counter" and pi.rule in ("geometric", "fan_in", "fan_out", "xavier",
                                            "orthogonal"):
            _counter_param(p, pi, seed, name)
            changed.append(name)
            continue
        new = draw(pi, tuple(p.shape), gen)
        if new is None:
            continue
        _write(p, new)
        changed.append(name)
    restore_constants(model)
    return changed


# -- distributed calibration ------------------------------------------------------------------
def _output_buffer(model: nn.Module) -> str:
    names = [n for n, _ in model.named_buffers() if n.rpartition(".")[2] == PREFIX + "output_scale"]
    if not names:
        raise PrecondError("the model has no output scale (precondfx_output_scale buffer): "
                           "precondition it with target_std set (the default) first")
    return names[0]


def _global_std(t: torch.Tensor, group: Any) -> tuple[float, float]:
    """(std over every rank's batch, this rank's std); population std, float64."""
    t = t.detach().to(torch.float64).flatten()
    stats = torch.stack([t.sum(), t.pow(2).sum(), torch.tensor(float(t.numel()),
                                                               dtype=torch.float64,
                                                               device=t.device)])
    local = float(t.std(correction=0)) if t.numel() > 1 else float("nan")
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats, group=group)
    s, s2, n = (float(v) for v in stats.cpu())
    if n < 2:
        raise PrecondError("the calibration batch has fewer than 2 output elements over all ranks")
    mean = s / n
    return math.sqrt(max(s2 / n - mean * mean, 0.0)), local


@torch.no_grad()
def calibrate(model: nn.Module, sample: Any, target_std: float = 0.05, *,
              output_key: str | int | None = None, mode: str = "train", group: Any = None,
              forward_kwargs: dict | None = None) -> dict[str, float]:
    """Set the output scale from a distributed forward: every rank runs its own calibration
    batch, the output's sum, sum of squares and count are all-reduced, so the std is that of
    the global batch and every rank sets the same constant.  Works without a process group
    (one process).  Returns the stds before and after and the scale."""
    from precondfx import calibrate as cal
    if not (target_std and target_std > 0 and math.isfinite(target_std)):
        raise PrecondError(f"target_std={target_std!r} must be a positive number")
    s = make_sample(sample, forward_kwargs)
    cal.check_finite_sample(s)
    buf_name = _output_buffer(model)
    buf = model.get_buffer(buf_name)
    current = float(buf.float().cpu())
    if not (math.isfinite(current) and current != 0.0):  # uninitialized after to_empty
        current = 1.0
        buf.fill_(1.0)
    before, _ = _global_std(main_output(cal.forward(model, s, mode), output_key), group)
    scale = current * cal.solve_output_scale(before, target_std)
    buf.fill_(scale)
    rec = getattr(model, CONSTANTS, None)
    if isinstance(rec, dict):
        rec[buf_name] = scale
    after, local = _global_std(main_output(cal.forward(model, s, mode), output_key), group)
    return {"std_before": before / current, "scale": scale, "std_after": after,
            "local_std_after": local}
