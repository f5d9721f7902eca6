"""The ONNX front end on models built here with onnx.helper (no torch export involved).

Expected values come from the paper's formulas written out in the tests (geometric init
``E[W^2] = 2/(k^2 sqrt(n_in n_out))``, alpha ``= (k^2)^(-1/4)``), from onnxruntime runs of the
original and rewritten files, and from the ONNX checker: never from precondfx itself.
"""
from __future__ import annotations

import hashlib
import math
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from precondfx.errors import PrecondError
from precondfx.onnx import inspect_onnx, precondition_onnx

RNG = np.random.default_rng(1234)


def _init(name, shape, scale=0.1, dtype=np.float32):
    return numpy_helper.from_array((RNG.standard_normal(shape) * scale).astype(dtype), name)


def cnn(path, *, h=32, w=32, batch="batch", dtype=TensorProto.FLOAT, external=False,
        pool_out=False, hw_symbolic=False):
    """x[N,3,H,W] -> Conv3x3(8) -> Relu -> MaxPool2 -> Conv3x3(16) -> Relu -> MaxPool(3,2,1)
    -> GlobalAveragePool -> Flatten -> Gemm(10, transB=1) -> y"""
    npd = helper.tensor_dtype_to_np_dtype(dtype)
    inits = [_init("c1.weight", (8, 3, 3, 3), dtype=npd), _init("c1.bias", (8,), dtype=npd),
             _init("c2.weight", (16, 8, 3, 3), dtype=npd), _init("c2.bias", (16,), dtype=npd),
             _init("fc.weight", (10, 16), dtype=npd), _init("fc.bias", (10,), dtype=npd)]
    nodes = [
        helper.make_node("Conv", ["x", "c1.weight", "c1.bias"], ["a1"], name="conv1",
                         kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Conv", ["p1", "c2.weight", "c2.bias"], ["a2"], name="conv2",
                         kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a2"], ["r2"], name="relu2"),
        helper.make_node("MaxPool", ["r2"], ["p2"], name="pool2", kernel_shape=[3, 3],
                         strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["p2"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["y"], name="fc", transB=1),
    ]
    hh, ww = ("h", "w") if hw_symbolic else (h, w)
    outputs = [helper.make_tensor_value_info("y", dtype, [batch, 10])]
    if pool_out:
        outputs.append(helper.make_tensor_value_info("p1", dtype, [batch, 8, "hp", "wp"]))
    g = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", dtype,
                                                                        [batch, 3, hh, ww])],
                          outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                          producer_name="precondfx-tests")
    m.metadata_props.add(key="owner", value="tests")
    if external:
        onnx.save_model(m, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=os.path.basename(path) + ".weights", size_threshold=0)
    else:
        onnx.save_model(m, path)
    return path


def run(path, feeds):
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def x_of(n, h=32, w=32, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal((n, 3, h, w)).astype(dtype)


def initializers(path):
    m = onnx.load(str(path))
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}, m


def geometric_std(n_in, n_out, k2, alpha=1.0):
    return math.sqrt(2.0 / (k2 * math.sqrt(n_in * n_out))) / alpha


