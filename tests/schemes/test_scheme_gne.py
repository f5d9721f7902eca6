"""scheme='gne' (Chen et al., gradient norm equality): the gradient-norm gain of a deep leaky-ReLU
MLP measured here with random cotangents, the planned inits against the spec's table values
(not the GNE maths' output), depth-aware SELU coefficients against the spec's solved table, SMN
replacing BatchNorm and training, and the block isometry diagnostics against exact Jacobians."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from tests import zoo
from tests.helpers import call, frozen, main


def leaky_mlp(depth: int = 32, width: int = 256, slope: float = 0.3) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LeakyReLU(slope)]
    return nn.Sequential(*layers)


def grad_norm_gain(model: nn.Module, x: torch.Tensor, n: int = 4) -> float:
    """||dL/dx0||^2 / ||dL/dy_L||^2 for random Gaussian cotangents dL/dy_L, averaged."""
    gen = torch.Generator().manual_seed(123)
    xr = x.clone().requires_grad_(True)
    y = model(xr)
    ratios = []
    for _ in range(n):
        u = torch.randn(y.shape, generator=gen)
        (g,) = torch.autograd.grad(y, xr, u, retain_graph=True)
        ratios.append(float(g.double().pow(2).sum() / u.double().pow(2).sum()))
    return sum(ratios) / n


@pytest.mark.parametrize("seed,kind", [(0, "gaussian"), (1, "gaussian"), (2, "gaussian"),
                                       (0, "orthogonal")])
def test_deep_leaky_relu_gradient_norm_gain(seed, kind):
    torch.manual_seed(seed)
    model, x = leaky_mlp(), torch.randn(64, 256)
    res = precondfx.precondition(model, x, scheme="gne", target_std=None, seed=seed,
                                 scheme_options={"kind": kind})
    gain = grad_norm_gain(res.model, x)
    assert 0.5 <= gain <= 2.0, gain
    if seed == 0 and kind == "gaussian":  # PyTorch's default init vanishes on the same net
        assert grad_norm_gain(model, x) < 1e-6


class Mixed(nn.Module):
    """conv(3x3, pad 1, 8x8) -> ReLU; conv -> leaky(0.3); linear -> tanh; linear (expanding)
    -> leaky(0.3); linear head (no activation)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(4, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 8, 3, padding=1)
        self.f1 = nn.Linear(8 * 8 * 8, 64)
        self.f2 = nn.Linear(64, 256)
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c1(x))
        h = F.leaky_relu(self.c2(h), 0.3)
        h = torch.tanh(self.f1(h.flatten(1)))
        h = F.leaky_relu(self.f2(h), 0.3)
        return self.head(h)


# Table 4 (Gaussian) optimal sigma; A.2.7 effective kernel of a 3x3/pad 1 conv at 8x8:
# k~/9 = 0.840 (exactly ((3H-2)/H)^2 / 9 with H = 8)
KEFF_8 = ((3 * 8 - 2) / 8) ** 2


def test_gaussian_inits_reproduce_table_values():
    torch.manual_seed(0)
    res = precondfx.precondition(Mixed(), torch.randn(16, 4, 8, 8), scheme="gne",
                                 target_std=None)
    inits = res.report.plan.inits
    assert KEFF_8 / 9 == pytest.approx(0.840, abs=5e-4)
    want = {
        "c1.weight": math.sqrt(2 / (4 * KEFF_8)),                 # ReLU: sqrt(2/n)
        "c2.weight": math.sqrt(2 / (16 * KEFF_8 * (1 + 0.09))),   # leaky: sqrt(2/(n(1+g^2)))
        "f1.weight": math.sqrt(1 / 512),                          # tanh: 1/sqrt(n)
        "f2.weight": math.sqrt(2 / (64 * 1.09)),
        "head.weight": math.sqrt(1 / 256),                        # linear: 1/sqrt(n)
    }
    for name, std in want.items():
        assert inits[name].std == pytest.approx(std, rel=1e-9), name
        w = res.model.get_parameter(name).detach().double()
        assert float(w.pow(2).mean()) == pytest.approx(std ** 2, rel=1e-4)  # drawn as planned
    assert all(inits[n].rule == "zeros" for n in ("c1.bias", "f2.bias"))
    rows = {r["node"]: r for r in res.report.conditioning["gne"]["layers"]}
    assert rows["c2"]["act"] == "leaky_relu" and rows["c2"]["slope"] == pytest.approx(0.3)
    assert rows["f1"]["act"] == "tanh" and rows["head"]["act"] == "linear"
    assert res.report.plan.options["balance"] == "none"


def test_orthogonal_inits_reproduce_table_values():
    torch.manual_seed(0)
    res = precondfx.precondition(Mixed(), torch.randn(16, 4, 8, 8), scheme="gne",
                                 target_std=None, scheme_options={"kind": "orthogonal"})
    inits = res.report.plan.inits
    g2_leaky = 2 / 1.09                                  # Table 5: beta^2 = 2/(1+g^2)
    # c1: 16 x 36, rows orthonormal; beta^2 = 2, times k/k~ for the padding cut-off
    assert inits["c1.weight"].std == pytest.approx(math.sqrt(2 * 9 / KEFF_8), rel=1e-9)
    # f2: 256 x 64 expands: beta^2 *= m/n = 4
    assert inits["f2.weight"].std == pytest.approx(math.sqrt(g2_leaky * 4), rel=1e-9)
    assert inits["f1.weight"].std == pytest.approx(1.0)  # tanh: beta ~ 1
    w = res.model.get_parameter("f1.weight").detach().double()  # 64 x 512
    assert torch.allclose(w @ w.T, torch.eye(64, dtype=torch.float64), atol=1e-5)


