"""Defects found by the ninth ONNX hunt (the command line and the ONNX back end, files
written by torch.onnx.export and by onnx.helper, checked with onnxruntime); each test failed
on the code before its fix."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import precondfx
from precondfx.onnx import precondition_onnx

ort = pytest.importorskip("onnxruntime")


def _export(model, x, path, **kw):
    torch.onnx.export(model.eval(), (x,), str(path), dynamo=False, **kw)
    return str(path)


class _LogitsProbsAux(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 5))

    def forward(self, x):
        lg = self.f(x)
        return lg, torch.softmax(lg, -1), torch.tanh(x[:, :3])


def test_the_note_says_probs_see_the_scale_and_aux_does_not(tmp_path):
    """Before: 'not on output 'probs', output 'aux'', while onnxruntime's probs in the file
    are the softmax of the scaled logits (5.96e-08 apart). Now the note says probs sees the
    scale, aux not, as the file does."""
    torch.manual_seed(0)
    m, x = _LogitsProbsAux(), torch.randn(16, 8)
    src = _export(m, x, tmp_path / "a.onnx", input_names=["x"],
                  output_names=["logits", "probs", "aux"])
    out = str(tmp_path / "out.onnx")
    rep = precondition_onnx(src, out, feeds={"x": x.numpy()})
    notes = [n for n in rep.capture_notes if "output scale on" in n]
    assert len(notes) == 1
    assert "output 'probs' is computed from it in the model, so it sees the scale" in notes[0]
    assert "not on output 'aux'" in notes[0] and "not on output 'probs'" not in notes[0]
    lg, pr, aux = ort.InferenceSession(out).run(None, {"x": x.numpy()})
    lg0, _, aux0 = ort.InferenceSession(src).run(None, {"x": x.numpy()})
    assert float(lg.std()) == pytest.approx(1.0, rel=1e-3)
    assert np.abs(pr - torch.softmax(torch.from_numpy(lg), -1).numpy()).max() < 1e-6
    assert np.array_equal(aux, aux0)          # the note's 'not on': the file leaves it


class _MaskedLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        legal = torch.arange(10) < 6
        return self.f(x).masked_fill(~legal, float("-inf"))


def test_distributed_calibrate_applies_the_minus_inf_rule():
    """Before: ``distributed.calibrate`` (the sharded path, global_std) of masked logits
    raised 'has NaN/inf values ... After model.to_empty'; precondition itself measures the
    finite entries. Now both measure the same: std 1.0 on the finite entries, 256 masked."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    pm, rep = precondfx.precondition(_MaskedLogits(), x, balance="analytic", lr=None)
    st = precondfx.pytorch.distributed.calibrate(pm, x)
    assert st["std_after"] == pytest.approx(1.0, rel=1e-4)
    assert st["masked_entries"] == 64 * 4
    with torch.no_grad():
        y = pm(x)
    assert torch.isneginf(y[:, 6:]).all()
    assert float(y[:, :6].double().std(correction=0)) == pytest.approx(1.0, rel=1e-4)
    from precondfx.pytorch.calibrate import global_std
    assert global_std(y) == pytest.approx(1.0, rel=1e-4)
    assert np.isnan(global_std(torch.tensor([1.0, float("nan"), 2.0])))


# -- (c) a float input multiplied into computed values is a mask by its use -----------------
class _MaskedMeanPool(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x, keep):
        h = torch.relu(self.emb(x))
        h = (h * keep.unsqueeze(-1)).sum(1) / keep.sum(1, keepdim=True).clamp(min=1.0)
        return self.head(h)


class _Product(nn.Module):
    """``net(a * b)`` and ``x * (x > 0)``: data inputs multiplied, none a mask."""

    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, a, b, x):
        return self.f(a * b + x * (x > 0))


