"""Defects found by a robustness hunt over ONNX files the project had not seen (exports of varied
models with both exporters, helper-built graphs): each test builds a small model in place and
fails without its fix."""
from __future__ import annotations

import hashlib
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from precondfx.cli import main
from precondfx.errors import PrecondError
from precondfx.onnx import precondition_onnx

RNG = np.random.default_rng(11)


def _w(name, shape, scale=0.3, dtype=np.float32):
    return numpy_helper.from_array((RNG.standard_normal(shape) * scale).astype(dtype), name)


def _vi(name, shape, t=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, t, shape)


def _mlp(path, opset=17, inputs=("x",), n_in=10, elem=TensorProto.FLOAT, dtype=np.float32,
         scale=0.3, hidden=16):
    """y = relu(sum_i x_i W1_i) W2, one (batch, n_in) input per name."""
    nodes, inits = [], []
    for i, name in enumerate(inputs):
        nodes.append(helper.make_node("MatMul", [name, f"w1_{i}"], [f"m{i}"]))
        inits.append(_w(f"w1_{i}", (n_in, hidden), scale, dtype))
    acc = "m0"
    for i in range(1, len(inputs)):
        nodes.append(helper.make_node("Add", [acc, f"m{i}"], [f"s{i}"]))
        acc = f"s{i}"
    nodes += [helper.make_node("Relu", [acc], ["r"]),
              helper.make_node("MatMul", ["r", "w2"], ["y"])]
    inits.append(_w("w2", (hidden, 4), scale, dtype))
    g = helper.make_graph(nodes, "mlp", [_vi(n, ["N", n_in], elem) for n in inputs],
                          [_vi("y", ["N", 4], elem)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return str(path)


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _run(path, feeds):
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)[0]


def test_opset_newer_than_onnxruntime_says_so_and_what_to_do(tmp_path, capsys):
    """A file stamped with an opset this onnxruntime does not know (a newer exporter) was
    reported as 'onnxruntime cannot load the rewritten model' with ORT's C++ signature: the
    input's opset is the cause, and re-exporting (or upgrading onnxruntime) the fix."""
    src = _mlp(tmp_path / "new.onnx", opset=99)
    before = _sha(src)
    out = tmp_path / "out.onnx"
    assert main(["precondition", src, "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if ln.startswith("precondfx: error")]
    assert len(line) == 1, err
    assert "opset 99" in line[0] and "'ai.onnx'" in line[0]
    assert "opset_version=" in line[0] and "upgrade onnxruntime" in line[0]
    assert "rewritten" not in line[0] and "Traceback" not in err
    assert "onnxruntime::" not in line[0]             # no C++ signature
    assert not out.exists() and _sha(src) == before
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".precondfx")]
