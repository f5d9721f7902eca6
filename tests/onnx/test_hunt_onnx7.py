"""Defects found by the seventh ONNX hunt (the command line and the ONNX back end); each test
fails without its fix."""
from __future__ import annotations

import hashlib
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from precondfx.cli import main
from precondfx.errors import PrecondError
from precondfx.onnx import precondition_onnx

ort = pytest.importorskip("onnxruntime")


def _arr(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _model(nodes, inputs, outputs, inits, opset=17):
    m = h.make_model(h.make_graph(nodes, "g", inputs, outputs, inits),
                     opset_imports=[h.make_opsetid("", opset)])
    onnx.checker.check_model(m, full_check=True)
    return m


def _digest(folder):
    return {p: hashlib.sha256((folder / p).read_bytes()).hexdigest()
            for p in sorted(os.listdir(folder)) if (folder / p).is_file()}


def _locations(path):
    from onnx.external_data_helper import _get_all_tensors
    m = onnx.load(str(path), load_external_data=False)
    return {t.name: {e.key: e.value for e in t.external_data}.get("location")
            for t in _get_all_tensors(m)}


def test_external_data_inside_an_if_branch_is_read_and_written(tmp_path):
    """An If branch holding an index table (no weight) that the file keeps in external data,
    as ``onnx.save(..., save_as_external_data=True)`` does for every tensor above the
    threshold: the calibration session (built from bytes) could not read it, and the run
    stopped with 'onnxruntime cannot load the rewritten model ... Data of TensorProto (perm)
    should be stored in if.bin, but it is not regular file'.  Now the branch's tensor is read,
    the output lands at the target std under onnxruntime in both branches' runs, and its data
    is in the output's own data file, not the input's."""
    rng = np.random.default_rng(0)
    perm = nh.from_array(np.arange(299, -1, -1, dtype=np.int64), "perm")     # 2400 bytes
    then = h.make_graph([h.make_node("Gather", ["r", "perm"], ["ya"], axis=1)], "then", [],
                        [h.make_tensor_value_info("ya", T.FLOAT, None)], [perm])
    other = h.make_graph([h.make_node("Identity", ["r"], ["yb"])], "else", [],
                         [h.make_tensor_value_info("yb", T.FLOAT, None)])
    m = _model([h.make_node("MatMul", ["x", "W"], ["h"]), h.make_node("Relu", ["h"], ["r"]),
                h.make_node("If", ["c"], ["p"], then_branch=then, else_branch=other),
                h.make_node("MatMul", ["p", "W2"], ["y"])],
               [h.make_tensor_value_info("x", T.FLOAT, ["N", 8]),
                h.make_tensor_value_info("c", T.BOOL, [])],
               [h.make_tensor_value_info("y", T.FLOAT, ["N", 4])],
               [nh.from_array(_arr(rng, 8, 300), "W"), nh.from_array(_arr(rng, 300, 4), "W2")])
    src_dir, out_dir = tmp_path / "src", tmp_path / "out"
    src_dir.mkdir()
    out_dir.mkdir()
    src = src_dir / "if.onnx"
    onnx.save(m, str(src), save_as_external_data=True, location="if.bin", size_threshold=1024)
    assert _locations(src)["perm"] == "if.bin"
    before = _digest(src_dir)
    feeds = {"x": _arr(rng, 32, 8), "c": np.array(True)}
    out = out_dir / "if_pc.onnx"
    rep = precondition_onnx(str(src), str(out), feeds=feeds)
    assert _digest(src_dir) == before
    assert _locations(out)["perm"] == "if_pc.onnx.data"
    sess = ort.InferenceSession(str(out))
    y = sess.run(None, feeds)[0]
    assert abs(float(y.std()) - 1.0) < 1e-4
    assert abs(rep.output_std_after - 1.0) < 1e-6
    assert sess.run(None, {**feeds, "c": np.array(False)})[0].shape == (32, 4)
