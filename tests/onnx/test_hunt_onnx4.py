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


class _Tied(nn.Module):
    """An embedding tied to the output layer (GPT-2's wte / lm_head)."""

    def __init__(self, vocab=50, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mix(self.emb(ids))))


def _inits(path):
    import onnx
    from onnx import numpy_helper
    return {i.name: numpy_helper.to_array(i) for i in onnx.load(path).graph.initializer}


def test_a_tie_the_exporter_stored_twice_is_reported_split(tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (8, 12))
    src = _export(_Tied(), ids, tmp_path / "tied.onnx", input_names=["ids"])
    w = _inits(src)
    folded = [k for k, v in w.items() if v.shape == (32, 50)]
    assert len(folded) == 1 and np.array_equal(w[folded[0]], w["emb.weight"].T)
    out = str(tmp_path / "out.onnx")
    rep = precondition_onnx(src, out, feeds={"ids": ids.numpy()})
    notes = [n for n in rep.capture_notes if "held the same values" in n]
    assert len(notes) == 1 and "'emb.weight'" in notes[0] and folded[0] in notes[0]
    w2 = _inits(out)
    gap = np.abs(w2[folded[0]] - w2["emb.weight"].T).max() / np.abs(w2["emb.weight"]).max()
    assert gap > 0.1           # drawn separately: what the note says
    # exported without folding, the tie is one initializer: drawn once, nothing to say
    src2 = _export(_Tied(), ids, tmp_path / "tied_nf.onnx", input_names=["ids"],
                   do_constant_folding=False)
    rep2 = precondition_onnx(src2, str(tmp_path / "out2.onnx"), feeds={"ids": ids.numpy()})
    assert not [n for n in rep2.capture_notes if "held the same values" in n]
    assert len([k for k, v in _inits(str(tmp_path / "out2.onnx")).items() if v.ndim == 2]) == 2
    # layers cloned before training (copy.deepcopy) hold equal values but are not tied
    import copy
    layer = nn.Linear(32, 32)
    clones = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), copy.deepcopy(layer), nn.ReLU(),
                           copy.deepcopy(layer), nn.Linear(32, 4))
    x = torch.randn(6, 8)
    src3 = _export(clones, x, tmp_path / "clones.onnx", input_names=["x"])
    rep3 = precondition_onnx(src3, str(tmp_path / "out3.onnx"), feeds={"x": x.numpy()})
    assert not [n for n in rep3.capture_notes if "held the same values" in n]


def test_an_embedded_output_over_one_with_external_data_leaves_no_stale_data(tmp_path):
    torch.manual_seed(0)
    m, x = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10)), torch.randn(8, 16)
    src = _export(m, x, tmp_path / "mlp.onnx", input_names=["x"])
    out = tmp_path / "out.onnx"
    data = tmp_path / "out.onnx.data"
    precondition_onnx(src, str(out), feeds={"x": x.numpy()}, external_data="always")
    assert data.is_file()
    rep = precondition_onnx(src, str(out), feeds={"x": x.numpy()}, seed=1)   # embedded now
    assert not data.exists()         # the old output's weights do not sit beside the new one
    y = ort.InferenceSession(str(out)).run(None, {"x": x.numpy()})[0]
    assert float(y.std()) == pytest.approx(1.0, rel=1e-3) and rep.output_scale > 0
    other = tmp_path / "notes.onnx.data"     # a file the earlier output does not read: kept
    other.write_text("mine")
    precondition_onnx(src, str(tmp_path / "notes.onnx"), feeds={"x": x.numpy()})
    assert other.read_text() == "mine"


def test_a_fixed_batch_mismatch_says_what_to_do(tmp_path):
    from precondfx.errors import PrecondError
    m, x = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)), torch.randn(16, 16)
    src = _export(m, x, tmp_path / "m.onnx", input_names=["x"])     # batch fixed at 16
    with pytest.raises(PrecondError) as e:
        precondition_onnx(src, str(tmp_path / "o.onnx"), feeds={"x": x[:4].numpy()})
    msg = str(e.value)
    assert "dim 0: calibration 4 vs model 16" in msg and "dynamic_axes=" in msg
    assert not (tmp_path / "o.onnx").exists()
