"""Complex tensors as real numbers, for every statistic precondfx reads off a tensor.

A complex parameter ``w = a + ib`` is trained as two real parameters ``a`` and ``b`` (its
gradient is ``dL/da + i dL/db``; ``torch.optim`` steps each part).  Its second moment, its
gradient's, a Hessian-vector product's are therefore those of ``torch.view_as_real(w)``: every
real and imaginary part a coordinate.  ``t.double()`` would keep the real parts only (and warn).
"""
from __future__ import annotations

import torch


def real_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as real numbers in its own precision: a complex tensor as its real and imaginary
    parts (``(..., 2)``, a view)."""
    return torch.view_as_real(t) if t.is_complex() else t


def as_real(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64, a complex tensor as its real and imaginary parts (``(..., 2)``)."""
    return real_view(t).double()


def mean_square(t: torch.Tensor) -> float:
    """The mean square per real coordinate (a complex entry is two)."""
    return float(as_real(t.detach()).pow(2).mean())


def sum_square(t: torch.Tensor) -> float:
    """The sum of squares over real coordinates (``sum |t|^2`` for a complex ``t``)."""
    return float(as_real(t.detach()).pow(2).sum())


def real_numel(t: torch.Tensor) -> int:
    """The number of real coordinates (two per complex entry)."""
    return t.numel() * (2 if t.is_complex() else 1)


__all__ = ["real_view", "as_real", "mean_square", "sum_square", "real_numel"]
