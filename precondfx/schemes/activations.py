"""One engine for Gaussian expectations over activations, shared by the gne and tat schemes.

* A registry of numpy activations with analytic first and second derivatives
  (:class:`NumpyActivation`, :func:`get_activation`; names as in the TAT/DKS spec §2.8, plus
  celu, mish and hardswish for the gne gains).
* Gaussian quadrature: :func:`gaussian_rule` / :func:`gaussian_expectation` (composite
  Gauss-Legendre split at the integrand's kinks) and :func:`normal_expectation` at any mean and
  variance.
* :func:`activation_of`: the ``(name, slope)`` of a captured activation node, the one place a
  graph node is recognized as an activation (gne, wn and tat read it).

``precondfx.schemes.gne.moments`` (derivative moments ``E[f'^2]``, ``E[f'^4]``) and
``precondfx.schemes.tat.local_maps`` (local Q/C maps) compute their expectations here.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from precondfx.errors import PrecondError

# ---------------------------------------------------------------------------------------------
# Activation registry (numpy, with analytic derivatives; spec §2.8 supported names)
# ---------------------------------------------------------------------------------------------

_SELU_LAMBDA = 1.0507009873554804934
_SELU_ALPHA = 1.6732632423543772848
_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _erf(x: np.ndarray) -> np.ndarray:
    return torch.special.erf(torch.as_tensor(np.asarray(x, dtype=np.float64))).numpy()


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _npdf(x: np.ndarray) -> np.ndarray:
    return _INV_SQRT_2PI * np.exp(-0.5 * x * x)


@dataclass(frozen=True)
class NumpyActivation:
    """A numpy activation with analytic derivatives for the Gaussian-quadrature maps (spec §2.8).

    ``kinks`` are pre-activation points where the function or its first two derivatives are not
    smooth; quadrature splits there. ``smooth`` is False when phi' is discontinuous, so C''(1) is
    infinite and TAT-smooth does not apply (spec §5). ``odd`` activations have mirror solutions
    (alpha, beta, delta) ~ (alpha, -beta, -delta) (spec §2.8 "not unique").
    """

    name: str
    fn: Callable[[np.ndarray], np.ndarray]
    d1: Callable[[np.ndarray], np.ndarray]
    d2: Callable[[np.ndarray], np.ndarray]
    kinks: tuple[float, ...] = ()
    smooth: bool = True
    odd: bool = False
    periodic: bool = False


def _tanh_d1(x: np.ndarray) -> np.ndarray:
    t = np.tanh(x)
    return 1.0 - t * t


def _tanh_d2(x: np.ndarray) -> np.ndarray:
    t = np.tanh(x)
    return -2.0 * t * (1.0 - t * t)


def _sig_d1(x: np.ndarray) -> np.ndarray:
    s = _sigmoid(x)
    return s * (1.0 - s)


def _sig_d2(x: np.ndarray) -> np.ndarray:
    s = _sigmoid(x)
    return s * (1.0 - s) * (1.0 - 2.0 * s)


def _elu(a: float, lam: float) -> tuple[Callable, Callable, Callable]:
    def f(x: np.ndarray) -> np.ndarray:
        return lam * np.where(x < 0, a * np.expm1(np.minimum(x, 0.0)), x)

    def d1(x: np.ndarray) -> np.ndarray:
        return lam * np.where(x < 0, a * np.exp(np.minimum(x, 0.0)), 1.0)

    def d2(x: np.ndarray) -> np.ndarray:
        return lam * np.where(x < 0, a * np.exp(np.minimum(x, 0.0)), 0.0)

    return f, d1, d2


def _swish(x: np.ndarray) -> np.ndarray:
    return x * _sigmoid(x)


def _swish_d1(x: np.ndarray) -> np.ndarray:
    s = _sigmoid(x)
    return s + x * s * (1.0 - s)


def _swish_d2(x: np.ndarray) -> np.ndarray:
    s = _sigmoid(x)
    return s * (1.0 - s) * (2.0 + x * (1.0 - 2.0 * s))


def _gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(_GELU_K * (x + _GELU_C * x**3)))


def _gelu_d1(x: np.ndarray) -> np.ndarray:
    t = np.tanh(_GELU_K * (x + _GELU_C * x**3))
    u1 = _GELU_K * (1.0 + 3.0 * _GELU_C * x * x)
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * u1


def _gelu_d2(x: np.ndarray) -> np.ndarray:
    t = np.tanh(_GELU_K * (x + _GELU_C * x**3))
    u1 = _GELU_K * (1.0 + 3.0 * _GELU_C * x * x)
    u2 = _GELU_K * 6.0 * _GELU_C * x
    s = 1.0 - t * t
    return s * u1 + 0.5 * x * s * (u2 - 2.0 * t * u1 * u1)


def _gelu_exact(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _gelu_exact_d1(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * _npdf(x)


def _gelu_exact_d2(x: np.ndarray) -> np.ndarray:
    return _npdf(x) * (2.0 - x * x)


def _leaky(slope: float) -> NumpyActivation:
    return NumpyActivation(
        "leaky_relu",
        lambda x: np.where(x < 0, slope * x, x),
        lambda x: np.where(x < 0, slope, 1.0),
        lambda x: np.zeros_like(x),
        kinks=(0.0,),
        smooth=False,
    )


_elu_f, _elu_d1, _elu_d2 = _elu(1.0, 1.0)
_selu_f, _selu_d1, _selu_d2 = _elu(_SELU_ALPHA, _SELU_LAMBDA)

ACTIVATIONS: dict[str, NumpyActivation] = {
    a.name: a
    for a in [
        NumpyActivation("tanh", np.tanh, _tanh_d1, _tanh_d2, odd=True),
        NumpyActivation("sigmoid", _sigmoid, _sig_d1, _sig_d2),
        NumpyActivation(
            "erf",
            _erf,
            lambda x: (2.0 / math.sqrt(math.pi)) * np.exp(-x * x),
            lambda x: (-4.0 / math.sqrt(math.pi)) * x * np.exp(-x * x),
            odd=True,
        ),
        NumpyActivation(
            "relu",
            lambda x: np.maximum(x, 0.0),
            lambda x: np.where(x > 0, 1.0, 0.0),
            lambda x: np.zeros_like(x),
            kinks=(0.0,),
            smooth=False,
        ),
        NumpyActivation("softplus", lambda x: np.logaddexp(0.0, x), _sigmoid, _sig_d1),
        # SELU's first derivative jumps at 0 (lambda*alpha vs lambda): C''(1) is infinite.
        NumpyActivation("selu", _selu_f, _selu_d1, _selu_d2, kinks=(0.0,), smooth=False),
        NumpyActivation("elu", _elu_f, _elu_d1, _elu_d2, kinks=(0.0,)),
        NumpyActivation("swish", _swish, _swish_d1, _swish_d2),
        NumpyActivation(
            "bentid",
            lambda x: 0.5 * (np.sqrt(x * x + 1.0) - 1.0) + x,
            lambda x: 0.5 * x / np.sqrt(x * x + 1.0) + 1.0,
            lambda x: 0.5 / (x * x + 1.0) ** 1.5,
        ),
        NumpyActivation("atan", np.arctan, lambda x: 1.0 / (1.0 + x * x), lambda x: -2.0 * x / (1.0 + x * x) ** 2, odd=True),
        NumpyActivation(
            "asinh", np.arcsinh, lambda x: 1.0 / np.sqrt(1.0 + x * x), lambda x: -x / (1.0 + x * x) ** 1.5, odd=True
        ),
        NumpyActivation("square", lambda x: x * x, lambda x: 2.0 * x, lambda x: np.full_like(x, 2.0)),
        NumpyActivation(
            "softsign",
            lambda x: x / (1.0 + np.abs(x)),
            lambda x: 1.0 / (1.0 + np.abs(x)) ** 2,
            lambda x: -2.0 * np.sign(x) / (1.0 + np.abs(x)) ** 3,
            kinks=(0.0,),
            odd=True,
        ),
        _leaky(0.01),
        NumpyActivation("gelu", _gelu, _gelu_d1, _gelu_d2),
        NumpyActivation("gelu_exact", _gelu_exact, _gelu_exact_d1, _gelu_exact_d2),
        NumpyActivation("sin", np.sin, np.cos, lambda x: -np.sin(x), periodic=True),
        NumpyActivation("cos", np.cos, lambda x: -np.sin(x), lambda x: -np.cos(x), periodic=True),
    ]
}
ACTIVATIONS["silu"] = ACTIVATIONS["swish"]


def _mish(x: np.ndarray) -> np.ndarray:
    return x * np.tanh(np.logaddexp(0.0, x))


def _mish_d1(x: np.ndarray) -> np.ndarray:
    t, s = np.tanh(np.logaddexp(0.0, x)), _sigmoid(x)
    return t + x * (1.0 - t * t) * s


def _mish_d2(x: np.ndarray) -> np.ndarray:
    t, s = np.tanh(np.logaddexp(0.0, x)), _sigmoid(x)
    sech2 = 1.0 - t * t
    return 2.0 * sech2 * s + x * sech2 * s * (1.0 - s - 2.0 * t * s)


# activations the gne gains need beyond the TAT/DKS list (celu at its default alpha=1 is elu)
ACTIVATIONS["celu"] = NumpyActivation("celu", _elu_f, _elu_d1, _elu_d2, kinks=(0.0,))
ACTIVATIONS["mish"] = NumpyActivation("mish", _mish, _mish_d1, _mish_d2)
ACTIVATIONS["hardswish"] = NumpyActivation(
    "hardswish",
    lambda x: np.where(x <= -3, 0.0, np.where(x >= 3, x, x * (x + 3.0) / 6.0)),
    lambda x: np.where(x <= -3, 0.0, np.where(x >= 3, 1.0, (2.0 * x + 3.0) / 6.0)),
    lambda x: np.where((x > -3) & (x < 3), 1.0 / 3.0, 0.0),
    kinks=(-3.0, 3.0),
    smooth=False,
)

_ALIASES = {"silu": "swish", "gelu_tanh": "gelu", "leakyrelu": "leaky_relu", "leaky-relu": "leaky_relu"}


def get_activation(name: str, negative_slope: float | None = None) -> NumpyActivation:
    """Look up an activation by name (spec §2.8 list; "silu" = "swish", "gelu" = tanh approx).

    ``negative_slope`` only applies to ``leaky_relu`` (default 0.01 as in torch/reference).
    """
    key = _ALIASES.get(name.lower(), name.lower())
    if key == "leaky_relu":
        return _leaky(0.01 if negative_slope is None else float(negative_slope))
    if key not in ACTIVATIONS:
        raise PrecondError(f"Unknown activation {name!r}; known: {sorted(ACTIVATIONS)}.")
    return ACTIVATIONS[key]


#: parameters of activations whose registry function above is at these defaults (torch's)
_PARAM_DEFAULTS: dict[str, dict[str, float]] = {
    "elu": {"alpha": 1.0}, "celu": {"alpha": 1.0}, "softplus": {"beta": 1.0, "threshold": 20.0}}


def activation_params(node: Any) -> dict[str, Any]:
    """The parameters of an activation node that differ from those of the registry's function of
    its name: ELU/CELU ``alpha``, Softplus ``beta``/``threshold`` (read from the node's attrs, as
    the capture records them for modules and functional calls), GELU ``approximate='tanh'``."""
    name, _ = activation_of(node)
    out: dict[str, Any] = {}
    for k, d in _PARAM_DEFAULTS.get(name, {}).items():
        v = node.attrs.get(k, d)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and float(v) != d:
            out[k] = float(v)
    if name == "gelu" and node.attrs.get("approximate") == "tanh":
        out["approximate"] = "tanh"
    return out


def parametrized_activation(name: str, params: dict[str, Any]) -> NumpyActivation:
    """The registry activation ``name`` at ``params`` (:func:`activation_params`): ELU and CELU
    with their ``alpha``, Softplus with ``beta`` and ``threshold``, GELU's tanh form."""
    if name == "gelu":
        return get_activation("gelu" if params.get("approximate") == "tanh" else "gelu_exact")
    if name == "elu" and "alpha" in params:
        f, d1, d2 = _elu(float(params["alpha"]), 1.0)
        return NumpyActivation("elu", f, d1, d2, kinks=(0.0,))
    if name == "celu" and "alpha" in params:
        a = float(params["alpha"])
        neg = lambda x: np.exp(np.minimum(x, 0.0) / a)  # noqa: E731
        return NumpyActivation("celu", lambda x: np.where(x < 0, a * (neg(x) - 1.0), x),
                               lambda x: np.where(x < 0, neg(x), 1.0),
                               lambda x: np.where(x < 0, neg(x) / a, 0.0), kinks=(0.0,))
    if name == "softplus" and params:
        b = float(params.get("beta", 1.0))
        t = float(params.get("threshold", 20.0))
        lin = lambda x: b * x > t  # noqa: E731
        return NumpyActivation(
            "softplus", lambda x: np.where(lin(x), x, np.logaddexp(0.0, b * x) / b),
            lambda x: np.where(lin(x), 1.0, _sigmoid(b * x)),
            lambda x: np.where(lin(x), 0.0, b * _sig_d1(b * x)), kinks=(t / b,))
    return get_activation(name)


