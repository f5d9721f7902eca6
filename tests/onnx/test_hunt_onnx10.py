"""Defects found by the tenth ONNX hunt (the command line and the ONNX back end: files
written by torch.onnx.export and by onnx.helper, checked with onnxruntime); each test failed
on the code before its fix."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from precondfx.errors import PrecondError
from precondfx.onnx import inspect_onnx, precondition_onnx

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto as T, helper as h, numpy_helper as nh  # noqa: E402


def _export(model, args, path, **kw):
    torch.onnx.export(model.eval(), args, str(path), dynamo=False, **kw)
    return str(path)


def _mlp():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))


class _Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = _mlp()

    def forward(self, a, b):
        return F.cosine_similarity(self.f(a), self.f(b), dim=-1)


def test_a_similarity_of_near_identical_pairs_is_refused_as_constant(tmp_path):
    """(d) Before: the ONNX back end applied an output scale of 1.94e+07 to rounding noise
    (cosine similarity of pairs 2e-7 apart, output std 5.2e-08) with a warning and wrote the
    file; the PyTorch back end refuses it. Now the same refusal (core.calibration.constancy),
    and nothing is written."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    src = _export(_Siamese(), (x, x), tmp_path / "s.onnx", input_names=["a", "b"])
    a = x.numpy()
    out = tmp_path / "out.onnx"
    with pytest.raises(PrecondError, match="output is constant on the calibration batch"):
        precondition_onnx(src, str(out), feeds={"a": a, "b": a * np.float32(1 + 2e-7)})
    assert not out.exists()


class _IgnoresBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = _mlp()

    def forward(self, a):
        return self.f(a[:1]).expand(a.shape[0], -1)


def test_an_output_the_same_for_every_sample_is_noted(tmp_path):
    """(d) Before: no word that the output does not depend on the sample (the PyTorch back
    end notes it). Now the same 'constant output' note."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    src = _export(_IgnoresBatch(), (x,), tmp_path / "i.onnx", input_names=["a"],
                  dynamic_axes={"a": {0: "N"}})
    rep = precondition_onnx(src, str(tmp_path / "out.onnx"), feeds={"a": x.numpy()})
    notes = [why for what, why in rep.skipped if what == "note: constant output"]
    assert len(notes) == 1 and "same for every sample" in notes[0]


def _scaled_weight_mlp(path, pre, w1_shape=(8, 32)):
    """x -> MatMul(x, <pre>(W1)) -> Relu -> MatMul(., W2), W1 behind the nodes ``pre``."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal(w1_shape).astype(np.float32), "W1"),
             nh.from_array(rng.standard_normal((32, 5)).astype(np.float32), "W2"),
             nh.from_array(np.array(3.0, np.float32), "three")]
    nodes = pre + [h.make_node("MatMul", ["x", "W1s"], ["h"]),
                   h.make_node("Relu", ["h"], ["r"]), h.make_node("MatMul", ["r", "W2"], ["y"])]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["N", 8])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["N", 5])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    onnx.checker.check_model(m)
    onnx.save(m, str(path))
    return str(path)


@pytest.mark.parametrize("pre,factor,w1_shape", [
    ([h.make_node("Mul", ["three", "W1"], ["W1s"])], 3.0, (8, 32)),
    ([h.make_node("Constant", [], ["c"], value=nh.from_array(np.array(0.5, np.float32))),
      h.make_node("Div", ["W1", "c"], ["W1s"])], 2.0, (8, 32)),
    ([h.make_node("Transpose", ["W1"], ["W1t"], perm=[1, 0]),
      h.make_node("Mul", ["W1t", "three"], ["W1s"])], 3.0, (32, 8)),
])
def test_a_weight_times_a_constant_is_a_linear_layer(tmp_path, pre, factor, w1_shape):
    """(b) Before: ``MatMul(x, Mul(W1, 3))`` was 'breaks' ('product of two activations') and
    W1 was kept (its std 1 times 3 in the layer). Now the MatMul is a weighted linear layer;
    W1 is drawn divided by the factor, so the weight the layer applies (factor * W1) has the
    std of the plain MatMul's plan (0.354 for 8 -> 32)."""
    src = _scaled_weight_mlp(tmp_path / "m.onnx", pre, w1_shape)
    rows = {r.name: r for r in inspect_onnx(src).rows()}
    first = next(r for r in rows.values() if r.kind == "matmul")
    assert first.status == "weighted"
    x = np.random.default_rng(1).standard_normal((256, 8)).astype(np.float32)
    out = str(tmp_path / "out.onnx")
    rep = precondition_onnx(src, out, feeds={"x": x})
    w1 = {i.name: nh.to_array(i) for i in onnx.load(out).graph.initializer}["W1"]
    assert float((w1 * factor).std()) == pytest.approx(8 ** -0.5, rel=1e-3)
    y = ort.InferenceSession(out).run(None, {"x": x})[0]
    assert float(y.std()) == pytest.approx(1.0, rel=1e-3)
    assert rep.output_std_after == pytest.approx(1.0, rel=1e-3)


