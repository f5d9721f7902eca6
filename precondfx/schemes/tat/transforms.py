"""Solving for the activation transform parameters (spec §2.8 "The solver"): TAT-smooth and DKS,
by a damped Newton method from the reference's starting points (no scipy)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from precondfx.errors import PrecondError
from precondfx.schemes.activations import _ALIASES, NumpyActivation, _leaky, get_activation
from precondfx.schemes.tat.arch import Arch
from precondfx.schemes.tat.local_maps import (ActivationTransform, _raw_moments,
                                              local_curvature_target, local_slope_target)

_ALWAYS_TRY = {"input_scale": (1.0, 0.1), "input_shift": (0.0, 1.0, -1.0), "output_shift": (0.0, 1.0, -1.0), "negative_slope": (0.0, 0.5)}
_SAMPLE_LOW = {"input_scale": 0.0, "input_shift": -3.0, "output_shift": -3.0, "negative_slope": 0.0}
_SAMPLE_HIGH = {"input_scale": 2.0, "input_shift": 3.0, "output_shift": 3.0, "negative_slope": 1.0}
_RANDOM_SEED = 123
_NUM_TRIES = 50


def _starting_points(opt_names: Sequence[str], num_tries: int = _NUM_TRIES) -> list[tuple[float, ...]]:
    """Reference order: itertools.product of the always-try values (first name outermost), then
    uniform draws from RandomState(123) (same stream as the reference's np.random.seed(123))."""
    pts = list(itertools.product(*(_ALWAYS_TRY[n] for n in opt_names)))
    rng = np.random.RandomState(_RANDOM_SEED)
    for _ in range(num_tries - len(pts)):
        pts.append(tuple(float(rng.uniform(_SAMPLE_LOW[n], _SAMPLE_HIGH[n])) for n in opt_names))
    return pts


def _fd_jacobian(fun: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    n = x.size
    cols = []
    for i in range(n):
        h = 1e-6 * max(1.0, abs(x[i]))
        e = np.zeros(n)
        e[i] = h
        cols.append((fun(x + e) - fun(x - e)) / (2.0 * h))
    return np.stack(cols, axis=1)


def _safe(fun: Callable[[np.ndarray], np.ndarray]) -> Callable[[np.ndarray], np.ndarray]:
    def g(x: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            try:
                v = np.asarray(fun(x), dtype=float)
            except (FloatingPointError, ValueError, ZeroDivisionError, OverflowError):
                return np.full(x.size, np.inf)
        return v if np.all(np.isfinite(v)) else np.full(v.size, np.inf)

    return g


def _newton_solve(
    fun: Callable[[np.ndarray], np.ndarray], x0: Sequence[float], tol: float = 1e-12, max_iter: int = 100
) -> tuple[np.ndarray, bool]:
    """Damped Newton / Levenberg-Marquardt on a square system with a central-difference Jacobian.

    Stands in for MINPACK's hybrid Powell method used by the reference (no scipy here).
    Success when ||F||_inf < tol, or when steps stall below 1e-14 with ||F||_inf < 1e-9.
    """
    f = _safe(fun)
    x = np.asarray(x0, dtype=float)
    fx = f(x)
    if not np.all(np.isfinite(fx)):
        return x, False
    lam = 1e-6
    for _ in range(max_iter):
        nf = float(np.max(np.abs(fx)))
        if nf < tol:
            return x, True
        J = _fd_jacobian(f, x)
        if not np.all(np.isfinite(J)):
            return x, False
        accepted = False
        # Try Newton with backtracking first, then increasingly damped LM steps.
        try:
            dx = np.linalg.solve(J, -fx)
        except np.linalg.LinAlgError:
            dx = np.linalg.lstsq(J, -fx, rcond=None)[0]
        n0 = float(np.linalg.norm(fx))
        t = 1.0
        for _ in range(30):
            xn = x + t * dx
            fn = f(xn)
            if np.all(np.isfinite(fn)) and np.linalg.norm(fn) < (1.0 - 1e-4 * t) * n0:
                accepted = True
                break
            t *= 0.5
        if not accepted:
            JtJ = J.T @ J
            g = J.T @ fx
            for _ in range(30):
                A = JtJ + lam * np.diag(np.maximum(np.diag(JtJ), 1e-12))
                try:
                    dx = np.linalg.solve(A, -g)
                except np.linalg.LinAlgError:
                    lam *= 10.0
                    continue
                xn = x + dx
                fn = f(xn)
                if np.all(np.isfinite(fn)) and np.linalg.norm(fn) < n0:
                    accepted = True
                    lam = max(lam / 10.0, 1e-12)
                    break
                lam *= 10.0
        if not accepted:
            return x, nf < 1e-9
        step = float(np.max(np.abs(xn - x)))
        x, fx = xn, fn
        if step < 1e-14 * (1.0 + float(np.max(np.abs(x)))):
            return x, float(np.max(np.abs(fx))) < 1e-9
    return x, float(np.max(np.abs(fx))) < 1e-9


def _canonical(t: ActivationTransform) -> ActivationTransform:
    """Pick one representative of equivalent solutions (documented in spec §2.8).

    Odd phi: (alpha, beta, delta) and (alpha, -beta, -delta) give phi_hat_2(x) = -phi_hat_1(-x),
    which satisfy the same conditions; we return beta >= 0. Periodic phi: beta wrapped to [0, 2 pi).
    """
    act = t.activation
    if act.odd and t.input_shift < 0.0:
        return ActivationTransform(t.name, t.input_scale, -t.input_shift, -t.output_shift, t.output_scale, t.negative_slope)
    if act.periodic:
        return ActivationTransform(
            t.name, t.input_scale, float(np.mod(t.input_shift, 2 * np.pi)), t.output_shift, t.output_scale, t.negative_slope
        )
    return t


def _solve_transform(
    name: str,
    opt_names: Sequence[str],
    build: Callable[[np.ndarray], ActivationTransform],
    residual: Callable[[np.ndarray], np.ndarray],
    reject: Callable[[ActivationTransform], bool] | None,
) -> ActivationTransform:
    for p0 in _starting_points(opt_names):
        x, ok = _newton_solve(residual, p0)
        if not ok:
            continue
        t = build(x)
        if not all(np.isfinite([t.input_scale, t.input_shift, t.output_shift, t.output_scale])):
            continue
        if reject is not None and reject(t):
            continue
        return _canonical(t)
    raise PrecondError(f"Failed to find transformation parameters for activation {name!r} from {_NUM_TRIES} starting points.")


def solve_tat_smooth_local(name: str, c_curv_target: float) -> ActivationTransform:
    """TAT for a smooth activation given the local C''(1) target kappa (spec §2.8; paper eq. 16).

    Unknowns (alpha, beta, delta); gamma = E[(phi(alpha z+beta)+delta)^2]^(-1/2) so Q(1) = 1;
    equations Q'(1) = 1, C'(1) = 1, C''(1) = kappa. Starting points in the reference order;
    solutions with alpha*gamma >= 2 are rejected (reference "hacky fix"). Odd activations are
    returned on the beta >= 0 branch.
    """
    act = get_activation(name)
    if not act.smooth:
        raise PrecondError(
            f"TAT for smooth activations needs a twice-differentiable activation; {name!r} has a kink "
            "(C''(1) is infinite). Use TAT-LReLU for the ReLU family, or DKS."
        )

    def parts(p: np.ndarray) -> tuple[float, float, float, float, dict[str, float]]:
        a, b, d = float(p[0]), float(p[1]), float(p[2])
        m = _raw_moments(act, a, b)
        g2 = 1.0 / (m["ff"] + 2.0 * d * m["f"] + d * d)
        return a, b, d, g2, m

    def residual(p: np.ndarray) -> np.ndarray:
        a, _, d, g2, m = parts(p)
        return np.array(
            [
                g2 * a * (m["ff1z"] + d * m["f1z"]) - 1.0,
                g2 * a * a * m["f1f1"] - 1.0,
                g2 * a**4 * m["f2f2"] - c_curv_target,
            ]
        )

    def build(p: np.ndarray) -> ActivationTransform:
        a, b, d, g2, _ = parts(p)
        return ActivationTransform(name, a, b, d, math.sqrt(g2))

    return _solve_transform(
        name, ("input_scale", "input_shift", "output_shift"), build, residual, lambda t: t.input_scale * t.output_scale >= 2.0
    )


def q_slope_reachable(c_slope: float, q_slope: float) -> None:
    """Refuse a DKS target no activation can meet, before the solve (50 starting points: 17 s
    to 137 s to fail for tanh and softplus): with E[phi]=0 (C(0)=0) and E[phi^2]=1 (Q(1)=1),
    phi = sum_k a_k h_k (orthonormal Hermite functions, k >= 1, sum a_k^2 = 1) has
    C'(1) = sum k a_k^2 and Q'(1) = C'(1) + sum_j a_j a_(j+2) sqrt((j+1)(j+2)) (spec §2.2:
    C'(1) = E[phi'^2], Q'(1) = E[phi phi' z]); each cross term is at most
    ((j+1) a_j^2 + (j+2) a_(j+2)^2)/2 in size, their sum at most C'(1) + 1/2, so
    -1/2 <= Q'(1) <= 2 C'(1) + 1/2 is necessary."""
    lo, hi = -0.5, 2.0 * c_slope + 0.5
    if not lo <= q_slope <= hi:
        raise PrecondError(
            f"no activation meets Q'(1)={q_slope:g} with C'(1)={c_slope:.6g} and C(0)=0: a "
            f"normalized activation's Q'(1) lies in [{lo:g}, {hi:.6g}] (2 C'(1) + 1/2; "
            f"precondfx.schemes.tat.transforms.q_slope_reachable).")


def solve_dks_local(name: str, c_slope_target: float, q_slope_target: float = 1.0) -> ActivationTransform:
    """DKS transform given the local C'(1) target s (spec §2.8; DKS paper).

    delta = -E[phi(alpha z + beta)] (C(0) = 0), gamma from Q(1) = 1.
    * smooth phi: unknowns (alpha, beta); equations Q'(1) = q_slope_target, C'(1) = s.
    * leaky_relu: unknowns (negative_slope, beta), alpha = 1 (homogeneous), same equations.
    * relu: beta = +1 if s < 1.466942206924260361 else -1; unknown alpha; equation C'(1) = s only.
    """
    key = _ALIASES.get(name.lower(), name.lower())

    def output(act: NumpyActivation, a: float, b: float) -> tuple[float, float, dict[str, float]]:
        m = _raw_moments(act, a, b)
        d = -m["f"]
        g2 = 1.0 / (m["ff"] - m["f"] ** 2)
        return d, g2, m

    if key == "relu":
        act = get_activation("relu")
        beta = 1.0 if c_slope_target < 1.466942206924260361 else -1.0

        def residual(p: np.ndarray) -> np.ndarray:
            a = float(p[0])
            _, g2, m = output(act, a, beta)
            return np.array([g2 * a * a * m["f1f1"] - c_slope_target])

        def build(p: np.ndarray) -> ActivationTransform:
            a = float(p[0])
            d, g2, _ = output(act, a, beta)
            return ActivationTransform("relu", a, beta, d, math.sqrt(g2))

        return _solve_transform(name, ("input_scale",), build, residual, None)

    q_slope_reachable(c_slope_target, q_slope_target)
    if key == "leaky_relu":

        def residual(p: np.ndarray) -> np.ndarray:
            slope, b = float(p[0]), float(p[1])
            d, g2, m = output(_leaky(slope), 1.0, b)
            return np.array([g2 * (m["ff1z"] + d * m["f1z"]) - q_slope_target, g2 * m["f1f1"] - c_slope_target])

        def build(p: np.ndarray) -> ActivationTransform:
            slope, b = float(p[0]), float(p[1])
            d, g2, _ = output(_leaky(slope), 1.0, b)
            return ActivationTransform("leaky_relu", 1.0, b, d, math.sqrt(g2), negative_slope=slope)

        return _solve_transform(name, ("negative_slope", "input_shift"), build, residual, None)

    act = get_activation(key)

    def residual(p: np.ndarray) -> np.ndarray:
        a, b = float(p[0]), float(p[1])
        d, g2, m = output(act, a, b)
        return np.array([g2 * a * (m["ff1z"] + d * m["f1z"]) - q_slope_target, g2 * a * a * m["f1f1"] - c_slope_target])

    def build(p: np.ndarray) -> ActivationTransform:
        a, b = float(p[0]), float(p[1])
        d, g2, _ = output(act, a, b)
        return ActivationTransform(key, a, b, d, math.sqrt(g2))

    return _solve_transform(name, ("input_scale", "input_shift"), build, residual, None)


def solve_tat_smooth(name: str, arch: Arch | int, tau: float = 0.3, exact_target: bool = False) -> ActivationTransform:
    """TAT for smooth activations on a network (spec §2.8; paper Alg. 2): kappa from
    mu^2_f(kappa) = tau (:func:`local_curvature_target`, ``exact_target`` -> tau/coef_f), then
    :func:`solve_tat_smooth_local`."""
    return solve_tat_smooth_local(name, local_curvature_target(arch, tau, exact=exact_target))


def solve_dks(name: str, arch: Arch | int, zeta: float = 1.5, q_slope_target: float = 1.0) -> ActivationTransform:
    """DKS on a network (spec §2.8): s from mu^1_f(s) = zeta (:func:`local_slope_target`),
    then :func:`solve_dks_local`."""
    return solve_dks_local(name, local_slope_target(arch, zeta), q_slope_target)
