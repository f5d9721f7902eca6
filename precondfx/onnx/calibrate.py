"""Calibration runs with onnxruntime: measure the main output's std on the calibration feed.

The session always uses ``CPUExecutionProvider``, set explicitly, so runs are reproducible.  The
calibration copy has every Dropout's ``training_mode`` set to False, so the output scale does not
depend on ORT's optimization level (with optimizations on, ORT drops a training-mode Dropout;
with them off, it applies it at random).  The std is the population std (correction 0) over all
elements of the output (its finite ones when the others are -inf, a mask), in float64, as on
the PyTorch path (``precondfx.pytorch.calibrate.output_std``);
``precondfx.pytorch.calibrate.solve_output_scale`` turns it into the scale.

The model is run from memory, before anything is written: its large initializers are handed to
ORT as OrtValues sharing the numpy (or memory-mapped) buffers, so there is neither a copy nor the
2 GB protobuf limit; the output scale is then set and the model saved once.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np
import onnx_ir as ir

from precondfx.core.backend import PREFIX
from precondfx.core.calibration import constancy, masked_std
from precondfx.errors import PrecondError

PROVIDERS = ["CPUExecutionProvider"]


def _ort():
    import onnxruntime as ort
    return ort


def session(source: str | bytes) -> "object":
    """An ORT CPU session from a path or serialized model bytes."""
    ort = _ort()
    so = ort.SessionOptions()
    so.log_severity_level = 4  # errors reach the user as PrecondError
    try:
        return ort.InferenceSession(source, so, providers=PROVIDERS)
    except Exception as e:
        raise _load_error(e) from None


#: onnxruntime's refusal of an opset newer than it was built for (a file from a newer exporter)
_OPSET_TOO_NEW = re.compile(r"Opset (\d+) is under development.*?Current official support for "
                            r"domain (\S+) is till opset (\d+)")


def _ort_version() -> str:
    return str(getattr(_ort(), "__version__", "?"))


def _load_error(e: BaseException) -> PrecondError:
    """onnxruntime's refusal to load the model, with what to do when the CPU provider has no
    kernel for an op (bfloat16 arithmetic, most often): the input model has the same op."""
    msg = " ".join(str(e).split())
    newer = _OPSET_TOO_NEW.search(msg)
    if newer:
        opset, domain, top = newer.group(1), newer.group(2).rstrip("."), newer.group(3)
        return PrecondError(f"the model uses opset {opset} of domain {domain!r}, newer than "
                            f"onnxruntime {_ort_version()} runs (up to opset {top}), and "
                            f"precondfx calibrates and checks ONNX files with it: re-export the "
                            f"model with opset_version={top} or lower (or convert it: "
                            f"onnx.version_converter.convert_version(model, {top})), or upgrade "
                            f"onnxruntime")
    if "NOT_IMPLEMENTED" in msg or "Could not find an implementation" in msg:
        return PrecondError(f"onnxruntime's CPU provider has no kernel for an op of this model "
                            f"({msg[:300]}), and precondfx calibrates and checks ONNX files with "
                            f"it: convert the model to a type it runs (float32 or float16; "
                            f"bfloat16 arithmetic is mostly unsupported), or precondition the "
                            f"PyTorch model")
    if "is not a registered function/op" in msg or "No Op registered" in msg:
        return PrecondError(f"onnxruntime does not know an op of this model ({msg[:300]}), and "
                            f"precondfx calibrates and checks ONNX files with it: a custom op "
                            f"needs its kernels registered in onnxruntime (e.g. "
                            f"onnxruntime-extensions for ai.onnx.contrib ops); or precondition "
                            f"the model before those ops are added, or from Python: "
                            f"precondition_onnx(..., target_std=None, verify=False), on the command "
                            f"line --target-std none --no-verify")
    return PrecondError(f"onnxruntime cannot load the rewritten model: {msg[:400]}")


def run(sess: "object", feeds: Mapping[str, np.ndarray], outputs: list[str] | None = None
        ) -> list[np.ndarray]:
    """Run a session; an ORT failure becomes a PrecondError naming the feed's shapes."""
    try:
        return sess.run(outputs, dict(feeds))
    except Exception as e:
        msg = " ".join(str(e).split())
        shapes = {k: list(v.shape) for k, v in feeds.items()}
        hint = ""
        if any(w in msg.lower() for w in ("shape", "dimension", "size", "broadcast")):
            hint = (" (a model that runs only at the size it was exported with needs "
                    "calibration data of that size, or --batch N)")
        raise PrecondError(f"onnxruntime could not run the model on the calibration batch "
                           f"(shapes {shapes}): {msg[:400]}{hint}") from None


def output_std(arr: np.ndarray) -> tuple[float, int]:
    """Population std (correction 0) in float64 (``core.calibration.masked_std``: over the
    finite entries when the others are -inf, a mask; NaN for NaN/+inf), and how many masked
    entries it left out."""
    a = np.asarray(arr)
    if a.size < 2:
        raise PrecondError(f"the main output has {a.size} element(s): its std is undefined; use "
                           f"a calibration batch with more samples or pass target_std=None")
    return masked_std(a)


