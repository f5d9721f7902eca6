"""Benchmark: a 50-layer plain conv net on scikit-learn's digits, default init vs precondfx vs TAT.

The network: 50 3x3 convolutions of width 16 with a ReLU after each (50 nonlinear layers), no
normalization, no skip connections; stride-2 convolutions at layers 1 and 30 take 8x8 to 4x4
to 2x2 (early reductions keep a CPU step near 40 ms); global average pooling and a linear head
(10 classes).  Training: SGD with momentum 0.9, batch 64, a fixed number of steps (300),
cross-entropy; the training loss after the budget is measured on the whole training split
(1437 images; 360 held out for accuracy).  Inputs are scaled to [0, 1] and standardized (one
mean and std over all pixels), the same for every method.

Methods, each at its best learning rate from the sweep (lowest mean final training loss over
seeds; diverged runs count as infinite loss):

* ``default``: PyTorch's default initialization (kaiming-uniform with a = sqrt(5));
* ``precondfx``: ``precondfx.precondition(model, sample)``, the core scheme with its defaults;
* ``tat``: ``precondfx.precondition(model, sample, scheme="tat")`` (TReLU, eta = 0.9,
  Delta-orthogonal convolutions, the pipeline's output scale 0.05);
* ``tat_nostd``: ``scheme="tat", target_std=None`` (no output scale: the paper's setting);
* ``tat_pln`` (``--pln``): like ``tat`` on inputs with per-location normalization
  (``precondfx.schemes.tat.per_location_normalize``: a homogeneous channel, so 2 input channels).

Run ``python bench/bench_tat_digits.py`` (about 10 minutes on 2 idle cores: 5 learning rates,
3 seeds, 4 methods) to write ``docs/results/tat_digits.json`` and ``docs/results/tat_digits.png``; ``--quick`` is a smoke run
under a minute (40 steps, two learning rates, one seed) that writes to a temporary folder unless
``--out`` is given.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import precondfx  # noqa: E402
from precondfx.schemes.tat import per_location_normalize  # noqa: E402

DEPTH, WIDTH, STRIDES = 50, 16, (1, 30)


def make_net(in_ch: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    c = in_ch
    for i in range(1, DEPTH + 1):
        layers += [nn.Conv2d(c, WIDTH, 3, stride=2 if i in STRIDES else 1, padding=1), nn.ReLU()]
        c = WIDTH
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(WIDTH, 10)]
    return nn.Sequential(*layers)


def load(pln: bool) -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))
    x, y = x[perm], y[perm]
    n_tr = 1437
    if pln:
        x = per_location_normalize(x)          # (N, 2, 8, 8), q = 1 at every pixel
    else:
        m, s = x[:n_tr].mean(), x[:n_tr].std()
        x = (x - m) / s
    return x[:n_tr], y[:n_tr], x[n_tr:], y[n_tr:]


def build(method: str, seed: int, xtr: torch.Tensor) -> tuple[nn.Module, dict]:
    net = make_net(xtr.shape[1], seed)
    sample = xtr[:256]
    info: dict = {}
    if method == "default":
        return net, info
    scheme = "tat" if method.startswith("tat") else "geometric"
    kw = {"target_std": None} if method == "tat_nostd" else {}
    out, rep = precondfx.precondition(net, sample, scheme=scheme, seed=seed, **kw)
    info = {"output_scale": rep.output_scale}     # the pipeline's output multiplier
    if scheme == "tat":
        t = rep.conditioning["tat"]
        info.update(negative_slope=t["negative_slope"], trelu_scale=t["output_scale"])
    return out, info


def train(model: nn.Module, data: tuple, lr: float, steps: int, seed: int, log_every: int
          ) -> dict:
    xtr, ytr, xte, yte = data
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(10_000 + seed)
    curve, run, order, pos = [], [], torch.randperm(len(xtr), generator=g), 0
    model.train()
    for step in range(1, steps + 1):
        if pos + 64 > len(order):
            order, pos = torch.randperm(len(xtr), generator=g), 0
        idx = order[pos:pos + 64]
        pos += 64
        loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
        if not torch.isfinite(loss):
            return {"final_loss": math.inf, "test_acc": 0.0, "curve": curve, "diverged": step}
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        run.append(float(loss.detach()))
        if step % log_every == 0:
            curve.append([step, float(np.mean(run))])
            run = []
    model.eval()
    with torch.no_grad():
        out_tr = model(xtr)
        final = float(F.cross_entropy(out_tr, ytr))
        acc = float((model(xte).argmax(1) == yte).float().mean())
    return {"final_loss": final if math.isfinite(final) else math.inf, "test_acc": acc,
            "curve": curve}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI smoke run (< 1 minute)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--lrs", type=float, nargs="*", default=None)
    ap.add_argument("--pln", action="store_true", help="also run TAT on PLN inputs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--out", default=None, help="output folder (default docs/results; "
                    "a temporary folder with --quick)")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    steps = args.steps or (40 if args.quick else 300)
    seeds = list(range(args.seeds or (1 if args.quick else 3)))
    lrs = args.lrs or ([0.001, 0.01] if args.quick else [0.0003, 0.001, 0.003, 0.01, 0.03])
    methods = ["default", "precondfx", "tat", "tat_nostd"] + (["tat_pln"] if args.pln else [])
    out_dir = args.out or (tempfile.mkdtemp(prefix="tat_digits_") if args.quick else
                           os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "docs", "results"))
    os.makedirs(out_dir, exist_ok=True)
    data = {False: load(False)}
    if args.pln:
        data[True] = load(True)
    log_every = max(1, steps // 40)
    t0 = time.time()
    runs: dict = {}
    for method in methods:
        d = data[method == "tat_pln"]
        for seed in seeds:
            base, info = build(method, seed, d[0])
            for lr in lrs:
                model = __import__("copy").deepcopy(base)
                r = train(model, d, lr, steps, seed, log_every)
                r.update(info)
                runs.setdefault(method, {}).setdefault(str(lr), []).append(r)
                print(f"[{time.time() - t0:6.1f}s] {method:9s} seed {seed} lr {lr:<5g} "
                      f"final train loss {r['final_loss']:.4f}  test acc {r['test_acc']:.3f}",
                      flush=True)
    summary = {}
    for method, by_lr in runs.items():
        means = {lr: float(np.mean([r["final_loss"] for r in rs])) for lr, rs in by_lr.items()}
        best = min(means, key=lambda k: means[k])
        rs = by_lr[best]
        losses = [r["final_loss"] for r in rs]
        summary[method] = {
            "best_lr": float(best), "best_lr_at_grid_edge": best in (str(lrs[0]), str(lrs[-1])),
            "final_loss_mean": float(np.mean(losses)),
            "final_loss_std": float(np.std(losses)) if all(map(math.isfinite, losses)) else None,
            "test_acc_mean": float(np.mean([r["test_acc"] for r in rs])),
            "loss_by_lr": means,
            **{k: rs[0][k] for k in ("negative_slope", "output_scale") if k in rs[0]},
        }
    result = {"config": {"depth": DEPTH, "width": WIDTH, "strides_at": STRIDES, "steps": steps,
                         "batch": 64, "optimizer": "SGD momentum 0.9", "lrs": lrs,
                         "seeds": seeds, "quick": args.quick, "torch": torch.__version__,
                         "threads": torch.get_num_threads(),
                         "wall_s": round(time.time() - t0, 1)},
              "summary": summary, "runs": runs}
    print()
    print(table(result))
    with open(os.path.join(out_dir, "tat_digits.json"), "w") as f:
        json.dump(result, f, indent=1, default=lambda o: None)
    plot(result, os.path.join(out_dir, "tat_digits.png"))
    print(f"\nwrote {out_dir}/tat_digits.json and tat_digits.png")
    return result


def table(result: dict) -> str:
    cfg = result["config"]
    lines = [f"digits, plain conv net depth {cfg['depth']} width {cfg['width']}, "
             f"{cfg['steps']} SGD steps (batch 64, momentum 0.9), {len(cfg['seeds'])} seed(s), "
             f"best of lr {cfg['lrs']}",
             f"{'method':10} {'best lr':>8} {'train loss':>18} {'test acc':>9}   "
             f"loss at each lr"]
    for m, s in result["summary"].items():
        std = f" +- {s['final_loss_std']:.3f}" if s["final_loss_std"] is not None else ""
        per = " ".join(f"{v:.3f}" if math.isfinite(v) else "div" for v in s["loss_by_lr"].values())
        edge = "*" if s["best_lr_at_grid_edge"] else " "
        lines.append(f"{m:10} {s['best_lr']:>7g}{edge} {s['final_loss_mean']:>9.4f}{std:9s} "
                     f"{s['test_acc_mean']:>9.3f}   {per}")
    lines.append("(* best learning rate at the edge of the grid)")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (m, s) in enumerate(result["summary"].items()):
        rs = result["runs"][m][str(s["best_lr"])]
        n = min(len(r["curve"]) for r in rs)
        if n == 0 or not math.isfinite(s["final_loss_mean"]):
            ax.plot([], [], ls="none", label=f"{m}: diverged at every lr")
            continue
        steps = [p[0] for p in rs[0]["curve"][:n]]
        ys = np.array([[p[1] for p in r["curve"][:n]] for r in rs])
        mu = ys.mean(0)
        ax.plot(steps, mu, color=f"C{i}", label=f"{m} (lr {s['best_lr']:g})")
        if len(rs) > 1:
            ax.fill_between(steps, ys.min(0), ys.max(0), color=f"C{i}", alpha=0.2)
    cfg = result["config"]
    ax.set_xlabel("SGD step")
    ax.set_ylabel("training loss (running mean; band: min-max over seeds)")
    ax.set_yscale("log")
    ax.set_title(f"digits, plain {cfg['depth']}-layer conv net, best lr per method")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
