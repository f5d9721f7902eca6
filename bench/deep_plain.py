"""Trainability versus depth of a plain network (no normalization, no skip connections).

Model (``--arch mlp``, default): ``zoo.MLP(64, 10, hidden=(width,) * depth)``, ReLU, on
scikit-learn's digits (1797 samples, 64 pixel features min-max scaled to [-1, 1], 10 classes).
``--arch conv``: ``zoo.plain_deep_cnn`` (3x3 convolutions, width 16) on the 8x8 digits repeated
over 3 channels.  Depths 10, 30, 50, 100 (hidden layers / convolutions).

Every method's logits are multiplied by one fixed scalar chosen on the first minibatch so that
their std is 0.05 (the same calibration for every method).  SGD with momentum 0.9, no weight
decay, a fixed budget of ``--epochs`` epochs of batch ``--batch``; the final full-training-set
loss at the best learning rate of a small power-of-two sweep (median over seeds).  Each
(method, depth) trains all (LR x seed) copies at once (bench/common.py ``Batched``).

Methods: PyTorch default, fan-in (Kaiming, the textbook init for plain ReLU nets), precondfx
default (geometric, balance='auto'), LSUV (precondfx scheme='lsuv') and TAT (precondfx
scheme='tat'; skipped and said so when the scheme is not registered).

    python bench/deep_plain.py            # ~10 minutes on one CPU thread
    python bench/deep_plain.py --quick    # CI smoke run

Writes docs/results/deep_plain[_tag].json and .png.
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

METHODS = ["default", "fan_in", "precondfx", "lsuv", "tat"]


def digits_flat():
    from sklearn.datasets import load_digits
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32) / 16.0 * 2 - 1
    return X, torch.tensor(y, dtype=torch.long)


@torch.no_grad()
def grad_diag(model, x, y) -> dict:
    """Gradient second moment of the first and last weight (vanishing/exploding signal) and
    the mean cosine similarity between the last hidden representations of different inputs
    (collapse of deep ReLU nets)."""
    with torch.enable_grad():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
    ws = [(n, p) for n, p in model.named_parameters() if p.dim() > 1 and p.grad is not None]
    g0 = float(ws[0][1].grad.pow(2).mean() / ws[0][1].pow(2).mean())
    g1 = float(ws[-1][1].grad.pow(2).mean() / ws[-1][1].pow(2).mean())
    model.zero_grad(set_to_none=True)
    feats = []
    last = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))][-1]
    h = last.register_forward_hook(lambda m, i, o: feats.append(i[0].detach().flatten(1)))
    model(x)
    h.remove()
    f = F.normalize(feats[0], dim=1)
    cos = f @ f.T
    n = len(f)
    off = float((cos.sum() - cos.diagonal().sum()) / (n * (n - 1)))
    return {"nu_first_over_last": g0 / g1 if g1 > 0 else math.inf, "mean_cosine_last_hidden": off}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--arch", choices=["mlp", "conv"], default="mlp")
    ap.add_argument("--depths", default="10,30,50,100")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=float, default=5)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--lrs", default="-3,-5,-7,-9,-11", help="LR exponents (2^k)")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--target-std", type=float, default=0.05)
    ap.add_argument("--methods", default=",".join(METHODS))
    C.add_run_args(ap)
    args = C.parse_run_args(ap, argv)
    depths = [int(d) for d in args.depths.split(",")]
    lrs = [2.0 ** int(k) for k in args.lrs.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    if args.quick:
        depths, lrs, args.seeds, args.epochs = [4, 12], [2.0 ** -2, 2.0 ** -5], 1, 0.5
        methods = ["default", "fan_in", "precondfx", "lsuv", "tat"]
    tag = args.tag or ("quick" if args.quick else "")
    say = C.Progress("deep")
    notes = {m: C.method_note(m) for m in methods if C.method_note(m)}
    for m, n in notes.items():
        say(f"note: {m}: {n}")
    methods = [m for m in methods if not (notes.get(m) and "skipped" in notes[m])]
    if args.arch == "mlp":
        X, y = digits_flat()

        def make_for(depth):
            return lambda s: zoo.MLP(64, 10, (args.width,) * depth)
    else:
        X, y = C.digits_images(8)
        args.width = 16 if args.width == 64 else args.width

        def make_for(depth):
            return lambda s: zoo.plain_deep_cnn(s, depth=depth, width=args.width, image=8)[0]
    if args.quick:
        X, y = X[:256], y[:256]
    seeds = list(range(args.seeds))
    order = C.orders(seeds, len(y), math.ceil(args.epochs))
    say(f"{args.arch} width {args.width}, depths {depths}, {len(y)} samples, batch {args.batch},"
        f" {args.epochs:g} epochs, LRs {[f'2^{int(math.log2(l))}' for l in lrs]}, seeds {seeds},"
        f" methods {methods}")
    runs: dict[str, dict] = {m: {} for m in methods}
    for depth in depths:
        make = make_for(depth)
        for m in methods:
            try:
                per_seed = [C.build(m, make, s, X[order[s][0, :args.batch]], args.target_std)
                            for s in seeds]
            except Exception as e:  # a scheme that fails on this model: recorded, not hidden
                runs[m][depth] = {"error": f"{type(e).__name__}: {e}"}
                say(f"depth {depth:4d} {m:10} FAILED to initialize: {e}")
                continue
            idx = order[0][0, :args.batch]
            diag = grad_diag(per_seed[0], X[idx], y[idx])
            models = [per_seed[j] for _ in lrs for j in range(len(seeds))]
            res = C.train_batched(models, [lr for lr in lrs for _ in seeds],
                                  [s for _ in lrs for s in seeds], X.to(args.device),
                                  y.to(args.device), order, batch=args.batch,
                                  epochs=args.epochs, momentum=args.momentum, weight_decay=0.0,
                                  device=args.device, curve_every=max(1, len(y) // args.batch // 2))
            fin = res["final"].reshape(len(lrs), len(seeds))
            med = np.median(fin, axis=1)
            b = int(np.argmin(med))
            curves = np.array(res["curve"], dtype=float).reshape(len(lrs), len(seeds), -1)
            runs[m][depth] = {"final": fin, "median": med, "best_lr": lrs[b],
                              "best": float(med[b]), "best_at_edge": b in (0, len(lrs) - 1),
                              "best_curve": np.median(curves[b], axis=0), "init": diag}
            say(f"depth {depth:4d} {m:10} best 2^{int(math.log2(lrs[b])):>3}: loss {med[b]:.4f}"
                f"  (per LR: {' '.join(f'{v:.3f}' for v in med)}; nu first/last "
                f"{diag['nu_first_over_last']:.3g}, cos {diag['mean_cosine_last_hidden']:.3f})")
    chance = math.log(10)
    payload = {"setup": {"arch": args.arch, "width": args.width, "depths": depths,
                         "data": "sklearn digits", "n_train": len(y), "batch": args.batch,
                         "epochs": args.epochs, "seeds": seeds, "momentum": args.momentum,
                         "weight_decay": 0.0, "target_std": args.target_std, "lrs": lrs,
                         "chance_loss": chance},
               "notes": notes, "runs": runs, "env": C.env_info(), "wall_s": say.elapsed(),
               "table": {m: {str(d): runs[m][d].get("best") for d in depths if d in runs[m]}
                         for m in methods}}
    name = "deep_plain" + (f"_{args.arch}" if args.arch != "mlp" else "") + (f"_{tag}" if tag else "")
    jpath = C.write_json(os.path.join(args.out, name + ".json"), payload)
    try:
        plot(C.clean(payload), methods, depths, os.path.join(args.out, name + ".png"))
    except Exception as e:
        say(f"plot skipped: {e}")
    print(f"\nfinal training loss at the best LR (chance = ln 10 = {chance:.3f}); "
          f"{args.arch}, width {args.width}")
    print("| method | " + " | ".join(f"depth {d}" for d in depths) + " |")
    print("|---|" + "---|" * len(depths))
    for m in methods:
        cells = []
        for d in depths:
            r = runs[m].get(d, {})
            if "best" in r and math.isfinite(r["best"]):
                edge = "*" if r["best_at_edge"] else ""
                cells.append(f"{r['best']:.3f} (2^{int(math.log2(r['best_lr']))}{edge})")
            elif "best" in r:
                cells.append("diverged at every LR")
            else:
                cells.append("failed: " + r["error"].split(": ", 1)[-1][:70] + "...")
        print(f"| {C.LABELS.get(m, m)} | " + " | ".join(cells) + " |")
    print("(2^k: best learning rate; * = at the edge of the sweep)")
    for m, n in notes.items():
        print(f"note: {m}: {n}")
    say(f"wrote {jpath}")
    return payload


def plot(payload, methods, depths, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = payload["runs"]
    fig, axes = plt.subplots(1, 1 + len(depths), figsize=(4.2 * (1 + len(depths)), 3.8))
    for m in methods:
        ds = [d for d in depths if runs[m].get(str(d), {}).get("best") is not None]
        axes[0].plot(ds, [runs[m][str(d)]["best"] for d in ds], "o-", label=C.LABELS.get(m, m))
        for j, d in enumerate(depths):
            r = runs[m].get(str(d), {})
            if r.get("best_curve"):
                axes[1 + j].plot(r["best_curve"], label=C.LABELS.get(m, m))
    axes[0].axhline(payload["setup"]["chance_loss"], color="k", ls="--", lw=0.8)
    axes[0].set_xlabel("depth")
    axes[0].set_ylabel("final training loss (best LR)")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    axes[0].set_title(f"plain {payload['setup']['arch']}, width {payload['setup']['width']}",
                      fontsize=9)
    for j, d in enumerate(depths):
        axes[1 + j].set_title(f"depth {d}: minibatch loss (best LR)", fontsize=9)
        axes[1 + j].set_yscale("log")
        axes[1 + j].set_xlabel("half-epochs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