# ---------------------------------------------------------------------------------------------
def test_cnn_end_to_end(tmp_path):
    src = cnn(tmp_path / "cnn.onnx")
    out = tmp_path / "out.onnx"
    rep = precondition_onnx(str(src), str(out), feeds={"x": x_of(256, seed=1)}, seed=3,
                            target_std=0.05)
    onnx.checker.check_model(str(out), full_check=True)
    inits, m = initializers(out)
    ops = [n.op_type for n in m.graph.node]
    assert "MaxPool" not in ops
    # pool1 (2x2, after conv1 through relu) is folded: conv1 now has stride 2
    conv1 = next(n for n in m.graph.node if n.name == "conv1")
    assert list(next(a for a in conv1.attribute if a.name == "strides").ints) == [2, 2]
    # pool2 (3,2,1) is replaced by a 16->16 strided conv keeping the pool's name and geometry
    pool2 = next(n for n in m.graph.node if n.name == "pool2")
    assert pool2.op_type == "Conv"
    attrs = {a.name: list(a.ints) for a in pool2.attribute if a.ints}
    assert attrs["kernel_shape"] == [3, 3] and attrs["strides"] == [2, 2]
    assert attrs["pads"] == [1, 1, 1, 1]
    # public names, symbolic batch dim and metadata survive
    assert [o.name for o in m.graph.output] == ["y"]
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert {p.key: p.value for p in m.metadata_props}["owner"] == "tests"
    # output std on fresh random inputs at another batch size: within 5% of 0.05
    y = run(out, {"x": x_of(1024, seed=99)})[0]
    assert y.shape == (1024, 10)
    assert abs(y.std() / 0.05 - 1) < 0.05, y.std()
    assert rep.output_std_after == pytest.approx(0.05, rel=1e-6)
    # geometric init with analytic alphas, from the formula (3x3 convs: alpha = 9^-1/4)
    a = 9 ** -0.25
    for name, (n_in, n_out, k2, alpha) in {
            "c2.weight": (8, 16, 9, a), "fc.weight": (16, 10, 1, 1.0),
            "precondfx_pool_pool2.weight": (16, 16, 9, a)}.items():
        got = float(inits[name].std())
        assert got == pytest.approx(geometric_std(n_in, n_out, k2, alpha), rel=0.08), name
    for b in ("c1.bias", "c2.bias", "fc.bias", "precondfx_pool_pool2.bias"):
        assert not inits[b].any()
    # the alpha constants are Mul nodes on the conv inputs, values (k^2)^(-1/4)
    alphas = [float(inits[n]) for n in inits if n.startswith("precondfx_alpha_")]
    assert sorted(alphas) == pytest.approx([a] * 3)


def test_same_seed_same_bytes_and_input_untouched(tmp_path):
    src = cnn(tmp_path / "cnn.onnx")
    before = hashlib.sha256(open(src, "rb").read()).hexdigest()
    feeds = {"x": x_of(16)}
    precondition_onnx(str(src), str(tmp_path / "a.onnx"), feeds=feeds, seed=5)
    precondition_onnx(str(src), str(tmp_path / "b.onnx"), feeds=feeds, seed=5)
    precondition_onnx(str(src), str(tmp_path / "c.onnx"), feeds=feeds, seed=6)
    a, b, c = (open(tmp_path / f"{k}.onnx", "rb").read() for k in "abc")
    assert a == b and a != c
    assert hashlib.sha256(open(src, "rb").read()).hexdigest() == before
    assert not any(p.name.startswith(".precondfx-") for p in tmp_path.iterdir())


def test_no_reinit_is_the_original_times_the_output_scale(tmp_path):
    src = cnn(tmp_path / "cnn.onnx")
    x = x_of(32, seed=2)
    for balance in ("none", "analytic"):
        out = tmp_path / f"same_{balance}.onnx"
        rep = precondition_onnx(str(src), str(out), feeds={"x": x}, reinit_weights=False,
                                maxpool="keep", residual="none", balance=balance,
                                target_std=0.05)
        xt = x_of(9, seed=3)
        y0, y1 = run(src, {"x": xt})[0], run(out, {"x": xt})[0]
        ref = y0 * rep.output_scale
        assert np.abs(y1 - ref).max() <= 1e-5 * np.abs(ref).max(), balance
        # the scale is 0.05 / std of the original output on the calibration batch
        assert rep.output_scale == pytest.approx(0.05 / run(src, {"x": x})[0].astype(
            np.float64).std(), rel=1e-5)


