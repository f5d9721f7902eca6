"""From the per-sample records to estimates: means with Student-t intervals, ratios of means
(the GR formula of Eq. 1) with bootstrap intervals, and the block matrix."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from precondfx.pytorch import reals
from precondfx.pytorch.measure.conditioning.records import _Blocks, _Capture, _Records
from precondfx.pytorch.measure.conditioning.results import (BlockMatrix, Estimate,
                                                            LayerConditioning, LayerRef)

_BOOTSTRAP = 2000
# two-sided 95% Student t quantiles, df = 1..30
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (a table, then the
    large-df approximation): the half-width factor of a 95% interval."""
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df


def mean_estimate(values: np.ndarray, scale: float = 1.0) -> Estimate:
    """The mean of per-sample ``values`` (times ``scale``) with its standard error and 95%
    t-interval."""
    v = np.asarray(values, dtype=float) * scale
    n = v.size
    mean = float(v.mean())
    if n < 2:
        return Estimate(mean, float("nan"), float("nan"), float("nan"), n)
    se = float(v.std(ddof=1) / math.sqrt(n))
    t = t975(n - 1)
    return Estimate(mean, se, mean - t * se, mean + t * se, n)


def _ratio_estimate(fn: Callable[[np.ndarray], np.ndarray], cols: np.ndarray,
                    rng: np.random.Generator) -> Estimate:
    """Plug-in estimate ``fn(column means)`` with a bootstrap SE and percentile interval."""
    n = cols.shape[0]
    mean = float(fn(cols.mean(axis=0, keepdims=True))[0])
    if n < 2:
        return Estimate(mean, float("nan"), float("nan"), float("nan"), n, "bootstrap")
    idx = rng.integers(0, n, size=(_BOOTSTRAP, n))
    boot = fn(cols[idx].mean(axis=1))
    boot = boot[np.isfinite(boot)]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return Estimate(mean, float(boot.std(ddof=1)), float(lo), float(hi), n, "bootstrap")




def _layer_result(r: LayerRef, w: torch.Tensor, c: "_Capture", rec: _Records, l: int,
                  stats: tuple[str, ...], rng: np.random.Generator) -> LayerConditioning:
    """Layer ``l``'s estimates from the per-sample records."""
    w2 = reals.mean_square(w)      # a complex weight: per real coordinate
    lc = LayerConditioning(name=r.name, weight=r.weight, bias=r.bias, module=r.module,
                           module_type=c.kind, numel=w.numel(), weight_sq=w2, alpha=r.alpha)
    notes_l = []
    if "hessian" in stats:
        lc.hessian = mean_estimate(rec.blk[:, l, l])
    if "ratio" in stats:
        lc.grad_sq = mean_estimate(rec.grad_sq[:, l])
        lc.ratio = mean_estimate(rec.grad_sq[:, l], 1.0 / w2) if w2 > 0 else None
        if w2 == 0:
            notes_l.append("weights are all zero: ratio undefined")
    captured = np.all(np.isfinite(rec.y2[:, l])) and np.all(np.isfinite(rec.x2[:, l]))
    if ("gr" in stats or "ratio" in stats) and captured:
        lc.x_sq = mean_estimate(rec.x2[:, l])
        lc.y_sq = mean_estimate(rec.y2[:, l])
        lc.dy_sq = mean_estimate(rec.dy2[:, l])
    if "gr" in stats:
        if not c.supported:
            notes_l.append(c.note)
        elif not captured:
            notes_l.append("the layer's module was not called in the forward pass; gr not computed")
        else:
            _gr_estimates(lc, r, c, rec, l, rng)
    lc.note = "; ".join(n for n in notes_l if n)
    return lc


def _gr_estimates(lc: LayerConditioning, r: LayerRef, c: "_Capture", rec: _Records, l: int,
                  rng: np.random.Generator) -> None:
    """The GR scaling of Eq. 1 (and of the bias) as ratios of means, bootstrapped."""
    n_in, k2 = c.geometry()
    lc.n_in, lc.k2 = n_in, k2
    lc.rho2 = float(rec.rho2[:, l].mean())
    lc.rho2_bias = float(rec.rho2b[:, l].mean())
    a4 = r.alpha ** 4
    cols = np.stack([rec.x2[:, l], rec.y2[:, l], rec.dy2[:, l], rec.rho2[:, l],
                     rec.rho2b[:, l]], axis=1)

    def gamma(m: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return a4 * n_in * k2 * m[:, 3] * m[:, 0] ** 2 * m[:, 2] / m[:, 1]

    def gamma_b(m: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return m[:, 4] * m[:, 2] / m[:, 1]

    lc.gr = _ratio_estimate(gamma, cols, rng)
    if r.bias is not None:
        lc.gr_bias = _ratio_estimate(gamma_b, cols, rng)


def _block_matrix(rec: _Records, blocks: _Blocks, results: list[LayerConditioning],
                  method: str) -> BlockMatrix:
    """Means and standard errors over samples of the block matrix; bias blocks' diagonal goes
    to their layer's ``hessian_bias``."""
    n = rec.blk.shape[0]
    mean = rec.blk.mean(axis=0)
    se = rec.blk.std(axis=0, ddof=1) / math.sqrt(n) if n > 1 else np.full_like(mean, np.nan)
    for b, (l, kind) in enumerate(blocks.layer):
        if kind == "bias":
            results[l].hessian_bias = mean_estimate(rec.blk[:, b, b])
    return BlockMatrix(blocks.names, mean, se, "ggn" if method == "ggn" else "hessian")

