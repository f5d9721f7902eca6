"""Leaky ReLU / TReLU closed forms and the TReLU slope solver (spec §2.3, §2.7; paper Lemma 1,
eqs. 9, 12, 20, 22, Alg. 1, Prop. 3), with the bisection the targets use."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from precondfx.errors import PrecondError
from precondfx.schemes.tat.arch import (Arch, Number, _as_arch, count_activations, subnet_max,
                                        subnetworks, u_map)


@dataclass(frozen=True)
class TReLUParams:
    """TReLU ``output_scale * leaky_relu(x, negative_slope)`` (spec §2.7; paper Alg. 1)."""

    negative_slope: float
    output_scale: float

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        return self.output_scale * np.where(x >= 0, x, self.negative_slope * x)


def trelu_output_scale(alpha: float) -> float:
    """gamma = sqrt(2/(1+alpha^2)), the scale that makes the TReLU Q map the identity (Lemma 1)."""
    return math.sqrt(2.0 / (1.0 + alpha * alpha))


def leaky_relu_c_map(c: Number, alpha: float) -> Number:
    """Local C map of (T)ReLU with negative slope alpha (spec §2.3; paper eq. 9).

    Uses the reference form [(1-a)^2 (sqrt(1-c^2) + (pi - arccos c) c)/pi + 2 a c]/(1+a^2),
    which equals c + (1-a)^2/(pi(1+a^2)) (sqrt(1-c^2) - c arccos c). It is independent of q
    because the activation is positively homogeneous; c is clipped to [-1, 1].
    """
    c = np.clip(c, -1.0, 1.0)
    return ((1.0 - alpha) ** 2 * (np.sqrt(1.0 - c**2) + (np.pi - np.arccos(c)) * c) / np.pi + 2.0 * alpha * c) / (
        1.0 + alpha**2
    )


def leaky_relu_c_map_derivative(c: Number, alpha: float) -> Number:
    """C'(c) = 1 - (1-a)^2/((1+a^2) pi) arccos(c) (spec §2.3); C'(1) = 1 for every a."""
    c = np.clip(c, -1.0, 1.0)
    return 1.0 - (1.0 - alpha) ** 2 / ((1.0 + alpha**2) * np.pi) * np.arccos(c)


def relu_c_map(c: Number) -> Number:
    """ReLU's C map (Daniely et al.; paper eq. 22): (sqrt(1-c^2) + (pi - arccos c) c)/pi."""
    return leaky_relu_c_map(c, 0.0)


def trelu_q_map(q: Number) -> Number:
    """Q map of the TReLU: exactly the identity for every q (paper Lemma 1)."""
    return q


def leaky_relu_q_map(q: Number, alpha: float) -> Number:
    """Q map of the *unscaled* leaky ReLU: (1+a^2)/2 * q (paper Lemma 1 proof)."""
    return 0.5 * (1.0 + alpha * alpha) * q


def trelu_global_c_map(c: Number, alpha: float, depth: int, derivative: bool = False) -> Number | tuple[Number, Number]:
    """C_f(c) = C_alpha^{o L}(c) for a vanilla TReLU net of ``depth`` layers (paper eq. 12).

    With ``derivative=True`` also returns C'_f(c) by the chain rule (used for Theorem 1 checks).
    """
    x = np.asarray(c, dtype=float)
    d = np.ones_like(x)
    for _ in range(int(depth)):
        if derivative:
            d = d * leaky_relu_c_map_derivative(x, alpha)
        x = leaky_relu_c_map(x, alpha)
    return (x, d) if derivative else x


def max_c_value(arch: Arch | int, alpha: float) -> float:
    """mu^0_f(alpha) = M_{f, C_alpha}(0): the largest C_g(0) over subnetworks (spec §2.6)."""
    return subnet_max(_as_arch(arch), 0.0, lambda y: leaky_relu_c_map(y, alpha))


def max_reachable_eta(arch: Arch | int) -> float:
    """Largest eta TAT-LReLU can reach with alpha in [0, 1]: mu^0_f(0), i.e. plain ReLU (spec §2.7)."""
    return max_c_value(arch, 0.0)


def solve_increasing(
    fn: Callable[[float], float],
    target: float,
    x0: float,
    lo: float,
    hi: float,
    tol: float = 1e-8,
    max_eval: int = 100,
) -> float:
    """Bisection for an increasing fn: returns x with |fn(x) - target| < tol (spec §2.7).

    Same steps as the reference's ``_solve_increasing``: start at x0; if fn(x) > target set
    hi = x and move to (x+lo)/2, else lo = x and move to (x+hi)/2 (or 2x while hi is infinite).
    Raises PrecondError after ``max_eval`` evaluations (target unreachable).
    """
    x = float(x0)
    for _ in range(max_eval):
        v = float(fn(x))
        if abs(v - target) < tol:
            return x
        if v > target:
            hi = x
            x = 0.5 * (x + lo)
        elif v < target:
            lo = x
            x = x * 2.0 if math.isinf(hi) else 0.5 * (x + hi)
        else:  # NaN
            raise PrecondError(f"solve_increasing: fn({x}) returned {v}.")
    raise PrecondError(
        f"Maximum evaluations ({max_eval}) exceeded while solving for target {target}: the target is "
        "probably unachievable for this architecture."
    )


