"""Shape inference with the symbolic dims bound to the calibration sizes, without copying the
weights; a second inference with other sizes tells which values have symbolic spatial dims."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
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

    out = call_stripped(model, fn)
    out.update(_observed(model, out))
    return out


def _unknown(shape: tuple[int | None, ...] | None) -> bool:
    return shape is None or any(d is None for d in shape)


def _observed(model: ir.Model, inferred: dict[str, tuple]) -> dict[str, tuple]:
    """Shapes ONNX inference left unknown (a Reshape to ``c // groups`` computed from ``Shape``,
    a ``Slice`` with computed ends: common in ``dynamo=False`` exports), read from one
    onnxruntime run on zeros of the bound input shapes; without them the plan would lose what
    depends on the spatial size (the zero-padding correction), unlike the same model's PyTorch
    or other exports.  Best effort: {} when the inputs are not all bound or the run fails."""
    from precondfx.onnx.calibrate import run, session_for_model

    feeds = {}
    for spec in real_inputs(model):
        shape, elem = inferred.get(spec.name, (None, 0))
        if _unknown(shape) or not elem:
            return {}
        try:
            feeds[spec.name] = np.zeros(shape, onnx.helper.tensor_dtype_to_np_dtype(elem))
        except Exception:
            return {}
    g = model.graph
    seen = {v.name for v in g.outputs}
    want = []
    for node in g:
        for v in node.outputs:
            if v.name and v.name not in seen and _unknown(inferred.get(v.name, (None, 0))[0]) \
                    and inferred.get(v.name, (None, 0))[1]:
                want.append(v)
                seen.add(v.name)
    if not want:
        return {}
    n_out = len(g.outputs)
    saved = [(v, v.type, v.shape) for v in want]
    try:
        for v in want:
            if v.type is None:
                v.type = ir.TensorType(ir.DataType(inferred[v.name][1]))
            g.outputs.append(v)
        sess = session_for_model(model)
        got = run(sess, feeds, [v.name for v in want])
    except Exception:       # best effort, as ONNX inference: the later stages say what fails
        return {}
    finally:
        while len(g.outputs) > n_out:     # pop(): the values forget being graph outputs
            g.outputs.pop()
        for v, t, sh in saved:
            v.type, v.shape = t, sh
    out = {}
    for v, y in zip(want, got):
        known = inferred.get(v.name, (None, 0))[0]
        shape = tuple(int(d) for d in np.shape(y))
        if known is None or (len(known) == len(shape) and
                             all(k is None or k == d for k, d in zip(known, shape))):
            out[v.name] = (shape, inferred[v.name][1])
    return out


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