def _if_model(path):
    """logits = MLP(x); probs = If(flag, softmax(logits), sigmoid(logits)) (the branches read
    the logits from the main graph); aux = tanh(x)."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((8, 32)).astype(np.float32), "W1"),
             nh.from_array(rng.standard_normal((32, 5)).astype(np.float32), "W2")]
    then = h.make_graph([h.make_node("Softmax", ["logits"], ["p_then"], axis=-1)], "then", [],
                        [h.make_tensor_value_info("p_then", T.FLOAT, ["N", 5])])
    els = h.make_graph([h.make_node("Sigmoid", ["logits"], ["p_else"])], "else", [],
                       [h.make_tensor_value_info("p_else", T.FLOAT, ["N", 5])])
    nodes = [h.make_node("MatMul", ["x", "W1"], ["h"]), h.make_node("Relu", ["h"], ["r"]),
             h.make_node("MatMul", ["r", "W2"], ["logits"]),
             h.make_node("If", ["flag"], ["probs"], then_branch=then, else_branch=els),
             h.make_node("Tanh", ["x"], ["aux"])]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["N", 8]),
                                  h.make_tensor_value_info("flag", T.BOOL, [])],
                     [h.make_tensor_value_info("logits", T.FLOAT, ["N", 5]),
                      h.make_tensor_value_info("probs", T.FLOAT, ["N", 5]),
                      h.make_tensor_value_info("aux", T.FLOAT, ["N", 8])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    onnx.checker.check_model(m)
    onnx.save(m, str(path))
    return str(path)


@pytest.mark.parametrize("key", [None, "logits"])
def test_the_note_follows_the_scaled_logits_into_an_if_branch(tmp_path, key):
    """(c) Before: 'not on output 'probs'' (output_key='logits': no note at all), while the
    file's probs are the softmax of the scaled logits (1.2e-07 apart): the walk did not enter
    the If branches. Now the note says probs sees the scale, aux not."""
    src = _if_model(tmp_path / "if.onnx")
    x = np.random.default_rng(1).standard_normal((64, 8)).astype(np.float32)
    feeds = {"x": x, "flag": np.array(True)}
    out = str(tmp_path / "out.onnx")
    rep = precondition_onnx(src, out, feeds=feeds, output_key=key)
    notes = [n for n in rep.capture_notes if "output scale on" in n]
    assert len(notes) == 1
    assert "output 'probs' is computed from it in the model, so it sees the scale" in notes[0]
    assert "not on output 'probs'" not in notes[0]
    lg, pr, aux = ort.InferenceSession(out).run(None, feeds)
    e = np.exp(lg - lg.max(-1, keepdims=True))
    assert np.abs(pr - e / e.sum(-1, keepdims=True)).max() < 1e-6
    assert float(lg.std()) == pytest.approx(1.0, rel=1e-3)
    assert np.array_equal(aux, ort.InferenceSession(src).run(None, feeds)[2])


class _IntMaskAttention(nn.Module):
    """Attention over x with an int64 padding mask ``m`` (1 kept, 0 padded), used as
    ``masked_fill(m == 0)``, ``scores * m.float()`` or ``masked_fill(~m.bool())``."""

    def __init__(self, use):
        super().__init__()
        self.q, self.k, self.o = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.use = use

    def forward(self, x, m):
        sc = self.q(x) @ self.k(x).transpose(1, 2) / 4
        if self.use == "equal":
            sc = sc.masked_fill(m[:, None, :] == 0, float("-inf"))
        elif self.use == "mul":
            sc = sc * m[:, None, :].float()
        else:
            sc = sc.masked_fill(~m[:, None, :].bool(), float("-inf"))
        return self.o(torch.softmax(sc, -1) @ x)


@pytest.mark.parametrize("use,why", [("equal", "Equal node '/Equal' compares it with a "
                                      "constant"),
                                     ("mul", "Mul node '/Mul' multiplies it into"),
                                     ("bool", "Cast node '/Cast' reads it as a condition")])
def test_an_int64_mask_not_named_mask_is_found_by_its_use(tmp_path, use, why):
    """(a) Before: an int64 mask input named 'm' was refused ('input 'm' is INT64: random
    normal data cannot stand in for it') when only x had data, while the same mask named
    'attention_mask', or a float 'm', got ones. Now it is found by its use (one rule for
    float and int inputs), filled with ones and named in the note; onnxruntime on the file
    with that feed gives the calibrated std."""
    torch.manual_seed(0)
    x, m = torch.randn(4, 6, 16), torch.ones(4, 6, dtype=torch.int64)
    src = _export(_IntMaskAttention(use), (x, m), tmp_path / "a.onnx", input_names=["x", "m"])
    out = str(tmp_path / "out.onnx")
    rep = precondition_onnx(src, out, feeds={"x": x.numpy()})
    notes = [n for n in rep.capture_notes if "mask input(s) m [4, 6]" in n]
    assert len(notes) == 1 and why in notes[0]
    y = ort.InferenceSession(out).run(None, {"x": x.numpy(), "m": m.numpy()})[0]
    assert float(y.std()) == pytest.approx(1.0, rel=1e-3)


class _TokensWithPadMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.o = nn.Embedding(50, 16), nn.Linear(16, 4)

    def forward(self, tok):
        keep = (tok != 0).float()[..., None]
        return self.o((self.emb(tok) * keep).sum(1))


def test_token_ids_compared_with_the_pad_id_are_not_a_mask(tmp_path):
    """(a) The use rule leaves token ids alone: read by an embedding too, so not a mask
    (N(0,1) or ones would not stand in for them either: still refused, data asked for)."""
    from precondfx.onnx import io
    from precondfx.onnx.pipeline import mask_inputs
    tok = torch.randint(1, 50, (4, 6))
    src = _export(_TokensWithPadMask(), (tok,), tmp_path / "t.onnx", input_names=["tok"])
    assert mask_inputs(io.load(src)) == {}
    with pytest.raises(PrecondError, match="input 'tok' is INT64"):
        precondition_onnx(src, str(tmp_path / "out.onnx"))


class _ThresholdMaskAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.o = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x, m):
        sc = self.q(x) @ self.k(x).transpose(1, 2) / 4
        sc = sc.masked_fill(m[:, None, :] < 0.5, float("-inf"))
        return self.o(torch.softmax(sc, -1) @ x)


def test_pytorch_input_scale_leaves_a_float_mask_found_by_its_use(tmp_path):
    """(a, the shared rule) Before: precondfx.precondition(..., input_scale='auto') on fx
    multiplied the float mask 'm' by the input scale (0.054), so 'm < 0.5' masked every
    position and calibration failed ('output ... has NaN/inf values'). Now the PyTorch back
    end applies the ONNX back end's use rule (core.calibration.mask_by_use): 'm' is left
    alone, with why; the ONNX back end says the same of the exported file."""
    import precondfx
    torch.manual_seed(0)
    x, m = torch.randn(4, 6, 16) * 10, torch.ones(4, 6)
    m[:, 4:] = 0
    net, rep = precondfx.precondition(_ThresholdMaskAttention(), (x, m), input_scale="auto")
    why = [w for what, w in rep.skipped if what == "input scale" and "'m'" in w]
    assert len(why) == 1 and "lt node 'lt' compares it with a constant" in why[0]
    assert float(net(x, m).std()) == pytest.approx(1.0, rel=0.05)
    src = _export(_ThresholdMaskAttention(), (x, m), tmp_path / "t.onnx",
                  input_names=["x", "m"])
    from precondfx.onnx import io
    from precondfx.onnx.pipeline import mask_inputs
    assert "Less node '/Less' compares it with a constant" in mask_inputs(io.load(src))["m"]


def test_a_kept_max_pool_says_why(tmp_path):
    """Before: a MaxPool with auto_pad=SAME_UPPER (or ceil_mode whose size a strided conv
    cannot give) showed 'kept' next to 'replaced by striding (Sec. 7)' and no reason anywhere
    in the report (the plan had it). Now a line says why, on the ONNX and PyTorch paths."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((8, 4, 3, 3)).astype(np.float32), "W1"),
             nh.from_array(rng.standard_normal((3, 8, 3, 3)).astype(np.float32), "W2")]
    nodes = [h.make_node("Conv", ["x", "W1"], ["h"], auto_pad="SAME_UPPER"),
             h.make_node("Relu", ["h"], ["r"]),
             h.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2],
                         auto_pad="SAME_UPPER"),
             h.make_node("Conv", ["p", "W2"], ["y"])]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["N", 4, 7, 7])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["N", 3, 2, 2])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    onnx.checker.check_model(m)
    onnx.save(m, str(tmp_path / "p.onnx"))
    text = " ".join(str(inspect_onnx(str(tmp_path / "p.onnx"), batch=8)).split())
    assert "kept max pool MaxPool_2: its auto_pad=SAME_UPPER cannot be reproduced" in text
    import precondfx
    net = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(),
                        nn.MaxPool2d(3, 2, ceil_mode=True), nn.Conv2d(8, 3, 3))
    _, rep = precondfx.precondition(net, torch.randn(8, 4, 8, 8), lr=None)
    assert "kept max pool 2: a strided convolution of the same geometry would give spatial " \
           "size [3, 3], not [4, 4] (ceil_mode)" in " ".join(str(rep).split())  # any width