def _lrelu_c_power_at_zero(alpha: float, depth: int) -> float:
    """C_alpha^{o depth}(0) with scalar math (fast path for vanilla nets)."""
    k = (1.0 - alpha) ** 2 / math.pi
    s = 2.0 * alpha
    n = 1.0 + alpha * alpha
    c = 0.0
    for _ in range(depth):
        c = min(1.0, max(-1.0, c))
        c = (k * (math.sqrt(1.0 - c * c) + (math.pi - math.acos(c)) * c) + s * c) / n
    return c


def solve_trelu_slope(arch: Arch | int, eta: float = 0.9, *, tol: float = 1e-8, max_eval: int = 100) -> TReLUParams:
    """TReLU negative slope alpha in [0, 1] with mu^0_f(alpha) = eta (spec §2.7; paper Alg. 1).

    ``arch`` is an architecture expression or an int L for a vanilla net of L nonlinear layers
    (then mu^0 = C_alpha^{oL}(0), paper eq. 12). Bisection on 1 - mu^0(alpha) = 1 - eta from
    0.5 on [0, 1] with |residual| < tol, exactly the reference procedure (so tol=1e-8 reproduces
    its numbers bit for bit). Returns alpha and gamma = sqrt(2/(1+alpha^2)); the activation is
    gamma * leaky_relu(x, alpha). Raises PrecondError when eta > mu^0_f(0) (plain ReLU).
    """
    if not 0.0 <= eta <= 1.0:
        raise PrecondError(f"eta must be in [0, 1], got {eta}.")
    if isinstance(arch, (int, np.integer)) and not isinstance(arch, bool):
        depth = int(arch)
        if depth < 1:
            raise PrecondError("A vanilla net needs at least one nonlinear layer to shape C_f(0).")

        def mu0(alpha: float) -> float:  # vanilla fast path: C_alpha^{oL}(0) (paper eq. 12)
            return _lrelu_c_power_at_zero(alpha, depth)

    else:
        a = _as_arch(arch)
        if count_activations(a) == 0:
            raise PrecondError("The architecture has no nonlinear layer, so C_f(0) cannot be shaped.")
        cands = subnetworks(a)

        def mu0(alpha: float) -> float:
            r = lambda y: leaky_relu_c_map(y, alpha)  # noqa: E731
            return max(float(u_map(g, 0.0, r)) for g in cands)

    top = mu0(0.0)
    if top < eta - tol:
        raise PrecondError(
            f"C_f(0) target eta={eta} is unachievable: the largest reachable value with a negative slope in "
            f"[0, 1] is {top:.6f} (plain ReLU). Use a deeper network, a smaller eta or a smaller shortcut weight "
            "(e.g. a Leaky-ReLU MLP of only a few layers may not be able to achieve C(0) target of 0.9)."
        )
    alpha = solve_increasing(lambda x: 1.0 - mu0(x), 1.0 - eta, 0.5, 0.0, 1.0, tol=tol, max_eval=max_eval)
    return TReLUParams(negative_slope=alpha, output_scale=trelu_output_scale(alpha))


def _ode_rhs(x: Number) -> Number:
    x = np.clip(x, -1.0, 1.0)
    return np.sqrt(1.0 - x * x) - x * np.arccos(x)


def ode_time_for_eta(eta: float) -> float:
    """T(eta) with psi(0, T) = eta, psi solving dx/dt = sqrt(1-x^2) - x arccos x (paper Prop. 3).

    T = integral_0^eta dx / g(x), by composite Gauss-Legendre. T(0.9) = 4.509938 (spec §2.7).
    """
    if not 0.0 <= eta < 1.0:
        raise PrecondError("eta must be in [0, 1)")
    t, w = np.polynomial.legendre.leggauss(20)
    edges = np.linspace(0.0, eta, 257)
    a, b = edges[:-1, None], edges[1:, None]
    x = 0.5 * (a + b) + 0.5 * (b - a) * t
    return float(np.sum(0.5 * (b - a) * w / _ode_rhs(x)))


def ode_limit_c_map(c: Number, T: float, steps: int = 4000) -> Number:
    """psi(c, T): the large-depth limit of the TReLU global C map at fixed eta (paper Prop. 3).

    Classical RK4 on dx/dt = sqrt(1-x^2) - x arccos x from x(0) = c, vectorised over c.
    """
    x = np.array(c, dtype=float)
    h = T / steps
    for _ in range(steps):
        k1 = _ode_rhs(x)
        k2 = _ode_rhs(x + 0.5 * h * k1)
        k3 = _ode_rhs(x + 0.5 * h * k2)
        k4 = _ode_rhs(x + h * k3)
        x = x + h / 6.0 * (k1 + 2 * k2 + 2 * k3 + k4)
    return x


def trelu_slope_initial_guess(depth: int, eta: float) -> float:
    """Asymptotic alpha_0 = (1 - sqrt(1-(1-m)^2))/(1-m), m = pi T(eta)/L (spec §2.7, Prop. 3).

    Only a starting point / sanity check: 0.56725 vs exact 0.57044 at L=100, eta=0.9.
    """
    m = math.pi * ode_time_for_eta(eta) / depth
    if m >= 1.0:
        raise PrecondError("depth too small for the asymptotic formula (need L > pi*T(eta)).")
    return (1.0 - math.sqrt(1.0 - (1.0 - m) ** 2)) / (1.0 - m)
