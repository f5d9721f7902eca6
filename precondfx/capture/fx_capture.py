"""Capture with ``torch.fx.symbolic_trace``: the only method whose result is itself editable.

Leaf modules of ``torch.nn`` (Conv2d, Linear, BatchNorm...) stay ``call_module`` nodes; user
modules are traced through.  Shapes come from running the traced module on the sample
(``ShapeProp``).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from precondfx import optable
from precondfx.calibrate import is_stochastic
from precondfx.capture.common import (Act, Const, Param, Sample, build_node, leaves,
                                      shape_of, target_name)
from precondfx.graph import Graph, Node


class _Tracer(fx.Tracer):
    """fx's tracer, with stochastic modules (DropPath, StochasticDepth...) kept as leaves: traced
    through, their ``if self.training`` would be frozen into the graph in the trace's mode."""

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return is_stochastic(m) or super().is_leaf_module(m, qualname)


_FUNCTIONAL_DROPOUT = {F.dropout: nn.Dropout, F.dropout1d: nn.Dropout1d,
                       F.dropout2d: nn.Dropout2d, F.dropout3d: nn.Dropout3d,
                       F.alpha_dropout: nn.AlphaDropout}


def trace(model: torch.nn.Module, sample: Sample) -> fx.GraphModule:
    """Symbolically trace ``model``; non-tensor keyword inputs become concrete arguments.

    Functional dropout calls (``F.dropout(x, p, training=self.training)``) are traced with the
    trace-time mode frozen in; they are replaced by dropout modules so that the result still
    switches between train and eval."""
    concrete = {k: v for k, v in sample.kwargs.items() if not isinstance(v, torch.Tensor)}
    tracer = _Tracer()
    graph = tracer.trace(model, concrete_args=concrete or None)
    name = model.__class__.__name__ if isinstance(model, torch.nn.Module) else "module"
    gm = fx.GraphModule(tracer.root, graph, name)
    count = 0
    for n in list(gm.graph.nodes):
        cls = _FUNCTIONAL_DROPOUT.get(n.target) if n.op == "call_function" else None
        if cls is None:
            continue
        p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
        if not isinstance(p, (int, float)):
            continue
        path = f"precondfx_dropout_{count}"
        count += 1
        gm.add_submodule(path, cls(float(p)))
        with gm.graph.inserting_before(n):
            new = gm.graph.call_module(path, (n.args[0] if n.args else n.kwargs["input"],))
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
    if count:
        gm.recompile()
    return gm


def run_shape_prop(gm: fx.GraphModule, sample: Sample) -> None:
    """Record every node's output shape by running ``gm`` on the sample (placeholders in order)."""
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    values: list[Any] = list(sample.args)
    for nm in names[len(values):]:
        nm_clean = nm.lstrip("*")
        if nm_clean in sample.kwargs:
            values.append(sample.kwargs[nm_clean])
        else:
            values.append(_default_of(gm, nm_clean))
    ShapeProp(gm).propagate(*values)


def _default_of(gm: fx.GraphModule, name: str) -> Any:
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.target == name and n.args:
            return n.args[0]
    return None


def _marker(a: Any, gm: fx.GraphModule) -> Any:
    if isinstance(a, fx.Node):
        if a.op == "get_attr":
            return Param(str(a.target))
        return Act(a.name)
    if isinstance(a, (list, tuple)):
        return type(a)(_marker(x, gm) for x in a)
    if isinstance(a, dict):
        return {k: _marker(v, gm) for k, v in a.items()}
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return Const(a)
    return a


def to_graph(gm: fx.GraphModule) -> Graph:
    """Convert a traced (and shape-propagated) GraphModule into the neutral graph."""
    nodes: list[Node] = []
    module_calls: dict[str, int] = {}
    outputs: list[str] = []
    for n in gm.graph.nodes:
        meta = n.meta.get("tensor_meta")
        out_shape = shape_of(meta) if hasattr(meta, "shape") else None
        in_shapes = [shape_of(a.meta.get("tensor_meta")) if isinstance(a, fx.Node) else None
                     for a in n.args]
        args = [_marker(a, gm) for a in n.args]
        kwargs = {k: _marker(v, gm) for k, v in n.kwargs.items()}
        if n.op == "placeholder":
            nodes.append(Node(n.name, "input", f"input {n.target}", out_shape=out_shape))
        elif n.op == "get_attr":
            continue  # parameters appear as Param operands of their users
        elif n.op == "output":
            outs: list = []
            _flatten_nodes(n.args, outs)
            outputs = [o.name for o in outs if o.op != "get_attr"]
            nodes.append(Node(n.name, "output", "output", inputs=outputs))
        elif n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            idx = module_calls.get(str(n.target), 0)
            module_calls[str(n.target)] = idx + 1
            spec = optable.for_module(mod)
            nodes.append(build_node(n.name, spec, f"{type(mod).__module__}.{type(mod).__name__}",
                                    args, kwargs, module=str(n.target), module_obj=mod,
                                    call_index=idx, out_shape=out_shape, in_shapes=in_shapes))
        elif n.op == "call_function":
            spec = optable.for_function(n.target)
            nodes.append(build_node(n.name, spec, target_name(n.target), args, kwargs,
                                    out_shape=out_shape, in_shapes=in_shapes))
        elif n.op == "call_method":
            spec = optable.for_method(str(n.target))
            nodes.append(build_node(n.name, spec, f"Tensor.{n.target}", args, kwargs,
                                    out_shape=out_shape, in_shapes=in_shapes))
    return Graph(nodes, "fx", outputs=outputs)


def _flatten_nodes(a: Any, out: list) -> None:
    out.extend(x for x in leaves(a) if isinstance(x, fx.Node))


def forward_signature(model: torch.nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
