"""The paper's LIBSVM study (Sec. 8, Table 2, App. F) on data available offline.

Protocol (paper): a ReLU MLP with hidden widths 384 and 64 and a LayerNorm (no affine) on the
input; the logits multiplied by one fixed scalar chosen on the first minibatch so that their
std is 0.05, for every method; weight decay 1e-5; 5 epochs of SGD; learning rates 2^1 .. 2^-12;
the median over seeds of the final training loss; the best learning rate per (dataset,
method); each dataset normalized by its worst method; the average normalized loss, and in how
many datasets each method is worst and best.

Data: scikit-learn's bundled iris, wine, breast_cancer and digits, plus 23 synthetic
classification sets (20 ``make_classification`` with 5-200 features and 2-10 classes, 2
``make_gaussian_quantiles``, ``make_hastie_10_2``), fixed seeds; every feature min-max scaled to
[-1, 1] (as LIBSVM's scaled sets are) before the network's LayerNorm.

All (learning rate x seed) copies of one (dataset, method) are trained at once as one batched
model (bench/common.py: stacked parameters, vmap, a hand-vectorized SGD update); every copy has
its own initialization (one ``precondfx.precondition`` / baseline call per seed, calibrated on
that seed's first minibatch) and copies with the same seed see the same minibatches.

    python bench/libsvm_study.py                      # main table (CPU, scaled down: see --help)
    python bench/libsvm_study.py --momentum 0         # the same without momentum
    python bench/libsvm_study.py --ablation           # why geometric does / does not win
    python bench/libsvm_study.py --quick              # CI smoke run (< 1 minute)
    python bench/libsvm_study.py --paper --device cuda  # the full protocol (10 seeds) on a GPU

Writes docs/results/libsvm_<tag>.json and .png (tag: main / m0 / ablation / quick / ...).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

from tests import zoo  # noqa: E402

MAIN_METHODS = ["default", "fan_in", "fan_out", "xavier", "geometric", "precondfx",
                "precondfx_hessian", "fan_in_hessian", "lsuv"]
PAPER_METHODS = ["xavier", "fan_in", "fan_out", "geometric"]


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------

def synthetic_specs(k: int = 20) -> list[dict]:
    """``k`` make_classification settings, deterministic: features cycle over 5-200, classes
    over 2-10, the rest drawn from a fixed RandomState."""
    rng = np.random.RandomState(2024)
    feats = [5, 8, 10, 15, 20, 30, 40, 50, 64, 80, 100, 128, 160, 200]
    specs = []
    for i in range(k):
        nf = feats[(i * 5) % len(feats)]
        nc = 2 + (i * 4) % 9
        ncl = 1 + i % 2
        need = math.ceil(math.log2(nc * ncl)) + 1
        ninf = int(min(nf, max(need, round(rng.uniform(0.3, 1.0) * nf))))
        nred = int(min(nf - ninf, rng.randint(0, max(1, nf // 4) + 1)))
        specs.append(dict(kind="classification", n_samples=600, n_features=nf, n_classes=nc,
                          n_informative=ninf, n_redundant=nred, n_clusters_per_class=ncl,
                          class_sep=round(float(rng.uniform(0.6, 1.6)), 3),
                          flip_y=round(float(rng.uniform(0.0, 0.05)), 3), random_state=100 + i))
    specs.append(dict(kind="gaussian_quantiles", n_samples=600, n_features=10, n_classes=3,
                      random_state=200))
    specs.append(dict(kind="gaussian_quantiles", n_samples=600, n_features=40, n_classes=6,
                      random_state=201))
    specs.append(dict(kind="hastie_10_2", n_samples=600, random_state=202))
    return specs


def _scale(x: np.ndarray) -> np.ndarray:
    lo, hi = x.min(0), x.max(0)
    span = np.where(hi > lo, hi - lo, 1.0)
    return np.where(hi > lo, 2 * (x - lo) / span - 1, 0.0)


def datasets(n_synth: int = 20, synth_samples: int | None = None) -> list[tuple[str, Any, dict]]:
    """(name, loader, spec) for every dataset; loaders return (X float32, y int64)."""
    from sklearn import datasets as skd

    out: list[tuple[str, Any, dict]] = []
    for name in ("iris", "wine", "breast_cancer", "digits"):
        out.append((name, (lambda n=name: getattr(skd, f"load_{n}")(return_X_y=True)),
                    {"kind": "sklearn", "name": name}))
    specs = synthetic_specs(n_synth)
    extra = specs[n_synth:]
    for i, sp in enumerate(specs[:n_synth] + extra):
        sp = dict(sp)
        if synth_samples:
            sp["n_samples"] = synth_samples
        if sp["kind"] == "classification":
            name = f"synth{i:02d}_f{sp['n_features']}_c{sp['n_classes']}"
            kw = {k: v for k, v in sp.items() if k != "kind"}
            fn = (lambda kw=kw: skd.make_classification(**kw))
        elif sp["kind"] == "gaussian_quantiles":
            name = f"gquant_f{sp['n_features']}_c{sp['n_classes']}"
            kw = {k: v for k, v in sp.items() if k != "kind"}
            fn = (lambda kw=kw: skd.make_gaussian_quantiles(**kw))
        else:
            name = "hastie_10_2"
            kw = {k: v for k, v in sp.items() if k != "kind"}
            fn = (lambda kw=kw: skd.make_hastie_10_2(**kw))
        out.append((name, fn, sp))
    return out


def load(fn) -> tuple[torch.Tensor, torch.Tensor]:
    X, y = fn()
    X = _scale(np.asarray(X, dtype=np.float64))
    y = np.unique(np.asarray(y), return_inverse=True)[1]
    return torch.tensor(X, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def make_net(d: int, c: int) -> nn.Module:
    """LayerNorm (no affine) on the input, then the paper's MLP d-384-64-c (zoo.MLP)."""
    return nn.Sequential(nn.LayerNorm(d, elementwise_affine=False), zoo.MLP(d, c, (384, 64)))


