"""Train at the suggested learning rate itself (issue 20, item 3).

``bench/suggested_lr_probe.py`` reads the suite's loss at the suggested rate off its grid of
powers of two (interpolated).  This trains precondfx's result of each held-out task at exactly
the rate ``precondition(..., suggest_lr=True)`` reports for it (per seed: the suggestion made on
that seed's model and calibration batch), with the suite's own trainer, protocol and seeds, and
sets the test loss against the one at the rate the suite chose on validation
(``docs/results/train_suite_heldout_v3_cpu.json``).  Target: within 10% (0.03 nats for GPT-2).

    python bench/suggested_lr_check.py          # ~15 minutes on one CPU thread

Writes docs/results/suggested_lr_check.{md,json}.
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import train_suite as T  # noqa: E402
from suggested_lr_probe import JSONS, cells  # noqa: E402  (the suite's cells, one reader)
from results_io import write_table  # noqa: E402

from precondfx.pytorch.capture.common import Sample  # noqa: E402
from precondfx.pytorch.measure.suggest import suggest_lr  # noqa: E402

TASKS = ["mlp_w128_d2", "conv_bn", "pool_cnn", "pool_cnn_bn", "vit", "gpt2"]
SEEDS = [0, 1, 2]


def main() -> None:
    C.setup(1)
    say = C.Progress("suggested_lr_check")
    ref = cells()
    rows = []
    for tn in TASKS:
        task = T.heldout_task(tn)
        for opt in ("sgd", "adamw"):
            models, lrs = [], []
            for s in SEEDS:
                calib = task.get(task.sampler(s)[0])[0]
                model, _ = T.build(task, "pfx", s, calib, opt)
                sl = suggest_lr(model, Sample((calib,), {}), mode="train", seed=s)
                models.append(model.train())
                lrs.append(sl["sgd" if opt == "sgd" else "adam"])
            r = T.train_copies(task, models, lrs, SEEDS, T.Hyper(opt), {}, "cpu")
            key = "heldout" if task.kind == "lm" else "test"
            got = float(np.median(r[key]))
            cell = ref[(tn, opt, "pfx")]
            best = float(cell["best"])
            lm = task.kind == "lm"
            ok = (got - best <= 0.03) if lm else (got <= 1.1 * best)
            rows.append({"task": tn, "optimizer": opt, "suggested_log2": [float(np.log2(x))
                                                                          for x in lrs],
                         "test_at_suggested": got, "per_seed": [float(v) for v in r[key]],
                         "test_at_chosen": best, "chosen_log2": cell["best_log2"],
                         "within_target": bool(ok)})
            say(f"{tn} {opt}: suggested 2^{np.median(np.log2(lrs)):.2f} -> {got:.4g} "
                f"(chosen rate: {best:.4g}) {'ok' if ok else 'MISS'}")
    lines = ["# Training at the suggested learning rate (issue 20, item 3)", "",
             "precondfx's default result of each held-out task trained at exactly the rate "
             "`suggest_lr=True` reports for that seed (3 seeds, the suite's protocol); "
             "against the test loss at the rate the suite chose on validation "
             f"({', '.join(JSONS)}). Target: within 10% (0.03 nats for GPT-2).", "",
             "| task | optimizer | suggested log2 (per seed) | test loss there (median) | at the "
             "chosen rate | within target |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['optimizer']} | "
                     f"{' / '.join(f'{v:.2f}' for v in r['suggested_log2'])} | "
                     f"{r['test_at_suggested']:.4g} | {r['test_at_chosen']:.4g} | "
                     f"{'yes' if r['within_target'] else 'no'} |")
    for opt in ("sgd", "adamw"):
        oks = [r["within_target"] for r in rows if r["optimizer"] == opt]
        lines.append(f"\n- {opt}: within the target on {sum(oks)} of {len(oks)} tasks")
    lines += ["", f"Environment: {C.env_info()}", "Reproduce: `python bench/suggested_lr_check.py`"]
    write_table(os.path.join(C.RESULTS, "suggested_lr_check"), lines,
                {"rows": rows, "env": C.env_info()})


if __name__ == "__main__":
    main()