def test_external_data_round_trip(tmp_path):
    src = cnn(tmp_path / "ext.onnx", external=True)
    weights = tmp_path / "ext.onnx.weights"
    data_before = open(weights, "rb").read()
    out = tmp_path / "out.onnx"
    precondition_onnx(str(src), str(out), feeds={"x": x_of(8)})
    assert (tmp_path / "out.onnx.data").exists()
    m = onnx.load(str(out), load_external_data=False)
    locs = {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}
    assert locs == {"out.onnx.data"}
    onnx.checker.check_model(str(out), full_check=True)
    assert run(out, {"x": x_of(3)})[0].shape == (3, 10)
    assert open(weights, "rb").read() == data_before
    # an inline input gives an inline output
    src2 = cnn(tmp_path / "inline.onnx")
    precondition_onnx(str(src2), str(tmp_path / "out2.onnx"), feeds={"x": x_of(8)})
    assert not (tmp_path / "out2.onnx.data").exists()


def test_refuses_to_overwrite_input(tmp_path):
    src = cnn(tmp_path / "cnn.onnx")
    with pytest.raises(PrecondError, match="refusing"):
        precondition_onnx(str(src), str(src), feeds={"x": x_of(4)})
    link = tmp_path / "link.onnx"
    os.symlink(src, link)
    with pytest.raises(PrecondError, match="refusing"):
        precondition_onnx(str(src), str(link), feeds={"x": x_of(4)})
    # the input's external data file is protected too
    ext = cnn(tmp_path / "e.onnx", external=True)
    os.rename(tmp_path / "e.onnx.weights", tmp_path / "o.onnx.data")
    m = onnx.load(str(ext), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "o.onnx.data"
    onnx.save(m, str(ext))
    with pytest.raises(PrecondError, match="refusing"):
        precondition_onnx(str(ext), str(tmp_path / "o.onnx"), feeds={"x": x_of(4)})


def test_fp16_constants_in_fp16(tmp_path):
    src = cnn(tmp_path / "h.onnx", dtype=TensorProto.FLOAT16)
    out = tmp_path / "out.onnx"
    precondition_onnx(str(src), str(out), feeds={"x": x_of(64, dtype=np.float16)},
                      target_std=0.05)
    inits, m = initializers(out)
    consts = [n for n in inits if n.startswith("precondfx_")]
    assert consts and all(inits[n].dtype == np.float16 for n in consts)
    assert inits["c2.weight"].dtype == np.float16
    y = run(out, {"x": x_of(200, seed=4, dtype=np.float16)})[0].astype(np.float64)
    assert abs(y.std() / 0.05 - 1) < 0.06


def test_graph_output_names_kept_when_pool_output_is_public(tmp_path):
    src = cnn(tmp_path / "p.onnx", pool_out=True)
    out = tmp_path / "out.onnx"
    precondition_onnx(str(src), str(out), feeds={"x": x_of(8)})
    m = onnx.load(str(out))
    assert [o.name for o in m.graph.output] == ["y", "p1"]
    onnx.checker.check_model(str(out), full_check=True)
    y, p1 = run(out, {"x": x_of(5)})
    assert p1.shape == (5, 8, 16, 16)


def test_symbolic_spatial_dims_refuse_the_fold(tmp_path):
    src = cnn(tmp_path / "fcn.onnx", hw_symbolic=True)
    out = tmp_path / "out.onnx"
    rep = precondition_onnx(str(src), str(out), dims={"h": 32, "w": 32}, batch=4)
    pools = {p.node: p for p in rep.plan.pools}
    assert pools["pool1"].action == "conv" and "symbolic" in pools["pool1"].reason
    m = onnx.load(str(out))
    dims = [d.dim_param or d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 3, "h", "w"]
    # an odd size runs, and the replacement reproduces the pool's floor geometry
    for h, w in ((33, 47), (32, 32)):
        y = run(out, {"x": x_of(2, h, w)})[0]
        assert y.shape == (2, 10)
    s = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert s.get_inputs()[0].shape[2:] == ["h", "w"]


def test_random_inputs_need_dims(tmp_path):
    src = cnn(tmp_path / "fcn.onnx", hw_symbolic=True)
    with pytest.raises(PrecondError, match="--dim h=N"):
        precondition_onnx(str(src), str(tmp_path / "o.onnx"))
    assert not (tmp_path / "o.onnx").exists()


def test_calibration_nan_leaves_no_output(tmp_path):
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="fc", transB=1),
         helper.make_node("Log", ["h"], ["y"], name="log")], "nan",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 6])],
        [_init("w", (6, 4)), _init("b", (6,))])
    src = tmp_path / "nan.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    out = tmp_path / "out.onnx"
    with pytest.raises(PrecondError, match="NaN"):
        precondition_onnx(str(src), str(out), feeds={"x": RNG.standard_normal((16, 4))})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.onnx"]


