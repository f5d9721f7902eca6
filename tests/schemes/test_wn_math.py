"""Tests for precondfx.schemes.wn_math (spec B.2.2-B.2.6, validation targets B.4).

Expected values come from the spec ((1 + 1/40)^20 = 1.6386, K_n = 1, 2^-20 for g = 1) or from
independent computations, never from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from precondfx.errors import PrecondError
from precondfx.schemes import wn_math as W




def test_theorem1_constant_is_one() -> None:
    # B.2.2 [DERIVED]: K_n = 1 exactly with S_n the n-sphere in R^{n+1}; log space avoids the
    # overflow the spec hit at n = 1000
    for n in list(range(2, 13)) + [100, 101, 1000, 1001, 5000]:
        assert W.theorem1_constant(n) == pytest.approx(1.0, abs=1e-9)
    with pytest.raises(PrecondError):
        W.theorem1_constant(1)


def test_gains_and_constants() -> None:
    assert W.wn_gain(500, 200, 2.0) == pytest.approx(math.sqrt(5.0))
    assert W.wn_gain(200, 500, 1 / 40) == pytest.approx(math.sqrt(200 / 500) / math.sqrt(40))
    assert W.wn_layer_gamma("relu") == 2.0
    assert W.wn_layer_gamma("stem") == W.wn_layer_gamma("shortcut") == W.wn_layer_gamma("linear") == 1.0
    assert W.wn_layer_gamma("residual_last", blocks_in_stage=9) == pytest.approx(1 / 9)
    with pytest.raises(PrecondError):
        W.wn_layer_gamma("residual_last")
    assert W.residual_branch_scale(16) == 0.25
    # Theorem 3 factor: sqrt 2 at B = 1, (1 + 1/40)^20 = 1.6386 at B = 40, -> sqrt e
    assert W.residual_norm_factor(1) == pytest.approx(math.sqrt(2))
    assert W.residual_norm_factor(40) == pytest.approx(1.025**20, rel=1e-12)
    assert abs(W.residual_norm_factor(40) - 1.6386) < 1e-4
    assert W.residual_norm_factor(10**6) == pytest.approx(math.sqrt(math.e), rel=1e-6)
    assert W.stagewise_hanin_gamma(3) == pytest.approx(0.9**6)
    assert W.wn_fans(nn.Conv2d(16, 32, 3)) == (144, 288)
    assert W.wn_fans(nn.Conv2d(16, 32, 3, groups=4)) == (36, 72)


def test_wn_init_sets_direction_and_magnitude() -> None:
    torch.manual_seed(0)
    conv = weight_norm(nn.Conv2d(8, 16, 3))
    W.wn_init_(conv, gamma=2.0)
    g = conv.parametrizations.weight.original0
    v = conv.parametrizations.weight.original1.detach().reshape(16, -1)
    assert torch.allclose(g.detach(), torch.full((16, 1, 1, 1), math.sqrt(2 * 8 / 16)))
    assert torch.allclose(v @ v.T, torch.eye(16), atol=1e-5)  # orthogonal rows (16 <= 72)
    assert torch.allclose(conv.weight.detach().reshape(16, -1).norm(dim=1), torch.full((16,), 1.0), atol=1e-5)
    assert float(conv.bias.detach().abs().sum()) == 0.0
    lin = weight_norm(nn.Linear(400, 300))
    W.wn_init_(lin, gamma=1.0, direction="gaussian")
    assert float(lin.parametrizations.weight.original1.detach().std()) == pytest.approx(1 / 20, rel=0.03)
    # legacy torch.nn.utils.weight_norm layout is accepted too
    old = nn.Linear(10, 5)
    old.weight_g = nn.Parameter(torch.ones(5, 1))
    old.weight_v = nn.Parameter(torch.randn(5, 10))
    W.wn_init_(old, gamma=2.0)
    assert torch.allclose(old.weight_g.detach(), torch.full((5, 1), 2.0))
    with pytest.raises(PrecondError):
        W.wn_init_(nn.Linear(4, 4))
    with pytest.raises(PrecondError):
        W.wn_init_(weight_norm(nn.Linear(4, 4), dim=None))


@pytest.mark.parametrize("m, n", [(200, 500), (1000, 500), (300, 300)])
def test_theorems_1_and_2_monte_carlo(m: int, n: int) -> None:
    # B.4 item 1: E||ReLU(sqrt(2n/m) R u)||^2 / ||u||^2 = 1 and E||sqrt2 z * R^T u||^2/||u||^2 = 1,
    # +-3%; averaged over 8 weight draws x 64 vectors
    torch.manual_seed(1)
    fwd, bwd = [], []
    for _ in range(8):
        layer = weight_norm(nn.Linear(n, m, bias=False))
        W.wn_init_(layer, gamma=2.0)
        w = layer.weight.detach()
        r_hat = w / w.norm(dim=1, keepdim=True)
        u = torch.randn(64, n)
        fwd.append(float((torch.relu(u @ w.T).pow(2).sum(1) / u.pow(2).sum(1)).mean()))
        ug = torch.randn(64, m)
        z = (torch.rand(64, n) < 0.5).float()
        v = math.sqrt(2) * z * (ug @ r_hat)
        bwd.append(float((v.pow(2).sum(1) / ug.pow(2).sum(1)).mean()))
    assert sum(fwd) / 8 == pytest.approx(1.0, rel=0.03)
    assert sum(bwd) / 8 == pytest.approx(1.0, rel=0.03)


def _wn_mlp_moments(widths: list[int], gamma: float | None, seed: int, n_inputs: int = 512) -> list[float]:
    """Per-layer ||h_l||^2 / ||x||^2 (summed over inputs) of a WN ReLU MLP initialized by wn_math."""
    torch.manual_seed(seed)
    x = torch.randn(n_inputs, widths[0])
    layers = [weight_norm(nn.Linear(a, b)) for a, b in zip(widths[:-1], widths[1:])]
    if gamma is None:
        W.wn_init_feedforward_(layers)
    else:
        for layer in layers:
            W.wn_init_(layer, gamma=gamma)
    out, h = [], x
    with torch.no_grad():
        for layer in layers:
            h = torch.relu(layer(h))
            out.append(float(h.pow(2).sum() / x.pow(2).sum()))
    return out


def test_wn_relu_mlp_forward_second_moment() -> None:
    # B.4 item 3 (Fig. 1 top): 20-layer WN ReLU MLP, width 256: the forward second moment stays
    # within [0.5, 2] at every layer (mean over 3 weight draws; a single draw drifts, per the spec)
    depth, width = 20, 256
    runs = [_wn_mlp_moments([width] * (depth + 1), None, seed) for seed in range(3)]
    per_layer = [sum(r[i] for r in runs) / 3 for i in range(depth)]
    assert all(0.5 <= v <= 2.0 for v in per_layer), per_layer
    # control "He (g = 1)": each layer halves the second moment -> 2^-20 ~ 1e-6 at depth 20
    he = _wn_mlp_moments([width] * (depth + 1), gamma=width / width, seed=0)
    assert he[-1] < 2.0**-20 * 4
    assert he[0] == pytest.approx(0.5, rel=0.1)


def test_wn_mlp_varying_widths_total_norm() -> None:
    # B.4 item 3 exact protocol at smaller N: widths U(150, 250), input dim 500; the forward rule
    # preserves the total norm: ||h_l|| / ||x|| in the spec's band [0.6, 1.5] at every layer
    gen = torch.Generator().manual_seed(2)
    widths = [500] + [int(w) for w in torch.randint(150, 251, (20,), generator=gen)]
    runs = [_wn_mlp_moments(widths, None, seed, n_inputs=256) for seed in range(3)]
    per_layer = [math.sqrt(sum(r[i] for r in runs) / 3) for i in range(20)]
    assert all(0.6 <= v <= 1.5 for v in per_layer), per_layer


def _wn_resnet_gain(seed: int, blocks: int = 40, d: int = 500, m: int = 200, n_inputs: int = 256) -> tuple[float, float]:
    """B.4 item 4: h <- h + W1 ReLU(W0 h), mean ||h_B||/||x|| and backward ||dh_0||/||dh_B||."""
    torch.manual_seed(seed)
    branches = []
    for _ in range(blocks):
        l0, l1 = weight_norm(nn.Linear(d, m)), weight_norm(nn.Linear(m, d))
        W.wn_init_residual_branch_([l0, l1], blocks_in_stage=blocks)
        branches.append((l0, l1))
    # gains as in the spec: W0 sqrt(2*500/m), W1 sqrt(m/500)/sqrt(40)
    assert float(branches[0][0].parametrizations.weight.original0.detach()[0]) == pytest.approx(math.sqrt(2 * d / m))
    assert float(branches[0][1].parametrizations.weight.original0.detach()[0]) == pytest.approx(math.sqrt(m / d / blocks))
    x = torch.randn(n_inputs, d, requires_grad=True)
    h = x
    for l0, l1 in branches:
        h = h + l1(torch.relu(l0(h)))
    fwd = float((h.detach().norm(dim=1) / x.detach().norm(dim=1)).mean())
    u = torch.randn_like(h)
    (g,) = torch.autograd.grad(h, x, u)
    bwd = float((g.norm(dim=1) / u.norm(dim=1)).mean())
    return fwd, bwd


def test_wn_resnet_40_blocks() -> None:
    # B.4 item 4: theory (1 + 1/40)^20 = 1.6386 forward and backward (spec's runs: 1.62-1.64)
    fwd, bwd = _wn_resnet_gain(0)
    theory = 1.025**20
    assert fwd == pytest.approx(theory, abs=0.04)
    assert bwd == pytest.approx(theory, abs=0.04)
    assert math.sqrt(2) - 0.01 < fwd < math.sqrt(math.e) + 0.04
