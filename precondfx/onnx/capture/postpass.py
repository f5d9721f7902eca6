"""Passes over the built nodes: the bias ``Add`` after a MatMul layer, and ``nn.MultiheadAttention``'s
packed ``in_proj`` (planned as k maps of n_out/k outputs, as on the PyTorch path)."""
from __future__ import annotations

from typing import Callable

import onnx_ir as ir

from precondfx.core.graph import Node
from precondfx.onnx.capture.attrs import _SHAPE_OPS
from precondfx.onnx.capture.scopes import _meta_list
from precondfx.onnx.io import FLOAT_TYPES


def _matmul_biases(nodes: list[Node], ir_nodes: dict[str, ir.Node], inits: dict,
                   params: dict, add_param: Callable, views: dict | None = None) -> None:
    """MatMul(x, W) (or x @ W.T, a linear without bias) followed by Add(., b) with b an
    initializer (or a view of one): b is the layer's bias."""
    views = views or {}
    by_name = {n.name: n for n in nodes}
    for n in nodes:
        if n.kind not in ("matmul", "linear") or "weight" not in n.params \
                or "bias" in n.params:
            continue
        out = ir_nodes[n.name].outputs[0]
        uses = list(out.uses())
        if len(uses) != 1 or out.is_graph_output():
            continue
        user = uses[0].node
        if user.op_type != "Add" or user.name not in by_name:
            continue
        other = user.inputs[1 - uses[0].idx] if len(user.inputs) == 2 else None
        other = views.get(id(other), other) if other is not None else None  # Cast(b16)...
        if other is None or other.name not in inits or other.dtype not in FLOAT_TYPES:
            continue
        add_param(other)
        n.params["bias"] = other.name
        add_node = by_name[user.name]
        if other.name not in add_node.params.values():
            add_node.params[f"operand{len(add_node.params)}"] = other.name


_PASS = ("Unsqueeze", "Squeeze", "Transpose", "Identity")


def _packed_projections(nodes: list[Node], ir_nodes: dict[str, ir.Node],
                        shape_of: Callable[[ir.Value | None], tuple[int, ...] | None]) -> None:
    """``nn.MultiheadAttention``'s packed ``in_proj``: a linear/matmul layer of that module
    (the dynamo exporter's class hierarchy, or torch's ``in_proj_weight``/``in_proj_bias``
    names the legacy exporter keeps) whose n_out output features are unflattened into k groups
    that are then taken apart (k scalar ``Gather``s, or a k-way ``Split``): q, k, v (k=3).
    The PyTorch path plans each as one map of n_out/k outputs (``fans.attention_fans``); the
    node's ``packed`` attribute tells ``fans.weight_fans``.  Other packed projections (timm's
    ``qkv`` Linear) are plain linears on the PyTorch path, and stay so here."""
    for n in nodes:
        if n.kind not in ("linear", "matmul") or "weight" not in n.params:
            continue
        if not _from_mha(ir_nodes[n.name], n):
            continue
        v = ir_nodes[n.name].outputs[0]
        shape = shape_of(v)
        if not shape:
            continue
        n_out = shape[-1]
        uses = _data_uses(v)
        if len(uses) == 1 and uses[0].node.op_type == "Add" and not v.is_graph_output():
            v = uses[0].node.outputs[0]          # the bias
            uses = _data_uses(v)
        if len(uses) != 1 or uses[0].node.op_type != "Reshape":
            continue
        r = uses[0].node.outputs[0]
        rs = shape_of(r)           # None when the target shape is computed (legacy exporter)
        if rs is not None and (len(rs) < 2 or rs[-1] * rs[-2] != n_out):
            continue
        w = r
        for _ in range(8):
            us = _data_uses(w)
            if len(us) == 1 and us[0].node.op_type in _PASS:
                w = us[0].node.outputs[0]
                continue
            break
        users = [u.node for u in _data_uses(w)]
        picks = sorted(i for i in (_scalar_index(u) for u in users) if i is not None)
        k = rs[-2] if rs is not None else len(picks)
        if k not in (2, 3, 4) or n_out % k:
            continue
        split = [u for u in users if u.op_type == "Split" and len(u.outputs) == k]
        if (picks == list(range(k)) and len(users) == k) or (len(users) == 1 and split):
            n.attrs["packed"] = k


def _from_mha(node: ir.Node, n: Node) -> bool:
    """Whether the exporter says the layer belongs to a ``torch.nn.MultiheadAttention``."""
    cls = _meta_list(node, "pkg.torch.onnx.class_hierarchy") or []
    if any(c.rpartition(".")[2] == "MultiheadAttention" for c in cls):
        return True
    return any(p.rpartition(".")[2] in ("in_proj_weight", "in_proj_bias")
               for p in n.params.values())


def _data_uses(v: ir.Value) -> list:
    """The uses of ``v`` that read its values (not ``Shape``/``Size``, which read its shape)."""
    return [u for u in v.uses() if u.node.op_type not in _SHAPE_OPS]


def _scalar_index(node: ir.Node) -> int | None:
    """The constant scalar index of a ``Gather`` (``x[i]`` along one axis), else None."""
    if node.op_type != "Gather" or len(node.inputs) != 2 or node.inputs[1] is None:
        return None
    idx = node.inputs[1]
    t = idx.const_value
    prod = idx.producer()
    if t is None and prod is not None and prod.op_type == "Constant":
        a = prod.attributes.get("value")
        t = a.as_tensor() if a is not None and a.type == ir.AttributeType.TENSOR else None
        if t is None and prod.attributes.get("value_int") is not None:
            return int(prod.attributes["value_int"].as_int())
    if t is None or tuple(t.shape) != ():
        return None
    return int(t.numpy())
