"""Activation replacement (spec §3.3): every activation on the data path becomes the solved TReLU
or transformed activation module, one module per hooked module path (shared by the nodes that
call it), a fresh one per functional call."""
from __future__ import annotations

import re
from typing import Any, Callable

from torch import nn

from precondfx.core.graph import Graph, Node
from precondfx.core.plan import ParamInfo
from precondfx.pytorch.modules import (ScaledLeakyReLU, ScaledPReLU, TransformedActivation,
                                       TransformedLeakyReLU)
from precondfx.schemes.tat.analysis import Analysis
from precondfx.schemes.tat.local_maps import ActivationTransform
from precondfx.schemes.tat.trelu import TReLUParams

# activation name in the maths -> precondfx.pytorch.modules.TransformedActivation name
_TORCH_NAME = {"tanh": "tanh", "sigmoid": "sigmoid", "softplus": "softplus", "gelu_exact": "gelu",
               "gelu": "gelu_tanh", "swish": "silu", "elu": "elu", "selu": "selu",
               "softsign": "softsign", "relu": "relu"}


def _safe(name: str) -> str:
    return re.sub(r"[^0-9a-zA-Z_]", "_", name)


class Replacements:
    """The replacements a scheme plans: ``items`` (node, module, module path) as
    :meth:`Scheme.replacements` returns them, and ``reasons`` (node -> what the plan does there)."""

    def __init__(self, scheme: str) -> None:
        self.scheme = scheme
        self.items: list[tuple[str, nn.Module, str]] = []
        self.reasons: dict[str, str] = {}

    def add(self, n: Node, make: Callable[[], nn.Module], shared: dict[str, nn.Module],
            what: str) -> None:
        """Replace node ``n`` by ``make()`` (the module its module path already got, if any)."""
        if n.module:
            mod = shared.get(n.module)
            if mod is None:
                mod = shared[n.module] = make()
            path = n.module
        else:
            mod, path = make(), f"precondfx_{self.scheme}_{_safe(n.name)}"
        self.items.append((n.name, mod, path))
        self.reasons[n.name] = f"{self.scheme}: replaced by {what}"


def add_trelu(repl: Replacements, graph: Graph, an: Analysis, params: dict[str, ParamInfo],
              p: TReLUParams, eta: float) -> None:
    """Every ReLU-family activation becomes the TReLU ``g*leaky_relu(x, a)`` (a PReLU keeps its
    parameter count, starting at the slope a)."""
    a, g = p.negative_slope, p.output_scale
    shared: dict[str, nn.Module] = {}
    for v in an.activations:
        n = graph[v]
        if an.act_names[v] == "prelu":
            w = n.params.get("weight")
            num = int(params[w].shape[0]) if w and w in params and params[w].shape else 1
            make: Callable[[], nn.Module] = lambda num=num: ScaledPReLU(num, a, g)
        else:
            make = lambda: ScaledLeakyReLU(a, g)  # noqa: E731
        repl.add(n, make, shared, f"TReLU {g:.4g}*leaky_relu(x, {a:.6g}) (TAT, eta={eta})")


def transforms_info(sol: dict[str, ActivationTransform]) -> dict[str, dict[str, Any]]:
    """The solved constants per activation name, as the report shows them."""
    return {k: {"alpha": t.input_scale, "beta": t.input_shift,
                "gamma": t.output_scale, "delta": t.output_shift,
                **({"negative_slope": t.negative_slope}
                   if t.negative_slope is not None else {})}
            for k, t in sol.items()}


def add_transformed(repl: Replacements, graph: Graph, an: Analysis,
                    sol: dict[str, ActivationTransform], method: str) -> None:
    """Every activation becomes its solved ``gamma*(phi(alpha*x+beta)+delta)``."""
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
        repl.add(graph[v], make, shared,
                 f"{t.output_scale:.4g}*({t.name}({t.input_scale:.4g}x"
                 f"{t.input_shift:+.4g}){t.output_shift:+.4g}) ({method})")
