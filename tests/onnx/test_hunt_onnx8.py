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