def _two_branch(path):
    """b(relu(a(x))) + c(z): an add of two inputs' paths is not a residual join; and
    x + W2 relu(W1 x) is one (branch of 2 layers, skip of 0)."""
    nodes = [
        helper.make_node("MatMul", ["x", "wa"], ["ha"], name="a"),
        helper.make_node("Add", ["ha", "ba"], ["hab"], name="a_bias"),
        helper.make_node("Relu", ["hab"], ["ra"], name="ra"),
        helper.make_node("MatMul", ["ra", "wb"], ["hb"], name="b"),
        helper.make_node("MatMul", ["z", "wc"], ["hc"], name="c"),
        helper.make_node("Add", ["hb", "hc"], ["m"], name="merge"),
        helper.make_node("Gemm", ["m", "w1"], ["h1"], name="l1", transB=0),
        helper.make_node("Relu", ["h1"], ["r1"], name="r1"),
        helper.make_node("Gemm", ["r1", "w2"], ["h2"], name="l2", transB=0),
        helper.make_node("Add", ["m", "h2"], ["y"], name="residual"),
    ]
    inits = [_init("wa", (5, 8)), _init("ba", (8,)), _init("wb", (8, 8)), _init("wc", (3, 8)),
             _init("w1", (8, 8)), _init("w2", (8, 8))]
    g = helper.make_graph(nodes, "two", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5]),
        helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_matmul_layers_biases_and_residual_detection(tmp_path):
    src = _two_branch(tmp_path / "two.onnx")
    rep = inspect_onnx(str(src), balance="none")
    rows = {r.name: r for r in rep.nodes}
    assert rows["a"].kind == "matmul" and rows["a"].status == "weighted"
    assert rows["l1"].kind == "matmul" and rows["l1"].status == "weighted"  # Gemm transB=0
    assert rows["a_bias"].status == "preserves"
    plan = rep.plan
    assert plan.inits["ba"].rule == "zeros"           # MatMul + Add(initializer) = bias
    # fans of x @ W with W (K, N): n_in = K, n_out = N
    assert plan.inits["wa"].std == pytest.approx(math.sqrt(2 / math.sqrt(5 * 8)), rel=1e-9)
    assert [r.node for r in plan.residuals] == ["residual"]   # 'merge' has no common ancestor
    assert "no common ancestor" in rows["merge"].reason
    res = plan.residuals[0]
    assert res.branch_index == 1 and res.s == pytest.approx(1.0)  # 1/sqrt(1 join)
    assert set(res.branch_layers) == {"l1", "l2"}
    # analytic alphas (App. E.1): layers outside the branch get s/sqrt(1+s^2) = 1/sqrt(2)
    alphas = inspect_onnx(str(src)).plan.alphas()
    assert alphas["wa"] == pytest.approx(2 ** -0.5) and alphas["w1"] == pytest.approx(1.0)
    out = tmp_path / "out.onnx"
    feeds = {"x": RNG.standard_normal((64, 5)), "z": RNG.standard_normal((64, 3))}
    precondition_onnx(str(src), str(out), feeds=feeds)
    y = run(out, {k: v[:7].astype(np.float32) for k, v in feeds.items()})[0]
    assert y.shape == (7, 8)