class _ThresholdMask(nn.Module):
    """Attention scores filled where ``keep < 0.5``: a float mask compared with a constant."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16), nn.Linear(16, 16),
                                          nn.Linear(16, 16), nn.Linear(16, 4))

    def forward(self, x, keep):
        sc = self.q(x) @ self.k(x).transpose(1, 2) / 4.0
        sc = sc.masked_fill(keep[:, None, :] < 0.5, -1e4)
        return self.o(torch.softmax(sc, -1) @ self.v(x))


@pytest.mark.parametrize("model, why, real_std", [
    (_MaskedMeanPool, "Mul node '/Mul' multiplies it into a computed value", 0.98),
    (_ThresholdMask, "Less node '/Less' compares it with a constant", 0.99)])
def test_a_mask_not_named_so_gets_ones(tmp_path, model, why, real_std):
    """Before: ``keep`` (named neither mask nor read directly by Where) got N(0,1) data: a
    masked mean divided by sums of random numbers (the file's output std 0.256 on the real
    mask, 0.261 on ones, for a target of 1), ``keep < 0.5`` masked 69% of the keys at random
    (0.845 and 0.851). Now its uses (multiplied into computed values, compared with a
    constant, summed) read it as a mask: ones, said with why; std 1.0 on ones."""
    torch.manual_seed(0)
    m, x = model(), torch.randn(8, 12, 16)
    keep = torch.ones(8, 12)
    keep[:, 9:] = 0
    src = str(tmp_path / "pool.onnx")
    torch.onnx.export(m.eval(), (x, keep), src, dynamo=False, input_names=["x", "keep"],
                      output_names=["logits"], dynamic_axes={"x": {0: "b"}, "keep": {0: "b"}})
    before = open(src, "rb").read()
    out = str(tmp_path / "out.onnx")
    rep = precondition_onnx(src, out, feeds={"x": x.numpy()})
    note = next(n for n in rep.capture_notes if "calibration used ones" in n)
    assert "keep [8, 12]" in note and why in note and "read as a mask by all its uses" in note
    assert not any("random N(0,1) inputs for keep" in n for n in rep.capture_notes)
    s = ort.InferenceSession(out)
    ones = s.run(None, {"x": x.numpy(), "keep": np.ones((8, 12), np.float32)})[0]
    real = s.run(None, {"x": x.numpy(), "keep": keep.numpy()})[0]
    assert float(ones.std()) == pytest.approx(1.0, rel=1e-3)
    assert float(real.std()) == pytest.approx(real_std, abs=0.01)
    assert open(src, "rb").read() == before           # the input file is untouched


def test_two_data_inputs_multiplied_are_not_masks(tmp_path):
    """The rule is by use and stays narrow: ``net(a * b)`` (an input times another input)
    and ``x * (x > 0)`` (an input gated by itself) keep random N(0,1) data (ones would
    calibrate net(ones))."""
    torch.manual_seed(0)
    a, b, x = torch.randn(16, 12), torch.randn(16, 12), torch.randn(16, 12)
    src = str(tmp_path / "p.onnx")
    torch.onnx.export(_Product().eval(), (a, b, x), src, dynamo=False,
                      input_names=["a", "b", "x"], output_names=["y"])
    from precondfx.onnx import io
    from precondfx.onnx.pipeline import mask_inputs
    assert mask_inputs(io.load(src)) == {}


# -- (d) the command line's flags for lr, optimizer, measure, suggest_lr, capture ------------
def tiny_mlp():
    """A builder for ``precondfx precondition tests.onnx.test_hunt_onnx9:tiny_mlp``."""
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)),
            torch.randn(16, 6))


def _err(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("flags, shown", [
    (["--measure"], "--measure applies to PyTorch models"),
    (["--suggest-lr"], "--suggest-lr applies to PyTorch models"),
    (["--capture", "fx,eager"], "--capture fx,eager applies to PyTorch models"),
    (["--lr", "0.1", "--optimizer", "sgd"], "--lr 0.1 applies to PyTorch models"),
    (["--optimizer", "adam"], "--optimizer adam applies to PyTorch models"),
])
def test_onnx_file_refuses_the_pytorch_flags_by_name(tmp_path, capsys, flags, shown):
    """Before: 'unrecognized arguments' (no such flags). Now the flags exist, checked by the
    option registry; for an ONNX file they are refused by flag, saying why, and nothing is
    written."""
    from precondfx.cli import main
    torch.manual_seed(0)
    src = _export(_LogitsProbsAux(), torch.randn(4, 8), tmp_path / "a.onnx",
                  input_names=["x"], output_names=["logits", "probs", "aux"])
    out = tmp_path / "o.onnx"
    assert main(["precondition", src, "-o", str(out), "--quiet", *flags]) == 2
    err = _err(capsys)
    assert shown in err and "needs the PyTorch model" in err, err
    assert not out.exists()
    assert main(["precondition", src, "-o", str(out), "--quiet", "--lr", "none"]) == 0
    capsys.readouterr()
    # inspect offers none of them, and says which command has them and why
    assert main(["inspect", src, "--measure"]) == 2
    err = _err(capsys)
    assert "--measure is a flag of precondition, not of inspect" in err
    assert "needs the PyTorch model" in err


def test_pytorch_model_takes_lr_and_says_what_lr_auto_left(tmp_path, capsys):
    """Before: no --lr/--optimizer (unrecognized arguments), and the .pt written with the
    default lr='auto' held the storage before its first step without a word. Now
    ``--lr 0.5 --optimizer sgd`` writes the storage for that rate (the lr multipliers c < 1,
    equal in the state_dict and the report), and the default says lr='auto' has not acted
    and what the user gets when loading."""
    from precondfx.cli import main
    spec = "tests.onnx.test_hunt_onnx9:tiny_mlp"
    pt, rj = tmp_path / "m.pt", tmp_path / "r.json"
    assert main(["precondition", spec, "-o", str(pt), "--lr", "0.5", "--optimizer", "sgd",
                 "--capture", "fx", "--report", str(rj)]) == 0
    err = _err(capsys)
    assert "lr='auto' (the default) has not acted" not in err
    sd = torch.load(pt)
    lrs = [float(v) for k, v in sd.items() if "precondfx_lr" in k]
    import json
    summary = json.load(open(rj))["conditioning"]["lr_target"]["summary"]
    assert "lr=0.5 (sgd)" in summary
    c = float(summary.split("/ ")[1].split(",")[0])
    assert len(lrs) == 2 and all(v == pytest.approx(c, rel=1e-3) for v in lrs) and c != 1.0
    assert main(["precondition", spec, "-o", str(tmp_path / "d.pt")]) == 0
    err = _err(capsys)
    assert "lr='auto' (the default) has not acted" in err and "--lr RATE" in err
    assert all(float(v) == 1.0 for k, v in torch.load(tmp_path / "d.pt").items()
               if "precondfx_lr" in k)


# -- hunt: input_scale='auto' multiplied the mask input too ----------------------------------
def test_input_scale_leaves_a_mask_input_as_it_is(tmp_path):
    """Before: ``input_scale='auto'`` multiplied every float input, the float
    ``attention_mask`` too (x 0.100): ``mask < 0.5`` then masked every key, and the masked
    positions leaked into the output (changing them moved it by 1.31 in onnxruntime); the
    scale was also computed from the mask's ones. Now the mask is left as it is (a skipped
    line says why), the scale comes from ``x`` alone, and the masked positions move nothing."""
    torch.manual_seed(0)
    x = torch.randn(8, 12, 16) * 5
    v = torch.ones(8, 12)
    v[:, 9:] = 0
    src = str(tmp_path / "i.onnx")
    torch.onnx.export(_ThresholdMask().eval(), (x, v), src, dynamo=False,
                      input_names=["x", "attention_mask"], output_names=["logits"])
    out = str(tmp_path / "o.onnx")
    rep = precondition_onnx(src, out, feeds={"x": x.numpy(), "attention_mask": v.numpy()},
                            input_scale="auto")
    assert any("not on input 'attention_mask'" in why for _, why in rep.skipped)
    s = ort.InferenceSession(out)
    x2 = x.clone()
    x2[:, 9:] = torch.randn(8, 3, 16) * 5
    y, y2 = (s.run(None, {"x": a.numpy(), "attention_mask": v.numpy()})[0] for a in (x, x2))
    assert np.abs(y2 - y)[:, :9].max() < 1e-5         # the kept rows do not see them
    assert float(y.std()) == pytest.approx(1.0, rel=1e-3)
    scale = next(sc.value for sc in rep.plan.scales if sc.tag == "input")
    rms = float(np.sqrt(np.mean(np.square(x.numpy(), dtype=np.float64))))
    assert scale * rms == pytest.approx(0.5, abs=0.005)   # x alone sets it (before: 0.515)


# -- hunt: an initializer read only through Identity nodes stayed in the file, unused --------
def test_a_weight_read_only_through_identity_leaves_no_dead_copy(tmp_path):
    """Before: ``MatMul(x, Identity(w1))`` got its own copy ``w1i`` (re-drawn) and the file
    kept the original ``w1`` (the export's values, std 0.196) with no reader: the weights
    stored twice, and onnxruntime warns 'Removing initializer' at every load. Now ``w1`` is
    dropped; the file holds the re-drawn copy only."""
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((8, 16)) * 0.2).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((4, 16)) * 0.2).astype(np.float32), "w2")
    g = helper.make_graph(
        [helper.make_node("Identity", ["w1"], ["w1i"]),
         helper.make_node("MatMul", ["x", "w1i"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Gemm", ["r", "w2"], ["y"], transB=1)], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TP.FLOAT, ["N", 4])], [w1, w2])
    src, out = str(tmp_path / "i.onnx"), str(tmp_path / "o.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    x = rng.standard_normal((32, 8)).astype(np.float32)
    rep = precondition_onnx(src, out, feeds={"x": x})
    names = [i.name for i in onnx.load(out).graph.initializer]
    assert "w1" not in names and "w1i" in names and "w2" in names
    assert rep.plan.inits["w1i"].rule == "geometric"
    y = ort.InferenceSession(out).run(None, {"x": x})[0]
    assert float(y.std()) == pytest.approx(1.0, rel=1e-3)
    assert [i.name for i in onnx.load(src).graph.initializer] == ["w1", "w2"]   # untouched


def test_output_key_says_which_outputs_see_the_scale(tmp_path):
    """Before: with ``output_key='hidden'`` the report said nothing of ``logits``, which the
    file computes from the scaled ``hidden`` (so its logits carry the scale too).
    Now a note says that ``logits`` sees the scale."""
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper
    rng = np.random.default_rng(0)

    def w(name, shape, s):
        return numpy_helper.from_array((rng.standard_normal(shape) * s).astype(np.float32),
                                       name)
    g = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["e"]),
         helper.make_node("MatMul", ["e", "w1"], ["h"]),
         helper.make_node("Relu", ["h"], ["hidden"]),
         helper.make_node("MatMul", ["hidden", "w2"], ["logits"])], "g",
        [helper.make_tensor_value_info("ids", TP.INT64, ["N", "S"])],
        [helper.make_tensor_value_info("hidden", TP.FLOAT, ["N", "S", 16]),
         helper.make_tensor_value_info("logits", TP.FLOAT, ["N", "S", 20])],
        [w("emb", (20, 16), 1.0), w("w1", (16, 16), 0.2), w("w2", (16, 20), 0.2)])
    src, out = str(tmp_path / "t.onnx"), str(tmp_path / "o.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    ids = rng.integers(0, 20, (4, 10)).astype(np.int64)
    rep = precondition_onnx(src, out, feeds={"ids": ids}, output_key="hidden")
    notes = [n for n in rep.capture_notes if "output scale on" in n]
    assert notes == ["output scale on output 'hidden' (output_key=); output 'logits' is "
                     "computed from it in the model, so it sees the scale too"]
    hid, lg = ort.InferenceSession(out).run(None, {"ids": ids})
    assert float(hid.std()) == pytest.approx(1.0, rel=1e-3)
    rep2 = precondition_onnx(src, str(tmp_path / "o2.onnx"), feeds={"ids": ids},
                             output_key="logits")
    assert not [n for n in rep2.capture_notes if "output scale on" in n]   # none downstream
