"""Train precondfx's result at the user's learning rate, told to it with ``lr=`` and
``optimizer=`` (issue 20, item 2).

The user's rate here is the one the suite chose on validation for the framework's own init
(``docs/results/train_suite_heldout_v3_cpu.json``): a pipeline tuned for the default.  Each
task's model is preconditioned with ``precondition(model, calib, lr=that rate,
optimizer=...)`` and trained at exactly that rate with the suite's trainer, protocol and seeds;
its test loss is set against the framework default's and precondfx's default's (no ``lr=``)
at the same rate, from the same JSON.  "Never worse" is judged as the suite judges it
(``train_suite.compare``: beyond 2 standard errors).

    python bench/keep_rate_check.py --optimizers sgd --offsets=-1,0,1 --tag sgd       # 12 min
    python bench/keep_rate_check.py --optimizers adamw --offsets=-1,0,1 --tag adamw   # 10 min
    python bench/keep_rate_check.py --merge sgd,adamw                                 # the table
    # the Adam curvature route on the transformers too (lr_scale=None under lr=):
    python bench/keep_rate_check.py --tasks vit,gpt2,gpt2_l,bert --optimizers adamw \
        --offsets=-1,0,1 --lr-scale none --tag adamw_curv
    python bench/keep_rate_check.py --merge adamw_curv --out keep_rate_check_curv

The offsets are octaves from the framework default's chosen rate (a pipeline tuned near it).
Writes docs/results/keep_rate_check_<tag>.json per run and docs/results/<out>.{md,json} on
--merge.
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

SUITE = "train_suite_heldout_v3_cpu.json"
TASKS = ["mlp_w128_d2", "conv_bn", "pool_cnn", "pool_cnn_bn", "vit", "gpt2", "gpt2_l", "bert"]
SEEDS = [0, 1, 2]
OPTS = {"sgd": "sgd", "adamw": "adamw"}


def suite_cells() -> dict:
    return json.load(open(os.path.join(C.RESULTS, SUITE)))["results"]


def at_log2(cell: dict, e: int) -> dict | None:
    """A suite cell's median ± SE (and accuracy) at rate 2^e (None: off its grid)."""
    if not cell or e not in cell.get("lr_log2", []):
        return None
    i = cell["lr_log2"].index(e)
    v = T.at_rate(np.asarray(cell["losses"][cell["metric"]], float), i)
    acc = cell["losses"].get(f"{cell['metric']}_acc")
    if acc is not None:
        v["acc"] = float(np.median(np.asarray(acc, float)[i]))
    return v


def train_at(task: "T.Task", opt: str, lr: float, extra: dict | None = None,
             mode: str = "lr", margin: float = 0.0) -> tuple[dict, list[float], list[float]]:
    """Precondition each seed's framework-default model with ``lr=lr`` (``mode="lr"``) or with
    precondfx's defaults (``mode="default"``: ``lr='auto'``, its first step done by
    ``precondfx.settle_rate`` because the suite's trainer steps its own batched SGD/AdamW, with
    no ``torch.optim`` step to hook; ``tests/pytorch/test_first_step.py`` checks that it and a
    torch.optim first step give one factor) and train it at ``lr`` (the suite's trainer):
    median ± SE (and accuracy), per-seed losses, per-seed factors."""
    import precondfx
    models, facs = [], []
    mom = T.Hyper(opt).momentum if opt == "sgd" else 0.0  # the loop's, as torch.optim's step
    for s in SEEDS:
        calib = task.get(task.sampler(s)[0])[0]
        model, _ = T.build(task, "default", s, calib, opt)
        told = {"lr": lr, "optimizer": opt} if mode == "lr" else {}
        out, rep = precondfx.precondition(model, calib, seed=s, **told, **(extra or {}))
        if mode == "default":
            with C.ceiling_margin(margin):      # 0: the library's ceiling
                precondfx.settle_rate(out, lr, opt, momentum=mom)
        models.append(out.train())
        facs.append(rep.conditioning["lr_target"]["factor"])
    r = T.train_copies(task, models, [lr] * len(SEEDS), SEEDS, T.Hyper(opt), {}, "cpu")
    key = "heldout" if task.kind == "lm" else "test"
    L = np.asarray(r[key], float)
    got = T.at_rate(L[None, :], 0)
    acc = r.get(f"{key}_acc")
    if acc is not None:
        got["acc"] = float(np.median(acc))
    return got, [float(v) for v in L], facs


