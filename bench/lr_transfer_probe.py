"""What at initialization predicts the best learning rate (issue 11, item 3)?

For each member of the digits MLP family of ``bench/train_suite.py`` (widths at depth 2, depths
at width 128), preconditioned with precondfx's defaults, this measures on the calibration batch
(the first minibatch, 32 images, true labels):

* ``lam_max``: the top eigenvalue of the Gauss-Newton matrix of the cross-entropy (power
  iteration on Gauss-Newton-vector products): SGD is stable below 2(1+momentum)/lam_max;
* ``greedy_sgd``: g'g / g'Gg, the rate that minimizes the quadratic model along the gradient;
* ``greedy_adam``: |g|_1 / s'Gs with s = sign(g), the same along Adam's first step;
* ``nu``: per layer, the relative change of the layer's output for a unit Adam step,
  fan_in * E|x| / rms(y) (x: the layer's input, y: its output), and its median over layers.
* ``adam_step``: per layer, the relative change of the layer's output (rms over the batch,
  input held fixed) that Adam's first step at rate 1 makes, measured: the first Adam step is
  ``-lr sign(g)`` on every stored parameter, weight *and bias*, so the change is
  ``c (sign(G_W) x + sign(g_b))`` against ``c (W x + b)`` (c: a multiplier on the layer's output,
  ``lr_scale``; it cancels).  Its spread over layers and its movement over widths and depths
  say how far one rate is from suiting every layer of every member.
* ``adam_out``: the relative change of the whole model's centred logits (rms over the batch and
  classes) that Adam's first step ``-lr sign(g)`` on every trainable parameter makes at rate 1,
  to first order (one Jacobian-vector product); ``1/adam_out`` is the rate at which that first
  step moves the logits by their own rms.  Unlike the per-layer columns it needs nothing of the
  architecture, so ``--size cpu`` measures the held-out suite's CNNs and transformers too.

Each predictor is printed as log2 of the rate it implies (1/lam_max, the greedy rates, 1/nu);
``lr_transfer_cpu.md`` compares their movement over widths and depths with the best rates the
training suite measured.  Single thread, seconds per model.

    python bench/lr_transfer_probe.py            # writes docs/results/lr_transfer_probe.json
    (--lr-scale adam measured the lr_scale='adam' models, removed since; commit aa5b8de has it)
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import train_suite as TS  # noqa: E402


def _gnvp(m: nn.Module, x: torch.Tensor, ws: list[torch.Tensor], v: list[torch.Tensor]
          ) -> list[torch.Tensor]:
    """G v, G = J' H_z J with H_z = (diag p - p p')/B the cross-entropy's output Hessian."""
    z = m(x)
    u = torch.zeros_like(z, requires_grad=True)
    gu = torch.autograd.grad((z * u).sum(), ws, create_graph=True)
    jv = torch.autograd.grad(sum((a * b).sum() for a, b in zip(gu, v)), u)[0]
    p = z.detach().softmax(-1)
    hjv = (p * jv - p * (p * jv).sum(-1, keepdim=True)) / len(x)
    return [g.detach() for g in torch.autograd.grad((z * hjv).sum(), ws)]


def _dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return sum(float((x * y).sum()) for x, y in zip(a, b))


def probe(m: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> dict:
    ws = [p for n, p in m.named_parameters() if p.dim() > 1]
    z = m(x)
    g = [q.detach() for q in torch.autograd.grad(nn.functional.cross_entropy(z, y), ws)]
    s = [q.sign() for q in g]
    greedy_sgd = _dot(g, g) / _dot(g, _gnvp(m, x, ws, g))
    greedy_adam = sum(float(q.abs().sum()) for q in g) / _dot(s, _gnvp(m, x, ws, s))
    gen = torch.Generator().manual_seed(seed)
    v = [torch.randn(q.shape, generator=gen) for q in ws]
    for _ in range(30):
        hv = _gnvp(m, x, ws, v)
        n = math.sqrt(_dot(hv, hv))
        v = [q / n for q in hv]
    lam = _dot(v, _gnvp(m, x, ws, v))
    nus: list[float] = []
    io: list[tuple[nn.Linear, torch.Tensor, torch.Tensor]] = []

    def hook(mod: nn.Module, inp: tuple, out: torch.Tensor) -> None:
        nus.append(mod.in_features * float(inp[0].abs().mean()) / float(out.pow(2).mean().sqrt()))
        io.append((mod, inp[0].detach(), out.detach()))
    lins = [mod for mod in m.modules() if isinstance(mod, nn.Linear)]
    hs = [mod.register_forward_hook(hook) for mod in lins]
    with torch.no_grad():
        m(x)
    for h in hs:
        h.remove()
    steps = adam_step_rel(m, x, y, io)
    return {"log2_inv_adam_out": -math.log2(adam_out_rel(m, x, y)),
            "log2_inv_lam_max": -math.log2(lam), "log2_greedy_sgd": math.log2(greedy_sgd),
            "log2_greedy_adam": math.log2(greedy_adam),
            "log2_inv_nu_median": -math.log2(float(np.median(nus))),
            "log2_inv_adam_step_max": -math.log2(max(steps)),
            "log2_nu_layers": [math.log2(n) for n in nus],
            "log2_adam_step_layers": [math.log2(v) for v in steps]}


def _logits(out: object) -> torch.Tensor:
    out = getattr(out, "logits", out)
    return out[0] if isinstance(out, (tuple, list)) else out  # type: ignore[return-value]


def adam_out_rel(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """rms(J s) / rms(z) with ``z`` the centred logits and ``s = sign(g)`` over every trainable
    parameter: the first-order change Adam's first step at rate 1 makes to the output."""
    ps = [p for p in m.parameters() if p.requires_grad]
    z = _logits(m(x))
    loss = nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]).float(), y.reshape(-1))
    s = [torch.zeros_like(p) if q is None else q.sign()
         for p, q in zip(ps, torch.autograd.grad(loss, ps, allow_unused=True))]
    z = _logits(m(x))
    u = torch.zeros_like(z, requires_grad=True)
    gu = torch.autograd.grad((z * u).sum(), ps, create_graph=True, allow_unused=True)
    js = torch.autograd.grad(sum((a * b).sum() for a, b in zip(gu, s) if a is not None), u)[0]
    zc = z.detach() - z.detach().mean(-1, keepdim=True)
    jc = js - js.mean(-1, keepdim=True)
    return float(jc.pow(2).mean().sqrt() / zc.pow(2).mean().sqrt())


