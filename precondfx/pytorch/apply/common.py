"""Pieces both PyTorch back ends use: buffer names, replacement pool modules, output paths."""
from __future__ import annotations

import copy
import re
from typing import Any

import torch
from torch import nn

from precondfx.pytorch.capture.common import is_dataclass_output
from precondfx.pytorch.capture.common import output_path  # noqa: F401  (the one rule, re-exported)
from precondfx.errors import PrecondError
from precondfx.core.backend import PREFIX
from precondfx.core.plan import PoolChange


def buffer_name(tag: str, node: str, index: int | None = None) -> str:
    """A valid, unique-per-site attribute name for a scale constant."""
    base = re.sub(r"[^0-9a-zA-Z_]", "_", node)
    return f"{PREFIX}{tag}_{base}" + (f"_{index}" if index is not None else "")


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
