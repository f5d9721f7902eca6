"""Hunt onnx8: the ONNX command line and back end against the PyTorch back end, on files
written by torch.onnx.export and by onnx.helper."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

import precondfx  # noqa: E402
from precondfx.cli import main  # noqa: E402
from precondfx.errors import PrecondError  # noqa: E402
from precondfx.onnx import precondition_onnx  # noqa: E402

nn = torch.nn
SAME = dict(reinit_weights=False, maxpool="keep", balance="none")


def _run(path, feeds):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _both(model, x, tmp_path, names):
    """The PyTorch result and onnxruntime on the preconditioned export of the same model,
    same plan (weights kept): their outputs, by name."""
    src = str(tmp_path / "m.onnx")
    torch.onnx.export(model, (x,), src, dynamo=False, input_names=["x"], output_names=names,
                      dynamic_axes={"x": {0: "batch"}})
    out = str(tmp_path / "out.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = precondition_onnx(src, out, feeds={"x": x.numpy()}, **SAME)
        res, prep = precondfx.precondition(model, x, lr=None, **SAME)
    with torch.no_grad():
        got = res(x)
    got = (got,) if isinstance(got, torch.Tensor) else got
    pt = dict(zip(names, [t.numpy() for t in got]))
    return pt, _run(out, {"x": x.numpy()}), rep, prep


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(16, 64), nn.ReLU()), nn.Linear(64, 6)


class LogitsAndProbs(_Body):
    def forward(self, x):
        z = self.head(self.body(x))
        return z.reshape(x.shape[0], 2, 3), torch.softmax(z, dim=-1)


class LossAndLogits(_Body):
    def forward(self, x):
        z = self.head(self.body(x))
        return (z * z).mean(), z


@pytest.mark.parametrize("cls,names", [(LogitsAndProbs, ["logits", "probs"]),
                                       (LossAndLogits, ["loss", "logits"])])
def test_outputs_computed_from_the_logits_agree_on_both_back_ends(tmp_path, cls, names):
    """(a) ``return logits, softmax(logits)`` and ``return loss, logits``: the PyTorch back end
    puts the output scale where the logits are computed, so the probabilities and the loss
    see it (docs/guides/transformers.md, 'the model's own loss sees the output scale'); the
    ONNX back end multiplied the returned logits only: probabilities off by 0.29, the loss
    unscaled (0.65 times the PyTorch one).  Now one rule (core.outputs.scale_moves_up) and
    the same function on both back ends."""
    torch.manual_seed(0)
    model, x = cls().eval(), torch.randn(32, 16)
    pt, ox, rep, prep = _both(model, x, tmp_path, names)
    assert rep.output_scale == pytest.approx(prep.output_scale, rel=1e-4)
    for k in names:
        np.testing.assert_allclose(ox[k], pt[k], rtol=1e-4, atol=1e-5, err_msg=k)


# -- (b) mask inputs -----------------------------------------------------------------------------
class MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.o = nn.Linear(16, 4)

    def forward(self, x, attention_mask):
        scores = self.q(x) @ self.k(x).transpose(1, 2) / 4
        scores = scores + (1.0 - attention_mask[:, None, :]) * -10000.0   # BERT's float mask
        return self.o((torch.softmax(scores, -1) @ self.v(x)).mean(1))


def test_a_float_attention_mask_given_no_data_is_calibrated_with_ones(tmp_path):
    """(b) A float ``attention_mask`` input with no calibration data got N(0,1) values (masked
    at random, the note said 'random N(0,1)'): the file's output std on unpadded data (mask
    of ones) was 0.43 for a target of 1.  Now the mask gets ones (nothing masked), the note
    says so, and the std is 1."""
    torch.manual_seed(0)
    model, x, ones = MaskedAttention().eval(), torch.randn(32, 10, 16), torch.ones(32, 10)
    src, out = str(tmp_path / "m.onnx"), str(tmp_path / "out.onnx")
    torch.onnx.export(model, (x, ones), src, dynamo=False, input_names=["x", "attention_mask"],
                      output_names=["logits"], dynamic_axes={"x": {0: "b"},
                                                             "attention_mask": {0: "b"}})
    rep = precondition_onnx(src, out, feeds={"x": x.numpy()})
    y = _run(out, {"x": x.numpy(), "attention_mask": ones.numpy()})["logits"]
    assert float(y.std()) == pytest.approx(1.0, rel=1e-3)
    text = " ".join(str(rep).split())
    assert "used ones (nothing masked) for the mask input(s) attention_mask [32, 10]" in text
    assert "random N(0,1) inputs for attention_mask" not in text


def _helper_masked(name: str):
    """Hand-written: logits + (1 - m) * -10000, ``m`` a float input of any name."""
    from onnx import TensorProto as TP, helper, numpy_helper
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "W"),
             numpy_helper.from_array(np.zeros(4, np.float32), "b"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(-10000.0, np.float32), "big")]
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["z"], name="fc", transB=1),
             helper.make_node("Sub", ["one", name], ["inv"], name="inv"),
             helper.make_node("Mul", ["inv", "big"], ["pen"], name="pen"),
             helper.make_node("Add", ["z", "pen"], ["y"], name="add")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, ["N", 8]),
                                       helper.make_tensor_value_info(name, TP.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, ["N", 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_float_input_used_as_a_mask_is_filled_with_ones_on_the_command_line(tmp_path,
                                                                               capsys):
    """(b) ``logits + (1 - keep) * -10000`` by onnx.helper, ``keep`` a float input named
    without 'mask', only ``x`` given on the command line: ``keep`` got N(0,1) data, the
    penalty dominated: output std on real data (keep = ones) 1.6e-4 for a target of 1.  Now
    its use (1 - keep) says it is a mask: ones, std 1."""
    src, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(_helper_masked("keep"), str(src))
    x = np.random.default_rng(1).standard_normal((64, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    code = main(["precondition", str(src), "-o", str(out), "--calib-input",
                 f"x={tmp_path / 'x.npy'}", "--quiet"])
    assert code == 0, capsys.readouterr().err
    y = _run(out, {"x": x, "keep": np.ones((64, 4), np.float32)})["y"]
    assert float(y.std()) == pytest.approx(1.0, rel=1e-3)


# -- (c) outputs masked with -inf ----------------------------------------------------------------
class MaskedLogits(nn.Module):
    """An action-masked policy head: illegal actions get -inf (here: x_j > 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 6)

    def forward(self, x):
        z = self.b(torch.relu(self.a(x)))
        return z.masked_fill(x[:, :6] > 1.0, float("-inf"))