# ---------------------------------------------------------------------------------------------
# Gaussian quadrature (spec §2.8 "Quadrature")
# ---------------------------------------------------------------------------------------------

_QUAD_RADIUS = 10.0  # like the reference: integrate N(0,1) over [-10, 10]
_QUAD_PANELS = 24  # panels per smooth segment
_QUAD_ORDER = 16  # Gauss-Legendre nodes per panel
_GL_T, _GL_W = np.polynomial.legendre.leggauss(_QUAD_ORDER)


def gaussian_rule(breaks: np.ndarray | Sequence[float] = (), panels: int = _QUAD_PANELS) -> tuple[np.ndarray, np.ndarray]:
    """Nodes and weights with sum(w * f(z)) ~= E_{z~N(0,1)}[f(z)] (spec §2.8).

    Composite Gauss-Legendre (16 nodes per panel) on [-10, 10], split at ``breaks`` (kinks of
    the integrand, shape (K,) or batched (..., K)). The reference uses 1e5-node Gauss-Legendre
    on [-10, 10]; Gauss-Hermite is *not* used because it converges badly for kinked integrands
    (spec: ReLU-DKS off by 0.17 with 200 Hermite nodes). Smooth integrands reach ~1e-15, kinked
    ones too since every segment between kinks is smooth. Returns arrays of shape (..., N).
    """
    b = np.clip(np.asarray(breaks, dtype=float), -_QUAD_RADIUS, _QUAD_RADIUS)
    if b.ndim == 0:
        b = b[None]
    if b.shape == (0,) and panels == _QUAD_PANELS:   # a smooth integrand: always this rule
        return _PLAIN_RULE
    return _rule(b, panels)


