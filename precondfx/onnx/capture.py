"""ONNX graph -> the front-end neutral :class:`~precondfx.core.graph.Graph`.

Every ONNX node is looked up in the one op table (``optable.for_onnx``) and described with the
same operand markers the PyTorch capture methods use (``Act``, ``Param``, ``Const``), then turned
into a neutral node by ``capture.common.build_node``, so attributes are parsed as for a
functional PyTorch call: ONNX ``kernel_shape``/``strides``/``pads``/``dilations``/``group`` become
``kernel_size``/``stride``/``padding``/``dilation``/``groups``.

* ``Gemm`` with ``transB=1`` and a weight initializer is a ``linear`` layer (weight ``(out, in)``);
  ``Gemm`` with ``transB=0`` and ``MatMul`` with an initializer operand are ``matmul`` layers with
  ``weight_side`` (the side whose fans apply); an ``Add`` of an initializer right after such a
  ``MatMul`` is its bias; ``Gather`` of rows of a float initializer is an ``embedding``.
* Parameters are the float initializers (scalars and constants lifted from ``Constant`` nodes are
  constants unless they sit in a weight or bias slot); BatchNormalization's running statistics
  are buffers, not parameters.
* Values computed only from constants and shapes (``Shape`` -> ``Gather`` -> ``Concat``...) are
  constants: they do not make a join of two activations.
* Module paths are recovered from the exporters' metadata (dynamo: ``name_scopes`` and
  ``class_hierarchy``; TorchScript: ``/layer1/layer1.0/conv1/Conv`` node names; else the weight's
  name), so plans name the same parameters as on the PyTorch path.
* Shapes come from ONNX shape inference with the symbolic dims bound to the calibration sizes
  (``bindings``); a second inference with other sizes tells which spatial dims are symbolic: the
  max-pool fold is refused there (it only matches the pool's output size for some sizes).
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import onnx
import onnx_ir as ir

from precondfx.core import optable
from precondfx.core.nodes import Act, Const, Param, build_node
from precondfx.core.graph import Graph, Node
from precondfx.onnx.io import FLOAT_TYPES, real_inputs
from precondfx.onnx.normalize import NormalizeInfo
from precondfx.core.plan import ParamInfo

_NORM_OPS = {"BatchNormalization", "LayerNormalization", "GroupNormalization",
             "InstanceNormalization", "RMSNormalization", "SimplifiedLayerNormalization"}
_SHAPE_OPS = {"Shape", "Size"}
#: ops that pass a weight on with another layout or dtype: ``MatMul(x, Transpose(W))`` (the
#: dynamo exporter without its optimizer), ``Gemm(x, Cast(W_fp16))`` (mixed-precision
#: exports), a reshaped or squeezed kernel; the layer's weight is the initializer they read
_VIEW_OPS = {"Identity", "Cast", "CastLike", "Transpose", "Reshape", "Squeeze", "Unsqueeze",
             "Flatten"}
_BIG = 1024  # initializers larger than this (bytes) are stripped for shape inference


#: why a pool's stride is not folded into a convolution whose input has symbolic spatial dims
SYMBOLIC_NO_FOLD = ("the spatial dims are symbolic, and a folded stride matches the pool's output "
                    "size only for some input sizes")

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
    #: parameter -> the factor its layer multiplies it by (Gemm ``alpha``): a drawn weight is
    #: divided by it, so the effective weight has the planned std
    gains: dict[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# shape inference with bound dims, without copying the weights
# --------------------------------------------------------------------------------------------
def call_stripped(model: ir.Model, fn: Callable[[onnx.ModelProto], Any]) -> Any:
    """Call ``fn`` on a proto of ``model`` without the data of large initializers (they become
    typed graph inputs), so that no 2 GB limit applies and nothing is copied; the model is left
    as it was."""
    g = model.graph
    saved = list(g.initializers.values())
    n_inputs = len(g.inputs)
    removed = []
    inlined = []
    try:
        for v in saved:
            t = v.const_value
            if t is None:
                continue
            if v.shape is None:
                v.shape = ir.Shape(t.shape)
            if v.dtype is None:
                v.dtype = t.dtype
            if isinstance(t, ir.ExternalTensor) and t.nbytes <= _BIG:
                # a small tensor the file keeps external (a Reshape's shape): inference reads
                # its data, which it cannot from external data
                inlined.append((v, t))
                v.const_value = ir.tensor(t.numpy(), dtype=t.dtype, name=v.name)
                continue
            if t.nbytes > _BIG:
                if v not in g.inputs:
                    g.inputs.append(v)
                g.initializers.pop(v.name)
                removed.append((v, t))
                v.const_value = None
        proto = ir.serde.serialize_model(model)
    finally:
        for v, t in inlined:
            v.const_value = t
        for v, t in removed:
            v.const_value = t
            g.register_initializer(v)
        keep = list(g.inputs[:n_inputs])
        g.inputs.clear()
        g.inputs.extend(keep)
    return fn(proto)


def infer_shapes(model: ir.Model, bindings: dict[str, int], leading: int
                 ) -> dict[str, tuple[tuple[int | None, ...] | None, int]]:
    """value name -> (shape with the symbolic dims bound, elem type) by ONNX shape inference."""
    real = {s.name for s in real_inputs(model)}

    def fn(proto: onnx.ModelProto) -> dict:
        for inp in proto.graph.input:
            if inp.name not in real or not inp.type.HasField("tensor_type"):
                continue
            for i, d in enumerate(inp.type.tensor_type.shape.dim):
                if d.HasField("dim_value") and d.dim_value >= 0:
                    continue
                if d.HasField("dim_param") and d.dim_param in bindings:
                    d.dim_value = int(bindings[d.dim_param])
                elif i == 0:
                    d.dim_value = int(leading)
        del proto.graph.value_info[:]
        for o in proto.graph.output:
            if o.type.HasField("tensor_type"):
                o.type.tensor_type.ClearField("shape")
        try:
            inferred = onnx.shape_inference.infer_shapes(proto, check_type=False,
                                                         strict_mode=False, data_prop=True)
        except Exception:  # inference is best effort: unknown custom ops etc.
            inferred = proto
        out = {}
        for vi in list(inferred.graph.value_info) + list(inferred.graph.output) + \
                list(inferred.graph.input):
            tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
            if tt is None:
                continue
            shape = None
            if tt.HasField("shape"):
                shape = tuple(int(d.dim_value) if d.HasField("dim_value") else None
                              for d in tt.shape.dim)
            out[vi.name] = (shape, int(tt.elem_type))
        return out

    return call_stripped(model, fn)


def _static(shape: tuple[int | None, ...] | None) -> tuple[int, ...] | None:
    if shape is None or any(d is None for d in shape):
        return None
    return tuple(int(d) for d in shape)


# --------------------------------------------------------------------------------------------
# module paths
# --------------------------------------------------------------------------------------------
def _meta_list(node: ir.Node, key: str) -> list[str] | None:
    raw = node.metadata_props.get(key)
    if not raw:
        return None
    try:
        val = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return None
    return [str(x) for x in val] if isinstance(val, (list, tuple)) else None


def _legacy_scope(name: str | None) -> list[str] | None:
    """``/layer1/layer1.0/conv1/Conv`` -> full module path parts of the innermost scope."""
    if not name or not name.startswith("/"):
        return None
    segs = [s for s in name.split("/")[1:-1] if s]
    paths: list[str] = []
    for s in segs:
        atoms = s.split(".")
        if paths and atoms[0] == paths[-1].split(".")[-1] and len(atoms) > 1:
            paths.append(paths[-1] + "." + ".".join(atoms[1:]))
        else:
            paths.append((paths[-1] + "." + s) if paths else s)
    return paths


class _Modules:
    """Recovers the leaf module path of a node from exporter metadata or names."""

    def __init__(self, model: ir.Model) -> None:
        self.inits = model.graph.initializers
        scope_count: dict[str, int] = {}
        deeper: set[str] = set()
        for node in model.graph:
            if node.op_type == "Constant":
                continue
            paths = _legacy_scope(node.name)
            if not paths:
                continue
            scope_count[paths[-1]] = scope_count.get(paths[-1], 0) + 1
            deeper.update(paths[:-1])
        self.scope_count, self.deeper = scope_count, deeper

    def of(self, node: ir.Node, kind: str, weight: str | None) -> str | None:
        cls = _meta_list(node, "pkg.torch.onnx.class_hierarchy")
        scopes = _meta_list(node, "pkg.torch.onnx.name_scopes")
        if cls and scopes and len(cls) >= 2 and len(scopes) >= 2:
            spec = optable.for_module_class_name(cls[-2])
            if spec is not None and scopes[-2] and (
                    spec.kind == kind or (kind == "matmul" and spec.kind == "linear")):
                return scopes[-2]
        if weight and weight.endswith(".weight") and not weight.startswith("onnx::"):
            return weight[: -len(".weight")]
        paths = _legacy_scope(node.name)
        if paths:
            p = paths[-1]
            if weight and weight.startswith(p + "."):
                return p
            if self.scope_count.get(p, 0) == 1 and p not in self.deeper:
                return p
        return None


# --------------------------------------------------------------------------------------------
# the graph
# --------------------------------------------------------------------------------------------
def _ints(node: ir.Node, name: str, default: list[int] | None = None) -> list[int] | None:
    a = node.attributes.get(name)
    if a is None:
        return default
    return [int(x) for x in a.as_ints()]


def _int(node: ir.Node, name: str, default: int) -> int:
    a = node.attributes.get(name)
    return int(a.as_int()) if a is not None else default


def _float(node: ir.Node, name: str, default: float) -> float:
    a = node.attributes.get(name)
    return float(a.as_float()) if a is not None else default


def _str(node: ir.Node, name: str, default: str) -> str:
    a = node.attributes.get(name)
    if a is None:
        return default
    v = a.as_string()
    return v.decode() if isinstance(v, bytes) else str(v)


def _numel(v: ir.Value) -> int | None:
    shape = v.shape if v.shape is not None else (
        ir.Shape(v.const_value.shape) if v.const_value is not None else None)
    if shape is None:
        return None
    try:
        return math.prod(int(d) for d in shape)
    except (TypeError, ValueError):
        return None


def _geometry(node: ir.Node, d: int, kernel: list[int] | None, what: str
              ) -> tuple[dict[str, Any], str | None]:
    """ONNX conv/pool attributes as the planner's names; second item: why pads are unusable."""
    strides = _ints(node, "strides") or [1] * d
    dil = _ints(node, "dilations") or [1] * d
    pads = _ints(node, "pads") or [0] * (2 * d)
    auto = _str(node, "auto_pad", "NOTSET")
    problem = None
    if auto not in ("NOTSET", "", "VALID"):
        padding: Any = auto.lower()
        problem = f"auto_pad={auto}"
    elif auto == "VALID":
        padding = [0] * d
    elif pads[:d] != pads[d:]:
        padding = f"asymmetric pads {pads}"
        problem = f"asymmetric pads {pads} (begin != end)"
    else:
        padding = pads[:d]
    attrs = {"kernel_size": kernel, "stride": strides, "padding": padding, "dilation": dil}
    return attrs, problem


