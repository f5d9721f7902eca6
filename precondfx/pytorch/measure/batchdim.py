"""Which dimension of the inputs holds the batch: dim 0, or dim 1 for sequence-first models.

``nn.LSTM`` (default ``batch_first=False``) and ``nn.Transformer(batch_first=False)`` take
``(T, B, ...)`` inputs.  Per-sample measurements that slice dim 0 would then measure single
time steps of the whole batch: a different input, silently.  The shapes cannot tell (``(T, B,
F)`` and ``(B, T, F)`` look alike), so the model does: a dimension is the batch dimension when
one sample's slice, run alone, gives the same output as that sample's slice of the whole
batch's output.  Samples are independent along the batch dimension; along time they are not
(attention, recurrence), and checking the first and the last slice catches causal models,
whose first time step alone does match.  Runs in eval mode, without dropout, so BatchNorm's
batch statistics do not mix the samples.  Only models holding a module built for sequence-first
tensors (``batch_first=False``) are checked; others keep dim 0 at no cost, and
``precondfx.Sample(..., batch_dim=1)`` says it for any model.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from precondfx.pytorch.capture.common import Sample, batch_layout
from precondfx.errors import PrecondError

#: relative difference under which a slice's output is the batch output's slice
RTOL = 1e-4


def _same(part: torch.Tensor, whole: torch.Tensor, i: int, b: int) -> bool:
    """Whether ``part`` is slice ``i`` of ``whole`` along some dimension of size ``b``."""
    for e in range(whole.dim()):
        if whole.shape[e] != b or part.dim() != whole.dim() or part.shape[e] != 1:
            continue
        ref = whole.narrow(e, i, 1)
        if ref.shape != part.shape:
            continue
        scale = float(ref.detach().double().abs().max().clamp_min(1e-30))
        if float((part.detach().double() - ref.detach().double()).abs().max()) <= RTOL * scale:
            return True
    return False


def _independent(run: Callable[[Sample], torch.Tensor], s: Sample, whole: torch.Tensor) -> bool:
    """Whether the first and the last sample along ``s.dim``, run alone, give their slices of
    the whole batch's output."""
    try:
        b, _ = batch_layout(s)
    except PrecondError:
        return False
    if b < 2:
        return False
    for i in (0, b - 1):
        try:
            part = run(s.take(i))
        except Exception:  # noqa: BLE001 - a slice the model cannot run: not this dimension
            return False
        if not _same(part, whole, i, b):
            return False
    return True


def sequence_first_modules(model: nn.Module) -> list[str]:
    """Modules built for ``(T, B, ...)`` tensors: ``batch_first=False`` on an RNN/LSTM/GRU,
    ``nn.MultiheadAttention`` or an ``nn.Transformer`` layer (their default)."""
    return [n for n, m in model.named_modules() if getattr(m, "batch_first", None) is False]


def resolve(model: nn.Module, s: Sample, output_fn: Callable[[Any], torch.Tensor]
            ) -> tuple[Sample, str]:
    """``s`` with its batch dimension set, and a note when it is not dim 0.

    Kept as given when the user said (``batch_dim`` or ``batched`` set), when no module of the
    model takes sequence-first tensors (:func:`sequence_first_modules`: the check costs three
    to five forwards, which other models do not pay), when dim 0 behaves as a batch dimension,
    or when dim 1 does not either (a model that mixes its samples: the measurement says so
    itself)."""
    if s.batch_dim is not None or s.batched is not None or not sequence_first_modules(model):
        return s, ""
    from precondfx.pytorch.calibrate import forward

    def run(x: Sample) -> torch.Tensor:
        return output_fn(forward(model, x, "eval"))
    whole = run(s)
    if _independent(run, s, whole):
        return s, ""
    s1 = dataclasses.replace(s, batch_dim=1)
    if not _independent(run, s1, whole):
        return s, ""
    b, _ = batch_layout(s1)
    return s1, (f"the inputs are sequence-first: samples are independent along dim 1 (batch "
                f"{b}), not dim 0, so per-sample measurements slice dim 1 (pass "
                f"precondfx.Sample(args, kwargs, batch_dim=0) to override)")
