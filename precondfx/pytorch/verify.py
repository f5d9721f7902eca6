"""Verify: measure the conditioning of the model before and after the pass, for the report.

``precondition(..., measure=True)`` calls :func:`measure_report`: the Hessian-block statistic of
every weighted layer on the user's original model and on the rewritten one (held-out half of the
calibration batch, fresh random cotangents), and, for models of at most ``max_blocks`` layers,
the full block matrix from Hessian-vector products (the paper's Fig. 1) and the GR-formula /
measured ratio of each layer (Fig. 2).  ``Report.plot`` draws what was measured.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from torch import nn

from precondfx.pytorch.apply.shards import is_sharded
from precondfx.pytorch.balance import measured_statistics
from precondfx.pytorch.capture.common import Sample, main_output
from precondfx.errors import PrecondError
from precondfx.pytorch.measure import batchdim
from precondfx.core.plan import Plan


def measure_report(original: nn.Module, result: nn.Module, sample: Sample, plan: Plan, *,
                   output_key: Any = None, mode: str = "train", seed: int = 0,
                   n_samples: int = 16, max_blocks: int = 40,
                   say: Callable[[str], None] = lambda m: None,
                   verbose: bool | None = None) -> dict[str, Any]:
    """Before/after Hessian statistics, and the block matrix and GR ratios of the result."""
    weights = list(dict.fromkeys(lay.weight for lay in plan.layers if lay.weight))
    original = _comparable(original, sample)
    orig_names = dict(original.named_parameters())
    common = [w for w in weights if w in orig_names]
    out: dict[str, Any] = {}
    if not weights or not common:
        out["note"] = ("not measured: no weighted layer with one weight matrix to measure "
                       "(recurrent layers hold several)")
        return out
    sample, dim_note = batchdim.resolve(result, sample, lambda o: main_output(o, output_key))
    if dim_note:
        out["batch_dim"] = dim_note
    say("measuring the conditioning of the original model")
    before = measured_statistics(original, sample, common, n_samples=n_samples, seed=seed,
                                 output_key=output_key, mode=mode, verbose=verbose,
                                 desc="held-out statistics, original model")
    say("measuring the conditioning of the rewritten model")
    after = measured_statistics(result, sample, weights, n_samples=n_samples, seed=seed,
                                output_key=output_key, mode=mode, verbose=verbose,
                                desc="held-out statistics, rewritten model")
    out["before"] = before
    out["after"] = after
    if len(weights) <= max_blocks:
        from precondfx.pytorch.measure.conditioning import LayerRef, measure_conditioning
        refs = [LayerRef(name=w, weight=w, module=w.rpartition(".")[0] or None)
                for w in weights]
        say(f"Hessian block matrix ({len(refs)} x {len(refs)}) by Hessian-vector products")
        try:
            res = measure_conditioning(result, sample, refs, stats=("hessian", "gr"),
                                       n_samples=min(n_samples, 8), n_probes=2, seed=seed,
                                       output_fn=lambda o: main_output(o, output_key),
                                       verbose=verbose)
            out["blocks"] = {"names": res.blocks.names,
                             "mean": [[float(v) for v in row] for row in res.blocks.mean]}
            ratios = {}
            for lay in res.layers:
                if lay.gr is not None and lay.hessian is not None and lay.hessian.mean > 0:
                    ratios[lay.name] = lay.gr.mean / lay.hessian.mean
            out["gr_over_hessian"] = ratios
        except Exception as e:  # noqa: BLE001 - an optional figure: say why it is missing
            out["blocks_note"] = (f"block matrix not measured: {type(e).__name__}: "
                                  f"{str(e)[:160]}")
    return out


def _comparable(original: nn.Module, sample: Sample) -> nn.Module:
    """The user's model as the pass computes with it: a copy in the sample's floating dtype
    (a bfloat16/float16 model is worked on in float32) with lazy modules materialized by one
    run; the model itself when nothing needs changing (or it cannot be copied)."""
    import copy

    import torch

    from precondfx.pytorch import calibrate as cal
    dts = {t.dtype for t in sample.tensors() if t.is_floating_point()}
    lazy = any(isinstance(p, nn.parameter.UninitializedParameter) for p in original.parameters())
    low = any(p.dtype in (torch.float16, torch.bfloat16) for p in original.parameters())
    if not lazy and not low:
        return original
    try:
        work = copy.deepcopy(original)
    except Exception:  # noqa: BLE001 - measured as it is
        return original
    if low and len(dts) == 1:
        work = work.to(dts.pop())
    if lazy:
        cal.forward(work, sample)
    return work


def verify_result(result: nn.Module, sample: Sample, *, output_key: Any = None,
                  mode: str = "train", target_std: float | None = None, seed: int = 0,
                  draws: int = 8) -> dict[str, Any]:
    """Run the finished model on the sample in the calibration mode and in the other one
    (dropout off, buffers restored, random ops seeded from ``seed``): every floating-point
    output finite, and the main output's std against the target, measured after every step
    that changed a constant (measured balancing and LSUV must leave the function as
    calibrated).  A forward that draws random numbers is measured as calibration measured
    it (root mean square over ``draws`` seeded draws) and the note says so.  Returns the
    report's ``verification`` section."""
    import torch

    from precondfx.pytorch import calibrate as cal
    from precondfx.pytorch.capture.common import leaves
    res: dict[str, Any] = {"mode": mode}
    ran = []
    per_draw: list[float] = []
    for m in (mode, "eval" if mode == "train" else "train"):
        try:
            with cal.seeded(seed) as rec:
                out = cal.forward(result, sample, m)
        except PrecondError as e:      # e.g. BatchNorm on a batch of one, in train mode
            if m == mode:
                raise
            res["not_run"] = {m: " ".join(str(e).split())[:200]}
            continue
        ran.append(m)
        bad = [tuple(t.shape) for t in leaves(out) if isinstance(t, torch.Tensor)
               and t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if bad:
            res.setdefault("not_finite", {})[m] = [list(b) for b in bad]
        if m == mode:
            try:
                res["std"] = cal.output_std(out, output_key)
                if is_sharded(result):   # calibrated on every rank's batch: checked on it
                    res["std"] = cal.global_std(cal.main_output(out, output_key))
            except PrecondError:
                pass
            if rec.random and "std" in res:
                per_draw = [res["std"]]
                for i in range(1, draws):
                    with cal.seeded((seed + i) % (2 ** 63)):
                        per_draw.append(cal.output_std(cal.forward(result, sample, m),
                                                       output_key))
                res["std"] = math.sqrt(sum(x * x for x in per_draw) / len(per_draw))
                res["random_draws"] = per_draw
    res["finite"] = "not_finite" not in res
    std = res.get("std")
    if std is not None and target_std is not None:
        res["target_std"] = target_std
        res["relative_error"] = abs(std / target_std - 1.0)
    where = f", output std {std:.4g}" + (f" (target {target_std:g})" if target_std else "") \
        if std is not None else ""
    if per_draw:
        where += (f", as the root mean square over {len(per_draw)} draws of its random ops "
                  f"seeded from seed={seed} (the forward draws random numbers: one batch's std "
                  f"ranges {min(per_draw):.4g}..{max(per_draw):.4g} from draw to draw)")
    fin = "outputs finite" if res["finite"] else \
        f"NaN/inf in outputs {res['not_finite']} (the original model's too? check it)"
    res["note"] = (f"verified: the rewritten model ran on the sample in {' and '.join(ran)} "
                   f"mode (dropout off), {fin}{where}")
    return res
