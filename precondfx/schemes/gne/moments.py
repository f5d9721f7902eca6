"""The block moments ``phi = E[tr(J J^T)]`` (normalized trace) and ``varphi`` of Chen et al.'s
components table (spec A.2.6 and its listed extensions), and the serial / parallel /
residual / concat composition rules (Thms 4.1, 4.2, eq. 42)."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from precondfx.errors import PrecondError
from precondfx.schemes.activations import normal_expectation
from precondfx.schemes.gne.selu import _exp_cdf, selu_phi


class Moments(NamedTuple):
    """Spectrum moments of one component's ``J J^T``: ``phi`` (mean eigenvalue) and ``varphi``
    (eigenvalue variance), spec A.2.1 / Def. 3.1."""

    phi: float
    varphi: float

    @property
    def ratio(self) -> float:
        """Scale-free spread ``varphi / phi^2`` (the summand of eq. 14)."""
        return self.varphi / self.phi**2 if self.phi != 0 else math.inf


def _check_prob(p: float, name: str = "p") -> None:
    if not 0.0 <= p <= 1.0:
        raise PrecondError(f"{name} must be a probability in [0, 1], got {p!r}.")


def relu_moments(p: float = 0.5) -> Moments:
    """ReLU with ``p = P(x > 0)``: ``(p, p - p^2)`` (Table 3).  ``p = 1/2`` right after a
    zero-mean linear layer (Sec. 5.1); measure ``p`` elsewhere (e.g. after a residual add)."""
    _check_prob(p)
    return Moments(p, p - p * p)


def leaky_relu_moments(slope: float, p: float = 0.5) -> Moments:
    """Leaky ReLU with negative slope ``slope`` (gamma) and ``p = P(x > 0)`` (Table 3):
    ``phi = p + g^2 (1-p)``, ``varphi = g^4 (1-p) + p - phi^2``."""
    _check_prob(p)
    g2 = float(slope) ** 2
    phi = p + g2 * (1.0 - p)
    return Moments(phi, g2 * g2 * (1.0 - p) + p - phi * phi)


def sprelu_moments(alpha: float, p: float = 0.5) -> Moments:
    """sPReLU (eq. 18): leaky ReLU of slope ``alpha`` rescaled by ``1/sqrt(1+alpha^2)``, so
    ``phi = 1/2`` at ``p = 1/2`` for every alpha (A.2.9)."""
    base = leaky_relu_moments(alpha, p)
    return scale_moments(base, 1.0 / math.sqrt(1.0 + float(alpha) ** 2))


def tanh_moments(var: float | None = None) -> Moments:
    """tanh.  ``var=None`` gives the Table 3 linear-regime value ``(1, 0)``; a pre-activation
    variance gives the exact Gaussian expectation ``E[tanh'(x)^2]`` etc. [DERIVED]."""
    if var is None:
        return Moments(1.0, 0.0)
    return pointwise_moments(lambda x: 1.0 - np.tanh(x) ** 2, var)


def pointwise_moments(
    derivative: Callable[[np.ndarray], np.ndarray], var: float, mean: float = 0.0, *,
    breaks: Sequence[float] = (0.0,),
) -> Moments:
    """Any element-wise activation at pre-activations ``N(mean, var)``: ``J`` is diagonal with
    entries ``f'(x_i)``, so ``phi = E[f'^2]`` and ``varphi = E[f'^4] - phi^2`` (A.2.6 extension,
    "SELU / other activations").  The expectations are the shared engine's
    (``precondfx.schemes.activations.normal_expectation``), split at ``breaks`` (the jumps of
    ``f'``; 0 for rectifiers) so that they do not spoil the accuracy."""
    if var <= 0:
        raise PrecondError(f"pre-activation variance must be > 0, got {var!r}.")

    def d2(x: np.ndarray) -> np.ndarray:
        return np.asarray(derivative(x), dtype=np.float64) ** 2
    m2 = normal_expectation(d2, mean, var, breaks)
    m4 = normal_expectation(lambda x: d2(x) ** 2, mean, var, breaks)
    return Moments(m2, m4 - m2 * m2)


def dense_gaussian_moments(fan_in: int, fan_out: int, std: float) -> Moments:
    """Dense ``u = K y`` with ``K in R^{m x n}`` i.i.d. ``N(0, std^2)``: ``(n s^2, m n s^4)``
    (Table 3; ``n`` = fan-in, ``m`` = fan-out)."""
    s2 = float(std) ** 2
    return Moments(fan_in * s2, fan_out * fan_in * s2 * s2)


def conv_gaussian_moments(
    c_in: int, c_out: int, std: float, effective_k: float, *, spatial_ratio: float = 1.0
) -> Moments:
    """Conv with i.i.d. ``N(0, std^2)`` kernel: ``phi = c_in * k~ * std^2`` with ``k~`` the
    effective kernel size (Table 3, A.2.7; pass ``c_in/groups`` for grouped convs).  The
    ``varphi`` cell is lost in the paper; the spec's [RECON/DERIVED] rule is
    ``varphi = phi^2 * len(out)/len(in)``, with ``len(out)/len(in) = (c_out/c_in) * spatial_ratio``
    and ``spatial_ratio = H_o W_o / (H W)`` (1 for stride 1 'same' convs)."""
    phi = c_in * float(effective_k) * float(std) ** 2
    return Moments(phi, phi * phi * (c_out / c_in) * spatial_ratio)


def orthogonal_moments(beta: float, fan_in: int | None = None, fan_out: int | None = None) -> Moments:
    """Orthogonal ``u = K y`` with ``K K^T = beta^2 I``: ``(beta^2, 0)`` (Table 3).  For an
    expanding layer (``fan_out > fan_in``) only ``K^T K = beta^2 I`` is possible and
    ``phi = beta^2 n/m``, ``varphi = beta^4 (n/m)(1 - n/m)`` (A.2.6 [DERIVED])."""
    b2 = float(beta) ** 2
    if fan_in is None or fan_out is None or fan_out <= fan_in:
        return Moments(b2, 0.0)
    r = fan_in / fan_out
    return Moments(b2 * r, b2 * b2 * r * (1.0 - r))


def data_norm_moments(m: int, var: float, *, exact: bool = False) -> Moments:
    """Data normalization of a length-``m`` vector of variance ``var = sigma_B^2`` (Table 3):
    ``(1/var, 2/(m var^2))``; ``exact=True`` gives the finite-``m`` forms
    ``((m-2)/(m var), 2(m-2)/(m^2 var^2))`` (A.2.6 [DERIVED])."""
    if exact:
        return Moments((m - 2) / (m * var), 2.0 * (m - 2) / (m * m * var * var))
    return Moments(1.0 / var, 2.0 / (m * var * var))


def identity_moments() -> Moments:
    """Identity: ``(1, 0)``, non-central (A.2.6 extensions)."""
    return Moments(1.0, 0.0)


def scale_moments(moments: Moments, c: float) -> Moments:
    """A scalar gain ``c`` after a component: ``phi -> c^2 phi``, ``varphi -> c^4 varphi``."""
    c2 = float(c) ** 2
    return Moments(moments.phi * c2, moments.varphi * c2 * c2)


def dropout_moments(keep_prob: float) -> Moments:
    """Inverted dropout with keep probability ``q``: ``phi = 1/q`` (spec A.2.6 extension);
    ``varphi = (1-q)/q^3`` [DERIVED: a ReLU-like mask with ``p = q`` scaled by ``1/q``].  It is
    the identity at initialization/inference (eval mode)."""
    if not 0.0 < keep_prob <= 1.0:
        raise PrecondError(f"keep_prob must be in (0, 1], got {keep_prob!r}.")
    return scale_moments(relu_moments(keep_prob), 1.0 / keep_prob)


def max_pool_moments() -> Moments:
    """Non-overlapping max pooling: a selection matrix, ``(1, 0)`` (A.2.6 [DERIVED]).  Not a
    general linear transform: the forward second moment increases."""
    return Moments(1.0, 0.0)


def avg_pool_moments(window: int) -> Moments:
    """Non-overlapping average pooling over ``window`` inputs (``k*k`` for a ``k x k`` pool) on
    uncorrelated inputs: ``phi = 1/window``; the rows are orthogonal so ``varphi = 0``
    (A.2.6 [DERIVED])."""
    return Moments(1.0 / window, 0.0)


def selu_moments(lam: float, alpha: float, var: float) -> Moments:
    """SELU at pre-activations ``N(0, var)``: ``phi`` from Prop. 5.7; ``varphi`` [DERIVED] from
    ``E[f'^4] = lam^4/2 + lam^4 alpha^4 e^{8 var} Phi(-4 sqrt(var))``."""
    phi = selu_phi(lam, alpha, var)
    s = math.sqrt(var)
    m4 = lam**4 / 2.0 + lam**4 * alpha**4 * _exp_cdf(8.0 * var, -4.0 * s)
    return Moments(phi, m4 - phi * phi)


#: Name -> function of the components table (A.2.6 and its listed extensions).
COMPONENTS: dict[str, Callable[..., Moments]] = {
    "relu": relu_moments,
    "leaky_relu": leaky_relu_moments,
    "sprelu": sprelu_moments,
    "tanh": tanh_moments,
    "selu": selu_moments,
    "pointwise": pointwise_moments,
    "dense": dense_gaussian_moments,
    "conv": conv_gaussian_moments,
    "orthogonal": orthogonal_moments,
    "data_norm": data_norm_moments,
    "identity": identity_moments,
    "dropout": dropout_moments,
    "max_pool": max_pool_moments,
    "avg_pool": avg_pool_moments,
}


def serial_moments(parts: Sequence[tuple[Moments, int]]) -> Moments:
    """Serial composition, input to output order; ``parts[i] = (moments_i, m_i)`` with ``m_i``
    the output length of component ``i`` (Thm 4.1): ``phi = prod phi_i`` (eq. 13) and
    ``varphi = phi^2 sum_i (m_L/m_i) varphi_i/phi_i^2`` (eq. 14).  Requires the 1st/2nd-moment
    unitary invariance of the spec's A.2.3 (true for Table 3 components in series)."""
    if not parts:
        return identity_moments()
    m_last = parts[-1][1]
    phi = 1.0
    acc = 0.0
    for mom, m_i in parts:
        phi *= mom.phi
        acc += (m_last / m_i) * mom.ratio
    return Moments(phi, phi * phi * acc)


def parallel_moments(branches: Sequence[Moments]) -> Moments:
    """Sum of independent branch Jacobians (Thm 4.2): ``phi = sum phi_i`` (eq. 15) and
    ``varphi = phi^2 + sum(varphi_i - phi_i^2)`` (eq. 16).  Valid only if at most one branch is
    non-central (every other branch contains a zero-mean linear op), which the caller checks."""
    phi = sum(b.phi for b in branches)
    return Moments(phi, phi * phi + sum(b.varphi - b.phi**2 for b in branches))


def residual_moments(branch: Moments) -> Moments:
    """Identity shortcut plus a central branch, ``J = I + J~`` (eq. 43): ``phi = 1 + phi~``;
    for a Gaussian branch ``varphi = 2 phi~ + phi~^2`` (A.2.5 check)."""
    return parallel_moments([identity_moments(), branch])


def concat_phi(parts: Sequence[tuple[float, int]]) -> float:
    """Concatenation of branches with ``(phi_i, m_i)`` along the feature axis:
    ``phi = sum (m_i/m) phi_i`` (generalizes eq. 42; A.2.6 extensions)."""
    m = sum(mi for _, mi in parts)
    return sum(mi / m * phi for phi, mi in parts)

