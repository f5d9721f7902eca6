"""Defects found by the fourth ONNX hunt (real exports, checked with onnxruntime); each test
fails without its fix."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import precondfx
from precondfx.onnx import precondition_onnx

ort = pytest.importorskip("onnxruntime")


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.cls = nn.Linear(32, 10)
        self.box = nn.Linear(32, 4)

    def forward(self, x):
        h = self.body(x)
        return self.cls(h), self.box(h)


def _export(model, x, path, **kw):
    torch.onnx.export(model.eval(), (x,), str(path), dynamo=False, **kw)
    return str(path)


def test_two_outputs_say_which_takes_the_output_scale(tmp_path):
    torch.manual_seed(0)
    m, x = _TwoHeads(), torch.randn(8, 16)
    src = _export(m, x, tmp_path / "two.onnx", input_names=["x"],
                  output_names=["scores", "boxes"])
    rep = precondition_onnx(src, str(tmp_path / "out.onnx"), feeds={"x": x.numpy()})
    notes = [n for n in rep.capture_notes if "output scale on" in n]
    assert len(notes) == 1 and "'scores'" in notes[0] and "not on output 'boxes'" in notes[0]
    _, rt = precondfx.precondition(m, x)     # the PyTorch path says the same
    assert any("not on output[1]" in n for n in rt.capture_notes)
    s = ort.InferenceSession(str(tmp_path / "out.onnx"))
    scores, boxes = s.run(None, {"x": x.numpy()})
    assert float(scores.std()) == pytest.approx(1.0, rel=1e-3)      # the scaled one
    assert abs(float(boxes.std()) - 1.0) > 0.05                      # left as drawn