# spec A.2.11, solved eq. 32 (gamma0 = 1): epsilon -> (lambda, alpha)
SELU_TABLE = {0.03: (1.27453, 0.89304), 0.0625: (1.10344, 1.48886)}


class SeluNet(nn.Module):
    def __init__(self, depth: int = 4, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.act = nn.SELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lay in self.layers:
            x = self.act(lay(x))
        return x


@pytest.mark.parametrize("eps", sorted(SELU_TABLE))
def test_depth_aware_selu_coefficients(eps):
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    res = precondfx.precondition(SeluNet(), x, scheme="gne",
                                 scheme_options={"selu": "depth", "selu_epsilon": eps},
                                 target_std=0.05)
    lam, alpha = SELU_TABLE[eps]
    acts = [m for m in res.model.modules() if type(m).__name__ == "ScaledSELU"]
    assert acts and not any(isinstance(m, nn.SELU) for m in res.model.modules())
    for m in acts:
        assert float(m.lam) == pytest.approx(lam, abs=1e-4)
        assert float(m.alpha) == pytest.approx(alpha, abs=1e-4)
    z = torch.linspace(-3, 3, 13)
    ref = lam * torch.where(z > 0, z, alpha * (torch.exp(z) - 1))
    assert torch.allclose(acts[0](z), ref, atol=1e-6)
    sel = res.report.conditioning["gne"]["selu"]
    assert sel["layers"] == 4 and sel["epsilon"] == eps
    assert all(res.report.plan.inits[f"layers.{i}.weight"].std == pytest.approx(1 / 8)
               for i in range(4))  # gamma0 = 1: N(0, 1/n), LeCun
    with frozen(res.model, True):
        assert float(main(call(res.model, x)).std()) == pytest.approx(0.05, rel=0.02)


def test_smn_replaces_batchnorm_and_trains():
    model, x = zoo.build("vgg_bn", batch=8)
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    res = precondfx.precondition(model, x, scheme="gne", scheme_options={"norm": "smn"},
                                 target_std=0.05)
    out = res.model
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in out.modules())
    smn = [m for m in out.modules() if type(m).__name__ == "SecondMomentNorm"]
    assert len(smn) == n_bn == 4
    assert [m.num_features for m in smn] == [16, 32, 64, 64]
    centred = [r for r in res.report.conditioning["gne"]["smn"] if "centred" in r["centered"]]
    assert len(centred) == 4
    with frozen(out, True):
        assert float(main(call(out, x)).std()) == pytest.approx(0.05, rel=0.02)
    # one training step
    out.train()
    opt = torch.optim.SGD(out.parameters(), lr=0.1)
    before = {k: v.detach().clone() for k, v in out.named_parameters()}
    y = torch.randint(0, 10, (8,))
    loss = F.cross_entropy(out(x), y)
    loss.backward()
    opt.step()
    assert math.isfinite(float(loss.detach()))
    changed = [k for k, v in out.named_parameters() if not torch.equal(v, before[k])]
    assert len(changed) > 0.5 * len(before)
    assert float(smn[0].num_batches_tracked) == 1  # running RMS updated by the train step
    out.eval()
    assert torch.isfinite(out(x)).all()


@pytest.mark.parametrize("capture", ["fx", "eager"])
def test_block_isometry_diagnostics_match_exact_jacobians(capture):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 32))
    x = torch.randn(32, 96)
    res = precondfx.precondition(model, x, scheme="gne", capture=capture, target_std=None,
                                 scheme_options={"diagnostics": True, "diag_probes": 32})
    diag = res.report.conditioning["gne"]["diagnostics"]
    blocks = {b["block"]: b for b in diag["blocks"]}
    assert len(blocks) == 3
    # exact phi of block 2 = mean_b ||D_b W||_F^2 / m from the rewritten model's weights
    w1 = res.model.get_parameter("0.weight").detach()
    w2 = res.model.get_parameter("2.weight").detach()
    h = torch.relu(x @ w1.T)
    d = (h @ w2.T > 0).double()                                       # [B, m]
    exact = float((d @ w2.double().pow(2).sum(1)).mean() / 128)
    b2 = [b for b in diag["blocks"] if b["n"] == 128 and b["m"] == 128][0]
    assert b2["phi"] == pytest.approx(exact, rel=0.03)
    for b in diag["blocks"][:2]:
        assert 0.8 < b["phi"] < 1.25          # gain sqrt 2 + ReLU: phi = 1 (Table 4)
    assert 1.2 < b2["varphi"] < 2.8           # Table 4: varphi = 1 + m/n = 2
    last = diag["blocks"][-1]                  # linear head, gain 1: phi = 1
    assert last["activation"] is None and 0.8 < last["phi"] < 1.25