def test_calibration_data_errors(tmp_path):
    src = _two_branch(tmp_path / "two.onnx")
    out = str(tmp_path / "o.onnx")
    x, z = RNG.standard_normal((4, 5)), RNG.standard_normal((5, 3))
    with pytest.raises(PrecondError, match="symbolic dim 'n' bound to 4 and 5"):
        precondition_onnx(str(src), out, feeds={"x": x, "z": z})
    with pytest.raises(PrecondError, match="dim 1: calibration 4 vs model 5"):
        precondition_onnx(str(src), out, feeds={"x": RNG.standard_normal((4, 4))})
    with pytest.raises(PrecondError, match="rank 3"):
        precondition_onnx(str(src), out, feeds={"x": RNG.standard_normal((4, 5, 1))})
    with pytest.raises(PrecondError, match="not a model input"):
        precondition_onnx(str(src), out, feeds={"q": x})
    bad = x.copy()
    bad[0, 0] = np.nan
    with pytest.raises(PrecondError, match="NaN"):
        precondition_onnx(str(src), out, feeds={"x": bad})
    assert not os.path.exists(out)


def test_integer_input_without_data_is_refused(tmp_path):
    g = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["e"], name="embed"),
         helper.make_node("MatMul", ["e", "w"], ["y"], name="proj")], "tok",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", "t"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "t", 4])],
        [_init("emb", (20, 6)), _init("w", (6, 4))])
    src = tmp_path / "tok.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    with pytest.raises(PrecondError, match="INT64.*--calib-input ids="):
        precondition_onnx(str(src), str(tmp_path / "o.onnx"), dims={"t": 3})
    ids = np.random.default_rng(0).integers(0, 20, (32, 5))
    rep = precondition_onnx(str(src), str(tmp_path / "o.onnx"), feeds={"ids": ids},
                            target_std=0.05)
    rows = {r.name: r for r in rep.nodes}
    assert rows["embed"].kind == "embedding" and rows["embed"].status == "weighted"
    assert rep.plan.inits["emb"].std == pytest.approx(1.0)   # unit second moment
    assert rep.output_std_after == pytest.approx(0.05)


def test_unknown_op_reported_not_crashing(tmp_path):
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="fc", transB=1),
         helper.make_node("Sign", ["h"], ["s"], name="sign"),
         helper.make_node("Frobnicate", ["s"], ["y"], name="custom", domain="com.example")],
        "unk", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 6])],
        [_init("w", (6, 4)), _init("b", (6,))])
    src = tmp_path / "unk.onnx"
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                            helper.make_opsetid("com.example", 1)])
    onnx.save(m, str(src))
    rep = inspect_onnx(str(src))
    rows = {r.name: r for r in rep.nodes}
    assert rows["sign"].status == "unknown" and rows["sign"].reason.startswith("Sign:")
    assert rows["custom"].status == "unknown" and "com.example::Frobnicate" in rows["custom"].reason
    assert rows["fc"].status == "weighted"


def test_identity_shared_and_constant_weights(tmp_path):
    """Legacy-exporter style: one bias re-shared through Identity; a weight in a Constant."""
    wconst = helper.make_node("Constant", [], ["w2"], name="wconst",
                              value=numpy_helper.from_array(
                                  RNG.standard_normal((4, 4)).astype(np.float32), "w2"))
    nodes = [
        wconst,
        helper.make_node("Identity", ["b"], ["b_copy"], name="ident"),
        helper.make_node("Gemm", ["x", "w1", "b"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "w2", "b_copy"], ["y"], name="fc2", transB=1),
    ]
    g = helper.make_graph(nodes, "ident", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["n", 4])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, ["n", 4])],
        [_init("w1", (4, 4)), numpy_helper.from_array(np.full(4, 0.5, np.float32), "b")])
    src = tmp_path / "ident.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    out = tmp_path / "out.onnx"
    rep = precondition_onnx(str(src), str(out), feeds={"x": RNG.standard_normal((64, 4))},
                            init="fan_in", balance="none")
    inits, m = initializers(out)
    assert "Identity" not in [n.op_type for n in m.graph.node]
    assert "Constant" not in [n.op_type for n in m.graph.node]
    assert not inits["b"].any() and not inits["b_copy"].any()
    assert rep.plan.inits["w2"].rule == "fan_in"      # the lifted Constant is a weight
    assert inits["w2"].std() == pytest.approx(math.sqrt(2 / 4), rel=0.35)
    assert any("Identity" in n for n in rep.capture_notes)


