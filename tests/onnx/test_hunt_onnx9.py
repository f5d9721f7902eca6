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
