"""Transformed activations gamma*(phi(alpha*x+beta)+delta) and their local Q/C maps by Gaussian
quadrature, and the local targets a network-level condition fixes (spec §2.2, §2.5, §2.8; paper
eqs. 3-5, 15-19)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from precondfx.errors import PrecondError
from precondfx.schemes.activations import NumpyActivation, gaussian_rule, get_activation
from precondfx.schemes.tat.arch import (Arch, Number, RFn, _as_arch, count_activations,
                                        make_subnet_max_func, subnet_max)
from precondfx.schemes.tat.trelu import solve_increasing


@dataclass(frozen=True)
class ActivationTransform:
    """phi_hat(x) = output_scale * (phi(input_scale * x + input_shift) + output_shift) (eq. 15).

    In the paper's letters: gamma * (phi(alpha x + beta) + delta). For ``leaky_relu`` the
    ``negative_slope`` is part of phi. The graph pass rewrites an activation as
    x*alpha -> +beta -> phi -> +delta -> *gamma (spec §3.3).
    """

    name: str
    input_scale: float = 1.0
    input_shift: float = 0.0
    output_shift: float = 0.0
    output_scale: float = 1.0
    negative_slope: float | None = None

    @property
    def activation(self) -> NumpyActivation:
        """The base activation phi."""
        return get_activation(self.name, self.negative_slope)

    def _kinks_z(self) -> np.ndarray:
        a = self.input_scale
        if a == 0.0:
            return np.zeros(0)
        return (np.asarray(self.activation.kinks, dtype=float) - self.input_shift) / a

    def __call__(self, x: np.ndarray | float) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        return self.output_scale * (self.activation.fn(self.input_scale * x + self.input_shift) + self.output_shift)

    def derivative(self, x: np.ndarray | float, order: int = 1) -> np.ndarray:
        """phi_hat' = gamma alpha phi'(alpha x + beta), phi_hat'' = gamma alpha^2 phi''(...)."""
        x = np.asarray(x, dtype=float)
        u = self.input_scale * x + self.input_shift
        act = self.activation
        if order == 1:
            return self.output_scale * self.input_scale * act.d1(u)
        if order == 2:
            return self.output_scale * self.input_scale**2 * act.d2(u)
        raise PrecondError("order must be 1 or 2")


@dataclass(frozen=True)
class LocalMaps:
    """Local Q/C map quantities at q=1 (spec §2.2), C values normalised by Q(1)."""

    q_value: float  # Q(1) = E[phi_hat(z)^2]
    q_slope: float  # Q'(1) = E[phi_hat phi_hat' z]
    c_value_0: float  # C(0) = E[phi_hat]^2 / Q(1)
    c_slope_0: float  # C'(0) = E[phi_hat']^2 / Q(1)
    c_slope_1: float  # C'(1) = E[phi_hat'^2] / Q(1)
    c_curv_1: float  # C''(1) = E[phi_hat''^2] / Q(1); inf for kinked activations


def _raw_moments(act: NumpyActivation, alpha: float, beta: float) -> dict[str, float]:
    """E over z~N(0,1) of phi(u), phi(u)^2, phi phi' z, phi'^2, phi'' ^2, phi', phi'' z with u = alpha z + beta."""
    if alpha != 0.0 and act.kinks:
        breaks = (np.asarray(act.kinks) - beta) / alpha
    else:
        breaks = np.zeros(0)
    z, w = gaussian_rule(breaks)
    u = alpha * z + beta
    f, f1, f2 = act.fn(u), act.d1(u), act.d2(u)
    add = np.add.reduce      # np.sum's own reduction (the same sums), without its dispatch
    return {
        "f": float(add(w * f)),
        "ff": float(add(w * f * f)),
        "ff1z": float(add(w * f * f1 * z)),
        "f1z": float(add(w * f1 * z)),
        "f1": float(add(w * f1)),
        "f1f1": float(add(w * f1 * f1)),
        "f2f2": float(add(w * f2 * f2)),
    }


def local_maps(t: ActivationTransform) -> LocalMaps:
    """Compute Q(1), Q'(1), C(0), C'(0), C'(1), C''(1) of phi_hat by quadrature (spec §2.2)."""
    act = t.activation
    a, b, d, g = t.input_scale, t.input_shift, t.output_shift, t.output_scale
    m = _raw_moments(act, a, b)
    q1 = g * g * (m["ff"] + 2.0 * d * m["f"] + d * d)
    q_slope = g * g * a * (m["ff1z"] + d * m["f1z"])
    c0 = (g * (m["f"] + d)) ** 2 / q1
    cs0 = (g * a * m["f1"]) ** 2 / q1
    cs1 = g * g * a * a * m["f1f1"] / q1
    cc1 = g * g * a**4 * m["f2f2"] / q1 if act.smooth else math.inf
    return LocalMaps(q1, q_slope, c0, cs0, cs1, cc1)


def local_q_map(t: ActivationTransform, q: Number) -> Number:
    """Q(q) = E[phi_hat(sqrt(q) z)^2] (spec §2.2; paper eq. 3), vectorised over q."""
    qs = np.atleast_1d(np.asarray(q, dtype=float))
    out = np.empty_like(qs)
    for i, qi in enumerate(qs):
        s = math.sqrt(qi)
        if s == 0.0:
            out[i] = float(t(0.0)) ** 2
            continue
        scaled = ActivationTransform(t.name, t.input_scale * s, t.input_shift, t.output_shift, t.output_scale, t.negative_slope)
        z, w = gaussian_rule(scaled._kinks_z())
        out[i] = float(np.sum(w * scaled(z) ** 2))
    return out.reshape(np.shape(q)) if np.ndim(q) else float(out[0])


