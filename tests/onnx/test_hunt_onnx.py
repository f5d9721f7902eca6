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


def test_feeds_as_one_array_or_a_list_in_input_order(tmp_path):
    """``feeds=`` as one array (the API twin of ``--calib x.npy``) raised numpy's 'truth value of
    an array is ambiguous'; a list raised dict()'s 'update sequence element' error.  Now one array
    feeds a single-input model and a list feeds the inputs in order (as arr_0, arr_1...)."""
    src = _mlp(tmp_path / "one.onnx")
    x = RNG.standard_normal((64, 10)).astype(np.float32)
    by_name = precondition_onnx(src, str(tmp_path / "a.onnx"), feeds={"x": x})
    one = precondition_onnx(src, str(tmp_path / "b.onnx"), feeds=x)
    assert one.output_scale == pytest.approx(by_name.output_scale, rel=1e-12)
    assert np.std(_run(tmp_path / "b.onnx", {"x": x}).astype(np.float64)) == \
        pytest.approx(1.0, rel=1e-3)
    assert not any("random" in n for n in one.capture_notes)

    src2 = _mlp(tmp_path / "two.onnx", inputs=("a", "b"))
    a, b = (RNG.standard_normal((64, 10)).astype(np.float32) for _ in range(2))
    named = precondition_onnx(src2, str(tmp_path / "c.onnx"), feeds={"a": a, "b": b})
    listed = precondition_onnx(src2, str(tmp_path / "d.onnx"), feeds=[a, b])
    swapped = precondition_onnx(src2, str(tmp_path / "e.onnx"), feeds=[b, a])
    assert listed.output_scale == pytest.approx(named.output_scale, rel=1e-12)
    assert swapped.output_scale != pytest.approx(named.output_scale, rel=1e-6)
    y = _run(tmp_path / "d.onnx", {"a": a, "b": b}).astype(np.float64)
    assert np.std(y) == pytest.approx(1.0, rel=1e-3)

    with pytest.raises(PrecondError, match=r"one array.*single-input.*\['a', 'b'\]"):
        precondition_onnx(src2, str(tmp_path / "f.onnx"), feeds=a)
    with pytest.raises(PrecondError, match=r"one array per model input.*3 item"):
        precondition_onnx(src2, str(tmp_path / "g.onnx"), feeds=[a, b, a])
    with pytest.raises(PrecondError, match=r"feeds= must map input names.*got int"):
        precondition_onnx(src2, str(tmp_path / "h.onnx"), feeds=5)
    assert not (tmp_path / "f.onnx").exists() and not (tmp_path / "h.onnx").exists()


def test_a_model_object_instead_of_a_path_is_refused_with_the_fix(tmp_path):
    """``precondition_onnx(onnx.load(p), ...)`` raised os.fspath's bare TypeError."""
    src = _mlp(tmp_path / "m.onnx")
    with pytest.raises(PrecondError, match=r"input model must be a path.*ModelProto.*onnx\.save"):
        precondition_onnx(onnx.load(src), str(tmp_path / "out.onnx"))
    with pytest.raises(PrecondError, match=r"output must be a path.*ModelProto"):
        precondition_onnx(src, onnx.load(src))
    assert not (tmp_path / "out.onnx").exists()