class _GatedInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.f, self.g = _mlp(), nn.Linear(8, 8)

    def forward(self, x, c):
        return self.f(x * torch.sigmoid(self.g(c)))


def test_pytorch_input_scale_still_scales_a_gated_input():
    """(a, the guard of the shared rule) On PyTorch a product is not read as a mask: the
    gated input x of ``f(x * sigmoid(g(c)))`` is data and gets the input scale, as before."""
    import precondfx
    torch.manual_seed(0)
    _, rep = precondfx.precondition(_GatedInput(), (torch.randn(16, 8) * 5,
                                                    torch.randn(16, 8) * 5),
                                    input_scale="auto", lr=None)
    assert rep.input_scale is not None
    assert not [w for what, w in rep.skipped if what == "input scale"]


def test_the_command_line_announces_masks_filled_with_ones(tmp_path, capsys):
    """Before: with --quiet the command line said on stderr that x got random N(0,1) data,
    and nothing of the mask 'm' it filled with ones (the table, with the note, is not
    printed). Now both made-up inputs are announced."""
    from precondfx.cli import main
    torch.manual_seed(0)
    x, m = torch.randn(4, 6, 16), torch.ones(4, 6, dtype=torch.int64)
    src = _export(_IntMaskAttention("mul"), (x, m), tmp_path / "a.onnx",
                  input_names=["x", "m"])
    assert main(["precondition", src, "-o", str(tmp_path / "out.onnx"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "calibration used random N(0,1) inputs for x [4, 6, 16]" in err
    assert "note: calibration used ones (nothing masked) for the mask input(s) m [4, 6]" in err


def test_a_norm_scale_behind_a_factor_applies_ones(tmp_path):
    """(b) A LayerNormalization scale read as Mul(g, 3): the plan sets the scale to ones;
    the file holds g = 1/3, so the layer applies ones (before the Mul was read as a view:
    g kept at mean 2.7, effective 8.1; with the view but not divided: effective 3)."""
    rng = np.random.default_rng(0)
    inits = [nh.from_array(rng.standard_normal((8, 32)).astype(np.float32), "W1"),
             nh.from_array(rng.standard_normal(32).astype(np.float32) + 3, "g"),
             nh.from_array(rng.standard_normal(32).astype(np.float32), "b"),
             nh.from_array(rng.standard_normal((32, 5)).astype(np.float32), "W2"),
             nh.from_array(np.array(3.0, np.float32), "c3")]
    nodes = [h.make_node("MatMul", ["x", "W1"], ["h"]), h.make_node("Mul", ["g", "c3"], ["gs"]),
             h.make_node("LayerNormalization", ["h", "gs", "b"], ["n"], axis=-1),
             h.make_node("Relu", ["n"], ["r"]), h.make_node("MatMul", ["r", "W2"], ["y"])]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["N", 8])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["N", 5])], inits)
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), str(tmp_path / "n.onnx"))
    out = str(tmp_path / "out.onnx")
    x = rng.standard_normal((64, 8)).astype(np.float32)
    rep = precondition_onnx(str(tmp_path / "n.onnx"), out, feeds={"x": x})
    w = {i.name: nh.to_array(i) for i in onnx.load(out).graph.initializer}
    assert np.allclose(w["g"] * 3, 1.0, atol=1e-6)
    assert any("g: set to 1/3 rather than ones" in n for n in rep.capture_notes)
    y = ort.InferenceSession(out).run(None, {"x": x})[0]
    assert float(y.std()) == pytest.approx(1.0, rel=1e-3)
