"""Classify every node of a captured graph: a status and a one-sentence reason.

The op table gives each kind a default; the context refines it: a matrix product is a weighted
layer only when one operand is a parameter, an add of two activations that share an ancestor is
a skip connection while an add of a constant is a bias, a product by a constant is a scaling
layer (Sec. 7).  Nothing is skipped: every node ends with a status.
"""
from __future__ import annotations

from collections.abc import Collection

from precondfx.core import nodes, optable
from precondfx.core.graph import Graph, Node


def classify(graph: Graph, learned: Collection[str] | None = None) -> Graph:
    """Fill ``status`` and ``reason`` of every node in place and return the graph.
    ``learned``: the names of the model's parameters, so that a product with a buffer (a fixed
    normalization constant, a temperature) is a product with a constant; None where the
    front end cannot tell buffers from weights (ONNX initializers): every tensor operand is
    then taken as learned."""
    for n in graph:
        spec = optable.BY_KIND.get(n.kind, optable.UNKNOWN_SPEC)
        n.status, n.reason = spec.status, spec.reason
        if n.kind == "unknown":
            n.reason = f"{n.target}: " + spec.reason
        _refine(n, learned)
    for n, made in derived_weights(graph):
        n.reason = (f"{n.kind} whose weight is computed in forward from parameter(s) "
                    f"{', '.join(made)} (e.g. an equalized learning rate's weight * constant): "
                    f"precondfx re-initializes only a weight passed to the layer as a "
                    f"parameter; left as is")
    return graph


def derived_weights(graph: Graph) -> list[tuple[Node, list[str]]]:
    """The conv/linear/embedding calls whose weight operand is an activation computed from
    parameters and constants alone (``F.linear(x, self.weight * self.scale)``), each with
    those parameters."""
    by_name = {n.name: n for n in graph}
    memo: dict[str, list[str] | None] = {}

    def made_of(name: str, depth: int = 0) -> list[str] | None:
        """The parameters a value is computed from, None if it depends on an input."""
        if name in memo:
            return memo[name]
        n = by_name.get(name)
        out: list[str] | None = None
        if n is not None and n.kind != "input" and depth < 16:
            out = list(n.params.values())
            for src in n.inputs:
                sub = made_of(src, depth + 1)
                if sub is None:
                    out = None
                    break
                out += [p for p in sub if p not in out]
            if out is not None and not out:
                out = None
        memo[name] = out
        return out

    found = []
    for n in graph:
        if n.kind in ("conv", "conv_transpose", "linear", "embedding") and n.module is None \
                and "weight" not in n.params:
            made = [p for src in n.inputs for p in (made_of(src) or [])]
            if made:
                found.append((n, made))
    return found


def _refine(n: Node, learned: Collection[str] | None = None) -> None:
    acts = len(n.inputs)
    if n.kind == "matmul":
        if "weight" in n.params:
            n.status, n.reason = optable.WEIGHTED, (
                "matrix product with a parameter: a linear layer (geometric init, alpha)")
        elif any(k.startswith("operand") for k in n.params):
            n.status, n.reason = optable.BREAKS, (
                "product with a parameter that is not one linear map of one activation (an "
                "elementwise einsum such as 'bi,i->bi', a learned scale; an einsum of three "
                "operands): breaks scaling; left as is")
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
        elif nodes.nonlinear_product(n):
            n.reason = f"{nodes.nonlinear_product(n)}: not a scaling layer, breaks scaling"
        elif any(k.startswith("operand") and (learned is None or v in learned)
                 for k, v in n.params.items()):
            n.reason = ("product with a learned parameter (layer scale): breaks scaling at "
                        "training time; left as is")
        else:
            n.status, n.reason = optable.PRESERVES, (
                "product with a constant: a scaling layer, keeps the activation-gradient "
                "product (Sec. 7)")