def test_dropout_training_mode_gives_deterministic_scale(tmp_path):
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Dropout", ["r", "ratio", "train"], ["d"], name="drop"),
        helper.make_node("Gemm", ["d", "w2", "b2"], ["y"], name="fc2", transB=1),
    ]
    inits = [_init("w1", (32, 16)), _init("b1", (32,)), _init("w2", (8, 32)), _init("b2", (8,)),
             numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
             numpy_helper.from_array(np.array(True), "train")]
    g = helper.make_graph(nodes, "drop", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["n", 16])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, ["n", 8])], inits)
    src = tmp_path / "drop.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    x = RNG.standard_normal((128, 16)).astype(np.float32)
    r1 = precondition_onnx(str(src), str(tmp_path / "a.onnx"), feeds={"x": x}, target_std=0.05)
    r2 = precondition_onnx(str(src), str(tmp_path / "b.onnx"), feeds={"x": x}, target_std=0.05)
    assert r1.output_scale == r2.output_scale
    # the scale is the one of the dropout-free network: check with training_mode off by hand
    m = onnx.load(str(tmp_path / "a.onnx"))
    for t in m.graph.initializer:
        if t.name == "train":
            t.CopyFrom(numpy_helper.from_array(np.array(False), "train"))
    onnx.save(m, str(tmp_path / "eval.onnx"))
    y = run(tmp_path / "eval.onnx", {"x": x})[0]
    assert y.astype(np.float64).std() == pytest.approx(0.05, rel=1e-5)
    # the saved file keeps the training-mode Dropout as it was
    assert numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "ratio")) == 0.5


def test_refusals(tmp_path):
    # a training artifact
    g = helper.make_graph([helper.make_node("Gradient", ["x"], ["gx"], name="grad",
                                            domain="ai.onnx.preview.training", xs=["x"], y="x")],
                          "train", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("gx", TensorProto.FLOAT, [2])])
    src = tmp_path / "art.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(
        "ai.onnx.preview.training", 1)]), str(src))
    with pytest.raises(PrecondError, match="training artifact"):
        inspect_onnx(str(src))
    # an If holding a weighted layer
    then_g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    g = helper.make_graph([helper.make_node("If", ["c"], ["y"], name="branch",
                                            then_branch=then_g, else_branch=else_g)], "if",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2]),
                           helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [_init("w", (2, 2))])
    src = tmp_path / "if.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    with pytest.raises(PrecondError, match="If node 'branch' holds weights"):
        inspect_onnx(str(src))
    # hessian balancing needs torch
    with pytest.raises(PrecondError, match="not available for ONNX"):
        precondition_onnx(str(cnn(tmp_path / "c.onnx")), str(tmp_path / "o.onnx"),
                          balance="hessian")


def test_corrupt_and_truncated_files(tmp_path):
    src = cnn(tmp_path / "cnn.onnx")
    data = open(src, "rb").read()
    (tmp_path / "trunc.onnx").write_bytes(data[: len(data) // 3])
    (tmp_path / "junk.onnx").write_bytes(b"this is not onnx\x00\xff" * 10)
    (tmp_path / "empty.onnx").write_bytes(b"")
    for name in ("trunc.onnx", "junk.onnx", "empty.onnx"):
        with pytest.raises(PrecondError):
            inspect_onnx(str(tmp_path / name))
    with pytest.raises(FileNotFoundError):
        inspect_onnx(str(tmp_path / "missing.onnx"))


def test_asymmetric_pool_pads_are_kept(tmp_path):
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", kernel_shape=[3, 3],
                          pads=[1, 1, 1, 1]),
         helper.make_node("MaxPool", ["c"], ["p"], name="pool", kernel_shape=[2, 2],
                          strides=[2, 2], pads=[0, 0, 1, 1]),
         helper.make_node("ReduceMean", ["p"], ["y"], name="mean", keepdims=0,
                          axes=[2, 3])], "asym",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 9, 9])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        [_init("w", (4, 3, 3, 3))])
    src = tmp_path / "asym.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    rep = precondition_onnx(str(src), str(tmp_path / "o.onnx"), batch=16)
    (pc,) = rep.plan.pools
    assert pc.action == "keep" and "asymmetric pads" in pc.reason
    assert "MaxPool" in [n.op_type for n in onnx.load(str(tmp_path / "o.onnx")).graph.node]