def test_masked_logits_are_calibrated_on_their_finite_entries(tmp_path):
    """(c) Logits masked with -inf (``masked_fill(~legal, -inf)``) were refused on both back
    ends ('NaN/inf values ... pass target_std=None'): no output scale for a masked policy.  Now
    the std is measured over the finite entries (core.calibration.masked_std), -inf stays
    -inf, a report line says how many entries were masked, and onnxruntime on the file equals
    the PyTorch result."""
    torch.manual_seed(0)
    model, x = MaskedLogits().eval(), torch.randn(64, 8)
    pt, ox, rep, prep = _both(model, x, tmp_path, ["logits"])
    y = ox["logits"]
    fin = np.isfinite(y)
    assert (fin == np.isfinite(pt["logits"])).all() and (y[~fin] == -np.inf).all()
    assert 0 < (~fin).sum() < y.size
    assert float(y[fin].std()) == pytest.approx(1.0, rel=1e-4)
    np.testing.assert_allclose(y[fin], pt["logits"][fin], rtol=1e-4, atol=1e-5)
    assert rep.output_scale == pytest.approx(prep.output_scale, rel=1e-4)
    for r in (rep, prep):
        assert f"holds -inf in {(~fin).sum()} of {y.size} entries" in " ".join(str(r).split())


def test_an_output_with_nan_is_still_refused(tmp_path):
    """(c) The -inf rule is for masks only: +inf or NaN in the main output is still refused."""
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 6)

        def forward(self, x):
            return self.a(x).masked_fill(x[:, :6] > 1.0, float("inf"))

    x = torch.randn(64, 8)
    with pytest.raises(PrecondError, match="NaN/inf"):
        precondfx.precondition(Bad().eval(), x, lr=None)


# -- (d) installed without its dependencies ------------------------------------------------------
_NO_DEPS = """
import sys, importlib.abc
class Gone(importlib.abc.MetaPathFinder):     # what pip install --no-deps leaves: no {mod}
    def find_spec(self, name, path, target=None):
        return None if name.split(".")[0] != {mod!r} else self.gone(name)
    def gone(self, name):
        raise ModuleNotFoundError("No module named " + repr(name), name=name)
sys.meta_path.insert(0, Gone())
sys.argv = ["precondfx", "inspect", "model.onnx"]
from precondfx.cli import main
raise SystemExit(main())
"""


