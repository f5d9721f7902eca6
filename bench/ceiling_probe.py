"""Why the ``lr='auto'`` ceiling spreads over seeds (issue 20, must-show 4).

The default's SGD ceiling is ``1/lambda``, ``lambda`` the top eigenvalue of the cross-entropy
Gauss-Newton matrix ``J' H J`` on the calibration batch, ``H = diag(p) - p p'`` the softmax's
Hessian at the model's own initial logits (``precondfx/pytorch/measure/suggest.py``).  On the
digits MLPs that rate moves 2-3 octaves over the seeds of one net, and the weights' draw, not
the batch, moves it.  For each net and seed of ``bench/train_suite.py``'s MLP family, built as
the suite builds precondfx's default (the seed's 32-sample calibration batch), this measures:

* ``rate``: log2 of ``1/lambda`` as the library measures it;
* ``centred``: the same with ``p`` the softmax of the logits with their mean over the batch
  removed (the part of the initial output that does not depend on the input, which the first
  steps learn away through the biases);
* ``uniform``: with ``p`` uniform (``H = (I - 11'/K)/K``);
* ``offset``: the rms over classes of the batch-mean logit over the logits' std (how much of
  the initial output is the same for every input);
* ``top_block``: the parameter whose own block of the matrix has the largest eigenvalue, and
  log2 of its ``1/lambda``.

Single thread, about a minute per net on an idle core.

    python bench/ceiling_probe.py                  # docs/results/ceiling_probe.{md,json}
    python bench/ceiling_probe.py --seeds 2 --nets mlp_w32_d2 --out /tmp/ceiling_probe
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import results_io  # noqa: E402
import train_suite as TS  # noqa: E402

NETS = ["mlp_w32_d2", "mlp_w128_d2", "mlp_w512_d2", "mlp_w2048_d2", "mlp_w128_d1",
        "mlp_w128_d4", "mlp_w128_d8", "mlp_w128_d16"]


def _softmax_hessian(p: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda u: p * u - p * (p * u).sum(-1, keepdim=True)


def _centred(z: torch.Tensor) -> tuple[Any, str]:
    return _softmax_hessian(torch.softmax((z - z.mean(0, keepdim=True)).double(), -1)), \
        "cross-entropy"


def _uniform(z: torch.Tensor) -> tuple[Any, str]:
    k = z.shape[-1]
    return (lambda u: (u - u.mean(-1, keepdim=True)) / k), "cross-entropy"


def probe(task: Any, seed: int) -> dict[str, Any]:
    """One net and seed: the rates under the three output Hessians, the offset, the top block."""
    import precondfx
    from precondfx.pytorch.capture.common import Sample
    from precondfx.pytorch.measure import suggest as S
    calib = task.get(task.sampler(seed)[0])[0]
    torch.manual_seed(seed)
    model, _ = precondfx.precondition(task.make(), calib, seed=seed, lr=None)
    sample = Sample((calib,), {})
    library = S._out_hessian
    row: dict[str, Any] = {"net": task.name, "seed": seed}
    try:
        for name, hess in (("rate", library), ("centred", _centred), ("uniform", _uniform)):
            S._out_hessian = hess
            row[name] = math.log2(S.suggest_lr(model, sample, families=("sgd",))["sgd"])
    finally:
        S._out_hessian = library
    blocks = {n: math.log2(S.suggest_lr(model, sample, families=("sgd",), only={n})["sgd"])
              for n, p in model.named_parameters() if p.dim() > 1}
    row["top_block"] = min(blocks, key=blocks.get)
    row["top_block_rate"] = blocks[row["top_block"]]
    with torch.no_grad():
        z = model.eval()(calib)
    row["offset"] = float(z.mean(0).pow(2).mean().sqrt() / z.std())
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", default=",".join(NETS))
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--prior", default=None,
                    help="a JSON this script wrote: its rows stand for the nets it holds")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs",
                                                  "results", "ceiling_probe"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    tasks = {t.name: t for t in TS.all_tasks(TS.SIZES["cpu_lr"])}
    rows = []
    if a.prior:
        with open(a.prior) as f:
            rows = [r for r in json.load(f)["rows"] if r["net"] in a.nets.split(",")]
    for net in a.nets.split(","):
        for seed in range(a.seeds):
            if any(r["net"] == net and r["seed"] == seed for r in rows):
                continue
            rows.append(probe(tasks[net], seed))
            print(rows[-1], flush=True)
    lines = ["# The SGD ceiling's spread over seeds (issue 20)", "",
             f"{a.seeds} seeds per net, each built as `bench/train_suite.py` builds precondfx's "
             "default (`lr=None` here: the ceiling's rate is measured, not applied). Cells: "
             "median log2 of `1/lambda` [min, max over seeds]; `offset`: rms of the batch-mean "
             "logit over the logits' std; correlation: Pearson's r over seeds of `offset` and "
             "the library's rate, all nets pooled after removing each net's mean.", "",
             "| net | library (softmax at the initial logits) | centred logits | uniform p "
             "| offset | top block (its own rate) |", "|---|---|---|---|---|---|"]

    def cell(v: list[float]) -> str:
        return f"{np.median(v):.2f} [{min(v):.1f}, {max(v):.1f}]"
    dx, dy = [], []
    for net in a.nets.split(","):
        rs = [r for r in rows if r["net"] == net]
        blocks = [r["top_block"] for r in rs]
        top = max(set(blocks), key=blocks.count)
        lines.append(f"| {net} | {cell([r['rate'] for r in rs])} | "
                     f"{cell([r['centred'] for r in rs])} | {cell([r['uniform'] for r in rs])} | "
                     f"{np.median([r['offset'] for r in rs]):.2f} | {top} ({blocks.count(top)}"
                     f"/{len(rs)}), {cell([r['top_block_rate'] for r in rs])} |")
        off, rate = np.array([r["offset"] for r in rs]), np.array([r["rate"] for r in rs])
        dx += list(off - off.mean())
        dy += list(rate - rate.mean())
    r = float(np.corrcoef(dx, dy)[0, 1]) if len(dx) > 2 else float("nan")
    lines += ["", f"Correlation of offset and the library's rate over seeds: r = {r:.2f}", "",
              f"Environment: {C.env_info()}",
              f"Reproduce: `python bench/ceiling_probe.py --nets {a.nets} --seeds {a.seeds}` "
              "(`--prior FILE`: rows of an earlier run kept)"]
    results_io.write_table(a.out, lines, {"rows": rows, "r_offset_rate": r})


if __name__ == "__main__":
    main()
