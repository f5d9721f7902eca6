"""What the capture knows about ONNX values: which carry activations and which node produced
them, which are parameters (initializers, or views of one through a layout or dtype op), and
the operand marker (``Act``, ``Param``, ``Const``) each becomes."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx_ir as ir

from precondfx.core.nodes import Act, Const, Param
from precondfx.core.plan import ParamInfo
from precondfx.onnx.capture.attrs import _VIEW_OPS, _int, _ints, _numel
from precondfx.onnx.io import FLOAT_TYPES


def _static(shape: tuple[int | None, ...] | None) -> tuple[int, ...] | None:
    if shape is None or any(d is None for d in shape):
        return None
    return tuple(int(d) for d in shape)


class Values:
    """The values of one capture pass: activations and their producers, the parameters found so
    far (with their shapes and gains) and the weight views."""

    def __init__(self, inits: Any, shapes: dict[str, tuple], symbolic: set[str],
                 lifted: set[str]) -> None:
        self.inits, self.shapes, self.symbolic, self.lifted = inits, shapes, symbolic, lifted
        self.producer: dict[int, str] = {}       # id(ir.Value) -> neutral node name
        self.data: set[int] = set()              # ids of values that carry activations
        self.params: dict[str, ParamInfo] = {}
        self.param_shapes: dict[str, tuple[int, ...]] = {}
        self.gains: dict[str, float] = {}
        self.views: dict[int, ir.Value] = {}     # id(weight view) -> the initializer it reads
        self.transposed: set[int] = set()        # ids of 2-D transposes of an initializer
        self.viewed: set[str] = set()            # parameters registered with a view's shape
        #: id(value) -> the parameter a value computed without activations reads (an Expand of
        #: a class token by a shape computed from the input): a token, for core.tokens
        self.derived: dict[int, str] = {}
        #: id(weight view) -> the constant factor it multiplies its initializer by
        #: (``MatMul(x, Mul(W, 3))``), and the node that does
        self.factors: dict[int, tuple[float, str]] = {}
        #: ids of weight views whose whole chain from the initializer has a single use each
        #: (only there does a factor belong to one layer)
        self.sole: set[int] = set()
        #: parameter -> (the factor its views multiply it by, the node), read by a layer
        self.scaled: dict[str, tuple[float, str]] = {}

    def shape_of(self, v: ir.Value | None) -> tuple[int, ...] | None:
        if v is None or v.name is None:
            return None
        s = self.shapes.get(v.name)
        return _static(s[0]) if s is not None else None

    def carries(self, v: ir.Value | None) -> bool:
        """Does ``v`` carry an activation?"""
        return v is not None and id(v) in self.data

    def _only_use(self, w: ir.Value, src: ir.Value) -> bool:
        """Whether ``w`` (``src`` or a view of it) reaches one node: the initializer and every
        view on the way used once."""
        return len(list(w.uses())) == 1 and not w.is_graph_output() and \
            (w is src or id(w) in self.sole)

    def note_scaled(self, node: ir.Node, ins: list) -> bool:
        """Record ``Mul(W, c)`` or ``Div(W, c)`` of a float initializer (or a view of one) by a
        constant scalar ``c`` as a view of ``W`` with that factor, when the initializer
        reaches that node alone: the layer reading it is a linear layer with a fixed factor
        (the factor is a gain, as a Gemm's ``alpha``)."""
        if node.op_type not in ("Mul", "Div") or node.domain not in ("", "ai.onnx") or \
                len(ins) != 2 or len(node.outputs) != 1:
            return False
        for k in ((0, 1) if node.op_type == "Mul" else (0,)):
            w, c = ins[k], ins[1 - k]
            if w is None or c is None or c.const_value is None or c.const_value.size != 1 \
                    or c.dtype not in FLOAT_TYPES:
                continue
            src = self.views.get(id(w), w)
            if src.name not in self.inits or self.inits[src.name] is not src or \
                    src.dtype not in FLOAT_TYPES or c is src or not self._only_use(w, src):
                continue
            f = float(np.asarray(c.const_value.numpy(), dtype=np.float64).reshape(()))
            if not math.isfinite(f) or f == 0.0:
                continue
            f = f if node.op_type == "Mul" else 1.0 / f
            prev, _ = self.factors.get(id(w), (1.0, ""))
            out = node.outputs[0]
            self.views[id(out)] = src
            self.sole.add(id(out))
            self.factors[id(out)] = (prev * f, f"{node.op_type} node "
                                     f"{node.name or '(unnamed)'!r}")
            return True
        return False

    def note_view(self, node: ir.Node, ins: list) -> None:
        """Record the output of a layout/dtype op on a float initializer (or on such a view)
        as a view of that initializer; a constant factor (:meth:`note_scaled`) too."""
        if self.note_scaled(node, ins):
            return
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
        if self._only_use(ins[0], src):
            self.sole.add(id(out))
            if id(ins[0]) in self.factors:
                self.factors[id(out)] = self.factors[id(ins[0])]
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

    def note_derived(self, node: ir.Node, ins: list) -> None:
        """Record the outputs of a node computed without activations from one float
        initializer (or from such a value) as reading that parameter."""
        src = [self.derived[id(v)] if id(v) in self.derived else
               self.views.get(id(v), v).name for v in ins if v is not None and
               (id(v) in self.derived or self.is_param(self.views.get(id(v), v), False))]
        if len(set(src)) == 1:
            for o in node.outputs:
                self.derived[id(o)] = src[0]

    def join_marker(self, v: ir.Value | None) -> Any:
        """An operand of a concatenation or addition: a value computed from a parameter
        without activations is that parameter (``Param``), as in the PyTorch captures."""
        if v is not None and id(v) not in self.data and id(v) in self.derived:
            name = self.derived[id(v)]
            if name in self.inits:
                self.add_param(self.inits[name])
                return Param(name)
        return self.marker(v)

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
            if weight_slot and id(v) in self.factors:
                self.scaled[src.name] = self.factors[id(v)]
            return Param(src.name)
        return Const(None)

