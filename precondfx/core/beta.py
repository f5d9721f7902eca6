"""App. E's per-block conditioning multipliers beta_l, planned from the residual joins.

With a branch scale ``s_l`` that changes from block to block, App. E multiplies every
convolution of block ``l``'s branch by ``1/beta_l`` (the middle 3x3 convolution of a bottleneck
also by its kernel alpha ``1/sqrt(3)``, which ``balance='analytic'`` plans), with

    beta_l^2 = beta_{l-1}^2 (1 + s_l^2) / (1 + s_{l-1}^2),     beta_0 = 1 at the first block,

and initializes each such weight with its geometric std times ``beta_l``, so that the forward
pass at initialization is what geometric init gives without the constant.  A flat ``s`` gives
every ``beta_l = 1`` (nothing is inserted).

App. E's block is a chain: convolution, ReLU, convolution, ..., the last convolution's output
scaled by ``s`` and added to the stream.  A join whose branch is not such a chain (a
normalization, a non-homogeneous activation, a fork or merge inside the branch, a frozen or
shared weight) keeps ``beta = 1``, and the plan says why (``Residual.beta_reason``); the
recurrence runs over the joins that match, in execution order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from precondfx.core.graph import Graph

#: layers a branch chain may hold (App. E: convolutions; a linear layer is a 1x1 convolution)
CHAIN_LAYERS = ("conv", "linear")
#: elementwise positively homogeneous ops a chain may pass through (Table 1)
CHAIN_OPS = ("relu", "leaky_relu", "prelu", "dropout")


@dataclass
class Join:
    """What the beta planning needs of one residual join."""

    residual: Any            # the plan's Residual record (beta and beta_reason are set here)
    operand: str             # the node the branch ends in (the join's scaled operand)


def recurrence(s: Sequence[float], beta0: float = 1.0) -> list[float]:
    """beta_l for branch scales ``s`` (App. E), starting from ``beta0`` at the first block."""
    out: list[float] = []
    for i, x in enumerate(s):
        out.append(beta0 if i == 0 else
                   out[-1] * math.sqrt((1.0 + x * x) / (1.0 + s[i - 1] ** 2)))
    return out


def chain_reason(graph: Graph, users: dict[str, list[str]], fork: str, operand: str,
                 layers: dict[str, Any], weight_uses: dict[str, int],
                 trainable: dict[str, bool]) -> str | None:
    """Why the branch from ``fork`` to ``operand`` is not App. E's block (a chain of
    convolutions through elementwise homogeneous ops, every node used once); None if it is."""
    cur, convs = operand, 0
    while cur != fork:
        n = graph.get(cur)
        if n is None:
            return f"{cur} is not in the captured graph"
        if len(users.get(cur, [])) != 1:
            return f"{cur} has {len(users.get(cur, []))} users: the branch is not a chain"
        if n.kind in CHAIN_LAYERS and n.status == "weighted":
            lay = layers.get(cur)
            if lay is None or not lay.weight:
                return f"{cur} ({n.kind}) has no planned weight"
            if weight_uses.get(lay.weight, 0) != 1:
                return f"the weight {lay.weight} of {cur} is used at more than one call site"
            if not trainable.get(lay.weight, True):
                return f"the weight {lay.weight} of {cur} is frozen"
            convs += 1
        elif n.kind not in CHAIN_OPS:
            return (f"{cur} ({n.kind}) is neither a convolution nor an elementwise positively "
                    f"homogeneous op")
        if len(n.inputs) != 1:
            return f"{cur} reads {len(n.inputs)} activations: the branch is not a chain"
        cur = n.inputs[0]
    return None if convs else "the branch holds no convolution"


def plan_betas(graph: Graph, plan: Any, joins: list[Join], flat: bool,
               trainable: dict[str, bool]) -> None:
    """Set ``beta``/``beta_reason`` on each join's Residual and ``beta`` on its branch's
    layers (``plan.layers``)."""
    users = graph.users()
    layers = {lay.node: lay for lay in plan.layers}
    uses: dict[str, int] = {}
    for lay in plan.layers:
        if lay.weight:
            uses[lay.weight] = uses.get(lay.weight, 0) + 1
    matching: list[Join] = []
    for j in joins:
        r = j.residual
        if r.s is None:
            r.beta, r.beta_reason = 1.0, "beta = 1: no branch scale s at this join"
            continue
        if flat:
            r.beta, r.beta_reason = 1.0, "beta = 1: flat s (App. E: beta_l = 1 for all l)"
            continue
        why = chain_reason(graph, users, r.fork, j.operand, layers, uses, trainable)
        if why is not None:
            r.beta, r.beta_reason = 1.0, (f"beta = 1: the branch is not App. E's block (a chain "
                                          f"of convolutions): {why}")
            continue
        matching.append(j)
    betas = recurrence([j.residual.s for j in matching])
    prev: Any = None
    for j, b in zip(matching, betas):
        r = j.residual
        r.beta = b
        r.beta_reason = ("beta_1 = 1 (first block matching App. E)" if prev is None else
                         f"beta^2 = {prev.beta:.6g}^2 (1+{r.s:.4g}^2)/(1+{prev.s:.4g}^2) "
                         f"(App. E)")
        for name in r.branch_layers:
            if name in layers:
                layers[name].beta = b
        prev = r