# ---------------------------------------------------------------------------------------------
# diagnostics at initialization
# ---------------------------------------------------------------------------------------------

def init_diagnostics(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Per weight: the per-sample weight-to-gradient ratio E[dW^2]/E[W^2] (paper Sec. 4; the
    GR scaling of an MLP layer), the minibatch version, and per bias the ratio of its
    per-sample squared gradient to the weight's (how fast biases move relative to weights)."""
    from torch.func import functional_call, grad, vmap
    params = {k: v.detach() for k, v in model.named_parameters()}
    bufs = {k: v.detach() for k, v in model.named_buffers()}

    def loss1(p, xi, yi):
        out = functional_call(model, (p, bufs), (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

    g = vmap(grad(loss1), in_dims=(None, 0, 0))(params, x, y)
    gb = torch.func.grad(lambda p: nn.functional.cross_entropy(
        functional_call(model, (p, bufs), (x,)), y))(params)
    out: dict[str, dict] = {}
    # effective weight includes an alpha on the layer input: ratio is alpha-invariant in W units
    for k, w in params.items():
        if w.dim() < 2:
            continue
        ps = float(g[k].pow(2).mean()) / float(w.pow(2).mean())
        mb = float(gb[k].pow(2).mean()) / float(w.pow(2).mean())
        bk = k[:-len("weight")] + "bias"
        rec = {"nu_per_sample": ps, "nu_batch": mb}
        if bk in params:
            rec["bias_over_weight_grad2"] = float(g[bk].pow(2).mean()) / float(g[k].pow(2).mean())
        out[k] = rec
    ps = [r["nu_per_sample"] for r in out.values()]
    mb = [r["nu_batch"] for r in out.values()]
    return {"layers": out, "spread_per_sample": max(ps) / min(ps), "spread_batch": max(mb) / min(mb)}


# ---------------------------------------------------------------------------------------------
# the MLP in canonical form, and a batched trainer for it
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def canonical(model: nn.Module, x: torch.Tensor) -> dict:
    """The function an initialized model computes, as plain tensors: ``logits = s * f(LN(x))``
    with ``f`` the layers ``h -> relu(W_l (alpha_l h) + b_l)`` (no relu on the last).  The
    alphas (precondfx's alpha buffers on layer inputs) and the output scalar are read off a
    forward pass with hooks on the Linear modules, whatever the model's form (our Scaled
    wrapper, a precondfx GraphModule, an eager module with hooks); the canonical forward is
    then checked against the model's own output on ``x``."""
    order: list[nn.Module] = []
    ins: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []

    def hook(mod, inp, out):
        order.append(mod)
        ins.append(inp[0].detach())
        outs.append(out.detach())

    hs = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        y = model(x).detach()
    finally:
        for h in hs:
            h.remove()
    prev = nn.functional.layer_norm(x, (x.shape[1],))
    W, b, alpha = [], [], []
    for k, mod in enumerate(order):
        a = float((ins[k] * prev).sum() / (prev * prev).sum().clamp_min(1e-30))
        if not torch.allclose(ins[k], a * prev, rtol=1e-4, atol=1e-6):
            raise RuntimeError(f"layer {k}: its input is not a scalar multiple of the previous "
                               f"activation: the model is not a LN-MLP in canonical form")
        W.append(mod.weight.detach().clone())
        b.append(mod.bias.detach().clone() if mod.bias is not None else
                 torch.zeros(mod.weight.shape[0]))
        alpha.append(a)
        prev = outs[k].relu()
    last = outs[-1]
    s = float((y * last).sum() / (last * last).sum())
    can = {"W": W, "b": b, "alpha": alpha, "s": s}
    h = nn.functional.layer_norm(x, (x.shape[1],))
    for k in range(len(W)):
        h = nn.functional.linear(h * alpha[k], W[k], b[k])
        if k < len(W) - 1:
            h = h.relu()
    if not torch.allclose(h * s, y, rtol=1e-3, atol=1e-6 + 1e-4 * float(y.abs().max())):
        raise RuntimeError("canonical forward does not reproduce the model's output")
    return can


class MLPBatch:
    """Many LN-MLPs in canonical form trained at once with SGD (PyTorch's update:
    ``g += wd p; buf = mu buf + g (buf = g on the first step); p -= lr buf``), vectorized over
    copies with bmm.  ``lr_w``/``lr_b``: (M, L) learning rates of each layer's weight and bias
    (per-copy LR times any per-layer multiplier)."""

    def __init__(self, cans: list[dict], lr_w: torch.Tensor, lr_b: torch.Tensor,
                 momentum: float, wd: float, device: str) -> None:
        L = len(cans[0]["W"])
        self.W = [torch.stack([c["W"][l] for c in cans]).to(device) for l in range(L)]
        self.b = [torch.stack([c["b"][l] for c in cans]).to(device) for l in range(L)]
        self.alpha = torch.tensor([c["alpha"] for c in cans], dtype=torch.float32, device=device)
        self.s = torch.tensor([c["s"] for c in cans], dtype=torch.float32, device=device)
        self.lr_w, self.lr_b = lr_w.to(device).float(), lr_b.to(device).float()
        self.params = self.W + self.b
        self.buf = [torch.zeros_like(p) for p in self.params]
        self.momentum, self.wd, self.L = momentum, wd, L
        self.alive = torch.arange(len(cans), device=device)
        self.t = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``h``: (M, B, d) per-copy inputs, or (B, d) shared; LayerNorm already applied."""
        for l in range(self.L):
            a = self.alpha[:, l].view(-1, 1, 1)
            h = torch.matmul(h, self.W[l].transpose(1, 2)) * a + self.b[l].unsqueeze(1)
            if l < self.L - 1:
                h = h.relu()
        return h * self.s.view(-1, 1, 1)

    def step(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for p in self.params:
            p.requires_grad_(True)
        out = self.forward(h)
        m, bsz = y.shape
        loss = nn.functional.cross_entropy(out.reshape(m * bsz, -1), y.reshape(-1),
                                           reduction="none").view(m, bsz).mean(1)
        grads = torch.autograd.grad(loss.sum(), self.params)
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(self.params, grads)):
                p.requires_grad_(False)
                l = i % self.L
                lr = (self.lr_w if i < self.L else self.lr_b)[:, l]
                if self.wd:
                    g = g.add(p, alpha=self.wd)
                if self.momentum:
                    if self.t == 0:
                        self.buf[i].copy_(g)
                    else:
                        self.buf[i].mul_(self.momentum).add_(g)
                    g = self.buf[i]
                p.sub_(lr.view(-1, *([1] * (p.dim() - 1))) * g)
        self.t += 1
        return loss.detach()

    def keep(self, ok: torch.Tensor) -> None:
        idx = ok.nonzero().flatten()
        self.W = [w[idx].contiguous() for w in self.W]
        self.b = [v[idx].contiguous() for v in self.b]
        self.params = self.W + self.b
        self.buf = [v[idx].contiguous() for v in self.buf]
        self.alpha, self.s = self.alpha[idx], self.s[idx]
        self.lr_w, self.lr_b = self.lr_w[idx], self.lr_b[idx]
        self.alive = self.alive[idx]

    def finite(self) -> torch.Tensor:
        ok = torch.ones(len(self.alive), dtype=torch.bool, device=self.alive.device)
        for p in self.params:
            ok &= torch.isfinite(p.flatten(1)).all(1)
        return ok

    @torch.no_grad()
    def eval_loss(self, h: torch.Tensor, y: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        tot = torch.zeros(len(self.alive), dtype=torch.float64, device=h.device)
        for i in range(0, len(y), chunk):
            out = self.forward(h[i:i + chunk])
            m, bsz = out.shape[:2]
            ce = nn.functional.cross_entropy(out.reshape(m * bsz, -1), y[i:i + chunk].repeat(m),
                                             reduction="none")
            tot += ce.view(m, bsz).double().sum(1)
        tot /= len(y)
        return torch.where(torch.isfinite(tot), tot, torch.full_like(tot, math.inf))


def train_mlps(cans: list[dict], lr_w: torch.Tensor, lr_b: torch.Tensor, seed_of: list[int],
               h: torch.Tensor, y: torch.Tensor, order: dict[int, torch.Tensor], *, batch: int,
               epochs: float, momentum: float, wd: float, device: str) -> np.ndarray:
    """Final full-data training loss of every copy (+inf where it diverged)."""
    tr = MLPBatch(cans, lr_w, lr_b, momentum, wd, device)
    uniq = sorted(set(seed_of))
    ordt = torch.stack([order[s] for s in uniq]).to(device)
    row = torch.tensor([uniq.index(s) for s in seed_of], device=device)
    h, y = h.to(device), y.to(device)
    spe = max(1, len(y) // batch)
    total = int(round(epochs * spe))
    for t in range(total):
        e, j = divmod(t, spe)
        idx = ordt[row[tr.alive], e % ordt.shape[1], j * batch:(j + 1) * batch]
        loss = tr.step(h[idx], y[idx])
        ok = torch.isfinite(loss)
        if t % 8 == 7 or t == total - 1:
            ok &= tr.finite()
        if not bool(ok.all()):
            tr.keep(ok)
            if len(tr.alive) == 0:
                break
    final = torch.full((len(cans),), math.inf, dtype=torch.float64)
    if len(tr.alive):
        final[tr.alive.cpu()] = tr.eval_loss(h, y).cpu()
    return final.numpy()


def parse_method(m: str) -> tuple[str, float]:
    """'geometric@tilt16' -> ('geometric', 16.0): per-layer weight LR multipliers
    t^(l/(2(L-1))), i.e. a GR-scaling (nu) ratio t between the last and the first layer
    (an alpha_l on a layer input multiplies its nu by alpha_l^4 and acts on SGD as a weight LR
    multiplier alpha_l^2).  A '+in63' suffix (kept in the base name) applies the paper's
    Sec. 6.3 input scaling after the LayerNorm, see ``in63``."""
    if "@tilt" in m:
        base, t = m.split("@tilt")
        num, _, den = t.partition("/")
        return base, float(num) / (float(den) if den else 1.0)
    return m.split("@as:")[0], 1.0


def as_rule_mults(can: dict, base_rule: str, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer (weight, bias) learning-rate multipliers under which SGD on a zero-bias
    ``base_rule`` init follows *exactly* the trajectory of the same draws under ``rule``
    (output scalar recalibrated).  With W_l = r_l V_l (r_l^2 the ratio of the rules'
    variances) and ReLU's positive homogeneity, the two networks compute the same function
    when the output scalar absorbs R_L = prod r_l; an SGD step on W_l moves V_l by
    lr / r_l^2 times V's own gradient, and one on b_l moves the equivalent bias by lr / R_l^2
    (momentum and weight decay are linear and carry over unchanged).  So fan-in, fan-out,
    Xavier and geometric inits differ, after output calibration, only in these multipliers."""
    r2 = []
    for W in can["W"]:
        n_out, n_in = W.shape
        r2.append(C.rule_std(rule, n_in, n_out, 1) ** 2 / C.rule_std(base_rule, n_in, n_out, 1) ** 2)
    r2 = torch.tensor(r2, dtype=torch.float64)
    return (1.0 / r2).float(), (1.0 / torch.cumprod(r2, 0)).float()


def in63(can: dict, d: int) -> dict:
    """Sec. 6.3 input scaling at the first layer's input (the LayerNorm output, E[x^2] = 1):
    multiply it by c = d^(-1/4) so that E[x0^2] = 1/sqrt(d), and divide the output scalar by c.
    With zero biases at init the network is positively homogeneous, so the initial function
    is unchanged; only the training dynamics change (equivalently: every bias learns sqrt(d)
    times faster relative to the weights).  precondfx's own ``input_scale='auto'`` scales the
    model input, which the LayerNorm then removes, so it cannot be used here."""
    c = d ** -0.25
    out = dict(can)
    out["alpha"] = [can["alpha"][0] * c] + list(can["alpha"][1:])
    out["s"] = can["s"] / c
    return out


def run_dataset(methods: list[str], X: torch.Tensor, y: torch.Tensor, lrs: list[float],
                seeds: list[int], order: dict[int, torch.Tensor], n_classes: int, *,
                momentum: float, batch: int, target_std: float | None, bias_lr_mult: float,
                epochs: float, wd: float, device: str, cache: dict, diag: bool) -> dict:
    """Every (method x LR x seed) of one dataset trained as one batch."""
    d = X.shape[1]
    cans, lr_w, lr_b, seed_of, owner = [], [], [], [], []
    out: dict[str, dict] = {}
    for m in methods:
        base, tilt = parse_method(m)
        per_seed = []
        core = base.split("+")[0]
        for s in seeds:
            key = (core, s, batch, target_std)
            if key not in cache:
                calib = X[order[s][0, :batch]]
                model = C.build(core, lambda _s: make_net(d, n_classes), s, calib, target_std)
                cache[key] = (canonical(model, calib), model)
            can, model = cache[key]
            if base.endswith("+in63"):
                if any(float(b.abs().max()) > 0 for b in can["b"]):
                    raise ValueError(f"{base}: needs zero biases at init")
                can = in63(can, d)
            per_seed.append((can, model))
        out[m] = {}
        if diag and tilt == 1.0 and "+" not in base:
            s0 = seeds[0]
            idx = order[s0][0, :batch]
            out[m]["init"] = init_diagnostics(per_seed[0][1], X[idx], y[idx])
        L = len(per_seed[0][0]["W"])
        mult = torch.tensor([tilt ** (l / (2 * (L - 1))) for l in range(L)])
        bmult = torch.ones(L)
        if "@as:" in m:
            kind, rule0 = C.METHODS[core]
            if kind != "rule" or rule0 == "default":
                raise ValueError(f"{m}: '@as:' needs a zero-bias rule-based base method")
            wm, bm = as_rule_mults(per_seed[0][0], rule0, m.split("@as:")[1])
            mult, bmult = mult * wm, bm
        for lr in lrs:
            for s, (can, _) in zip(seeds, per_seed):
                cans.append(can)
                lr_w.append(lr * mult)
                lr_b.append(lr * bias_lr_mult * bmult)
                seed_of.append(s)
                owner.append(m)
    h = nn.functional.layer_norm(X, (d,))
    fin = train_mlps(cans, torch.stack(lr_w), torch.stack(lr_b), seed_of, h, y, order,
                     batch=batch, epochs=epochs, momentum=momentum, wd=wd, device=device)
    own = np.array(owner)
    for m in methods:
        f = fin[own == m].reshape(len(lrs), len(seeds))
        med = np.median(f, axis=1)                # +inf if more than half the seeds diverged
        b = int(np.argmin(med))
        out[m].update({"final": f, "median": med, "best_lr_index": b, "best_lr": lrs[b],
                       "best": float(med[b]), "best_at_edge": b in (0, len(lrs) - 1)})
    return out


def summarize(results: dict, methods: list[str], lrs: list[float]) -> dict:
    best = {ds: {m: results[ds][m]["best"] for m in methods if m in results[ds]}
            for ds in results}
    out = {"all": C.norm_table(best, methods)}
    paper = [m for m in PAPER_METHODS if m in methods]
    if len(paper) == len(PAPER_METHODS):
        out["paper4"] = C.norm_table(best, paper)
    # the same, on coarser / narrower learning-rate grids (post hoc, from the same runs)
    grids = {"every_other_lr": list(range(0, len(lrs), 2)),
             "lr<=2^-1": [i for i, lr in enumerate(lrs) if lr <= 2 ** -1 + 1e-12],
             "lr_2^-1..2^-7": [i for i, lr in enumerate(lrs) if 2 ** -7 <= lr <= 2 ** -1 + 1e-12]}
    for gname, keep in grids.items():
        if len(keep) < 2:
            continue
        bg = {ds: {m: float(np.min(np.asarray(results[ds][m]["median"])[keep]))
                   for m in methods if m in results[ds]} for ds in results}
        out[f"all@{gname}"] = C.norm_table(bg, methods)
    eq = {}
    for m in methods:
        if "@as:" in m and m.split("@as:")[1] in methods:
            r = m.split("@as:")[1]
            diffs = []
            for ds in results:
                a = np.asarray(results[ds][r]["final"], dtype=float)
                b = np.asarray(results[ds][m]["final"], dtype=float)
                ok = np.isfinite(a) & np.isfinite(b)
                diffs.append(float(np.max(np.abs(a[ok] - b[ok]) / a[ok])) if ok.any() else 0.0)
            eq[f"{m} vs {r}"] = {"max_rel_diff_final_loss": max(diffs),
                                 "median_rel_diff": float(np.median(diffs))}
    if eq:
        out["equivalence"] = eq
    out["best_lr_at_edge"] = {m: int(sum(results[ds][m]["best_at_edge"] for ds in results
                                         if m in results[ds])) for m in methods}
    out["best_lr_log2_median"] = {m: float(np.median([math.log2(results[ds][m]["best_lr"])
                                                      for ds in results if m in results[ds]]))
                                  for m in methods}
    return out


# ---------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------

def plot(payload: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = payload["configs"]
    n = 1 + len(configs)
    ncols = min(n, 4)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.4 * nrows), squeeze=False)
    axes = axes.reshape(1, -1)
    for ax in axes[0, n:]:
        ax.axis("off")
    ax = axes[0, 0]
    cfg0 = configs[0]
    res = payload["results"][cfg0["name"]]
    methods = cfg0["methods"]
    dsn = list(res)
    for m in methods:
        vals = []
        for ds in dsn:
            worst = max(v["best"] for v in res[ds].values() if v["best"] is not None and
                        math.isfinite(v["best"]))
            b = res[ds][m]["best"]
            vals.append(1.0 if b is None or not math.isfinite(b) else b / worst)
        ax.plot(range(len(dsn)), vals, "o-", ms=3, lw=0.8, label=C.LABELS.get(m, m))
    ax.set_xticks(range(len(dsn)))
    ax.set_xticklabels(dsn, rotation=90, fontsize=5)
    ax.set_ylabel("best-LR median loss / worst method")
    ax.set_title(f"per dataset ({cfg0['name']})", fontsize=9)
    ax.legend(fontsize=6)
    for j, cfg in enumerate(configs):
        ax = axes[0, 1 + j]
        tab = payload["tables"][cfg["name"]]["all"]
        ms = list(tab)
        v = [tab[m]["avg_normalized"] for m in ms]
        e = [tab[m]["se"] for m in ms]
        ax.barh(range(len(ms)), v, xerr=e, color="C0")
        ax.set_yticks(range(len(ms)))
        ax.set_yticklabels([C.LABELS.get(m, m) for m in ms], fontsize=7)
        lo = min(v) - 0.1
        ax.set_xlim(max(0, lo), 1.0)
        ax.set_xlabel("average normalized loss (lower is better)")
        ax.set_title(cfg["name"], fontsize=8)
        for i, m in enumerate(ms):
            ax.text(max(0, lo) + 0.005, i, f"worst {tab[m]['worst_in']} best {tab[m]['best_in']}",
                    va="center", fontsize=6, color="w")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def configs_for(args: argparse.Namespace) -> list[dict]:
    base = dict(momentum=args.momentum, batch=args.batch, target_std=args.target_std,
                bias_lr_mult=1.0, methods=args.methods, lr_max=args.lr_max)
    if not args.ablation:
        return [dict(base, name=f"momentum {args.momentum:g}")]
    ab = args.ablation_methods
    tilts = [f"geometric@tilt{t}" for t in ("1/16", "1/4", "1", "4", "16", "64")]
    return [
        dict(base, name="base (momentum 0.9, batch 32, std 0.05)", momentum=0.9, methods=ab),
        dict(base, name="momentum 0", momentum=0.0, methods=ab),
        dict(base, name="batch 128", momentum=0.9, batch=128, methods=ab),
        dict(base, name="batch 8", momentum=0.9, batch=8, methods=ab),
        dict(base, name="no output scaling", momentum=0.9, target_std=None, methods=ab),
        dict(base, name="biases frozen (lr x0)", momentum=0.9, bias_lr_mult=0.0, methods=ab),
        dict(base, name=f"LR grid up to 2^{args.lr_max + 3}", momentum=0.9,
             lr_max=args.lr_max + 3, methods=ab),
        dict(base, name="equivalence: rules = geometric + per-layer LR multipliers",
             momentum=0.9, methods=["fan_in", "fan_out", "xavier", "geometric_own",
                                    "geometric_own@as:fan_in", "geometric_own@as:fan_out",
                                    "geometric_own@as:xavier"]),
        dict(base, name="layer-LR tilt of geometric (nu last/first = t)", momentum=0.9,
             methods=tilts + ["fan_in", "fan_in_hessian"]),
        dict(base, name="layer-LR tilt, momentum 0", momentum=0.0,
             methods=tilts + ["fan_in", "fan_in_hessian"]),
    ]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI smoke run")
    ap.add_argument("--paper", action="store_true",
                    help="the paper's protocol: 10 seeds, LRs 2^1..2^-12 (use a GPU)")
    ap.add_argument("--ablation", action="store_true", help="the investigation configs")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=float, default=5)
    ap.add_argument("--wd", type=float, default=1e-5)
    ap.add_argument("--target-std", type=float, default=0.05)
    ap.add_argument("--lr-max", type=int, default=1, help="largest LR exponent (2^k)")
    ap.add_argument("--lr-min", type=int, default=None,
                    help="smallest LR exponent (default -6; --paper: -12, the paper's grid)")
    ap.add_argument("--n-synth", type=int, default=20)
    ap.add_argument("--synth-samples", type=int, default=None)
    ap.add_argument("--methods", default=",".join(MAIN_METHODS))
    ap.add_argument("--ablation-methods",
                    default="default,fan_in,fan_out,xavier,geometric,geometric+in63,"
                            "fan_in+in63,fan_in_hessian")
    ap.add_argument("--datasets", default="", help="comma list of name prefixes (default all)")
    C.add_run_args(ap)
    args = C.parse_run_args(ap, argv)
    if args.paper:
        args.seeds = 10
    if args.lr_min is None:
        args.lr_min = -12 if args.paper else -6
    args.methods = [m for m in args.methods.split(",") if m]
    args.ablation_methods = [m for m in args.ablation_methods.split(",") if m]
    if args.quick:
        args.seeds, args.lr_max, args.lr_min = 2, -1, -5
        args.n_synth, args.synth_samples, args.epochs = 2, 128, 1
        args.datasets = args.datasets or "iris,wine,synth"
        args.methods = ["default", "fan_in", "xavier", "geometric", "precondfx", "lsuv"]
        args.ablation_methods = ["fan_in", "geometric"]
    tag = args.tag or ("quick" if args.quick else "ablation" if args.ablation else
                       ("main" if args.momentum == 0.9 else f"m{args.momentum:g}"))
    if args.paper and not args.tag:
        tag += "_paper"
    say = C.Progress("libsvm")
    seeds = list(range(args.seeds))
    dsets = datasets(args.n_synth, args.synth_samples)
    if args.datasets:
        pre = [p for p in args.datasets.split(",") if p]
        dsets = [d for d in dsets if any(d[0].startswith(p) for p in pre)]
    configs = configs_for(args)
    notes = {}
    for c in configs:
        for m in c["methods"]:
            n = C.method_note(parse_method(m)[0].split("+")[0])
            if n:
                notes[m] = n
    for m, n in notes.items():
        say(f"note: {m}: {n}")
    skip = {m for m, n in notes.items() if "skipped" in n}
    for c in configs:
        c["methods"] = [m for m in c["methods"] if m not in skip]
        c["lrs"] = [2.0 ** k for k in range(c["lr_max"], args.lr_min - 1, -1)]
    say(f"{len(dsets)} datasets, LRs 2^{args.lr_max}..2^{args.lr_min}, {len(seeds)} seeds, "
        f"{args.epochs:g} epochs, device {args.device}, configs: {[c['name'] for c in configs]}")
    results: dict[str, dict] = {c["name"]: {} for c in configs}
    data_info = {}
    for di, (name, fn, spec) in enumerate(dsets):
        X, y = load(fn)
        ncls = int(y.max()) + 1
        data_info[name] = {"n": len(y), "features": X.shape[1], "classes": ncls, "spec": spec}
        cache: dict = {}
        for ci, cfg in enumerate(configs):
            order = C.orders(seeds, len(y), math.ceil(args.epochs))
            res = run_dataset(cfg["methods"], X, y, cfg["lrs"], seeds, order, ncls,
                              momentum=cfg["momentum"], batch=cfg["batch"],
                              target_std=cfg["target_std"], bias_lr_mult=cfg["bias_lr_mult"],
                              epochs=args.epochs, wd=args.wd, device=args.device, cache=cache,
                              diag=(ci == 0))
            results[cfg["name"]][name] = res
            bests = {m: res[m]["best"] for m in cfg["methods"]}
            fin = [v for v in bests.values() if math.isfinite(v)]
            worst = max(fin) if fin else math.inf
            say(f"[{di + 1}/{len(dsets)}] {name} (n={len(y)}, d={X.shape[1]}, c={ncls}) "
                f"{cfg['name']}: " + "  ".join(
                    f"{m}={bests[m] / worst:.3f}@2^{int(math.log2(res[m]['best_lr']))}"
                    for m in cfg["methods"]))
        # partial results after every dataset (a run cut short still leaves its data)
        C.write_json(os.path.join(args.out, f"libsvm_{tag}.partial.json"),
                     {"configs": configs, "datasets": data_info, "results": results})
    tables = {c["name"]: summarize(results[c["name"]], c["methods"], c["lrs"]) for c in configs}
    payload = {"protocol": {"hidden": [384, 64], "input_layernorm": True,
                            "target_std": args.target_std, "weight_decay": args.wd,
                            "epochs": args.epochs, "batch": args.batch,
                            "lr_exponents": [args.lr_max, args.lr_min], "seeds": seeds,
                            "optimizer": "SGD (PyTorch update rule)",
                            "final_loss": "full training-set cross-entropy after training, "
                                          "median over seeds, best LR per (dataset, method)",
                            "features": "min-max scaled to [-1,1], then LayerNorm in the net"},
               "configs": configs, "datasets": data_info, "notes": notes, "tables": tables,
               "results": results, "env": C.env_info(), "wall_s": say.elapsed()}
    os.makedirs(args.out, exist_ok=True)
    jpath = C.write_json(os.path.join(args.out, f"libsvm_{tag}.json"), payload)
    try:
        os.remove(os.path.join(args.out, f"libsvm_{tag}.partial.json"))
    except OSError:
        pass
    try:
        plot(C.clean(payload), os.path.join(args.out, f"libsvm_{tag}.png"))
    except Exception as e:  # the JSON is the result
        say(f"plot skipped: {e}")
    for c in configs:
        for tname, tab in tables[c["name"]].items():
            if isinstance(tab, dict) and all(isinstance(v, dict) and "avg_normalized" in v
                                             for v in tab.values()):
                print("\n" + C.table_md(tab, f"**{c['name']} — {tname}** ({len(dsets)} datasets)"))
        if "equivalence" in tables[c["name"]]:
            print(f"equivalence (max relative difference of final losses): "
                  f"{tables[c['name']]['equivalence']}")
        print(f"best LR at the grid's edge (datasets): {tables[c['name']]['best_lr_at_edge']}")
        print(f"median log2 best LR: {tables[c['name']]['best_lr_log2_median']}")
    say(f"wrote {jpath}")
    return payload


if __name__ == "__main__":
    main()
