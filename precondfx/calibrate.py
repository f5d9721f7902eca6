"""Calibration runs: measure the model on the calibration batch without side effects.

The output scale is fixed in the mode training will use (Sec. 6.4; DESIGN.md): train mode by
default, where normalization layers use batch statistics.  Dropout is switched off so the scale
is deterministic, and every buffer (BatchNorm running statistics, counters) is restored after
the run, so a calibration forward leaves no trace.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from precondfx.capture.common import Sample, main_output
from precondfx.errors import PrecondError

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
            nn.FeatureAlphaDropout)


_STOCHASTIC_NAMES = ("Dropout", "DropPath", "StochasticDepth", "DropBlock")


def is_stochastic(m: nn.Module) -> bool:
    """Dropout and its relatives (timm's DropPath, torchvision's StochasticDepth, DropBlock):
    random in train mode, identity in eval mode."""
    return isinstance(m, _DROPOUT) or any(k in type(m).__name__ for k in _STOCHASTIC_NAMES)


_DROPOUT_FNS = {f for f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                            F.feature_alpha_dropout, torch.dropout, torch.Tensor.dropout
                            if hasattr(torch.Tensor, "dropout") else F.dropout)}


class NoDropout(TorchFunctionMode):
    """Turns functional dropout into the identity (transformers call F.dropout with
    ``training=self.training``, which module-level ``eval()`` of Dropout layers cannot reach)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _DROPOUT_FNS:
            return args[0] if args else kwargs["input"]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def preserved(model: nn.Module) -> Iterator[None]:
    """Restore every module's train/eval flag and every buffer (BatchNorm running statistics,
    counters) on exit, whatever runs inside."""
    modes = {m: m.training for m in model.modules()}
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        yield
    finally:
        for m, t in modes.items():
            m.training = t
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in saved and saved[name].shape == b.shape:
                    b.copy_(saved[name])


@contextlib.contextmanager
def quiet_run(model: nn.Module, mode: str = "train") -> Iterator[None]:
    """Run in ``mode`` ('train' or 'eval') with dropout off; restore modes and buffers after."""
    if mode not in ("train", "eval"):
        raise PrecondError(f"calibration mode must be 'train' or 'eval', got {mode!r}")
    with preserved(model):
        model.train(mode == "train")
        for m in model.modules():
            if is_stochastic(m):
                m.eval()
        yield


def forward(model: nn.Module, sample: Sample, mode: str = "train") -> object:
    """One side-effect-free forward pass (no grad), with a clear error if the model raises."""
    with quiet_run(model, mode), torch.no_grad(), NoDropout():
        try:
            return sample.call(model)
        except PrecondError:
            raise
        except Exception as e:  # the user's model raised: say so, keep the cause
            shapes = [tuple(t.shape) for t in sample.tensors()]
            if "more than 1 value per channel" in str(e):
                raise PrecondError(
                    f"the model's normalization layer needs more than one sample per channel in "
                    f"train mode, and the calibration batch has shapes {shapes}: pass a batch of "
                    f"at least two samples, or calibration='eval'") from e
            raise PrecondError(
                f"the model raised {type(e).__name__} when called with the sample (tensor shapes "
                f"{shapes}): {e}. Check that the sample is what the model's forward expects "
                f"(a tensor, a tuple of positional inputs or a dict of keyword inputs)") from e


def output_std(out: object, key: str | int | None = None) -> float:
    """Population std (correction 0) over all elements of the main output, in float64."""
    t = main_output(out, key).detach()
    if t.numel() < 2:
        raise PrecondError(f"the main output has {t.numel()} element(s): its std is undefined; "
                           f"use a calibration batch with more samples or pass target_std=None")
    return float(t.to(torch.float64).std(correction=0))


def check_finite_sample(sample: Sample) -> None:
    """Refuse empty batches and NaN/inf in floating-point inputs."""
    ts = sample.tensors()
    if not ts:
        raise PrecondError("the sample contains no tensor: pass the batch the model is called "
                           "with (a tensor, a tuple of positional inputs or a dict of keyword "
                           "inputs)")
    for t in ts:
        if t.numel() == 0:
            raise PrecondError(f"the sample has an empty tensor of shape {tuple(t.shape)}: pass "
                               f"a batch with at least one example (several are better for "
                               f"calibration)")
        if t.is_floating_point() and t.device.type != "meta" and \
                not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise PrecondError(f"the sample has {bad} NaN/inf value(s) in a tensor of shape "
                               f"{tuple(t.shape)}: clean the calibration batch first")


def solve_output_scale(std: float, target: float) -> float:
    """The scalar that brings the output std to ``target``, with a clear error for std 0."""
    if not math.isfinite(std):
        raise PrecondError("the model's output on the calibration batch has NaN/inf values "
                           "after re-initialization; check the model for numerical issues")
    if std <= 1e-30:
        raise PrecondError("the model's output has zero variance on the calibration batch, so no "
                           "output scale can reach the target std; use a batch of varied inputs, "
                           "or pass target_std=None")
    return target / std
