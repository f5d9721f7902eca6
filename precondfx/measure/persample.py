"""Per-sample gradient Gram matrices of many samples from one batched forward.

The sketch (:mod:`precondfx.measure.sketch`) needs, for each sample i, each measured weight W
and each pair of random cotangents ``v_a, v_b``, the inner products ``g_a . g_b`` of the
per-sample gradients ``g_a = J_i^T v_a``.  Run one sample at a time, that is one batch-size-1
forward and P backward passes per sample, and on a large model those small passes waste most
of the machine (ResNet-50 on a CPU: 12-20 training steps for 16 samples).

Here the samples go through the model together.  Forward hooks on the modules that own the
measured weights keep each call's input ``x`` and output ``y``; P backward passes of the batch
(cotangent rows drawn exactly as the per-sample loop draws them) give ``dy`` for every sample
at once, and the per-sample gradient is a known bilinear form of ``(x, dy)``:

* ``nn.Linear`` and transformers' ``Conv1D``: ``g = sum_t dy_t x_t^T`` over the positions t of
  the sample (all calls of the module): Gram by ``(dy dy^T) . (x x^T)`` over positions when
  that is cheaper, else from the materialized per-sample gradient;
* ``nn.Embedding``: ``g = sum_t onehot(id_t) dy_t^T``: ``[id_t = id_t'] dy_t . dy_t'``;
* ``nn.Conv1d``/``nn.Conv2d`` (zero padding, any stride/dilation/groups): ``dy`` against the
  unfolded input, materialized per sample.

No weight gradient is computed by autograd (the backward stops at the module outputs).  Three
checks fall back to the per-sample loop (``Unsupported``) rather than guess: every measured
weight must belong only to such modules; the batched forward must give each sample the output
it gets alone (BatchNorm in train mode normalizes one sample by its own statistics, which is
emulated; anything else that mixes samples fails the check); and the sum over the batch of the
per-sample gradients must equal autograd's gradient of the batch (a weight used outside its
module would break it).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from precondfx.capture.common import Sample


class Unsupported(Exception):
    """The batched path cannot measure this model exactly; the caller loops over samples."""


def _is_conv1d_t(m: nn.Module) -> bool:
    cls = type(m)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.") and \
        isinstance(getattr(m, "nf", None), int)


def _kind(m: nn.Module) -> str | None:
    if isinstance(m, nn.Linear):
        return "linear"
    if _is_conv1d_t(m):
        return "linear"
    if isinstance(m, nn.Embedding):
        return None if (m.scale_grad_by_freq or m.sparse) else "embedding"
    if isinstance(m, (nn.Conv1d, nn.Conv2d)) and m.padding_mode == "zeros" and \
            not isinstance(m.padding, str):
        return "conv"
    return None


class _PerSampleBatchNorm(TorchFunctionMode):
    """Train-mode batch norm with each sample's own statistics: what a batch of one computes
    (BatchNorm on ``(1, C, ...)`` normalizes over the sample's positions)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            p = dict(zip(("input", "running_mean", "running_var", "weight", "bias", "training",
                          "momentum", "eps"), args))
            p.update(kwargs)
            if p.get("training", False):
                x = p["input"]
                if x.dim() < 3:
                    raise Unsupported("train-mode BatchNorm on (N, C) inputs cannot run on one "
                                      "sample")
                # statistics over each sample's positions, per channel: instance norm (one
                # fused kernel); running statistics are not updated (they are restored anyway)
                return F.instance_norm(x, weight=p.get("weight"), bias=p.get("bias"),
                                       use_input_stats=True, eps=p.get("eps", 1e-5))
        return func(*args, **kwargs)