_ORT_DTYPES = {np.dtype(t) for t in (np.float32, np.float16, np.float64, np.int64, np.int32,
                                     np.int16, np.int8, np.uint8, np.uint16, np.uint32,
                                     np.uint64, np.bool_)}


def session_for_model(model: ir.Model) -> "object":
    """An ORT session on the in-memory model's calibration copy (Dropout training off).

    The weights are not serialized: large initializers go to ORT as OrtValues that share the
    numpy memory (``SessionOptions.add_external_initializers``), and the proto holds placeholders,
    so there is no copy and no 2 GB limit."""
    ort = _ort()
    g = model.graph
    swapped: list[tuple[ir.Value, object]] = []
    names: list[str] = []
    values: list[object] = []
    with dropout_training_off(model):
        try:
            for v in list(g.initializers.values()):
                t = v.const_value
                if t is None:
                    continue
                external = isinstance(t, ir.ExternalTensor)
                used = bool(list(v.uses())) or v.is_graph_output()
                if not external and (t.nbytes <= 1024 or not used):
                    continue
                arr = t.numpy()
                # into the proto: small tensors (shape inference reads the data of a Reshape's
                # shape, also when the file keeps it external), unused ones (onnxruntime drops
                # them, then refuses to replace them), types numpy cannot hand over (bfloat16)
                if t.nbytes <= 1024 or not used or arr.dtype not in _ORT_DTYPES:
                    if external:
                        swapped.append((v, t))
                        v.const_value = ir.tensor(arr, dtype=t.dtype, name=v.name)
                    continue
                names.append(v.name)
                values.append(ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr)))
                swapped.append((v, t))
                v.const_value = ir.ExternalTensor("precondfx_placeholder.bin", 0, t.nbytes,
                                                  t.dtype, shape=t.shape, name=v.name,
                                                  base_dir="")
            for v in _subgraph_initializers(model):
                t = v.const_value
                if isinstance(t, ir.ExternalTensor):    # no weights (normalize refuses them):
                    swapped.append((v, t))              # index tables, shapes; inline them
                    v.const_value = ir.tensor(t.numpy(), dtype=t.dtype, name=v.name)
            proto = ir.serde.serialize_model(model)
        finally:
            for v, t in swapped:
                v.const_value = t
    so = ort.SessionOptions()
    so.log_severity_level = 4  # errors reach the user as PrecondError
    if names:
        so.add_external_initializers(names, values)
    try:
        sess = ort.InferenceSession(proto.SerializeToString(), so, providers=PROVIDERS)
    except Exception as e:
        raise _load_error(e) from None
    sess._precondfx_keepalive = values  # the OrtValues must outlive the session
    return sess


def _subgraph_initializers(model: ir.Model) -> list[ir.Value]:
    """The initializers of the subgraphs (If branches, Loop and Scan bodies): a session built
    from bytes cannot read their external data, and ``add_external_initializers`` reaches the
    main graph's only."""
    from precondfx.onnx.io import all_initializers
    main = set(map(id, model.graph.initializers.values()))
    return [v for v in all_initializers(model) if id(v) not in main]


def measure_model(model: ir.Model, feeds: Mapping[str, np.ndarray], output: str
                  ) -> tuple[float, tuple[int, ...], int, tuple[float, bool]]:
    """Output std and shape of the in-memory model on the feed (Dropout training off), the
    number of masked (-inf) output entries the std left out, and how constant the output is
    (``core.calibration.constancy``: the std rounding alone gives it, and whether every
    sample holds the same values), as the PyTorch back end measures it."""
    sess = session_for_model(model)
    y = run(sess, feeds, [output])[0]
    std, masked = output_std(y)
    a = np.asarray(y)
    const = constancy(a, float(np.finfo(a.dtype).eps)) if a.dtype.kind in "fc" else (0.0, False)
    return std, tuple(np.shape(y)), masked, const


def dropout_training_off(model: ir.Model) -> Any:
    """Context manager for the calibration copy: every Dropout with a ``training_mode`` input
    reads a constant False while it is active (ORT otherwise may or may not drop)."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        changed: list[tuple[ir.Node, ir.Value]] = []
        false = None
        try:
            for node in ir.traversal.RecursiveGraphIterator(model.graph):
                if node.op_type != "Dropout" or len(node.inputs) < 3 or node.inputs[2] is None:
                    continue
                if false is None:
                    t = ir.tensor(np.array(False), dtype=ir.DataType.BOOL,
                                  name=f"{PREFIX}calibration_false")
                    false = ir.Value(name=f"{PREFIX}calibration_false", shape=ir.Shape([]),
                                     type=ir.TensorType(ir.DataType.BOOL), const_value=t)
                    model.graph.register_initializer(false)
                changed.append((node, node.inputs[2]))
                node.replace_input_with(2, false)
            yield len(changed)
        finally:
            for node, old in changed:
                node.replace_input_with(2, old)
            if false is not None:
                model.graph.initializers.pop(false.name)
    return cm()
