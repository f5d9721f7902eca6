"""TAT and DKS: tailored activation transformations as precondfx schemes.

``scheme="tat"`` (Zhang, Botev & Martens, ICLR 2022) and ``scheme="dks"`` (Martens et al. 2021)
run over the shared pipeline (capture -> classify -> plan -> apply -> re-init -> scheme step ->
output scale).  Both shape the network's *kernel* at initialization: for a wide network with
Delta-orthogonal weights, the cosine similarity of two inputs' representations evolves through
a deterministic map C_f, built per location from the layers' local C maps (spec §2.5).  The
math lives in :mod:`precondfx.schemes.tat_math`; this module is the graph pass of spec §3:

1. **Analysis** (:func:`analyze_graph`): the classified graph becomes an architecture expression
   (``tat_math.Act/Affine/Identity/Seq/Sum/Concat``).  Weighted layers are ``Affine``,
   activations ``Act``, transparent ops (reshape, dropout, padding, casts, folded or averaged
   max-pools, average pooling) vanish, and every join is built by recursing over fork/join pairs:
   the fork of a join is its immediate dominator, and each operand becomes a branch expression
   from the fork.  A sum of two activations becomes a *normalized sum*: the operand with fewer
   weighted layers (the shortcut) gets ``shortcut_weight`` w, the other ``sqrt(1 - w^2)``;
   equal counts give ``1/sqrt(2)`` each.  A concatenation becomes ``Concat`` weighted by channel
   counts.  "Depth" is never counted by hand: the solvers evaluate the U maps over the whole
   expression and take the maximum over subnetworks (the whole network and every branch of
   every join, recursively; spec §2.6).  What the theory does not cover is refused with a
   :class:`~precondfx.errors.PrecondError` that says why and what to do: normalization layers,
   attention/softmax and other products of activations, max pooling that was not replaced
   (``maxpool='keep'``), adaptive max pooling, embeddings, recurrent cells, non-linear
   elementwise ops without a transform, unknown ops, and models with several data inputs.
2. **Solve**: ReLU-family networks get TAT's TReLU ``sqrt(2/(1+a^2)) * leaky_relu(x, a)`` with
   the negative slope a such that the network's maximal C_g(0) over subnetworks is ``eta``
   (spec §2.7).  Smooth activations get ``gamma*(phi(alpha*x+beta)+delta)`` solved for TAT
   (Q(1)=1, Q'(1)=1, C'(1)=1, network curvature ``tau``) or DKS (Q(1)=1, Q'(1)=q_slope, C(0)=0,
   network slope ``zeta``) (spec §2.8).
3. **Rewrite**: activations are replaced through :meth:`Scheme.replacements` (modules and, in the
   fx path, functional calls), the join operands get constant multipliers (plan scales tagged
   ``shortcut`` and ``residual``), alphas and the core's residual scale are switched off
   (balance='none', residual='none': TAT fixes scales analytically, spec §3.3), every weighted
   layer is planned as ``orthogonal`` and drawn in the scheme step as scaled-uniform-orthogonal
   (Linear) or Delta-orthogonal (odd-kernel convolutions), biases zero (spec §2.9).
4. **Scheme step** (:meth:`TatScheme.calibrate`): the weight draws (a ``torch.Generator`` seeded
   from ``seed``), the input normalization option, and a self-check: the measured second moment
   q at every activation on the calibration batch, reported next to the solved constants.

Inputs should have q = mean(x^2 over channels) = 1 at every location (spec §2.1).  Per-location
normalization with a homogeneous coordinate adds a channel, so it cannot be inserted into a
model without changing its first layer: it is offered as the preprocessing function
:func:`per_location_normalize` users apply to their data.  In the graph, ``input_norm='scale'``
inserts one fixed input scale that makes the sample's mean q equal 1, and ``input_norm='pln'``
inserts a :class:`~precondfx.pytorch.modules.PerLocationNorm` (no homogeneous coordinate).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace, field
from typing import Any, Callable

import torch
from torch import nn

from precondfx.core import optable
from precondfx.errors import PrecondError
from precondfx.core.graph import Graph, Node
from precondfx.pytorch.modules import (PerLocationNorm, ScaledLeakyReLU, ScaledPReLU,
                               TransformedActivation, TransformedLeakyReLU)
from precondfx.core.options import Options, Override
from precondfx.core.plan import ParamInfo, ParamInit, Plan, Scale
from precondfx.schemes.activations import activation_of
from precondfx.schemes import tat_math as tm
from precondfx.core.scheme import Scheme, SchemeContext, register

__all__ = ["TatScheme", "DksScheme", "Analysis", "Join", "analyze_graph", "architecture",
           "per_location_normalize", "predicted_c_map"]

# ---------------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------------
RELU_FAMILY = ("relu", "leaky_relu", "prelu")
# base name (module class or function name, lower case) -> tat_math activation name
_SMOOTH = {"tanh": "tanh", "sigmoid": "sigmoid", "softplus": "softplus", "gelu": "gelu_exact",
           "silu": "swish", "swish": "swish", "elu": "elu", "celu": "elu", "selu": "selu",
           "softsign": "softsign"}
# tat_math name -> precondfx.pytorch.modules.TransformedActivation name
_TORCH_NAME = {"tanh": "tanh", "sigmoid": "sigmoid", "softplus": "softplus", "gelu_exact": "gelu",
               "gelu": "gelu_tanh", "swish": "silu", "elu": "elu", "selu": "selu",
               "softsign": "softsign", "relu": "relu"}
_ACT_KINDS = ("relu", "leaky_relu", "prelu", "smooth_gate", "saturating", "exp_linear",
              "clipped_relu")


def _act_name(n: Node) -> str | None:
    """tat_math name of an activation node (relu / leaky_relu / prelu or a smooth one), or
    None when no transform exists for it here (the node is recognized by the shared
    ``activation_of``)."""
    base, _ = activation_of(n)
    if base in RELU_FAMILY:
        return base
    if base == "gelu":
        return "gelu" if n.attrs.get("approximate") == "tanh" else "gelu_exact"
    return _SMOOTH.get(base)


# ---------------------------------------------------------------------------------------------
# analysis: classified graph -> architecture expression
# ---------------------------------------------------------------------------------------------
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

    archs: list[tm.Arch]                       # one per model output on the data path
    root: str                                  # the data input node
    activations: list[str]                     # nonlinear nodes, execution order
    act_names: dict[str, str]                  # node -> tat_math activation name
    joins: list[Join] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def arch(self) -> tm.Arch:
        return self.archs[0]

    def subnet_max(self, x: float, r: Callable) -> float:
        """M_{f,r}(x), with the maximum also taken over outputs (spec §3.2)."""
        return max(tm.subnet_max(a, x, r) for a in self.archs)

    def summary(self) -> dict[str, Any]:
        return {"nonlinear_layers": len(self.activations),
                "joins": len(self.joins),
                "outputs": len(self.archs),
                "effective_depth": self.subnet_max(0.0, lambda y: 1.0 + y),
                "activation_types": sorted(set(self.act_names.values()))}


_REFUSE_HELP = {
    "normalization": "TAT and DKS shape the kernel of networks *without* normalization layers (the "
                     "reference implementation raises 'DKS and TAT are not compatible with the use "
                     "of BN layers'; spec §5): remove them (TAT is meant to replace them), or use "
                     "scheme='geometric' or scheme='lsuv'",
    "multiplicative": "attention, softmax, gating and other products of activations are outside "
                      "the kernel theory of TAT/DKS (spec §5): use scheme='geometric' or "
                      "scheme='lsuv' for this model",
    "maxpool": "max pooling is not covered by TAT/DKS (spec §5): let precondfx replace it first "
               "with maxpool='stride' (default), 'conv' or 'avgpool'",
    "activation": "no TAT/DKS transform is available for this activation here (ReLU family: "
                  "relu, leaky_relu, prelu; smooth: tanh, sigmoid, softplus, gelu, silu, elu, "
                  "selu (dks only), softsign; kinked functions such as relu6, hardtanh, hardswish "
                  "have an infinite C''(1)): replace it by one of these in the model",
    "elementwise": "a non-linear elementwise function or reduction without a TAT/DKS transform: "
                   "its C map is unknown (spec §3.1)",
    "unknown": "an op not in precondfx's op table: its C map is unknown; rewrite it with "
               "supported ops or use scheme='geometric'",
    "embedding": "embedding layers read indices, not vectors with q = 1 per location: not covered "
                 "by the kernel theory (spec §5); use scheme='geometric'",
    "recurrent": "recurrent cells share weights over time steps: not covered by the kernel theory "
                 "(spec §5); use scheme='geometric'",
    "inputs": "the per-location kernel theory describes a network with one input (spec §3.2): "
              "models with several data inputs are not covered",
}


def _count_affine(a: tm.Arch) -> int:
    if isinstance(a, tm.Affine):
        return 1
    if isinstance(a, tm.Seq):
        return sum(_count_affine(p) for p in a.parts)
    if isinstance(a, (tm.Sum, tm.Concat)):
        return sum(_count_affine(b) for b in a.branches)
    return 0


def _fresh(a: tm.Arch) -> bool:
    """Does the branch end in an affine layer (fresh weights: uncorrelated with the others)?"""
    if isinstance(a, tm.Seq):
        return bool(a.parts) and _fresh(a.parts[-1])
    return isinstance(a, tm.Affine)


_MAX_TREE = 200_000
_TOO_LARGE = ("the architecture expression grows too large (densely connected blocks are "
              "expanded into a tree, spec §3.2): TAT/DKS analysis is not available for this "
              "model")
#: a node the method does not cover (it gets no element)
_REFUSED = object()


class _Findings:
    """What the pass finds on its way: notes (each once) and the nodes it refuses, grouped by
    reason; ``raise_refusals`` turns the refusals into one PrecondError."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self._noted: set[str] = set()
        self.problems: dict[str, list[str]] = {}

    def note(self, key: str, text: str) -> None:
        if key not in self._noted:
            self._noted.add(key)
            self.notes.append(text)

    def refuse(self, cat: str, n: Node, what: str) -> Any:
        self.problems.setdefault(cat, []).append(f"{n.name} ({what})")
        return _REFUSED

    def raise_refusals(self) -> None:
        if not self.problems:
            return
        lines = []
        for cat, items in self.problems.items():
            shown = ", ".join(items[:8]) + (f" and {len(items) - 8} more" if len(items) > 8
                                             else "")
            lines.append(f"  - {shown}: {_REFUSE_HELP[cat]}")
        raise PrecondError("TAT/DKS cannot handle this model; it contains what the method does "
                           "not cover:\n" + "\n".join(lines))


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


