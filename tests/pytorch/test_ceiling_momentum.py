"""lr='auto''s SGD ceiling under momentum: half the rate a quadratic of the measured curvature
tolerates under the optimizer's own iteration (``first_step.headroom``), checked against
torch.optim.SGD run on a quadratic, and at a real first step."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import precondfx
from precondfx.pytorch.first_step import headroom
from tests.pytorch.test_first_step import _data, _mlp

LAM = 3.0       # the quadratic's curvature


def _radius(rate: float, group: dict) -> float:
    """The spectral radius of one torch.optim.SGD step with ``group``'s momentum settings on
    f(x) = LAM x^2 / 2: the step is linear in (x, momentum buffer), so its matrix is read
    off two steps of torch's own optimizer from the basis states."""
    cols = []
    for x0, b0 in ((1.0, 0.0), (0.0, 1.0)):
        x = torch.tensor([x0], dtype=torch.float64, requires_grad=True)
        opt = torch.optim.SGD([x], lr=rate, **group)
        if group.get("momentum", 0.0):
            opt.state[x]["momentum_buffer"] = torch.tensor([b0], dtype=torch.float64)
        x.grad = LAM * x.detach().clone()
        opt.step()
        buf = opt.state[x].get("momentum_buffer", torch.zeros(1, dtype=torch.float64))
        cols.append([x.item(), buf.item()])
    m = torch.tensor(cols, dtype=torch.float64).T
    if not group.get("momentum", 0.0):
        return abs(m[0, 0].item())
    return float(torch.linalg.eigvals(m).abs().max())


def _limit(group: dict) -> float:
    """The largest stable rate, by bisection on torch.optim.SGD's own step."""
    lo, hi = 0.1 / LAM, 20.0 / LAM
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if _radius(mid, group) < 1.0 else (lo, mid)
    return lo


@pytest.mark.parametrize("group", [{"momentum": 0.0}, {"momentum": 0.9},
                                   {"momentum": 0.5, "dampening": 0.3},
                                   {"momentum": 0.99}])
def test_heavy_ball_ceiling_is_half_the_stability_limit(group):
    """The ceiling, headroom x 1/lambda, is half the largest rate at which torch.optim.SGD's
    own step stays stable on a quadratic of curvature lambda (2/lambda plain; 3.8/lambda at
    momentum 0.9), to 1e-6."""
    want = _limit(group) / 2
    assert headroom(group) / LAM == pytest.approx(want, rel=1e-6)


def test_nesterov_ceiling_stays_below_its_limit():
    """Nesterov's limit, 2 (1 + b) / ((1 + 2b) lambda) = 1.36/lambda at 0.9, is lower than
    heavy ball's: the ceiling stays at 1/lambda (never below plain SGD's), under the limit."""
    group = {"momentum": 0.9, "nesterov": True}
    lim = _limit(group)
    assert lim == pytest.approx(2 * 1.9 / (2.8 * LAM), rel=1e-6)
    assert headroom(group) == 1.0 and headroom(group) / LAM < lim


def test_odd_momentum_values_give_the_plain_ceiling():
    assert headroom({}) == 1.0
    assert headroom({"momentum": torch.tensor(0.9)}) == pytest.approx(1.9)
    assert headroom({"momentum": 1.5}) == 1.0
    assert headroom({"momentum": "0.9"}) == 1.0
    # OneCycleLR at its peak rate runs at base_momentum, the lowest
    assert headroom({"momentum": 0.95, "base_momentum": 0.85}) == pytest.approx(1.85)


def test_first_step_under_momentum_sets_the_ceiling_higher():
    """At a rate above the ceiling, SGD(momentum=0.9)'s first step leaves the layers'
    effective rate at 1.9 times the suggested one: the factor is sqrt(1.9 s / lr), sqrt(1.9)
    times plain SGD's, and the report says the ceiling."""
    x, y = _data()
    high = 2.0
    facs, secs = {}, {}
    for mom in (0.0, 0.9):
        model, rep = precondfx.precondition(_mlp(), x)
        opt = torch.optim.SGD(model.parameters(), lr=high, momentum=mom)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        secs[mom] = sec = rep.conditioning["lr_target"]
        facs[mom] = sec["factor"]
    s = secs[0.9]["suggested_before"]
    assert s == pytest.approx(secs[0.0]["suggested_before"], rel=1e-9)
    assert s < high / 4                              # the ceiling acts at both momenta
    assert facs[0.9] / facs[0.0] == pytest.approx(math.sqrt(1.9), rel=0.15)
    assert secs[0.9]["ceiling"] == pytest.approx(1.9 * secs[0.9]["suggested_after"], rel=1e-9)
    assert secs[0.9]["suggested_after"] * 1.9 == pytest.approx(high, rel=0.2)
    assert "1.9x the suggested rate" in secs[0.9]["summary"]


def test_settle_rate_takes_the_loops_momentum():
    """settle_rate(model, lr, momentum=0.9) sets what SGD(momentum=0.9)'s first step sets."""
    x, y = _data()
    a, rep_a = precondfx.precondition(_mlp(), x)
    b, _ = precondfx.precondition(_mlp(), x)
    opt = torch.optim.SGD(a.parameters(), lr=2.0, momentum=0.9)
    F.cross_entropy(a(x), y).backward()
    opt.step()
    sec = precondfx.settle_rate(b, 2.0, "sgd", momentum=0.9)
    assert sec["factor"] == pytest.approx(rep_a.conditioning["lr_target"]["factor"], rel=1e-6)
    c, _ = precondfx.precondition(_mlp(), x)
    with pytest.raises(Exception, match="momentum"):
        precondfx.settle_rate(c, 2.0, "sgd", momentum=1.0)
