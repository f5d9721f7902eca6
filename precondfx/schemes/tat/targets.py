"""Network-level targets over one or several outputs (the maximum over outputs and subnetworks,
spec §3.2): the TReLU slope, the local curvature (TAT) and the local slope (DKS)."""
from __future__ import annotations

import math

from precondfx.errors import PrecondError
from precondfx.schemes.tat.analysis import Analysis
from precondfx.schemes.tat.local_maps import local_curvature_target, local_slope_target
from precondfx.schemes.tat.arch import u_map
from precondfx.schemes.tat.trelu import (TReLUParams, leaky_relu_c_map, solve_increasing,
                                         solve_trelu_slope, trelu_output_scale)


def _trelu_slope(an: Analysis, eta: float) -> TReLUParams:
    if len(an.archs) == 1:
        return solve_trelu_slope(an.arch, eta)
    top = an.subnet_max(0.0, lambda y: leaky_relu_c_map(y, 0.0))
    if top < eta - 1e-8:
        raise PrecondError(f"C_f(0) target eta={eta} is unachievable: the largest reachable value "
                           f"is {top:.6f} (plain ReLU); use a smaller eta")
    a = solve_increasing(
        lambda x: 1.0 - an.subnet_max(0.0, lambda y: leaky_relu_c_map(y, x)), 1.0 - eta,
        0.5, 0.0, 1.0)
    return TReLUParams(a, trelu_output_scale(a))


def _curvature_target(an: Analysis, tau: float) -> float:
    if tau <= 0:
        raise PrecondError(f"tau={tau!r} must be > 0 (TAT's network curvature C''_f(1))")
    if len(an.archs) == 1:
        return local_curvature_target(an.arch, tau)
    return solve_increasing(lambda k: an.subnet_max(0.0, lambda y: k + y), tau, 0.1, 0.0,
                            math.inf)


def _slope_target(an: Analysis, zeta: float) -> float:
    if zeta <= 1:
        raise PrecondError(f"zeta={zeta!r} must be > 1 (DKS's network slope C'_f(1))")
    if len(an.archs) == 1:
        return local_slope_target(an.arch, zeta)
    return solve_increasing(lambda s: an.subnet_max(1.0, lambda y: s * y), zeta, 1.1, 1.0,
                            math.inf)


def predicted_c_map(an: Analysis, c: float, negative_slope: float) -> float:
    """The TReLU network's global C map at input cosine ``c`` (first output; spec §2.5)."""
    return float(u_map(an.arch, c, lambda y: leaky_relu_c_map(y, negative_slope)))

