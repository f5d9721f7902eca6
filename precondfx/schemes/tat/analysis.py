"""The graph pass (spec §3.1-3.2): a classified graph becomes the per-location architecture
expression(s) by recursion over fork/join pairs; joins become normalized sums or channel-weighted
concatenations."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from precondfx.core.graph import Graph, Node
from precondfx.core.plan import Plan
from precondfx.errors import PrecondError
from precondfx.schemes.tat.arch import (Act, Affine, Arch, Concat, Identity, Seq, Sum, count_leaves,
                                        subnet_max)
from precondfx.schemes.tat.elements import _REFUSE_HELP, _Findings, _element


@dataclass
class Join:
    """A join of two or more activation paths and how it enters the C map."""

    node: str
    kind: str                 # "sum" | "concat"
    fork: str                 # immediate dominator: where the branches start
    indices: list[int]        # operand positions (in the node's inputs) of the joined paths
    weights: list[float]      # sum: multipliers w_i (sum w_i^2 = 1); concat: channel counts
    shortcut: int | None      # position in ``indices`` of the shortcut operand (sum), if any
    affine_counts: list[int]  # weighted layers per branch
    fresh: list[bool]         # branch ends in a fresh affine layer (uncorrelated, spec §2.5)


@dataclass
class Analysis:
    """What the graph pass found: the per-location architecture expression(s) and more."""

    archs: list[Arch]              # one per model output on the data path
    root: str                      # the data input node
    activations: list[str]         # nonlinear nodes, execution order
    act_names: dict[str, str]      # node -> activation name (as in schemes.activations)
    joins: list[Join] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def arch(self) -> Arch:
        return self.archs[0]

    def subnet_max(self, x: float, r: Callable) -> float:
        """M_{f,r}(x), with the maximum also taken over outputs (spec §3.2)."""
        return max(subnet_max(a, x, r) for a in self.archs)

    def summary(self) -> dict[str, Any]:
        return {"nonlinear_layers": len(self.activations),
                "joins": len(self.joins),
                "outputs": len(self.archs),
                "effective_depth": self.subnet_max(0.0, lambda y: 1.0 + y),
                "activation_types": sorted(set(self.act_names.values()))}


def _fresh(a: Arch) -> bool:
    """Does the branch end in an affine layer (fresh weights: uncorrelated with the others)?"""
    if isinstance(a, Seq):
        return bool(a.parts) and _fresh(a.parts[-1])
    return isinstance(a, Affine)


_MAX_TREE = 200_000
_TOO_LARGE = ("the architecture expression grows too large (densely connected blocks are "
              "expanded into a tree, spec §3.2): TAT/DKS analysis is not available for this "
              "model")

def _data_path(graph: Graph) -> tuple[list[str], list[str], set[str]]:
    """The nodes reachable from an input that reach an output (execution order), the output
    nodes, and that set."""
    nodes = list(graph)
    reach: set[str] = set()
    for n in nodes:
        if n.kind == "input" or any(i in reach for i in n.inputs):
            reach.add(n.name)
    outs = [o for o in graph.outputs if graph.get(o) is not None]
    if not outs:
        outs = [i for n in nodes if n.kind == "output" for i in n.inputs]
    co: set[str] = set()
    stack = [o for o in outs if o in reach]
    while stack:
        v = stack.pop()
        if v in co:
            continue
        co.add(v)
        stack.extend(i for i in graph[v].inputs if i in reach)
    data = reach & co
    return [n.name for n in nodes if n.name in data], outs, data


def _data_root(graph: Graph, order: list[str]) -> str:
    """The one input on the data path (the per-location theory has one, spec §3.2)."""
    roots = [v for v in order if graph[v].kind == "input"]
    if not roots:
        raise PrecondError("no path from a model input to the output was found in the captured "
                           "graph: TAT/DKS need the network's data path")
    if len(roots) > 1:
        raise PrecondError(f"scheme cannot handle this model: {len(roots)} inputs "
                           f"({', '.join(roots)}) feed the output; "
                           + _REFUSE_HELP["inputs"])
    return roots[0]


def _dominators(order: list[str], root: str, preds: dict[str, list[str]]
                ) -> dict[str, str | None]:
    """Immediate dominators over the data path (execution order is topological)."""
    idom: dict[str, str | None] = {root: None}
    depth: dict[str, int] = {root: 0}

    def lca(a: str, b: str) -> str:
        while a != b:
            if depth[a] >= depth[b]:
                a = idom[a]  # type: ignore[assignment]
            else:
                b = idom[b]  # type: ignore[assignment]
        return a

    for v in order:
        if v == root:
            continue
        ps = preds[v]
        d = ps[0]
        for p in ps[1:]:
            d = lca(d, p)
        idom[v] = d
        depth[v] = depth[d] + 1
    return idom


class _Expression:
    """The architecture expression, by recursion over fork/join pairs: ``seg(v, stop)`` is the
    path from ``stop`` (a dominator of ``v``) to ``v``; a join is the sum or concatenation of
    its branches from the fork (its immediate dominator)."""

    def __init__(self, graph: Graph, elem: dict[str, Any], preds: dict[str, list[str]],
                 idom: dict[str, str | None], shortcut_weight: float, f: _Findings) -> None:
        self.graph, self.elem, self.preds, self.idom = graph, elem, preds, idom
        self.w, self.f = float(shortcut_weight), f
        self.joins: dict[str, tuple[Arch, Join]] = {}
        self.memo: dict[tuple[str, str], Arch] = {}
        self.size = 0

    def seg(self, v: str, stop: str) -> Arch:
        key = (v, stop)
        if key in self.memo:
            return self.memo[key]
        parts: list[Arch] = []
        cur: str | None = v
        while cur != stop:
            if cur is None:
                raise PrecondError(f"internal error: {stop} does not dominate {v}")
            e = self.elem[cur]
            self.size += 1
            if self.size > _MAX_TREE:
                raise PrecondError(_TOO_LARGE)
            if isinstance(e, tuple):
                parts.append(self.join(cur))
                cur = self.idom[cur]
            else:
                if e is not None:
                    parts.append(e)
                cur = self.preds[cur][0] if self.preds[cur] else None
        parts.reverse()
        arch = Seq(parts) if len(parts) > 1 else (parts[0] if parts else Identity())
        self.memo[key] = arch
        return arch

    def join(self, v: str) -> Arch:
        if v not in self.joins:
            n, d, ops = self.graph[v], self.idom[v], self.preds[v]
            idx = [n.inputs.index(p) for p in ops]
            branches = [self.seg(p, d) for p in ops]  # type: ignore[arg-type]
            counts = [count_leaves(b, Affine) for b in branches]
            fresh = [_fresh(b) for b in branches]
            if self.elem[v][1] == "concat":
                sizes = _concat_sizes(self.graph, n, ops, self.f.note)
                self.joins[v] = (Concat(branches, sizes),
                                 Join(v, "concat", d, idx, [float(s) for s in sizes], None,
                                      counts, fresh))
            else:
                self.joins[v] = self._sum(v, d, idx, branches, counts, fresh)
        return self.joins[v][0]

    def _sum(self, v: str, d: Any, idx: list[int], branches: list[Arch], counts: list[int],
             fresh: list[bool]) -> tuple[Arch, Join]:
        """A sum join: the shortcut (the branch with fewer weighted layers, of two) gets w, the
        other sqrt(1 - w^2); otherwise equal weights."""
        m = len(branches)
        if m == 2 and counts[0] != counts[1]:
            sc: int | None = 0 if counts[0] < counts[1] else 1
            ws = [self.w if i == sc else math.sqrt(1.0 - self.w * self.w) for i in range(2)]
            perm = [sc, 1 - sc]                                           # type: ignore[operator]
        else:
            sc, ws, perm = None, [1.0 / math.sqrt(m)] * m, list(range(m))
        if sum(1 for fr in fresh if not fr) > 1:
            self.f.note(f"corr{v}", f"{v}: more than one operand of this sum does not end in a "
                        f"fresh weighted layer, so the operands are correlated at initialization "
                        f"and the normalized-sum rule of the C map is approximate there "
                        f"(spec §2.5)")
        return (Sum([branches[i] for i in perm], [ws[i] for i in perm]),
                Join(v, "sum", d, idx, ws, sc, counts, fresh))


def _tree_size(archs: list[Arch]) -> int:
    """Nodes of the expressions as trees (shared subexpressions counted once per use)."""
    sizes: dict[int, int] = {}

    def size(a: Arch) -> int:
        k = id(a)
        if k not in sizes:
            kids = a.parts if isinstance(a, Seq) else \
                a.branches if isinstance(a, (Sum, Concat)) else ()
            sizes[k] = 1 + sum(size(b) for b in kids)
        return sizes[k]
    return sum(size(a) for a in archs)


def analyze_graph(graph: Graph, plan: Plan, shortcut_weight: float = 0.8) -> Analysis:
    """Build the per-location architecture expression of a classified graph (spec §3.1-3.2).

    Raises :class:`PrecondError` listing every node the method does not cover, grouped by
    reason, with what to do about it."""
    if not 0.0 <= shortcut_weight <= 1.0:
        raise PrecondError(f"shortcut_weight={shortcut_weight!r} must be in [0, 1] (the weight w "
                           f"of the normalized sum w*x + sqrt(1-w^2)*F(x))")
    order, outs, data = _data_path(graph)
    root = _data_root(graph, order)
    preds = {v: [i for i in graph[v].inputs if i in data] for v in order}
    pools = {pc.node: pc for pc in plan.pools}
    f = _Findings()
    elem: dict[str, Any] = {root: None}
    for v in order:
        if v != root:
            elem[v] = _element(graph[v], len(preds[v]), pools.get(v), f)
    f.raise_refusals()
    acts = [v for v in order if isinstance(elem[v], Act)]
    expr = _Expression(graph, elem, preds, _dominators(order, root, preds), shortcut_weight, f)
    archs: list[Arch] = []
    for a in (expr.seg(o, root) for o in outs if o in data):
        if a not in archs:
            archs.append(a)
    if not archs:
        raise PrecondError("no model output depends on the input in the captured graph")
    if _tree_size(archs) > _MAX_TREE:
        raise PrecondError(_TOO_LARGE)
    order_pos = {v: i for i, v in enumerate(order)}
    joins = sorted((j for _, j in expr.joins.values()), key=lambda j: order_pos[j.node])
    return Analysis(archs, root, acts, {v: elem[v].kind for v in acts}, joins, f.notes)


def _concat_sizes(graph: Graph, n: Node, ops: list[str], note: Callable) -> list[int]:
    shapes = [graph[p].out_shape for p in ops]
    out = n.out_shape
    if out is None or any(s is None for s in shapes) or any(len(s) != len(out) for s in shapes):
        note(f"cat{n.name}", f"{n.name}: concatenation sizes unknown (or a stack): equal "
             f"weights used in the C map")
        return [1] * len(ops)
    nd = len(out)
    dim = n.attrs.get("dim")
    if not isinstance(dim, int):
        cands = [d for d in range(nd) if sum(s[d] for s in shapes) == out[d]
                 and all(s[e] == out[e] for s in shapes for e in range(nd) if e != d)]
        dim = cands[0] if cands else 1
    dim = dim % nd
    chan = 1 if nd >= 3 else nd - 1
    if dim != chan:
        note(f"catdim{n.name}", f"{n.name}: concatenation along axis {dim}, not the channel "
             f"axis: weighted by size in the C map (approximate)")
    return [max(1, int(s[dim])) for s in shapes]


