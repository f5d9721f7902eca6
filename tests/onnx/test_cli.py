"""The ``precondfx`` command line: exit codes, messages, calibration data, files written.

Most cases call ``precondfx.cli.main([...])`` in-process; two run ``python -m precondfx`` to
check the module entry point and the real process exit code.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from precondfx.cli import main
from precondfx.core.report import Report

RNG = np.random.default_rng(7)


def _w(name, shape):
    return numpy_helper.from_array((RNG.standard_normal(shape) * 0.2).astype(np.float32), name)


def mlp2(path, external=False):
    """Two inputs: y = W3 relu(W1 a + W2 b)."""
    nodes = [helper.make_node("Gemm", ["a", "w1", "b1"], ["ha"], name="fa", transB=1),
             helper.make_node("Gemm", ["b", "w2", "b2"], ["hb"], name="fb", transB=1),
             helper.make_node("Add", ["ha", "hb"], ["h"], name="merge"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "w3", "b3"], ["y"], name="out", transB=1)]
    g = helper.make_graph(nodes, "mlp2", [
        helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", 6]),
        helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5])],
        [_w("w1", (16, 6)), _w("b1", (16,)), _w("w2", (16, 4)), _w("b2", (16,)),
         _w("w3", (5, 16)), _w("b3", (5,))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    if external:
        onnx.save_model(m, str(path), save_as_external_data=True, location="weights.bin",
                        size_threshold=0)
    else:
        onnx.save(m, str(path))
    return str(path)


def fcn(path):
    """x[batch,3,h,w] -> Conv -> Relu -> MaxPool2 -> Conv(4) -> y[batch,4,?,?]"""
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], name="conv1", kernel_shape=[3, 3],
                              pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2],
                              strides=[2, 2]),
             helper.make_node("Conv", ["p", "w2"], ["y"], name="conv2", kernel_shape=[1, 1])]
    g = helper.make_graph(nodes, "fcn", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, "ho", "wo"])],
        [_w("w1", (8, 3, 3, 3)), _w("w2", (4, 8, 1, 1))])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def feeds2(n, seed=0):
    r = np.random.default_rng(seed)
    return {"a": r.standard_normal((n, 6)).astype(np.float32),
            "b": r.standard_normal((n, 4)).astype(np.float32)}


def run(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("precondfx: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# ---------------------------------------------------------------------------------------------
def test_precondition_npz_by_name_and_report(tmp_path, capsys):
    src = mlp2(tmp_path / "m.onnx")
    calib = tmp_path / "calib.npz"
    np.savez(calib, **feeds2(400, seed=1))
    out, rep = tmp_path / "o.onnx", tmp_path / "r.json"
    assert main(["precondition", src, "-o", str(out), "--calib", str(calib), "--report",
                 str(rep), "--target-std", "0.1"]) == 0
    cap = capsys.readouterr()
    assert "precondfx report" in cap.out and "[precondfx" in cap.err
    assert "random" not in cap.err
    y = run(out, feeds2(2000, seed=2))[0]
    assert abs(y.std() / 0.1 - 1) < 0.05
    d = json.loads(rep.read_text())
    assert d["target_std"] == 0.1 and d["output_std_after"] == pytest.approx(0.1)
    assert set(d["stage_seconds"]) >= {"load", "capture", "plan", "apply", "reinit",
                                       "calibrate", "save", "verify", "total"}
    assert {r["name"]: r["status"] for r in d["nodes"]}["fa"] == "weighted"
    back = Report.load(rep)            # the ONNX report reads back to the same JSON
    assert json.loads(back.to_json()) == d
    assert back.output_scale == pytest.approx(0.1 / back.output_std_before)


def test_calib_positional_npz_and_calib_input(tmp_path, capsys):
    src = mlp2(tmp_path / "m.onnx")
    f = feeds2(64, seed=3)
    np.savez(tmp_path / "pos.npz", f["a"], f["b"])          # arr_0, arr_1 = inputs in order
    np.save(tmp_path / "a.npy", f["a"])
    np.save(tmp_path / "b.npy", f["b"])
    outs = []
    for k, extra in enumerate((["--calib", str(tmp_path / "pos.npz")],
                               ["--calib-input", f"a={tmp_path / 'a.npy'}",
                                "--calib-input", f"b={tmp_path / 'b.npy'}"])):
        out = tmp_path / f"o{k}.onnx"
        assert main(["precondition", src, "-o", str(out), "--quiet", *extra]) == 0
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]                      # same data by either route, same file
    assert capsys.readouterr().err == ""           # --quiet: nothing on stderr


@pytest.mark.parametrize("args,needle", [
    (["--calib", "{d}/a.npy"], "needs a single-input model; inputs are ['a', 'b']"),
    (["--calib", "{d}/bad.npz"], "key 'c' matches no model input; the inputs are ['a', 'b']"),
    (["--calib-input", "q={d}/a.npy"], "no model input named 'q'"),
    (["--calib-input", "a"], "expects NAME=VALUE"),
    (["--calib", "{d}/missing.npy"], "calibration file not found"),
    (["--calib-input", "a={d}/wrong.npy", "--calib-input", "b={d}/b.npy"],
     "input 'a' dim 1: calibration 5 vs model 6"),
    (["--calib-input", "a={d}/a.npy", "--calib-input", "b={d}/b7.npy"],
     "symbolic dim 'batch' bound to 8 and 7"),
    (["--balance", "hessian"], "not available for ONNX"),
    (["--dim", "batch=x"], "must be an integer"),
])
def test_calibration_errors_exit_2(tmp_path, capsys, args, needle):
    src = mlp2(tmp_path / "m.onnx")
    np.save(tmp_path / "a.npy", np.zeros((8, 6), np.float32))
    np.save(tmp_path / "b.npy", np.zeros((8, 4), np.float32))
    np.save(tmp_path / "b7.npy", np.zeros((7, 4), np.float32))
    np.save(tmp_path / "wrong.npy", np.zeros((8, 5), np.float32))
    np.savez(tmp_path / "bad.npz", a=np.zeros((8, 6)), c=np.zeros(3))
    out = tmp_path / "o.onnx"
    args = [a.replace("{d}", str(tmp_path)) for a in args]
    assert main(["precondition", src, "-o", str(out), *args]) == 2
    assert needle in one_error_line(capsys.readouterr().err)
    assert not out.exists()


def test_random_inputs_symbolic_dims_and_notes(tmp_path, capsys):
    src = fcn(tmp_path / "fcn.onnx")
    out = tmp_path / "o.onnx"
    assert main(["precondition", src, "-o", str(out)]) == 2
    assert "--dim h=N" in one_error_line(capsys.readouterr().err)
    assert main(["precondition", src, "-o", str(out), "--dim", "h=16", "--dim", "w=16",
                 "--batch", "6"]) == 0
    err = capsys.readouterr().err
    assert "note: calibration used random N(0,1) inputs for x [6, 3, 16, 16]" in err
    m = onnx.load(str(out))
    assert [d.dim_param or d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim] \
        == ["batch", 3, "h", "w"]
    assert "MaxPool" not in [n.op_type for n in m.graph.node]
    y = run(out, {"x": np.ones((3, 3, 21, 34), np.float32)})[0]
    assert y.shape == (3, 4, 10, 17)       # MaxPool(2)'s floor geometry at odd sizes


def test_refuses_to_overwrite_input(tmp_path, capsys):
    src = mlp2(tmp_path / "m.onnx")
    before = open(src, "rb").read()
    assert main(["precondition", src, "-o", src]) == 2
    assert "refusing to write" in one_error_line(capsys.readouterr().err)
    alias = os.path.join(str(tmp_path), ".", "m.onnx")
    assert main(["precondition", src, "-o", alias]) == 2
    assert open(src, "rb").read() == before


def test_nan_in_calibration_leaves_nothing(tmp_path, capsys):
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="fc", transB=1),
             helper.make_node("Sqrt", ["h"], ["y"], name="sqrt")]
    g = helper.make_graph(nodes, "nan", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["n", 3])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, ["n", 4])], [_w("w", (4, 3)), _w("b", (4,))])
    src = tmp_path / "nan.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    out = tmp_path / "out.onnx"
    assert main(["precondition", str(src), "-o", str(out), "--quiet"]) == 2
    assert "NaN" in one_error_line(capsys.readouterr().err)
    assert sorted(os.listdir(tmp_path)) == ["nan.onnx"]


def test_corrupt_truncated_missing(tmp_path, capsys):
    src = mlp2(tmp_path / "m.onnx")
    data = open(src, "rb").read()
    (tmp_path / "t.onnx").write_bytes(data[: len(data) // 2])
    (tmp_path / "c.onnx").write_bytes(bytes(range(256)) * 4)
    for name in ("t.onnx", "c.onnx", "missing.onnx"):
        for cmd in (["inspect", str(tmp_path / name)],
                    ["precondition", str(tmp_path / name), "-o", str(tmp_path / "o.onnx")]):
            assert main(cmd) == 2, (name, cmd)
            line = one_error_line(capsys.readouterr().err)
            assert name in line
    assert not (tmp_path / "o.onnx").exists()


def test_inspect_reports_unknown_op(tmp_path, capsys):
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="fc", transB=1),
             helper.make_node("Hardmax", ["h"], ["y"], name="hm")]
    g = helper.make_graph(nodes, "u", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["n", 3])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, ["n", 4])], [_w("w", (4, 3)), _w("b", (4,))])
    src = tmp_path / "u.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    assert main(["inspect", str(src), "--report", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("hm "))
    assert "unknown" in row
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["counts"]["unknown"] == 1
    # preconditioning still runs (ORT knows Hardmax); the op is reported, not fatal
    assert main(["precondition", str(src), "-o", str(tmp_path / "o.onnx"), "--quiet"]) == 0


def test_external_data_round_trip(tmp_path):
    src = mlp2(tmp_path / "m.onnx", external=True)
    out = tmp_path / "o.onnx"
    assert main(["precondition", src, "-o", str(out), "--quiet", "--batch", "64"]) == 0
    assert (tmp_path / "o.onnx.data").exists()
    onnx.checker.check_model(str(out), full_check=True)
    assert run(out, feeds2(3))[0].shape == (3, 5)
    out2 = tmp_path / "inline.onnx"
    assert main(["precondition", src, "-o", str(out2), "--quiet", "--external-data",
                 "never", "--batch", "64"]) == 0
    assert not (tmp_path / "inline.onnx.data").exists()
    np.testing.assert_array_equal(run(out2, feeds2(3))[0], run(out, feeds2(3))[0])


def test_no_reinit_cli(tmp_path):
    src = mlp2(tmp_path / "m.onnx")
    np.savez(tmp_path / "c.npz", **feeds2(32, seed=5))
    out = tmp_path / "o.onnx"
    assert main(["precondition", src, "-o", str(out), "--quiet", "--no-reinit", "--balance",
                 "none", "--calib", str(tmp_path / "c.npz"), "--target-std", "0.05"]) == 0
    f = feeds2(32, seed=5)
    y0 = run(src, f)[0].astype(np.float64)
    scale = 0.05 / y0.std()
    np.testing.assert_allclose(run(out, f)[0], y0 * scale, rtol=1e-5, atol=1e-7)


def test_plot_flag(tmp_path, capsys):
    src = mlp2(tmp_path / "m.onnx")
    # ONNX: refused up front (the plots need PyTorch measurements); nothing is written
    assert main(["precondition", src, "-o", str(tmp_path / "o.onnx"), "--quiet", "--plot",
                 str(tmp_path / "p.png")]) == 2
    assert "plotting is not available" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o.onnx").exists() and not (tmp_path / "p.png").exists()
    if not callable(getattr(Report, "plot", None)):
        return
    pytest.importorskip("matplotlib")
    code = main(["precondition", "tests.zoo:mlp", "-o", str(tmp_path / "m.pt"), "--quiet",
                 "--balance", "analytic", "--plot", str(tmp_path / "p.png")])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_usage_errors_and_internal_error(tmp_path, capsys, monkeypatch):
    assert main([]) == 2
    assert main(["precondition", "x.onnx"]) == 2          # -o is required
    assert main(["precondition", mlp2(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx"),
                 "--maxpool", "bogus"]) == 2
    capsys.readouterr()

    def boom(*a, **k):
        raise RuntimeError("simulated bug")
    monkeypatch.setattr("precondfx.onnx.reinit.reinit", boom)
    assert main(["precondition", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "o.onnx"),
                 "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "simulated bug" in err
    assert not (tmp_path / "o.onnx").exists()


def test_pytorch_entry_state_dict_and_onnx(tmp_path, capsys):
    pt = tmp_path / "m.pt"
    assert main(["precondition", "tests.zoo:maxpool_cnn", "-o", str(pt), "--quiet",
                 "--balance", "analytic"]) == 0
    sd = torch.load(pt)
    assert sd["conv2.weight"].shape == (16, 8, 3, 3)
    # geometric init divided by alpha: std = sqrt(2 / (9 sqrt(8*16))) * 9^(1/4)
    expected = (2 / (9 * (8 * 16) ** 0.5)) ** 0.5 * 9 ** 0.25
    assert float(sd["conv2.weight"].std()) == pytest.approx(expected, rel=0.1)
    ox = tmp_path / "m.onnx"
    assert main(["precondition", "tests.zoo:mlp", "--sample-shape", "64x100", "-o",
                 str(ox), "--quiet", "--balance", "none"]) == 0
    assert "random N(0,1) inputs of shape 64x100" in capsys.readouterr().err
    y = run(ox, {ort.InferenceSession(str(ox)).get_inputs()[0].name:
                 np.random.default_rng(0).standard_normal((3, 100)).astype(np.float32)})[0]
    assert y.shape == (3, 10)
    assert main(["precondition", "nosuch_module_xyz:build", "-o", str(pt)]) == 2
    assert "cannot import module" in one_error_line(capsys.readouterr().err)


def test_flags_come_from_the_option_definition(tmp_path, capsys):
    """Every CLI option flag is built from precondfx.core.options; a scheme's override is noted and
    the ONNX back end refuses what needs PyTorch, before reading the file."""
    rep = tmp_path / "r.json"
    assert main(["precondition", "tests.zoo:mlp", "-o", str(tmp_path / "m.pt"), "--quiet",
                 "--scheme", "gne", "--calibration", "eval", "--report", str(rep)]) == 0
    d = json.loads(rep.read_text())
    assert d["plan"]["options"]["balance"] == "none" and d["plan"]["options"]["scheme"] == "gne"
    assert any("balance='auto' -> 'none' (scheme gne)" in n for n in d["capture_notes"])
    capsys.readouterr()
    src = mlp2(tmp_path / "m.onnx")
    assert main(["precondition", src, "-o", str(tmp_path / "o.onnx"), "--scheme", "lsuv"]) == 2
    assert "scheme= other than 'geometric'" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o.onnx").exists()
    assert main(["precondition", "tests.zoo:mlp", "-o", str(tmp_path / "m.pt"),
                 "--seed", "1.5"]) == 2
    assert "pass an int" in capsys.readouterr().err


def test_module_entry_point(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    # the two processes run side by side (each spends ~2.5 s importing torch)
    demo, inspect = (subprocess.Popen([sys.executable, "-m", "precondfx", *args],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env)
                     for args in (["demo", "--quiet"], ["inspect", str(tmp_path / "nope.onnx")]))
    out, err = demo.communicate(timeout=120)
    assert demo.returncode == 0, err
    assert "precondfx report" in out and "folded into" in out
    _, err = inspect.communicate(timeout=120)
    assert inspect.returncode == 2
    assert one_error_line(err).endswith("nope.onnx")


def test_unknown_dim_and_non_onnx_output_refused(tmp_path, capsys):
    src = fcn(tmp_path / "fcn.onnx")
    out = tmp_path / "o.onnx"
    for cmd in (["precondition", src, "-o", str(out)], ["inspect", src]):
        assert main([*cmd, "--dim", "h=16", "--dim", "w=16", "--dim", "foo=3"]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "--dim foo=3" in line and "'foo'" in line and "batch, h, w" in line
    assert not out.exists()
    txt = tmp_path / "out.txt"
    assert main(["precondition", src, "-o", str(txt), "--dim", "h=16", "--dim", "w=16"]) == 2
    assert ".onnx" in one_error_line(capsys.readouterr().err)
    assert sorted(os.listdir(tmp_path)) == ["fcn.onnx"]


def test_onnxruntime_log_lines_stay_out(tmp_path, monkeypatch):
    # an unused initializer makes onnxruntime log a coloured warning at its default severity
    src = mlp2(tmp_path / "m.onnx")
    m = onnx.load(src)
    m.graph.initializer.append(_w("unused", (7,)))
    onnx.save(m, src)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "precondfx", "precondition", src, "-o",
                        str(tmp_path / "o.onnx"), "--batch", "16"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    for stream in (r.stdout, r.stderr):
        assert "onnxruntime:" not in stream and "\x1b[" not in stream, stream
    # the process-wide default logger (messages before any session exists) is set to ERROR
    seen = []
    monkeypatch.setattr(ort, "set_default_logger_severity", seen.append)
    assert main(["precondition", src, "-o", str(tmp_path / "o2.onnx"), "--quiet", "--batch",
                 "16"]) == 0
    assert seen == [3]


def test_pt_output_loads_with_weights_only_and_says_how(tmp_path, capsys):
    import precondfx
    from tests import zoo
    pt = tmp_path / "m.pt"
    assert main(["precondition", "tests.zoo:maxpool_cnn", "-o", str(pt),
                 "--balance", "analytic", "--seed", "4"]) == 0
    err = capsys.readouterr().err
    assert "state_dict" in err and "weights_only=False" in err
    sd = torch.load(pt)                       # torch's default weights_only=True
    # the recipe: rebuild the same rewrite, load the saved state into it
    model, sample = zoo.build("maxpool_cnn")
    again, _ = precondfx.precondition(model, sample, balance="analytic", seed=0)
    again.load_state_dict(sd)
    assert all(torch.equal(v, sd[k]) for k, v in again.state_dict().items())
    assert float(sd["precondfx_output_scale"]) != 1.0