_INDEX_TYPES = (ir.DataType.INT64, ir.DataType.INT32)


def _constant_lookup(node: ir.Node, ins: list, is_param: Callable[[ir.Value, bool], bool]
                     ) -> bool:
    """``Gather`` of rows of a 2-D float parameter at constant integer ids of rank >= 1: an
    embedding looked up at ids the model holds (BERT's position ids and default token-type
    ids are buffers; the exporters make them initializers or constant subgraphs).  The PyTorch
    path sees the same lookup as an ``nn.Embedding`` call and plans it as an embedding, so the
    ONNX path does too (a scalar index, e.g. a class token picked from a table, stays a
    constant)."""
    if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(ins) != 2:
        return False
    table, ids = ins
    if table is None or ids is None or _int(node, "axis", 0) != 0:
        return False
    if table.shape is None or len(table.shape) != 2 or not is_param(table, True):
        return False
    return ids.dtype in _INDEX_TYPES and ids.shape is not None and len(ids.shape) >= 1


@dataclass
class _Call:
    """One ONNX node read as a functional PyTorch call: operand markers and attributes for
    ``build_node``, the op table entry when the operands decide it (``kind``: Gemm as linear or
    matmul, Gather as embedding), and what the neutral node gets beyond what ``build_node``
    derives (``extra`` attributes, ``post_params``: parameter roles of a recurrent layer)."""

    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    post_params: dict[str, str] | None = None
    kind: str | None = None