def probe_any(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The architecture-free column alone (models that are not the digits MLPs)."""
    return {"log2_inv_adam_out": -math.log2(adam_out_rel(m, x, y))}


def adam_step_rel(m: nn.Module, x: torch.Tensor, y: torch.Tensor,
                  io: list[tuple[nn.Linear, torch.Tensor, torch.Tensor]]) -> list[float]:
    """Per Linear layer: rms(sign(G_W) x + sign(g_b)) / rms(W x + b) on the batch, the relative
    change of its output under Adam's first step (``-lr sign(g)``) at rate 1."""
    lins = [mod for mod, _, _ in io]
    ps = [q for mod in lins for q in (mod.weight, mod.bias) if q is not None]
    g = dict(zip(map(id, ps), torch.autograd.grad(nn.functional.cross_entropy(m(x), y), ps)))
    out = []
    for mod, xin, yout in io:
        d = xin @ g[id(mod.weight)].sign().T
        if mod.bias is not None:
            d = d + g[id(mod.bias)].sign()
        out.append(float(d.pow(2).mean().sqrt() / yout.pow(2).mean().sqrt()))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--lr-scale", default="none", choices=["none", "sgd", "user"],
                    help="precondition with this lr_scale= (default: precondfx's defaults)")
    ap.add_argument("--tasks", default="mlp", help="comma list of task names or prefixes")
    ap.add_argument("--size", default="cpu_lr", choices=["cpu_lr", "cpu"],
                    help="the suite's size whose tasks are probed (cpu: the held-out tasks, "
                         "measured with the architecture-free column only)")
    C.add_run_args(ap)
    args = C.parse_run_args(ap, argv)
    cfg = TS.SIZES[args.size]
    tasks = TS.select(TS.all_tasks(dict(cfg, libsvm=False)), args.tasks.split(","))
    kw = {} if args.lr_scale == "none" else {"lr_scale": args.lr_scale}
    out: dict = {"tasks": {}, "command": "python bench/lr_transfer_probe.py "
                 + " ".join(argv if argv is not None else sys.argv[1:])}
    import precondfx
    for t in tasks:
        rows = []
        for seed in range(args.seeds):
            x, y = t.get(t.sampler(seed)[0])
            torch.manual_seed(seed)
            model, _ = precondfx.precondition(t.make(), x, seed=seed, **kw)
            mlp = t.family.startswith("mlp")
            rows.append((probe if mlp else probe_any)(model.train(), x, y, *([seed] * mlp)))
        keys = [k for k in rows[0] if not k.endswith("layers")]
        row = out["tasks"][t.name] = {"family": t.family,
                                      **{k: float(np.mean([r[k] for r in rows])) for k in keys}}
        line = f"{t.name:14s} " + " ".join(f"{k}={row[k]:6.2f}" for k in keys)
        if "log2_nu_layers" in rows[0]:
            row["log2_nu_layers"] = rows[0]["log2_nu_layers"]
            row["log2_adam_step_layers"] = [float(np.mean(v)) for v in zip(
                *(r["log2_adam_step_layers"] for r in rows))]
            line += "  adam_step/layer " + " ".join(f"{v:5.1f}"
                                                     for v in row["log2_adam_step_layers"])
        print(line, flush=True)
    C.write_json(os.path.join(args.out, f"lr_transfer_probe{'_' + args.tag if args.tag else ''}"
                              f".json"), out)
    return out


if __name__ == "__main__":
    main()