class _Site:
    """Forward hook on one module: keeps each call's input and (differentiable) output."""

    def __init__(self, module: nn.Module, kind: str) -> None:
        self.module, self.kind = module, kind
        self.xs: list[torch.Tensor] = []
        self.ys: list[torch.Tensor] = []
        self.cache: dict[tuple, torch.Tensor] = {}
        self.on = True

    def __call__(self, module: nn.Module, args: tuple, out: Any) -> Any:
        if not self.on:
            return None
        if not isinstance(out, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
            raise Unsupported(f"{type(module).__name__} called with a non-tensor input or output")
        self.xs.append(args[0].detach().clone())
        self.ys.append(out)
        return out.clone()  # an in-place op downstream cannot overwrite what we differentiate


def _rows(x: torch.Tensor, d: int) -> torch.Tensor:
    """(B, T, d): positions of one sample flattened (dim 0 is the batch)."""
    return x.reshape(x.shape[0], -1, d)


def _linear_parts(site: _Site, dys: list[list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, T, n) and dy (B, P, T, m) with every call's positions concatenated."""
    m = site.module
    n = m.in_features if isinstance(m, nn.Linear) else m.weight.shape[0]
    xs = torch.cat([_rows(x, n) for x in site.xs], dim=1)
    ds = torch.stack([torch.cat([_rows(d, d.shape[-1]) for d in per_call], dim=1)
                      for per_call in dys], dim=1)
    return xs, ds


def _gram_linear(site: _Site, dys: list[list[torch.Tensor]], rows: slice) -> torch.Tensor:
    x, d = _linear_parts(site, dys)
    x, d = x[rows].double(), d[rows].double()
    b, p, t, mo = d.shape
    n = x.shape[-1]
    if t * t * (p * p * mo + n) <= t * p * mo * n + p * p * mo * n:  # Gram over positions
        kx = x @ x.transpose(1, 2)                                         # (B, T, T)
        kd = torch.einsum("bato,bcuo->bactu", d, d)                        # (B, P, P, T, T)
        return torch.einsum("bactu,btu->bac", kd, kx)
    g = torch.einsum("bato,bti->baoi", d, x).reshape(b, p, -1)
    return g @ g.transpose(1, 2)


def _gram_embedding(site: _Site, dys: list[list[torch.Tensor]], rows: slice) -> torch.Tensor:
    m = site.module
    ids = torch.cat([x.reshape(x.shape[0], -1) for x in site.xs], dim=1)[rows]
    d = torch.stack([torch.cat([_rows(dd, m.embedding_dim) for dd in per_call], dim=1)
                     for per_call in dys], dim=1)[rows].double()
    same = ids[:, :, None] == ids[:, None, :]
    if m.padding_idx is not None:
        keep = ids != m.padding_idx
        same = same & keep[:, :, None] & keep[:, None, :]
    kd = torch.einsum("bato,bcuo->bactu", d, d)
    return torch.einsum("bactu,btu->bac", kd, same.double())


def _conv_parts(site: _Site, dys: list[list[torch.Tensor]], rows: slice
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unfolded inputs U (B, groups, K, L) and output gradients D (B, P, groups, C_out/groups,
    L) of a Conv1d/Conv2d, every call's positions concatenated: the per-sample weight gradient
    of group g is ``D[b, a, g] @ U[b, g]^T``."""
    m = site.module
    two = isinstance(m, nn.Conv2d)
    k = m.kernel_size if two else (1, m.kernel_size[0])
    st = m.stride if two else (1, m.stride[0])
    pd = m.padding if two else (0, m.padding[0])
    dl = m.dilation if two else (1, m.dilation[0])
    g, ci, co = m.groups, m.in_channels, m.out_channels
    key = ("u", rows.start, rows.stop)
    if key not in site.cache:  # the same inputs in every round: unfold them once
        us = []
        for x in site.xs:
            x = x[rows]
            x = x if two else x.unsqueeze(2)
            u = F.unfold(x, k, dilation=dl, padding=pd, stride=st)      # (B, Ci*k, L)
            us.append(u.reshape(x.shape[0], g, ci // g * k[0] * k[1], -1))
        site.cache[key] = us[0] if len(us) == 1 else torch.cat(us, dim=-1)
    ds = []
    for c in range(len(site.xs)):
        d = torch.stack([per_call[c][rows] for per_call in dys], dim=1)   # (B, P, Co, ...)
        ds.append(d.reshape(d.shape[0], d.shape[1], g, co // g, -1))
    return site.cache[key], ds[0] if len(ds) == 1 else torch.cat(ds, dim=-1)


def _gram_conv(site: _Site, dys: list[list[torch.Tensor]], rows: slice) -> torch.Tensor:
    """(B, P, P) Gram of the per-sample weight gradients: over positions (``D D^T . U^T U``)
    when the layer has few output positions, else from the materialized gradients."""
    u, d = _conv_parts(site, dys, rows)
    b, g, k, n = u.shape
    p, c = d.shape[1], d.shape[3]
    if g * n * n * (k + p * p * c) < g * p * c * k * n + p * p * g * c * k:
        key = ("ku", rows.start, rows.stop)
        if key not in site.cache:
            site.cache[key] = u.transpose(2, 3) @ u                         # (B, g, L, L)
        ku = site.cache[key]
        dd = d.permute(0, 2, 1, 4, 3).reshape(b, g, p * n, c)              # (B, g, P*L, C)
        kd = (dd @ dd.transpose(2, 3)).reshape(b, g, p, n, p, n)
        return torch.einsum("bgalcm,bglm->bac", kd, ku).double()
    dd = d.permute(0, 2, 1, 3, 4).reshape(b, g, p * c, n)                  # (B, g, P*C, L)
    gw = (dd @ u.transpose(2, 3)).reshape(b, g, p, c * k)                  # (B, g, P, C*K)
    gw = gw.permute(0, 2, 1, 3).reshape(b, p, g * c * k)
    return (gw @ gw.transpose(1, 2)).double()


def _gram(site: _Site, dys: list[list[torch.Tensor]], rows: slice) -> torch.Tensor:
    if site.kind == "linear":
        return _gram_linear(site, dys, rows)
    if site.kind == "embedding":
        return _gram_embedding(site, dys, rows)
    return _gram_conv(site, dys, rows)


def _grad_sum(site: _Site, dy: list[torch.Tensor]) -> torch.Tensor:
    """Sum over the batch of the per-sample gradients for one cotangent, in the weight's layout
    (autograd's gradient of the batch when the weight is used only by this module)."""
    m = site.module
    w = m.weight
    if site.kind == "linear":
        x, d = _linear_parts(site, [dy])
        gs = torch.einsum("bto,bti->oi", d[:, 0], x)
        return gs if isinstance(m, nn.Linear) else gs.T
    if site.kind == "embedding":
        ids = torch.cat([x.reshape(-1) for x in site.xs])
        d = torch.cat([dd.reshape(-1, m.embedding_dim) for dd in dy])
        if m.padding_idx is not None:
            d = d * (ids != m.padding_idx)[:, None]
        return torch.zeros(w.shape, dtype=d.dtype, device=d.device).index_add_(0, ids, d)
    u, d = _conv_parts(site, [dy], slice(0, site.xs[0].shape[0]))
    return torch.einsum("bgcl,bgkl->gck", d[:, 0], u).reshape(w.shape)


def batched_sketch(model: nn.Module, smp: Sample, batch: int, params: Sequence[torch.Tensor],
                   names: Sequence[str], n_samples: int, n_cotangents: int,
                   gen: torch.Generator, output_fn: Callable[[Any], torch.Tensor],
                   step: Callable[[int], None] = lambda n: None, first: int = 0,
                   stop: Callable[[np.ndarray], bool] | None = None) -> np.ndarray:
    """Per-sample statistic ``(sum over pairs of G_aa G_bb + G_ab^2) / pairs / (2 numel)``
    (``n_samples`` x ``len(params)``), the same estimator with the same cotangents as the
    per-sample loop; raises :class:`Unsupported` when it cannot be exact.  After the round
    that reaches ``first`` samples, ``stop(values so far)`` may end the measurement early (the
    rows returned are the samples measured)."""
    owners: dict[int, list[_Site]] = {id(p): [] for p in params}
    sites: dict[int, _Site] = {}
    for path, m in model.named_modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and id(w) in owners:
            kind = _kind(m)
            name = names[[id(p) for p in params].index(id(w))]
            if kind is None:
                raise Unsupported(f"{name} is used by a {type(m).__name__} module")
            if id(m) not in sites:
                sites[id(m)] = _Site(m, kind)
            owners[id(w)].append(sites[id(m)])
    for p, name in zip(params, names):
        if not owners[id(p)]:
            raise Unsupported(f"{name} belongs to no Linear/Conv/Embedding module")
        if len({id(s) for s in owners[id(p)]}) > 1:
            raise Unsupported(f"{name} is shared by several modules")
    nb = min(batch, n_samples)
    # prepend: see the module's own output, before any hook of the user's or of precondfx
    # (an output scale on the last layer) transforms it
    handles = [s.module.register_forward_hook(s, prepend=True) for s in sites.values()]
    try:
        with _PerSampleBatchNorm():
            y = output_fn(smp.take(0, nb).call(model))
        for s in sites.values():
            s.on = False
        with torch.no_grad():
            y1 = output_fn(smp.take(0).call(model))
        if y.shape[0] != nb or tuple(y.shape[1:]) != tuple(y1.shape[1:]):
            raise Unsupported(f"the batched output {tuple(y.shape)} does not stack the "
                              f"per-sample outputs {tuple(y1.shape)}")
        ref = y1.detach().double()
        err = float((y[:1].detach().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        if not err < 1e-4:
            raise Unsupported(f"the batched forward changes a sample's output by {err:.2g} "
                              f"(relative): the model mixes samples")
        for s in sites.values():
            if not s.ys:
                raise Unsupported(f"a {type(s.module).__name__} was not called")
            for x, yy in zip(s.xs, s.ys):
                if x.dim() == 0 or x.shape[0] != nb or yy.dim() == 0 or yy.shape[0] != nb:
                    raise Unsupported(f"a {type(s.module).__name__} runs on a tensor without "
                                      f"the batch dimension (input {tuple(x.shape)}), shared "
                                      f"by the samples")
        outs = [(s, c) for s in sites.values() for c in range(len(s.ys))]
        targets = [s.ys[c] for s, c in outs]
        # cotangents in the per-sample loop's order: sample by sample, P each
        vs = torch.stack([torch.stack([torch.randn(y1.shape, generator=gen, dtype=torch.float32)
                                       for _ in range(n_cotangents)])
                          for _ in range(n_samples)])
        per = np.zeros((n_samples, len(params)))
        iu = [(a, b) for a in range(n_cotangents) for b in range(a + 1, n_cotangents)]
        rounds = [(r, min(nb, n_samples - r)) for r in range(0, n_samples, nb)]
        for ri, (s0, cnt) in enumerate(rounds):
            dys: dict[int, list[list[torch.Tensor]]] = {id(s): [] for s in sites.values()}
            for a in range(n_cotangents):
                v = torch.zeros(y.shape, dtype=y.dtype, device=y.device)
                v[:cnt] = vs[s0:s0 + cnt, a].reshape((cnt,) + tuple(y.shape[1:])).to(v)
                last = ri == len(rounds) - 1 and a == n_cotangents - 1
                check = ri == 0 and a == 0
                want = targets + (list(params) if check else [])
                g = torch.autograd.grad(y, want, v, retain_graph=not last, allow_unused=True)
                per_site: dict[int, list[torch.Tensor]] = {id(s): [] for s in sites.values()}
                for (s, c), gi in zip(outs, g[:len(targets)]):
                    per_site[id(s)].append(torch.zeros_like(s.ys[c]) if gi is None
                                           else gi.detach())
                for k, lst in per_site.items():
                    dys[k].append(lst)
                if check:
                    _check_sums(params, names, owners, per_site, g[len(targets):])
            for j, p in enumerate(params):
                site = owners[id(p)][0]
                gram = _gram(site, dys[id(site)], slice(0, cnt))
                sq = torch.diagonal(gram, dim1=1, dim2=2)
                acc = sum(sq[:, a] * sq[:, b] + gram[:, a, b] ** 2 for a, b in iu)
                per[s0:s0 + cnt, j] = (acc / len(iu) / (2 * p.numel())).cpu().numpy()
            step(cnt)
            done = s0 + cnt
            if stop is not None and first and done >= first and done < n_samples and \
                    stop(per[:done]):
                return per[:done]
        return per
    finally:
        for h in handles:
            h.remove()


def _check_sums(params: Sequence[torch.Tensor], names: Sequence[str],
                owners: dict[int, list[_Site]], per_site: dict[int, list[torch.Tensor]],
                grads: Sequence[torch.Tensor | None]) -> None:
    """The per-sample gradients must add up to autograd's gradient of the batch."""
    for p, name, g in zip(params, names, grads):
        site = owners[id(p)][0]
        tot = _grad_sum(site, per_site[id(site)]).reshape(p.shape)
        ref = torch.zeros_like(tot) if g is None else g.detach().to(tot.dtype)
        err = float(torch.linalg.vector_norm(tot - ref))
        scale = float(torch.linalg.vector_norm(ref))
        if not err <= 1e-3 * scale:  # float32 sums in another order: ~1e-6; a missed use: O(1)
            raise Unsupported(f"{name}: the per-sample gradients do not add up to the batch "
                              f"gradient (relative error {err / max(scale, 1e-30):.2g}): the "
                              f"weight is used outside its module")
