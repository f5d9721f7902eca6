"""Shared pieces of the training and cost benchmarks (bench/*.py).

* ``setup()``: one intra-op thread (the machines these run on are shared), denormals flushed.
* Initialization methods, each producing a model whose logits are multiplied by one fixed
  scalar chosen on the first minibatch so that their std is ``target_std`` (paper App. F):
  the baselines (PyTorch default, fan-in, fan-out, arithmetic mean, geometric written here) are
  implemented in this file, independently of precondfx, with the same one-scalar calibration
  that precondfx's ``target_std`` does; the precondfx methods call ``precondfx.precondition``.
* ``Batched``: trains many copies of one architecture at once (one per learning rate x seed),
  each with its own initialization, by stacking their parameters along a leading dimension
  (``torch.func.stack_module_state`` + ``vmap(functional_call)``) and applying the SGD update
  (PyTorch's semantics: ``g += wd p; buf = mu buf + g; p -= lr buf``) by hand, vectorized over
  the copies.  A copy whose loss becomes non-finite is marked diverged and dropped from the
  batch (its final loss is +inf).
* ``norm_table``: the paper's Table 2 columns (average normalized loss, worst in #, best in #).
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import sys
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:          # run from a checkout without installing the package
    sys.path.append(ROOT)
RESULTS = os.path.join(ROOT, "docs", "results")


def setup(threads: int = 1) -> None:
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)


@contextlib.contextmanager
def ceiling_margin(octaves: float) -> Iterator[None]:
    """An experiment, not a library option: inside, ``lr='auto'``'s first step (and
    ``precondfx.settle_rate``) acts as if the optimizer's rate were ``lr / 2^octaves``, so the
    ceiling sits that many octaves above the suggested rate (0: the library's default)."""
    from precondfx.pytorch import lr_target
    keep = lr_target.keep_rate
    if octaves:
        def shifted(model, graph, plan, bufs, lr, optimizer, measure, **kw):
            return keep(model, graph, plan, bufs, lr / 2.0 ** octaves, optimizer, measure, **kw)
        lr_target.keep_rate = shifted
    try:
        yield
    finally:
        lr_target.keep_rate = keep


class Progress:
    """Progress lines with the elapsed wall time."""

    def __init__(self, name: str, quiet: bool = False) -> None:
        self.t0 = time.perf_counter()
        self.name, self.quiet = name, quiet

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{self.name} {self.elapsed():7.1f}s] {msg}", flush=True)


def clean(obj: Any) -> Any:
    """JSON-safe copy: numpy scalars/arrays to Python, non-finite floats to None."""
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return clean(obj.tolist())
    if isinstance(obj, (np.floating, float)):
        v = float(obj)
        return float(f"{v:.7g}") if math.isfinite(v) else None
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, torch.Tensor):
        return clean(obj.detach().cpu().numpy())
    return obj


def write_json(path: str, obj: Any) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = json.dumps(clean(obj), indent=1, allow_nan=False)
    if len(text) > 2_000_000:                      # big result files: compact separators
        text = json.dumps(clean(obj), separators=(",", ":"), allow_nan=False)
    with open(path, "w") as f:
        f.write(text)
    return path


def env_info() -> dict:
    import platform
    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}


# ---------------------------------------------------------------------------------------------
# initialization methods
# ---------------------------------------------------------------------------------------------

