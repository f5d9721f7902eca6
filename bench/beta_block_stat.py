"""Does App. E's beta recurrence equalize the blocks?  (issue 24, a side measurement)

On the 6-block App. E bottleneck ResNet of tests/pytorch/test_beta.py (no normalization,
balance='none', geometric init), the measured Hessian-block statistic of each weight
(``measure=True``; 64 samples) is averaged per block (geometric mean over the block's three
convolutions, then over seeds), for a flat s=0.5 (every beta 1) and for the hand schedule with
the paper's betas.  If the betas make every block's conditioning equal, the per-block values
are equal under the schedule.  Printed beside them: ``s^4/(1+s^2)^2 / beta^4``, what App.
E.1's own gamma formula gives per block (``gamma_l ~ s_l^4 V_l E[dz_{l+1}^2]/(1+s_l^2)`` with
``V_l E[dz_{l+1}^2] ~ 1/(1+s_l^2)``), times the beta constant's ``beta^-4``.

    python bench/beta_block_stat.py            # writes docs/results/beta_block_stat.json
"""
from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import precondfx  # noqa: E402
from tests.pytorch.test_beta import SCHEDULE, NFResNet, _app_e_betas, _x  # noqa: E402

SEEDS = 3


def block_stats(rs: object) -> list[float]:
    """Per block, the geometric mean (over convolutions and seeds) of the measured statistic."""
    logs = []
    for seed in range(SEEDS):
        torch.manual_seed(seed)
        _, rep = precondfx.precondition(NFResNet(), _x(64), residual_scale=rs, balance="none",
                                        measure=True, seed=seed)
        v = rep.conditioning["measure"]["after"]["values"]
        logs.append([np.mean([math.log(v[f"blocks.{i}.{c}.weight"]) for c in ("c0", "c1", "c2")])
                     for i in range(len(SCHEDULE))])
    m = np.exp(np.mean(logs, 0))
    return list(m / m[0])


def main() -> dict:
    torch.set_num_threads(1)
    s, b = np.array(SCHEDULE), np.array(_app_e_betas(SCHEDULE))
    pred = (s ** 2 / (1 + s ** 2)) ** 2 / b ** 4
    out = {"schedule": SCHEDULE, "paper_betas": list(b), "seeds": SEEDS,
           "flat_s0.5": block_stats(0.5), "schedule_paper_betas": block_stats(SCHEDULE),
           "e1_formula_over_beta4": list(pred / pred[0]),
           "command": "python bench/beta_block_stat.py"}
    for k in ("flat_s0.5", "schedule_paper_betas", "e1_formula_over_beta4"):
        v = out[k]
        print(f"{k:24s}", " ".join(f"{x:7.3f}" for x in v), f" spread {max(v) / min(v):.3g}")
    with open(os.path.join(ROOT, "docs", "results", "beta_block_stat.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
