"""Mathematical core of TAT and DKS, independent of any graph code.

This module implements the maths of

* **TAT**: Zhang, Botev, Martens, *Deep Learning without Shortcuts: Shaping the Kernel with
  Tailored Rectifiers* (ICLR 2022), and
* **DKS**: Martens et al., *Rapid training of deep neural networks without skip connections or
  normalization layers using Deep Kernel Shaping* (2021),

as written down in ``shared/spec/tat-dks-spec.md`` (cited below as "spec §x.y"). It depends on
numpy and torch only (no scipy): quadrature, bisection and the small non-linear root solver are
written here.

Contents
--------
* Leaky-ReLU / TReLU closed-form Q and C maps (spec §2.3, paper Lemma 1, eq. 9/20).
* An *architecture expression* tree (:class:`Act`, :class:`Affine`, :class:`Identity`,
  :class:`Seq`, :class:`Sum`, :class:`Concat`) with the U_{f,r} evaluator of spec §2.5 (paper
  App. B.4) and the subnetwork maximiser M_{f,r} of spec §2.6 (paper App. B.2).
* :func:`solve_trelu_slope`: TReLU negative slope for a target C_f(0)=eta (spec §2.7, Alg. 1).
* A registry of numpy activations with analytic first/second derivatives, Gaussian quadrature
  for local Q/C maps, and the TAT-smooth / DKS transforms ``gamma*(phi(alpha*x+beta)+delta)``
  (spec §2.8, paper eqs. 15-16, Alg. 2).
* Scaled-uniform-orthogonal and Delta-orthogonal initialisers for torch tensors (spec §2.9) and
  per-location normalisation (spec §2.10).

Architecture expressions (for the graph pass)
---------------------------------------------
A network is described, *per location*, by a tree whose leaves are layers and whose inner nodes
are sequential composition and normalised sums. Every node is a function of one input (the value
at the node's entry point), so a fork-join block is a :class:`Sum` (or :class:`Concat`) whose
branches all start at the fork::

    Act(kind)        an elementwise nonlinearity            -> r            (rule 3)
    Affine()         Linear / Delta-initialised conv        -> identity     (rule 2)
    Identity()       transparent op or an identity shortcut -> identity
    Seq(parts)       parts applied left to right            -> composition  (rule 1)
    Sum(branches, weights)   sum_i w_i * branch_i(x), sum w_i^2 == 1 -> sum_i w_i^2 U_i  (rule 4)
    Concat(branches, sizes)  channel concat + affine        -> sum_i (d_i/sum d) U_i

A plain (vanilla) net Linear->act->Linear->act->...->Linear with L activations::

    plain = Seq([Affine(), Act()] * L + [Affine()])       # or simply plain_net(L)

A rescaled ResNet (x -> w*x + sqrt(1-w^2)*R(x), R = three conv+act layers, paper eq. 6)::

    branch = Seq([Act(), Affine(), Act(), Affine(), Act(), Affine()])
    block = Sum([Identity(), branch], [w, (1 - w * w) ** 0.5])
    resnet = Seq([Affine()] + [block] * n_blocks + [Act()])   # see rescaled_resnet_v2()

Subnetworks considered by :func:`subnet_max` are the whole tree plus, recursively, every branch
of every Sum/Concat (spec §2.6: candidates are "the whole network and every branch of every
fork-join block, recursively"). A graph pass builds the tree by recursing over fork/join pairs
(immediate dominators); a tensor consumed by several joins may be duplicated in the tree, which
is exact because U is a deterministic function of the entry value. Sums must be over
uncorrelated branches (at most one branch without a fresh affine layer at its end, spec §2.5);
checking that is the graph pass's job.

Typical use::

    p = solve_trelu_slope(resnet, eta=0.9)        # TReLUParams(negative_slope, output_scale)
    u_map(resnet, 0.0, lambda c: leaky_relu_c_map(c, p.negative_slope))   # predicted C_f(0)
    t = solve_tat_smooth("tanh", resnet, tau=0.3)  # ActivationTransform(alpha, beta, delta, gamma)
    d = solve_dks("softplus", resnet, zeta=1.5)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch

from precondfx.errors import PrecondError
from precondfx.schemes.activations import (  # noqa: F401  (the shared engine, re-exported)
    _ALIASES, _GELU_C, _GELU_K, _SELU_ALPHA, _SELU_LAMBDA, ACTIVATIONS, NumpyActivation, _erf,
    _leaky, _npdf, _sigmoid, gaussian_expectation, gaussian_rule, get_activation)

__all__ = [
    # architecture expressions
    "Act",
    "Affine",
    "Identity",
    "Seq",
    "Sum",
    "Concat",
    "Arch",
    "plain_net",
    "residual_block",
    "rescaled_resnet_v2",
    "u_map",
    "subnetworks",
    "subnet_max",
    "make_subnet_max_func",
    "count_activations",
    # leaky ReLU / TReLU
    "TReLUParams",
    "trelu_output_scale",
    "leaky_relu_c_map",
    "leaky_relu_c_map_derivative",
    "relu_c_map",
    "trelu_q_map",
    "leaky_relu_q_map",
    "trelu_global_c_map",
    "max_c_value",
    "max_reachable_eta",
    "solve_increasing",
    "solve_trelu_slope",
    "trelu_slope_initial_guess",
    "ode_time_for_eta",
    "ode_limit_c_map",
    # smooth activations
    "NumpyActivation",
    "ACTIVATIONS",
    "get_activation",
    "gaussian_rule",
    "gaussian_expectation",
    "ActivationTransform",
    "LocalMaps",
    "local_maps",
    "local_q_map",
    "local_c_map",
    "curvature_coefficient",
    "max_slope",
    "max_curvature",
    "local_curvature_target",
    "local_slope_target",
    "solve_tat_smooth_local",
    "solve_tat_smooth",
    "solve_dks_local",
    "solve_dks",
    # initialisation / preprocessing
    "orthogonal_",
    "delta_orthogonal_",
    "per_location_normalization",
]

Number = Union[float, np.ndarray]
RFn = Callable[[Number], Number]

# ---------------------------------------------------------------------------------------------
# Architecture expressions (spec §2.5, §2.6; paper App. B.2, B.4)
# ---------------------------------------------------------------------------------------------

_WEIGHT_TOL = 1e-9


@dataclass(frozen=True)
class Act:
    """An elementwise nonlinear layer; maps to the local function r (spec §2.5 rule 3).

    ``kind`` names the activation (e.g. ``"tanh"``); :func:`u_map` may be given a mapping from
    kind to local map so that networks mixing activation types get their true global C map.
    """

    kind: str = "act"


@dataclass(frozen=True)
class Affine:
    """An affine layer (Linear, Delta-initialised conv); identity in U (spec §2.5 rule 2)."""


@dataclass(frozen=True)
class Identity:
    """A transparent op or an identity shortcut branch; identity in U (spec §3.1 TRANSPARENT)."""


@dataclass(frozen=True)
class Seq:
    """Sequential composition, parts applied left to right; U composes (spec §2.5 rule 1)."""

    parts: tuple["Arch", ...] = ()

    def __init__(self, parts: Iterable["Arch"] = ()) -> None:
        object.__setattr__(self, "parts", tuple(parts))
        for p in self.parts:
            _check_node(p)


@dataclass(frozen=True)
class Sum:
    """Normalised sum ``sum_i w_i * branch_i(x)`` with sum w_i^2 = 1 (spec §2.5 rule 4).

    All branches start at the same input (the fork). Branches must be mutually uncorrelated
    at init (e.g. each but at most one ends in a fresh affine layer), which is the graph pass's
    job to check. ``weights`` are the multipliers w_i, not their squares. Use
    :meth:`normalized` to rescale arbitrary positive weights to unit norm.
    """

    branches: tuple["Arch", ...]
    weights: tuple[float, ...]

    def __init__(self, branches: Iterable["Arch"], weights: Iterable[float]) -> None:
        b = tuple(branches)
        w = tuple(float(x) for x in weights)
        if len(b) != len(w) or not b:
            raise PrecondError(f"Sum needs one weight per branch (got {len(b)} branches and {len(w)} weights).")
        if abs(sum(x * x for x in w) - 1.0) > _WEIGHT_TOL:
            raise PrecondError(
                f"Sum weights {w} are not normalised (sum of squares {sum(x * x for x in w)!r} != 1); "
                "use Sum.normalized(...) or rescale the residual as w*x + sqrt(1-w^2)*F(x)."
            )
        for p in b:
            _check_node(p)
        object.__setattr__(self, "branches", b)
        object.__setattr__(self, "weights", w)

    @classmethod
    def normalized(cls, branches: Iterable["Arch"], weights: Iterable[float] | None = None) -> "Sum":
        """Build a Sum whose weights are ``weights / ||weights||`` (default: all equal, 1/sqrt(n))."""
        b = tuple(branches)
        w = np.ones(len(b)) if weights is None else np.asarray(list(weights), dtype=float)
        n = float(np.sqrt(np.sum(w * w)))
        if n == 0.0:
            raise PrecondError("Sum.normalized needs at least one non-zero weight.")
        return cls(b, (w / n).tolist())


@dataclass(frozen=True)
class Concat:
    """Channel concatenation followed by an affine layer: a normalised sum with w_i^2 = d_i/sum d.

    This rule is the spec's own derivation (spec §2.5 "Concatenation"), not from the paper.
    """

    branches: tuple["Arch", ...]
    sizes: tuple[int, ...]

    def __init__(self, branches: Iterable["Arch"], sizes: Iterable[int]) -> None:
        b = tuple(branches)
        s = tuple(int(x) for x in sizes)
        if len(b) != len(s) or not b or any(x <= 0 for x in s):
            raise PrecondError(f"Concat needs one positive channel count per branch (got {s}).")
        for p in b:
            _check_node(p)
        object.__setattr__(self, "branches", b)
        object.__setattr__(self, "sizes", s)


Arch = Union[Act, Affine, Identity, Seq, Sum, Concat]
_NODE_TYPES = (Act, Affine, Identity, Seq, Sum, Concat)


def _check_node(node: object) -> None:
    if not isinstance(node, _NODE_TYPES):
        raise PrecondError(f"{node!r} is not an architecture node (Act, Affine, Identity, Seq, Sum, Concat).")


def plain_net(depth: int, kind: str = "act") -> Seq:
    """A vanilla net with ``depth`` nonlinear layers: Affine, (Act, Affine) * depth (paper eq. 12)."""
    if depth < 0:
        raise PrecondError("depth must be >= 0")
    parts: list[Arch] = [Affine()]
    for _ in range(depth):
        parts += [Act(kind), Affine()]
    return Seq(parts)


def residual_block(branch: Arch, shortcut_weight: float, shortcut: Arch | None = None) -> Sum:
    """Rescaled residual ``w*shortcut(x) + sqrt(1-w^2)*branch(x)`` (paper eq. 6-7)."""
    w = float(shortcut_weight)
    if not 0.0 <= w <= 1.0:
        raise PrecondError(f"shortcut_weight must be in [0, 1], got {w}.")
    return Sum([Identity() if shortcut is None else shortcut, branch], [w, math.sqrt(1.0 - w * w)])


def rescaled_resnet_v2(
    blocks_per_group: Sequence[int] = (3, 4, 23, 3), shortcut_weight: float = 0.0, kind: str = "act"
) -> Seq:
    """The paper's modified ResNet-V2 per-location structure (spec §4.1, §4.3; paper App. B.5).

    Each block is a normalised sum of a bottleneck residual branch (three act+conv layers) and a
    shortcut that is ``act+conv`` in the first block of each group ("transition" block) and the
    identity otherwise; a final activation follows the blocks. (3,4,6,3) is ResNet-50 and
    (3,4,23,3) ResNet-101; mu^2 coefficient = (L-6)(1-w^2)+5 with L = 3*sum(blocks)+2.
    """
    res_branch = Seq([Act(kind), Affine(), Act(kind), Affine(), Act(kind), Affine()])
    transition_shortcut = Seq([Act(kind), Affine()])
    parts: list[Arch] = [Affine()]
    for n in blocks_per_group:
        for j in range(int(n)):
            parts.append(residual_block(res_branch, shortcut_weight, transition_shortcut if j == 0 else None))
    parts.append(Act(kind))
    return Seq(parts)


def _resolve_r(r: RFn | Mapping[str, RFn], kind: str) -> RFn:
    if callable(r):
        return r
    try:
        return r[kind]
    except KeyError:
        raise PrecondError(f"No local map given for activation kind {kind!r}.") from None


def u_map(arch: Arch, x: Number, r: RFn | Mapping[str, RFn]) -> Number:
    """Evaluate the generalised map U_{f,r}(x) of ``arch`` (spec §2.5; paper App. B.4).

    ``r`` replaces every local C map: a callable, or a mapping from :attr:`Act.kind` to callable.
    With r = local C map, U is the global C map C_f; with r(y)=s*y and x=1 it is C'_f(1) (DKS);
    with r(y)=kappa+y and x=0 it is C''_f(1) (TAT smooth). Works elementwise on numpy arrays.
    """
    if isinstance(arch, Act):
        return _resolve_r(r, arch.kind)(x)
    if isinstance(arch, (Affine, Identity)):
        return x
    if isinstance(arch, Seq):
        for p in arch.parts:
            x = u_map(p, x, r)
        return x
    if isinstance(arch, Sum):
        total: Number = 0.0
        for w, b in zip(arch.weights, arch.branches):
            total = total + (w * w) * u_map(b, x, r)
        return total
    if isinstance(arch, Concat):
        d = float(sum(arch.sizes))
        total = 0.0
        for s, b in zip(arch.sizes, arch.branches):
            total = total + (s / d) * u_map(b, x, r)
        return total
    raise PrecondError(f"{arch!r} is not an architecture node.")


def subnetworks(arch: Arch) -> list[Arch]:
    """Candidate subnetworks for M_{f,r}: ``arch`` and every Sum/Concat branch, recursively.

    Duplicates (structurally equal subtrees) are removed; order is first-seen (spec §2.6).
    """
    out: list[Arch] = []
    seen: set[Arch] = set()

    def visit_forks(node: Arch) -> None:
        if isinstance(node, Seq):
            for p in node.parts:
                visit_forks(p)
        elif isinstance(node, (Sum, Concat)):
            for b in node.branches:
                add(b)

    def add(node: Arch) -> None:
        if node in seen:
            return
        seen.add(node)
        out.append(node)
        visit_forks(node)

    add(arch)
    return out


def subnet_max(arch: Arch, x: float, r: RFn | Mapping[str, RFn]) -> float:
    """M_{f,r}(x) = max over candidate subnetworks g of U_{g,r}(x) (spec §2.6; paper App. B.2)."""
    return max(float(u_map(g, x, r)) for g in subnetworks(arch))


def make_subnet_max_func(arch: Arch) -> Callable[[float, RFn], float]:
    """Return ``f(x, r_fn) = M_{arch,r_fn}(x)``: the reference's ``subnet_max_func`` contract."""
    cands = subnetworks(arch)
    return lambda x, r_fn: max(float(u_map(g, x, r_fn)) for g in cands)


