"""Defects found by a robustness hunt with models written the way users write them (each test
failed before its fix, named in the test's docstring).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from precondfx.errors import PrecondError


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _same_state(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# -------------------------------------------------- a module held in a plain list as well


class _PoolNet(nn.Module):
    """conv -> relu -> max-pool -> linear, the pool foldable into the conv's stride.  With
    ``aliased`` the forward and ``features`` run the layers through a plain Python list
    (``self.stages``), which holds the same module objects as the registered attributes."""

    def __init__(self, aliased: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 4 * 4, 3)
        self.aliased = aliased
        if aliased:
            self.stages = [self.conv, self.act, self.pool]

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if self.aliased:
            for s in self.stages:
                x = s(x)
            return x
        return self.pool(self.act(self.conv(x)))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).flatten(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(x)


@pytest.mark.parametrize("capture", ["fx", "export", "eager"])
def test_module_also_held_in_a_plain_list_follows_its_replacement(capture):
    """A max-pool folded into the preceding convolution's stride is replaced by an Identity at
    its attribute; a plain list holding the same pool (``self.stages``) kept the old pool, so
    the forward (eager back end) or the user's method (fx result) pooled twice: the eager
    pass failed with "the model raised RuntimeError ... mat1 and mat2 shapes cannot be
    multiplied", the fx result's ``logits`` raised the same.  Fixed by
    ``apply.common.swap_references`` (both back ends)."""
    x = _x(6, 3, 8, 8)
    torch.manual_seed(0)
    plain = _PoolNet(aliased=False)
    torch.manual_seed(0)
    aliased = _PoolNet(aliased=True)
    before = _state(aliased)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rp, rep_p = precondfx.precondition(plain, x, seed=0, capture=capture)
        ra, rep_a = precondfx.precondition(aliased, x, seed=0, capture=capture)
    assert _same_state(before, _state(aliased))
    assert aliased.stages[2] is aliased.pool and isinstance(aliased.pool, nn.MaxPool2d)
    assert rep_a.capture == rep_p.capture == capture
    assert isinstance(ra, _PoolNet)
    # the list follows the module tree, in the result only
    assert ra.stages[0] is ra.conv and ra.stages[2] is ra.pool
    assert not isinstance(ra.pool, nn.MaxPool2d)
    with torch.no_grad():
        want = rp(x)
        got = ra(x)
        assert got.shape == (6, 3)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), float((got - want).abs().max())
        assert abs(float(got.double().std(correction=0)) - 1) < 0.02
        # the user's method computes what the forward computes
        assert torch.allclose(ra.logits(x), got, rtol=1e-5, atol=1e-6)


def test_module_registered_twice_follows_its_replacement():
    """The same pool registered under a second name (``self.body = nn.Sequential(conv, act,
    pool)`` next to ``self.pool``): both names see the replacement."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.act, self.pool = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), \
                nn.MaxPool2d(2)
            self.body = nn.Sequential(self.conv, self.act, self.pool)
            self.fc = nn.Linear(8 * 4 * 4, 3)

        def pooled(self, x):
            return self.pool(self.act(self.conv(x)))

        def forward(self, x):
            return self.fc(self.body(x).flatten(1))

    x = _x(6, 3, 8, 8)
    res, rep = precondfx.precondition(Net(), x, seed=0)
    assert res.body[2] is res.pool
    with torch.no_grad():
        assert res.pooled(x).shape == res.body(x).shape == (6, 8, 4, 4)


def test_inplace_failure_restores_plain_list_references():
    """``inplace=True`` and a later stage fails: the list is restored with the module tree."""

    class Net(_PoolNet):
        def forward(self, x):
            out = super().forward(x)
            return out * float("nan") if not isinstance(self.pool, nn.MaxPool2d) else out

    torch.manual_seed(0)
    m = Net(aliased=True)
    pool, before = m.pool, _state(m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PrecondError):
            precondfx.precondition(m, _x(6, 3, 8, 8), inplace=True, capture="eager")
    assert m.pool is pool and m.stages[2] is pool
    assert _same_state(before, _state(m))
