"""The init of one weighted layer under the BDI criterion: the fan-in ``n`` of its linear
component (with the effective kernel size, A.2.7), and the Gaussian std or orthogonal ``beta``
that gives its block ``phi(J J^T) = 1`` (Tables 4/5)."""
from __future__ import annotations

import math
from typing import Any

from precondfx.core.graph import Graph
from precondfx.core.plan import Layer, Plan
from precondfx.schemes.gne.blocks import conv_effective_k


def fan_in(graph: Graph, plan: Plan, lay: Layer, shape: tuple[int, ...], effective_kernel: bool
           ) -> tuple[float, float | None, str]:
    """``n`` of the block's linear component and the effective kernel size used."""
    if lay.kind == "conv":
        if effective_kernel:
            keff, src = conv_effective_k(graph, plan, lay, shape)
        else:
            keff, src = float(lay.k2), "nominal kernel size (effective_kernel=False)"
        return lay.n_in * keff, keff, f"c_in/groups={lay.n_in} x {src}"
    if lay.kind == "conv_transpose":
        node = graph.get(lay.node)
        st = node.attrs.get("stride", 1) if node is not None else 1
        st = math.prod(st) if isinstance(st, (list, tuple)) else int(st or 1)
        n = lay.n_in * lay.k2 / max(st, 1)
        return n, None, (f"transposed conv: each output reads c_in/groups * k/stride = "
                         f"{n:.4g} inputs [DERIVED]")
    return float(lay.n_in * lay.k2), None, f"fan-in {lay.n_in * lay.k2}"


def orth_dims(lay: Layer, shape: tuple[int, ...]) -> tuple[int, int]:
    """(output rows, input columns) of the map, for the expanding-shape correction."""
    if lay.kind == "matmul":
        return lay.n_out, lay.n_in
    return int(shape[0]), int(math.prod(shape[1:]))


def layer_std(kind: str, lay: Layer, shape: tuple[int, ...], gain: float, gsrc: str, n: float,
              keff: float | None, ksrc: str) -> tuple[float, str, str]:
    """(std or beta, init rule, reason) of one layer's weight (before its alpha)."""
    if kind == "gaussian":
        std, rule = gain / math.sqrt(n), "normal"
        why = (f"GNE Gaussian: std = gain/sqrt(n) = {gain:.4g}/sqrt({n:.5g}) (eq. 17, "
               f"Table 4); {gsrc}; n: {ksrc}")
        return std, rule, why
    rows_, cols = orth_dims(lay, shape)
    b2 = gain * gain * (rows_ / cols if rows_ > cols else 1.0)
    if keff and lay.kind == "conv":
        b2 *= lay.k2 / keff
    std, rule = math.sqrt(b2), "orthogonal"
    why = (f"GNE orthogonal: beta = {std:.4g} (gain {gain:.4g}, Table 5"
           + (f"; x sqrt({rows_}/{cols}) for an expanding shape" if rows_ > cols
              else "")
           + (f"; x sqrt(k/k~) = sqrt({lay.k2}/{keff:.4g})" if keff and
              lay.kind == "conv" and keff != lay.k2 else "") + f"); {gsrc}")
    return std, rule, why


def uncovered_rows(graph: Graph, plan: Plan) -> list[dict[str, Any]]:
    """Report rows for the weighted nodes the plan has no layer for."""
    in_plan = {lay.node for lay in plan.layers}
    return [{"node": n.name, "kind": n.kind,
             "action": "not covered: not a plain conv/linear weight of the plan "
                       "(parametrized, attention or recurrent weights keep the "
                       "core plan's init)"}
            for n in graph if n.status == "weighted" and n.name not in in_plan]