# -- per node: an element of the expression (an Arch leaf; None: transparent; ("join", kind))
def _affine_element(n: Node, f: _Findings) -> Any:
    """A weighted layer: an affine map (its weight must be a parameter)."""
    k, v = n.kind, n.name
    e: Any = tm.Affine()
    if n.status != optable.WEIGHTED:
        e = f.refuse("multiplicative", n, f"{k} whose weight is an activation")
    elif k == "conv" and int(n.attrs.get("groups", 1) or 1) > 1:
        f.note("groups", "grouped/depthwise convolutions: their Delta init makes the channel "
               "maps near-deterministic, so the random-feature assumption is weak (spec §5); "
               "treated as affine")
    if k == "conv_transpose" and any(int(s) > 1 for s in _as_tuple(n.attrs.get("stride", 1))):
        f.note("convT", f"{v}: a strided transposed convolution with a Delta kernel leaves "
               f"zeros between its outputs (q = 0 there): the per-location theory is "
               f"approximate after it")
    return e


def _maxpool_element(n: Node, pc: Any, f: _Findings) -> Any:
    """A max-pool: what the plan turns it into (a convolution, a fold, an average)."""
    action = pc.action if pc is not None else "keep"
    if action == "conv":
        return tm.Affine()
    if action in ("fold", "avgpool"):
        return None
    return f.refuse("maxpool", n, f"kept: {pc.reason}" if pc is not None else "not replaced")


