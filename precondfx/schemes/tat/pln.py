"""Per-location normalization (spec §2.10): TAT/DKS assume q = mean(x^2 over channels) = 1 at every
input location (spec §2.1). The preprocessing function users apply to their data, and the
``input_norm='pln'`` module the scheme step inserts (no homogeneous coordinate)."""

from __future__ import annotations

import torch
from torch import nn

from precondfx.core.scheme import SchemeContext
from precondfx.errors import PrecondError
from precondfx.pytorch.modules import PerLocationNorm



def per_location_normalization(
    x: torch.Tensor,
    homog_mode: str = "one",
    homog_scale: float = 1.0,
    has_batch_dim: bool = True,
    channel_dim: int = -1,
) -> torch.Tensor:
    """Per-Location Normalization: make mean(x^2) over the feature axis 1 everywhere (spec §2.10).

    Optionally first appends a homogeneous coordinate to the feature axis: ``"one"`` (a constant
    ``homog_scale``), ``"avg_q"`` (sqrt of mean x^2 over all non-batch axes, times
    ``homog_scale``; needs at least one location axis) or ``"off"``. Features are on the last
    axis as in the reference; pass ``channel_dim=1`` for NCHW. TAT/DKS assume input q = 1 at
    every location (spec §2.1); this guarantees it.
    """
    if homog_mode not in ("one", "avg_q", "off"):
        raise PrecondError(f"Unknown homog_mode {homog_mode!r} (use 'one', 'avg_q' or 'off').")
    if x.dim() == 0 and has_batch_dim:
        raise PrecondError("x has no batch dimension (it is a scalar) but has_batch_dim=True.")
    moved = False
    if x.dim() > 0 and channel_dim not in (-1, x.dim() - 1):
        x = torch.movedim(x, channel_dim, -1)
        moved = True
    nd = x.dim()
    if homog_mode == "avg_q" and ((nd <= 2 and has_batch_dim) or (nd <= 1 and not has_batch_dim)):
        raise PrecondError("homog_mode='avg_q' needs at least one location axis besides the batch and feature axes.")
    if (nd == 1 and has_batch_dim) or (nd == 0 and not has_batch_dim):
        x = x.unsqueeze(-1)
    if homog_mode == "avg_q":
        dims = list(range(1 if has_batch_dim else 0, x.dim()))
        homog = torch.sqrt(torch.mean(x * x, dim=dims, keepdim=True)).expand(*x.shape[:-1], 1)
    elif homog_mode == "one":
        homog = torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)
    else:
        homog = None
    if homog is not None:
        x = torch.cat([x, homog_scale * homog], dim=-1)
    x = x / torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True))
    if moved:
        x = torch.movedim(x, -1, channel_dim)
    return x


def per_location_normalize(x: torch.Tensor, homog_mode: str = "one", homog_scale: float = 1.0,
                           channel_dim: int | None = None) -> torch.Tensor:
    """Per-Location Normalization of a batch (spec §2.10): a preprocessing step for TAT/DKS.

    Appends a homogeneous coordinate (``homog_mode='one'``: a constant channel, ``'avg_q'``:
    the sample's RMS, ``'off'``: none) and divides every location by its RMS over channels, so
    that q = 1 everywhere and all-zero locations (blank pixels) are not left at zero.  With a
    homogeneous coordinate the channel count grows by one: build the model for it.  The channel
    axis defaults to 1 for (N, C, ...) batches with spatial axes and -1 for (N, features)."""
    if channel_dim is None:
        channel_dim = 1 if x.dim() >= 3 else -1
    return per_location_normalization(x, homog_mode, homog_scale, True, channel_dim)


def insert_pln(ctx: SchemeContext, cdim: int) -> None:
    """PerLocationNorm on the input, through the back end (``Backend.input_module``)."""
    if not ctx.applier.input_module("precondfx_pln", PerLocationNorm(cdim)):
        raise PrecondError("input_norm='pln' needs a PyTorch back end: use input_norm='scale'")


def _pln_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """The input hook of models preconditioned by earlier versions (kept so they unpickle)."""
    pln = module.precondfx_pln
    args = tuple(pln(a) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)
    return args, kwargs
