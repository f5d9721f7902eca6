"""Architecture expressions of TAT/DKS (spec §2.5, §2.6; paper App. B.2, B.4): the per-location
tree a graph pass builds, its U_{f,r} evaluator and the subnetwork maximiser M_{f,r}.

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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np

from precondfx.errors import PrecondError

Number = Union[float, np.ndarray]
RFn = Callable[[Number], Number]

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


def count_leaves(arch: Arch, leaf: type) -> int:
    """Number of ``leaf`` nodes in the tree (with multiplicity)."""
    if isinstance(arch, leaf):
        return 1
    if isinstance(arch, Seq):
        return sum(count_leaves(p, leaf) for p in arch.parts)
    if isinstance(arch, (Sum, Concat)):
        return sum(count_leaves(b, leaf) for b in arch.branches)
    return 0


def count_activations(arch: Arch) -> int:
    """Number of Act leaves in the tree (with multiplicity)."""
    return count_leaves(arch, Act)


def _as_arch(arch: Arch | int) -> Arch:
    if isinstance(arch, (int, np.integer)) and not isinstance(arch, bool):
        return plain_net(int(arch))
    _check_node(arch)
    return arch


def describe(a: Arch, limit: int = 400) -> str:
    """A compact text form of an architecture expression (runs of equal parts collapsed)."""
    def d(x: Arch) -> str:
        if isinstance(x, Act):
            return f"Act({x.kind})"
        if isinstance(x, Affine):
            return "Affine"
        if isinstance(x, Identity):
            return "Id"
        if isinstance(x, Sum):
            return "Sum(" + ", ".join(f"{w:.3g}*{d(b)}" for w, b in
                                      zip(x.weights, x.branches)) + ")"
        if isinstance(x, Concat):
            return "Concat(" + ", ".join(f"{s}:{d(b)}" for s, b in zip(x.sizes, x.branches)) + ")"
        parts = [d(p) for p in x.parts]
        out: list[str] = []
        i = 0
        while i < len(parts):
            for span in (2, 1):
                seq = parts[i:i + span]
                k = 1
                while parts[i + k * span:i + (k + 1) * span] == seq:
                    k += 1
                if k > 1 or span == 1:
                    out.append(("[" + ", ".join(seq) + f"]x{k}") if k > 1 else seq[0])
                    i += k * span
                    break
        return "Seq(" + ", ".join(out) + ")"
    s = d(a)
    return s if len(s) <= limit else s[:limit - 3] + "..."
