"""Flat residual scale against per-block schedules on the training suite's NF-ResNet (issue 24).

Runs ``bench/train_suite.py`` on its ``nf_resnet`` task (normalization-free ResNet, 4 basic
blocks, 16x16 digits, 3 epochs, batch 32) with SGD (momentum 0.9) for three precondfx variants,
each at its own best learning rate (a grid of 8 powers of two, widened at the edges), 3 seeds:

* ``pfx``: the default, flat ``s = 1/sqrt(4) = 0.5`` (every beta 1);
* ``pfx_s_nf``: ``residual_scale="nf"``, the NF-ResNet schedule ``s_l = 0.2/sqrt(1+0.04(l-1))``;
* ``pfx_s_nf1``: ``residual_scale="nf:1"``, ``s_l = 1/sqrt(l)`` (betas 1, 0.87, 0.82, 0.79).

Writes docs/results/beta_schedule.json (the suite's payload, plus each variant's s and beta)
and docs/results/beta_schedule.md.  One core (``--threads 1``), about 10 CPU minutes.

    nice -n 10 python bench/beta_schedule.py
    python bench/beta_schedule.py --from /tmp/x/train_suite_beta_schedule.json   # render only
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import train_suite as T  # noqa: E402

METHODS = ["pfx", "pfx_s_nf", "pfx_s_nf1"]
SUITE_ARGS = ["--tasks", "nf_resnet", "--methods", ",".join(METHODS), "--optimizers", "sgd",
              "--seeds", "3", "--n-lr", "8", "--threads", "1"]
OUT = os.path.join(os.path.dirname(HERE), "docs", "results", "beta_schedule")


def schedules() -> dict:
    """Each variant's planned s and beta per block on the task's model."""
    import precondfx
    torch.manual_seed(0)
    x = torch.randn(32, 3, 16, 16)
    out = {}
    for m in METHODS:
        rep = precondfx.analyze(T.NFResNet(), x, **T.PFX[m])
        out[m] = {"residual_scale": T.PFX[m].get("residual_scale", "auto"),
                  "s": [r.s for r in rep.plan.residuals],
                  "beta": [r.beta for r in rep.plan.residuals]}
    return out


def table(d: dict) -> list[str]:
    """One row per variant: its s and beta, best rate, final loss there, per-rate medians."""
    lines = ["| variant | s_l | beta_l | best lr | train loss (median ± se, 3 seeds) | "
             "held-out at best | median train loss per lr (log2 lr: loss) |",
             "|---|---|---|---|---|---|---|"]
    for m in METHODS:
        r = d["results"]["nf_resnet"]["sgd"].get(m)
        sch = d["schedules"][m]
        if r is None:
            lines.append(f"| {m} | | | not run | | | |")
            continue
        se = f" ± {r['se']:.3f}" if r.get("se") is not None else ""
        per = ", ".join(f"{e}: {v:.3f}" if v is not None else f"{e}: diverged"
                        for e, v in zip(r["lr_log2"], r["median"]))
        lines.append(f"| `{m}` (`{sch['residual_scale']}`) | "
                     f"{', '.join(f'{v:.3g}' for v in sch['s'])} | "
                     f"{', '.join(f'{v:.3g}' for v in sch['beta'])} | 2^{r['best_lr_log2']}"
                     f"{' (edge)' if r.get('at_edge') else ''} | {r['best']:.3f}{se} | "
                     f"{r.get('heldout_at_best', float('nan')):.3f} | {per} |")
    return lines


def verdict(d: dict) -> list[str]:
    """Each schedule against the flat default: lower, higher or a tie within 2 combined
    standard errors (``train_suite.compare``)."""
    res = d["results"]["nf_resnet"]["sgd"]
    out = []
    if any(res.get(m) is None for m in METHODS):
        return ["- not every variant ran: no verdict"]
    for m in METHODS[1:]:
        c = T.compare(res.get(m), res.get("pfx"))
        word = {-1: "lower than", 1: "higher than", 0: "a tie with"}[c]
        out.append(f"- `{m}`: final training loss {word} the flat default's (2 combined "
                   f"standard errors over seeds).")
    wins = [m for m in METHODS[1:] if T.compare(res.get(m), res.get("pfx")) < 0]
    out.append("- Default: " + ("the evidence favours a schedule (" + ", ".join(wins) + ")"
                                if wins else "stays flat (`residual_scale='auto'`): no schedule "
                                "beat it beyond the noise"))
    return out


def write(d: dict, command: str, notes: list[str] = ()) -> None:
    d = dict(d, schedules=schedules(), command_issue24=command, notes_issue24=list(notes))
    with open(OUT + ".json", "w") as f:
        json.dump(d, f, indent=1)
    md = ["# Flat s against per-block schedules (issue 24)", "",
          "Task `nf_resnet` of bench/train_suite.py (normalization-free ResNet: stem, 4 basic "
          "blocks 32-64 channels, global pool, linear; 16x16 digits, 3 epochs, batch 32), SGD "
          "momentum 0.9, each variant at its best learning rate on a grid of powers of two "
          "(8 rates, widened at the edges), 3 seeds; loss = final full training-set "
          "cross-entropy.  Every variant is precondfx's default pass (geometric init, measured "
          "balancing, output std 1) with only `residual_scale` changed.", "",
          f"Command: `{command}` (one core, nice -n 10; wall {d.get('wall_s', 0):.0f} s on a "
          f"shared 2-core machine).", ""] + table(d) + ["", "## Verdict", ""] + verdict(d) + (
              ["", "## Notes", ""] + [f"- {n}" for n in notes] if notes else [])
    with open(OUT + ".md", "w") as f:
        f.write("\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="src", default="", help="render an existing suite JSON")
    ap.add_argument("--note", action="append", default=[], help="a line for the Notes")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.src:
        with open(args.src) as f:
            d = json.load(f)
        write(d, " ".join(["python bench/train_suite.py"] + SUITE_ARGS)
              + f"; python bench/beta_schedule.py --from {os.path.basename(args.src)}",
              args.note)
        return
    tmp = tempfile.mkdtemp()
    d = T.main(SUITE_ARGS + ["--out", tmp, "--tag", "beta_schedule"])
    write(d, "python bench/beta_schedule.py")


if __name__ == "__main__":
    main()
