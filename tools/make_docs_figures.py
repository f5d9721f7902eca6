"""Draw the figures of the documentation's Concepts page (docs/img/), from a real run.

Run:  PYTHONPATH=. python tools/make_docs_figures.py
It preconditions the quickstart CNN (examples/quickstart.py) with ``measure=True`` and saves
``report.plot``'s figures: per-layer Hessian-block statistic before/after, and the block
matrix of the paper's Fig. 1 after the pass.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import precondfx  # noqa: E402
from examples.quickstart import SmallCNN  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, images = SmallCNN(), torch.randn(64, 3, 32, 32)
    _, report = precondfx.precondition(model, images, measure=True)
    print(report)
    out = os.path.join(ROOT, "docs", "img")
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = report.plot(os.path.join(tmp, "quickstart.png"))
        for p in paths:
            shutil.copy(p, os.path.join(out, os.path.basename(p)))
            print("wrote", os.path.join("docs", "img", os.path.basename(p)))


if __name__ == "__main__":
    main()
