"""What does ``lr='auto'`` (the default) cost at the optimizer's first step, in training steps?

At the first ``step()`` of a ``torch.optim.SGD`` the default measures the rewritten model's SGD
curvature on the kept calibration batch (the measurement ``lr=`` runs inside ``precondition``:
at most 20 power iterations of Jacobian-vector products, stopped once converged, re-measured up to 3 times) and rescales the
stored weights (``precondfx.pytorch.first_step``).  For each model of ``bench/cost.py``'s
families, this script times, in one process and one thread:

* a training step (SGD momentum 0.9: zero_grad, forward, cross-entropy, backward, step; the
  median of ``--steps`` steps after the first) of the result with ``lr=None``;
* the first step of that result (which allocates the momentum buffers) and the first step of
  the default result (which also fires), and reports their difference in training steps;
* the bytes of the calibration batch the default keeps until that step, and the difference in
  ``precondition``'s own time (the default also plans the ``lr`` multipliers).

    python bench/first_step_cost.py              # MLPs, the strided AlexNet, GPT-2: ~2 min
    python bench/first_step_cost.py --resnet50   # plus ResNet-50 (224x224, batch 8): ~10 min

Writes docs/results/first_step_cost.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import cost  # noqa: E402
from results_io import write_table  # noqa: E402

import precondfx  # noqa: E402


def _step(model, loss_fn, opt) -> float:
    t = time.perf_counter()
    opt.zero_grad()
    loss_fn(model).backward()
    opt.step()
    return time.perf_counter() - t


def _bytes(sample) -> int:
    ts = list(sample.values()) if isinstance(sample, dict) else [sample]
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def measure(name: str, build, steps: int) -> dict:
    model, sample, loss_fn, fwd = build()
    t0 = time.perf_counter()
    off, _ = precondfx.precondition(model, sample, lr=None, **fwd)
    t_off = time.perf_counter() - t0
    t0 = time.perf_counter()
    auto, rep = precondfx.precondition(model, sample, **fwd)
    t_auto = time.perf_counter() - t0
    o_off = torch.optim.SGD(off.parameters(), lr=0.05, momentum=0.9)
    o_auto = torch.optim.SGD(auto.parameters(), lr=0.05, momentum=0.9)
    first_off = _step(off, loss_fn, o_off)
    first_auto = _step(auto, loss_fn, o_auto)
    step = statistics.median(_step(off, loss_fn, o_off) for _ in range(steps))
    sec = rep.conditioning.get("lr_target", {})
    return {"model": name, "step_s": step, "first_step_off_s": first_off,
            "first_step_auto_s": first_auto,
            "fire_in_steps": (first_auto - first_off) / step,
            "precondition_extra_s": t_auto - t_off, "precondition_off_s": t_off,
            "kept_batch_bytes": _bytes(sample), "factor": sec.get("factor"),
            "rounds": len(sec.get("rounds", [])), "summary": sec.get("summary")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--resnet50", action="store_true")
    a = ap.parse_args(argv)
    C.setup(1)
    say = C.Progress("first_step_cost")
    fams = ["mlp", "conv", "gpt2"] + (["resnet50"] if a.resnet50 else [])
    rows = []
    for fam, name, build, _ in cost.models(False, fams):
        if fam == "resnet50" and "no norm" not in name:
            continue
        r = measure(name, build, a.steps)
        rows.append(r)
        say(f"{name}: first step +{r['fire_in_steps']:.1f} training steps "
            f"(factor {r['factor']:.3g}, {r['rounds']} rounds)")
    lines = ["# `lr='auto'`: the cost of its first step", "",
             "One thread, one process; SGD momentum 0.9. \"first step\": the default's first "
             "step minus the first step of the same result with `lr=None`, in training steps "
             "(the median step of the `lr=None` result). The kept batch is released at that "
             "step.", "",
             "| model | training step (s) | first step: extra, in steps | factor (rounds) | "
             "kept batch (KiB) | precondition: extra (s) of (s) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['step_s']:.4f} | {r['fire_in_steps']:.1f} | "
                     f"{r['factor']:.3g} ({r['rounds']}) | {r['kept_batch_bytes'] / 1024:.0f} | "
                     f"{r['precondition_extra_s']:+.3f} of {r['precondition_off_s']:.3f} |")
    lines += ["", f"Reproduce: `python bench/first_step_cost.py"
                  f"{' --resnet50' if a.resnet50 else ''}`", "",
              f"Environment: {C.env_info()}"]
    write_table(os.path.join(C.RESULTS, "first_step_cost"), lines,
                {"rows": rows, "env": C.env_info()})


if __name__ == "__main__":
    main()
