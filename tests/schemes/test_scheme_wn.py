"""scheme='wn' (Arpit, Campos & Bengio): weight-normalized MLPs keep their forward second moment
(measured here with hooks), a 40-block weight-normalized residual MLP reproduces the spec's norm
factor (1 + 1/40)^20 = 1.6386, the plan's g values are the spec's formula, stages are counted
per projection shortcut, and the output scale still lands on its target."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import precondfx
from tests import zoo
from tests.helpers import call, frozen, main


class WNMLP(nn.Module):
    def __init__(self, depth: int = 20, width: int = 256) -> None:
        super().__init__()
        self.layers = nn.ModuleList(weight_norm(nn.Linear(width, width)) for _ in range(depth))
        self.acts = nn.ModuleList(nn.ReLU() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lay, act in zip(self.layers, self.acts):
            x = act(lay(x))
        return x


def relu_second_moments(model: nn.Module, x: torch.Tensor) -> list[float]:
    got: list[float] = []
    hooks = [m.register_forward_hook(lambda m, i, o: got.append(float(o.double().pow(2).mean())))
             for m in model.modules() if isinstance(m, nn.ReLU)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return got


def test_wn_mlp_forward_second_moment():
    torch.manual_seed(0)
    model, x = WNMLP(), torch.randn(128, 256)
    res = precondfx.precondition(model, x, scheme="wn", target_std=None)
    moments = relu_second_moments(res.model, x)
    assert len(moments) == 20
    assert float(x.pow(2).mean()) == pytest.approx(1.0, abs=0.02)
    for i, m in enumerate(moments):
        assert 0.5 <= m <= 2.0, (i, m)
    assert relu_second_moments(model, x)[-1] < 0.01  # PyTorch's default init vanishes
    # the plan: v orthogonal, g = sqrt(2 n_in/n_out) = sqrt 2 for every row, biases zero
    inits = res.report.plan.inits
    g = "layers.3.parametrizations.weight.original0"
    v = "layers.3.parametrizations.weight.original1"
    assert inits[g].rule == "constant" and inits[g].std == pytest.approx(math.sqrt(2))
    assert inits[v].rule == "orthogonal" and inits["layers.3.bias"].rule == "zeros"
    gt = res.model.get_parameter(g).detach()
    assert torch.allclose(gt, torch.full_like(gt, math.sqrt(2)))
    vt = res.model.get_parameter(v).detach().double()
    assert torch.allclose(vt @ vt.T, torch.eye(256, dtype=torch.float64), atol=1e-5)


class Block(nn.Module):
    def __init__(self, d: int, m: int) -> None:
        super().__init__()
        self.w0 = weight_norm(nn.Linear(d, m))
        self.w1 = weight_norm(nn.Linear(m, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.w1(torch.relu(self.w0(h)))


def test_wn_resnet_40_blocks_norm_factor():
    """Spec B.4 item 4: B = 40 blocks, F(h) = W1 ReLU(W0 h), W0: m x 500 with g = sqrt(2*500/m),
    W1: 500 x m with g = sqrt(m/500)/sqrt(40); ||h_B||/||x|| = (1+1/40)^20 = 1.6386 (spec
    measured 1.63)."""
    torch.manual_seed(0)
    d, m = 500, 300
    model = nn.Sequential(*[Block(d, m) for _ in range(40)])
    x = torch.randn(64, d)
    res = precondfx.precondition(model, x, scheme="wn", target_std=None)
    with torch.no_grad():
        y = res.model(x)
    ratio = float((y.double().pow(2).sum() / x.double().pow(2).sum()).sqrt())
    theory = (1 + 1 / 40) ** 20
    assert theory == pytest.approx(1.6386, abs=1e-4)
    assert ratio == pytest.approx(theory, rel=0.03), ratio
    inits = res.report.plan.inits
    g0 = inits["0.w0.parametrizations.weight.original0"].std
    g1 = inits["39.w1.parametrizations.weight.original0"].std
    assert g0 == pytest.approx(math.sqrt(2 * d / m))
    assert g1 == pytest.approx(math.sqrt(m / d) / math.sqrt(40))
    assert res.report.plan.options["residual"] == "none"  # 1/sqrt(B) lives in g, not in s
    assert not any(sc.tag == "residual" for sc in res.report.plan.scales)
    stages = res.report.conditioning["wn"]["stages"]
    assert [s["blocks"] for s in stages] == [40]


class TwoStages(nn.Module):
    """Stage 1: three identity blocks at width 32; stage 2: a block with a projection shortcut
    to width 64 and two identity blocks; a plain (not weight-normalized) linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.s1 = nn.ModuleList(Block(32, 32) for _ in range(3))
        self.p0 = weight_norm(nn.Linear(32, 64))
        self.p1 = weight_norm(nn.Linear(64, 64))
        self.proj = weight_norm(nn.Linear(32, 64))
        self.s2 = nn.ModuleList(Block(64, 64) for _ in range(2))
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.s1:
            x = b(x)
        x = self.proj(x) + self.p1(torch.relu(self.p0(x)))
        for b in self.s2:
            x = b(x)
        return self.head(x)


def test_stages_and_plain_layers():
    torch.manual_seed(0)
    x = torch.randn(32, 32)
    res = precondfx.precondition(TwoStages(), x, scheme="wn", target_std=None)
    rep = res.report.conditioning["wn"]
    assert [s["blocks"] for s in rep["stages"]] == [3, 3]
    inits = res.report.plan.inits
    gname = "parametrizations.weight.original0"
    assert inits[f"s1.2.w1.{gname}"].std == pytest.approx(math.sqrt(1 / 3))     # 1/B_1
    assert inits[f"p1.{gname}"].std == pytest.approx(math.sqrt(1 / 3))          # first of stage 2
    assert inits[f"s2.1.w1.{gname}"].std == pytest.approx(math.sqrt(1 / 3))
    assert inits[f"proj.{gname}"].std == pytest.approx(math.sqrt(32 / 64))      # gamma 1
    assert inits[f"p0.{gname}"].std == pytest.approx(math.sqrt(2 * 32 / 64))    # gamma 2
    # the plain head: E[W^2] = gamma/fan_out = 1/10
    assert inits["head.weight"].std == pytest.approx(math.sqrt(1 / 10))


def test_output_scale_on_wn_zoo_model():
    model, x = zoo.build("mlp")
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            weight_norm(mod)
    res = precondfx.precondition(model, x, scheme="wn", target_std=0.05)
    rows = res.report.conditioning["wn"]["layers"]
    assert len(rows) == 3 and all("g =" in r["action"] for r in rows)
    with frozen(res.model, True):
        std = float(main(call(res.model, x)).double().std(correction=0))
    assert std == pytest.approx(0.05, rel=0.02)
