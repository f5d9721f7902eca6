"""Adam's suggested rate across the MLP width and depth family (issue 20, item 5).

``lr=`` with an Adam optimizer moves the result's *suggested* rate (``suggest_lr``, from the
curvature at initialization) onto the user's rate.  That gives one rate across widths and
depths only if the suggestion tracks the best rate: this reads the suggestion of precondfx's
default result for each net of the ``--cpu-lr`` transfer family (median over seeds) and sets it
against the rate the suite chose on validation in a given result JSON (by default the 12-seed
GPU run, ``train_suite_transfer_adamw_gpu12.json``).  The spread of ``chosen - suggested`` over
a family is about how far the best rate would still move under ``lr=``.  No training.

    python bench/suggested_lr_transfer.py                    # ~3 min on one core (w2048 most)
    python bench/suggested_lr_transfer.py --nets mlp_w128_d1,mlp_w128_d4

Writes docs/results/suggested_lr_transfer.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import train_suite as T  # noqa: E402
from results_io import write_table  # noqa: E402

from precondfx.pytorch.capture.common import Sample  # noqa: E402
from precondfx.pytorch.measure.suggest import suggest_lr  # noqa: E402

FAMILIES = {"widths": ["mlp_w32_d2", "mlp_w128_d2", "mlp_w512_d2", "mlp_w2048_d2"],
            "depths": ["mlp_w128_d1", "mlp_w128_d2", "mlp_w128_d4", "mlp_w128_d8",
                       "mlp_w128_d16"]}
REFERENCE = "train_suite_transfer_adamw_gpu12.json"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nets", default=",".join(dict.fromkeys(sum(FAMILIES.values(), []))))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--reference", default=REFERENCE, help="a train_suite JSON in docs/results")
    ap.add_argument("--out", default=os.path.join(C.RESULTS, "suggested_lr_transfer"))
    args = ap.parse_args(argv)
    C.setup(1)
    say = C.Progress("suggested_lr_transfer")
    ref = json.load(open(os.path.join(C.RESULTS, args.reference)))["results"]
    tasks = {t.name: t for t in T.all_tasks(dict(T.SIZES["cpu_lr"], libsvm=False))}
    rows: dict[str, dict] = {}
    for name in args.nets.split(","):
        task = tasks[name]
        got = []
        for s in range(args.seeds):
            calib = task.get(task.sampler(s)[0])[0]
            model, _ = T.build(task, "pfx", s, calib, "adamw")
            got.append(math.log2(suggest_lr(model, Sample((calib,), {}), mode="train",
                                            seed=s, families=("adam",))["adam"]))
        cell = ref.get(name, {}).get("adamw", {}).get("pfx")
        chosen = cell["best_lr_log2"] if cell else None
        sug = float(np.median(got))
        rows[name] = {"suggested_log2": sug, "per_seed": got, "chosen_log2": chosen,
                      "offset": None if chosen is None else chosen - sug}
        say(f"{name}: suggested 2^{sug:.2f}, chosen 2^{chosen}")
    spread = {}
    for fam, nets in FAMILIES.items():
        off = [rows[n]["offset"] for n in nets if n in rows and rows[n]["offset"] is not None]
        spread[fam] = {"nets": [n for n in nets if n in rows], "offset_spread":
                       float(max(off) - min(off)) if len(off) > 1 else None}
    lines = ["# Adam's suggested rate across MLP widths and depths (issue 20, item 5)", "",
             f"precondfx's default result, `suggest_lr`'s Adam rate (median of {args.seeds} "
             f"seeds) against the AdamW rate chosen on validation in `{args.reference}` (log2). "
             "`lr=` moves the suggestion onto the user's rate, so the spread of the offset over "
             "a family is about how far the best rate would still move under `lr=` (target: "
             "1 octave over widths, 2 over depths).", "",
             "| net | suggested | per seed | chosen | offset |", "|---|---|---|---|---|"]
    for n, r in rows.items():
        off = "-" if r["offset"] is None else f"{r['offset']:+.2f}"
        lines.append(f"| {n} | {r['suggested_log2']:.2f} | "
                     f"{' / '.join(f'{v:.2f}' for v in r['per_seed'])} | {r['chosen_log2']} | "
                     f"{off} |")
    lines.append("")
    for fam, v in spread.items():
        sp = "-" if v["offset_spread"] is None else f"{v['offset_spread']:.2f}"
        lines.append(f"- {fam}: offset spread {sp} octaves over {', '.join(v['nets'])}")
    lines += ["", f"Environment: {C.env_info()}",
              "Reproduce: `python bench/suggested_lr_transfer.py`"]
    out = {"rows": rows, "spread": spread, "reference": args.reference}
    write_table(args.out, lines, out)
    return out


if __name__ == "__main__":
    main()
