"""A cheap, unbiased estimate of every layer's Hessian-block statistic at once.

The paper's statistic for layer l is ``E_R E_r ||G_l r||^2 / numel_l`` with ``G_l = J_l^T R J_l``
(Sec. 3.1; ``J_l`` the Jacobian of the sample's output w.r.t. ``W_l``, ``R`` the symmetrized
Gaussian of the random quadratic loss).  With ``K_l = J_l J_l^T`` the expectation over R and r
is exact (see ``conditioning``'s ``ggn`` method):

    E ||G_l r||^2 = (tr(K_l)^2 + ||K_l||_F^2) / 2.

Both terms come from gradients of random *linear* losses ``v^T y``: for independent standard
normal cotangents ``v_a, v_b`` and ``g_a = J_l^T v_a`` (one backward pass gives ``g_a`` for
every layer at once), ``E[||g_a||^2 ||g_b||^2] = tr(K_l)^2`` and ``E[(g_a . g_b)^2] =
||K_l||_F^2``.  Averaging over the ``P(P-1)/2`` pairs of ``P`` cotangents gives an unbiased
estimate for all layers from 1 forward and ``P`` backward passes per sample, with no double
backward and no per-layer probe: what makes measured balancing affordable on large models
(``hvp`` costs ``L * n_probes`` Hessian-vector products per sample).  The value is the
Gauss-Newton block, equal to the Hessian diagonal block when the network above the layer is
piecewise linear (ReLU nets, the paper's setting); tests check it against explicit HVPs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from precondfx.errors import PrecondError
from precondfx.pytorch import reals
from precondfx.pytorch.measure.conditioning.estimates import mean_estimate
from precondfx.pytorch.measure.conditioning.inputs import (default_output_fn, measurement_state,
                                                           per_sample, run_sample)
from precondfx.pytorch.measure.conditioning.results import Estimate
from precondfx.pytorch.measure.persample import batched_sketch
from precondfx.pytorch.measure.ranks import agreed
from precondfx.pytorch.measure.runtime import one_thread
from precondfx.core.progress import Progress

__all__ = ["hessian_sketch", "SketchResult", "spread_of", "geometric_mean", "one_thread",
           "precise", "RTOL", "rtol_for"]


@dataclass
class SketchResult:
    """Per-parameter Hessian-block statistic estimates (mean, standard error over samples)."""

    values: dict[str, Estimate]
    n_samples: int
    n_cotangents: int
    mode: str
    engine: str = ""                  # "batched" or "per-sample loop (why)"
    per_sample: np.ndarray | None = None  # (n_samples, n_weights) values behind the means

    def means(self) -> dict[str, float]:
        return {k: v.mean for k, v in self.values.items()}

    def spread(self) -> float:
        m = [v for v in self.means().values() if v > 0]
        return max(m) / min(m) if m and len(m) == len(self.values) else float("inf")


def hessian_sketch(model: nn.Module, sample: Any, weights: Sequence[str], *, n_samples: int = 8,
                   n_cotangents: int = 4, seed: int = 0,
                   forward_kwargs: Mapping[str, Any] | None = None,
                   output_fn: Callable[[Any], torch.Tensor] | None = None,
                   verbose: bool | None = None, desc: str = "Hessian-block sketch",
                   batched: bool = True, first: int = 0,
                   stop: Callable[[np.ndarray], bool] | None = None,
                   ranks: Any = None) -> SketchResult:
    """Estimate ``E||G_l r||^2/numel`` for each named weight (see the module docstring).

    Cost per sample: 1 forward and ``n_cotangents`` backward passes, for all layers together.
    With ``batched`` (default) the samples run together (:mod:`precondfx.pytorch.measure.persample`:
    same cotangents, same estimator, one batched forward and P batched backward passes); models
    it cannot measure exactly fall back to one sample at a time (``engine`` says which ran).
    ``stop(values)``, called with the per-sample values after each sample (batched: each round
    of samples) from the ``first`` on, can end the measurement there (an estimate that already
    decides, or is already precise enough: :func:`precise`).
    Progress (ETA per sample) goes to stderr on a terminal unless ``verbose=False``
    (:mod:`precondfx.core.progress`).

    ``ranks`` (:class:`precondfx.pytorch.measure.ranks.Ranks`): ``sample`` is this rank's part
    of the samples of every rank; each rank measures the draws on the samples it holds, and
    the per-sample values are summed over the ranks after each round (batched) or sample
    (loop), so every rank returns the same values and stops at the same sample as one
    process measuring every rank's samples."""
    if n_cotangents < 2:
        raise PrecondError("n_cotangents must be at least 2 (the estimate uses pairs)")
    output_fn = output_fn or default_output_fn
    smp, batch = per_sample(sample, forward_kwargs)
    params = [model.get_parameter(w) for w in weights]
    gen = torch.Generator().manual_seed(int(seed))
    per = np.zeros((n_samples, len(params)))
    iu = [(a, b) for a in range(n_cotangents) for b in range(a + 1, n_cotangents)]
    note = ""
    if batched and smp.dim != 0:    # the batched engine stacks the samples along dim 0
        batched, note = False, (f"per-sample loop (inputs batched along dim {smp.dim}, "
                                f"sequence-first)")
    if ranks is not None:   # every rank must take the same engine: the collectives pair up
        batched = ranks.max([0.0 if batched else 1.0])[0] == 0.0
    total = ranks.total if ranks is not None else batch
    with measurement_state(model, params), torch.enable_grad(), one_thread(model), \
            Progress(n_samples, desc, verbose=verbose) as bar:
        if batched:
            state = gen.get_state()
            try:
                per = batched_sketch(model, smp, batch, params, list(weights), n_samples,
                                     n_cotangents, gen, output_fn, bar.step, first, stop,
                                     ranks=ranks)
            except Exception as e:  # noqa: BLE001 - the loop below is exact for any model
                note = f"per-sample loop ({type(e).__name__}: {str(e)[:120]})"
                gen.set_state(state)
                bar.restart()
            else:
                vals = {w: mean_estimate(per[:, j]) for j, w in enumerate(weights)}
                return SketchResult(vals, len(per), n_cotangents, "pairs", "batched", per)
        shape = None
        if ranks is not None:   # the draws of samples other ranks hold are skipped, not made
            with torch.no_grad():
                shape = run_sample(model, smp, 0, output_fn).shape
        for s in range(n_samples):
            i = s % total if ranks is None else ranks.local(s % total)
            def one(s: int = s, i: int | None = i) -> None:
                if i is None:       # a sample another rank holds: its directions are skipped
                    for _ in range(n_cotangents):
                        torch.randn(shape, generator=gen, dtype=torch.float32)
                else:
                    per[s] = _one(model, smp, i, params, n_cotangents, gen, output_fn, iu)
            if (err := agreed(ranks, one)) is not None:
                raise err
            if ranks is not None:
                per[s] = ranks.sum(per[s])
            bar.step()
            if stop is not None and first <= s + 1 < n_samples and stop(per[:s + 1]):
                per = per[:s + 1]
                break
    vals = {w: mean_estimate(per[:, j]) for j, w in enumerate(weights)}
    return SketchResult(vals, len(per), n_cotangents, "pairs", note or "per-sample loop", per)