#: kinds the C map passes through unchanged, with the note that says it is an approximation
#: (None: exact, no note)
_TRANSPARENT = {
    "avgpool": ("avgpool", "average pooling / means over positions were treated as the identity "
                "(approximate: they mix locations; the reference does the same, spec §5)"),
    "resize": ("resize", "upsampling copies locations: treated as the identity in the C map"),
    **{k: None for k in ("dropout", "reshape", "select", "pad", "cast", "constant", "output")},
}
_TRANSPARENT["mean"] = _TRANSPARENT["avgpool"]
#: kinds refused outright: the reason's category
_REFUSED_KINDS = {"normalization": "normalization", "softmax": "multiplicative",
                  "sdpa": "multiplicative", "attention": "multiplicative",
                  "gating": "multiplicative", "embedding": "embedding",
                  "recurrent": "recurrent", "elementwise": "elementwise",
                  "reduce_other": "elementwise"}


def _other_element(n: Node, nin: int, what: str, f: _Findings) -> Any:
    """Joins, transparent ops and refused ones."""
    k, v = n.kind, n.name
    if k in ("add", "sub", "concat"):
        return ("join", "concat" if k == "concat" else "sum") if nin >= 2 else None
    if k == "mul":
        if nin >= 2:
            return f.refuse("multiplicative", n, "product of two activations (gating)")
        f.note("mul", "a multiplication by a constant or learned scalar was treated as the "
               "identity in the C map (exact for cosines; it changes q, which matters for "
               "smooth activations and for the weights of a following sum)")
        return None
    if k in _TRANSPARENT:
        if _TRANSPARENT[k] is not None:
            f.note(*_TRANSPARENT[k])
        return None
    if k == "neg":
        abs_ = "abs" in n.target.rsplit(".", 1)[-1]
        return f.refuse("elementwise", n, "abs") if abs_ else None
    if k == "sum":
        f.note("sum", f"{v}: a sum over elements was treated as the identity in the C map")
        return None
    if k in _REFUSED_KINDS:
        return f.refuse(_REFUSED_KINDS[k], n, what)
    return f.refuse("unknown", n, f"{k}: {n.target}")


def _element(n: Node, nin: int, pc: Any, f: _Findings) -> Any:
    """The element of node ``n`` (``nin`` inputs on the data path; ``pc`` its pool plan)."""
    k = n.kind
    what = n.attrs.get("class") or n.target.rsplit(".", 1)[-1]
    if k in ("conv", "conv_transpose", "linear") or (k == "matmul" and "weight" in n.params):
        e = _affine_element(n, f)
    elif k == "matmul":
        e = f.refuse("multiplicative", n, "product of two activations (attention scores)")
    elif k == "maxpool":
        e = _maxpool_element(n, pc, f)
    elif k == "adaptive_maxpool":
        e = f.refuse("maxpool", n, "adaptive max pooling has no stride to fold")
    elif k in _ACT_KINDS:
        name = _act_name(n)
        e = f.refuse("activation", n, what) if name is None else tm.Act(name)
    else:
        e = _other_element(n, nin, what, f)
    if e is not _REFUSED and not isinstance(e, tuple) and nin > 1 and \
            (e is not None or k != "output"):
        f.refuse("elementwise", n, f"{what} combines {nin} activations")
    return e


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
        self.joins: dict[str, tuple[tm.Arch, Join]] = {}
        self.memo: dict[tuple[str, str], tm.Arch] = {}
        self.size = 0

    def seg(self, v: str, stop: str) -> tm.Arch:
        key = (v, stop)
        if key in self.memo:
            return self.memo[key]
        parts: list[tm.Arch] = []
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
        arch = tm.Seq(parts) if len(parts) > 1 else (parts[0] if parts else tm.Identity())
        self.memo[key] = arch
        return arch

    def join(self, v: str) -> tm.Arch:
        if v not in self.joins:
            n, d, ops = self.graph[v], self.idom[v], self.preds[v]
            idx = [n.inputs.index(p) for p in ops]
            branches = [self.seg(p, d) for p in ops]  # type: ignore[arg-type]
            counts = [_count_affine(b) for b in branches]
            fresh = [_fresh(b) for b in branches]
            if self.elem[v][1] == "concat":
                sizes = _concat_sizes(self.graph, n, ops, self.f.note)
                self.joins[v] = (tm.Concat(branches, sizes),
                                 Join(v, "concat", d, idx, [float(s) for s in sizes], None,
                                      counts, fresh))
            else:
                self.joins[v] = self._sum(v, d, idx, branches, counts, fresh)
        return self.joins[v][0]

    def _sum(self, v: str, d: Any, idx: list[int], branches: list[tm.Arch], counts: list[int],
             fresh: list[bool]) -> tuple[tm.Arch, Join]:
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
        return (tm.Sum([branches[i] for i in perm], [ws[i] for i in perm]),
                Join(v, "sum", d, idx, ws, sc, counts, fresh))


def _tree_size(archs: list[tm.Arch]) -> int:
    """Nodes of the expressions as trees (shared subexpressions counted once per use)."""
    sizes: dict[int, int] = {}

    def size(a: tm.Arch) -> int:
        k = id(a)
        if k not in sizes:
            kids = a.parts if isinstance(a, tm.Seq) else \
                a.branches if isinstance(a, (tm.Sum, tm.Concat)) else ()
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
    acts = [v for v in order if isinstance(elem[v], tm.Act)]
    expr = _Expression(graph, elem, preds, _dominators(order, root, preds), shortcut_weight, f)
    archs: list[tm.Arch] = []
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


def _as_tuple(v: Any) -> tuple:
    return tuple(v) if isinstance(v, (list, tuple)) else (v,)


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