def run(tasks: list[str], opts: list[str], offsets: list[int], tag: str,
        extra: dict | None = None, mode: str = "lr", margin: float = 0.0) -> None:
    C.setup(1)
    say = C.Progress("keep_rate_check")
    ref = suite_cells()
    rows = []
    for tn in tasks:
        task = T.heldout_task(tn)
        for opt in opts:
            cells = ref[tn][opt]
            for off in offsets:
                e = cells["default"]["best_lr_log2"] + off
                got, per_seed, facs = train_at(task, opt, 2.0 ** e, extra, mode, margin)
                row = {"task": tn, "optimizer": opt, "offset": off, "lr_log2": e, "keep": got,
                       "mode": mode, "ceiling_margin": margin,
                       "options": {k: str(v) for k, v in (extra or {}).items()},
                       "per_seed": per_seed,
                       "factor_log2": [math.log2(f) for f in facs],
                       "default": at_log2(cells["default"], e),
                       "pfx": at_log2(cells.get("pfx", {}), e),
                       "pfx_best": {"best": cells["pfx"]["best"], "se": cells["pfx"]["se"],
                                    "lr_log2": cells["pfx"]["best_lr_log2"]}}
                rows.append(row)
                say(f"{tn} {opt} @2^{e}: {mode} {_cell(got)} (factor "
                    f"2^{np.median(row['factor_log2']):.2f}); framework default "
                    f"{_cell(row['default'])}; precondfx default {_cell(row['pfx'])}")
    C.write_json(os.path.join(C.RESULTS, f"keep_rate_check_{tag}.json"),
                 {"rows": rows, "env": C.env_info(),
                  "command": f"python bench/keep_rate_check.py --tasks {','.join(tasks)} "
                             f"--optimizers {','.join(opts)} --offsets="
                             f"{','.join(map(str, offsets))} --tag {tag}"
                             + (" --lr-scale none" if extra else "")
                             + (f" --mode {mode}" if mode != "lr" else "")
                             + (f" --ceiling-margin {margin:g}" if margin else "")})


def _cell(v: dict | None) -> str:
    if not v or v.get("best") is None or not math.isfinite(v["best"]):
        return "diverged"
    acc = f" ({100 * v['acc']:.1f}%)" if v.get("acc") is not None else ""
    se = v.get("se")
    return f"{v['best']:.4g} ± {se:.3g}{acc}" if se is not None and math.isfinite(se) \
        else f"{v['best']:.4g}{acc}"


def _label(rows: list[dict]) -> str:
    """The column of the runs merged: ``lr=`` given, or the defaults (``lr='auto'``)."""
    modes = {r.get("mode", "lr") for r in rows}
    return {frozenset({"lr"}): "`lr=` given", frozenset({"default"}): "defaults (`lr='auto'`)"
            }.get(frozenset(modes), "this run")


