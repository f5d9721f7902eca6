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
