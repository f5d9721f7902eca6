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


def test_a_weight_fed_as_an_input_is_not_drawn_at_random(tmp_path):
    """A head whose weight the caller feeds (a graph input read as a MatMul's right operand,
    every dim fixed) beside a file that holds its other weights: the calibration filled it with
    N(0, 1) data, 8x the scale of the weight the caller feeds here, and fitted the output scale
    to that (the result's output std was 0.114, not 1, with the real weight).  Now random data
    is refused for it, with the flag that gives it; given, the output lands at the target."""
    rng = np.random.default_rng(0)
    m = _model([h.make_node("MatMul", ["x", "W"], ["h"]), h.make_node("Relu", ["h"], ["r"]),
                h.make_node("MatMul", ["r", "Whead"], ["y"])],
               [h.make_tensor_value_info("x", T.FLOAT, ["N", 8]),
                h.make_tensor_value_info("Whead", T.FLOAT, [64, 10])],
               [h.make_tensor_value_info("y", T.FLOAT, ["N", 10])],
               [nh.from_array(_arr(rng, 8, 64), "W")])
    src = tmp_path / "m.onnx"
    onnx.save(m, str(src))
    x, head = _arr(rng, 32, 8), _arr(rng, 64, 10, scale=1 / 8)
    out = tmp_path / "out.onnx"
    with pytest.raises(PrecondError, match=r"'Whead' is read as the weight of MatMul.*"
                                           r"--calib-input Whead=FILE.npy"):
        precondition_onnx(str(src), str(out), feeds={"x": x})
    assert not out.exists()
    precondition_onnx(str(src), str(out), feeds={"x": x, "Whead": head})
    y = ort.InferenceSession(str(out)).run(None, {"x": x, "Whead": head})[0]
    assert abs(float(y.std()) - 1.0) < 1e-4


def test_nan_output_from_a_random_float_input_names_the_input(tmp_path, capsys):
    """Logits plus log(gate) (0 where padded: -inf there) with only ``x`` given: the float
    input was filled with N(0, 1) data, log of its negative entries is NaN, and the error
    blamed the model ('NaN/inf values after re-initialization; check the model for numerical
    issues').  Now it names the random input and the flag that gives its data; with the input
    given the run succeeds.  (An input named as a mask, or read as one, gets ones instead:
    tests/onnx/test_hunt_onnx8.py.)"""
    rng = np.random.default_rng(0)
    m = _model([h.make_node("MatMul", ["x", "W"], ["h"]), h.make_node("Relu", ["h"], ["r"]),
                h.make_node("MatMul", ["r", "W2"], ["z"]), h.make_node("Log", ["gate"], ["lm"]),
                h.make_node("Add", ["z", "lm"], ["y"])],
               [h.make_tensor_value_info("x", T.FLOAT, ["N", 8]),
                h.make_tensor_value_info("gate", T.FLOAT, ["N", 4])],
               [h.make_tensor_value_info("y", T.FLOAT, ["N", 4])],
               [nh.from_array(_arr(rng, 8, 16), "W"), nh.from_array(_arr(rng, 16, 4), "W2")])
    src = tmp_path / "m.onnx"
    onnx.save(m, str(src))
    np.save(tmp_path / "x.npy", _arr(rng, 32, 8))
    np.save(tmp_path / "gate.npy", np.ones((32, 4), np.float32))
    out = str(tmp_path / "out.onnx")
    code = main(["precondition", str(src), "-o", out, "--calib-input",
                 f"x={tmp_path / 'x.npy'}", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert "gate [32, 4] were random N(0,1) data" in err and \
        "--calib-input gate=FILE.npy" in err, err
    assert not os.path.exists(out)
    code = main(["precondition", str(src), "-o", out, "--calib-input",
                 f"x={tmp_path / 'x.npy'}", "--calib-input", f"gate={tmp_path / 'gate.npy'}",
                 "--quiet"])
    assert code == 0, capsys.readouterr().err


def test_one_initializer_read_by_two_layers_is_reported_as_a_tie(tmp_path):
    """torch.onnx.export(dynamo=True) stores initializers with equal values once: the two
    layers of an nn.TransformerEncoder (deep copies of one layer) read the same out_proj
    weight and the same three MatMul weights, one initializer each.  precondfx drew each once,
    so the file's layers were tied (equal, and trained as one weight), without a word; the
    PyTorch model draws them apart.  This is that file's shape (one weight, two Gemm layers):
    the report now says which initializers several layers read, and how to export them
    apart."""
    rng = np.random.default_rng(0)
    w = nh.from_array(_arr(rng, 16, 16), "a.weight")
    m = _model([h.make_node("Gemm", ["x", "a.weight"], ["h1"], transB=1),
                h.make_node("Relu", ["h1"], ["r1"]),
                h.make_node("Gemm", ["r1", "a.weight"], ["h2"], transB=1),
                h.make_node("Relu", ["h2"], ["r2"]),
                h.make_node("Gemm", ["r2", "c.weight"], ["y"], transB=1)],
               [h.make_tensor_value_info("x", T.FLOAT, ["N", 16])],
               [h.make_tensor_value_info("y", T.FLOAT, ["N", 4])],
               [w, nh.from_array(_arr(rng, 4, 16), "c.weight")])
    src = tmp_path / "m.onnx"
    onnx.save(m, str(src))
    rep = precondition_onnx(str(src), str(tmp_path / "out.onnx"), feeds=_arr(rng, 32, 16))
    text = " ".join(str(rep).split())       # the report wraps at the terminal's width
    assert "'a.weight' (2 layers" in text and "optimize=False" in text, text
    assert "'c.weight' (" not in text


def test_external_data_never_writes_the_kept_tensors_inline(tmp_path, capsys):
    """A model saved with external data (its weights and a fixed sinusoidal position table
    buffer), rewritten with --external-data never into another folder: the tensors precondfx
    keeps (the table) were written as references to the input's data file, relative to the
    output's folder, and the run ended with 'the rewritten model fails onnx.checker ... (this
    is a precondfx bug ...)' (with --no-verify the file would read a data file that is not
    there).  Now every tensor is inline, the input folder is untouched and onnxruntime runs the
    output alone at the target std."""
    import torch
    import torch.nn as nn

    class PosMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            pos = torch.arange(32.0)[:, None] / 10000 ** (torch.arange(0.0, 16, 2) / 16)
            self.register_buffer("pe", torch.cat([pos.sin(), pos.cos()], dim=1))  # 2 KB
            self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x + self.pe)))

    torch.manual_seed(0)
    x = torch.randn(8, 32, 16)
    src_dir, out_dir = tmp_path / "src", tmp_path / "out"
    src_dir.mkdir()
    out_dir.mkdir()
    tmp = str(tmp_path / "tmp.onnx")
    torch.onnx.export(PosMLP().eval(), (x,), tmp, dynamo=False, input_names=["x"],
                      dynamic_axes={"x": {0: "batch"}})
    src = src_dir / "m.onnx"
    onnx.save(onnx.load(tmp), str(src), save_as_external_data=True, location="m.weights")
    assert _locations(src)["pe"] == "m.weights"
    before = _digest(src_dir)
    np.save(tmp_path / "x.npy", x.numpy())
    out = out_dir / "m_pc.onnx"
    code = main(["precondition", str(src), "-o", str(out), "--calib", str(tmp_path / "x.npy"),
                 "--external-data", "never", "--quiet"])
    assert code == 0, capsys.readouterr().err
    assert _digest(src_dir) == before
    assert sorted(os.listdir(out_dir)) == ["m_pc.onnx"]
    assert all(loc is None for loc in _locations(out).values())
    y = ort.InferenceSession(str(out)).run(None, {"x": x.numpy()})[0]
    assert abs(float(y.std()) - 1.0) < 1e-4


