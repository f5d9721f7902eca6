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

import numpy as np
import torch
from torch import nn

from precondfx.pytorch import calibrate as cal
from precondfx.pytorch.apply import shards
from precondfx.pytorch.capture.common import MainPath, Sample, main_output, main_path_of
from precondfx.errors import PrecondError
from precondfx.core.graph import Graph
from precondfx.pytorch.measure import batchdim
from precondfx.pytorch.measure.conditioning.estimates import mean_estimate
from precondfx.pytorch.measure.ranks import Ranks, for_group
from precondfx.pytorch.measure.sketch import geometric_mean, hessian_sketch, precise, rtol_for, spread_of
from precondfx.core.measured import Measured
from precondfx.core.options import DEFAULTS as D
from precondfx.core.plan import Plan

STATISTICS = {
    "hessian": "E[(G_l r)^2]/numel: Gauss-Newton (= Hessian for ReLU nets) diagonal block, random "
               "quadratic loss, batch size 1 (Sec. 3.1)",
}


def _split(s: Sample) -> tuple[Sample, Sample | None, int]:
    """First and second half of the batch (only the inputs that carry the batch dimension are
    cut; see :meth:`Sample.take`)."""
    b = s.batch_size()
    if b < 2:
        return s, None, b
    h = (b + 1) // 2
    return s.take(0, h), s.take(h, b), b


def _measure(model: nn.Module, s: Sample, weights: list[str], n_samples: int, n_cot: int,
             seed: int, output_key: Any, mode: str, stat: str = "hessian",
             verbose: bool | None = None, desc: str = "measured balancing"
             ) -> tuple[dict[str, float], dict[str, float], str]:
    per, _, note = _measure_per(model, s, weights, n_samples, n_cot, seed, output_key, mode,
                                verbose, desc)
    means, se = _estimates(per, weights)
    return means, se, note


def _differentiable_output(output_key: Any) -> Callable[[Any], torch.Tensor]:
    """The main output measuring differentiates (refused where it has no gradient)."""
    def fn(out: Any) -> torch.Tensor:
        y = main_output(out, output_key)
        cal.check_differentiable(y, "measured balancing", "pass balance='analytic' or 'none'")
        return y
    return fn


def _measure_per(model: nn.Module, s: Sample, weights: list[str], n_samples: int, n_cot: int,
                 seed: int, output_key: Any, mode: str, verbose: bool | None = None,
                 desc: str = "measured balancing", first: int = 0,
                 stop: Callable[[np.ndarray], bool] | None = None, ranks: Ranks | None = None
                 ) -> tuple[np.ndarray, str, str]:
    """Per-sample statistics (samples measured x weights), the engine that ran, and a note.
    With ``ranks``, those of every rank's samples, the same on every rank (the parameters of a
    sharded model gathered whole meanwhile: :func:`~precondfx.pytorch.apply.shards.gathered`)."""
    fn = _differentiable_output(output_key)

    def sketch(data: Any) -> Any:
        with shards.gathered(model):
            return hessian_sketch(model, data, weights, n_samples=n_samples,
                                  n_cotangents=n_cot, seed=seed, output_fn=fn,
                                  verbose=verbose, desc=desc, first=first, stop=stop,
                                  ranks=ranks)
    from precondfx.pytorch.calibrate import preserved, set_mode
    note = ""
    with preserved(model):  # every module's own mode back afterwards, not one flag for all
        set_mode(model, mode)  # measured in the mode calibration uses
        try:
            res = sketch(s)
        except (RuntimeError, ValueError) as e:
            if mode != "train":
                raise
            model.train(False)
            note = (f"per-sample (batch size 1) passes failed in train mode ({str(e)[:80]}); "
                    f"measured in eval mode")
            res = sketch(s)
    return res.per_sample, res.engine, note


def _estimates(per: np.ndarray, weights: list[str]) -> tuple[dict[str, float], dict[str, float]]:
    """Means and standard errors over samples of per-sample values."""
    est = {w: mean_estimate(per[:, j]) for j, w in enumerate(weights)}
    return {w: e.mean for w, e in est.items()}, {w: e.stderr for w, e in est.items()}


def measured_statistics(model: nn.Module, sample: Sample, weights: list[str], *,
                        stat: str = "hessian", n_samples: int = 16, n_cotangents: int = 4,
                        seed: int = 0, output_key: Any = None, mode: str = "train",
                        verbose: bool | None = None, desc: str = "held-out statistics"
                        ) -> dict[str, Any]:
    """A statistic per weight on the held-out half of the batch (for reports); a batch of one
    has no held-out half: then it is measured on that sample (``held_out`` False)."""
    _, held, _ = _split(sample)
    means, se, note = _measure(model, held or sample, weights, n_samples, n_cotangents,
                               seed + 1000, output_key, mode, stat, verbose=verbose, desc=desc)
    return {"values": means, "stderr": se, "spread": spread_of(means), "note": note,
            "held_out": held is not None}


