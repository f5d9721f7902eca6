"""Meta-device / plan defects found by the integrations hunt: ``fold`` on a model planned on
the meta device, and ``reinit`` with the plan of another model."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import precondfx
from precondfx import PrecondError


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.l1 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.head(h + self.l1(torch.relu(h)))


def _ids() -> torch.Tensor:
    return torch.randint(0, 50, (8, 6), generator=torch.Generator().manual_seed(0))


def test_fold_of_a_meta_model_is_refused_clearly() -> None:
    """fold used to raise torch's 'Tensor.item() cannot be called on meta tensors'."""
    with torch.device("meta"):
        model = TiedLM()
    pm, _ = precondfx.precondition(model, _ids(), balance="analytic", seed=0)
    problems = precondfx.fold_problems(pm)
    assert [w for w, _ in problems] == ["model"] and "meta device" in problems[0][1]
    with pytest.raises(PrecondError, match="meta device"):
        precondfx.fold(pm)


def test_reinit_with_the_plan_of_another_model_is_refused() -> None:
    """reinit used to return [] and change nothing when no planned name was in the model."""
    mlp = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    _, rep = precondfx.precondition(TiedLM(), _ids(), seed=0)
    before = [p.detach().clone() for p in mlp.parameters()]
    with pytest.raises(PrecondError, match="another model"):
        precondfx.reinit(mlp, rep.plan, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(before, mlp.parameters()))
    # its own plan still re-initializes it
    pm, own = precondfx.precondition(mlp, torch.randn(16, 6), seed=0)
    assert len(precondfx.reinit(pm, own.plan, seed=0)) == 4
