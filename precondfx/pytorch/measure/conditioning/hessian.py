"""Per sample, under the random quadratic loss: Hessian-vector products of every block's probes
(``method="hvp"``), or the exact expectation over R from the Jacobians' Gram matrices
(``method="ggn"``); both fill the block matrix, E[dW^2] and E[dy^2]."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from precondfx.core.progress import Progress
from precondfx.errors import PrecondError
from precondfx.pytorch import reals
from precondfx.pytorch.measure.conditioning.records import _Records, _Run

_DENSE_MAX = 4096
_LOWRANK_K = 64


def _quadratic(kind: str | Callable, index: int, n: int, gen: torch.Generator,
               like: torch.Tensor, dense_max: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
    """Return ``y -> R y`` for this sample's R, and the resolved kind."""
    dt, dev = like.dtype, like.device
    if callable(kind):
        R = torch.as_tensor(kind(index, n)).to(dev, dt)
        if R.dim() == 1:
            return (lambda y: R * y), "custom"
        return (lambda y: R @ y), "custom"
    if kind == "auto":
        kind = "dense" if n <= dense_max else "lowrank"
    if kind == "dense":
        A = torch.randn(n, n, generator=gen, dtype=torch.float64)
        R = ((A + A.T) / 2).to(dev, dt)
        return (lambda y: R @ y), kind
    if kind == "lowrank":
        k = min(_LOWRANK_K, n)
        V = torch.randn(n, k, generator=gen, dtype=torch.float64).to(dev, dt)
        s = (torch.randn(k, generator=gen, dtype=torch.float64) / math.sqrt(2 * k)).to(dev, dt)
        return (lambda y: V @ (s * (V.T @ y))), kind
    if kind == "diagonal":
        d = (torch.randn(n, generator=gen, dtype=torch.float64) * math.sqrt(n / 2)).to(dev, dt)
        return (lambda y: d * y), kind
    raise PrecondError(f"quadratic={kind!r}: use 'auto', 'dense', 'lowrank', 'diagonal' or a "
                       "callable (sample_index, n) -> R")


def _probes(kind: str, shape: torch.Size, n: int, gen: torch.Generator,
            like: torch.Tensor) -> tuple[list[torch.Tensor], float]:
    """Probe vectors and the weight that turns sum ||H v||^2 into the estimate of ||H||_F^2.
    A complex parameter is probed over its real coordinates (real and imaginary parts)."""
    if like.is_complex():
        vs, wgt = _probes(kind, torch.Size((*shape, 2)), n, gen, torch.view_as_real(like))
        return [torch.view_as_complex(v.contiguous()) for v in vs], wgt
    numel = int(np.prod(shape)) if len(shape) else 1
    if numel <= n:
        eye = torch.eye(numel, dtype=like.dtype, device=like.device)
        return [eye[j].reshape(shape) for j in range(numel)], 1.0
    if kind == "rademacher":
        vs = [(torch.randint(0, 2, shape, generator=gen) * 2 - 1) for _ in range(n)]
    elif kind == "gaussian":
        vs = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(n)]
    else:
        raise PrecondError(f"probe={kind!r}: use 'rademacher' or 'gaussian'")
    return [v.to(like.device, like.dtype) for v in vs], 1.0 / n




def _dy_moments(rec: _Records, s: int, outs: list[list[torch.Tensor]],
                g_outs: Sequence[torch.Tensor | None]) -> None:
    """E[dy^2] per layer from the gradients of its hooked outputs (every call pooled)."""
    k = 0
    for l, os_ in enumerate(outs):
        tot, cnt = 0.0, 0
        for o in os_:
            g = g_outs[k]
            k += 1
            cnt += reals.real_numel(o)
            if g is not None:
                tot += reals.sum_square(g)
        rec.dy2[s, l] = tot / cnt if cnt else float("nan")


