"""The init draws of ``precondfx.core.draw`` on torch tensors."""
from __future__ import annotations

from typing import Any

import torch

from precondfx.core.draw import ArrayOps


def torch_ops(gen: Any) -> ArrayOps:
    """Torch operations drawing from ``gen`` (a ``torch.Generator``), on the CPU."""
    return ArrayOps(
        normal=lambda shape: torch.randn(shape, generator=gen),
        full=lambda shape, v: torch.full(shape, float(v)),
        qr=torch.linalg.qr, diagonal=torch.diagonal, sign=torch.sign,
        concat=lambda xs: torch.cat(xs, 0), stack=lambda xs: torch.stack(xs),
        mean_square=lambda t: float(t.double().pow(2).mean()))
