"""The init draws of ``precondfx.core.draw`` on torch tensors."""
from __future__ import annotations

from typing import Any

import torch

from precondfx.core.draw import ArrayOps


def _qr(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.linalg.qr(a)`` (reduced) as LAPACK's two steps, geqrf then orgqr: the same Q bit
    for bit (checked on square, tall and wide shapes) in ~0.65x the time on one CPU thread
    (0.30 against 0.47 s for 1024x1024; linalg.qr spends the rest copying R out).  The second
    value holds R in its upper triangle; :func:`precondfx.core.draw.orthogonal` reads only its
    diagonal."""
    h, tau = torch.geqrf(a)
    return torch.linalg.householder_product(h, tau), h


def torch_ops(gen: Any) -> ArrayOps:
    """Torch operations drawing from ``gen`` (a ``torch.Generator``), on the CPU."""
    return ArrayOps(
        normal=lambda shape: torch.randn(shape, generator=gen),
        full=lambda shape, v: torch.full(shape, float(v)),
        qr=_qr, diagonal=torch.diagonal, sign=torch.sign,
        concat=lambda xs: torch.cat(xs, 0), stack=lambda xs: torch.stack(xs),
        mean_square=lambda t: float(t.double().pow(2).mean()))