def count_activations(arch: Arch) -> int:
    """Number of Act leaves in the tree (with multiplicity)."""
    if isinstance(arch, Act):
        return 1
    if isinstance(arch, Seq):
        return sum(count_activations(p) for p in arch.parts)
    if isinstance(arch, (Sum, Concat)):
        return sum(count_activations(b) for b in arch.branches)
    return 0


def _as_arch(arch: Arch | int) -> Arch:
    if isinstance(arch, (int, np.integer)) and not isinstance(arch, bool):
        return plain_net(int(arch))
    _check_node(arch)
    return arch


# ---------------------------------------------------------------------------------------------
# Leaky ReLU / TReLU closed forms (spec §2.3; paper Lemma 1, eq. 9, eq. 20, eq. 22)
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Transformed activations and their local maps (spec §2.2, §2.8; paper eqs. 3-5, 15-19)
# ---------------------------------------------------------------------------------------------


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
    return {
        "f": float(np.sum(w * f)),
        "ff": float(np.sum(w * f * f)),
        "ff1z": float(np.sum(w * f * f1 * z)),
        "f1z": float(np.sum(w * f1 * z)),
        "f1": float(np.sum(w * f1)),
        "f1f1": float(np.sum(w * f1 * f1)),
        "f2f2": float(np.sum(w * f2 * f2)),
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


# ---------------------------------------------------------------------------------------------
# Root solving for the activation parameters (spec §2.8 "The solver")
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Initialisation (spec §2.9; paper App. D) and per-location normalisation (spec §2.10)
# ---------------------------------------------------------------------------------------------


def _suo_matrix(out_dim: int, in_dim: int, generator: torch.Generator | None) -> torch.Tensor:
    """Scaled uniform orthogonal out x in matrix (float64), paper App. D.

    Haar-distributed: a Gaussian min x max draw X is orthonormalised by Cholesky-QR applied
    twice (W = L^-1 X with L L^T = X X^T, i.e. the Q factor of X^T with positive-diagonal R,
    which is the sign-fixed QR the reference uses; the second pass restores orthogonality to
    rounding), falling back to Householder QR if a Cholesky fails. Orthonormal rows when
    out <= in, orthonormal columns when out > in, then times max(sqrt(out/in), 1).
    """
    big, small = max(out_dim, in_dim), min(out_dim, in_dim)
    x = torch.randn(small, big, dtype=torch.float64, generator=generator)
    w = x
    for _ in range(2):
        chol, info = torch.linalg.cholesky_ex(w @ w.T)
        if int(info) != 0:
            q, r = torch.linalg.qr(x.T)
            d = torch.sign(torch.diagonal(r))
            d[d == 0] = 1.0
            w = (q * d).T
            break
        w = torch.linalg.solve_triangular(chol, w, upper=False)
    w = w if out_dim <= in_dim else w.T
    return w * max(math.sqrt(out_dim / in_dim), 1.0)


def orthogonal_(weight: torch.Tensor, gain: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """In-place scaled uniform orthogonal (SUO) init in PyTorch layout (spec §2.9; paper App. D).

    ``weight`` is (out, in, *kernel) (Linear or a non-delta conv, flattened to out x in*prod(k)).
    W is Haar-orthogonal times max(sqrt(out/fan_in), 1) * gain: ||Wx|| = sqrt(out/in)||x||
    exactly when out >= in (q preserved), and in expectation when out < in.
    """
    if weight.dim() < 2:
        raise PrecondError("orthogonal_ needs a tensor with at least 2 dimensions (out, in, ...).")
    out_dim = weight.shape[0]
    fan_in = weight[0].numel()
    w = _suo_matrix(out_dim, fan_in, generator) * gain
    with torch.no_grad():
        weight.copy_(w.reshape(weight.shape).to(weight.dtype))
    return weight


def delta_orthogonal_(
    weight: torch.Tensor, gain: float = 1.0, groups: int = 1, generator: torch.Generator | None = None
) -> torch.Tensor:
    """In-place Delta-orthogonal init of a ConvNd weight (out, in/groups, *k) (spec §2.9).

    All taps are zero except the spatial centre, which holds an SUO matrix per group of shape
    (out/groups) x (in/groups) (orthonormal rows if out < in, columns if out > in, scaled by
    max(sqrt(out/in), 1) from channel counts only) times ``gain``. At init the conv acts as an
    independent dense layer per location. Kernel sizes must be odd.
    """
    if weight.dim() < 3:
        raise PrecondError("delta_orthogonal_ needs a conv weight (out, in/groups, k1, ...).")
    ks = tuple(weight.shape[2:])
    if any(k % 2 == 0 for k in ks):
        raise PrecondError(f"Delta initialisation needs odd kernel sizes, got {ks}; use orthogonal_ instead.")
    out_dim, in_per_group = weight.shape[0], weight.shape[1]
    if groups < 1 or out_dim % groups:
        raise PrecondError(f"out_channels={out_dim} is not divisible by groups={groups}.")
    og = out_dim // groups
    centre = (slice(None), slice(None)) + tuple(k // 2 for k in ks)
    mat = torch.cat([_suo_matrix(og, in_per_group, generator) for _ in range(groups)], dim=0) * gain
    with torch.no_grad():
        weight.zero_()
        weight[centre] = mat.to(weight.dtype)
    return weight


def per_location_normalization(
    x: torch.Tensor,
    homog_mode: str = "one",
    homog_scale: float = 1.0,
    has_batch_dim: bool = True,
    channel_dim: int = -1,
) -> torch.Tensor:
    """Per-Location Normalization: make mean(x^2) over the feature axis 1 everywhere (spec §2.10).

    Optionally first appends a homogeneous coordinate to the feature axis: ``"one"`` (a constant
    ``homog_scale``), ``"avg_q"`` (sqrt of mean x^2 over all non-batch axes, times
    ``homog_scale``; needs at least one location axis) or ``"off"``. Features are on the last
    axis as in the reference; pass ``channel_dim=1`` for NCHW. TAT/DKS assume input q = 1 at
    every location (spec §2.1); this guarantees it.
    """
    if homog_mode not in ("one", "avg_q", "off"):
        raise PrecondError(f"Unknown homog_mode {homog_mode!r} (use 'one', 'avg_q' or 'off').")
    if x.dim() == 0 and has_batch_dim:
        raise PrecondError("x has no batch dimension (it is a scalar) but has_batch_dim=True.")
    moved = False
    if x.dim() > 0 and channel_dim not in (-1, x.dim() - 1):
        x = torch.movedim(x, channel_dim, -1)
        moved = True
    nd = x.dim()
    if homog_mode == "avg_q" and ((nd <= 2 and has_batch_dim) or (nd <= 1 and not has_batch_dim)):
        raise PrecondError("homog_mode='avg_q' needs at least one location axis besides the batch and feature axes.")
    if (nd == 1 and has_batch_dim) or (nd == 0 and not has_batch_dim):
        x = x.unsqueeze(-1)
    if homog_mode == "avg_q":
        dims = list(range(1 if has_batch_dim else 0, x.dim()))
        homog = torch.sqrt(torch.mean(x * x, dim=dims, keepdim=True)).expand(*x.shape[:-1], 1)
    elif homog_mode == "one":
        homog = torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)
    else:
        homog = None
    if homog is not None:
        x = torch.cat([x, homog_scale * homog], dim=-1)
    x = x / torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True))
    if moved:
        x = torch.movedim(x, -1, channel_dim)
    return x