def test_weights_over_the_limit_go_to_external_data(tmp_path, monkeypatch):
    from precondfx.onnx import io as onnx_io
    monkeypatch.setattr(onnx_io, "EXTERNAL_LIMIT", 1000)   # stands in for 1.8 GB
    src = cnn(tmp_path / "cnn.onnx")
    out = tmp_path / "out.onnx"
    precondition_onnx(str(src), str(out), feeds={"x": x_of(8)})
    assert (tmp_path / "out.onnx.data").exists()
    m = onnx.load(str(out), load_external_data=False)
    big = [t for t in m.graph.initializer if t.name == "c2.weight"][0]
    assert big.data_location == TensorProto.EXTERNAL
    scale = [t for t in m.graph.initializer if t.name == "precondfx_output_scale"][0]
    assert scale.data_location != TensorProto.EXTERNAL       # small constants stay inline
    assert run(out, {"x": x_of(3)})[0].shape == (3, 10)


def test_lstm_weights_orthogonal_per_gate(tmp_path):
    hidden, n_in = 6, 5
    nodes = [helper.make_node("LSTM", ["x", "W", "R", "B"], ["ys", "yh"], name="lstm",
                              hidden_size=hidden),
             helper.make_node("Squeeze", ["yh", "axes"], ["h"], name="squeeze"),
             helper.make_node("Gemm", ["h", "wo", "bo"], ["y"], name="head", transB=1)]
    g = helper.make_graph(nodes, "lstm", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["t", "n", n_in])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, ["n", 3])],
        [_init("W", (1, 4 * hidden, n_in)), _init("R", (1, 4 * hidden, hidden)),
         _init("B", (1, 8 * hidden)), numpy_helper.from_array(np.array([0], np.int64), "axes"),
         _init("wo", (3, hidden)), _init("bo", (3,))])
    src = tmp_path / "lstm.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(src))
    out = tmp_path / "out.onnx"
    rep = precondition_onnx(str(src), str(out),
                            feeds={"x": RNG.standard_normal((7, 64, n_in))})
    assert {r.name: r.kind for r in rep.nodes}["lstm"] == "recurrent"
    inits, _ = initializers(out)
    r = inits["R"][0]
    for k in range(4):                                   # one orthogonal block per gate
        q = r[k * hidden:(k + 1) * hidden]
        np.testing.assert_allclose(q.T @ q, np.eye(hidden), atol=1e-5)
    assert not inits["B"].any()
    # input weights: geometric over one gate, n_in=5, n_out=hidden
    assert rep.plan.inits["W"].std == pytest.approx(math.sqrt(2 / math.sqrt(n_in * hidden)))
    assert run(out, {"x": RNG.standard_normal((3, 2, n_in)).astype(np.float32)})[0].shape == (2, 3)


