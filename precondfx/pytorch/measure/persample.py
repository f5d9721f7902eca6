"""Per-sample gradient Gram matrices of many samples from one batched forward.

The sketch (:mod:`precondfx.pytorch.measure.sketch`) needs, for each sample i, each measured weight W
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

from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from precondfx.pytorch.capture.common import Sample
from precondfx.pytorch.measure.ranks import agreed


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
    if isinstance(m, (nn.Conv1d, nn.Conv2d)) and (
            m.padding_mode == "zeros" and not isinstance(m.padding, str) or
            isinstance(getattr(m, "_reversed_padding_repeated_twice", None), (list, tuple))):
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
                # (a copy, not instance_norm's view of its reshaped result: an in-place op
                # downstream, such as ReLU(inplace=True), would otherwise make autograd rebuild
                # the whole base gradient at every backward pass (CopySlices))
                return F.instance_norm(x, weight=p.get("weight"), bias=p.get("bias"),
                                       use_input_stats=True, eps=p.get("eps", 1e-5)).clone()
        return func(*args, **kwargs)


class _Site:
    """Forward hook on one module: keeps each call's input and (differentiable) output; during
    a round it turns each cotangent's output gradient into what the Gram needs (``absorb``), so
    that no backward pass's gradients outlive it."""

    def __init__(self, module: nn.Module, kind: str) -> None:
        self.module, self.kind = module, kind
        self.xs: list[torch.Tensor] = []
        self.ys: list[torch.Tensor] = []
        self.cache: dict[tuple, torch.Tensor] = {}
        self.feats: list[torch.Tensor] = []   # one per cotangent of the current round
        self.materialize = False              # feats are per-sample gradients, else dy
        self.on = True
        self.nb = 1                           # the batch of the recorded forward

    def __call__(self, module: nn.Module, args: tuple, out: Any) -> Any:
        if not self.on:
            return None
        if not isinstance(out, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
            raise Unsupported(f"{type(module).__name__} called with a non-tensor input or output")
        x = args[0]
        if self.nb > 1 and x.dim() >= 1 and x.shape[0] == 1 and out.dim() >= 2 and \
                out.shape[0] == 1:
            # shared by the samples (position embeddings on position ids of shape (1, T)):
            # every sample gets its own copy, so that its gradient is its own; a model that
            # does not broadcast the output fails the forward or the output check
            x = x.expand((self.nb,) + tuple(x.shape[1:]))
            out = out.expand((self.nb,) + tuple(out.shape[1:]))
        self.xs.append(x.detach().clone())
        self.ys.append(out)
        return out.clone()  # an in-place op downstream cannot overwrite what we differentiate

    # -- the parts of the per-sample gradient ------------------------------------------------
    def _x(self, rows: slice) -> torch.Tensor:
        """Linear: inputs (B, T, n), every call's positions concatenated (cached)."""
        key = ("x", rows.start, rows.stop)
        if key not in self.cache:
            m = self.module
            n = m.in_features if isinstance(m, nn.Linear) else m.weight.shape[0]
            self.cache[key] = torch.cat([_rows(x[rows], n) for x in self.xs], dim=1)
        return self.cache[key]

    def _u(self, rows: slice) -> torch.Tensor:
        """Conv: unfolded inputs (B, groups, K, L), every call's positions concatenated (the
        same in every round: unfolded once)."""
        key = ("u", rows.start, rows.stop)
        if key not in self.cache:
            m = self.module
            two = isinstance(m, nn.Conv2d)
            k = m.kernel_size if two else (1, m.kernel_size[0])
            st = m.stride if two else (1, m.stride[0])
            pd = m.padding if two else (0, m.padding[0])
            dl = m.dilation if two else (1, m.dilation[0])
            g, ci = m.groups, m.in_channels
            us = []
            for x in self.xs:
                x = x[rows]
                if m.padding_mode != "zeros" or isinstance(m.padding, str):
                    # circular/reflect/replicate or 'same'/'valid': pad as the module does
                    pads = list(m._reversed_padding_repeated_twice)
                    x = F.pad(x, pads, mode="constant" if m.padding_mode == "zeros"
                              else m.padding_mode)
                    pd = (0, 0)
                x = x if two else x.unsqueeze(2)
                if k == (1, 1) and pd == (0, 0):   # 1x1: the (strided) input is its unfolding
                    u = x[:, :, ::st[0], ::st[1]].reshape(x.shape[0], ci, -1)
                else:
                    u = F.unfold(x, k, dilation=dl, padding=pd, stride=st)  # (B, Ci*k, L)
                us.append(u.reshape(x.shape[0], g, ci // g * k[0] * k[1], -1))
            self.cache[key] = us[0] if len(us) == 1 else torch.cat(us, dim=-1)
        return self.cache[key]

    def _d(self, dy: list[torch.Tensor], rows: slice) -> torch.Tensor:
        """One cotangent's output gradients: (B, T, m) for Linear/Embedding, (B, groups,
        C_out/groups, L) for a conv, every call's positions concatenated."""
        m = self.module
        if self.kind == "conv":
            g, co = m.groups, m.out_channels
            ds = [d[rows].reshape(d[rows].shape[0], g, co // g, -1) for d in dy]
            return ds[0] if len(ds) == 1 else torch.cat(ds, dim=-1)
        dim = m.embedding_dim if self.kind == "embedding" else dy[0].shape[-1]
        return torch.cat([_rows(d[rows], dim) for d in dy], dim=1)

    # -- one round ---------------------------------------------------------------------------
    def start(self, p: int, rows: slice) -> None:
        """A new round of ``p`` cotangents on the samples ``rows``: decide whether the Gram
        comes from the materialized per-sample gradients or from a Gram over positions,
        whichever costs fewer multiply-adds."""
        self.feats = []
        if self.kind == "embedding":
            self.materialize = False
        elif self.kind == "linear":
            t, n = self._x(rows).shape[1:]
            m = self.module
            mo = m.out_features if isinstance(m, nn.Linear) else m.nf
            # Gram over positions: x x^T, then (x x^T) dy per cotangent, then the pairs
            self.materialize = not (t * t * n + p * t * t * mo + p * p * t * mo <=
                                    t * p * mo * n + p * p * mo * n)
        else:
            _, g, k, n = self._u(rows).shape
            c = self.module.out_channels // g
            self.materialize = not (g * (n * n * k + p * n * n * c + p * p * c * n) <
                                    g * p * c * k * n + p * p * g * c * k)

    def absorb(self, dy: list[torch.Tensor], rows: slice) -> None:
        """Keep what the Gram needs from one cotangent's output gradients ``dy`` (one per
        call): the per-sample weight gradients (B, numel) or the output gradients."""
        d = self._d(dy, rows)
        if not self.materialize:
            self.feats.append(d)
        elif self.kind == "linear":
            self.feats.append((d.transpose(1, 2) @ self._x(rows)).flatten(1))       # (B, m*n)
        else:
            self.feats.append((d @ self._u(rows).transpose(2, 3)).flatten(1))       # (B, g*C*K)

    def gram(self, rows: slice) -> torch.Tensor:
        """(B, P, P): inner products of the per-sample gradients of the round's cotangents."""
        if self.materialize:
            f = torch.stack(self.feats, dim=1).double()                             # (B, P, D)
            return f @ f.transpose(1, 2)
        # over positions: g_a . g_c = sum_{t,u} (dy_a,t . dy_c,u) k(t, u) with k the inputs'
        # Gram (Linear, conv) or [id_t = id_u] (Embedding): k dy_c once per cotangent, then
        # one inner product per pair
        if self.kind in ("linear", "embedding"):
            k = self._same(rows) if self.kind == "embedding" else \
                (lambda x: x @ x.transpose(1, 2))(self._x(rows).double())      # (B, T, T)
            d = torch.stack(self.feats, dim=1).double()                      # (B, P, T, m)
            return torch.einsum("batm,bctm->bac", d, k[:, None] @ d)
        u = self._u(rows)
        d = torch.stack(self.feats, dim=2)                                   # (B, g, P, C, L)
        key = ("ku", rows.start, rows.stop)
        if key not in self.cache:
            self.cache[key] = u.transpose(2, 3) @ u                         # (B, g, L, L)
        kd = d @ self.cache[key][:, :, None]                                # (B, g, P, C, L)
        return torch.einsum("bgacl,bgecl->bae", d, kd).double()

    def _same(self, rows: slice) -> torch.Tensor:
        """Embedding: ``[id_t = id_u]`` over the sample's positions (padding rows out)."""
        ids = torch.cat([x.reshape(x.shape[0], -1) for x in self.xs], dim=1)[rows]
        same = ids[:, :, None] == ids[:, None, :]
        pad = self.module.padding_idx
        if pad is not None:
            keep = ids != pad
            same = same & keep[:, :, None] & keep[:, None, :]
        return same.double()

    def grad_sum(self, rows: slice) -> torch.Tensor:
        """Sum over the samples of the per-sample gradients for the round's first cotangent,
        in the weight's layout (autograd's gradient of the batch when the weight is used only
        by this module)."""
        m, f = self.module, self.feats[0]
        w = m.weight
        if self.materialize and self.kind == "linear":
            gs = f.sum(0).reshape(-1, self._x(rows).shape[-1])
            return gs if isinstance(m, nn.Linear) else gs.T
        if self.materialize:
            return f.sum(0).reshape(w.shape)
        if self.kind == "linear":
            gs = torch.einsum("bto,bti->oi", f, self._x(rows))
            return gs if isinstance(m, nn.Linear) else gs.T
        if self.kind == "embedding":
            ids = torch.cat([x.reshape(x.shape[0], -1) for x in self.xs], dim=1)[rows].reshape(-1)
            d = f.reshape(-1, m.embedding_dim)
            if m.padding_idx is not None:
                d = d * (ids != m.padding_idx)[:, None]
            return torch.zeros(w.shape, dtype=d.dtype, device=d.device).index_add_(0, ids, d)
        return torch.einsum("bgcl,bgkl->gck", f, self._u(rows)).reshape(w.shape)


def _rows(x: torch.Tensor, d: int) -> torch.Tensor:
    """(B, T, d): positions of one sample flattened (dim 0 is the batch)."""
    return x.reshape(x.shape[0], -1, d)


def _sites(model: nn.Module, params: Sequence[torch.Tensor], names: Sequence[str]
           ) -> tuple[dict[int, _Site], dict[int, list[_Site]]]:
    """The hooked modules, and the ones that use each measured weight (by ``id``): one, or an
    Embedding and a Linear sharing it (tied input and output embeddings)."""
    owners: dict[int, list[_Site]] = {id(p): [] for p in params}
    sites: dict[int, _Site] = {}
    ids = [id(p) for p in params]
    for _, m in model.named_modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and id(w) in owners:
            kind = _kind(m)
            if kind is None:
                raise Unsupported(f"{names[ids.index(id(w))]} is used by a "
                                  f"{type(m).__name__} module")
            if id(m) not in sites:
                sites[id(m)] = _Site(m, kind)
            owners[id(w)].append(sites[id(m)])
    for p, name in zip(params, names):
        if not owners[id(p)]:
            raise Unsupported(f"{name} belongs to no Linear/Conv/Embedding module")
        own = owners[id(p)]
        if len(own) > 1 and not _tied(own):
            raise Unsupported(f"{name} is shared by several modules")
    return sites, owners


def _tied(own: list[_Site]) -> bool:
    """An Embedding and an ``nn.Linear`` with the same (V, d) weight: GPT-2's tied word
    embedding and language-model head."""
    kinds = sorted(s.kind for s in own)
    return kinds == ["embedding", "linear"] and all(
        isinstance(s.module, (nn.Embedding, nn.Linear)) for s in own)


def _gram_param(own: list[_Site], rows: slice) -> torch.Tensor:
    """(B, P, P) Gram of one weight's per-sample gradients: its module's, or for a tied
    weight the sum over its two modules with the cross terms."""
    if len(own) == 1:
        return own[0].gram(rows)
    emb, lin = sorted(own, key=lambda s: s.kind)
    c = _cross(emb, lin, rows)
    return emb.gram(rows) + lin.gram(rows) + c + c.transpose(1, 2)


def _cross(emb: _Site, lin: _Site, rows: slice) -> torch.Tensor:
    """``<E_a, L_b>`` for the embedding's per-sample gradient ``E_a = sum_t e_{id_t} dE_t^T``
    and the Linear's ``L_b`` (same (V, d) layout): ``sum_t dE_{a,t} . L_b[id_t]``."""
    m = emb.module
    ids = torch.cat([x.reshape(x.shape[0], -1) for x in emb.xs], dim=1)[rows]      # (B, T)
    de = torch.stack(emb.feats, dim=1).double()                                  # (B, P, T, d)
    if m.padding_idx is not None:
        de = de * (ids != m.padding_idx)[:, None, :, None]
    b, p, t, d = de.shape
    if lin.materialize:
        lg = torch.stack(lin.feats, dim=1).double().reshape(b, p, -1, d)          # (B, P, V, d)
        at = torch.take_along_dim(lg, ids[:, None, :, None].expand(b, p, t, d), dim=2)
        return torch.einsum("batd,bctd->bac", de, at)
    dl = torch.stack(lin.feats, dim=1).double()                                  # (B, P, U, V)
    x = lin._x(rows).double()                                                    # (B, U, d)
    g1 = torch.einsum("batd,bud->batu", de, x)
    g2 = torch.take_along_dim(dl, ids[:, None, None, :].expand(b, p, dl.shape[2], t), dim=3)
    return torch.einsum("batu,bcut->bac", g1, g2)


def _forward(model: nn.Module, smp: Sample, nb: int, sites: dict[int, _Site],
             output_fn: Callable[[Any], torch.Tensor]) -> tuple[torch.Tensor, torch.Size]:
    """The batched forward of the first ``nb`` samples (hooks recording), checked against the
    first sample run alone; returns the output and one sample's output shape."""
    batch = smp.take(0, nb)
    # in the inputs' own memory format: torch 2.13's CPU weight gradient of a strided 1x1
    # convolution on a channels-last input corrupts the heap on one thread (3 -> 10 channels,
    # 8x8 input, stride 2: an abort in a later free), so no channels-last copy is made here
    with _PerSampleBatchNorm():
        y = output_fn(batch.call(model))
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
    return y, y1.shape


def batched_sketch(model: nn.Module, smp: Sample, batch: int, params: Sequence[torch.Tensor],
                   names: Sequence[str], n_samples: int, n_cotangents: int,
                   gen: torch.Generator, output_fn: Callable[[Any], torch.Tensor],
                   step: Callable[[int], None] = lambda n: None, first: int = 0,
                   stop: Callable[[np.ndarray], bool] | None = None,
                   ranks: Any = None) -> np.ndarray:
    """Per-sample statistic ``(sum over pairs of G_aa G_bb + G_ab^2) / pairs / (2 numel)``
    (``n_samples`` x ``len(params)``), the same estimator with the same cotangents as the
    per-sample loop; raises :class:`Unsupported` when it cannot be exact.  The samples run in
    rounds of ``batch``; after each round that has reached ``first`` samples, ``stop(values so
    far)`` may end the measurement (the rows returned are the samples measured).

    With ``ranks`` (:class:`precondfx.pytorch.measure.ranks.Ranks`) the samples are the global
    ones of every rank: the rounds are those of one process holding them all, this rank
    measures the rows it holds, and each round's rows are summed over the ranks before the
    stop rule sees them (every rank gets the same values and the same decision; a failure on
    any rank is a failure on all)."""
    total = ranks.total if ranks is not None else batch
    n_round = min(total, n_samples)                  # draws per round (global)
    mine = ranks.owned(n_round) if ranks is not None else list(range(n_round))
    nb = len(mine)                                   # local rows of the batched forward
    error: BaseException | None = None
    handles: list[Any] = []
    try:
        sites, owner = _sites(model, params, names)
        for s in sites.values():
            s.nb = max(nb, 1)
        # prepend: see the module's own output, before any hook of the user's or of precondfx
        # (an output scale on the last layer) transforms it
        handles = [s.module.register_forward_hook(s, prepend=True) for s in sites.values()]
        if nb:
            y, shape1 = _forward(model, smp, nb, sites, output_fn)
        else:                                        # this rank holds none of the draws
            with torch.no_grad():
                shape1 = output_fn(smp.take(0).call(model)).shape
    except Exception as e:  # noqa: BLE001 - agreed over the ranks below
        if ranks is None:
            for h in handles:
                h.remove()
            raise
        error = e
    try:
        if ranks is not None and (err := ranks.failed(error)) is not None:
            raise Unsupported(f"{type(err).__name__}: {err}")
        outs = [(s, c) for s in sites.values() for c in range(len(s.ys))]
        # cotangents in the per-sample loop's order: sample by sample, P each
        vs = torch.stack([torch.stack([torch.randn(shape1, generator=gen, dtype=torch.float32)
                                       for _ in range(n_cotangents)])
                          for _ in range(n_samples)])
        per = np.zeros((n_samples, len(params)))
        iu = [(a, b) for a in range(n_cotangents) for b in range(a + 1, n_cotangents)]
        rounds = [(r, min(n_round, n_samples - r)) for r in range(0, n_samples, n_round)]
        for ri, (s0, cnt) in enumerate(rounds):
            gs = [g for g in mine if g < cnt]        # this round's draws s0 + g, local rows 0..
            k = len(gs)
            def one_round() -> None:
                if k:
                    _round(y, vs, gs, s0, k, sites, outs, owner, params, names, iu, per,
                           n_cotangents, check=ri == 0,
                           keep_graph=any(g < c for _, c in rounds[ri + 1:] for g in mine))
            if (err := agreed(ranks, one_round)) is not None:
                raise Unsupported(f"{type(err).__name__}: {err}")
            if ranks is not None:
                per[s0:s0 + cnt] = ranks.sum(per[s0:s0 + cnt])
            step(cnt)
            done = s0 + cnt
            if stop is not None and done >= first and done < n_samples and stop(per[:done]):
                return per[:done]
        return per
    finally:
        for h in handles:
            h.remove()


def _round(y: torch.Tensor, vs: torch.Tensor, gs: list[int], s0: int, k: int,
           sites: dict[int, _Site], outs: list[tuple[_Site, int]],
           owner: dict[int, list[_Site]], params: Sequence[torch.Tensor],
           names: Sequence[str], iu: list[tuple[int, int]], per: np.ndarray,
           n_cotangents: int, check: bool, keep_graph: bool) -> None:
    """One round: P backward passes of the first ``k`` rows of the batched output with the
    cotangents of draws ``s0 + g`` (g in ``gs``), their per-sample values into ``per``."""
    rows = slice(0, k)
    draws = [s0 + g for g in gs]
    for s in sites.values():
        s.start(n_cotangents, rows)
    for a in range(n_cotangents):
        v = torch.zeros(y.shape, dtype=y.dtype, device=y.device)
        v[:k] = vs[draws, a].reshape((k,) + tuple(y.shape[1:])).to(v)
        _backward(y, v, outs, sites, rows, params if check and a == 0 else (),
                  keep_graph=keep_graph or a < n_cotangents - 1, names=names, owner=owner)
    for j, p in enumerate(params):
        gram = _gram_param(owner[id(p)], rows)
        sq = torch.diagonal(gram, dim1=1, dim2=2)
        acc = sum(sq[:, a] * sq[:, b] + gram[:, a, b] ** 2 for a, b in iu)
        per[draws, j] = (acc / len(iu) / (2 * p.numel())).cpu().numpy()
    for s in sites.values():
        s.feats = []


def _backward(y: torch.Tensor, v: torch.Tensor, outs: list[tuple[_Site, int]],
              sites: dict[int, _Site], rows: slice, check: Sequence[torch.Tensor],
              keep_graph: bool, names: Sequence[str], owner: dict[int, list[_Site]]
              ) -> None:
    """One backward pass of the cotangent ``v``: each site absorbs its output gradients (and,
    with ``check`` parameters, their batch gradients are compared with the per-sample sums)."""
    targets = [s.ys[c] for s, c in outs]
    g = torch.autograd.grad(y, targets + list(check), v, retain_graph=keep_graph,
                            allow_unused=True)
    per_site: dict[int, list[torch.Tensor]] = {id(s): [] for s in sites.values()}
    for (s, c), gi in zip(outs, g[:len(targets)]):
        per_site[id(s)].append(torch.zeros_like(s.ys[c]) if gi is None else gi.detach())
    refs = g[len(targets):]
    del g
    for s in sites.values():
        s.absorb(per_site.pop(id(s)), rows)
    if check:
        _check_sums(check, names, owner, refs, rows)


def _check_sums(params: Sequence[torch.Tensor], names: Sequence[str],
                owner: dict[int, list[_Site]], grads: Sequence[torch.Tensor | None],
                rows: slice) -> None:
    """The per-sample gradients must add up to autograd's gradient of the batch."""
    for p, name, g in zip(params, names, grads):
        tot = sum(s.grad_sum(rows).reshape(p.shape) for s in owner[id(p)])
        ref = torch.zeros_like(tot) if g is None else g.detach().to(tot.dtype)
        err = float(torch.linalg.vector_norm(tot - ref))
        scale = float(torch.linalg.vector_norm(ref))
        if not err <= 1e-3 * scale:  # float32 sums in another order: ~1e-6; a missed use: O(1)
            raise Unsupported(f"{name}: the per-sample gradients do not add up to the batch "
                              f"gradient (relative error {err / max(scale, 1e-30):.2g}): the "
                              f"weight is used outside its module")
