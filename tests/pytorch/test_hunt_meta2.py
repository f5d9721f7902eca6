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
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    plain = precondfx.fold(model)
    assert type(plain) is _TiedReluHead
    assert plain.head.weight is plain.emb.weight
    assert not [n for n, _ in plain.named_buffers() if "precondfx" in n]
    with torch.no_grad():
        want = model(x)
        assert torch.allclose(plain(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        fresh = _TiedReluHead(act)
        fresh.load_state_dict(plain.state_dict(), strict=True)
        assert torch.equal(fresh(x), plain(x))