def _output(model: nn.Module, s: Sample, output_key: Any, mode: str) -> torch.Tensor:
    """The main output in full float32 precision (TF32 off: its 10-bit rounding would hide
    whether a rescaling kept the function)."""
    from precondfx.pytorch.calibrate import forward
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


def balanceable(alpha_buffers: dict[str, list[str]], plan: Plan, graph: Graph | None = None
                ) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Split the plan's weighted layers into those measured balancing can rescale (every call
    site carries an alpha buffer, or one buffer serves them all) and the others, with why.
    A weight that ``graph`` shows read outside its layers' calls (``F.linear(h, w.t())`` on a
    module's weight, a norm of it computed in forward) is left out: dividing it by the factor
    would change those other uses, so rescaling would not keep the function."""
    sites: dict[str, int] = {}
    nodes: dict[str, set[str]] = {}
    for lay in plan.layers:
        if lay.weight:
            sites[lay.weight] = sites.get(lay.weight, 0) + 1
            if graph is not None:
                nodes.setdefault(lay.weight, set()).add(lay.node)
    others = other_readers(graph, nodes) if graph is not None else {}
    gains = graph.gains if graph is not None else {}
    ok: dict[str, list[str]] = {}
    left: dict[str, str] = {}
    for w, n in sites.items():
        bufs = sorted(set(alpha_buffers.get(w, [])))
        if w in gains:
            left[w] = (f"the forward multiplies the weight by a fixed gain ({gains[w]:.4g}: an "
                       f"equalized learning rate, a learning-rate multiplier) that sets its "
                       f"rate against the other layers' by design: left as planned")
        elif others.get(w):
            left[w] = (f"the weight is also read outside its layer (by {', '.join(others[w][:3])}"
                       f"): rescaling it would change that use too; left out of rescaling")
        elif bufs and (len(bufs) == n or len(bufs) == 1):
            ok[w] = bufs
        elif not bufs:
            left[w] = "no alpha could be placed on this layer (see NOT APPLIED)"
        else:
            left[w] = (f"an alpha was placed on {len(bufs)} of its {n} call sites: left out of "
                       f"measured balancing")
    return ok, left


def other_readers(graph: Graph, sites: dict[str, set[str]]) -> dict[str, list[str]]:
    """For each weight, the graph nodes that read it other than its layers' own call sites."""
    out: dict[str, list[str]] = {}
    for n in graph:
        for p in set(n.params.values()):
            if p in sites and n.name not in sites[p]:
                out.setdefault(p, []).append(n.name)
    return out


def summary_line(section: dict[str, Any]) -> str:
    """One line for the report: how many weighted layers were balanced, how many left out."""
    n, done = section.get("layers", 0), len(section.get("factors") or {})
    left = section.get("left_out") or {}
    head = f"measured balancing: {done} of {n} weighted layers rebalanced"
    if left:
        head += f", {len(left)} left out (see NOT APPLIED)"
    if section.get("applied"):
        held, same = section.get("held_out"), section.get("same_sample")
        tail = (f"; held-out half of the batch: {held:.3g}x" if isinstance(held, float) else
                f"; remeasured with fresh draws on the same sample (a batch of one has no "
                f"held-out half): {same:.3g}x" if isinstance(same, float) else
                " (held-out check: measure=True)")
        n, distinct = section["samples"], section.get("distinct_samples")
        on = (f"{n} balancing draws over {distinct} sample(s) of the batch"
              if isinstance(distinct, int) and distinct < n else f"{n} balancing samples")
        return (f"{head}; Hessian-block spread {section['spread_before']:.3g}x -> "
                f"{spread_of(section['after_fit']):.3g}x on the {on}{tail}")
    return f"{head}: {section.get('decision') or section.get('note') or 'not applied'}"


def held_out(section: dict[str, Any] | None, measured: dict[str, Any]) -> None:
    """Record the held-out spread that ``measure=True`` took on the rewritten model in the
    balancing section (and its summary line)."""
    if isinstance(section, dict) and section.get("applied") and "after" in measured:
        if measured["after"].get("held_out", True):
            section["held_out"] = float(measured["after"]["spread"])
        else:       # a batch of one: measured on the very sample balanced on
            section["same_sample"] = float(measured["after"]["spread"])
        section["summary"] = summary_line(section)