def _hvp_sample(run: _Run, rec: _Records, s: int, y: torch.Tensor, bar: Progress | None) -> None:
    """One sample under the random quadratic loss: the first backward (``create_graph`` when
    the Hessian is wanted) gives E[dW^2] and E[dy^2]; the HVPs of every block's probes give the
    block matrix row by row."""
    params = run.blocks.params
    nb, nl = len(params), len(run.caps)
    ry, rec.loss_kind = _quadratic(run.quadratic, s, y.numel(), run.gen, y, run.dense_max)
    L = 0.5 * torch.dot(y, ry(y))
    outs = [c.outputs for c in run.caps]
    grads = torch.autograd.grad(L, params + [o for os_ in outs for o in os_],
                                create_graph=run.want_h, allow_unused=True)
    g_blocks = grads[:nb]
    for l in range(nl):
        g = g_blocks[l]
        rec.grad_sq[s, l] = 0.0 if g is None else reals.mean_square(g)
    _dy_moments(rec, s, outs, grads[nb:])
    for b in range(nb if run.want_h else 0):
        if b and bar is not None:
            bar.step()
        gb = g_blocks[b]
        if gb is None or not gb.requires_grad:
            continue  # no curvature through this block
        vs, wgt = _probes(run.probe, params[b].shape, run.n_probes, run.gen, params[b])
        for v in vs:
            try:
                hv = torch.autograd.grad(gb, params, grad_outputs=v, retain_graph=True,
                                         allow_unused=True)
            except RuntimeError as e:
                raise PrecondError(
                    f"Hessian-vector product failed ({e}); an op of the model may "
                    "lack double backward: use method='ggn' or "
                    "stats=('ratio', 'gr')") from e
            for m in range(nb):
                if hv[m] is not None:
                    rec.blk[s, m, b] += wgt * reals.mean_square(hv[m])


def _ggn_rows(run: _Run, y: torch.Tensor, targets: list[torch.Tensor]
              ) -> list[list[torch.Tensor | None]]:
    """Per target, the gradient of every output element (one backward pass each)."""
    n_out = y.numel()
    if n_out > run.ggn_max_outputs:
        raise PrecondError(
            f"method='ggn' needs one backward pass per output element; the output "
            f"has {n_out} > ggn_max_outputs={run.ggn_max_outputs}: use method='hvp'")
    need = n_out * sum(t.numel() * t.element_size() for t in targets)
    if need > run.ggn_max_bytes:
        raise PrecondError(
            f"method='ggn' would hold {need / 2**30:.1f} GiB of per-output "
            f"gradients (> ggn_max_bytes={run.ggn_max_bytes}): use method='hvp'")
    rows: list[list[torch.Tensor | None]] = [[] for _ in targets]
    for a in range(n_out):
        g = torch.autograd.grad(y[a], targets, retain_graph=a < n_out - 1, allow_unused=True)
        for t, gt in enumerate(g):
            rows[t].append(None if gt is None else reals.real_view(gt.detach()).reshape(-1))
    return rows


def _jacobian_gram(rs: list[torch.Tensor | None]) -> torch.Tensor | None:
    """``J J^T`` from the per-output gradient rows (None when no row depends on the target)."""
    if all(r_ is None for r_ in rs):
        return None
    ref_ = next(r_ for r_ in rs if r_ is not None)
    J = torch.stack([r_ if r_ is not None else torch.zeros_like(ref_) for r_ in rs]).double()
    return J @ J.T


def _ggn_sample(run: _Run, rec: _Records, s: int, y: torch.Tensor) -> None:
    """One sample, exact expectation over the dense R: Gram matrices of the Jacobians of the
    output w.r.t. each block and each hooked output (one backward per output element)."""
    rec.loss_kind = "dense (exact expectation)"
    params = run.blocks.params
    nb = len(params)
    outs = [c.outputs for c in run.caps]
    rows = _ggn_rows(run, y, params + [o for os_ in outs for o in os_])
    yd = y.detach().double()
    yy = float(yd @ yd)
    Ks = [_jacobian_gram(rows[t]) for t in range(nb)]
    for l in range(len(run.caps)):
        K = Ks[l]
        if K is not None:
            rec.grad_sq[s, l] = (yy * float(K.trace()) + float(yd @ K @ yd)) / \
                (2 * reals.real_numel(params[l]))
    if run.want_h:
        tr = [float(K.trace()) if K is not None else 0.0 for K in Ks]
        for m in range(nb):
            for b in range(nb):
                if Ks[m] is not None and Ks[b] is not None:
                    rec.blk[s, m, b] = (float((Ks[m] * Ks[b]).sum()) + tr[m] * tr[b]) / \
                        (2 * reals.real_numel(params[m]))
    k = nb
    for l, os_ in enumerate(outs):
        rs_all: list[torch.Tensor] = []
        cnt = 0
        for o in os_:
            cnt += reals.real_numel(o)
            rs = rows[k]
            k += 1
            if any(r_ is not None for r_ in rs):
                rs_all.append(torch.stack([
                    r_.double() if r_ is not None else
                    torch.zeros(reals.real_numel(o), dtype=torch.float64, device=o.device)
                    for r_ in rs]))
        if cnt and rs_all:
            A = torch.cat(rs_all, dim=1)
            M = A @ A.T
            rec.dy2[s, l] = (yy * float(M.trace()) + float(yd @ M @ yd)) / (2 * cnt)
        else:
            rec.dy2[s, l] = 0.0 if cnt else float("nan")

