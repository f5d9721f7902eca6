"""lr_scale="sgd" is a learning-rate change, exactly: with one global c, every stored parameter
(weights and biases) is the default model's divided by c, so SGD with momentum at rate lr on it
follows the default model trained at lr * c^2.  This trains both side by side on the depth-16
digits MLP of ``bench/train_suite.py`` (seed 0, its minibatches) and prints the largest logit
difference every 20 steps: equal to float rounding at first, then apart as rounding errors grow
(the sweep's differences between the two at the same effective rate are this chaos, not a
systematic effect).

    python bench/lr_scale_sgd_equivalence.py          # about 10 s, one thread
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_suite as TS  # noqa: E402


def main(task: str = "mlp_w128_d16", log2_lr: float = -3.0, steps: int = 100) -> list[tuple]:
    import precondfx
    torch.set_num_threads(1)
    t = TS.select(TS.all_tasks(dict(TS.SIZES["cpu_lr"], libsvm=False)), [task])[0]
    samp = t.sampler(0)
    x, y = t.get(samp[0])
    torch.manual_seed(0)
    m0 = t.make()
    a, _ = precondfx.precondition(m0, x, seed=0)
    b, rep = precondfx.precondition(m0, x, seed=0, lr_scale="sgd")
    c = set(rep.conditioning["lr_scale"]["factors"].values())
    assert len(c) == 1, c
    c2 = c.pop() ** 2
    lr = 2.0 ** log2_lr
    oa = torch.optim.SGD(a.parameters(), lr=lr * c2, momentum=0.9)
    ob = torch.optim.SGD(b.parameters(), lr=lr, momentum=0.9)
    rows = []
    print(f"{task}: lr_scale='sgd' at 2^{log2_lr:g} vs default at 2^{log2_lr:g} x c^2 = "
          f"{lr * c2:.4g}")
    for step in range(steps):
        xb, yb = t.get(samp[step])
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            F.cross_entropy(m(xb), yb).backward()
            o.step()
        if step % 20 == 19:
            with torch.no_grad():
                d = float((a(x) - b(x)).abs().max())
                la, lb = float(F.cross_entropy(a(x), y)), float(F.cross_entropy(b(x), y))
            rows.append((step + 1, d, la, lb))
            print(f"step {step + 1:4d}  max |logit diff| {d:.3g}   loss default {la:.4f}  "
                  f"lr_scale {lb:.4f}")
    return rows


if __name__ == "__main__":
    main()
