"""Defects found by the meta/fold/distributed hunt (hunt_meta2)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx


class _TiedReluHead(nn.Module):
    """A small language model whose output head shares the embedding's weight and reads a
    ReLU of a linear layer (``F.relu`` or ``nn.ReLU``)."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.mid = nn.Linear(16, 16)
        self.act = nn.ReLU() if act == "module" else None
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.emb(t))
        h = self.act(h) if self.act is not None else F.relu(h)
        return self.head(h)


def _two_steps_then_fold(model: nn.Module, x: torch.Tensor, lr: float) -> nn.Module:
    """Two SGD steps on the result (the constants and weights move), then ``fold``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return precondfx.fold(model)


@pytest.mark.parametrize("capture,act", [("fx", "function"), ("fx", "module"),
                                         ("eager", "function")])
def test_fold_tied_head_passes_its_factor_through_relu(capture: str, act: str) -> None:
    """The docs: a tied head's factor passes to the module producing its input, and a scale
    after a positively homogeneous op (``F.relu``) passes to the layer before it.  Together
    they were refused ("a tied weight whose users need different scales"); now the head's
    factor goes through the ReLU into ``mid``, also after training steps."""
    torch.manual_seed(1)
    x = torch.randint(0, 40, (8, 5))
    model, _ = precondfx.precondition(_TiedReluHead(act), x, capture=capture)
    assert precondfx.fold_problems(model) == []
    plain = _two_steps_then_fold(model, x, lr=0.05)
    assert type(plain) is _TiedReluHead
    assert plain.head.weight is plain.emb.weight
    assert not [n for n, _ in plain.named_buffers() if "precondfx" in n]
    with torch.no_grad():
        want = model(x)
        assert torch.allclose(plain(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        fresh = _TiedReluHead(act)
        fresh.load_state_dict(plain.state_dict(), strict=True)
        assert torch.equal(fresh(x), plain(x))


class _ScaledBranches(nn.Module):
    """A residual MLP whose branches end in a fixed factor: ``0.5 * layer(h)``, a layer scale
    ``layer(h) * self.gamma`` (CaiT/ConvNeXt style), ``layer(h) / 4``, or (not foldable) a
    product with another activation, ``layer(h) * torch.sigmoid(h)``."""

    def __init__(self, how: str, width: int = 16) -> None:
        super().__init__()
        self.how = how
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.gamma = nn.Parameter(torch.full((width,), 0.5))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.blocks:
            if self.how == "half":
                b = 0.5 * layer(h)
            elif self.how == "gamma":
                b = layer(h) * self.gamma
            elif self.how == "div":
                b = layer(h) / 4
            else:
                b = layer(h) * torch.sigmoid(h)
            h = h + b
        return self.out(h)


@pytest.mark.parametrize("how", ["half", "gamma", "div"])
def test_fold_residual_scale_through_a_fixed_factor(how: str) -> None:
    """fx back end: the residual scale sits on ``0.5 * layer(h)`` (or ``* gamma``, ``/ 4``);
    fold refused it ("multiplies the output of mul ... which no module of your class can
    absorb exactly") though the product is linear in ``layer(h)``: the scale now goes into
    ``layer``'s weight and bias, also after training steps (gamma trained too)."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    model, _ = precondfx.precondition(_ScaledBranches(how), x, capture="fx")
    assert any(k.startswith("precondfx_residual") and v != 1.0
               for k, v in model.precondfx_constants.items())
    assert precondfx.fold_problems(model) == []
    plain = _two_steps_then_fold(model, x, lr=0.01)
    assert type(plain) is _ScaledBranches
    with torch.no_grad():
        want = model(x)
        got = plain(x)
        assert ((got - want).norm() / want.norm()).item() < 1e-5
        fresh = _ScaledBranches(how)
        fresh.load_state_dict(plain.state_dict(), strict=True)
        assert torch.equal(fresh(x), got)


def test_fold_moves_the_scale_of_a_gated_product_onto_its_layer() -> None:
    """``layer(h) * sigmoid(h)``, a product of two activations, is linear in ``layer(h)``: the
    residual scale goes into ``layer``'s weight and bias (``core.nodes.gate_node``; fold
    refused it before, "no module of your class can absorb"), also after training steps."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    model, _ = precondfx.precondition(_ScaledBranches("gate"), x, capture="fx")
    res = [k for k, v in model.precondfx_constants.items()
           if k.startswith("precondfx_residual") and v != 1.0]
    assert len(res) == 2
    assert precondfx.fold_problems(model) == []
    plain = _two_steps_then_fold(model, x, lr=0.01)
    assert type(plain) is _ScaledBranches
    with torch.no_grad():
        want, got = model(x), plain(x)
        assert ((got - want).norm() / want.norm()).item() < 1e-5


class _MaxNormEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 12, max_norm=1.0)
        self.mid = nn.Linear(12, 12)
        self.head = nn.Linear(12, 30)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.mid(self.emb(t))).mean(1))


@pytest.mark.parametrize("capture", ["fx", "eager"])
def test_measured_balancing_leaves_a_max_norm_embedding_out(capture: str) -> None:
    """``nn.Embedding(max_norm=...)`` renormalizes its rows in forward, so rescaling its weight
    changes the function: balance='hessian' raised "measured balancing failed: rescaling
    changed the output by 0.055" for the whole model (and 'auto' silently gave up on every
    layer).  The embedding is now left out with why, and the other layers are balanced."""
    torch.manual_seed(0)
    t = torch.randint(0, 30, (8, 5))
    model, rep = precondfx.precondition(_MaxNormEmbedding(), t, balance="hessian",
                                        capture=capture)
    h = rep.conditioning["hessian"]
    assert "max_norm" in h["left_out"]["emb.weight"]
    assert set(h["factors"]) == {"mid.weight", "head.weight"}
    assert any(k == "balance emb.weight" and "max_norm" in why for k, why in rep.skipped)
    assert max(abs(f - 1.0) for f in h["factors"].values()) > 1e-3   # they did move
    plain = precondfx.fold(model)
    model.eval()
    plain.eval()
    with torch.no_grad():
        want = model(t)
        assert ((plain(t) - want).norm() / want.norm()).item() < 1e-5
