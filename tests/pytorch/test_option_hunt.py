"""Regressions found by a hunt over option combinations (each a defect the defaults did not
show): every test fails without its fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import precondfx
from tests.user_models import PoolCNN


def _pool_net():
    torch.manual_seed(3)
    return PoolCNN(), torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("opts", [dict(init="keep", maxpool="conv"),
                                  dict(reinit_weights=False, maxpool="conv", balance="none"),
                                  dict(reinit_weights=False, maxpool="conv",
                                       pool_conv="depthwise", balance="none")])
def test_replacement_conv_is_drawn_from_the_seed(opts):
    """A max-pool's replacement conv is a new layer: with init='keep' or reinit_weights=False
    it was left at torch's default init, drawn from the global RNG (the same seed gave
    different models)."""
    states = []
    for g in (0, 1):
        torch.manual_seed(g)            # the global RNG must not matter
        model, x = _pool_net()
        torch.manual_seed(100 + g)
        res, rep = precondfx.precondition(model, x, **opts)
        states.append(res.state_dict())
        assert rep.plan.inits["pool.weight"].rule == "geometric"
        assert rep.plan.inits["pool.bias"].rule == "zeros"
        assert float(res.pool.bias.detach().abs().max()) == 0.0
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


def _mlp():
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)),
            torch.randn(16, 6, generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("opts,said", [
    (dict(maxpool="keep", pool_conv="avg"), "pool_conv='avg' has no effect"),
    (dict(pool_conv="depthwise"), "pool_conv='depthwise' has no effect"),     # no max-pool
    (dict(balance="none", balance_threshold=5.0), "balance_threshold=5.0 has no effect"),
    (dict(balance="analytic", balance_samples=2), "balance_samples=2 has no effect"),
    (dict(residual="none", residual_scale=0.5), "residual_scale=0.5 has no effect"),
    (dict(reinit_weights=False, init="xavier"), "init='xavier' has no effect"),
])
def test_an_option_without_effect_is_said(opts, said):
    """An option set to a value the other options leave without effect was ignored without a
    word; the plan (precondition's and analyze's) now says so."""
    model, x = _mlp()
    _, rep = precondfx.precondition(model, x, **opts)
    assert sum(said in n for n in rep.plan.notes) == 1, rep.plan.notes
    assert rep.plan.notes == precondfx.analyze(model, x, **opts).plan.notes


def test_an_option_with_effect_gets_no_note():
    model, x = _mlp()
    _, rep = precondfx.precondition(model, x, balance="hessian", balance_samples=4,
                                    balance_threshold=3.0)
    assert not any("has no effect" in n for n in rep.plan.notes), rep.plan.notes


@pytest.mark.parametrize("opts,said", [
    (dict(maxpool="conv"), "maxpool='conv' has no effect: the model has no max-pool"),
    (dict(residual="all"), "residual='all' has no effect: the model has no residual join"),
    (dict(residual_scale="nf"), "residual_scale='nf' has no effect: the model has no residual"),
])
def test_an_option_this_model_leaves_without_effect_is_said(opts, said):
    model, x = _mlp()
    _, rep = precondfx.precondition(model, x, **opts)
    assert sum(said in n for n in rep.plan.notes) == 1, rep.plan.notes


def test_pool_conv_without_a_replaced_pool_is_said():
    model, x = _pool_net()
    _, rep = precondfx.precondition(model, x, maxpool="avgpool", pool_conv="depthwise")
    assert [n for n in rep.plan.notes if "has no effect" in n] == [
        "pool_conv='depthwise' has no effect: maxpool='avgpool' replaces no max-pool by a "
        "convolution"]
    model, x = _pool_net()
    _, rep = precondfx.precondition(model, x, maxpool="conv", pool_conv="depthwise")
    assert not any("has no effect" in n for n in rep.plan.notes)
    assert rep.plan.pools[0].conv == "depthwise"


class DeepTanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh())])
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.layers(x))


@pytest.mark.parametrize("scheme", ["lsuv", "gne", "dks"])
def test_init_a_scheme_ignores_is_said(scheme):
    """init='xavier' with a scheme that draws every weight its own way changed nothing and the
    report did not say so."""
    torch.manual_seed(0)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    states, notes = [], []
    for init in ("geometric", "xavier"):
        torch.manual_seed(0)
        res, rep = precondfx.precondition(DeepTanh(), x, scheme=scheme, init=init)
        states.append(res.state_dict())
        notes.append([n for n in rep.plan.notes if n.startswith("init=")])
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])  # no effect ...
    assert notes[0] == []
    assert notes[1] == [f"init='xavier' has no effect: scheme={scheme!r} draws every weight "
                        f"its own way"]                                  # ... and it says so


def test_init_the_geometric_scheme_reads_gets_no_note():
    model, x = _mlp()
    _, rep = precondfx.precondition(model, x, init="xavier")
    assert not any(n.startswith("init=") for n in rep.plan.notes)
    assert any(pi.rule == "xavier" for pi in rep.plan.inits.values())


class TokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 16)
        self.head = nn.Linear(16, 30)

    def forward(self, idx):
        return self.head(torch.relu(self.emb(idx)))


@pytest.mark.parametrize("capture", ["fx", "eager"])
def test_input_scale_on_integer_inputs_is_not_claimed(capture):
    """input_scale=2.0 on a model of token ids scaled nothing, yet the report said 'input
    scale: 2' (report.input_scale, an input scale in the plan) and the result held a buffer
    for it."""
    torch.manual_seed(0)
    ids = torch.randint(0, 30, (8, 6), generator=torch.Generator().manual_seed(1))
    _, plain = precondfx.precondition(TokenNet(), ids, capture=capture)
    torch.manual_seed(0)
    res, rep = precondfx.precondition(TokenNet(), ids, input_scale=2.0, capture=capture)
    assert rep.input_scale is None
    assert not any(sc.tag == "input" for sc in rep.plan.scales)
    assert [n for n in rep.plan.notes if n.startswith("input_scale=")] == [
        "input_scale=2.0 has no effect: the model takes no floating-point input (token ids and "
        "other integer inputs are not scaled)"]
    assert rep.output_scale == pytest.approx(plain.output_scale, rel=1e-6)
    assert not any("input_scale" in k for k in res.state_dict())
    assert precondfx.analyze(TokenNet(), ids, input_scale=2.0).plan.notes == rep.plan.notes


class NormedRes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.a = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        h = self.inp(x)
        h = h + self.ln(self.a(torch.relu(h)))       # normalized branch: residual='auto' skips it
        return self.out(h)


def test_residual_scale_without_a_scaled_branch_is_said():
    """residual_scale=0.5 where residual='auto' scales no branch (every branch normalized)
    changed nothing and was not mentioned; residual='all' still takes it."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    _, rep = precondfx.precondition(NormedRes(), x, residual_scale=0.5)
    assert [r.s for r in rep.plan.residuals] == [None]
    notes = [n for n in rep.plan.notes if n.startswith("residual_scale=")]
    assert len(notes) == 1 and notes[0].startswith(
        "residual_scale=0.5 has no effect: no residual join gets a branch scale (add")
    torch.manual_seed(0)
    _, rep = precondfx.precondition(NormedRes(), x, residual_scale=0.5, residual="all")
    assert [r.s for r in rep.plan.residuals] == [0.5]
    assert not any(n.startswith("residual_scale=") for n in rep.plan.notes)