def _finish(section: dict[str, Any], n_layers: int, left: dict[str, str]) -> dict[str, Any]:
    section.update(layers=n_layers, left_out=dict(left))
    section.setdefault("applied", False)
    section["summary"] = summary_line(section)
    return section


def balance_measured(model: nn.Module, sample: Sample, plan: Plan | None,
                     alpha_buffers: dict[str, list[str]], *, balance: str,
                     stat: str = "hessian", n_samples: int = D.balance_samples,
                     n_cotangents: int = 4, seed: int = D.seed, output_key: Any = D.output_key,
                     mode: str = D.calibration, threshold: float = D.balance_threshold,
                     log: Callable[[str], None] = lambda m: None,
                     verbose: bool | None = None, rtol: float | None = None,
                     graph: Graph | None = None, distributed: bool = False,
                     group: Any = None,
                     split: tuple[dict[str, list[str]], dict[str, str]] | None = None
                     ) -> dict[str, Any]:
    """Balance a measured statistic (``STATISTICS``) of every weight whose every call site has
    an alpha buffer (it scales exactly as alpha^4) and that ``graph`` shows read nowhere else;
    the other weighted layers of the plan are listed in ``left_out`` with why.  ``balance='hessian'`` always balances (and raises if it
    cannot); with ``balance='auto'`` the alphas are only changed when the measured spread is
    significantly above ``threshold`` (lower bound at 2 standard errors): below, the estimate's
    own noise is comparable to the imbalance it would correct.  The measurement stops early
    (from a quarter of ``n_samples`` on) once every layer's statistic is known to ``rtol``
    (95% interval, :func:`precondfx.pytorch.measure.sketch.precise`; default
    :func:`~precondfx.pytorch.measure.sketch.rtol_for` the threshold: the noise left after balancing
    cannot leave two layers further apart than ``threshold``), and for ``auto`` once even the
    upper bound of the spread is below ``threshold``.
    On the paper's MLP the per-sample statistic is heavy-tailed, and balancing 16 samples
    without this test moved one seed's held-out weight-to-gradient spread from 1.1x to 2.2x.

    The rescaling must not change the function: the main output on the balancing half of the
    calibration batch (the rescaling is exact sample by sample; half the forwards) is computed
    before and after, and the change undone (exactly: saved tensors copied back)
    when it exceeds ``1e-4`` relative, or when two identical forwards already differ (a random
    op the calibration could not turn off).

    ``distributed`` (a sharded model, or every rank of an initialized process group ``group``
    calling with its own batch): each rank measures the first half of its own batch, the
    per-sample statistics are summed over the ranks before the stop rule and the factors
    see them (:mod:`precondfx.pytorch.measure.ranks`), and the output checks take the largest
    change over the ranks, so every rank sets the same factors: those of one process balancing
    on the global batch whose rank-r part is ``x[r::world]`` (when every rank holds the same
    even number of samples).  Without a process group of 2 ranks or more it is one process.

    Returns the report section: statistics before/after on the balancing samples, their
    spreads, the factor applied to each alpha, counts of layers balanced and left out and a
    ``summary`` line.  The plan is not changed: :func:`record_factors` records the factors.
    ``split``: :func:`balanceable`'s result, computed earlier (then ``plan``, ``alpha_buffers``
    and ``graph`` are not read)."""
    if balance not in ("auto", "hessian"):
        raise PrecondError(f"balance={balance!r}: measured balancing is 'auto' or 'hessian'")
    gated = balance == "auto"
    if split is not None:
        ok, left = {w: list(b) for w, b in split[0].items()}, dict(split[1])
    elif plan is None:
        raise PrecondError("balance_measured needs the plan (or split=)")
    else:
        ok, left = balanceable(alpha_buffers, plan, graph)
    # an embedding with max_norm renormalizes its stored rows at every forward: dividing the
    # weight by a factor changes which rows are renormalized, so the function would change
    # (and the output check would undo every layer's factor)
    for w in sorted(set(ok) & set(cal._renormed(model))):
        del ok[w]
        left[w] = ("an embedding with max_norm renormalizes its rows in forward: rescaling "
                   "its weight would change the function; left out of rescaling")
    n_layers = len(ok) + len(left)
    weights = list(ok)
    if len(weights) < 2:
        return _finish({"note": f"{len(weights)} of {n_layers} weighted layers carry an alpha "
                                f"on every call site: nothing to balance"}, n_layers, left)
    with shards.gathered(model):   # its forwards then run no collective: ranks may differ
        if not isinstance(output_key, MainPath):   # picked on the whole batch, not per sample
            with torch.no_grad():
                output_key = main_path_of(cal.forward(model, sample, mode), output_key)
        sample, dim_note = batchdim.resolve(model, sample,
                                            lambda out: main_output(out, output_key))
    fit, held, b = _split(sample)
    ranks = for_group(fit.batch_size(), group) if distributed else None
    if ranks is not None:
        b = int(ranks.sum(np.array([float(b)]))[0])   # the global batch
    n_fit = n_samples
    # once a quarter of the samples is measured, stop when every statistic is precise enough
    # (or, for 'auto', when even the upper bound of the spread at 2 standard errors is below
    # the threshold); the samples are the same draws a full run would make, so a run that
    # goes on is the full estimate
    n_first = min(n_fit, max(4, n_fit // 4))

    rtol = rtol_for(threshold) if rtol is None else rtol

    def clear(per_: np.ndarray) -> bool:
        return gated and _upper_spread(*_estimates(per_, weights)) <= threshold

    def enough(per_: np.ndarray) -> bool:
        return clear(per_) or precise(per_, rtol)
    log(f"measuring the {stat} statistic of {len(weights)} layers on {n_fit} samples")
    per, engine, note = _measure_per(model, fit, weights, n_fit, n_cotangents, seed,
                                     output_key, mode, verbose, first=n_first, stop=enough,
                                     ranks=ranks)
    before, before_se = _estimates(per, weights)
    early = _stop_note(per, n_fit, clear, before, before_se, rtol, threshold)
    n_fit = min(n_fit, len(per))
    before, before_se = _drop_unreached(before, before_se, left, stat)
    if len(before) < 2:
        return _finish({"note": f"{len(before)} of {n_layers} weighted layers with a nonzero "
                                f"{stat} statistic: nothing to balance"}, n_layers, left)
    base = {"statistic": STATISTICS[stat], "samples": n_fit, "cotangents": n_cotangents,
            "batch": b, "before": before, "stderr_before": before_se,
            "spread_before": spread_of(before),
            "note": "; ".join(x for x in (dim_note, note) if x), "batch_dim": sample.dim,
            "engine": engine,
            "stopped_early": early.rstrip("; ")}
    if ranks is None:   # the draws cycle over the fitting half's samples
        base["distinct_samples"] = min(n_fit, fit.batch_size())
    if ranks is not None:
        base["ranks"] = ranks.world
        base["balancing_samples_per_rank"] = list(ranks.sizes)
    low = significant_spread(before, before_se)
    if gated and low <= threshold:
        return _finish({**base, "spread_lower_bound": low, "applied": False,
                        "decision": f"{early}measured spread {spread_of(before):.3g}x (lower bound "
                                    f"{low:.3g}x at 2 standard errors) <= threshold "
                                    f"{threshold:g}x: alphas left as planned"}, n_layers, left)
    target = geometric_mean(list(before.values()))
    factors = {w: (target / v) ** 0.25 for w, v in before.items()}
    change, msg = _rescale_checked(model, fit, ok, factors, output_key, mode,
                                   spread_of(before), ranks)
    if msg is not None:
        if not gated:
            raise PrecondError(f"measured balancing failed: {msg}")
        return _finish({**base, "applied": False, "decision": msg}, n_layers, left)
    after = {w: v * factors[w] ** 4 for w, v in before.items()}  # exact: stat scales alpha^4
    return _finish({
        **base, "after_fit": after, "factors": factors, "applied": True,
        "output_change": change,
        "held_out": None,   # filled by held_out() when precondition(..., measure=True)
    }, n_layers, left)


def _stop_note(per: np.ndarray, n_fit: int, clear: Callable[[np.ndarray], bool],
               before: dict[str, float], before_se: dict[str, float], rtol: float,
               threshold: float) -> str:
    """Why the measurement stopped before ``n_fit`` samples ('' when it did not)."""
    if len(per) >= n_fit:
        return ""
    n = len(per)
    return (f"decided on the first {n} samples: even the upper bound of the spread "
            f"({_upper_spread(before, before_se):.3g}x) is below the threshold; "
            if clear(per) else
            f"stopped after {n} samples: every layer's statistic known to "
            f"+-{rtol:.0%} (95% interval): the noise cannot leave two layers more than "
            f"{threshold:g}x apart; ")


def _drop_unreached(before: dict[str, float], se: dict[str, float], left: dict[str, str],
                    stat: str) -> tuple[dict[str, float], dict[str, float]]:
    """The statistics without the weights whose statistic is zero or not finite (the main
    output does not depend on them on the balancing samples: another head, a branch the
    samples did not take), each recorded in ``left`` with why; the others are balanced."""
    bad = [w for w, v in before.items() if not (v > 0 and math.isfinite(v))]
    for w in bad:
        left[w] = (f"its {stat} statistic is {before[w]:.3g} on the balancing samples: the "
                   f"main output does not depend on it there (another head, a branch not "
                   f"taken, a statistic over the batch): left as planned")
    return ({w: v for w, v in before.items() if w not in bad},
            {w: v for w, v in se.items() if w not in bad})


def _rescale_checked(model: nn.Module, fit: Sample, ok: dict[str, list[str]],
                     factors: dict[str, float], output_key: Any, mode: str, spread: float,
                     ranks: Ranks | None = None) -> tuple[float, str | None]:
    """Rescale each weight's alphas by its factor and check that the main output on ``fit``
    is unchanged; if not (or if two identical forwards of ``fit`` already differ: a random
    op), undo exactly (saved tensors copied back).  The identical forwards run on ``fit``
    itself, not on one sample of it: a train-mode BatchNorm refuses a batch of one.  With
    ``ranks`` the largest change and noise over the ranks decide, the same way on every rank.
    Returns the output's relative change and why the rescaling was undone (None: kept)."""
    y0 = _output(model, fit, output_key, mode)
    noise = _rel_change(_output(model, fit, output_key, mode), y0)
    saved = {w: (model.get_parameter(w).detach().clone(),
                 [model.get_buffer(b_).detach().clone() for b_ in ok[w]]) for w in factors}
    for w, c in factors.items():
        _rescale(model, w, ok[w], c)
    change = _rel_change(_output(model, fit, output_key, mode), y0)
    if ranks is not None:
        change, noise = ranks.max([change, noise])
    if noise <= 1e-5 and change < 1e-4 + noise:
        return change, None
    with torch.no_grad():
        for w, (wt, bufs) in saved.items():
            model.get_parameter(w).copy_(wt)
            for b_, v in zip(ok[w], bufs):
                model.get_buffer(b_).copy_(v)
    if noise > 1e-5:
        return change, (f"two identical forwards of the calibration batch differ by "
                        f"{noise:.2g} (relative): a random op is active that the calibration "
                        f"run could not turn off, so whether rescaling keeps the function "
                        f"cannot be checked; alphas left as planned (calibration='eval' or a "
                        f"deterministic forward)")
    return change, (f"rescaling changed the output by {change:.2g} (relative; the statistics "
                    f"span {spread:.3g}x); alphas left as planned")


def _rel_change(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref| (the reference's scale, not each element's)."""
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _upper_spread(means: dict[str, float], se: dict[str, float], z: float = 2.0) -> float:
    """An upper bound on the spread: largest value plus z standard errors over the smallest
    minus z standard errors (inf when that is not positive)."""
    lo = min(m - z * se.get(k, 0.0) for k, m in means.items())
    hi = max(m + z * se.get(k, 0.0) for k, m in means.items())
    return hi / lo if lo > 0 else float("inf")


def significant_spread(means: dict[str, float], se: dict[str, float], z: float = 2.0) -> float:
    """A lower bound on the spread max/min: the largest value minus z standard errors over the
    smallest plus z standard errors (1 when the intervals overlap)."""
    lo = {k: max(m - z * se.get(k, 0.0), 1e-300) for k, m in means.items()}
    hi = {k: m + z * se.get(k, 0.0) for k, m in means.items()}
    return max(1.0, max(lo.values()) / min(hi.values()))


def record_factors(measured: Measured, plan: Plan, factors: dict[str, float]) -> None:
    """Record in ``measured`` what balancing set (the plan stays as planned): each rescaled
    weight's alphas times its factor, its std divided by it."""
    for lay in plan.layers:
        c = factors.get(lay.weight or "")
        if c is not None:
            measured.add("balance", "alpha", lay.node, c, op="mul",
                         note=f"measured balancing x{c:.4g}")
    node_w = {lay.node: lay.weight for lay in plan.layers}
    for sc in plan.scales:
        if sc.tag == "alpha" and node_w.get(sc.node) in factors:
            measured.add("balance", "scale", sc.key(), factors[node_w[sc.node]], op="mul")
    for w, c in factors.items():
        pi = plan.inits.get(w)
        if pi is not None and pi.std is not None:
            measured.add("balance", "std", w, c, op="div")
