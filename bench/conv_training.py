"""Training curves of the paper's strided AlexNet (App. F, Fig. 3) per initialization.

Model: ``zoo.alexnet_strided`` (11x11 / 5x5 / 3x3 circular-padded convolutions with striding
instead of max-pooling, then 3 linear layers), widths divided by ``--width-div`` (8 by
default).  Data: scikit-learn's digits (1797 8x8 images, 10 classes), upsampled bilinearly to
``--image`` (16 by default) with the gray level repeated over 3 channels, scaled to [-1, 1]
(the paper's CIFAR-10 normalization; no augmentation).  Every method's logits are multiplied by
one fixed scalar chosen on the first minibatch so that their std is 0.05 (paper Sec. 8.1).
SGD with momentum 0.9 and no weight decay (App. F), constant learning rate; for each method the
best learning rate of a small power-of-two sweep (by the final full-training-set loss, mean over
seeds) is kept and its curve plotted (minibatch loss, window mean over ``--window`` steps,
averaged over seeds).

Methods: PyTorch default, fan-in, geometric (precondfx balance='none'), the paper's
preconditioned variant (geometric + Sec. 5 alphas: precondfx balance='analytic'), precondfx's
default (balance='auto') and precondfx balance='hessian'.

    python bench/conv_training.py            # ~10 minutes on one CPU thread
    python bench/conv_training.py --quick    # CI smoke run

The copies are trained one after the other (a vmap-batched conv ran ~3x slower per copy on CPU
than a plain loop: grouped convolutions with 11x11 circular padding are slow there).

Writes docs/results/conv_training[_quick].json and .png.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

from tests import zoo  # noqa: E402

METHODS = ["default", "fan_in", "geometric", "precondfx_analytic", "precondfx",
           "precondfx_hessian"]


def train_one(model, X, y, order, lr, *, batch, epochs, momentum, device, eval_every):
    model.to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    spe = len(y) // batch
    losses, evals = [], []
    for t in range(epochs * spe):
        e, j = divmod(t, spe)
        idx = order[e, j * batch:(j + 1) * batch]
        loss = F.cross_entropy(model(X[idx]), y[idx])
        if not torch.isfinite(loss):
            losses += [math.inf] * (epochs * spe - t)
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if eval_every and (t + 1) % eval_every == 0:
            evals.append(full_loss(model, X, y))
    return losses, full_loss(model, X, y), evals


@torch.no_grad()
def full_loss(model, X, y, chunk=512):
    tot = 0.0
    for i in range(0, len(y), chunk):
        tot += float(F.cross_entropy(model(X[i:i + chunk]), y[i:i + chunk], reduction="sum"))
    v = tot / len(y)
    return v if math.isfinite(v) else math.inf


def window(xs, w):
    xs = np.asarray(xs, dtype=float)
    n = len(xs) // w
    return xs[:n * w].reshape(n, w).mean(1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--width-div", type=int, default=8)
    ap.add_argument("--image", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--lrs", default="-2,-4,-6,-8", help="LR exponents (2^k), comma list")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--target-std", type=float, default=0.05)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--window", type=int, default=14)
    C.add_run_args(ap)
    args = C.parse_run_args(ap, argv)
    methods = [m for m in args.methods.split(",") if m]
    lrs = [2.0 ** int(k) for k in args.lrs.split(",")]
    if args.quick:
        args.image, args.width_div, args.epochs, args.seeds = 16, 16, 1, 1
        lrs = [2.0 ** -3]
        methods = ["default", "geometric", "precondfx"]
        args.window = 4
    tag = args.tag or ("quick" if args.quick else "")
    say = C.Progress("conv")
    X, y = C.digits_images(args.image)
    n_sub = 384 if args.quick else len(y)
    X, y = X[:n_sub].to(args.device), y[:n_sub].to(args.device)
    seeds = list(range(args.seeds))
    orders = C.orders(seeds, len(y), args.epochs)

    def make(s):
        return zoo.alexnet_strided(s, width_div=args.width_div, image=args.image,
                                   batch=args.batch)[0]

    n_params = sum(p.numel() for p in make(0).parameters())
    say(f"strided AlexNet /{args.width_div} ({n_params} params), digits {args.image}x{args.image}"
        f" x3, {len(y)} images, batch {args.batch}, {args.epochs} epochs, LRs "
        f"{[f'2^{int(math.log2(l))}' for l in lrs]}, seeds {seeds}, methods {methods}")
    runs: dict[str, dict] = {}
    for m in methods:
        runs[m] = {"lrs": lrs, "final": [], "curves": []}
        models = {}
        for s in seeds:
            calib = X[orders[s][0, :args.batch]].cpu()
            models[s] = C.build(m, make, s, calib, args.target_std)
        for lr in lrs:
            fin, cur = [], []
            for s in seeds:
                import copy
                model = copy.deepcopy(models[s])
                losses, f, _ = train_one(model, X, y, orders[s].to(args.device), lr,
                                         batch=args.batch, epochs=args.epochs,
                                         momentum=args.momentum, device=args.device,
                                         eval_every=0)
                fin.append(f)
                cur.append(losses)
            runs[m]["final"].append(fin)
            runs[m]["curves"].append(cur)
            say(f"{m:20} lr 2^{int(math.log2(lr)):>3}: final train loss "
                + " ".join(f"{v:.4f}" for v in fin))
        mean_fin = [float(np.mean(f)) for f in runs[m]["final"]]
        b = int(np.nanargmin(np.where(np.isfinite(mean_fin), mean_fin, np.nan))) \
            if any(np.isfinite(mean_fin)) else 0
        runs[m]["best_lr"] = lrs[b]
        runs[m]["best_lr_index"] = b
        runs[m]["best_final_mean"] = mean_fin[b]
        runs[m]["best_final_per_seed"] = runs[m]["final"][b]
        runs[m]["best_at_edge"] = len(lrs) > 1 and b in (0, len(lrs) - 1)
        cur = np.array([window(c, args.window) for c in runs[m]["curves"][b]])
        runs[m]["best_curve"] = cur.mean(0)
        runs[m]["best_curve_steps"] = (np.arange(cur.shape[1]) + 1) * args.window
    table = {m: {"best_lr": runs[m]["best_lr"], "final_train_loss": runs[m]["best_final_mean"],
                 "best_at_edge": runs[m]["best_at_edge"],
                 "final_per_lr": [float(np.mean(f)) for f in runs[m]["final"]]}
             for m in methods}
    payload = {"setup": {"model": f"alexnet_strided width_div={args.width_div}",
                         "params": n_params, "image": args.image, "data": "sklearn digits "
                         "upsampled, 3 channels, [-1,1]", "n_train": len(y),
                         "batch": args.batch, "epochs": args.epochs, "seeds": seeds,
                         "momentum": args.momentum, "weight_decay": 0.0,
                         "target_std": args.target_std, "lrs": lrs, "window": args.window},
               "notes": {m: C.method_note(m) for m in methods if C.method_note(m)},
               "table": table, "runs": runs, "env": C.env_info(), "wall_s": say.elapsed()}
    name = "conv_training" + (f"_{tag}" if tag else "")
    jpath = C.write_json(os.path.join(args.out, name + ".json"), payload)
    try:
        plot(payload, methods, os.path.join(args.out, name + ".png"))
    except Exception as e:
        say(f"plot skipped: {e}")
    print("\n| method | best LR | final training loss (mean over seeds) | per LR |")
    print("|---|---|---|---|")
    for m in methods:
        r = table[m]
        print(f"| {C.LABELS.get(m, m)} | 2^{int(math.log2(r['best_lr']))}"
              f"{' (edge)' if r['best_at_edge'] else ''} | {r['final_train_loss']:.4f} | "
              + ", ".join(f"{v:.4f}" for v in r["final_per_lr"]) + " |")
    say(f"wrote {jpath}")
    return payload


def plot(payload, methods, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = payload["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for m in methods:
        r = runs[m]
        axes[0].plot(r["best_curve_steps"], r["best_curve"],
                     label=f"{C.LABELS.get(m, m)} (lr 2^{int(math.log2(r['best_lr']))})")
        axes[1].plot([math.log2(v) for v in r["lrs"]],
                     [float(np.mean(f)) for f in r["final"]], "o-", label=C.LABELS.get(m, m))
    axes[0].set_yscale("log")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("training loss (minibatch, window mean, mean over seeds)")
    axes[0].set_title(f"strided AlexNet ({payload['setup']['model']}), digits "
                      f"{payload['setup']['image']}px, best LR per method", fontsize=9)
    axes[0].legend(fontsize=7)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("log2 learning rate")
    axes[1].set_ylabel("final full training loss (mean over seeds)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
