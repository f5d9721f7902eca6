"""Held-out Hessian-block spread per initialization and balancing mode (issue: conditioning).

For each model the statistic E[(G_l r)^2]/numel of every weighted layer is measured on FRESH
inputs and fresh random cotangents (not the calibration batch) with the pair-cotangent estimator
(precondfx.pytorch.measure.sketch, checked against explicit Hessian-vector products in the tests), and
the spread (max/min over layers) is reported for: PyTorch's default init, geometric init alone
(balance='none'), geometric + analytic constants (balance='analytic', the paper's Sec. 5 / App. E
alphas), the default (balance='auto': measured balancing when the measured spread is
significantly above 2x), geometric + measured balancing (balance='hessian'), and fan-in +
measured balancing.

    python bench/bench_conditioning.py            # full (a few minutes)
    python bench/bench_conditioning.py --quick    # smoke run (CI)

Writes docs/results/conditioning.json and docs/results/conditioning.png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import precondfx
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import zoo  # noqa: E402
from precondfx.pytorch.measure.sketch import hessian_sketch, spread_of

METHODS = [
    ("pytorch default", None),
    ("geometric", dict(balance="none")),
    ("geometric + analytic", dict(balance="analytic")),
    ("precondfx default (auto)", dict()),
    ("geometric + hessian", dict(balance="hessian")),
    ("fan-in + hessian", dict(init="fan_in", balance="hessian")),
]


def models(quick: bool):
    if quick:
        yield "alexnet_strided/8 (16x16)", lambda s: zoo.build("alexnet_strided", seed=s,
                                                               width_div=16, image=16, batch=16)
        return
    yield "alexnet_strided/4 (32x32)", lambda s: zoo.build("alexnet_strided", seed=s,
                                                           width_div=4, batch=32)
    yield "resnet50 layout, no norm (w16, 64x64)", lambda s: zoo.resnet50(
        norm=False, width=16, layers=(3, 4, 6, 3), image=64, batch=16, num_classes=10, seed=s)
    yield "plain conv, 30 layers", lambda s: zoo.build("plain_deep_cnn", seed=s, depth=30,
                                                       batch=32)


def heldout_spread(model, weights, x, n, seed):
    res = hessian_sketch(model, x, weights, n_samples=n, n_cotangents=4, seed=seed)
    return spread_of(res.means()), res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--out", default="docs/results")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    n = 4 if args.quick else args.samples
    rows = []
    for mname, build in models(args.quick):
        model0, calib = build(0)
        fresh = torch.randn_like(calib) if isinstance(calib, torch.Tensor) else None
        weights = [k for k, p in model0.named_parameters() if k.endswith("weight") and p.dim() > 1]
        for label, kw in METHODS:
            model, _ = build(0)
            t0 = time.perf_counter()
            if kw is None:
                pm, ws = model, weights
            else:
                pm, rep = precondfx.precondition(model, calib, balance_samples=n, **kw)
                ws = [lay.weight for lay in rep.plan.layers if lay.weight]
            took = time.perf_counter() - t0
            sp, _ = heldout_spread(pm, list(dict.fromkeys(ws)), fresh, n, seed=123)
            rows.append({"model": mname, "method": label, "heldout_spread": sp,
                         "precondition_s": took, "layers": len(ws)})
            print(f"{mname:40} {label:24} held-out spread {sp:12.4g}   ({took:.2f}s)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    with open(os.path.join(args.out, f"conditioning{suffix}.json"), "w") as f:
        json.dump({"rows": rows, "samples": n}, f, indent=2)
    try:
        _plot(rows, os.path.join(args.out, f"conditioning{suffix}.png"))
    except Exception as e:  # matplotlib missing: the JSON is the result
        print("plot skipped:", e)
    print("\n| model | " + " | ".join(m for m, _ in METHODS) + " |")
    print("|---|" + "---|" * len(METHODS))
    for mname in dict.fromkeys(r["model"] for r in rows):
        vals = [next(r["heldout_spread"] for r in rows if r["model"] == mname and r["method"] == m)
                for m, _ in METHODS]
        print(f"| {mname} | " + " | ".join(f"{v:.3g}x" for v in vals) + " |")


def _plot(rows, path):
    from precondfx.core.plots import _figure, _save
    import numpy as np
    ms = list(dict.fromkeys(r["model"] for r in rows))
    meths = [m for m, _ in METHODS]
    fig = _figure((9, 4.5), 100)
    ax = fig.add_subplot(1, 1, 1)
    w = 0.8 / len(meths)
    for j, m in enumerate(meths):
        v = [next(r["heldout_spread"] for r in rows if r["model"] == mm and r["method"] == m)
             for mm in ms]
        ax.bar(np.arange(len(ms)) + j * w, v, w, label=m)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(ms)) + 0.4 - w / 2)
    ax.set_xticklabels(ms, fontsize=8)
    ax.set_ylabel("held-out Hessian-block spread (max/min)")
    ax.axhline(2.0, color="k", lw=0.8, ls="--")
    ax.legend(fontsize=7)
    _save(fig, path, 100)


if __name__ == "__main__":
    main()