def merge(tags: list[str], out: str = "keep_rate_check") -> None:
    rows, cmds, env = [], [], None
    for t in tags:
        d = json.load(open(os.path.join(C.RESULTS, f"keep_rate_check_{t}.json")))
        rows += d["rows"]
        cmds.append(d["command"])
        env = env or d.get("env")
    rows.sort(key=lambda r: (r["optimizer"], r.get("offset", 0), TASKS.index(r["task"])))
    default = {r.get("mode", "lr") for r in rows} == {"default"}
    lines = ["# precondfx's defaults at the user's learning rate (`lr='auto'`; issue 20)"
             if default else
             "# The user's learning rate, told to precondfx (`lr=`, `optimizer=`; issue 20)", "",
             ("Each task's model preconditioned with precondfx's defaults (under SGD, "
              "`lr='auto'`'s first step at that rate: `precondfx.settle_rate`) and trained at "
              "a rate near the one the suite chose on " if default else
              "Each task's model preconditioned with `lr=` a rate near the one the suite chose on ")
             + f"validation for the framework's own init ({SUITE}; offset in octaves from it)"
             + ("" if default else " and trained at exactly that rate") +
             " (3 seeds, the suite's protocol; median ± SE). "
             "Columns: the framework default and precondfx's default (no `lr=`"
             + (", before `lr='auto'` and the weights' own random stream" if default else "") +
             ") at the same rate, from the suite; precondfx's default at its own chosen rate. "
             "Verdict: "
             "`train_suite.compare` (beyond 2 standard errors).", "",
             "| task | optimizer | rate (offset) | framework default | precondfx default | "
             f"**{_label(rows)}** | factor (log2, per seed) | vs framework default | vs "
             "precondfx default | precondfx default at its rate |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    words = {-1: "better", 0: "within noise", 1: "worse"}
    verdicts: dict[tuple[str, int], list[int]] = {}
    for r in rows:
        off = r.get("offset", 0)
        v = T.compare(r["keep"], r["default"])
        w = T.compare(r["keep"], r["pfx"]) if r["pfx"] else None
        verdicts.setdefault((r["optimizer"], off), []).append(v)
        pb = r["pfx_best"]
        lines.append(f"| {r['task']} | {r['optimizer']} | 2^{r['lr_log2']} ({off:+d}) | "
                     f"{_cell(r['default'])} | {_cell(r['pfx'])} | **{_cell(r['keep'])}** | "
                     f"{' / '.join(f'{f:.2f}' for f in r['factor_log2'])} | {words[v]} | "
                     f"{words.get(w, '-')} | {_cell(pb)} @2^{pb['lr_log2']} |")
    lines.append("")
    for (opt, off), vs in sorted(verdicts.items()):
        lines.append(f"- {opt}, offset {off:+d}: never worse than the framework default beyond "
                     f"the noise on {sum(v <= 0 for v in vs)} of {len(vs)} tasks, better on "
                     f"{sum(v < 0 for v in vs)}")
    lines += ["", "Reproduce:", ""] + [f"    {c}" for c in cmds] + \
        [f"    python bench/keep_rate_check.py --merge {','.join(tags)} --out {out}", "",
         f"Environment of the runs: {env}"]
    write_table(os.path.join(C.RESULTS, out), lines, {"rows": rows, "env": env})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--optimizers", default="sgd,adamw")
    ap.add_argument("--offsets", default="0",
                    help="octaves from the framework default's chosen rate, e.g. -1,0,1")
    ap.add_argument("--lr-scale", default="default", choices=("default", "none"),
                    help="none: lr_scale=None under lr= (the curvature route on every model)")
    ap.add_argument("--mode", default="lr", choices=("lr", "default"),
                    help="lr: precondition with lr= the rate; default: precondfx's defaults "
                         "(lr='auto', as a torch.optim loop meets them)")
    ap.add_argument("--ceiling-margin", type=float, default=0.0,
                    help="--mode default: an experiment, the SGD ceiling this many octaves above "
                         "the suggested rate (common.ceiling_margin; 0: the library's)")
    ap.add_argument("--tag", default="all")
    ap.add_argument("--merge", default="", help="comma-separated tags of finished runs")
    ap.add_argument("--out", default="keep_rate_check", help="--merge: the table's file name")
    a = ap.parse_args(argv)
    if a.merge:
        merge([t for t in a.merge.split(",") if t], a.out)
        return
    run([t for t in a.tasks.split(",") if t], [o for o in a.optimizers.split(",") if o],
        [int(o) for o in a.offsets.split(",") if o], a.tag,
        {"lr_scale": None} if a.lr_scale == "none" else None, a.mode, a.ceiling_margin)


if __name__ == "__main__":
    main()
