"""Shape inference with the symbolic dims bound to the calibration sizes, without copying the
weights; a second inference with other sizes tells which values have symbolic spatial dims."""
from __future__ import annotations

from typing import Any, Callable

import onnx
import onnx_ir as ir

from precondfx.onnx.io import real_inputs


_BIG = 1024  # initializers larger than this (bytes) are stripped for shape inference


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