def _rule(b: np.ndarray, panels: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`gaussian_rule` for the clipped breaks ``b`` (shape (..., K))."""
    lead = b.shape[:-1]
    lo = np.full(lead + (1,), -_QUAD_RADIUS)
    hi = np.full(lead + (1,), _QUAD_RADIUS)
    edges = np.concatenate([lo, np.sort(b, axis=-1), hi], axis=-1)  # (..., K+2)
    a, c = edges[..., :-1], edges[..., 1:]  # segments (..., K+1)
    frac = np.arange(panels + 1) / panels
    pe = a[..., None] + (c - a)[..., None] * frac  # (..., K+1, P+1)
    pa, pb = pe[..., :-1], pe[..., 1:]  # (..., K+1, P)
    half = 0.5 * (pb - pa)
    mid = 0.5 * (pb + pa)
    nodes = mid[..., None] + half[..., None] * _GL_T  # (..., K+1, P, Q)
    weights = half[..., None] * _GL_W * _npdf(nodes)
    shape = lead + (-1,)
    return nodes.reshape(shape), weights.reshape(shape)


def _frozen(rule: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    for a in rule:
        a.setflags(write=False)
    return rule


#: the rule without breaks, built once: the TAT/DKS solvers evaluate it tens of thousands of
#: times per solve (it was a third of a failing solve's time)
_PLAIN_RULE = _frozen(_rule(np.zeros(0), _QUAD_PANELS))


def gaussian_expectation(f: Callable[[np.ndarray], np.ndarray], breaks: Sequence[float] = ()) -> float:
    """E_{z~N(0,1)}[f(z)] with :func:`gaussian_rule` (split at ``breaks``)."""
    z, w = gaussian_rule(breaks)
    return float(np.sum(w * f(z)))


def normal_expectation(f: Callable[[np.ndarray], np.ndarray], mean: float = 0.0,
                       var: float = 1.0, breaks: Sequence[float] = ()) -> float:
    """``E[f(x)]`` at ``x ~ N(mean, var)``; ``breaks`` are the kinks of ``f`` in ``x``."""
    if not var > 0:
        raise PrecondError(f"pre-activation variance must be > 0, got {var!r}.")
    sd = math.sqrt(var)
    z, w = gaussian_rule([(b - mean) / sd for b in breaks])
    return float(np.sum(w * np.asarray(f(mean + sd * z), dtype=np.float64)))


# ---------------------------------------------------------------------------------------------
# Activation nodes of a captured graph
# ---------------------------------------------------------------------------------------------
#: activations named by their own smooth-gate / clipped-rectifier op, searched in the target
_GATE_NAMES = ("gelu", "silu", "mish", "softplus", "hardswish", "softsign", "relu6",
               "hardtanh", "tanhshrink", "softshrink", "hardshrink")


def activation_of(node: Any) -> tuple[str, float | None]:
    """``(name, slope)`` of an activation node: relu, leaky_relu (slope), prelu, selu, elu,
    celu, tanh, sigmoid, gelu, silu, mish, softplus, relu6, hardtanh...; ``(kind, None)`` for
    anything else."""
    text = f"{node.attrs.get('class', '')} {node.target}".lower()
    k = node.kind
    if k == "relu":
        return "relu", None
    if k == "leaky_relu":
        return "leaky_relu", float(node.attrs.get("negative_slope", 0.01))
    if k == "prelu":
        return "prelu", None
    if k == "exp_linear":
        for name in ("selu", "celu"):
            if name in text:
                return name, None
        return "elu", float(node.attrs.get("alpha", 1.0))
    if k == "saturating":
        if "tanh" in text:
            return "tanh", None
        for name in ("hardsigmoid", "logsigmoid", "log_sigmoid"):
            if name in text:
                return name.replace("_", ""), None
        return "sigmoid", None
    if k in ("smooth_gate", "clipped_relu"):
        for name in _GATE_NAMES:
            if name in text:
                return name, None
    return k, None