#: node attributes carried over from ``_Call.extra``
_EXTRA_ATTRS = ("gemm", "training_mode", "keep_reason", "no_fold_reason", "symbolic_spatial")


class _Builder:
    """The state of one :func:`to_graph` pass: which values carry activations, which neutral
    node produced each value, the parameters found so far."""

    def __init__(self, model: ir.Model, shapes: dict[str, tuple], symbolic: set[str],
                 norm: NormalizeInfo | None) -> None:
        self.model, self.g, self.shapes, self.symbolic = model, model.graph, shapes, symbolic
        self.inits = self.g.initializers
        self.lifted = norm.lifted if norm is not None else set()
        self.modules = _Modules(model)
        self.nodes: list[Node] = []
        self.ir_nodes: dict[str, ir.Node] = {}
        self.act_index: dict[str, list[int]] = {}
        self.input_nodes: dict[str, ir.Value] = {}
        self.producer: dict[int, str] = {}       # id(ir.Value) -> neutral node name
        self.data: set[int] = set()              # ids of values that carry activations
        self.taken: set[str] = {n.name for n in self.g if n.name}
        self.params: dict[str, ParamInfo] = {}
        self.param_shapes: dict[str, tuple[int, ...]] = {}
        self.gains: dict[str, float] = {}
        self.module_calls: dict[str, int] = {}
        self.views: dict[int, ir.Value] = {}     # id(weight view) -> the initializer it reads
        self.transposed: set[int] = set()        # ids of 2-D transposes of an initializer
        self.viewed: set[str] = set()            # parameters registered with a view's shape

    # -- values ---------------------------------------------------------------------------------
    def shape_of(self, v: ir.Value | None) -> tuple[int, ...] | None:
        if v is None or v.name is None:
            return None
        s = self.shapes.get(v.name)
        return _static(s[0]) if s is not None else None

    def carries(self, v: ir.Value | None) -> bool:
        """Does ``v`` carry an activation?"""
        return v is not None and id(v) in self.data

    def note_view(self, node: ir.Node, ins: list) -> None:
        """Record the output of a layout/dtype op on a float initializer (or on such a view)
        as a view of that initializer."""
        if node.op_type not in _VIEW_OPS or node.domain not in ("", "ai.onnx") or not ins \
                or ins[0] is None or len(node.outputs) != 1:
            return
        src = self.views.get(id(ins[0]), ins[0])
        if src.name not in self.inits or self.inits[src.name] is not src \
                or src.dtype not in FLOAT_TYPES:
            return
        if node.op_type == "Cast":
            try:
                if ir.DataType(_int(node, "to", 0)) not in FLOAT_TYPES:
                    return
            except ValueError:
                return
        if node.op_type == "CastLike" and (len(ins) < 2 or ins[1] is None
                                           or ins[1].dtype not in FLOAT_TYPES):
            return
        out = node.outputs[0]
        self.views[id(out)] = src
        if node.op_type == "Transpose" and ins[0] is src and src.shape is not None \
                and len(src.shape) == 2 and _ints(node, "perm", [1, 0]) == [1, 0]:
            self.transposed.add(id(out))

    def is_param(self, v: ir.Value, slot_is_weight: bool) -> bool:
        if id(v) in self.views:     # a weight view is its initializer, in a weight slot
            return slot_is_weight and self.is_param(self.views[id(v)], True)
        if v.name not in self.inits or self.inits[v.name] is not v:
            return False
        if v.dtype not in FLOAT_TYPES:
            return False
        if slot_is_weight:
            return True
        n = _numel(v)
        return v.name not in self.lifted and (n is None or n > 1)

    def add_param(self, v: ir.Value, shape: tuple[int, ...] | None = None) -> None:
        """Register initializer ``v`` as a parameter; ``shape``: the layout its layer sees
        (a view's), when it differs from the file's."""
        file_shape = tuple(int(x) for x in (v.shape if v.shape is not None
                                            else v.const_value.shape))
        have = self.params.get(v.name)
        if have is None or (shape is not None and tuple(have.shape) == file_shape
                            and v.name not in self.viewed):
            self.params[v.name] = ParamInfo(shape or file_shape)
            if shape is not None:
                self.viewed.add(v.name)
        self.param_shapes.setdefault(v.name, file_shape)

    def marker(self, v: ir.Value | None, weight_slot: bool = False) -> Any:
        if v is None:
            return None
        if id(v) in self.data:
            return Act(self.producer[id(v)])
        if self.is_param(v, weight_slot):
            src = self.views.get(id(v), v)
            logical = None
            if src is not v and id(v) not in self.transposed:
                logical = self.shape_of(v)
                if logical is None or math.prod(logical) != _numel(src):
                    logical = None
            self.add_param(src, logical)
            return Param(src.name)
        return Const(None)

    # -- the graph's inputs and outputs ---------------------------------------------------------
    def add_inputs(self) -> None:
        for spec_in in real_inputs(self.model):
            v = next(x for x in self.g.inputs if x.name == spec_in.name)
            name = spec_in.name if spec_in.name not in self.taken else f"input:{spec_in.name}"
            self.taken.add(name)
            self.nodes.append(Node(name, "input", f"input {spec_in.name}",
                                   out_shape=self.shape_of(v),
                                   attrs={} if v.dtype is None or v.dtype in FLOAT_TYPES
                                   else {"integer": True}))
            self.input_nodes[name] = v
            self.producer[id(v)] = name
            self.data.add(id(v))

    def captured(self) -> Captured:
        """The output node, and everything collected as a :class:`Captured`."""
        _matmul_biases(self.nodes, self.ir_nodes, self.inits, self.params, self.add_param,
                       self.views)
        _packed_projections(self.nodes, self.ir_nodes, self.shape_of)
        outs: list[str] = []
        for o in self.g.outputs:
            src = self.producer.get(id(o))
            if src is not None and src not in outs:
                outs.append(src)
        out_name = "output" if "output" not in self.taken else "output:graph"
        self.nodes.append(Node(out_name, "output", "output", inputs=outs))
        return Captured(Graph(self.nodes, "onnx", outputs=outs), self.params, self.ir_nodes,
                        self.act_index, self.input_nodes,
                        dtypes={k: v[1] for k, v in self.shapes.items()},
                        param_shapes=self.param_shapes, gains=self.gains)

    # -- one node -------------------------------------------------------------------------------
    def add_node(self, node: ir.Node) -> None:
        ins = list(node.inputs)
        is_data = node.op_type not in _SHAPE_OPS and any(self.carries(v) for v in ins)
        if not is_data and _constant_lookup(node, ins, self.is_param):
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
            self.note_view(node, ins)
        call = self.call_of(node, ins) if is_data else _Call([self.marker(v) for v in ins])
        if call.kind is not None:
            spec = optable.BY_KIND[call.kind]
        kind = spec.kind if spec is not None else "unknown"
        mod, call_index = self.module_of(node, spec, kind, call.args)
        nn_ = build_node(node.name, spec, target, call.args, call.kwargs, module=mod,
                         call_index=call_index, out_shape=self.shape_of(
                             node.outputs[0] if node.outputs else None),
                         in_shapes=[self.shape_of(v) for v in ins])
        _annotate(nn_, node, kind, call)
        self.act_index[node.name] = self.act_slots(ins, nn_)
        self.nodes.append(nn_)
        self.ir_nodes[node.name] = node
        for o in node.outputs:
            self.producer[id(o)] = node.name
            if is_data:
                self.data.add(id(o))

    def module_of(self, node: ir.Node, spec: Any, kind: str, args: list[Any]
                  ) -> tuple[str | None, int]:
        """The module path of a node, and which call of that module it is."""
        if spec is None or kind in ("constant", "unknown"):
            return None, 0
        w = None
        if kind in ("conv", "conv_transpose", "linear", "embedding", "matmul"):
            w = next((a.name for a in args if isinstance(a, Param)), None)
        mod = self.modules.of(node, kind, w)
        if kind == "maxpool" and mod and f"{mod}.weight" in self.inits:
            mod = None
        if not mod:
            return mod, 0
        call_index = self.module_calls.get(mod, 0)
        self.module_calls[mod] = call_index + 1
        return mod, call_index

    def act_slots(self, ins: list, nn_: Node) -> list[int]:
        """ONNX input slots of the activation operands, in the order build_node listed them."""
        slots: list[int] = []
        seen: list[str] = []
        for i, v in enumerate(ins):
            if self.carries(v) and self.producer[id(v)] not in seen:
                seen.append(self.producer[id(v)])
                slots.append(i)
        return [slots[seen.index(src)] for src in nn_.inputs if src in seen]

    # -- operands and attributes, by op ---------------------------------------------------------
    def call_of(self, node: ir.Node, ins: list) -> _Call:
        """A node on the data path as a call."""
        op = node.op_type
        if op in ("Conv", "ConvTranspose") and len(ins) >= 2:
            return self.conv(node, ins)
        if op == "Gemm" and len(ins) >= 2:
            return self.gemm(node, ins)
        if op == "MatMul" and len(ins) == 2 and self.carries(ins[0]) \
                and id(ins[1]) in self.transposed:       # x @ W.T: torch's linear
            return _Call([self.marker(ins[0]), self.marker(ins[1], True), None], kind="linear")
        if op == "MatMul" and len(ins) == 2:
            return _Call([self.marker(ins[0], not self.carries(ins[0])),
                          self.marker(ins[1], not self.carries(ins[1]))])
        if op == "MaxPool":
            return self.maxpool(node, ins)
        if op in _NORM_OPS and len(ins) >= 1:
            return self.norm(node, ins)
        if op in ("LSTM", "GRU", "RNN"):
            return self.recurrent(node, ins)
        if self.is_lookup(node, ins):
            return _Call([self.marker(ins[1]), self.marker(ins[0], True)], kind="embedding")
        if op == "LeakyRelu":
            return _Call([self.marker(ins[0])],
                         {"negative_slope": Const(_float(node, "alpha", 0.01))})
        return _Call([self.marker(v) for v in ins])

    def conv(self, node: ir.Node, ins: list) -> _Call:
        op, w = node.op_type, ins[1]
        wshape = self.shape_of(w) or (tuple(w.shape) if w is not None and w.shape else None)
        d = max(1, len(wshape) - 2) if wshape else 2
        kernel = _ints(node, "kernel_shape") or (list(wshape[2:]) if wshape else None)
        geo, _ = _geometry(node, d, kernel, op)
        c = _Call(kwargs={k: Const(v) for k, v in geo.items()})
        c.kwargs["groups"] = Const(_int(node, "group", 1))
        if op == "ConvTranspose":
            c.kwargs["output_padding"] = Const(_ints(node, "output_padding") or [0] * d)
        c.args = [self.marker(ins[0]), self.marker(w, True),
                  self.marker(ins[2] if len(ins) > 2 else None, True)]
        if ins[0] is not None and ins[0].name in self.symbolic and op == "Conv":
            c.extra["no_fold_reason"] = SYMBOLIC_NO_FOLD
            c.extra["symbolic_spatial"] = True
        return c

    def gemm(self, node: ir.Node, ins: list) -> _Call:
        """``transB=1`` with a weight initializer: linear; else a matmul layer, its weight on
        the side whose fans apply, C its bias when an initializer."""
        a_, b_ = ins[0], ins[1]
        ta, tb = _int(node, "transA", 0), _int(node, "transB", 0)
        c_ = ins[2] if len(ins) > 2 else None
        t_b = id(b_) in self.transposed if b_ is not None else False
        if ta == 0 and self.carries(a_) and self.is_param(b_, True) and (tb == 1) != t_b:
            c = _Call([self.marker(a_), self.marker(b_, True), self.marker(c_, True)],
                      kind="linear")
        else:
            c = _Call([self.marker(a_, not self.carries(a_)),
                       self.marker(b_, not self.carries(b_))], kind="matmul")
            side = None
            if not self.carries(b_) and self.is_param(b_, True):
                side = "right" if tb == 0 else "left"
            elif not self.carries(a_) and self.is_param(a_, True):
                side = "left" if ta == 0 else "right"
            if side:
                c.extra["weight_side"] = side
            if c_ is not None and self.is_param(c_, True):
                src = self.views.get(id(c_), c_)
                self.add_param(src)
                c.extra["_bias"] = src.name
            elif c_ is not None:
                c.args.append(self.marker(c_))
        alpha = _float(node, "alpha", 1.0)
        c.extra["gemm"] = {"transA": ta, "transB": tb, "alpha": alpha,
                           "beta": _float(node, "beta", 1.0)}
        w = next((a.name for a in c.args if isinstance(a, Param)), None)
        if w is not None and alpha not in (0.0, 1.0):
            self.gains.setdefault(w, alpha)
        return c

    def maxpool(self, node: ir.Node, ins: list) -> _Call:
        """A max-pool's geometry, and why it must be kept (the planner's ``keep_reason``)."""
        x = ins[0]
        xs = self.shape_of(x)
        d = (len(xs) - 2) if xs else len(_ints(node, "kernel_shape") or [0, 0])
        geo, problem = _geometry(node, d, _ints(node, "kernel_shape"), "MaxPool")
        ceil = bool(_int(node, "ceil_mode", 0))
        idx_used = len(node.outputs) > 1 and bool(list(node.outputs[1].uses())) or (
            len(node.outputs) > 1 and node.outputs[1].is_graph_output())
        why = None
        if problem:
            why = f"its {problem} cannot be reproduced by a symmetric replacement"
        elif ceil and x is not None and x.name in self.symbolic:
            why = "ceil_mode=1 with symbolic spatial dims: no replacement matches its " \
                  "output size for every input size"
        elif _int(node, "storage_order", 0) == 1 and idx_used:
            why = "its indices output (column-major) is used"
        c = _Call()
        if why:
            c.extra["keep_reason"] = f"kept: {why}"
        if isinstance(geo["padding"], str):  # kept anyway; the planner wants numbers
            geo["padding"] = (_ints(node, "pads") or [0] * (2 * d))[:d]
        c.kwargs = {k: Const(v) for k, v in geo.items()}
        c.kwargs["ceil_mode"] = Const(ceil)
        c.kwargs["return_indices"] = Const(bool(idx_used))
        c.args = [self.marker(x)]
        return c

    def norm(self, node: ir.Node, ins: list) -> _Call:
        c = _Call([self.marker(ins[0])])
        if len(ins) > 1 and ins[1] is not None:
            c.kwargs["weight"] = self.marker(ins[1], True)
        if len(ins) > 2 and ins[2] is not None:
            c.kwargs["bias"] = self.marker(ins[2], True)
        for extra_in in ins[3:]:                 # running statistics: buffers
            if self.carries(extra_in):
                c.args.append(self.marker(extra_in))
        c.extra["training_mode"] = _int(node, "training_mode", 0)
        return c

    def recurrent(self, node: ir.Node, ins: list) -> _Call:
        """LSTM/GRU/RNN: the weights under torch's parameter names and layout."""
        op = node.op_type
        c = _Call([self.marker(ins[0])], post_params={})
        for slot, role in ((1, "weight_ih_l0"), (2, "weight_hh_l0"), (3, "bias_l0")):
            v = ins[slot] if len(ins) > slot else None
            if v is not None and self.is_param(v, True):
                src = self.views.get(id(v), v)           # a Cast of fp16 weights...
                shp = self.shape_of(v) if src is not v else None
                shp = shp or tuple(int(x) for x in (src.shape if src.shape is not None
                                                    else src.const_value.shape))
                # one direction: present the torch layout (gates*H, in) to the planner
                logical = shp[1:] if len(shp) == 3 and shp[0] == 1 else shp
                self.add_param(src, logical)
                c.post_params[role] = src.name           # type: ignore[index]
        for v in ins[4:]:
            if self.carries(v):
                c.args.append(self.marker(v))
        c.extra["class"] = op
        c.extra["gates"] = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
        return c

    def is_lookup(self, node: ir.Node, ins: list) -> bool:
        """``Gather`` of rows of a 2-D float parameter at activation or constant ids."""
        table = ins[0] if len(ins) == 2 else None
        shape = None if table is None else self.shape_of(table) or (
            tuple(table.shape) if table.shape is not None else None)   # a view's: inferred
        return node.op_type == "Gather" and len(ins) == 2 and _int(node, "axis", 0) == 0 \
            and table is not None and not self.carries(table) \
            and self.is_param(table, True) and shape is not None \
            and len(shape) == 2 and ins[1] is not None \
            and (self.carries(ins[1]) or _constant_lookup(node, ins, self.is_param))