def _one(model: nn.Module, smp: Any, i: int, params: Sequence[torch.Tensor],
         n_cotangents: int, gen: torch.Generator, output_fn: Callable[[Any], torch.Tensor],
         iu: list[tuple[int, int]]) -> np.ndarray:
    """The per-sample values of sample ``i`` (one forward, P backward passes)."""
    y = run_sample(model, smp, i, output_fn)
    grads: list[list[torch.Tensor]] = []
    for k in range(n_cotangents):
        v = torch.randn(y.shape, generator=gen, dtype=torch.float32).to(y.device, y.dtype)
        g = torch.autograd.grad(y, params, v, retain_graph=k < n_cotangents - 1,
                                allow_unused=True)
        grads.append([torch.zeros_like(p) if gi is None else gi.detach().to_dense()
                      if gi.layout != torch.strided else gi.detach()
                      for gi, p in zip(g, params)])   # sparse: Embedding(sparse=True)
    out = np.zeros(len(params))
    for j, p in enumerate(params):
        flat = [_real(grads[k][j]).double().flatten() for k in range(n_cotangents)]
        sq = [float(f @ f) for f in flat]
        acc = sum(sq[a] * sq[b] + float(flat[a] @ flat[b]) ** 2 for a, b in iu)
        out[j] = acc / len(iu) / (2 * flat[0].numel())
    return out


#: a complex parameter's gradient (d/dRe + i d/dIm) is the gradient over its real and
#: imaginary parts, each a real parameter
_real = reals.real_view


def rtol_for(threshold: float) -> float:
    """The precision at which measured balancing stops: every layer's statistic within +-r of
    its mean (95% interval) with ``(1 + r) / (1 - r) = threshold``.  Balancing divides each
    layer's statistic by its estimate, so two layers' errors could leave them at most
    ``(1 + r) / (1 - r)`` apart: no further than the spread ``balance='auto'`` acts on.  It
    also bounds every alpha (``~ statistic^(-1/4)``) to about ``+-r/4``."""
    return max((threshold - 1.0) / (threshold + 1.0), 0.0)


#: the precision at the default threshold (2x): +-1/3, alphas to about +-8%
RTOL = rtol_for(2.0)


def precise(per: np.ndarray, rtol: float = RTOL) -> bool:
    """Whether every column's mean (per-sample values, samples x weights) is known to ``rtol``:
    the half-width of its 95% t interval is at most ``rtol`` times the mean (at least 2 rows;
    a column with a mean that is not positive is never precise)."""
    if per.ndim != 2 or per.shape[0] < 2:
        return False
    for j in range(per.shape[1]):
        e = mean_estimate(per[:, j])
        if not (e.mean > 0 and math.isfinite(e.ci_high) and
                (e.ci_high - e.ci_low) / 2 <= rtol * e.mean):
            return False
    return True


def spread_of(values: Mapping[str, float]) -> float:
    """max/min over positive values (inf when any value is zero)."""
    v = list(values.values())
    if not v or min(v) <= 0:
        return float("inf")
    return max(v) / min(v)


def geometric_mean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))