def test_a_softmax_of_the_logits_in_the_file_is_the_softmax_of_the_scaled_logits(tmp_path):
    """A classifier returning its logits (reshaped) and the softmax of the logits, exported
    with torch.onnx.export.  The output scale used to multiply the returned logits only, so
    the file's probabilities were no longer the softmax of its logits (max difference 0.29 on
    this batch) while the PyTorch back end scales the logits where they are computed; a note
    said so.  Now both back ends put the scale where the logits are computed
    (``core.outputs.scale_moves_up``): the file's probabilities are the softmax of its logits
    and no note is needed."""
    import torch
    import torch.nn as nn

    class LogitsAndProbs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Sequential(nn.Linear(16, 64), nn.ReLU()), nn.Linear(64, 6)

        def forward(self, x):
            z = self.head(self.body(x))
            return z.reshape(x.shape[0], 2, 3), torch.softmax(z, dim=-1)

    torch.manual_seed(0)
    model, x = LogitsAndProbs().eval(), torch.randn(32, 16)
    src = str(tmp_path / "m.onnx")
    torch.onnx.export(model, (x,), src, dynamo=False, input_names=["x"],
                      output_names=["logits", "probs"], dynamic_axes={"x": {0: "batch"}})
    out = str(tmp_path / "out.onnx")
    rep = precondition_onnx(src, out, feeds={"x": x.numpy()})
    logits, probs = ort.InferenceSession(out).run(["logits", "probs"], {"x": x.numpy()})
    z = logits.reshape(32, 6).astype(np.float64)
    soft = np.exp(z - z.max(-1, keepdims=True))
    soft /= soft.sum(-1, keepdims=True)
    np.testing.assert_allclose(probs, soft, atol=1e-5)
    assert abs(rep.output_scale - 1) > 0.1          # the softmax would change if unscaled
    assert np.std(logits) == pytest.approx(1.0, rel=1e-3)
    text = " ".join(str(rep).split())
    assert "multiplies the returned 'logits' only" not in text, text
