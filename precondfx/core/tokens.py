"""Free token and position parameters: drawn at the scale of the activation they join.

A vision transformer concatenates a learned class token to its patch embeddings and adds a
learned position embedding (``cat([cls, patches]) + pos``); CLIP, DeiT and many hand-written
models do the same.  These parameters belong to no weighted layer, so the geometric rules do
not cover them, and frameworks draw them at a fixed std (transformers: 0.02).  After precondfx
re-draws the patch embedding, its output has an rms of order 1 while the class token's stream
starts at 0.02: every LayerNorm that stream meets divides by 0.02, and the top Gauss-Newton
eigenvalue of a tiny ViT's result (2320, against 20 for an MLP) lay on these two parameters
(``bench/suggested_lr_probe.py``).  Drawn at the rms of the patch embedding's output, it fell
to 66, and test loss on digits went from 0.50 to 0.19 under AdamW (docs/results/heldout_cpu.md).

The rule (planned here, measured by the ``match`` stage of :mod:`precondfx.core.driver`):

* a parameter read only through shape operations (``expand``, ``view``, slicing) by a
  concatenation (a token) or by an addition where, after broadcasting, it varies along more
  than one axis (a position embedding; a bias-like parameter that varies along one axis only
  is left alone), joined to an activation,
* whose activation side leads back, through shape operations, dropout, concatenations and
  other such additions, to one weighted layer (the partner: the patch embedding),

gets the rule ``match``: a normal draw whose std is the rms of the partner's output on the
calibration batch, measured after the weights are re-drawn.  Without data (the meta device)
it is left as is, and the report says so.
"""
from __future__ import annotations

import math
from typing import Any

from precondfx.core import optable
from precondfx.core.graph import Graph, Node

#: node kinds a value passes through without changing what it is (only its layout)
SHAPE_KINDS = ("reshape", "slice", "select", "index", "getitem", "identity", "cast",
               "contiguous")
#: node kinds the walk from a join to its partner layer may cross
THROUGH_KINDS = SHAPE_KINDS + ("dropout", "concat", "add")
#: the kinds of join a free parameter can be matched at
JOIN_KINDS = ("concat", "add")


def _param_only(g: Graph, name: str, seen: set[str] | None = None) -> list[str] | None:
    """The parameters node ``name`` reads when no activation flows into it: a chain of shape
    operations on parameters and on constants (``x.shape[0]`` read by an ``expand`` is a
    constant); ``[]`` for a constant alone; None when an activation flows in."""
    n = g.get(name)
    if n is None:
        return None
    seen = seen if seen is not None else set()
    if name in seen:
        return None
    seen.add(name)
    if n.kind == "constant":       # no activation flows through (a shape read, an Expand of
        out = list(n.params.values())   # an initializer by a computed shape in ONNX)
        for i in n.inputs:
            out += _param_only(g, i, seen) or []
        return out
    if n.kind not in SHAPE_KINDS:
        return None
    out = list(n.params.values())
    for i in n.inputs:
        sub = _param_only(g, i, seen)
        if sub is None:
            return None
        out += sub
    return out


def _partner(g: Graph, start: str) -> str | None:
    """The one weighted layer the activation ``start`` comes from through
    :data:`THROUGH_KINDS` (operands that are chains of parameters skipped); None when the
    walk meets anything else or forks into two activations."""
    name: str | None = start
    seen: set[str] = set()
    while name is not None and name not in seen:
        seen.add(name)
        n = g.get(name)
        if n is None:
            return None
        if n.status == optable.WEIGHTED and n.kind not in THROUGH_KINDS:
            return n.name
        if n.kind not in THROUGH_KINDS:
            return None
        acts = [i for i in n.inputs if _param_only(g, i) is None]
        if len(acts) != 1:           # two activations meet (or none): no single partner
            return None
        name = acts[0]
    return None


def _varies_on_axes(shape: Any) -> int:
    return sum(1 for d in (shape or ()) if int(d) > 1)


def token_partners(graph: Graph, shapes: dict[str, Any]) -> dict[str, tuple[str, Node]]:
    """Each free token or position parameter -> (its partner layer node, the join node)
    (see the module docstring for the rule; ``shapes``: parameter name -> shape).  A
    parameter met at several joins with different partners is left out."""
    out: dict[str, tuple[str, Node]] = {}
    clash: set[str] = set()
    for n in graph:
        if n.kind not in JOIN_KINDS:
            continue
        free: list[str] = []
        acts: list[str] = []
        for i in n.inputs:
            ps = _param_only(graph, i)
            if ps is None:
                acts.append(i)
            else:
                free += ps           # [] for a constant: neither a token nor an activation
        free += list(n.params.values())
        if not free or len(acts) != 1:
            continue
        partner = _partner(graph, acts[0])
        if partner is None:
            continue
        if n.kind == "add":
            free = [p for p in free if not bias_like(shapes.get(p))]
        for p in free:
            if p in out and out[p][0] != partner:
                clash.add(p)
            out.setdefault(p, (partner, n))
    for p in clash:
        out.pop(p, None)
    return out


def bias_like(shape: Any) -> bool:
    """A parameter that varies along one axis at most (a bias vector, a per-channel offset):
    left alone by the rule, which is for tokens and position embeddings."""
    return _varies_on_axes(shape) < 2


def rms(value: Any) -> float | None:
    """Root mean square of a probed activation (a torch tensor or a numpy array; the core
    imports neither)."""
    if value is None:
        return None
    if hasattr(value, "detach"):
        v = value.detach().double()
        return float(v.pow(2).mean().sqrt())
    import numpy as np
    a = np.asarray(value, dtype=np.float64)
    return float(math.sqrt(float(np.mean(a * a)))) if a.size else None


__all__ = ["token_partners", "bias_like", "rms", "SHAPE_KINDS", "THROUGH_KINDS"]
