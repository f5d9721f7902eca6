"""Defects found by a hunt over layer types and architectures written the way users write them
(each test failed before its fix, named in the test's docstring)."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _run(model: nn.Module, sample, **opts):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return precondfx.precondition(model, sample, seed=0, **opts)


def _m2(t: torch.Tensor) -> float:
    return float(t.detach().double().pow(2).mean())


# -------------------------------------------------- nn.TransformerEncoder / nn.Transformer


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 16)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.enc = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16),
                                         enable_nested_tensor=False)
        self.cls = nn.Linear(16, 3)

    def forward(self, x):
        return self.cls(self.enc(self.inp(x)).mean(1))


class _Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.src, self.tgt = nn.Embedding(20, 16), nn.Embedding(20, 16)
        self.tf = nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(16, 20)

    def forward(self, src, tgt):
        mask = self.tf.generate_square_subsequent_mask(tgt.shape[1])
        return self.out(self.tf(self.src(src), self.tgt(tgt), tgt_mask=mask))


def _ids(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 20, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("build, sample", [
    (_Encoder, lambda: _x(6, 7, 5)),
    (_Seq2Seq, lambda: (_ids(6, 5, seed=1), _ids(6, 4, seed=2))),
], ids=["TransformerEncoder", "Transformer"])
def test_transformer_modules_are_seen_into(build, sample):
    """fx keeps every ``torch.nn`` module as one call, so an ``nn.TransformerEncoder`` (or
    ``nn.Transformer``) was a single node of status unknown and all its layers were left at
    PyTorch's init ("kept ...: read by an op that is not a weighted layer"): 26 of the
    encoder model's 30 parameters, every attention and feed-forward weight.  Fixed in
    ``capture.fx_capture._Tracer.is_leaf_module`` (a torch.nn module the op table does not
    know and that holds modules is traced through, as export and eager capture do)."""
    torch.manual_seed(0)
    model = build()
    res, rep = _run(model, sample(), balance="none")
    assert not rep.rows("unknown"), [(r.label, r.target) for r in rep.rows("unknown")]
    layers = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
              and (".linear1" in n or ".linear2" in n or "out_proj" in n)]
    assert len(layers) >= 4
    for name in layers:
        mod = model.get_submodule(name)
        pi = rep.plan.inits[f"{name}.weight"]
        assert pi.rule == "geometric", (name, pi.reason)
        want = 2 / math.sqrt(mod.in_features * mod.out_features)    # Eq. 7, k = 1
        assert _m2(res.get_submodule(name).weight) == pytest.approx(want, rel=1e-3), name
    for n, m in model.named_modules():
        if isinstance(m, nn.MultiheadAttention):
            assert rep.plan.inits[f"{n}.in_proj_weight"].rule == "geometric"
            assert _m2(res.get_submodule(n).in_proj_weight) == \
                pytest.approx(2 / 16, rel=1e-3)   # three 16 -> 16 maps
    assert isinstance(res, type(model))
    args = sample() if isinstance(sample(), tuple) else (sample(),)
    with torch.no_grad():
        out = res(*args)
    assert abs(float(out.double().std(correction=0)) - 1) < 0.02
    # the function is the user's, up to the output scale, with weights kept
    same, rep2 = _run(model, sample(), reinit_weights=False, balance="none", residual="none",
                      maxpool="keep")
    with torch.no_grad():
        got, want = same(*args), model(*args) * rep2.output_scale
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# -------------------------------------------------- recurrent weights


class _LSTMProj(nn.Module):
    def __init__(self, proj: int = 8) -> None:
        super().__init__()
        self.lstm = nn.LSTM(10, 24, num_layers=2, proj_size=proj, batch_first=True)
        self.fc = nn.Linear(proj or 24, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


def test_lstm_projection_weight_is_initialized():
    """``nn.LSTM(proj_size=P)``: every weight of the LSTM was re-initialized except the
    projection ``weight_hr_l*`` (P x H), a map applied at every time step, which kept PyTorch's
    ``U(-1/sqrt(H), 1/sqrt(H))`` (E[W^2] = 1/(3H): the projected state lost 2/3 of its second
    moment per step against the orthogonal recurrent weights).  Now orthogonal rows, as the
    recurrent weights (``core.plan._opaque_inits``)."""
    torch.manual_seed(0)
    model = _LSTMProj()
    res, rep = _run(model, _x(6, 7, 10), balance="none")
    for layer in (0, 1):
        name = f"lstm.weight_hr_l{layer}"
        assert rep.plan.inits[name].rule == "orthogonal", rep.plan.inits[name].reason
        w = res.get_parameter(name).detach().double()
        assert w.shape == (8, 24)
        torch.testing.assert_close(w @ w.T, torch.eye(8, dtype=torch.float64), atol=1e-5,
                                   rtol=0)
        assert not torch.equal(w.float(), model.get_parameter(name))


@pytest.mark.parametrize("build", [lambda: _LSTMProj(8), lambda: _LSTMProj(0)],
                         ids=["proj", "plain"])
def test_init_keep_leaves_recurrent_weights(build):
    """``init='keep'`` ("leave the weights") still re-drew every LSTM/GRU/RNN hidden-to-hidden
    weight as an orthogonal matrix: the model's trained or chosen recurrent weights were
    replaced (``weight_hh_l0`` changed while the input weights were kept).  Fixed in
    ``core.plan._opaque_inits``."""
    torch.manual_seed(0)
    model = build()
    res, rep = _run(model, _x(6, 7, 10), init="keep", balance="none")
    for name, p in model.named_parameters():
        if "weight" in name:
            assert rep.plan.inits[name].rule == "keep", (name, rep.plan.inits[name].reason)
            assert torch.equal(res.get_parameter(name), p), name
