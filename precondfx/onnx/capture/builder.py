"""One capture pass: the graph's inputs, every ONNX node as a neutral node (its call, module
path and activation slots), the output node, and the result, :class:`Captured`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

from precondfx.core import optable
from precondfx.core.graph import Graph, Node
from precondfx.core.nodes import Param, build_node
from precondfx.core.plan import ParamInfo
from precondfx.onnx.capture.attrs import _SHAPE_OPS, _constant_lookup
from precondfx.onnx.capture.ops import _Call, annotate, call_of
from precondfx.onnx.capture.postpass import _matmul_biases, _packed_projections
from precondfx.onnx.capture.scopes import _Modules
from precondfx.onnx.capture.values import Values
from precondfx.onnx.io import FLOAT_TYPES, real_inputs
from precondfx.onnx.normalize import NormalizeInfo


@dataclass
class Captured:
    """The neutral graph plus what the ONNX back end needs to find things again."""

    graph: Graph
    params: dict[str, ParamInfo]
    nodes: dict[str, ir.Node]                       # neutral node name -> ONNX node
    act_index: dict[str, list[int]]                 # neutral node -> ONNX input slots of acts
    input_nodes: dict[str, ir.Value]                # neutral input node -> graph input
    dtypes: dict[str, int] = field(default_factory=dict)    # value name -> onnx elem type
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # as in the file
    #: parameter -> what applies its gain (``graph.gains``: a Gemm's alpha, a ``Mul`` by a
    #: constant), for the report
    gain_why: dict[str, str] = field(default_factory=dict)


class _Builder:
    """The state of one :func:`to_graph` pass: the neutral nodes built so far, the ONNX node and
    activation slots of each, module calls; what is known about the values is in ``vals``."""

    def __init__(self, model: ir.Model, shapes: dict[str, tuple], symbolic: set[str],
                 norm: NormalizeInfo | None) -> None:
        self.model, self.g = model, model.graph
        self.vals = Values(self.g.initializers, shapes, symbolic,
                           norm.lifted if norm is not None else set())
        self.modules = _Modules(model)
        self.nodes: list[Node] = []
        self.ir_nodes: dict[str, ir.Node] = {}
        self.act_index: dict[str, list[int]] = {}
        self.input_nodes: dict[str, ir.Value] = {}
        self.taken: set[str] = {n.name for n in self.g if n.name}
        self.module_calls: dict[str, int] = {}

    # -- the graph's inputs and outputs ---------------------------------------------------------
    def add_inputs(self) -> None:
        vals = self.vals
        for spec_in in real_inputs(self.model):
            v = next(x for x in self.g.inputs if x.name == spec_in.name)
            name = spec_in.name if spec_in.name not in self.taken else f"input:{spec_in.name}"
            self.taken.add(name)
            self.nodes.append(Node(name, "input", f"input {spec_in.name}",
                                   out_shape=vals.shape_of(v),
                                   attrs={} if v.dtype is None or v.dtype in FLOAT_TYPES
                                   else {"integer": True}))
            self.input_nodes[name] = v
            vals.producer[id(v)] = name
            vals.data.add(id(v))

    def captured(self) -> Captured:
        """The output node, and everything collected as a :class:`Captured`."""
        vals = self.vals
        _matmul_biases(self.nodes, self.ir_nodes, vals.inits, vals.params, vals.add_param,
                       vals.views)
        _packed_projections(self.nodes, self.ir_nodes, vals.shape_of)
        outs: list[str] = []
        read: dict[str, str] = {}       # parameters the graph returns (as is, or derived)
        for i, o in enumerate(self.g.outputs):
            src = vals.producer.get(id(o))
            if src is not None and src not in outs:
                outs.append(src)
            pname = vals.derived.get(id(o), o.name)
            if pname in vals.params:
                read[f"output{i}"] = pname
        out_name = "output" if "output" not in self.taken else "output:graph"
        self.nodes.append(Node(out_name, "output", "output", inputs=outs, params=read))
        gains = _gains(vals)
        return Captured(Graph(self.nodes, "onnx", outputs=outs, gains=gains["gains"]),
                        vals.params, self.ir_nodes, self.act_index, self.input_nodes,
                        dtypes={k: v[1] for k, v in vals.shapes.items()},
                        param_shapes=vals.param_shapes, gain_why=gains["why"])

    # -- one node -------------------------------------------------------------------------------
    def add_node(self, node: ir.Node) -> None:
        vals = self.vals
        ins = list(node.inputs)
        implicit = [v for v in _subgraph_reads(node) if vals.carries(v)]
        is_data = node.op_type not in _SHAPE_OPS and any(vals.carries(v) for v in ins + implicit)
        if not is_data and _constant_lookup(node, ins, vals.is_param):
            is_data = True      # an embedding read at constant ids (positions, token types)
        if not is_data:   # computed from constants and shapes only
            spec = optable.BY_KIND["constant"]
        elif node.domain in ("", "ai.onnx", "com.microsoft"):
            spec = optable.for_onnx(node.op_type)
        else:
            spec = None
        target = node.op_type if node.domain in ("", "ai.onnx") else \
            f"{node.domain}::{node.op_type}"
        if not is_data:
            vals.note_view(node, ins)
            vals.note_derived(node, ins)
        call = call_of(vals, node, ins) if is_data else _Call([vals.marker(v) for v in ins])
        # the activations an If branch or a Loop/Scan body reads from this graph: operands
        # without an ONNX input slot (a scale planned on one is reported as not placed)
        call.args += [vals.marker(v) for v in dict.fromkeys(implicit)]
        if call.kind is not None:
            spec = optable.BY_KIND[call.kind]
        kind = spec.kind if spec is not None else "unknown"
        mod, call_index = self.module_of(node, spec, kind, call.args)
        nn_ = build_node(node.name, spec, target, call.args, call.kwargs, module=mod,
                         call_index=call_index, out_shape=vals.shape_of(
                             node.outputs[0] if node.outputs else None),
                         in_shapes=[vals.shape_of(v) for v in ins])
        annotate(nn_, node, kind, call)
        self.act_index[node.name] = self.act_slots(ins, nn_)
        self.nodes.append(nn_)
        self.ir_nodes[node.name] = node
        for o in node.outputs:
            vals.producer[id(o)] = node.name
            if is_data:
                vals.data.add(id(o))

    def module_of(self, node: ir.Node, spec: Any, kind: str, args: list[Any]
                  ) -> tuple[str | None, int]:
        """The module path of a node, and which call of that module it is."""
        if spec is None or kind in ("constant", "unknown"):
            return None, 0
        w = None
        if kind in ("conv", "conv_transpose", "linear", "embedding", "matmul"):
            w = next((a.name for a in args if isinstance(a, Param)), None)
        mod = self.modules.of(node, kind, w)
        if kind == "maxpool" and mod and f"{mod}.weight" in self.vals.inits:
            mod = None
        if not mod:
            return mod, 0
        call_index = self.module_calls.get(mod, 0)
        self.module_calls[mod] = call_index + 1
        return mod, call_index

    def act_slots(self, ins: list, nn_: Node) -> list[int]:
        """ONNX input slots of the activation operands, in the order build_node listed them."""
        vals = self.vals
        slots: list[int] = []
        seen: list[str] = []
        for i, v in enumerate(ins):
            if vals.carries(v) and vals.producer[id(v)] not in seen:
                seen.append(vals.producer[id(v)])
                slots.append(i)
        return [slots[seen.index(src)] for src in nn_.inputs if src in seen]


def _gains(vals: Any) -> dict[str, dict]:
    """The factor each layer multiplies its weight by (a Gemm's ``alpha`` times the constant
    factors of its weight's views: ``graph.gains``, which the plan divides), and what applies
    it."""
    gains = dict(vals.gains)
    why = {n: f"alpha={a:.4g} of its Gemm, which applies alpha*W" for n, a in gains.items()}
    for n, (f, by) in vals.scaled.items():
        gains[n] = gains.get(n, 1.0) * f
        what = f"{by}, which multiplies it by {f:.4g} before its layer reads it"
        why[n] = f"{what}; {why[n]}" if n in why else what
    return {"gains": gains, "why": why}


def _subgraph_reads(node: ir.Node) -> list[ir.Value]:
    """The values the subgraphs of ``node`` (If branches, Loop and Scan bodies, nested) read,
    by name from the enclosing graphs included: onnx-ir gives an outer value read inside a
    subgraph as the outer value itself."""
    out: list[ir.Value] = []
    for attr in node.attributes.values():
        graphs = [attr.as_graph()] if attr.type == ir.AttributeType.GRAPH else \
            list(attr.as_graphs()) if attr.type == ir.AttributeType.GRAPHS else []
        for g in graphs:
            for inner in ir.traversal.RecursiveGraphIterator(g):
                out.extend(v for v in inner.inputs if v is not None)
    return out


def to_graph(model: ir.Model, shapes: dict[str, tuple], symbolic: set[str],
             norm: NormalizeInfo | None = None) -> Captured:
    """Build the neutral graph; ``shapes`` from :func:`infer_shapes`, ``symbolic``: names of
    values whose spatial dims depend on symbolic input dims."""
    b = _Builder(model, shapes, symbolic, norm)
    b.add_inputs()
    for node in model.graph:
        b.add_node(node)
    return b.captured()