# ---------------------------------------------------------------------------------------------
# solvers over one or several outputs
# ---------------------------------------------------------------------------------------------
def _trelu_slope(an: Analysis, eta: float) -> tm.TReLUParams:
    if len(an.archs) == 1:
        return tm.solve_trelu_slope(an.arch, eta)
    top = an.subnet_max(0.0, lambda y: tm.leaky_relu_c_map(y, 0.0))
    if top < eta - 1e-8:
        raise PrecondError(f"C_f(0) target eta={eta} is unachievable: the largest reachable value "
                           f"is {top:.6f} (plain ReLU); use a smaller eta")
    a = tm.solve_increasing(
        lambda x: 1.0 - an.subnet_max(0.0, lambda y: tm.leaky_relu_c_map(y, x)), 1.0 - eta,
        0.5, 0.0, 1.0)
    return tm.TReLUParams(a, tm.trelu_output_scale(a))


def _curvature_target(an: Analysis, tau: float) -> float:
    if tau <= 0:
        raise PrecondError(f"tau={tau!r} must be > 0 (TAT's network curvature C''_f(1))")
    if len(an.archs) == 1:
        return tm.local_curvature_target(an.arch, tau)
    return tm.solve_increasing(lambda k: an.subnet_max(0.0, lambda y: k + y), tau, 0.1, 0.0,
                               math.inf)


def _slope_target(an: Analysis, zeta: float) -> float:
    if zeta <= 1:
        raise PrecondError(f"zeta={zeta!r} must be > 1 (DKS's network slope C'_f(1))")
    if len(an.archs) == 1:
        return tm.local_slope_target(an.arch, zeta)
    return tm.solve_increasing(lambda s: an.subnet_max(1.0, lambda y: s * y), zeta, 1.1, 1.0,
                               math.inf)


def predicted_c_map(an: Analysis, c: float, negative_slope: float) -> float:
    """The TReLU network's global C map at input cosine ``c`` (first output; spec §2.5)."""
    return float(tm.u_map(an.arch, c, lambda y: tm.leaky_relu_c_map(y, negative_slope)))


# ---------------------------------------------------------------------------------------------
# the schemes
# ---------------------------------------------------------------------------------------------
_INPUT_NORM = ("auto", "check", "scale", "pln", "off")


def _safe(name: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]", "_", name)