@pytest.mark.parametrize("mod,req", [("torch", "torch>=2.4"), ("numpy", "numpy>=1.26")])
def test_the_command_line_without_a_required_dependency_says_what_to_install(tmp_path, mod,
                                                                             req):
    """(d) ``pip install --no-deps .`` then ``precondfx ...``: the console script died in
    ``import precondfx`` with a raw ModuleNotFoundError traceback ('No module named torch').
    Now exit 2 and one line naming the install command."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    r = subprocess.run([sys.executable, "-c", _NO_DEPS.format(mod=mod)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert f"a required dependency not installed (installed with --no-deps?): pip install " \
           f"'{req}'" in r.stderr, r.stderr


def test_a_missing_tqdm_is_named_as_a_required_dependency():
    """(d) tqdm (required, imported when a progress bar shows) missing: the command line said
    "module 'tqdm' is not installed (imported by the model's code)"; now it names the
    install command for precondfx's own dependency."""
    from precondfx.cli import _missing_extra
    msg = _missing_extra(ModuleNotFoundError("No module named 'tqdm'", name="tqdm"))
    assert "pip install 'tqdm>=4.66'" in msg and "model's code" not in msg, msg


def test_a_mask_filled_with_ones_that_masks_everything_is_named(tmp_path):
    """(b) A mask whose convention is the other way round (1 = padded): ones mask every entry
    and the output is all -inf.  The error names the input filled with ones and the flag that
    gives its data (it blamed the model's numerics, as for an input given by the user)."""
    from onnx import TensorProto as TP, helper, numpy_helper
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["z"], name="fc", transB=1),
             helper.make_node("Sub", ["one", "pad"], ["keep"], name="keep"),
             helper.make_node("Log", ["keep"], ["lk"], name="log"),
             helper.make_node("Add", ["z", "lk"], ["y"], name="add")]
    inits = [numpy_helper.from_array(rng.standard_normal((4, 8)).astype(np.float32), "W"),
             numpy_helper.from_array(np.zeros(4, np.float32), "b"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, ["N", 8]),
                                       helper.make_tensor_value_info("pad", TP.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TP.FLOAT, ["N", 4])], inits)
    src = str(tmp_path / "m.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              src)
    x = rng.standard_normal((32, 8)).astype(np.float32)
    with pytest.raises(PrecondError, match=r"pad \[32, 4\] were ones \(a mask\).*"
                                           r"--calib-input pad=FILE.npy"):
        precondition_onnx(src, str(tmp_path / "out.onnx"), feeds={"x": x})
    assert not (tmp_path / "out.onnx").exists()


def test_an_int64_attention_mask_given_no_data_gets_ones(tmp_path, capsys):
    """(b) transformers export ``attention_mask`` as int64 beside ``input_ids``; with only the
    ids given the command line refused ('is INT64: random normal data cannot stand in'),
    though ones (no padding) is what transformers itself uses when no mask is passed.  Now
    ones, with the note, and the file's std on unpadded data is 1."""
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(50, 16), nn.Linear(16, 3)

        def forward(self, input_ids, attention_mask):
            m = attention_mask[..., None].to(torch.float32)
            return self.head((self.emb(input_ids) * m).sum(1) / m.sum(1))

    torch.manual_seed(0)
    ids, ones = torch.randint(0, 50, (32, 7)), torch.ones(32, 7, dtype=torch.int64)
    src, out = str(tmp_path / "m.onnx"), str(tmp_path / "out.onnx")
    torch.onnx.export(Tiny().eval(), (ids, ones), src, dynamo=False,
                      input_names=["input_ids", "attention_mask"], output_names=["logits"],
                      dynamic_axes={"input_ids": {0: "b", 1: "t"},
                                    "attention_mask": {0: "b", 1: "t"}})
    np.save(tmp_path / "ids.npy", ids.numpy())
    code = main(["precondition", src, "-o", out, "--calib-input",
                 f"input_ids={tmp_path / 'ids.npy'}", "--quiet", "--report",
                 str(tmp_path / "r.json")])
    assert code == 0, capsys.readouterr().err
    y = _run(out, {"input_ids": ids.numpy(), "attention_mask": ones.numpy()})["logits"]
    assert float(y.std()) == pytest.approx(1.0, rel=1e-3)
    assert "mask input(s) attention_mask [32, 7]" in (tmp_path / "r.json").read_text()
