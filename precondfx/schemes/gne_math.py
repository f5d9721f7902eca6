"""Mathematical core of Chen et al.'s gradient norm equality / block dynamical isometry (BDI).

Spec: ``shared/spec/chen-arpit-spec.md`` part A ([001]).  Everything here is independent of the
graph pass: a pass that knows, per weighted layer, its type, fan-in/fan-out, kernel, padding and
the activation that follows can call these functions.

Conventions (spec, "Conventions"): ``J`` is the per-sample Jacobian ``d out / d in`` with ``m``
rows (output length) and ``n`` columns; ``phi = E[tr(J J^T)]`` with the *normalized* trace, and
``varphi = phi((J J^T)^2) - phi(J J^T)^2``.

Contents

* :class:`Moments` and the components table (A.2.6 plus its listed extensions);
* serial / parallel / residual / concat composition rules (Thms 4.1, 4.2, eq. 42);
* activation-aware gains and the Table 4/5 block moments (A.2.9), Fixup-style branch scaling
  (A.2.14);
* the effective kernel size of zero-padded convolutions (A.2.7);
* SELU moments and the depth-aware SELU coefficients (A.2.11, Prop. 5.7, eq. 32);
* weight initializers :func:`gne_init_` / :func:`gne_layer_init_`;
* Second Moment Normalization :class:`SecondMomentNorm` and the weight-centering
  parametrization it is paired with (A.2.10, eq. 25-26, Algorithm 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from precondfx.schemes.activations import normal_expectation
from precondfx.core.fans import _tup, effective_kernel_1d, effective_kernel_size  # noqa: F401
from precondfx.errors import PrecondError

__all__ = [
    "Moments",
    "relu_moments",
    "leaky_relu_moments",
    "sprelu_moments",
    "tanh_moments",
    "selu_moments",
    "pointwise_moments",
    "dense_gaussian_moments",
    "conv_gaussian_moments",
    "orthogonal_moments",
    "data_norm_moments",
    "identity_moments",
    "scale_moments",
    "dropout_moments",
    "max_pool_moments",
    "avg_pool_moments",
    "COMPONENTS",
    "serial_moments",
    "parallel_moments",
    "residual_moments",
    "concat_phi",
    "activation_moments",
    "gne_gain",
    "gne_std",
    "linear_act_block_moments",
    "fixup_branch_scale",
    "effective_kernel_1d",
    "effective_kernel_size",
    "conv_effective_kernel",
    "normal_cdf",
    "selu_phi",
    "selu_second_moment",
    "selu_mean",
    "selu_block_phi",
    "selu_coefficients",
    "selu_epsilon_for_depth",
    "gne_init_",
    "gne_layer_init_",
    "CenteredWeight",
    "register_weight_centering",
    "SecondMomentNorm",
    "ScaledSELU",
]


# ---------------------------------------------------------------------------------------------
# Components table (spec A.2.6)
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Composition rules (Thms 4.1, 4.2, eq. 42)
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Activation-aware gains (A.2.9), Table 4/5 block moments, Fixup scaling (A.2.14)
# ---------------------------------------------------------------------------------------------

_LINEAR_NAMES = {"linear", "identity", "none", "conv", "conv1d", "conv2d", "conv3d"}


def _activation_spec(activation: str | nn.Module | None, slope: float | None) -> tuple[str, float | None]:
    """Normalize an activation given by name or module to ``(name, slope)``."""
    if activation is None:
        return "linear", None
    if isinstance(activation, nn.Module):
        if isinstance(activation, nn.Identity):
            return "linear", None
        if isinstance(activation, nn.ReLU):
            return "relu", None
        if isinstance(activation, nn.LeakyReLU):
            return "leaky_relu", float(activation.negative_slope)
        if isinstance(activation, nn.Tanh):
            return "tanh", None
        if isinstance(activation, nn.SELU):
            return "selu", None
        if isinstance(activation, nn.PReLU):
            return "prelu", float(activation.weight.detach().mean())
        raise PrecondError(
            f"no BDI gain is known for activation {type(activation).__name__}; supported: Identity, "
            "ReLU, LeakyReLU, Tanh, SELU, PReLU (or pass gain=1/sqrt(phi_act) yourself)."
        )
    name = str(activation).lower().replace("-", "_")
    if name in _LINEAR_NAMES:
        return "linear", None
    if name in {"leakyrelu", "lrelu"}:
        name = "leaky_relu"
    return name, slope


def gne_gain(activation: str | nn.Module | None = "relu", *, slope: float | None = None, gamma0: float = 1.0) -> float:
    """Gain ``c`` with weight std ``c/sqrt(n)`` (Gaussian) or ``beta = c`` (orthogonal) that gives
    a linear+activation block ``phi = 1`` (Tables 4-6, [CODE] gains): linear/tanh 1, ReLU
    ``sqrt 2``, leaky ReLU ``sqrt(2/(1+slope^2))``, PReLU and sPReLU ``sqrt 2`` (as in the authors'
    code: plain PReLU then has ``phi = (1+a^2)/... > 1`` per block, the instability sPReLU fixes),
    SELU ``sqrt(gamma0)`` (eq. 32: the linear layer has ``phi = gamma0``)."""
    name, slope = _activation_spec(activation, slope)
    if name == "linear" or name == "tanh":
        return 1.0
    if name in {"relu", "prelu", "sprelu"}:
        return math.sqrt(2.0)
    if name == "leaky_relu":
        g = 0.01 if slope is None else float(slope)
        return math.sqrt(2.0 / (1.0 + g * g))
    if name == "selu":
        return math.sqrt(gamma0)
    raise PrecondError(
        f"no BDI gain is known for activation {name!r}; supported: linear, relu, leaky_relu, tanh, "
        "prelu, sprelu, selu (or pass gain=1/sqrt(phi_act) yourself)."
    )


def gne_std(fan_in: float, gain: float) -> float:
    """Gaussian weight std ``gain / sqrt(n)`` (eq. 17, Table 4), ``n = c_in/groups * k~``."""
    return gain / math.sqrt(fan_in)


def activation_moments(
    activation: str | nn.Module | None, *, slope: float | None = None, p: float = 0.5,
    selu: tuple[float, float] | None = None, var: float = 1.0,
) -> Moments:
    """Table 3 moments of an activation by name/module (``p = P(x>0)``; SELU uses ``selu=(lam,
    alpha)`` at pre-activation variance ``var``, default the standard constants)."""
    name, slope = _activation_spec(activation, slope)
    if name == "linear":
        return identity_moments()
    if name == "relu":
        return relu_moments(p)
    if name in {"leaky_relu", "prelu"}:
        return leaky_relu_moments((0.25 if name == "prelu" else 0.01) if slope is None else slope, p)
    if name == "sprelu":
        return sprelu_moments(0.25 if slope is None else slope, p)
    if name == "tanh":
        return tanh_moments()
    if name == "selu":
        lam, alpha = selu if selu is not None else (1.0507009873554805, 1.6732632423543772)
        return selu_moments(lam, alpha, var)
    raise PrecondError(f"activation {name!r} is not in the components table (A.2.6).")


def linear_act_block_moments(
    activation: str | nn.Module | None, fan_in: int, fan_out: int, *, kind: str = "gaussian",
    gain: float | None = None, slope: float | None = None, p: float = 0.5,
) -> Moments:
    """Moments of one ``linear -> activation`` block (Sec. 5.1, eq. 17, Tables 4/5) via the
    serial rule.  ``gain=None`` uses :func:`gne_gain`, which gives ``phi = 1`` and
    ``varphi = 1 + m/n`` (KM+ReLU), ``((1-g^2)/(1+g^2))^2 + m/n`` (Gaussian + leaky ReLU), and
    without the ``m/n`` term for orthogonal kernels.  Orthogonal expanding layers are assumed to
    carry the ``beta^2 m/n`` correction of :func:`gne_init_`."""
    if gain is None:
        gain = gne_gain(activation, slope=slope)
    if kind == "gaussian":
        kern = dense_gaussian_moments(fan_in, fan_out, gne_std(fan_in, gain))
    elif kind in {"orthogonal", "delta_orthogonal"}:
        beta = gain * (math.sqrt(fan_out / fan_in) if fan_out > fan_in else 1.0)
        kern = orthogonal_moments(beta, fan_in, fan_out)
    else:
        raise PrecondError(f"kind must be 'gaussian' or 'orthogonal', got {kind!r}.")
    act = activation_moments(activation, slope=slope, p=p)
    return serial_moments([(kern, fan_out), (act, fan_out)])


def fixup_branch_scale(num_blocks: int, convs_per_branch: int, p: float = 1.5) -> float:
    """Chen's Fixup form (Prop. 6.2, A.2.14): multiply every one of the ``m`` activated branch
    convs' init (Kaiming std, or orthogonal ``beta = sqrt 2``) by ``L^{-p/(2m)}`` so that a block
    has ``phi = 1 + L^{-p}``; ``L`` = residual blocks in the whole net, ``p > 1`` (1.5 was best).
    Projection shortcuts keep gain 1."""
    if p <= 1.0:
        raise PrecondError(f"Prop. 6.2 needs p > 1 for gradient norm equality, got p={p!r}.")
    return float(num_blocks) ** (-p / (2.0 * convs_per_branch))


# ---------------------------------------------------------------------------------------------
# Effective kernel size (A.2.7)
# ---------------------------------------------------------------------------------------------


def conv_effective_kernel(conv: nn.Module, input_size: int | Sequence[int]) -> float:
    """Effective kernel size of a ``nn.Conv{1,2,3}d`` module for a given spatial input size."""
    if not isinstance(conv, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        raise PrecondError(f"expected nn.Conv1d/2d/3d, got {type(conv).__name__}.")
    d = len(conv.kernel_size)
    return effective_kernel_size(
        _tup(input_size, d), conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.padding_mode
    )


# ---------------------------------------------------------------------------------------------
# SELU (A.2.11, Prop. 5.7, eq. 32)
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Initializers (A.2.9, A.3 "Per-activation gain init")
# ---------------------------------------------------------------------------------------------

_KINDS = ("gaussian", "orthogonal", "delta_orthogonal")


@torch.no_grad()
def gne_init_(
    weight: torch.Tensor, *, gain: float, kind: str = "gaussian", effective_k: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Initialize a linear/conv weight in place so its Jacobian has ``phi = gain^2``
    (Tables 4/5; A.3).  ``weight`` is ``[out, in]`` or ``[c_out, c_in/groups, *k]``.

    * ``gaussian``: ``N(0, gain^2/n)`` with ``n = c_in/groups * k~`` (``k~ = effective_k`` if given,
      else the nominal kernel size), eq. 17.
    * ``orthogonal``: the kernel reshaped to ``c_out x (c_in k)`` made orthogonal with
      ``beta = gain``; expanding shapes get ``beta^2 *= c_out/(c_in k)`` [DERIVED, A.2.6] and a
      given ``effective_k`` multiplies ``beta^2`` by ``k/k~`` to undo the padding cut-off.
    * ``delta_orthogonal``: an orthogonal ``c_out x c_in`` matrix (``beta`` as above) at the centre
      tap, zeros elsewhere (A.2.9 [CODE]); no cut-off correction is needed.

    Returns ``weight``.  Multiply ``gain`` by :func:`fixup_branch_scale` for residual branches."""
    if weight.dim() < 2:
        raise PrecondError(f"gne_init_ needs a weight with >= 2 dims, got shape {tuple(weight.shape)}.")
    if kind not in _KINDS:
        raise PrecondError(f"kind must be one of {_KINDS}, got {kind!r}.")
    c_out, c_in = weight.shape[0], weight.shape[1]
    k = math.prod(weight.shape[2:]) if weight.dim() > 2 else 1
    n_nom = c_in * k
    if effective_k is not None and not 0 < effective_k <= k:
        raise PrecondError(f"effective_k must be in (0, {k}], got {effective_k!r}.")
    if kind == "gaussian":
        n = c_in * (effective_k if effective_k is not None else k)
        return weight.normal_(0.0, gain / math.sqrt(n), generator=generator)
    if kind == "orthogonal":
        mat = torch.empty(c_out, n_nom, dtype=weight.dtype, device=weight.device)
        nn.init.orthogonal_(mat, generator=generator)
        b2 = gain * gain * (c_out / n_nom if c_out > n_nom else 1.0)
        if effective_k is not None:
            b2 *= k / effective_k
        return weight.copy_(mat.view_as(weight) * math.sqrt(b2))
    if weight.dim() < 3:
        raise PrecondError("delta_orthogonal needs a conv weight [c_out, c_in, *k].")
    mat = torch.empty(c_out, c_in, dtype=weight.dtype, device=weight.device)
    nn.init.orthogonal_(mat, generator=generator)
    b2 = gain * gain * (c_out / c_in if c_out > c_in else 1.0)
    weight.zero_()
    centre = (slice(None), slice(None)) + tuple(s // 2 for s in weight.shape[2:])
    weight[centre] = mat * math.sqrt(b2)
    return weight


def gne_layer_init_(
    module: nn.Module, *, activation: str | nn.Module | None = "relu", slope: float | None = None,
    kind: str = "gaussian", input_size: int | Sequence[int] | None = None, gamma0: float = 1.0,
    scale: float = 1.0, zero_bias: bool = True, generator: torch.Generator | None = None,
) -> nn.Module:
    """Apply :func:`gne_init_` to an ``nn.Linear`` / ``nn.Conv{1,2,3}d`` followed by
    ``activation``: gain from :func:`gne_gain` times ``scale`` (e.g. a Fixup branch scale), the
    effective kernel size from ``input_size`` (spatial, for convs; nominal kernel if omitted),
    bias zeroed.  Returns the module."""
    if not isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        raise PrecondError(f"gne_layer_init_ supports nn.Linear and nn.Conv1d/2d/3d, got {type(module).__name__}.")
    if torch.nn.utils.parametrize.is_parametrized(module, "weight"):
        raise PrecondError("this layer's weight is parametrized (e.g. weight_norm); initialize it with wn_math instead.")
    gain = gne_gain(activation, slope=slope, gamma0=gamma0) * scale
    eff = None
    if input_size is not None and not isinstance(module, nn.Linear) and kind != "delta_orthogonal":
        eff = conv_effective_kernel(module, input_size)
    gne_init_(module.weight, gain=gain, kind=kind, effective_k=eff, generator=generator)
    if zero_bias and getattr(module, "bias", None) is not None:
        with torch.no_grad():
            module.bias.zero_()
    return module


# ---------------------------------------------------------------------------------------------
# Second Moment Normalization (A.2.10)
# ---------------------------------------------------------------------------------------------


class CenteredWeight(nn.Module):
    """Parametrization ``K -> K - mean(K[c_out, :])`` (eq. 26, Algorithm 1 steps 1-2): the weight
    mean is removed per output channel so that SMN's zero-mean assumption holds during training."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:  # noqa: D102
        dims = tuple(range(1, weight.dim()))
        return weight - weight.mean(dim=dims, keepdim=True)


def register_weight_centering(module: nn.Module, name: str = "weight") -> nn.Module:
    """Register :class:`CenteredWeight` on ``module.<name>`` (the conv/linear before an SMN)."""
    torch.nn.utils.parametrize.register_parametrization(module, name, CenteredWeight())
    return module


class SecondMomentNorm(nn.Module):
    """Second Moment Normalization (eq. 25, Algorithm 1; A.2.10): per channel (dim 1),
    ``y = beta + gamma * x / (sqrt(E[x^2]) + eps)`` with the second moment taken over the batch
    and all spatial positions; no mean subtraction (pair it with :func:`register_weight_centering`
    on the preceding layer).  Drop-in for ``BatchNorm{1,2,3}d``: same constructor arguments, any
    input ``[N, C, *]``.

    Eval mode divides by ``running_rms + eps``, a BN-style running average of the batch RMS
    ``sqrt(alpha_2)`` ([CODE]: eps outside the sqrt; the authors store it in ``running_var``).
    ``momentum=None`` uses a cumulative average, like BN.  ``norm='l1'`` gives the L1 variant
    ``x / E|x|`` (eq. 29).  Per eq. 27 [RECON] its Jacobian has ``phi ~= 1/alpha_2``."""

    def __init__(
        self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
        track_running_stats: bool = True, norm: str = "l2", device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if norm not in ("l2", "l1"):
            raise PrecondError(f"norm must be 'l2' or 'l1', got {norm!r}.")
        fk = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        self.norm = norm
        if affine:
            self.weight = nn.Parameter(torch.ones(num_features, **fk))
            self.bias = nn.Parameter(torch.zeros(num_features, **fk))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_rms", torch.ones(num_features, **fk))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
        else:
            self.register_buffer("running_rms", None)
            self.register_buffer("num_batches_tracked", None)

    @classmethod
    def from_batchnorm(cls, bn: nn.modules.batchnorm._BatchNorm) -> SecondMomentNorm:
        """An SMN with the BN's hyper-parameters and (copied) affine parameters."""
        ref = bn.weight if bn.affine else bn.running_mean
        fk = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
        smn = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, **fk)
        if bn.affine:
            with torch.no_grad():
                smn.weight.copy_(bn.weight)
                smn.bias.copy_(bn.bias)
        return smn

    def reset_running_stats(self) -> None:
        """Running RMS back to 1 and the batch counter to 0."""
        if self.track_running_stats:
            self.running_rms.fill_(1.0)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        """Reset running statistics and the affine parameters to (1, 0)."""
        self.reset_running_stats()
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def _batch_scale(self, x: torch.Tensor) -> torch.Tensor:
        dims = [0] + list(range(2, x.dim()))
        if self.norm == "l2":
            return x.pow(2).mean(dim=dims).sqrt()
        return x.abs().mean(dim=dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise PrecondError(
                f"SecondMomentNorm expects input [N, {self.num_features}, *], got shape {tuple(x.shape)}."
            )
        use_batch = self.training or not self.track_running_stats
        if use_batch:
            scale = self._batch_scale(x)
            if self.training and self.track_running_stats:
                with torch.no_grad():
                    self.num_batches_tracked.add_(1)
                    mom = (1.0 / float(self.num_batches_tracked)) if self.momentum is None else self.momentum
                    self.running_rms.mul_(1.0 - mom).add_(scale.detach().to(self.running_rms.dtype), alpha=mom)
        else:
            scale = self.running_rms
        shape = (1, -1) + (1,) * (x.dim() - 2)
        y = x / (scale + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"track_running_stats={self.track_running_stats}, norm={self.norm!r}"
        )


# ---------------------------------------------------------------------------------------------
# Depth-aware SELU module (A.2.11, eq. 32)
# ---------------------------------------------------------------------------------------------


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
