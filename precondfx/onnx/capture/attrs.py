"""Reading ONNX nodes: attributes under the planner's names, element counts, the op sets the
capture tells apart, and embedding lookups at constant ids."""
from __future__ import annotations

import math
from typing import Any, Callable

import onnx_ir as ir


_NORM_OPS = {"BatchNormalization", "LayerNormalization", "GroupNormalization",
             "InstanceNormalization", "RMSNormalization", "SimplifiedLayerNormalization"}
_SHAPE_OPS = {"Shape", "Size"}
#: ops that pass a weight on with another layout or dtype: ``MatMul(x, Transpose(W))`` (the
#: dynamo exporter without its optimizer), ``Gemm(x, Cast(W_fp16))`` (mixed-precision
#: exports), a reshaped or squeezed kernel; the layer's weight is the initializer they read
_VIEW_OPS = {"Identity", "Cast", "CastLike", "Transpose", "Reshape", "Squeeze", "Unsqueeze",
             "Flatten"}


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