def local_c_map(t: ActivationTransform, c: Number, q1: float = 1.0, q2: float = 1.0) -> Number:
    """C(c, q1, q2) = E[phi_hat(u1) phi_hat(u2)] / sqrt(Q(q1) Q(q2)) (spec §2.2; paper eq. 4-5).

    (u1, u2) ~ N(0, [[q1, sqrt(q1 q2) c], [., q2]]) written as u1 = sqrt(q1) z1,
    u2 = sqrt(q2) (c z1 + sqrt(1-c^2) z2). 2-D tensor-product quadrature: the inner rule is
    split at the kinks of phi_hat as seen from z2 for every outer node, so kinked activations
    are integrated as accurately as smooth ones (~1e-13). Vectorised over c (a loop).
    """
    cs = np.atleast_1d(np.asarray(c, dtype=float))
    s1, s2 = math.sqrt(q1), math.sqrt(q2)
    act = t.activation
    a, b = t.input_scale, t.input_shift
    kinks_x = (np.asarray(act.kinks, dtype=float) - b) / a if (a != 0.0 and act.kinks) else np.zeros(0)
    z1, w1 = gaussian_rule(kinks_x / s1)
    f1 = t(s1 * z1)
    norm = math.sqrt(float(local_q_map(t, q1)) * float(local_q_map(t, q2)))
    out = np.empty_like(cs)
    for i, ci in enumerate(np.clip(cs, -1.0, 1.0)):
        sc = math.sqrt(max(0.0, 1.0 - ci * ci))
        if sc < 1e-12:
            inner = t(s2 * ci * z1)
        else:
            # kinks of phi_hat(s2 (c z1 + sc z2)) in z2: (k/s2 - c z1) / sc, one row per outer node.
            br = (kinks_x[None, :] / s2 - ci * z1[:, None]) / sc
            z2, w2 = gaussian_rule(br)
            inner = np.sum(w2 * t(s2 * (ci * z1[:, None] + sc * z2)), axis=1)
        out[i] = float(np.sum(w1 * f1 * inner)) / norm
    return out.reshape(np.shape(c)) if np.ndim(c) else float(out[0])


# ---------------------------------------------------------------------------------------------
# Network-level targets: mu^1 (DKS) and mu^2 (TAT smooth) (spec §2.5 table, §2.6, §2.8)
# ---------------------------------------------------------------------------------------------


def max_slope(arch: Arch | int, s: float) -> float:
    """mu^1_f(s) = M_{f, y -> s y}(1): the maximal C'_g(1) given local C'(1) = s (DKS; spec §2.5)."""
    return subnet_max(_as_arch(arch), 1.0, lambda y: s * y)


def max_curvature(arch: Arch | int, kappa: float) -> float:
    """mu^2_f(kappa) = M_{f, y -> kappa + y}(0): the maximal C''_g(1) given C''(1) = kappa (spec §2.5)."""
    return subnet_max(_as_arch(arch), 0.0, lambda y: kappa + y)


def curvature_coefficient(arch: Arch | int) -> float:
    """coef_f with mu^2_f(kappa) = coef_f * kappa (paper App. B.5; L for a vanilla net)."""
    return max_curvature(arch, 1.0)


def _nonlinear_subnet_max(arch: Arch | int) -> Callable[[float, RFn], float]:
    """M_{f,r} of an architecture that has a nonlinear layer (else there is no kernel to shape)."""
    a = _as_arch(arch)
    if count_activations(a) == 0:
        raise PrecondError("The architecture has no nonlinear layer.")
    return make_subnet_max_func(a)


def local_curvature_target(arch: Arch | int, tau: float, exact: bool = False) -> float:
    """Local C''(1) = kappa with mu^2_f(kappa) = tau (spec §2.8, §3.2; paper Alg. 2 step 2).

    mu^2 is linear, so kappa = tau/coef_f; ``exact=True`` returns that. The default follows the
    reference bisection (start 0.1 on [0, inf), tol 1e-8 on mu^2), which differs from tau/coef_f
    by up to ~1e-8/coef_f and reproduces the dks numbers (spec §4.1) bit for bit.
    """
    if tau <= 0.0:
        raise PrecondError("TAT c_curve_target tau must be > 0.")
    f = _nonlinear_subnet_max(arch)
    if exact:
        return tau / f(0.0, lambda y: 1.0 + y)
    return solve_increasing(lambda k: f(0.0, lambda y: k + y), tau, 0.1, 0.0, math.inf)


def local_slope_target(arch: Arch | int, zeta: float, tol: float = 1e-8) -> float:
    """Local C'(1) = s with mu^1_f(s) = zeta, by the reference bisection (DKS; spec §2.8).

    Start 1.1 on [1, inf), |mu^1 - zeta| < tol (1e-8 as in the reference, which reproduces its
    numbers bit for bit; pass a smaller tol for the exact root). Vanilla net: s = zeta^(1/L).
    """
    if zeta <= 1.0:
        raise PrecondError("DKS c_slope_1_target zeta must be > 1.")
    f = _nonlinear_subnet_max(arch)
    return solve_increasing(lambda s: f(1.0, lambda y: s * y), zeta, 1.1, 1.0, math.inf, tol=tol)
