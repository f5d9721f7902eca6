"""Classify every node of a captured graph: a status and a one-sentence reason.

The op table gives each kind a default; the context refines it: a matrix product is a weighted
layer only when one operand is a parameter, an add of two activations that share an ancestor is
a skip connection while an add of a constant is a bias, a product by a constant is a scaling
layer (Sec. 7).  Nothing is skipped: every node ends with a status.
"""
from __future__ import annotations

from precondfx.core import optable
from precondfx.core.graph import Graph, Node


def classify(graph: Graph) -> Graph:
    """Fill ``status`` and ``reason`` of every node in place and return the graph."""
    for n in graph:
        spec = optable.BY_KIND.get(n.kind, optable.UNKNOWN_SPEC)
        n.status, n.reason = spec.status, spec.reason
        if n.kind == "unknown":
            n.reason = f"{n.target}: " + spec.reason
        _refine(n)
    return graph


def _refine(n: Node) -> None:
    acts = len(n.inputs)
    if n.kind == "matmul":
        if "weight" in n.params:
            n.status, n.reason = optable.WEIGHTED, (
                "matrix product with a parameter: a linear layer (geometric init, alpha)")
        else:
            n.status, n.reason = optable.BREAKS, (
                "product of two activations (e.g. attention scores): degree-2 homogeneous, "
                "breaks scaling")
    elif n.kind in ("conv", "conv_transpose", "linear", "embedding") and n.module is None \
            and "weight" not in n.params:
        n.status, n.reason = optable.BREAKS, (
            f"{n.kind} whose weight is an activation, not a parameter: nothing to re-initialize")
    elif n.kind in ("add", "sub"):
        if acts >= 2:
            n.reason = ("sum of two activations (skip connection or merge): breaks scaling "
                        "(Table 1); residual joins get the branch scale s (App. E)")
        else:
            n.status, n.reason = optable.PRESERVES, (
                "adds a constant or parameter (bias-like): keeps the second-moment product")
    elif n.kind == "mul":
        if acts >= 2:
            n.reason = "product of two activations (gating): breaks scaling"
        elif any(k.startswith("operand") for k in n.params):
            n.reason = ("product with a learned parameter (layer scale): breaks scaling at "
                        "training time; left as is")
        else:
            n.status, n.reason = optable.PRESERVES, (
                "product with a constant: a scaling layer, keeps the activation-gradient "
                "product (Sec. 7)")