def test_local_functions_are_inlined(tmp_path):
    fn = helper.make_function(
        "local", "LinRelu", ["x", "w", "b"], ["y"],
        [helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1),
         helper.make_node("Relu", ["h"], ["y"])],
        opset_imports=[helper.make_opsetid("", 17)])
    g = helper.make_graph(
        [helper.make_node("LinRelu", ["x", "w1", "b1"], ["h1"], name="block1", domain="local"),
         helper.make_node("Gemm", ["h1", "w2", "b2"], ["y"], name="head", transB=1)], "fn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        [_init("w1", (8, 4)), _init("b1", (8,)), _init("w2", (3, 8)), _init("b2", (3,))])
    m = helper.make_model(g, functions=[fn], opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("local", 1)])
    src = tmp_path / "fn.onnx"
    onnx.save(m, str(src))
    rep = precondition_onnx(str(src), str(tmp_path / "o.onnx"),
                            feeds={"x": RNG.standard_normal((32, 4))})
    kinds = sorted(r.kind for r in rep.nodes if r.status == "weighted")
    assert kinds == ["linear", "linear"]
    assert rep.plan.inits["w1"].std == pytest.approx(math.sqrt(2 / math.sqrt(4 * 8)))
    assert any("inlined 1" in n for n in rep.capture_notes)
    assert run(tmp_path / "o.onnx", {"x": x_of(1)[:, 0, 0, :4].copy()})[0].shape == (1, 3)


def test_bf16_weights_drawn_in_fp32_then_cast():
    import ml_dtypes
    import onnx_ir as ir

    from precondfx.onnx.reinit import reinit
    from precondfx.core.plan import ParamInit, Plan
    arr = np.zeros((64, 64), ml_dtypes.bfloat16)
    v = ir.Value(name="w", shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.BFLOAT16),
                 const_value=ir.tensor(arr, dtype=ir.DataType.BFLOAT16, name="w"))
    a32 = ir.Value(name="a", shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.FLOAT),
                   const_value=ir.tensor(np.zeros((64, 64), np.float32), name="a"))
    graph = ir.Graph([], [], nodes=[], initializers=[v, a32])
    model = ir.Model(graph, ir_version=10)
    plan = Plan(options={}, inits={"w": ParamInit("w", "geometric", 0.25, "", [64, 64])})
    reinit(model, plan, seed=11)
    got = v.const_value.numpy()
    assert got.dtype == ml_dtypes.bfloat16
    from precondfx.core.draw import weight_seed   # the weights' own stream of seed 11
    z = np.random.default_rng(weight_seed(11)).standard_normal((64, 64), dtype=np.float32)
    ref = z * (0.25 / float(np.mean(z.astype(np.float64) ** 2)) ** 0.5)  # second moment matched
    np.testing.assert_array_equal(got, ref.astype(ml_dtypes.bfloat16))


def test_pool_conv_avg_and_depthwise(tmp_path):
    """pool_conv on the ONNX path: 'avg' (with maxpool='conv') makes both pools trainable
    Convs holding average pooling, so the file computes what maxpool='avgpool' gives (same
    seed, onnxruntime, fresh inputs); 'depthwise' makes the unfoldable MaxPool(3,2,1) a grouped Conv (group 16, weight
    (16, 1, 3, 3)) drawn with the geometric std of fans (1, 1, 9) and the analytic alpha."""
    src = cnn(tmp_path / "cnn.onnx")
    feeds = {"x": x_of(64, seed=1)}
    outs = {}
    for tag, kw in (("avgpool", dict(maxpool="avgpool")),
                    ("avg", dict(maxpool="conv", pool_conv="avg")),
                    ("dw", dict(pool_conv="depthwise"))):
        outs[tag] = tmp_path / f"{tag}.onnx"
        precondition_onnx(str(src), str(outs[tag]), feeds=feeds, seed=3, **kw)
        onnx.checker.check_model(str(outs[tag]), full_check=True)
    x = {"x": x_of(32, seed=7)}
    np.testing.assert_allclose(run(outs["avg"], x)[0], run(outs["avgpool"], x)[0],
                               rtol=1e-4, atol=1e-5)
    inits, m = initializers(outs["dw"])
    pool2 = next(n for n in m.graph.node if n.name == "pool2")
    assert pool2.op_type == "Conv"
    assert next(a.i for a in pool2.attribute if a.name == "group") == 16
    w = inits["precondfx_pool_pool2.weight"]
    assert w.shape == (16, 1, 3, 3)
    assert float(w.std()) == pytest.approx(geometric_std(1, 1, 9, 9 ** -0.25), rel=0.15)