@pytest.mark.parametrize("option", ["measure", "suggest_lr"])
def test_analyze_says_it_does_not_measure(option):
    """analyze(measure=True) / analyze(suggest_lr=True) returned a report without the
    measurement and without a word about it."""
    model, x = _mlp()
    rep = precondfx.analyze(model, x, **{option: True})
    assert [w for w, _ in rep.skipped] == [f"{option}=True"]
    assert precondfx.analyze(model, x).skipped == []


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if h.sum() > 0:                  # data-dependent control flow: fx cannot trace it
            h = h * 2
        return self.b(h)


def test_a_capture_restricted_to_one_method_says_the_others_may_work():
    """capture='fx' on a model fx cannot trace ended in 'Check that the model runs on the
    sample' (it does): the error now names the methods not tried and how to try them."""
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    with pytest.raises(precondfx.PrecondError) as e:
        precondfx.precondition(Branchy(), x, capture="fx")
    msg = str(e.value)
    assert "fx: failed" in msg
    assert "the other methods (export, draft_export, eager) may capture it" in msg
    assert "drop capture=" in msg
    res, rep = precondfx.precondition(Branchy(), x, capture="eager")     # which it does
    assert rep.capture == "eager"


@pytest.mark.parametrize("empty", [[], ()])
def test_an_empty_capture_list_is_said_to_be_empty(empty):
    """capture=[] said "capture=[[]] is not among (...)"."""
    model, x = _mlp()
    with pytest.raises(precondfx.PrecondError, match=r"capture=(\[\]|\(\)) is empty: pass one "
                       r"method"):
        precondfx.precondition(model, x, capture=empty)


def test_init_with_reinit_false_draws_the_replacement_conv():
    """With reinit_weights=False, init= still draws a max-pool's replacement conv: no 'has no
    effect' note there, and the note where nothing is drawn."""
    model, x = _pool_net()
    _, rep = precondfx.precondition(model, x, reinit_weights=False, init="xavier",
                                    maxpool="conv")
    assert rep.plan.inits["pool.weight"].rule == "xavier"
    assert not any(n.startswith("init=") for n in rep.plan.notes)
    model, x = _pool_net()
    _, rep = precondfx.precondition(model, x, reinit_weights=False, init="xavier",
                                    maxpool="keep")
    assert [n for n in rep.plan.notes if n.startswith("init=")] == [
        "init='xavier' has no effect: reinit_weights=False keeps the weights (only a new "
        "layer, the convolution that replaces a max-pool, is drawn)"]


def test_residual_scale_as_an_array_is_the_same_as_a_list():
    """A numpy array or a tensor of per-join values is taken as the list of them (it was
    refused as not 'a sequence of numbers'); a 2-d array is still refused."""
    import numpy as np
    from precondfx.core import residual_schedule as rs
    want = (0.5, 0.25, 1.0)
    assert rs.check("residual_scale", np.array(want)) == want
    assert rs.check("residual_scale", torch.tensor(want, dtype=torch.float64)) == want
    assert rs.check("residual_scale", np.float32(0.5)) == 0.5
    with pytest.raises(precondfx.PrecondError, match="residual_scale="):
        rs.check("residual_scale", np.full((2, 2), 0.5))