class Scaled(nn.Module):
    """``inner(x) * scale``: the one fixed scalar on the logits (paper App. F / Sec. 6.4)."""

    def __init__(self, inner: nn.Module, scale: float = 1.0) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("scale", torch.tensor(float(scale)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


def _fans(m: nn.Module) -> tuple[int, int, int]:
    w = m.weight
    k2 = int(math.prod(w.shape[2:])) if w.dim() > 2 else 1
    g = getattr(m, "groups", 1)
    return int(w.shape[1]), int(w.shape[0]) // g, k2


def rule_std(rule: str, n_in: int, n_out: int, k2: int) -> float:
    """Std of the paper's rules for ReLU nets (Sec. 6.1, Eqs. 5-7), with kernel taps k^2."""
    if rule == "fan_in":
        v = 2.0 / (k2 * n_in)
    elif rule == "fan_out":
        v = 2.0 / (k2 * n_out)
    elif rule == "xavier":        # the paper's Eq. 6: 4/(n_in + n_out) (ReLU factor 2 included)
        v = 4.0 / (k2 * (n_in + n_out))
    elif rule == "geometric":     # Eq. 7: 2/(k^2 sqrt(n_in n_out))
        v = 2.0 / (k2 * math.sqrt(n_in * n_out))
    else:
        raise ValueError(rule)
    return math.sqrt(v)


@torch.no_grad()
def init_rule_(model: nn.Module, rule: str, seed: int) -> nn.Module:
    """Re-draw every Linear/Conv weight N(0, rule_std^2), biases 0 (plain draws, no moment
    matching).  ``rule='default'`` keeps PyTorch's own initialization."""
    if rule == "default":
        return model
    gen = torch.Generator().manual_seed(10_000 + seed)
    return _set_rule_(model, rule, lambda name, m: torch.randn(m.weight.shape, generator=gen))


@torch.no_grad()
def init_rule_from_draws_(model: nn.Module, rule: str, drawn: nn.Module, plan: Any) -> nn.Module:
    """Like :func:`init_rule_`, but with precondfx's own normal draws: every Linear/Conv weight
    of ``model`` becomes ``z * rule_std`` where ``z = W / std`` is the unit-moment draw behind
    the same weight of ``drawn`` (a precondfx result) and ``std`` its planned std; biases 0.
    Methods compared this way differ only in each layer's scale (common random numbers), so
    their difference is not blurred by which draws each got.  Refuses a weight precondfx did
    not draw with the geometric rule or whose stored moment is not the planned one (an alpha,
    an lr factor or measured balancing stored in it)."""
    def unit_draw(name: str, m: nn.Module) -> torch.Tensor:
        pi = plan.inits.get(f"{name}.weight")
        w = drawn.get_parameter(f"{name}.weight")
        if pi is None or pi.rule != "geometric" or not pi.std:
            raise ValueError(f"{name}.weight: not a geometric draw of precondfx ({pi})")
        z = w.double() / pi.std
        if abs(float(z.pow(2).mean()) - 1.0) > 1e-3:
            raise ValueError(f"{name}.weight: stored moment {float(z.pow(2).mean()):.4f} x the "
                             f"planned one: not the plain draw")
        return z
    return _set_rule_(model, rule, unit_draw)


def _set_rule_(model: nn.Module, rule: str, unit_draw: Callable[[str, nn.Module], torch.Tensor]
               ) -> nn.Module:
    """Every Linear/Conv weight ``unit_draw(name, module) * rule_std`` (in module order),
    biases 0."""
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            n_in, n_out, k2 = _fans(m)
            m.weight.copy_((unit_draw(name, m) * rule_std(rule, n_in, n_out, k2))
                           .to(m.weight.dtype))
            if m.bias is not None:
                m.bias.zero_()
    return model


def _linear_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))]


@torch.no_grad()
def lsuv_own_(model: nn.Module, x: torch.Tensor, seed: int, tol: float = 0.1,
              max_iter: int = 10) -> nn.Module:
    """Minimal LSUV (Mishkin & Matas, Alg. 1), a fallback used only when precondfx's
    ``scheme="lsuv"`` is not available: orthonormal pre-init, biases 0, then each layer (in
    execution order, found with forward hooks) divided by its output std until |var-1| < tol."""
    gen = torch.Generator().manual_seed(20_000 + seed)
    order: list[nn.Module] = []
    hooks = [m.register_forward_hook(lambda m, i, o: order.append(m) if m not in order else None)
             for m in _linear_layers(model)]
    model(x)
    for h in hooks:
        h.remove()
    for m in order:
        w = m.weight
        rows, cols = w.shape[0], int(math.prod(w.shape[1:]))
        a = torch.randn(max(rows, cols), min(rows, cols), generator=gen)
        q, r = torch.linalg.qr(a)
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
        w.copy_((q if rows >= cols else q.T).reshape(w.shape))
        if m.bias is not None:
            m.bias.zero_()
    for m in order:
        for _ in range(max_iter):
            out: list[torch.Tensor] = []
            h = m.register_forward_hook(lambda mod, i, o: out.append(o))
            model(x)
            h.remove()
            var = float(out[0].var())
            if abs(var - 1.0) < tol or var <= 0:
                break
            m.weight.div_(math.sqrt(var))
    return model


