"""Measured balancing: set each layer's alpha so that a measured statistic matches across layers.

``y = alpha * W' x`` with ``W' = W / alpha`` computes the same function for any alpha, while the
Hessian block of ``W'`` scales by ``alpha^2`` and its statistic ``E[(G r)^2]`` by ``alpha^4``,
leaving every other layer's unchanged (Sec. 5).  So one measurement suffices: with ``h_l`` the
statistic of layer l and ``t`` their geometric mean, multiplying alpha_l by ``(t/h_l)^(1/4)``
and dividing W'_l by the same factor makes every layer's statistic ``t`` on the measured
samples, without changing the network's output.  Balancing uses the first half of the
calibration batch; the other half (with fresh random cotangents) gives the held-out figure the
report shows.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from precondfx.capture.common import Sample, main_output
from precondfx.errors import PrecondError
from precondfx.measure.sketch import geometric_mean, hessian_sketch, spread_of

STATISTICS = {
    "hessian": "E[(G_l r)^2]/numel: Gauss-Newton (= Hessian for ReLU nets) diagonal block, random "
               "quadratic loss, batch size 1 (Sec. 3.1)",
}
from precondfx.plan import Plan


def _split(s: Sample) -> tuple[Sample, Sample | None, int]:
    """First and second half of the batch (only the inputs that carry the batch dimension are
    cut; see :meth:`Sample.take`)."""
    b = s.batch_size()
    if b < 2:
        return s, None, b
    h = (b + 1) // 2
    return s.take(0, h), s.take(h, b), b


def _measure(model: nn.Module, s: Sample, weights: list[str], n_samples: int, n_cot: int,
             seed: int, output_key: Any, mode: str, stat: str = "hessian"
             ) -> tuple[dict[str, float], dict[str, float], str]:
    fn = (lambda out: main_output(out, output_key))

    def sketch(data: Any) -> Any:
        return hessian_sketch(model, data, weights, n_samples=n_samples, n_cotangents=n_cot,
                              seed=seed, output_fn=fn)
    from precondfx.calibrate import preserved
    note = ""
    with preserved(model):  # every module's own mode back afterwards, not one flag for all
        model.train(mode == "train")
        try:
            res = sketch(s)
        except (RuntimeError, ValueError) as e:
            if mode != "train":
                raise
            model.train(False)
            note = (f"per-sample (batch size 1) passes failed in train mode ({str(e)[:80]}); "
                    f"measured in eval mode")
            res = sketch(s)
    return res.means(), {k: v.stderr for k, v in res.values.items()}, note


def measured_statistics(model: nn.Module, sample: Sample, weights: list[str], *,
                        stat: str = "hessian", n_samples: int = 16, n_cotangents: int = 4,
                        seed: int = 0, output_key: Any = None, mode: str = "train"
                        ) -> dict[str, Any]:
    """A statistic per weight on the held-out half of the batch (for reports)."""
    _, held, _ = _split(sample)
    means, se, note = _measure(model, held or sample, weights, n_samples, n_cotangents,
                               seed + 1000, output_key, mode, stat)
    return {"values": means, "stderr": se, "spread": spread_of(means), "note": note}


def _output(model: nn.Module, s: Sample, output_key: Any, mode: str) -> torch.Tensor:
    """The main output in full float32 precision (TF32 off: its 10-bit rounding would hide
    whether a rescaling kept the function)."""
    from precondfx.calibrate import forward
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        return main_output(forward(model, s, mode), output_key).detach().double()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


@torch.no_grad()
def _rescale(model: nn.Module, weight: str, buffers: list[str], c: float) -> None:
    for b in buffers:
        model.get_buffer(b).mul_(c)
    model.get_parameter(weight).div_(c)


def balance_measured(model: nn.Module, sample: Sample, plan: Plan,
                     alpha_buffers: dict[str, list[str]], *, stat: str = "hessian",
                     n_samples: int = 16, n_cotangents: int = 4, seed: int = 0,
                     output_key: Any = None, mode: str = "train", balance: str = "hessian",
                     threshold: float = 2.0, log: Callable[[str], None] = lambda m: None
                     ) -> dict[str, Any]:
    """Balance a measured statistic (``STATISTICS``) of every weight that has alpha buffers
    (it scales exactly as alpha^4).  ``balance='hessian'`` always balances (and raises if it
    cannot); with ``balance='auto'`` the alphas are only changed when the measured spread is
    significantly above ``threshold`` (lower bound at 2 standard errors): below, the estimate's
    own noise is comparable to the imbalance it would correct.
    On the paper's MLP the per-sample statistic is heavy-tailed, and balancing 16 samples
    without this test moved one seed's held-out weight-to-gradient spread from 1.1x to 2.2x.

    Returns the report section: statistics before/after on the balancing samples and on the
    held-out half, their spreads, and the factor applied to each alpha."""
    if balance not in ("auto", "hessian"):
        raise PrecondError(f"balance={balance!r}: measured balancing is 'auto' or 'hessian'")
    gated = balance == "auto"
    weights = [w for w, bufs in alpha_buffers.items() if bufs]
    if len(weights) < 2:
        return {"note": "fewer than two layers carry an alpha: nothing to balance"}
    fit, held, b = _split(sample)
    n_fit = n_samples
    log(f"measuring the {stat} statistic of {len(weights)} layers on {n_fit} samples")
    before, before_se, note = _measure(model, fit, weights, n_fit, n_cotangents, seed,
                                       output_key, mode, stat)
    bad = [w for w, v in before.items() if not (v > 0 and math.isfinite(v))]
    if bad:
        raise PrecondError(f"the {stat} statistic of {bad[:3]} is zero or not finite (the output "
                           f"does not depend on these weights on the calibration batch); use "
                           f"balance='analytic'")
    low = significant_spread(before, before_se)
    if gated and low <= threshold:
        return {"statistic": STATISTICS[stat], "samples": n_fit, "before": before,
                "spread_before": spread_of(before), "spread_lower_bound": low,
                "applied": False, "note": note,
                "decision": f"measured spread {spread_of(before):.3g}x (lower bound {low:.3g}x "
                            f"at 2 standard errors) <= threshold {threshold:g}x: alphas left as "
                            f"planned"}
    target = geometric_mean(list(before.values()))
    factors = {w: (target / v) ** 0.25 for w, v in before.items()}
    y0 = _output(model, fit, output_key, mode)
    saved = {w: (model.get_parameter(w).detach().clone(),
                 [model.get_buffer(b).detach().clone() for b in alpha_buffers[w]])
             for w in factors}
    for w, c in factors.items():
        _rescale(model, w, alpha_buffers[w], c)
    y1 = _output(model, fit, output_key, mode)
    change = float((y1 - y0).abs().max() / y0.abs().max().clamp_min(1e-30))
    if not change < 1e-3:  # reparametrization must not change the function: check, undo
        with torch.no_grad():
            for w, (wt, bufs) in saved.items():
                model.get_parameter(w).copy_(wt)
                for b, v in zip(alpha_buffers[w], bufs):
                    model.get_buffer(b).copy_(v)
        msg = (f"rescaling changed the output by {change:.2g} (relative): the statistics span "
               f"{spread_of(before):.3g}x, beyond what the dtype represents; alphas left as "
               f"planned")
        if not gated:
            raise PrecondError(f"measured balancing failed: {msg}")
        return {"statistic": STATISTICS[stat], "samples": n_fit, "before": before,
                "spread_before": spread_of(before), "applied": False, "note": note,
                "decision": msg}
    _update_plan(plan, factors)
    after = {w: v * factors[w] ** 4 for w, v in before.items()}  # exact: stat scales alpha^4
    return {
        "statistic": STATISTICS[stat], "samples": n_fit, "cotangents": n_cotangents, "batch": b,
        "before": before, "spread_before": spread_of(before), "after_fit": after,
        "factors": factors, "note": note, "applied": True,
        "held_out": "not measured here: precondition(..., measure=True) measures the rewritten "
                    "model on the held-out half of the batch",
    }


def significant_spread(means: dict[str, float], se: dict[str, float], z: float = 2.0) -> float:
    """A lower bound on the spread max/min: the largest value minus z standard errors over the
    smallest plus z standard errors (1 when the intervals overlap)."""
    lo = {k: max(m - z * se.get(k, 0.0), 1e-300) for k, m in means.items()}
    hi = {k: m + z * se.get(k, 0.0) for k, m in means.items()}
    return max(1.0, max(lo.values()) / min(hi.values()))


def _update_plan(plan: Plan, factors: dict[str, float]) -> None:
    """Keep the plan equal to what the model now holds (alphas up, weight stds down)."""
    for lay in plan.layers:
        c = factors.get(lay.weight or "")
        if c is not None:
            lay.alpha *= c
            lay.alpha_reason = (lay.alpha_reason + "; " if lay.alpha_reason else "") + \
                f"measured balancing x{c:.4g}"
    node_w = {lay.node: lay.weight for lay in plan.layers}
    for sc in plan.scales:
        if sc.tag == "alpha" and node_w.get(sc.node) in factors:
            sc.value *= factors[node_w[sc.node]]
    for w, c in factors.items():
        pi = plan.inits.get(w)
        if pi is not None and pi.std is not None:
            pi.std = pi.std / c