@register("tat")
class TatScheme(Scheme):
    """Tailored Activation Transformation (Zhang et al. 2022; spec ``tat-dks-spec.md``).

    Options (``precondition(..., scheme="tat", scheme_options={...})``):

    * ``eta`` (0.9): the TReLU target C_f(0) (max over subnetworks) for ReLU-family networks.
    * ``tau`` (0.3): the network curvature C''_f(1) for smooth activations.
    * ``shortcut_weight`` (0.8): w of the normalized sums ``w*shortcut + sqrt(1-w^2)*branch``
      inserted at residual joins (0 = vanilla; the paper's best rescaled ResNet uses 0.8).
    * ``delta`` (True): Delta-orthogonal convolutions (odd kernels); False draws scaled
      orthogonal matrices over the flattened kernel instead.
    * ``input_norm`` ('auto'): 'check' measures q = mean(x^2 over channels) of the sample per
      location and reports it; 'scale' inserts one input scale giving mean q = 1 on the sample;
      'pln' inserts a PerLocationNorm module at the input; 'off' does nothing; 'auto' is 'check'
      for TReLU networks (positively homogeneous: the input scale does not change the C map)
      and 'scale' for smooth activations.  Per-location normalization with a homogeneous
      coordinate is the preprocessing function :func:`per_location_normalize`.
    """

    name = "tat"

    def __init__(self, eta: float = 0.9, tau: float = 0.3, shortcut_weight: float = 0.8,
                 delta: bool = True, input_norm: str = "auto") -> None:
        if not 0.0 < float(eta) < 1.0:
            raise PrecondError(f"eta={eta!r} must be in (0, 1): the target C_f(0)")
        if input_norm not in _INPUT_NORM:
            raise PrecondError(f"input_norm={input_norm!r} is not one of {_INPUT_NORM}")
        self.eta, self.tau = float(eta), float(tau)
        self.shortcut_weight, self.delta = float(shortcut_weight), bool(delta)
        self.input_norm = input_norm
        self.analysis: Analysis | None = None
        self.method = ""
        self.info: dict[str, Any] = {}
        self._repl: list[tuple[str, nn.Module, str]] = []
        self._redraw: set[str] = set()
        self._reasons: dict[str, str] = {}     # node -> what the plan does there

    # -- pipeline hooks ----------------------------------------------------------------------
    def overrides(self, opts: Options) -> list[Override]:
        why = f"{self.name} fixes the scales analytically (spec §3.3)"
        return [Override("balance", "none", why),
                Override("residual", "none", f"{self.name} sets the residual weights itself "
                         f"(shortcut_weight)")]

    def plan(self, graph: Graph, plan: Plan, params: dict[str, ParamInfo], opts: Options) -> None:
        an = analyze_graph(graph, plan, self.shortcut_weight)
        self.analysis = an
        notes = list(an.notes)
        if not an.activations:
            raise PrecondError(f"scheme={self.name!r}: the network has no nonlinear layer on its "
                               f"data path, so there is no kernel to shape; use "
                               f"scheme='geometric'")
        self._solve(graph, an, params, notes)
        plan.reasons.update(self._reasons)
        self._plan_joins(graph, plan, an)
        self._plan_inits(graph, plan, params, opts, notes)
        self.info["notes"] = notes
        plan.notes.extend(f"{self.name}: {t}" for t in [self._headline()] + notes)

    def replacements(self, graph: Graph, plan: Plan) -> list[tuple[str, nn.Module, str]]:
        return list(self._repl)

    # -- solving -------------------------------------------------------------------------------
    def _solve(self, graph: Graph, an: Analysis, params: dict[str, ParamInfo],
               notes: list[str]) -> None:
        kinds = set(an.act_names.values())
        relu = kinds & set(RELU_FAMILY)
        if relu and kinds - relu:
            raise PrecondError(f"scheme='tat' cannot mix ReLU-family activations ({sorted(relu)}) "
                               f"with smooth ones ({sorted(kinds - relu)}): TAT's leaky-ReLU "
                               f"method needs leaky ReLUs to be the only activation type (spec "
                               f"§2.7); use one family, or scheme='dks'")
        if relu:
            try:
                p = _trelu_slope(an, self.eta)
            except PrecondError as e:
                top = an.subnet_max(0.0, lambda y: tm.leaky_relu_c_map(y, 0.0))
                raise PrecondError(
                    f"scheme='tat': the target eta={self.eta} is unreachable for this network: "
                    f"the largest C_f(0) a leaky ReLU with slope in [0, 1] can give is {top:.6f} "
                    f"(plain ReLU). Use a smaller eta, a deeper network or a smaller "
                    f"shortcut_weight (now {self.shortcut_weight}). ({e})") from None
            self.method = "TReLU"
            a, g = p.negative_slope, p.output_scale
            self.info.update(method="TReLU (TAT leaky ReLU)", eta=self.eta, negative_slope=a,
                             output_scale=g,
                             c_f0_predicted=an.subnet_max(0.0,
                                                          lambda y: tm.leaky_relu_c_map(y, a)),
                             max_reachable_eta=an.subnet_max(
                                 0.0, lambda y: tm.leaky_relu_c_map(y, 0.0)))
            shared: dict[str, nn.Module] = {}
            for v in an.activations:
                n = graph[v]
                if an.act_names[v] == "prelu":
                    w = n.params.get("weight")
                    num = int(params[w].shape[0]) if w and w in params and params[w].shape else 1
                    make: Callable[[], nn.Module] = lambda num=num: ScaledPReLU(num, a, g)
                else:
                    make = lambda: ScaledLeakyReLU(a, g)  # noqa: E731
                self._add_repl(n, make, shared,
                               f"TReLU {g:.4g}*leaky_relu(x, {a:.6g}) (TAT, eta={self.eta})")
            return
        self.method = "TAT-smooth"
        kappa = _curvature_target(an, self.tau)
        self.info.update(method="TAT smooth", tau=self.tau, local_curvature=kappa)
        self._smooth(graph, an, {k: tm.solve_tat_smooth_local(k, kappa) for k in kinds})

    def _smooth(self, graph: Graph, an: Analysis, sol: dict[str, tm.ActivationTransform]
                ) -> None:
        self.info["transforms"] = {k: {"alpha": t.input_scale, "beta": t.input_shift,
                                       "gamma": t.output_scale, "delta": t.output_shift,
                                       **({"negative_slope": t.negative_slope}
                                          if t.negative_slope is not None else {})}
                                   for k, t in sol.items()}
        shared: dict[str, nn.Module] = {}
        for v in an.activations:
            t = sol[an.act_names[v]]
            if t.negative_slope is not None:
                make: Callable[[], nn.Module] = lambda t=t: TransformedLeakyReLU(
                    t.negative_slope, t.input_shift, t.output_scale, t.output_shift)
            else:
                make = lambda t=t: TransformedActivation(  # noqa: E731
                    _TORCH_NAME[t.name], t.input_scale, t.input_shift, t.output_scale,
                    t.output_shift)
            self._add_repl(graph[v], make, shared,
                           f"{t.output_scale:.4g}*({t.name}({t.input_scale:.4g}x"
                           f"{t.input_shift:+.4g}){t.output_shift:+.4g}) ({self.method})")

    def _add_repl(self, n: Node, make: Callable[[], nn.Module], shared: dict[str, nn.Module],
                  what: str) -> None:
        if n.module:
            mod = shared.get(n.module)
            if mod is None:
                mod = shared[n.module] = make()
            path = n.module
        else:
            mod, path = make(), f"precondfx_{self.name}_{_safe(n.name)}"
        self._repl.append((n.name, mod, path))
        self._reasons[n.name] = f"{self.name}: replaced by {what}"

    # -- joins and inits -----------------------------------------------------------------------
    def _plan_joins(self, graph: Graph, plan: Plan, an: Analysis) -> None:
        nsum = 0
        for j in an.joins:
            if j.kind == "concat":
                plan.reasons[j.node] = (f"{self.name}: concatenation, channel-weighted average "
                                        f"of its branches' C maps (weights {j.weights})")
                continue
            nsum += 1
            for pos, (idx, w) in enumerate(zip(j.indices, j.weights)):
                tag = "shortcut" if pos == j.shortcut else "residual"
                why = (f"{self.name}: normalized sum, operand {idx} "
                       + (f"(shortcut, {j.affine_counts[pos]} weighted layers) times w="
                          f"{w:.4g}" if tag == "shortcut" else f"times {w:.4g}")
                       + " so that the sum of squared weights is 1 (spec §3.2)")
                plan.scales.append(Scale(tag, j.node, "operand", idx, w, why))
            plan.reasons[j.node] = (f"{self.name}: normalized sum from fork {j.fork}: weights "
                                    f"{[round(w, 4) for w in j.weights]} (affine layers per "
                                    f"operand {j.affine_counts})")
        self.info["normalized_sums"] = nsum
        self.info["shortcut_weight"] = self.shortcut_weight

    def _plan_inits(self, graph: Graph, plan: Plan, params: dict[str, ParamInfo],
                    opts: Options, notes: list[str]) -> None:
        if not opts.reinit:
            notes.append("reinit=False: weights kept; the kernel analysis assumes orthogonal "
                         "(Delta) initialization (spec §2.9)")
            return
        for lay in plan.layers:
            w = lay.weight
            pi = plan.inits.get(w or "")
            if not w or pi is None or pi.rule in ("keep", "scale") or w not in params:
                continue
            shape = params[w].shape
            n = graph.get(lay.node)
            conv = lay.kind in ("conv", "conv_transpose")
            odd = conv and len(shape) >= 3 and all(int(k) % 2 == 1 for k in shape[2:])
            delta = conv and self.delta and odd
            cout, cin = _out_in(lay.kind, shape, n, delta, lay)
            gain = max(math.sqrt(cout / max(cin, 1)), 1.0)
            how = ("Delta-orthogonal: centre tap a scaled uniform orthogonal matrix, other taps "
                   "zero" if delta else "scaled uniform orthogonal"
                   + (" over the flattened kernel" if conv else ""))
            if conv and not odd:
                notes.append(f"{lay.node}: even kernel {list(shape[2:])}, no Delta init "
                             f"possible; scaled orthogonal over the flattened kernel instead")
            redraw = delta or lay.kind == "conv_transpose"
            if redraw:
                self._redraw.add(w)
            plan.inits[w] = ParamInit(w, "orthogonal", gain,
                                      f"{self.name}: {how} (gain max(sqrt(out/in), 1) = "
                                      f"{gain:.4g}), "
                                      + (f"drawn in the scheme step from seed {opts.seed}"
                                         if redraw else "Haar orthogonal by QR with sign fix")
                                      + " (spec §2.9)", list(shape))
            if lay.bias and lay.bias in plan.inits and plan.inits[lay.bias].rule != "keep":
                plan.inits[lay.bias] = replace(plan.inits[lay.bias], reason=f"{self.name}: "
                                               f"biases start at zero (spec §2.9)")
        for v in (self.analysis.activations if self.analysis else []):
            n = graph[v]
            w = n.params.get("weight")
            if w and w in plan.inits and self.method == "TReLU":
                plan.inits[w] = replace(plan.inits[w], reason=f"{self.name}: PReLU slope starts "
                                        f"at the TAT negative slope (set by the replacement "
                                        f"module, spec §3.3)")

    def _headline(self) -> str:
        an = self.analysis
        s = an.summary() if an else {}
        base = (f"{s.get('nonlinear_layers')} nonlinear layers, {s.get('joins')} joins, "
                f"effective depth (curvature coefficient) {s.get('effective_depth', 0):.4g}")
        if self.method == "TReLU":
            return (f"TReLU negative slope {self.info['negative_slope']:.10g}, output scale "
                    f"{self.info['output_scale']:.10g} for C_f(0) = {self.eta} ({base})")
        if self.method == "TAT-smooth":
            return (f"TAT smooth, tau={self.tau}, local C''(1)="
                    f"{self.info['local_curvature']:.6g} ({base})")
        return (f"DKS, zeta={self.info.get('zeta')}, local C'(1)="
                f"{self.info.get('local_slope', 0):.8g} ({base})")

    # -- scheme step -----------------------------------------------------------------------------
    def calibrate(self, ctx: SchemeContext) -> dict[str, Any]:
        an = self.analysis
        assert an is not None
        notes: list[str] = list(self.info.get("notes", []))
        self._check_replacements(ctx)
        self._check_sums(ctx, notes)
        init = self._draw(ctx, notes)
        inp = self._input_norm(ctx, notes)
        qs = self._q_check(ctx)
        out = {k: v for k, v in self.info.items() if k != "notes"}
        out.update(an.summary())
        out.update(scheme=self.name, replaced=len(self._repl), init=init, input=inp,
                   q_at_activations=qs, notes=notes,
                   architecture=_describe(an.arch))
        return out

    def _check_replacements(self, ctx: SchemeContext) -> None:
        missing = ctx.unreplaced(self._repl)
        if missing:
            raise PrecondError(
                f"scheme={self.name!r}: the activations {missing[:8]} could not be replaced "
                f"(capture '{ctx.graph.method}': functional calls can only be rewritten in a "
                f"graph torch.fx captures, with inplace=False). A partly transformed network "
                f"does not have the solved C map: use nn.Module activations (e.g. nn.ReLU) or "
                f"make the model fx-traceable")
        ref = next(iter(ctx.model.parameters()), None)
        if ref is not None:
            for _, mod, _ in self._repl:
                mod.to(device=ref.device)
                if ref.is_floating_point():
                    for p in mod.parameters():
                        p.data = p.data.to(ref.dtype)

    def _check_sums(self, ctx: SchemeContext, notes: list[str]) -> None:
        """Every normalized-sum constant must be in place (the back end's outcome for each
        planned scale says); in the eager back end a shortcut operand usually has no module of
        its own to hook: a TReLU network (positively homogeneous, zero biases) is then fixed
        exactly by putting w' = sqrt(1-w^2)/w on the branch's constant alone (the sum is the
        normalized one times 1/w), recorded in ``ctx.measured``."""
        an = self.analysis
        assert an is not None
        be = ctx.applier
        bad = []
        for j in an.joins:
            if j.kind != "sum":
                continue
            keys = [f"{'shortcut' if pos == j.shortcut else 'residual'}:{j.node}:operand:{idx}"
                    for pos, idx in enumerate(j.indices)]
            miss = [pos for pos, k in enumerate(keys) if be.missed(k)]
            if not miss:
                continue
            w = j.weights[j.shortcut] if j.shortcut is not None else 0.0
            fixed = False
            if self.method == "TReLU" and j.shortcut is not None and miss == [j.shortcut] \
                    and w > 0:
                bpos = 1 - j.shortcut
                name = be.placed(keys[bpos])
                if name is not None:
                    value = j.weights[bpos] / w
                    be.set_constant(name, value)
                    ctx.measured.add(self.name, "scale", keys[bpos], value,
                                     note="times 1/w: the shortcut operand has no module to "
                                          "hook")
                    be.made_good(keys[j.shortcut], f"{self.name}: {j.node}: branch multiplier "
                                 f"sqrt(1-w^2)/w = {value:.4g} (shortcut operand has no module "
                                 f"to hook)")
                    notes.append(f"{j.node}: shortcut multiplier could not be placed (capture "
                                 f"{ctx.graph.method}); the branch carries "
                                 f"sqrt(1-w^2)/w = {j.weights[bpos] / w:.4g} instead (exact "
                                 f"for a TReLU network up to a scalar)")
                    fixed = True
            if not fixed:
                bad.append(j.node)
        if bad:
            raise PrecondError(
                f"scheme={self.name!r}: the normalized-sum constants could not be placed at the "
                f"joins {bad[:8]} (capture '{ctx.graph.method}': an operand produced by a "
                f"functional op or shared by several users has no module to hook). TAT/DKS need "
                f"w*x + sqrt(1-w^2)*F(x) at every join: use inplace=False on a model torch.fx "
                f"can trace, or write the joins as normalized sums yourself")

    def _draw(self, ctx: SchemeContext, notes: list[str]) -> str:
        if not ctx.opts.reinit:
            return "kept (reinit=False)"
        gen = torch.Generator().manual_seed(int(ctx.opts.seed))
        named = dict(ctx.model.named_parameters(remove_duplicate=False))
        done: set[str] = set()
        kinds: dict[str, int] = {}
        for lay in ctx.plan.layers:
            w = lay.weight
            pi = ctx.plan.inits.get(w or "")
            if not w or pi is None or pi.rule != "orthogonal" or w in done or w not in named:
                continue
            done.add(w)
            if w not in self._redraw:  # re-initialization drew it: scaled uniform orthogonal
                kinds["orthogonal"] = kinds.get("orthogonal", 0) + 1
                continue
            how = _init_affine(named[w], lay.kind, ctx.graph.get(lay.node), gen, self.delta)
            kinds[how] = kinds.get(how, 0) + 1
        return ", ".join(f"{k} x{v}" for k, v in kinds.items()) or "no weighted layer"

    def _input_norm(self, ctx: SchemeContext, notes: list[str]) -> dict[str, Any]:
        floats = [t for t in ctx.sample.tensors() if t.is_floating_point()]
        if not floats:
            return {"mode": "off", "reason": "no floating-point input"}
        x = floats[0].detach().double()
        cdim = 1 if x.dim() >= 2 else 0
        q = x.pow(2).mean(dim=cdim) if x.dim() >= 2 else x.pow(2).mean().reshape(1)
        stats = {"q_mean": float(q.mean()), "q_min": float(q.min()), "q_max": float(q.max()),
                 "zero_locations": float((q == 0).double().mean())}
        mode = self.input_norm
        if mode == "auto":
            mode = "check" if self.method == "TReLU" else "scale"
        res: dict[str, Any] = {"mode": mode, "sample": stats}
        if mode in ("scale", "pln") and ctx.opts.input_scale is not None:
            notes.append(f"input_norm={mode!r} not applied: input_scale was given")
            res["mode"] = "check"
            return res
        if mode == "scale":
            if stats["q_mean"] <= 0:
                raise PrecondError("input_norm='scale': the sample's inputs are all zero")
            value = 1.0 / math.sqrt(stats["q_mean"])
            ctx.applier.input_scale(value)
            ctx.applier.finish()
            res["scale"] = value
            notes.append(f"input scaled by {value:.4g} so that the sample's mean q per location "
                         f"is 1 (spec §2.1; per-location normalization is "
                         f"precondfx.schemes.tat.per_location_normalize)")
        elif mode == "pln":
            if x.dim() >= 2 and x.shape[cdim] < 2:
                raise PrecondError("input_norm='pln' on a single-channel input would map every "
                                   "location to its sign: preprocess the data with "
                                   "precondfx.schemes.tat.per_location_normalize (which adds a "
                                   "homogeneous channel) and build the model for one more "
                                   "input channel, or use input_norm='scale'")
            _insert_pln(ctx, cdim if x.dim() >= 3 else -1)
            res["module"] = "precondfx_pln"
            notes.append("PerLocationNorm inserted at the input (no homogeneous coordinate)")
            if stats["zero_locations"] > 0:
                notes.append(f"{stats['zero_locations']:.1%} of the sample's locations are all "
                             f"zero: PLN leaves them at zero (spec §2.10: add a homogeneous "
                             f"coordinate with per_location_normalize)")
        elif mode == "check":
            if abs(stats["q_mean"] - 1.0) > 0.1 or stats["zero_locations"] > 0:
                notes.append(f"input q per location is {stats['q_mean']:.3g} on average "
                             f"({stats['zero_locations']:.1%} zero locations); TAT assumes q = 1 "
                             f"(spec §2.1): preprocess with "
                             f"precondfx.schemes.tat.per_location_normalize"
                             + (" (TReLU networks are positively homogeneous, so only zero "
                                "locations matter)" if self.method == "TReLU" else ""))
        return res

    def _q_check(self, ctx: SchemeContext) -> dict[str, Any]:
        an = self.analysis
        assert an is not None
        try:
            got = ctx.outputs(list(an.activations))
        except Exception as e:  # the self-check must never break the pass
            return {"error": f"{type(e).__name__}: {e}"}
        qs = [float(t.detach().double().pow(2).mean()) for t in got.values()
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
        if not qs:
            return {}
        return {"measured": len(qs), "min": min(qs), "max": max(qs),
                "first": qs[0], "last": qs[-1]}


@register("dks")
class DksScheme(TatScheme):
    """Deep Kernel Shaping (Martens et al. 2021; spec §2.8) over the same graph pass.

    Options: ``zeta`` (1.5): the network slope C'_f(1) (max over subnetworks);
    ``q_slope`` (1.0): the local Q'(1) target; ``shortcut_weight``, ``delta`` and
    ``input_norm`` as for ``tat`` ('auto' means 'scale').  ReLU is only partly supported by DKS
    (its Q'(1) condition is dropped, spec §2.8); leaky ReLU and PReLU get the DKS leaky-ReLU
    transform (a PReLU's learnable slope becomes a constant)."""

    name = "dks"

    def __init__(self, zeta: float = 1.5, q_slope: float = 1.0, shortcut_weight: float = 0.8,
                 delta: bool = True, input_norm: str = "auto") -> None:
        super().__init__(shortcut_weight=shortcut_weight, delta=delta, input_norm=input_norm)
        self.zeta, self.q_slope = float(zeta), float(q_slope)

    def _solve(self, graph: Graph, an: Analysis, params: dict[str, ParamInfo],
               notes: list[str]) -> None:
        self.method = "DKS"
        s = _slope_target(an, self.zeta)
        kinds = set(an.act_names.values())
        sol = {}
        for k in sorted(kinds):
            key = "leaky_relu" if k in ("leaky_relu", "prelu") else k
            sol[k] = tm.solve_dks_local(key, s, self.q_slope)
        if "relu" in kinds:
            notes.append("ReLU under DKS is only partly supported: its Q'(1) condition is dropped "
                         "(spec §2.8)")
        if "prelu" in kinds:
            notes.append("PReLU replaced by the DKS leaky-ReLU transform: its slope becomes a "
                         "constant")
        self.info.update(method="DKS", zeta=self.zeta, q_slope=self.q_slope, local_slope=s)
        self._smooth(graph, an, sol)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _out_in(kind: str, shape: tuple, n: Node | None, delta: bool, lay: Any) -> tuple[int, int]:
    """(out, in) of the matrix the orthogonal draw acts on (Delta: channel counts only)."""
    g = int((n.attrs.get("groups", 1) if n is not None else 1) or 1)
    if kind == "conv_transpose" and len(shape) >= 3:
        return int(shape[1]), int(shape[0]) // g * (1 if delta else math.prod(shape[2:]))
    if kind == "conv" and len(shape) >= 3:
        return int(shape[0]) // g, int(shape[1]) * (1 if delta else math.prod(shape[2:]))
    if kind == "matmul" and len(shape) == 2 and n is not None and \
            n.attrs.get("weight_side", "right") == "right":
        return int(shape[1]), int(shape[0])
    if len(shape) >= 2:
        return int(shape[0]), int(math.prod(shape[1:]))
    return lay.n_out, lay.n_in * lay.k2


def _init_affine(p: torch.Tensor, kind: str, n: Node | None, gen: torch.Generator,
                 delta: bool) -> str:
    """Draw one weight in place: SUO (Linear, matmul), Delta-orthogonal (odd-kernel conv)."""
    with torch.no_grad():
        if kind in ("conv", "conv_transpose") and p.dim() >= 3:
            ks = tuple(p.shape[2:])
            odd = all(k % 2 == 1 for k in ks)
            groups = int((n.attrs.get("groups", 1) if n is not None and n.kind == kind else 1)
                         or 1)
            if kind == "conv_transpose":
                tmp = torch.empty((p.shape[1] * groups, p.shape[0] // groups) + ks,
                                  dtype=torch.float64)
                if delta and odd:
                    tm.delta_orthogonal_(tmp, groups=groups, generator=gen)
                else:
                    tm.orthogonal_(tmp, generator=gen)
                # (out, in/g, k) per group -> (in, out/g, k)
                og = p.shape[1]
                blocks = [tmp[i * og:(i + 1) * og].transpose(0, 1) for i in range(groups)]
                p.copy_(torch.cat(blocks, 0).to(p.dtype))
                return "delta-orthogonal (transposed)" if delta and odd else "orthogonal"
            if delta and odd:
                tm.delta_orthogonal_(p, groups=groups, generator=gen)
                return "delta-orthogonal"
            tm.orthogonal_(p, generator=gen)
            return "orthogonal (flattened kernel)"
        if kind == "matmul" and p.dim() == 2 and n is not None and \
                n.attrs.get("weight_side", "right") == "right":
            tmp = torch.empty(p.shape[1], p.shape[0], dtype=torch.float64)
            tm.orthogonal_(tmp, generator=gen)
            p.copy_(tmp.T.to(p.dtype))
            return "orthogonal"
        if p.dim() >= 2:
            tm.orthogonal_(p, generator=gen)
            return "orthogonal"
        return "kept (1-d weight)"


def _pln_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """The input hook of models preconditioned by earlier versions (kept so they unpickle)."""
    pln = module.precondfx_pln
    args = tuple(pln(a) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)
    return args, kwargs


def _insert_pln(ctx: SchemeContext, cdim: int) -> None:
    """PerLocationNorm on the input, through the back end (``Backend.input_module``)."""
    if not ctx.applier.input_module("precondfx_pln", PerLocationNorm(cdim)):
        raise PrecondError("input_norm='pln' needs a PyTorch back end: use input_norm='scale'")


def _describe(a: tm.Arch, limit: int = 400) -> str:
    """A compact text form of an architecture expression (runs of equal parts collapsed)."""
    def d(x: tm.Arch) -> str:
        if isinstance(x, tm.Act):
            return f"Act({x.kind})"
        if isinstance(x, tm.Affine):
            return "Affine"
        if isinstance(x, tm.Identity):
            return "Id"
        if isinstance(x, tm.Sum):
            return "Sum(" + ", ".join(f"{w:.3g}*{d(b)}" for w, b in
                                      zip(x.weights, x.branches)) + ")"
        if isinstance(x, tm.Concat):
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


def architecture(model: nn.Module, sample: Any, *, maxpool: str = "stride",
                 shortcut_weight: float = 0.8, capture: Any = ("fx", "export", "draft_export",
                                                               "eager")) -> Analysis:
    """The TAT/DKS analysis of a model without changing it: its per-location architecture
    expression(s), activations and joins (raises what ``scheme='tat'`` would refuse)."""
    from precondfx.pytorch import calibrate as cal
    from precondfx.pytorch.pipeline import capture_classify, prepare_sample
    from precondfx.core.plan import make_plan
    opts = Options(maxpool=maxpool, balance="none", residual="none")
    model, s, notes = prepare_sample(model, sample, {})
    cal.forward(model, s, "train")
    cap, infos = capture_classify(model, s, capture, "train", notes)
    plan = make_plan(cap.graph, infos, opts)
    return analyze_graph(cap.graph, plan, shortcut_weight)


def per_location_normalize(x: torch.Tensor, homog_mode: str = "one", homog_scale: float = 1.0,
                           channel_dim: int | None = None) -> torch.Tensor:
    """Per-Location Normalization of a batch (spec §2.10): a preprocessing step for TAT/DKS.

    Appends a homogeneous coordinate (``homog_mode='one'``: a constant channel, ``'avg_q'``:
    the sample's RMS, ``'off'``: none) and divides every location by its RMS over channels, so
    that q = 1 everywhere and all-zero locations (blank pixels) are not left at zero.  With a
    homogeneous coordinate the channel count grows by one: build the model for it.  The channel
    axis defaults to 1 for (N, C, ...) batches with spatial axes and -1 for (N, features)."""
    if channel_dim is None:
        channel_dim = 1 if x.dim() >= 3 else -1
    return tm.per_location_normalization(x, homog_mode, homog_scale, True, channel_dim)
