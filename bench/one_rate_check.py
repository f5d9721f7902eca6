"""One learning rate across MLP widths and depths under AdamW (issue 20, item 5).

The suite measures transfer as the movement of each net's *chosen* rate; ``lr=`` makes that
measure moot (given the rate, the pass moves the result's suggested rate onto it, so the loss
hardly depends on the rate).  What a user of one rate across sizes sees is the loss of every
net at that one rate.  So, per method, the rate chosen on validation for the base net (digits
MLP, width 128, depth 2) is used for all eight nets (widths 32-2048 at depth 2, depths 1-16 at
width 128), and each net's test loss there is set against that net's own best (chosen) loss:

* framework default, precondfx default, muP, u-muP: read off the suite's grids
  (``docs/results/train_suite_transfer_adamw_cpu.json``, section 0.5 of heldout_cpu.md);
* precondfx with ``lr=`` the framework default's base rate (the user's rate) and
  ``optimizer="adamw"``: trained here at that rate (3 seeds, the suite's trainer).

    python bench/one_rate_check.py        # ~10 minutes on one core

Writes docs/results/one_rate_check.{md,json}.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import train_suite as T  # noqa: E402
from keep_rate_check import _cell, at_log2, train_at  # noqa: E402
from results_io import write_table  # noqa: E402

SUITE = "train_suite_transfer_adamw_cpu.json"
BASE = "mlp_w128_d2"
NETS = ["mlp_w32_d2", "mlp_w128_d2", "mlp_w512_d2", "mlp_w2048_d2", "mlp_w128_d1", "mlp_w128_d4",
        "mlp_w128_d8", "mlp_w128_d16"]
METHODS = {"default": "framework default", "mup": "muP", "umup": "u-muP",
           "pfx": "precondfx default"}
#: "within" = test loss at the shared rate at most this times the net's best over the methods
WITHIN = 1.1


def main() -> None:
    C.setup(1)
    say = C.Progress("one_rate_check")
    ref = json.load(open(os.path.join(C.RESULTS, SUITE)))["results"]
    tasks = {t.name: t for t in T.all_tasks(T.SIZES["cpu_lr"]) if t.name in NETS}
    user = ref[BASE]["adamw"]["default"]["best_lr_log2"]
    rows = []
    for net in NETS:
        cells = ref[net]["adamw"]
        row: dict = {"net": net}
        for m in METHODS:
            e = ref[BASE]["adamw"][m]["best_lr_log2"]
            row[m] = {"at_shared": at_log2(cells[m], e), "shared_log2": e,
                      "own_best": {"best": cells[m]["best"], "se": cells[m]["se"],
                                   "lr_log2": cells[m]["best_lr_log2"]}}
        got, per_seed, facs = train_at(tasks[net], "adamw", 2.0 ** user)
        row["pfx_lr"] = {"at_shared": got, "shared_log2": user, "per_seed": per_seed,
                         "factor_log2": [float(np.log2(f)) for f in facs]}
        row["best_any"] = min(cells[m]["best"] for m in METHODS)
        rows.append(row)
        say(f"{net}: lr=2^{user} -> {_cell(got)}; " + "; ".join(
            f"{m} {_cell(row[m]['at_shared'])}" for m in METHODS))
    cols = list(METHODS) + ["pfx_lr"]
    names = {**METHODS, "pfx_lr": f"precondfx, `lr=2^{user}`"}
    lines = ["# One learning rate across MLP widths and depths, AdamW (issue 20, item 5)", "",
             f"Each method trains all eight digits MLPs at the one rate it chose on validation for "
             f"the base net ({BASE}); `lr=` is given the framework default's base rate 2^{user} "
             f"(the user's rate). Cells: test loss at that rate (median of 3 seeds ± SE), and in "
             f"brackets its ratio to the lowest chosen-rate loss of any method on that net "
             f"({SUITE}; section 0.5 of heldout_cpu.md). Within: ratio <= {WITHIN}.", "",
             "| net | best of any method | " + " | ".join(
                 f"{names[m]} @2^{rows[0][m]['shared_log2']}" for m in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    count = {m: 0 for m in cols}
    worst = {m: 0.0 for m in cols}
    for r in rows:
        cells_txt = []
        for m in cols:
            v = r[m]["at_shared"]
            ratio = (v["best"] / r["best_any"]) if v and v.get("best") is not None and \
                np.isfinite(v["best"]) else float("inf")
            count[m] += ratio <= WITHIN
            worst[m] = max(worst[m], ratio)
            cells_txt.append(f"{_cell(v)} [{ratio:.2f}]")
        lines.append(f"| {r['net']} | {r['best_any']:.4g} | " + " | ".join(cells_txt) + " |")
    lines.append("")
    for m in cols:
        lines.append(f"- {names[m]}: within {WITHIN}x of the best on {count[m]} of {len(rows)} "
                     f"nets at its one rate; worst ratio {worst[m]:.2f}")
    lines += ["", "Reproduce: `python bench/one_rate_check.py`", "",
              f"Environment: {C.env_info()}"]
    write_table(os.path.join(C.RESULTS, "one_rate_check"), lines,
                {"rows": rows, "env": C.env_info(), "within": WITHIN})


if __name__ == "__main__":
    main()
