"""The ONNX path on files exported the way people export them (``torch.onnx.export`` with both
exporters, opsets 13..18, dynamic batch axes, several outputs, token inputs, recurrent layers,
external data, tied weights, Constant nodes...), each checked against the contract:

- the rewritten file passes ``onnx.checker`` (full check) and runs in onnxruntime;
- its main output's std on the calibration feed is within 2% of ``target_std`` where the plan
  set an output scale (measured here with onnxruntime, independently of precondfx);
- public input and output names and the initializer names are kept;
- the input file's bytes are unchanged;
- or the case gets a clear error (``PrecondError``; the CLI: one line, exit code 2).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import subprocess
import sys
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from precondfx.errors import PrecondError
from precondfx.onnx import precondition_onnx

TARGET = 1.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- models as people write them ------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, end: str | None = None):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 10)
        self.end = end

    def forward(self, x):
        y = self.b(torch.relu(self.a(x)))
        if self.end == "softmax":
            return torch.softmax(y, -1)
        if self.end == "sigmoid":
            return torch.sigmoid(y)
        if self.end == "log_softmax":
            return F.log_softmax(y, -1)
        return y


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.cls, self.box = nn.Linear(32, 5), nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.cls(h), self.box(h)


class TokenModel(nn.Module):
    """Embedding + LayerNorm + masked self-attention + tied output projection."""

    def __init__(self, vocab=50, d=32, tied=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids, mask):
        h = self.ln(self.emb(ids))
        a, _ = self.attn(h, h, h, key_padding_mask=mask == 0, need_weights=False)
        return self.head(h + a)


class ConvNet(nn.Module):
    def __init__(self, resize=False, groupnorm=False, ceil=False, dropout=False):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.n = nn.GroupNorm(2, 8) if groupnorm else nn.Identity()
        self.pool = nn.MaxPool2d(2, ceil_mode=ceil)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.resize, self.drop = resize, nn.Dropout(0.2) if dropout else nn.Identity()
        self.fc = nn.Linear(8, 6)

    def forward(self, x):
        h = self.pool(torch.relu(self.n(self.c1(x))))
        if self.resize:
            h = F.interpolate(h, scale_factor=2.0, mode="nearest")
        h = torch.relu(self.c2(h))
        return self.fc(self.drop(h.mean((2, 3))))


class Recurrent(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(8, 16, batch_first=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.fc(y[:, -1])


# -- helpers --------------------------------------------------------------------------------------
def _export(model, args, path, *, dynamo=False, opset=17, names=None, dynamic=True,
            train=False, out_names=None):
    model.train(train)
    names = names or [f"in{i}" for i in range(len(args))]
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        if dynamo:
            batch = torch.export.Dim("batch", min=2, max=1024)
            torch.onnx.export(model, args, path, dynamo=True, opset_version=opset,
                              input_names=names, output_names=out_names,
                              dynamic_shapes=tuple({0: batch} for _ in args) if dynamic else None)
        else:
            kw = dict(training=torch.onnx.TrainingMode.TRAINING) if train else {}
            torch.onnx.export(model, args, path, dynamo=False, opset_version=opset,
                              input_names=names, output_names=out_names,
                              dynamic_axes={n: {0: "batch"} for n in names} if dynamic else None,
                              do_constant_folding=not train, **kw)
    return path


def _digest(path):
    h = hashlib.sha256()
    for p in [path] + [os.path.join(os.path.dirname(path), f) for f in sorted(os.listdir(
            os.path.dirname(path))) if f.endswith(".data") and not f.startswith("out")]:
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _feeds(path, batch=16, seed=0, ints=None):
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    out = {}
    for i in s.get_inputs():
        shape = [batch if not isinstance(d, int) else d for d in i.shape]
        if "int64" in i.type:
            out[i.name] = rng.integers(0, ints or 2, size=shape).astype(np.int64)
        else:
            out[i.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def _run(path, feeds):
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return {o.name: v for o, v in zip(s.get_outputs(), s.run(None, feeds))}


def _contract(src, tmp_path, feeds=None, main=None, scaled=True, **kw):
    """Run the ONNX path on ``src`` and check the contract; returns (report, outputs)."""
    before = _digest(src)
    feeds = feeds if feeds is not None else _feeds(src)
    out = str(tmp_path / "out.onnx")
    rep = precondition_onnx(src, out, feeds=feeds, target_std=TARGET, **kw)
    assert _digest(src) == before, "the input file changed"
    onnx.checker.check_model(out, full_check=True)
    m_in, m_out = onnx.load(src, load_external_data=False), onnx.load(out,
                                                                       load_external_data=False)
    assert [i.name for i in m_in.graph.input] == [i.name for i in m_out.graph.input]
    assert [o.name for o in m_in.graph.output] == [o.name for o in m_out.graph.output]
    kept = {i.name for i in m_out.graph.initializer}
    lost = {i.name for i in m_in.graph.initializer} - kept
    pools = {n.name for n in m_in.graph.node if n.op_type == "MaxPool"}
    assert not lost or pools, f"initializers lost: {sorted(lost)[:5]}"
    outs = _run(out, feeds)
    main = main or m_in.graph.output[0].name
    if scaled:
        std = float(np.asarray(outs[main], np.float64).std())
        assert abs(std - TARGET) <= 0.02 * TARGET, (std, rep.skipped)
        assert rep.output_scale is not None
    for k, v in outs.items():
        if v.dtype.kind == "f":
            assert np.isfinite(v).all(), k
    return rep, outs


# -- cases ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("opset", [13, 15, 18])
def test_mlp_opsets_legacy(tmp_path, opset):
    src = _export(MLP(), (torch.randn(4, 16),), str(tmp_path / "m.onnx"), opset=opset)
    rep, outs = _contract(src, tmp_path)
    assert rep.verification["batch"] != 16      # ran again at another batch size


@pytest.mark.parametrize("opset", [18])
def test_mlp_dynamo(tmp_path, opset):
    src = _export(MLP(), (torch.randn(4, 16),), str(tmp_path / "m.onnx"), opset=opset,
                  dynamo=True)
    _contract(src, tmp_path)


@pytest.mark.parametrize("end", ["softmax", "sigmoid", "log_softmax"])
@pytest.mark.parametrize("dynamo", [False, True])
def test_fixed_range_output_gets_no_scale(tmp_path, end, dynamo):
    """The PyTorch path's rule (``precondfx.outputs.bounded_output``): no scale after a fixed
    range op, a RuntimeWarning and a report line; probabilities stay probabilities."""
    src = _export(MLP(end), (torch.randn(4, 16),), str(tmp_path / "m.onnx"), dynamo=dynamo,
                  opset=18 if dynamo else 17)
    with pytest.warns(RuntimeWarning, match="return the values before that op"):
        rep, outs = _contract(src, tmp_path, scaled=False)
    assert rep.output_scale is None
    assert any("return the values before that op" in why for _, why in rep.skipped)
    y = next(iter(outs.values())).astype(np.float64)
    if end == "softmax":
        assert np.allclose(y.sum(-1), 1.0, atol=1e-5)
    elif end == "sigmoid":
        assert (y >= 0).all() and (y <= 1).all()
    else:
        assert np.allclose(np.exp(y).sum(-1), 1.0, atol=1e-4)


def test_multiple_outputs(tmp_path):
    src = _export(TwoHeads(), (torch.randn(4, 16),), str(tmp_path / "m.onnx"),
                  out_names=["cls", "box"])
    feeds = _feeds(src)
    orig = _run(src, feeds)
    rep, outs = _contract(src, tmp_path, feeds=feeds, main="cls")
    assert outs["box"].shape == orig["box"].shape
    rep2, outs2 = _contract(src, tmp_path, feeds=feeds, main="box", output_key="box")
    assert abs(outs2["box"].std() - TARGET) < 0.02


@pytest.mark.parametrize("tied", [False, True])
def test_tokens_embedding_attention_mask(tmp_path, tied):
    m = TokenModel(tied=tied)
    ids, mask = torch.randint(0, 50, (4, 7)), torch.ones(4, 7, dtype=torch.int64)
    src = _export(m, (ids, mask), str(tmp_path / "m.onnx"), names=["ids", "mask"], opset=17)
    rng = np.random.default_rng(0)
    feeds = {"ids": rng.integers(0, 50, (16, 7)).astype(np.int64),
             "mask": (rng.random((16, 7)) > 0.2).astype(np.int64)}
    feeds["mask"][:, 0] = 1
    _contract(src, tmp_path, feeds=feeds)


@pytest.mark.parametrize("kw", [dict(groupnorm=True), dict(ceil=True), dict(resize=True)],
                         ids=["groupnorm", "maxpool_ceil", "resize"])
def test_conv_variants(tmp_path, kw):
    src = _export(ConvNet(**kw), (torch.randn(2, 3, 15, 15),), str(tmp_path / "m.onnx"))
    _contract(src, tmp_path)


@pytest.mark.parametrize("cell", [nn.GRU, nn.LSTM], ids=["gru", "lstm"])
def test_recurrent(tmp_path, cell):
    src = _export(Recurrent(cell), (torch.randn(2, 5, 8),), str(tmp_path / "m.onnx"))
    _contract(src, tmp_path)


def test_training_mode_dropout(tmp_path):
    """A file exported in training mode holds a Dropout with training_mode=True: its output is
    random, so calibration must not read a random draw as the std."""
    src = _export(ConvNet(dropout=True), (torch.randn(2, 3, 15, 15),), str(tmp_path / "m.onnx"),
                  train=True, opset=13)
    assert any(n.op_type == "Dropout" for n in onnx.load(src).graph.node)
    try:
        _contract(src, tmp_path)
    except PrecondError as e:
        assert "ropout" in str(e)


def test_external_data(tmp_path):
    src = _export(MLP(), (torch.randn(4, 16),), str(tmp_path / "m.onnx"))
    p = onnx.load(src)
    ext = str(tmp_path / "ext.onnx")
    onnx.save_model(p, ext, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="ext.onnx.data", size_threshold=0)
    os.remove(src)
    _contract(ext, tmp_path)
    assert os.path.exists(tmp_path / "out.onnx.data")


def test_constant_nodes_instead_of_initializers(tmp_path):
    src = _export(MLP(), (torch.randn(4, 16),), str(tmp_path / "m.onnx"))
    p = onnx.load(src)
    for init in list(p.graph.initializer):
        p.graph.node.insert(0, onnx.helper.make_node("Constant", [], [init.name], value=init))
    del p.graph.initializer[:]
    const = str(tmp_path / "const.onnx")
    onnx.save(p, const)
    rep, outs = _contract(const, tmp_path)
    from onnx import numpy_helper
    got = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(tmp_path / "out.onnx")
                                                               ).graph.initializer}
    for name in ("a.weight", "b.weight"):      # re-initialized from the plan's std
        planned = rep.plan.inits[name].std
        assert abs(got[name].std() - planned) <= 0.02 * planned, (name, planned)


def test_already_preconditioned(tmp_path):
    src = _export(MLP(), (torch.randn(4, 16),), str(tmp_path / "m.onnx"))
    feeds = _feeds(src)
    _contract(src, tmp_path, feeds=feeds)
    again = str(tmp_path / "once.onnx")
    os.replace(tmp_path / "out.onnx", again)
    before = _digest(again)
    with pytest.raises(PrecondError, match="already preconditioned.*original export"):
        precondition_onnx(again, str(tmp_path / "twice.onnx"), feeds=feeds)
    assert _digest(again) == before and not os.path.exists(tmp_path / "twice.onnx")


def test_output_is_input_refused(tmp_path):
    src = _export(MLP(), (torch.randn(4, 16),), str(tmp_path / "m.onnx"))
    before = _digest(src)
    with pytest.raises(PrecondError, match="choose another output path"):
        precondition_onnx(src, src, feeds=_feeds(src))
    assert _digest(src) == before


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "precondfx", *args, "--quiet"],
                          capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)


def test_cli_bad_paths_and_corrupt_file(tmp_path):
    src = _export(MLP(), (torch.randn(4, 16),), str(tmp_path / "m.onnx"))
    before = _digest(src)
    r = _cli("precondition", src, "-o", src)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = _cli("precondition", src, "-o", str(tmp_path / "nope" / "out.onnx"))
    assert r.returncode == 2 and "does not exist" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(open(src, "rb").read()[:200])
    r = _cli("precondition", str(bad), "-o", str(tmp_path / "o.onnx"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not os.path.exists(tmp_path / "o.onnx")
    assert _digest(src) == before