def _annotate(nn_: Node, node: ir.Node, kind: str, call: _Call) -> None:
    """What the neutral node gets beyond what ``build_node`` derives."""
    extra = call.extra
    if kind == "unknown":
        nn_.kind = "unknown"
    if "weight_side" in extra and "weight" in nn_.params:
        nn_.attrs["weight_side"] = extra["weight_side"]
    if "_bias" in extra:
        nn_.params["bias"] = extra["_bias"]
    if call.post_params is not None:
        nn_.params = {k: v for k, v in nn_.params.items() if v not in call.post_params.values()}
        nn_.params.update(call.post_params)
        nn_.attrs["class"] = extra["class"]
    for k in _EXTRA_ATTRS:
        if k in extra:
            nn_.attrs[k] = extra[k]
    if node.domain not in ("", "ai.onnx"):
        nn_.attrs["domain"] = node.domain


def to_graph(model: ir.Model, shapes: dict[str, tuple], symbolic: set[str],
             norm: NormalizeInfo | None = None) -> Captured:
    """Build the neutral graph; ``shapes`` from :func:`infer_shapes`, ``symbolic``: names of
    values whose spatial dims depend on symbolic input dims."""
    b = _Builder(model, shapes, symbolic, norm)
    b.add_inputs()
    for node in model.graph:
        b.add_node(node)
    return b.captured()


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


def symbolic_values(model: ir.Model, bindings: dict[str, int], leading: int,
                    first: dict[str, tuple]) -> set[str]:
    """Values whose non-leading dims change when the symbolic non-leading input dims do."""
    syms = set()
    for spec in real_inputs(model):
        for i, d in enumerate(spec.dims or []):
            if i > 0 and not isinstance(d, int):
                syms.add(d)
    if not syms:
        return set()
    other = dict(bindings)
    for s in syms:
        if isinstance(s, str) and s:
            other[s] = bindings.get(s, 8) * 2 + 3
    second = infer_shapes(model, other, leading)
    out = set()
    for name, (shape, _) in first.items():
        s2 = second.get(name, (None, 0))[0]
        if shape is None or s2 is None or len(shape) != len(s2) or shape[1:] != s2[1:] \
                or any(d is None for d in shape[1:]):
            out.add(name)
    return out
