"""Pieces both PyTorch back ends use: buffer names, replacement pool modules, output paths."""
from __future__ import annotations

import copy
import operator
import re
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from precondfx.pytorch.capture.common import child, is_dataclass_output, rebuild_distribution
from precondfx.pytorch.capture.common import output_path  # noqa: F401  (the one rule, re-exported)
from precondfx.errors import PrecondError
from precondfx.core.backend import PREFIX
from precondfx.core.plan import PoolChange


def buffer_name(tag: str, node: str, index: int | None = None) -> str:
    """A valid, unique-per-site attribute name for a scale constant."""
    base = re.sub(r"[^0-9a-zA-Z_]", "_", node)
    return f"{PREFIX}{tag}_{base}" + (f"_{index}" if index is not None else "")


def first_param(model: torch.nn.Module) -> torch.Tensor | None:
    """The model's first parameter, whose device, dtype and memory format a replacement pool
    convolution takes (None for a model without parameters)."""
    return next(iter(model.parameters()), None)


def like_param(model: torch.nn.Module) -> torch.Tensor | None:
    """The parameter whose dtype and device the constants take: the floating one of the widest
    dtype (a model mixing bfloat16 and float32 layers gets float32 constants,
    which a 0-d multiplier never promotes a bfloat16 activation to), else the first one."""
    params = list(model.parameters())
    floats = [p for p in params if p.is_floating_point()]
    if floats:
        return max(floats, key=lambda p: torch.finfo(p.dtype).bits)
    return params[0] if params else None


def scalar_buffer(value: float, like: torch.Tensor | None) -> torch.Tensor:
    """A 0-d tensor holding ``value`` in the dtype/device of ``like`` (float32 CPU if None)."""
    dtype = like.dtype if like is not None and like.is_floating_point() else torch.float32
    device = like.device if like is not None else torch.device("cpu")
    return torch.tensor(float(value), dtype=dtype, device=device)


def replacement_pool(pc: PoolChange, like: torch.Tensor | None) -> nn.Module:
    """The module that replaces a max-pool: a strided conv (C->C) or an average pool."""
    g = pc.geometry
    d = g["dims"]
    if pc.action == "conv":
        cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[d]
        kw = {}
        if like is not None:
            kw = {"dtype": like.dtype if like.is_floating_point() else torch.float32,
                  "device": like.device}
        kind = getattr(pc, "conv", "full")
        c = g["channels"]
        mod = cls(c, c, tuple(g["kernel"]), stride=tuple(g["stride"]),
                  padding=tuple(g["padding"]), dilation=tuple(g["dilation"]), bias=True,
                  groups=c if kind == "depthwise" else 1, **kw)
        fmt = {2: torch.channels_last, 3: torch.channels_last_3d}.get(d)
        if fmt is not None and like is not None and like.dim() == d + 2 and \
                like.is_contiguous(memory_format=fmt) and not like.is_contiguous():
            mod = mod.to(memory_format=fmt)    # a channels_last model's memory format
        if kind == "avg":
            if mod.weight.device.type != "meta":
                with torch.no_grad():
                    mod.weight.copy_(avg_pool_weight(c, tuple(g["kernel"]), mod.weight.dtype))
                    mod.bias.zero_()
        return mod
    if pc.action == "avgpool":
        cls = {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d}[d]
        if any(x != 1 for x in g["dilation"]):
            raise PrecondError(f"{pc.node}: average pooling has no dilation; use maxpool='conv'")
        return cls(tuple(g["kernel"]), stride=tuple(g["stride"]), padding=tuple(g["padding"]),
                   ceil_mode=g["ceil_mode"])
    raise ValueError(pc.action)


#: module attributes that hold no references to modules (tensors, hooks) and are not searched
_NOT_SEARCHED = frozenset({"_parameters", "_buffers", "_non_persistent_buffers_set"})


