"""Experiment (issue 11, item 3): does ``lr_scale="adam"`` lose on GPT-2 because every layer gets
the same relative Adam step?  Runs ``bench/train_suite.py`` with one extra method,
``pfx_lr_roles``: ``lr_scale="adam"`` plus per-parameter learning-rate multipliers (the suite's
``lr_mult``) for what the rule treats alike or not at all: ``--norm-mult`` for the LayerNorm
gains and shifts (not covered by lr_scale: they train at the raw rate) and ``--block-mult`` for
the weights and biases inside the transformer blocks (``.h.`` in the name), against the
embeddings and the head.  ``--branch-adam`` sets ``precondfx.pytorch.lr_transfer.BRANCH_ADAM`` (default
1: every layer at the same relative step, the rule these runs were measured on; the library
now uses 4, which these runs led to).  Every other argument goes to the suite.

    python bench/lr_scale_roles.py --norm-mult 8 --block-mult 1 --cpu-small --tasks gpt2 \\
        --optimizers adamw --methods pfx_lr_roles --seeds 5 --tag cpu_lr2_gpt2_roles_n8
    python bench/lr_scale_roles.py --norm-mult 8 --block-mult 4 ... --tag cpu_lr2_gpt2_roles_n8b4
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_suite as TS  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    raise SystemExit("this experiment measured the first lr_scale='adam' rule (fan-in power 1, "
                     "branch multiplier), removed in 2026-11 (docs/results/heldout_cpu.md); the "
                     "present 'adam' rule is another one: run it at commit aa5b8de of branch "
                     "bench")
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--norm-mult", type=float, default=1.0)
    ap.add_argument("--block-mult", type=float, default=1.0)
    ap.add_argument("--branch-adam", type=float, default=1.0)
    args, rest = ap.parse_known_args(argv)
    from precondfx.pytorch import lr_transfer
    lr_transfer.BRANCH_ADAM = args.branch_adam
    orig = TS.build

    def build(task, method, seed, calib, opt):  # noqa: ANN001, ANN202
        if method != "pfx_lr_roles":
            return orig(task, method, seed, calib, opt)
        m, _ = orig(task, "pfx_lr", seed, calib, opt)
        mult = {}
        for n, _p in m.named_parameters():
            if ".ln_" in n or n.startswith("transformer.ln_f"):
                mult[n] = args.norm_mult
            elif ".h." in n:
                mult[n] = args.block_mult
        return m, mult

    TS.build = build
    TS.PER_OPTIMIZER = TS.PER_OPTIMIZER + ("pfx_lr_roles",)
    TS.PFX["pfx_lr_roles"] = {}
    TS.LABELS["pfx_lr_roles"] = (f"pfx_lr, norm lr x{args.norm_mult:g}, "
                                 f"block lr x{args.block_mult:g}")
    return TS.main(rest)


if __name__ == "__main__":
    main()