@torch.no_grad()
def output_std(model: nn.Module, x: torch.Tensor) -> float:
    return float(model(x).double().std(correction=0))


def calibrated(model: nn.Module, x: torch.Tensor, target_std: float | None) -> nn.Module:
    """Wrap in ``Scaled`` with the scalar that makes the logits' std ``target_std`` on ``x``
    (population std over every element, as precondfx does)."""
    model.train()
    if target_std is None:
        return Scaled(model, 1.0)
    return Scaled(model, target_std / output_std(model, x))


def precondfx_scheme_available(name: str) -> bool:
    try:
        from precondfx.core.scheme import names
        return name in names()
    except Exception:
        return False


#: name -> (kind, options).  kind "rule": a baseline written here; "precondfx": precondition().
METHODS: dict[str, tuple[str, Any]] = {
    "default": ("rule", "default"),
    "fan_in": ("rule", "fan_in"),
    "fan_out": ("rule", "fan_out"),
    "xavier": ("rule", "xavier"),
    "geometric_own": ("rule", "geometric"),
    "geometric": ("precondfx", dict(balance="none")),
    "precondfx": ("precondfx", dict()),
    "precondfx_analytic": ("precondfx", dict(balance="analytic")),
    "precondfx_hessian": ("precondfx", dict(balance="hessian")),
    "fan_in_hessian": ("precondfx", dict(init="fan_in", balance="hessian")),
    "lsuv": ("precondfx", dict(scheme="lsuv")),
    "tat": ("precondfx", dict(scheme="tat")),
}

LABELS = {
    "default": "PyTorch default", "fan_in": "fan-in", "fan_out": "fan-out",
    "xavier": "arithmetic mean (Xavier, Eq. 6)", "geometric_own": "geometric (own code)",
    "geometric": "geometric (precondfx balance=none)", "precondfx": "precondfx default (auto)",
    "precondfx_analytic": "precondfx analytic", "precondfx_hessian": "precondfx hessian",
    "fan_in_hessian": "precondfx fan-in + hessian", "lsuv": "LSUV", "tat": "TAT",
    "geometric+in63": "geometric + Sec. 6.3 input scale", "fan_in+in63":
    "fan-in + Sec. 6.3 input scale",
}


def method_note(name: str) -> str | None:
    """Why a method is run differently or skipped here (None when it runs as named)."""
    if name == "lsuv" and not precondfx_scheme_available("lsuv"):
        return "precondfx scheme='lsuv' not available: the bench's own minimal LSUV (lsuv_own_) is used"
    if name == "tat" and not precondfx_scheme_available("tat"):
        return "precondfx scheme='tat' not available (not registered): skipped"
    return None


def build(method: str, make: Callable[[int], nn.Module], seed: int, calib: torch.Tensor,
          target_std: float | None = 0.05, extra: dict | None = None) -> nn.Module:
    """One initialized model: ``make(seed)`` builds the architecture under ``torch.manual_seed``
    (so 'default' is PyTorch's own init for that seed); the method then re-initializes it and
    fixes the logits' scale on ``calib`` (the first minibatch)."""
    kind, opt = METHODS[method]
    torch.manual_seed(seed)
    model = make(seed)
    if kind == "rule":
        return calibrated(init_rule_(model, opt, seed), calib, target_std)
    if method == "lsuv" and not precondfx_scheme_available("lsuv"):
        model.train()
        return calibrated(lsuv_own_(model, calib, seed), calib, target_std)
    import precondfx
    kw = dict(opt)
    kw.update(extra or {})
    out, _ = precondfx.precondition(model, calib, seed=seed, target_std=target_std, **kw)
    out.train()
    return out


