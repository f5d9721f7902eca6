"""Each ONNX node on the data path read as a functional PyTorch call, by op: operand markers and
attributes for ``build_node`` (convolutions, Gemm/MatMul as linear or matmul layers, max-pools
and why one must be kept, normalizations, recurrent cells, embedding lookups)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

from precondfx.core.graph import Node
from precondfx.core.nodes import Const, Param
from precondfx.onnx.capture.attrs import (_NORM_OPS, _constant_lookup, _float, _geometry, _int,
                                          _ints, _str)
from precondfx.onnx.capture.values import Values


#: why a pool's stride is not folded into a convolution whose input has symbolic spatial dims
SYMBOLIC_NO_FOLD = ("the spatial dims are symbolic, and a folded stride matches the pool's output "
                    "size only for some input sizes")


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


def call_of(vals: Values, node: ir.Node, ins: list) -> _Call:
    """A node on the data path as a call."""
    op = node.op_type
    if op in ("Conv", "ConvTranspose") and len(ins) >= 2:
        return _conv(vals, node, ins)
    if op == "Gemm" and len(ins) >= 2:
        return _gemm(vals, node, ins)
    if op == "MatMul" and len(ins) == 2 and vals.carries(ins[0]) \
            and id(ins[1]) in vals.transposed:       # x @ W.T: torch's linear
        return _Call([vals.marker(ins[0]), vals.marker(ins[1], True), None], kind="linear")
    if op == "MatMul" and len(ins) == 2:
        return _Call([vals.marker(ins[0], not vals.carries(ins[0])),
                      vals.marker(ins[1], not vals.carries(ins[1]))])
    if op == "Einsum":     # the equation first, as torch.einsum takes it: core.nodes reads
        return _Call([Const(_str(node, "equation", ""))] +     # which operand is the weight
                     [vals.marker(v, not vals.carries(v)) for v in ins])
    if op == "MaxPool":
        return _maxpool(vals, node, ins)
    if op in _NORM_OPS and len(ins) >= 1:
        return _norm(vals, node, ins)
    if op in ("LSTM", "GRU", "RNN"):
        return _recurrent(vals, node, ins)
    if _is_lookup(vals, node, ins):
        return _Call([vals.marker(ins[1]), vals.marker(ins[0], True)], kind="embedding")
    if op in ("Concat", "Add"):         # a class token or a position embedding (core.tokens)
        return _Call([vals.join_marker(v) for v in ins])
    if op == "LeakyRelu":
        return _Call([vals.marker(ins[0])],
                     {"negative_slope": Const(_float(node, "alpha", 0.01))})
    return _Call([vals.marker(v) for v in ins])


def _conv(vals: Values, node: ir.Node, ins: list) -> _Call:
    op, w = node.op_type, ins[1]
    wshape = vals.shape_of(w) or (tuple(w.shape) if w is not None and w.shape else None)
    d = max(1, len(wshape) - 2) if wshape else 2
    kernel = _ints(node, "kernel_shape") or (list(wshape[2:]) if wshape else None)
    geo, _ = _geometry(node, d, kernel, op)
    c = _Call(kwargs={k: Const(v) for k, v in geo.items()})
    c.kwargs["groups"] = Const(_int(node, "group", 1))
    if op == "ConvTranspose":
        c.kwargs["output_padding"] = Const(_ints(node, "output_padding") or [0] * d)
    c.args = [vals.marker(ins[0]), vals.marker(w, True),
              vals.marker(ins[2] if len(ins) > 2 else None, True)]
    if ins[0] is not None and ins[0].name in vals.symbolic and op == "Conv":
        c.extra["no_fold_reason"] = SYMBOLIC_NO_FOLD
        c.extra["symbolic_spatial"] = True
    return c


def _gemm(vals: Values, node: ir.Node, ins: list) -> _Call:
    """``transB=1`` with a weight initializer: linear; else a matmul layer, its weight on
    the side whose fans apply, C its bias when an initializer."""
    a_, b_ = ins[0], ins[1]
    ta, tb = _int(node, "transA", 0), _int(node, "transB", 0)
    c_ = ins[2] if len(ins) > 2 else None
    t_b = id(b_) in vals.transposed if b_ is not None else False
    if ta == 0 and vals.carries(a_) and vals.is_param(b_, True) and (tb == 1) != t_b:
        c = _Call([vals.marker(a_), vals.marker(b_, True), vals.marker(c_, True)],
                  kind="linear")
    else:
        c = _Call([vals.marker(a_, not vals.carries(a_)),
                   vals.marker(b_, not vals.carries(b_))], kind="matmul")
        side = None
        if not vals.carries(b_) and vals.is_param(b_, True):
            side = "right" if tb == 0 else "left"
        elif not vals.carries(a_) and vals.is_param(a_, True):
            side = "left" if ta == 0 else "right"
        if side:
            c.extra["weight_side"] = side
        if c_ is not None and vals.is_param(c_, True):
            src = vals.views.get(id(c_), c_)
            vals.add_param(src)
            c.extra["_bias"] = src.name
        elif c_ is not None:
            c.args.append(vals.marker(c_))
    alpha = _float(node, "alpha", 1.0)
    c.extra["gemm"] = {"transA": ta, "transB": tb, "alpha": alpha,
                       "beta": _float(node, "beta", 1.0)}
    w = next((a.name for a in c.args if isinstance(a, Param)), None)
    if w is not None and alpha not in (0.0, 1.0):
        vals.gains.setdefault(w, alpha)
    return c


def _maxpool(vals: Values, node: ir.Node, ins: list) -> _Call:
    """A max-pool's geometry, and why it must be kept (the planner's ``keep_reason``)."""
    x = ins[0]
    xs = vals.shape_of(x)
    d = (len(xs) - 2) if xs else len(_ints(node, "kernel_shape") or [0, 0])
    geo, problem = _geometry(node, d, _ints(node, "kernel_shape"), "MaxPool")
    ceil = bool(_int(node, "ceil_mode", 0))
    idx_used = len(node.outputs) > 1 and bool(list(node.outputs[1].uses())) or (
        len(node.outputs) > 1 and node.outputs[1].is_graph_output())
    why = None
    if problem:
        why = f"its {problem} cannot be reproduced by a symmetric replacement"
    elif ceil and x is not None and x.name in vals.symbolic:
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
    c.args = [vals.marker(x)]
    return c


def _norm(vals: Values, node: ir.Node, ins: list) -> _Call:
    c = _Call([vals.marker(ins[0])])
    if len(ins) > 1 and ins[1] is not None:
        c.kwargs["weight"] = vals.marker(ins[1], True)
    if len(ins) > 2 and ins[2] is not None:
        c.kwargs["bias"] = vals.marker(ins[2], True)
    for extra_in in ins[3:]:                 # running statistics: buffers
        if vals.carries(extra_in):
            c.args.append(vals.marker(extra_in))
    c.extra["training_mode"] = _int(node, "training_mode", 0)
    return c


def _recurrent(vals: Values, node: ir.Node, ins: list) -> _Call:
    """LSTM/GRU/RNN: the weights under torch's parameter names and layout."""
    op = node.op_type
    c = _Call([vals.marker(ins[0])], post_params={})
    for slot, role in ((1, "weight_ih_l0"), (2, "weight_hh_l0"), (3, "bias_l0")):
        v = ins[slot] if len(ins) > slot else None
        if v is not None and vals.is_param(v, True):
            src = vals.views.get(id(v), v)           # a Cast of fp16 weights...
            shp = vals.shape_of(v) if src is not v else None
            shp = shp or tuple(int(x) for x in (src.shape if src.shape is not None
                                                else src.const_value.shape))
            # one direction: present the torch layout (gates*H, in) to the planner
            logical = shp[1:] if len(shp) == 3 and shp[0] == 1 else shp
            vals.add_param(src, logical)
            c.post_params[role] = src.name           # type: ignore[index]
    for v in ins[4:]:
        if vals.carries(v):
            c.args.append(vals.marker(v))
    c.extra["class"] = op
    c.extra["gates"] = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    return c


def _is_lookup(vals: Values, node: ir.Node, ins: list) -> bool:
    """``Gather`` of rows of a 2-D float parameter at activation or constant ids."""
    table = ins[0] if len(ins) == 2 else None
    shape = None if table is None else vals.shape_of(table) or (
        tuple(table.shape) if table.shape is not None else None)   # a view's: inferred
    return node.op_type == "Gather" and len(ins) == 2 and _int(node, "axis", 0) == 0 \
        and table is not None and not vals.carries(table) \
        and vals.is_param(table, True) and shape is not None \
        and len(shape) == 2 and ins[1] is not None \
        and (vals.carries(ins[1]) or _constant_lookup(node, ins, vals.is_param))


def annotate(nn_: Node, node: ir.Node, kind: str, call: _Call) -> None:
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

