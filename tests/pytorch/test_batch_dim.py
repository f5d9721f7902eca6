"""Sequence-first inputs (batch in dim 1): measured balancing finds the batch dimension and
measures the same per-sample statistics as on the batch-first twin of the model."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import precondfx
from precondfx.pytorch.capture.common import Sample
from precondfx.pytorch.measure import batchdim
from precondfx.pytorch.measure.sketch import hessian_sketch

T, B, V = 6, 8, 20


class Tagger(nn.Module):
    """Embedding -> Transformer encoder -> head; ``batch_first`` as nn.Transformer's."""

    def __init__(self, batch_first: bool, causal: bool = False) -> None:
        super().__init__()
        self.batch_first, self.causal = batch_first, causal
        self.emb = nn.Embedding(V, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=batch_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1] if self.batch_first else ids.shape[0]
        mask = nn.Transformer.generate_square_subsequent_mask(t) if self.causal else None
        return self.head(self.enc(self.emb(ids), mask=mask, is_causal=self.causal))


class RNNClassifier(nn.Module):
    """Linear -> LSTM (default: sequence-first) -> last step -> head."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.inp = nn.Linear(5, 12)
        self.rnn = nn.LSTM(12, 12, batch_first=batch_first)
        self.mid = nn.Linear(12, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o, _ = self.rnn(torch.tanh(self.inp(x)))
        last = o[:, -1] if self.batch_first else o[-1]
        return self.head(torch.relu(self.mid(last)))


def _twins(cls: type, **kw) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    seq = cls(batch_first=False, **kw)
    bat = cls(batch_first=True, **kw)
    bat.load_state_dict(seq.state_dict())
    return seq, bat


def _ids() -> torch.Tensor:
    return torch.randint(0, V, (T, B), generator=torch.Generator().manual_seed(0))


def _x() -> torch.Tensor:
    return torch.randn(T, B, 5, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("causal", [False, True])
def test_detects_dim_1_for_sequence_first(causal: bool) -> None:
    seq, bat = _twins(Tagger, causal=causal)
    s, note = batchdim.resolve(seq, Sample((_ids(),), {}), lambda o: o)
    assert s.batch_dim == 1 and "sequence-first" in note and f"batch {B}" in note
    # batch-first twin: dim 0 is kept, no note
    s0, note0 = batchdim.resolve(bat, Sample((_ids().T.contiguous(),), {}), lambda o: o)
    assert s0.batch_dim is None and note0 == ""
    # the user's word wins
    s2, _ = batchdim.resolve(seq, Sample((_ids(),), {}, batch_dim=0), lambda o: o)
    assert s2.batch_dim == 0


def test_sketch_on_sequence_first_equals_batch_first_twin() -> None:
    seq, bat = _twins(Tagger)
    w = ["emb.weight", "enc.layers.0.linear1.weight", "head.weight"]
    a = hessian_sketch(seq, Sample((_ids(),), {}, batch_dim=1), w, n_samples=4, seed=3)
    b = hessian_sketch(bat, _ids().T.contiguous(), w, n_samples=4, seed=3, batched=False)
    for k in w:
        assert a.values[k].mean == pytest.approx(b.values[k].mean, rel=1e-4), k


@pytest.mark.parametrize("cls,sample", [(Tagger, _ids), (RNNClassifier, _x)])
def test_measured_balancing_equals_batch_first_twin(cls: type, sample) -> None:
    seq, bat = _twins(cls)
    # a threshold near 1: no early stop, both measure all 8 samples (the batched engine of the
    # batch-first twin stops by rounds, the loop by samples)
    kw = dict(balance="hessian", seed=2, balance_samples=8, target_std=1.0,
              balance_threshold=1.001)
    rs, reps = precondfx.precondition(seq, sample(), **kw)
    rb, repb = precondfx.precondition(bat, sample().transpose(0, 1).contiguous(), **kw)
    hs, hb = reps.conditioning["hessian"], repb.conditioning["hessian"]
    assert hs["batch_dim"] == 1 and "sequence-first" in hs["note"]
    assert hb["batch_dim"] == 0 and hs["batch"] == hb["batch"] == B
    assert hs["samples"] == hb["samples"] == 8
    assert hs["applied"] and hb["applied"]
    assert set(hs["factors"]) == set(hb["factors"]) and len(hs["factors"]) >= 2
    for k, f in hb["factors"].items():
        assert hs["factors"][k] == pytest.approx(f, rel=1e-4), k
    # calibration is over the whole batch: same output std on both layouts
    with torch.no_grad():
        ys = rs.eval()(sample())
        yb = rb.eval()(sample().transpose(0, 1).contiguous())
    ys_b = ys.transpose(0, 1) if ys.dim() == 3 else ys
    assert torch.allclose(ys_b, yb, rtol=1e-4, atol=1e-5)


class Mixer(nn.Module):
    """A sequence-first GRU, then a mean over both dims: no batch dimension to find."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.b = nn.GRU(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(x)
        return self.b(h - h.mean(dim=(0, 1), keepdim=True))


def test_model_mixing_samples_keeps_dim_0() -> None:
    s, note = batchdim.resolve(Mixer(), Sample((torch.randn(5, 6, 4),), {}), lambda o: o)
    assert s.batch_dim is None and note == ""


def test_models_without_sequence_first_modules_pay_nothing() -> None:
    m, calls = nn.Linear(4, 2), []
    m.register_forward_hook(lambda *a: calls.append(1))
    s, note = batchdim.resolve(m, Sample((torch.randn(5, 6, 4),), {}), lambda o: o)
    assert (s.batch_dim, note, len(calls)) == (None, "", 0)
    m2, calls2 = Mixer(), []
    m2.register_forward_hook(lambda *a: calls2.append(1))
    batchdim.resolve(m2, Sample((torch.randn(5, 6, 4),), {}), lambda o: o)
    assert len(calls2) == 3      # the batch, then the first sample along dim 0 and dim 1
    #                              (each check stops at the first mismatch)