# ---------------------------------------------------------------------------------------------
# batched training
# ---------------------------------------------------------------------------------------------

def stack_state(models: Sequence[nn.Module]) -> tuple[dict, dict]:
    """Parameters and buffers of same-structure models stacked along a new leading dim
    (``stack_module_state`` insists on one Python class; each fx GraphModule has its own)."""
    names = [k for k, _ in models[0].named_parameters()]
    bnames = [k for k, _ in models[0].named_buffers()]
    for m in models[1:]:
        if [k for k, _ in m.named_parameters()] != names or \
                [k for k, _ in m.named_buffers()] != bnames:
            raise ValueError("models to batch differ in parameter or buffer names")
    ps = [dict(m.named_parameters()) for m in models]
    bs = [dict(m.named_buffers()) for m in models]
    params = {k: torch.stack([p[k].detach() for p in ps]) for k in names}
    bufs = {k: torch.stack([b[k].detach() for b in bs]) for k in bnames}
    return params, bufs


class Batched:
    """Many copies of one architecture trained at once with SGD (momentum, weight decay).

    ``models``: same structure (parameter and buffer names and shapes); ``lrs``: one learning
    rate per copy.  ``bias_lr_mult`` scales the learning rate of every parameter whose name ends
    in 'bias' (an ablation).  Parameters and buffers live on ``device``.
    """

    def __init__(self, models: Sequence[nn.Module], lrs: Sequence[float], momentum: float,
                 weight_decay: float, device: str = "cpu", bias_lr_mult: float = 1.0) -> None:
        self.base = copy.deepcopy(models[0]).to("meta")
        self.base.train()
        params, bufs = stack_state(models)
        self.names = list(params)
        self.params = {k: v.detach().to(device).contiguous() for k, v in params.items()}
        self.bufs = {k: v.detach().to(device) for k, v in bufs.items()}
        self.mom = {k: torch.zeros_like(v) for k, v in self.params.items()}
        self.lr = torch.tensor(list(lrs), dtype=torch.float32, device=device)
        self.mult = {k: (bias_lr_mult if k.endswith("bias") else 1.0) for k in self.names}
        self.momentum, self.wd = float(momentum), float(weight_decay)
        self.n = len(models)
        self.alive = torch.arange(self.n, device=device)       # original index of each row
        self.steps = 0
        self.device = device

        def f(p: dict, b: dict, x: torch.Tensor) -> torch.Tensor:
            return functional_call(self.base, (p, b), (x,))
        self._f = f

    def forward(self, x: torch.Tensor, shared: bool = False) -> torch.Tensor:
        return vmap(self._f, in_dims=(0, 0, None if shared else 0))(self.params, self.bufs, x)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One SGD step on per-copy batches ``x: (M, B, ...)``, ``y: (M, B)`` (rows of alive
        copies).  Returns the per-copy minibatch losses (before the step)."""
        ps = [self.params[k].requires_grad_(True) for k in self.names]
        out = self.forward(x)
        m, b = y.shape
        loss = F.cross_entropy(out.reshape(m * b, -1).float(), y.reshape(-1),
                               reduction="none").view(m, b).mean(1)
        grads = torch.autograd.grad(loss.sum(), ps)
        with torch.no_grad():
            first = self.steps == 0
            for k, p, g in zip(self.names, ps, grads):
                p.requires_grad_(False)
                if self.wd:
                    g = g.add(p, alpha=self.wd)
                buf = self.mom[k]
                if self.momentum:
                    if first:
                        buf.copy_(g)
                    else:
                        buf.mul_(self.momentum).add_(g)
                    g = buf
                lr = (self.lr * self.mult[k]).view(-1, *([1] * (p.dim() - 1)))
                p.sub_(lr * g)
        self.steps += 1
        return loss.detach()

    def drop(self, keep: torch.Tensor) -> None:
        """Keep only the rows where ``keep`` (bool over the current rows) is true."""
        idx = keep.nonzero().flatten()
        self.params = {k: v[idx].contiguous() for k, v in self.params.items()}
        self.mom = {k: v[idx].contiguous() for k, v in self.mom.items()}
        self.bufs = {k: v[idx] for k, v in self.bufs.items()}
        self.lr = self.lr[idx]
        self.alive = self.alive[idx]

    def params_finite(self) -> torch.Tensor:
        ok = torch.ones(len(self.alive), dtype=torch.bool, device=self.device)
        for v in self.params.values():
            ok &= torch.isfinite(v.flatten(1)).all(1)
        return ok

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, chunk: int = 512) -> torch.Tensor:
        """Mean cross-entropy of every alive copy on the whole of ``(x, y)`` (shared data);
        non-finite -> +inf."""
        tot = torch.zeros(len(self.alive), dtype=torch.float64, device=self.device)
        for i in range(0, len(y), chunk):
            out = self.forward(x[i:i + chunk], shared=True)
            yy = y[i:i + chunk]
            m, b = out.shape[:2]
            ce = F.cross_entropy(out.reshape(m * b, -1).float(), yy.repeat(m), reduction="none")
            tot += ce.view(m, b).double().sum(1)
        tot /= len(y)
        return torch.where(torch.isfinite(tot), tot, torch.full_like(tot, math.inf))


def train_batched(models: Sequence[nn.Module], lrs: Sequence[float], seeds_of: Sequence[int],
                  x: torch.Tensor, y: torch.Tensor, order: dict[int, torch.Tensor], *,
                  batch: int, epochs: float, momentum: float, weight_decay: float,
                  device: str = "cpu", bias_lr_mult: float = 1.0, eval_every: int = 0,
                  curve_every: int = 0) -> dict:
    """Train every copy; copy ``i`` uses learning rate ``lrs[i]`` and the data order of seed
    ``seeds_of[i]`` (``order[seed]``: a permutation per epoch, shape (epochs, n)), so copies that
    share a seed see the same minibatches whatever their method or learning rate.

    Returns ``final`` (full-data training loss after training, +inf when diverged), ``curve``
    (per-copy minibatch losses averaged over windows of ``curve_every`` steps) and ``evals``
    (full-data training loss every ``eval_every`` steps, when > 0)."""
    n = len(y)
    tr = Batched(models, lrs, momentum, weight_decay, device, bias_lr_mult)
    uniq = sorted(set(int(s) for s in seeds_of))
    ordt = torch.stack([order[s] for s in uniq]).to(device)          # (S, E, n)
    row_of_seed = {s: i for i, s in enumerate(uniq)}
    seed_row = torch.tensor([row_of_seed[int(s)] for s in seeds_of], device=device)
    steps_per_epoch = max(1, n // batch)
    total = int(round(epochs * steps_per_epoch))
    M = len(lrs)
    final = torch.full((M,), math.inf, dtype=torch.float64)
    curve = [[] for _ in range(M)]
    win = torch.zeros(M, dtype=torch.float64)
    win_n = 0
    evals: list[list[float]] = [[] for _ in range(M)]
    eval_steps: list[int] = []
    for t in range(total):
        e, j = divmod(t, steps_per_epoch)
        rows = seed_row[tr.alive]
        idx = ordt[rows, e % ordt.shape[1], j * batch:(j + 1) * batch]   # (M_alive, B)
        loss = tr.step(x[idx], y[idx])
        lcpu = loss.double().cpu()
        win[tr.alive.cpu()] += lcpu
        win_n += 1
        ok = torch.isfinite(loss) & tr.params_finite()
        if not bool(ok.all()):
            dead = tr.alive[~ok].cpu()
            for d in dead.tolist():
                win[d] = math.inf
            tr.drop(ok)
            if len(tr.alive) == 0:
                break
        if curve_every and (t + 1) % curve_every == 0:
            for i in range(M):
                curve[i].append(float(win[i]) / win_n)
            win.zero_()
            alive_set = set(tr.alive.cpu().tolist())
            for i in range(M):
                if i not in alive_set:
                    win[i] = math.inf
            win_n = 0
        if eval_every and (t + 1) % eval_every == 0 and len(tr.alive):
            ev = torch.full((M,), math.inf, dtype=torch.float64)
            ev[tr.alive.cpu()] = tr.eval_loss(x, y).cpu()
            for i in range(M):
                evals[i].append(float(ev[i]))
            eval_steps.append(t + 1)
    if len(tr.alive):
        final[tr.alive.cpu()] = tr.eval_loss(x, y).cpu()
    return {"final": final.numpy(), "curve": curve, "evals": evals, "eval_steps": eval_steps,
            "steps": total, "steps_per_epoch": steps_per_epoch}


def orders(seeds: Sequence[int], n: int, epochs: int) -> dict[int, torch.Tensor]:
    """A data permutation per epoch for each seed (shared by all methods and learning rates)."""
    out = {}
    for s in seeds:
        g = torch.Generator().manual_seed(777 + s)
        out[s] = torch.stack([torch.randperm(n, generator=g) for _ in range(max(1, epochs))])
    return out


# ---------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------

def norm_table(best: dict[str, dict[str, float]], methods: Sequence[str],
               n_boot: int = 1000, seed: int = 0) -> dict[str, dict]:
    """Paper Table 2 columns from ``best[dataset][method]`` (median-over-seeds loss at the best
    learning rate): each dataset divided by its worst method, averaged; worst/best counts (ties
    count for every tied method); a bootstrap over datasets gives the standard error."""
    ds = [d for d in best if all(m in best[d] for m in methods)]
    L = np.array([[best[d][m] for m in methods] for d in ds], dtype=float)
    L = np.where(np.isfinite(L), L, np.nan)
    worst = np.nanmax(L, axis=1, keepdims=True)
    norm = L / worst
    norm = np.where(np.isnan(norm), 1.0, norm)       # a method that diverged at every LR = worst
    rng = np.random.default_rng(seed)
    boots = np.array([norm[rng.integers(0, len(ds), len(ds))].mean(0) for _ in range(n_boot)])
    out = {}
    for j, m in enumerate(methods):
        col = norm[:, j]
        out[m] = {"avg_normalized": float(col.mean()), "se": float(boots[:, j].std()),
                  "worst_in": int(np.sum(np.isclose(col, 1.0))),
                  "best_in": int(np.sum(np.isclose(col, norm.min(1)))),
                  "datasets": len(ds)}
    return out


def table_md(tab: dict[str, dict], title: str = "") -> str:
    lines = [title] if title else []
    lines += ["| method | average normalized loss | worst in # | best in # |", "|---|---|---|---|"]
    for m, r in tab.items():
        lines.append(f"| {LABELS.get(m, m)} | {r['avg_normalized']:.3f} ± {r['se']:.3f} | "
                     f"{r['worst_in']} | {r['best_in']} |")
    return "\n".join(lines)


def digits_images(size: int = 16, channels: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits (1797 8x8 images, 10 classes), upsampled bilinearly to size x size,
    repeated over ``channels``, scaled to [-1, 1] (the paper's CIFAR normalization)."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    if size != 8:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = (x * 2 - 1).repeat(1, channels, 1, 1)
    return x, torch.tensor(d.target, dtype=torch.long)


def add_run_args(ap: "argparse.ArgumentParser") -> None:
    """The options every study shares: where it runs and where its results go."""
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--threads", type=int, default=1)


def parse_run_args(ap: "argparse.ArgumentParser", argv=None):
    """Parse, then set the thread count (``setup``)."""
    args = ap.parse_args(argv)
    setup(args.threads)
    return args
