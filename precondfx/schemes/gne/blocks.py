"""The blocks of the BDI criterion: the activation that follows each weighted layer (found through
the graph's users, also used by the wn scheme), its gain ``c = 1/sqrt(phi_act)`` (Tables 4-6),
and the effective kernel size of a convolution at its input size (A.2.7)."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from precondfx.core.graph import Graph, Node
from precondfx.core.plan import Layer, Plan
from precondfx.errors import PrecondError
from precondfx.schemes.activations import get_activation, parametrized_activation
from precondfx.core.fans import effective_kernel_size
from precondfx.schemes.gne.gains import gne_gain
from precondfx.schemes.gne.moments import pointwise_moments

#: kinds that are activations (the end of a "layer + activation" block)
ACTIVATION_KINDS = ("relu", "leaky_relu", "prelu", "exp_linear", "saturating", "smooth_gate",
                    "clipped_relu")
#: kinds the search for a layer's activation walks through (elementwise-linear or
#: scale-resetting ops that sit between a layer and its activation)
_PASS = ("dropout", "reshape", "cast", "normalization", "maxpool", "avgpool", "pad", "select")

#: smooth activations (A.2.6 extension: phi = E[f'(x)^2]); torch callables for the derivative
_SMOOTH: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "elu": F.elu, "celu": F.celu, "gelu": F.gelu, "silu": F.silu, "mish": F.mish,
    "softplus": F.softplus, "hardswish": F.hardswish, "softsign": F.softsign,
}


def following_activation(graph: Graph, name: str, users: dict[str, list[str]] | None = None
                         ) -> tuple[Node | None, list[str], str]:
    """The activation node that consumes layer ``name``'s output, found through the graph's
    users across elementwise-linear ops; ``(node or None, nodes walked through, note)``."""
    users = graph.users() if users is None else users
    cur, path = name, []
    while True:
        us = users.get(cur, [])
        if len(us) != 1:
            return None, path, ("its output has no user" if not us else
                                f"its output has {len(us)} users ({', '.join(us[:3])}): no "
                                f"single activation follows")
        nxt = graph[us[0]]
        if nxt.kind in ACTIVATION_KINDS:
            note = ""
            if any(graph[p].kind == "normalization" for p in path):
                note = ("a normalization layer sits between the layer and its activation: it "
                        "resets the scale (Prop. 5.6), so the gain hardly matters")
            return nxt, path, note
        bias_like = nxt.kind in ("add", "sub", "mul") and len(nxt.inputs) == 1
        if nxt.kind in _PASS or bias_like:
            path.append(nxt.name)
            cur = nxt.name
            continue
        return None, path, f"followed by {nxt.kind} ({nxt.name}), not an activation: linear"


#: gne activation name -> the shared registry's (``F.gelu`` is the exact, erf form)
_REGISTRY_NAME = {"gelu": "gelu_exact", "silu": "swish"}


def _smooth_phi(name: str, var: float = 1.0, params: dict | None = None) -> float:
    """``E[f'(x)^2]`` at ``x ~ N(0, var)`` for a smooth activation (A.2.6 extension), from the
    shared activation registry's analytic derivative (at the activation's ``params``: ELU/CELU
    alpha, Softplus beta/threshold, GELU's tanh form)."""
    act = (parametrized_activation(name, params) if params else
           get_activation(_REGISTRY_NAME.get(name, name)))
    return pointwise_moments(act.d1, var, breaks=act.kinks).phi


def activation_gain(name: str, slope: float | None, gamma0: float = 1.0,
                    params: dict | None = None) -> tuple[float, str]:
    """BDI gain ``c = 1/sqrt(phi_act)`` (Tables 4-6) and where it comes from; ``params``: the
    activation's parameters that differ from torch's defaults
    (``precondfx.schemes.activations.activation_params``)."""
    if name in ("linear", "tanh"):
        return 1.0, f"{name}: phi_act = 1 (Table 3/4), gain 1"
    if name in ("relu", "prelu", "leaky_relu", "selu"):
        g = gne_gain(name, slope=slope, gamma0=gamma0)
        if name == "relu":
            src = "ReLU phi_act = 1/2 (Table 3), gain sqrt 2"
        elif name == "prelu":
            src = "PReLU: gain sqrt 2 as in the authors' code (its slope is trainable)"
        elif name == "leaky_relu":
            src = (f"leaky ReLU slope {slope:g}: phi_act = (1+slope^2)/2 (Table 3), gain "
                   f"sqrt(2/(1+slope^2))")
        else:
            src = f"SELU: linear layer phi = gamma0 = {gamma0:g} (eq. 32), gain sqrt(gamma0)"
        return g, src
    if name in _SMOOTH:
        phi = _smooth_phi(name, params=params)
        at = "".join(f", {k}={v}" for k, v in (params or {}).items())
        return 1.0 / math.sqrt(phi), (f"{name}{at}: phi_act = E[f'(x)^2] = {phi:.4g} at x ~ "
                                      f"N(0,1) "
                                      f"(components-table extension, A.2.6 [DERIVED])")
    if name == "relu6":
        return math.sqrt(2.0), "ReLU6: a ReLU at initialization scales, gain sqrt 2"
    return 1.0, f"{name}: not in the components table (A.2.6): gain 1, phi not guaranteed"


def conv_effective_k(graph: Graph, plan: Plan, lay: Layer, shape: tuple[int, ...]
                     ) -> tuple[float, str]:
    """Effective kernel size ``k~`` (A.2.7) of a convolution layer at its input size."""
    k = math.prod(shape[2:]) if len(shape) > 2 else 1
    node = graph.get(lay.node)
    pc = next((p for p in plan.pools if p.node == lay.node and p.action == "conv"), None)
    if pc is not None:  # a max-pool replaced by a strided conv of the pool's geometry
        geo = pc.geometry
        size, kern, stride = geo["in_shape"][2:], geo["kernel"], geo["stride"]
        pad, dil, mode = geo["padding"], geo["dilation"], "zeros"
    else:
        a = node.attrs if node is not None else {}
        size = node.in_shapes[0][2:] if node is not None and node.in_shapes and \
            node.in_shapes[0] is not None else None
        kern = tuple(shape[2:])
        stride, pad = a.get("stride", 1) or 1, a.get("padding", 0)
        dil, mode = a.get("dilation", 1) or 1, a.get("padding_mode", "zeros") or "zeros"
    if not size or len(size) != len(shape) - 2:
        return float(k), "input size unknown: nominal kernel size"
    try:
        keff = effective_kernel_size(tuple(int(s) for s in size), tuple(int(x) for x in kern),
                                       stride, pad, dil, mode)
    except PrecondError as e:
        return float(k), f"effective kernel size not computable ({e}): nominal"
    return keff, f"effective kernel size {keff:.4g} of {k} taps at input {list(size)} (A.2.7)"