def swap_references(root: nn.Module, old: nn.Module, new: nn.Module | None
                    ) -> list[tuple[Any, Any, Any]]:
    """Point every other reference to ``old`` held in ``root``'s module tree at ``new``.

    A module replaced at one path (a max-pool replaced by a strided convolution, or dropped
    for an ``Identity`` when its stride is folded into the convolution before it) may also be
    held elsewhere: registered under a second name (``self.body = nn.Sequential(self.conv,
    self.pool)``) or in a plain Python attribute, list, tuple or dict that the forward or the
    user's methods iterate (``self.stages = [self.conv, self.pool]``).  Left pointing at the
    old module, those calls would still run it next to the changed convolution (pooling
    twice).  Returns ``(container, key, previous)`` records (a module's ``__dict__``, a list
    or a dict) that undo the change in reverse order (``restore_references``).  ``new=None``
    changes nothing."""
    undo: list[tuple[Any, Any, Any]] = []
    if new is None or new is old:
        return undo

    def fix(value: Any, depth: int) -> tuple[Any, bool]:
        """(the value with ``old`` replaced, whether anything was) for an immutable value;
        mutable containers are changed in place (recorded in ``undo``)."""
        if value is old:
            return new, True
        if depth > 4 or isinstance(value, (nn.Module, torch.Tensor, str, bytes)):
            return value, False
        if isinstance(value, list):
            for i, v in enumerate(value):
                nv, hit = fix(v, depth + 1)
                if hit and nv is not v:
                    undo.append((value, i, v))
                    value[i] = nv
            return value, False
        if isinstance(value, dict):
            for k, v in list(value.items()):
                nv, hit = fix(v, depth + 1)
                if hit and nv is not v:
                    undo.append((value, k, v))
                    value[k] = nv
            return value, False
        if type(value) is tuple or (isinstance(value, tuple) and hasattr(value, "_fields")):
            items = [fix(v, depth + 1) for v in value]
            if any(hit for _, hit in items):
                vals = [v for v, _ in items]
                return (type(value)(*vals) if hasattr(value, "_fields") else tuple(vals)), True
        return value, False

    for m in list(root.modules()):
        d = m.__dict__
        for name in list(d):
            if name in _NOT_SEARCHED:
                continue
            value = d[name]
            nv, hit = fix(value, 0)
            if hit and nv is not value:
                undo.append((d, name, value))
                d[name] = nv
    return undo


def restore_references(undo: list[tuple[Any, Any, Any]]) -> None:
    """Undo ``swap_references`` (its records, newest first)."""
    for container, key, previous in reversed(undo):
        container[key] = previous


def avg_pool_weight(channels: int, kernel: tuple[int, ...],
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight of a C->C convolution that computes average pooling (``count_include_pad``:
    zero padding counts, as AvgPool's default): ``1/prod(kernel)`` on the diagonal of the
    channel dimensions, 0 elsewhere."""
    w = torch.zeros((channels, channels) + tuple(kernel), dtype=dtype)
    idx = torch.arange(channels)
    w[idx, idx] = 1.0 / float(torch.tensor(kernel).prod())
    return w


def scale_at_path(out: Any, path: list, scale: torch.Tensor) -> Any:
    """``out`` with the tensor at ``path`` multiplied by ``scale``, structure kept."""
    if not path:
        return out * scale
    k, rest = path[0], path[1:]
    if isinstance(out, torch.distributions.Distribution):
        return rebuild_distribution(out, k, scale_at_path(child(out, k), rest, scale))
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        lst = list(out)
        lst[k] = scale_at_path(lst[k], rest, scale)
        # a structseq (torch.return_types.topk, .max...) keeps its type
        return tuple(lst) if type(out) is tuple else type(out)(lst)
    if isinstance(out, tuple):  # namedtuple
        return out._replace(**{out._fields[k]: scale_at_path(out[k], rest, scale)})
    if isinstance(out, list):
        out = list(out)
        out[k] = scale_at_path(out[k], rest, scale)
        return out
    if is_dataclass_output(out) and not hasattr(out, "__getitem__"):
        new_out = copy.copy(out)    # a field replaced on a copy (frozen dataclasses too)
        object.__setattr__(new_out, k, scale_at_path(getattr(out, k), rest, scale))
        return new_out
    # dict or transformers ModelOutput (an OrderedDict subclass whose items mirror attributes)
    new = scale_at_path(out[k], rest, scale)
    if type(out) is dict:
        out = dict(out)
    out[k] = new
    return out


def times_first(out: Any, s: torch.Tensor) -> Any:
    """``out`` with its tensor (or a tuple's first tensor) multiplied by ``s``."""
    if isinstance(out, torch.Tensor):
        return out * s
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (out[0] * s,) + tuple(out[1:])
    return out


def scaled_operand(n: Any) -> fx.Node | None:
    """For a ``mul`` node by a precondfx constant (``x * precondfx_...``), its other operand
    ``x``; None for any other node.  Such a node is folded away itself, and a product commutes:
    a scale on ``x`` or on the product is the same scale."""
    if not isinstance(n, fx.Node) or n.op != "call_function" or \
            n.target not in (operator.mul, torch.mul) or len(n.args) != 2 or n.kwargs:
        return None
    a, b = n.args
    for c, x in ((b, a), (a, b)):
        if isinstance(c, fx.Node) and c.op == "get_attr" and str(c.target).startswith(PREFIX) \
                and isinstance(x, fx.Node):
            return x
    return None
