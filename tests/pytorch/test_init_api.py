"""precondfx.init: torch.nn.init-style initializers, checked against the paper's formula
E[W^2] = 2/(k^2 sqrt(n_in n_out)) written out here with each layer's own fans."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import precondfx
import precondfx.init as pinit
from precondfx import PrecondError

CASES = [  # (weight, kwargs, n_in, n_out, k^2)
    (lambda: nn.Linear(64, 32).weight, {}, 64, 32, 1),
    (lambda: nn.Conv2d(16, 8, 3, groups=2).weight, {"groups": 2}, 8, 4, 9),
    (lambda: nn.Conv1d(4, 6, 5).weight, {}, 4, 6, 5),
    (lambda: nn.ConvTranspose2d(8, 12, 3).weight, {"transposed": True}, 8, 12, 9),
    (lambda: torch.empty(32, 96), {"transposed": True}, 32, 96, 1),   # transformers Conv1D
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_geometric_second_moment_exact(case: int) -> None:
    make, kw, n_in, n_out, k2 = CASES[case]
    w = make()
    out = pinit.geometric_(w, generator=torch.Generator().manual_seed(case), **kw)
    assert out is w
    expected = 2.0 / (k2 * math.sqrt(n_in * n_out))
    assert abs(float(w.detach().double().pow(2).mean()) / expected - 1) < 1e-6


def test_plain_normal_draw_within_sampling_error() -> None:
    w = torch.empty(256, 512)
    pinit.geometric_(w, moment_matched=False, generator=torch.Generator().manual_seed(0))
    expected = 2.0 / math.sqrt(512 * 256)
    # the mean of W^2/sigma^2 over N normal draws has std sqrt(2/N)
    assert abs(float(w.double().pow(2).mean()) / expected - 1) < 4 * math.sqrt(2 / w.numel())
    assert abs(float(w.double().mean())) < 4 * math.sqrt(expected / w.numel())


def test_other_rules_and_embedding() -> None:
    w = torch.empty(30, 50)
    g = torch.Generator().manual_seed(1)
    for fn, expected in [(pinit.fan_in_, 2 / 50), (pinit.fan_out_, 2 / 30),
                         (pinit.xavier_, 4 / 80)]:
        fn(w, generator=g)
        assert abs(float(w.double().pow(2).mean()) / expected - 1) < 1e-6
    e = pinit.embedding_(torch.empty(10, 16), padding_idx=0, generator=g)
    assert float(e[0].abs().sum()) == 0.0
    assert abs(float(e[1:].double().pow(2).mean()) - 1) < 0.15


def test_model_own_init_matches_the_plan() -> None:
    """A model's own init calling precondfx.init gives the weights the plan would give."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(20, 40), nn.Linear(40, 10)
            for m in (self.a, self.b):            # as in a model's _init_weights
                pinit.geometric_(m.weight)
                nn.init.zeros_(m.bias)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    net = Net()
    report = precondfx.analyze(net, torch.randn(8, 20))
    for name in ("a.weight", "b.weight"):
        planned = report.plan.inits[name].std
        got = float(net.get_parameter(name).detach().double().pow(2).mean().sqrt())
        assert abs(got / planned - 1) < 1e-6, name


def test_bad_inputs() -> None:
    with pytest.raises(PrecondError, match="2 dimensions"):
        pinit.geometric_(torch.empty(5))
    with pytest.raises(PrecondError, match="floating-point"):
        pinit.geometric_(torch.empty(3, 3, dtype=torch.long))
    with pytest.raises(PrecondError, match="groups"):
        pinit.geometric_(torch.empty(4, 2, 3, 3), groups=0)