def test_calibration_file_that_is_not_numpy(tmp_path, capsys):
    """``--calib model.onnx`` (any non-NumPy file) was reported as 'pickled (object) data ... load
    it unsafely using allow_pickle=': the file is not NumPy data at all."""
    src = _mlp(tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    (tmp_path / "batch.csv").write_text("1,2,3\n")
    for bad in (src, str(tmp_path / "batch.csv")):
        assert main(["precondition", src, "-o", str(out), "--calib", bad, "--quiet"]) == 2
        err = capsys.readouterr().err
        assert "cannot read calibration file" in err and "as .npy: it is not NumPy data" in err
        assert "np.save" in err, err
        assert "pickle" not in err and "Traceback" not in err
        assert not out.exists()
    np.save(tmp_path / "ok.npy", RNG.standard_normal((32, 10)).astype(np.float32))
    assert main(["precondition", src, "-o", str(out), "--calib", str(tmp_path / "ok.npy"),
                 "--quiet"]) == 0


def test_bool_input_takes_booleans_or_0_1_only(tmp_path):
    """Float calibration data for a BOOL mask input was cast with astype(bool): random normal
    values all became True without a word, and the output scale was fitted to an all-ones
    mask."""
    nodes = [helper.make_node("Cast", ["mask"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["x", "mf"], ["xm"]),
             helper.make_node("MatMul", ["xm", "w1"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    g = helper.make_graph(nodes, "masked", [_vi("x", ["N", 10]),
                                            _vi("mask", ["N", 10], TensorProto.BOOL)],
                          [_vi("y", ["N", 4])], [_w("w1", (10, 16)), _w("w2", (16, 4))])
    src = str(tmp_path / "masked.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    x = RNG.standard_normal((64, 10)).astype(np.float32)
    with pytest.raises(PrecondError, match=r"'mask' is BOOL.*booleans or 0/1.*float64 with other"):
        precondition_onnx(src, str(tmp_path / "bad.onnx"),
                          feeds={"x": x, "mask": RNG.standard_normal((64, 10))})
    assert not (tmp_path / "bad.onnx").exists()
    mask = RNG.random((64, 10)) < 0.3
    for given in (mask, mask.astype(np.float32), mask.astype(np.int64)):
        rep = precondition_onnx(src, str(tmp_path / "ok.onnx"), feeds={"x": x, "mask": given})
        y = _run(tmp_path / "ok.onnx", {"x": x, "mask": mask}).astype(np.float64)
        assert np.std(y) == pytest.approx(1.0, rel=1e-3)
        assert rep.output_std_after == pytest.approx(1.0, rel=1e-6)


def test_overflow_with_kept_weights_is_not_blamed_on_reinitialization(tmp_path):
    """With reinit_weights=False the NaN/inf output is the model's own (here an fp16 model that
    overflows on the batch), yet the error said 'after re-initialization'."""
    src = _mlp(tmp_path / "fp16.onnx", elem=TensorProto.FLOAT16, dtype=np.float16, scale=30.0,
               hidden=256)
    x = RNG.standard_normal((64, 10)).astype(np.float16)
    assert not np.isfinite(_run(src, {"x": x})).all()     # the input model overflows
    with pytest.raises(PrecondError, match=r"NaN/inf.*own weights kept \(reinit_weights=False\)"
                       ) as e:
        precondition_onnx(src, str(tmp_path / "out.onnx"), feeds={"x": x},
                          reinit_weights=False)
    assert "after re-initialization" not in str(e.value)
    assert not (tmp_path / "out.onnx").exists()
    rep = precondition_onnx(src, str(tmp_path / "out.onnx"), feeds={"x": x})  # re-initialized
    assert rep.output_std_after == pytest.approx(1.0, rel=2e-3)


def test_a_folder_named_like_the_weights_file_is_refused_before_writing(tmp_path, capsys):
    """With external data, a folder named ``out.onnx.data`` made the final move fail with a raw
    '[Errno 21] Is a directory' naming the staging folder."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m"]), helper.make_node("Relu", ["m"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    g = helper.make_graph(nodes, "ext", [_vi("x", ["N", 32])], [_vi("y", ["N", 4])],
                          [_w("w1", (32, 64)), _w("w2", (64, 4))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = str(src_dir / "m.onnx")
    onnx.save(m, src, save_as_external_data=True, location="m.data", size_threshold=0)
    out = tmp_path / "out.onnx"
    (tmp_path / "out.onnx.data").mkdir()
    assert main(["precondition", src, "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "out.onnx.data beside the output, and a folder has that name" in err, err
    assert "Errno" not in err and ".precondfx-" not in err
    assert not out.exists() and (tmp_path / "out.onnx.data").is_dir()
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".precondfx")]
    (tmp_path / "out.onnx.data").rmdir()
    assert main(["precondition", src, "-o", str(out), "--quiet"]) == 0
    x = RNG.standard_normal((32, 32)).astype(np.float32)
    assert (tmp_path / "out.onnx.data").is_file()
    assert np.isfinite(_run(out, {"x": x})).all()


def test_loop_holding_weights_is_refused_with_loop_advice(tmp_path):
    """A Loop (unnamed, as helper-built and some converted files have them) with a weight in its
    body was refused with 'node '?'' and the If advice 'export the model with the branch
    fixed'."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h_in", "wl"], ["mm"]), helper.make_node("Tanh", ["mm"], ["h_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [_vi("i", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL), _vi("h_in", None)],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("h_out", None)])
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m"]),
             helper.make_node("Loop", ["trip", "cond", "m"], ["r"], body=body),
             helper.make_node("MatMul", ["r", "w2"], ["y"])]
    inits = [_w("w1", (10, 16)), _w("wl", (16, 16)), _w("w2", (16, 4)),
             numpy_helper.from_array(np.array(3, np.int64), "trip"),
             numpy_helper.from_array(np.array(True), "cond")]
    g = helper.make_graph(nodes, "loop", [_vi("x", ["N", 10])], [_vi("y", ["N", 4])], inits)
    src = str(tmp_path / "loop.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), src)
    with pytest.raises(PrecondError, match=r"Loop node \(unnamed, node #1\) holds weights.*"
                                           r"MatMul reading wl.*loop unrolled") as e:
        precondition_onnx(src, str(tmp_path / "out.onnx"))
    assert "'?'" not in str(e.value) and "branch fixed" not in str(e.value)
    assert not (tmp_path / "out.onnx").exists()


def _shared_weight_residual(path):
    """W is the first layer (outside the residual branch: alpha s/sqrt(1+s^2)) and the branch's
    first layer (alpha 1): y = Wo (h + W2 relu(h W)), h = relu(x W)."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"]), helper.make_node("Relu", ["a"], ["h"]),
             helper.make_node("MatMul", ["h", "W"], ["b"]), helper.make_node("Relu", ["b"], ["br"]),
             helper.make_node("MatMul", ["br", "W2"], ["b2"]),
             helper.make_node("Add", ["h", "b2"], ["j"]),
             helper.make_node("MatMul", ["j", "Wo"], ["y"])]
    g = helper.make_graph(nodes, "shared", [_vi("x", ["N", 16])], [_vi("y", ["N", 4])],
                          [_w("W", (16, 16)), _w("W2", (16, 16)), _w("Wo", (16, 4))])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def test_kept_weight_shared_by_layers_with_different_alphas_keeps_the_function(tmp_path):
    """reinit_weights=False divides a weight by its first layer's constant (alpha 0.707 here);
    a second layer using the same weight kept its own alpha (1), so it computed with W/0.707
    and the output changed by 8% (the PyTorch path too: core.plan).  Both layers now take
    the first's constant; the output is the original's times the output scale."""
    src = _shared_weight_residual(tmp_path / "shared.onnx")
    x = RNG.standard_normal((64, 16)).astype(np.float32)
    out = tmp_path / "out.onnx"
    rep = precondition_onnx(src, str(out), feeds={"x": x}, reinit_weights=False,
                            balance="analytic")
    alphas = {lay.node: lay.alpha for lay in rep.plan.layers if lay.weight == "W"}
    assert len(alphas) == 2 and len(set(round(a, 12) for a in alphas.values())) == 1
    assert list(alphas.values())[0] == pytest.approx(2 ** -0.5)
    assert any("shares its weight W" in lay.alpha_reason for lay in rep.plan.layers)
    y0 = _run(src, {"x": x}).astype(np.float64)
    y1 = _run(out, {"x": x}).astype(np.float64)
    np.testing.assert_allclose(y1, rep.output_scale * y0, rtol=1e-5,
                               atol=1e-5 * np.abs(rep.output_scale * y0).max())
    assert np.std(y1) == pytest.approx(1.0, rel=1e-4)
    # re-initialized, the plan is as before: the second use keeps its own alpha
    rep2 = precondition_onnx(src, str(tmp_path / "re.onnx"), feeds={"x": x}, balance="analytic")
    assert sorted(round(lay.alpha, 6) for lay in rep2.plan.layers if lay.weight == "W") == \
        [round(2 ** -0.5, 6), 1.0]


def test_pytorch_tied_weight_kept_keeps_the_function():
    """The same on the PyTorch path: a Linear weight tied to a residual-branch Linear."""
    import copy

    import torch
    from torch import nn

    import precondfx

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b1, self.b2, self.o = (nn.Linear(16, 16), nn.Linear(16, 16),
                                                nn.Linear(16, 16), nn.Linear(16, 4))
            self.b1.weight = self.a.weight

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.o(h + self.b2(torch.relu(self.b1(h))))

    torch.manual_seed(0)
    m = Tied().eval()
    x = torch.randn(64, 16)
    y0 = m(x).detach().double()
    pm, rep = precondfx.precondition(copy.deepcopy(m), x, reinit_weights=False,
                                     balance="analytic", target_std=None)
    y1 = pm(x).detach().double()
    assert float((y1 - y0).abs().max() / y0.abs().max()) < 1e-5
    assert pm.a.weight is pm.b1.weight


def _conv_weight_read_elsewhere(path, as_output):
    """A 3x3 conv (alpha 9^-1/4 under balance='analytic') whose weight is also read outside the
    layer: its mean added after the conv, or returned as a second graph output."""
    nodes = [helper.make_node("Conv", ["x", "Wc"], ["c"], pads=[1, 1, 1, 1])]
    inits = [_w("Wc", (8, 3, 3, 3)), _w("Wf", (4, 8))]
    if as_output:
        nodes.append(helper.make_node("Relu", ["c"], ["r"]))
    else:
        nodes += [helper.make_node("ReduceMean", ["Wc"], ["wm"], axes=[1, 2, 3], keepdims=1),
                  helper.make_node("Reshape", ["wm", "shp"], ["wmr"]),
                  helper.make_node("Add", ["c", "wmr"], ["cb"]),
                  helper.make_node("Relu", ["cb"], ["r"])]
        inits.append(numpy_helper.from_array(np.array([1, 8, 1, 1], np.int64), "shp"))
    nodes += [helper.make_node("GlobalAveragePool", ["r"], ["g"]),
              helper.make_node("Flatten", ["g"], ["f"]),
              helper.make_node("Gemm", ["f", "Wf"], ["y"], transB=1)]
    outs = [_vi("y", ["N", 4])] + ([_vi("Wc", [8, 3, 3, 3])] if as_output else [])
    g = helper.make_graph(nodes, "dual", [_vi("x", ["N", 3, 6, 6])], outs, inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return str(path)


@pytest.mark.parametrize("as_output", [False, True], ids=["read_by_a_node", "graph_output"])
def test_kept_weight_read_outside_its_layer_is_not_rescaled(tmp_path, as_output):
    """reinit_weights=False divided the conv weight by its alpha (0.577) and put alpha on the
    conv's input: the conv was unchanged, but whatever else read the weight saw it 1.73x larger
    (the added mean: the output changed by 2%; a graph output returning the weight: 1.73x).
    Such a weight now gets no constant (core.plan; the ONNX capture shows weights returned as
    graph outputs on its output node)."""
    src = _conv_weight_read_elsewhere(tmp_path / "dual.onnx", as_output)
    x = RNG.standard_normal((32, 3, 6, 6)).astype(np.float32)
    out = tmp_path / "out.onnx"
    rep = precondition_onnx(src, str(out), feeds={"x": x}, reinit_weights=False,
                            balance="analytic")
    conv = next(lay for lay in rep.plan.layers if lay.weight == "Wc")
    assert conv.alpha == 1.0 and "also read by" in conv.alpha_reason
    s0 = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    s1 = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    o0 = dict(zip([o.name for o in s0.get_outputs()], s0.run(None, {"x": x})))
    o1 = dict(zip([o.name for o in s1.get_outputs()], s1.run(None, {"x": x})))
    np.testing.assert_allclose(o1["y"], rep.output_scale * o0["y"], rtol=1e-5,
                               atol=1e-5 * np.abs(rep.output_scale * o0["y"]).max())
    if as_output:
        np.testing.assert_array_equal(o1["Wc"], o0["Wc"])
    # re-initialized, the conv keeps its kernel alpha
    rep2 = precondition_onnx(src, str(tmp_path / "re.onnx"), feeds={"x": x}, balance="analytic")
    assert next(lay for lay in rep2.plan.layers if lay.weight == "Wc").alpha == \
        pytest.approx(9 ** -0.25)


@pytest.mark.parametrize("kw, words", [({"verify": "no"}, "verify='no' must be True or False"),
                                       ({"verbose": 1}, "verbose=1 must be True or False"),
                                       ({"balance_samples": 4}, "balance_samples="),
                                       ({"balance_threshold": 3.0}, "balance_threshold=")])
def test_options_that_would_be_swallowed_are_refused(tmp_path, kw, words):
    """A non-bool ``verify``/``verbose`` (``"no"`` is truthy: it verified) and the measured
    balancing options, which the ONNX back end never reads, are refused; nothing is written."""
    src, out = str(tmp_path / "m.onnx"), str(tmp_path / "o.onnx")
    _mlp(src)
    before = _sha(src)
    with pytest.raises(PrecondError, match=words):
        precondition_onnx(src, out, **kw)
    assert not os.path.exists(out) and _sha(src) == before
    if "balance_samples" in kw:       # the command line says the same, exit code 2
        assert main(["precondition", src, "-o", out, "--balance-samples", "4"]) == 2
        assert not os.path.exists(out)
