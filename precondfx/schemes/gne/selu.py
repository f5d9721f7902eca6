"""SELU moments and the depth-aware SELU coefficients (A.2.11, Prop. 5.7, eq. 32), and the
:class:`ScaledSELU` module that carries them."""
from __future__ import annotations

import math

import torch
from torch import nn

from precondfx.errors import PrecondError


def normal_cdf(t: float) -> float:
    """Standard normal CDF ``Phi(t)`` (no scipy)."""
    return 0.5 * math.erfc(-t / math.sqrt(2.0))


def _exp_cdf(exponent: float, t: float) -> float:
    """``exp(exponent) * Phi(t)`` computed in log space (stable for large exponents)."""
    if t < -30:
        # Phi(t) ~ pdf(t)/|t| (1 - 1/t^2 + 3/t^4)
        logphi = -0.5 * t * t - math.log(-t * math.sqrt(2 * math.pi)) + math.log1p(-1 / t**2 + 3 / t**4)
    else:
        logphi = math.log(normal_cdf(t))
    return math.exp(exponent + logphi)


def selu_phi(lam: float, alpha: float, var: float) -> float:
    """``phi(J J^T)`` of SELU at ``N(0, var)`` pre-activations (Prop. 5.7):
    ``lam^2 alpha^2 e^{2 var} Phi(-2 sqrt var) + lam^2/2``."""
    return lam * lam * alpha * alpha * _exp_cdf(2.0 * var, -2.0 * math.sqrt(var)) + lam * lam / 2.0


def selu_second_moment(lam: float, alpha: float, var: float) -> float:
    """``E[SELU(x)^2]`` at ``x ~ N(0, var)`` (Prop. 5.7)."""
    s = math.sqrt(var)
    return (
        0.5 * lam * lam * var + 0.5 * lam * lam * alpha * alpha
        + lam * lam * alpha * alpha * (_exp_cdf(2.0 * var, -2.0 * s) - 2.0 * _exp_cdf(var / 2.0, -s))
    )


def selu_mean(lam: float, alpha: float, var: float) -> float:
    """``E[SELU(x)]`` at ``x ~ N(0, var)`` (Prop. 5.7)."""
    s = math.sqrt(var)
    return lam * alpha * _exp_cdf(var / 2.0, -s) - lam * alpha / 2.0 + math.sqrt(var / (2 * math.pi)) * lam


def selu_block_phi(alpha2: float, lam: float, alpha: float, gamma0: float = 1.0) -> float:
    """Block (linear ``phi = gamma0`` + SELU) ``phi`` as a function of the input second moment
    ``alpha2`` (Fig. 3; A.4 item 7): ``gamma0 * selu_phi(lam, alpha, gamma0 * alpha2)``."""
    return gamma0 * selu_phi(lam, alpha, gamma0 * alpha2)


def selu_epsilon_for_depth(depth: int) -> float:
    """Default ``epsilon`` "slightly below ``1/L``" (A.2.11 depth rule): ``0.95/L``.  The authors
    hand-picked 0.03 for L=32 and 0.06 for L=15; pass ``epsilon`` explicitly to reproduce them."""
    if depth < 1:
        raise PrecondError(f"depth must be >= 1, got {depth!r}.")
    return 0.95 / depth


def selu_coefficients(
    depth: int | None = None, *, epsilon: float | None = None, gamma0: float = 1.0, fixed_point: float = 1.0
) -> tuple[float, float]:
    """Depth-aware SELU ``(lambda, alpha)`` (eq. 32): block ``phi = 1 + epsilon`` and activation
    second-moment fixed point ``fixed_point`` when the preceding linear layer has
    ``phi = gamma0`` (weights ``N(0, gamma0/n)``).  Both equations are linear in
    ``(lambda^2, lambda^2 alpha^2)``, so they are solved exactly (no fsolve); ``epsilon``
    defaults to :func:`selu_epsilon_for_depth`.  Raises if no real solution exists (large
    epsilon, roughly > 0.17 at gamma0 = 1)."""
    if epsilon is None:
        if depth is None:
            raise PrecondError("give depth (number of linear+SELU layers) or epsilon.")
        epsilon = selu_epsilon_for_depth(depth)
    if epsilon < 0:
        raise PrecondError(f"epsilon must be >= 0, got {epsilon!r}.")
    v = fixed_point * gamma0
    s = math.sqrt(v)
    e2 = _exp_cdf(2.0 * v, -2.0 * s)
    e1 = _exp_cdf(v / 2.0, -s)
    # unknowns a = lam^2, b = lam^2 alpha^2
    a11, a12, r1 = gamma0 / 2.0, gamma0 * e2, 1.0 + epsilon
    a21, a22, r2 = v / (2.0 * fixed_point), (e2 - 2.0 * e1 + 0.5) / fixed_point, 1.0
    det = a11 * a22 - a12 * a21
    if abs(det) < 1e-15:
        raise PrecondError("eq. 32 is singular for these gamma0/fixed_point values.")
    a = (r1 * a22 - a12 * r2) / det
    b = (a11 * r2 - a21 * r1) / det
    if a <= 0 or b < -1e-12:
        raise PrecondError(
            f"eq. 32 has no real solution for gamma0={gamma0}, epsilon={epsilon}, fixed_point={fixed_point}; "
            "use a smaller epsilon (below 1/depth)."
        )
    return math.sqrt(a), math.sqrt(max(b, 0.0) / a)


class ScaledSELU(nn.Module):
    """``lam * (x if x > 0 else alpha (e^x - 1))`` with given ``(lam, alpha)`` (eq. 30), e.g.
    the depth-aware coefficients of :func:`selu_coefficients`; constants are buffers so the
    module saves, deep-copies and exports."""

    def __init__(self, lam: float, alpha: float) -> None:
        super().__init__()
        self.register_buffer("lam", torch.tensor(float(lam)))
        self.register_buffer("alpha", torch.tensor(float(alpha)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        lam, alpha = self.lam.to(x.dtype), self.alpha.to(x.dtype)
        return lam * torch.where(x > 0, x, alpha * torch.expm1(x))

    def extra_repr(self) -> str:  # noqa: D102
        return f"lam={float(self.lam):.6g}, alpha={float(self.alpha):.6g}"
