"""Tests for the GNE maths, precondfx.schemes.gne (spec A.2.6-A.2.11, validation targets A.4).

Expected values come from the spec's tables/text or from independent exact computations
(explicit Jacobians, Monte-Carlo, conv of ones), never from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precondfx.errors import PrecondError
from precondfx.schemes import gne as G

SELU_LAMBDA = 1.0507009873554805
SELU_ALPHA = 1.6732632423543772




def _moments_of(j: torch.Tensor) -> tuple[float, float]:
    """(phi, varphi) of a single explicit Jacobian j [m, n]: tr(JJ^T)/m and ||JJ^T||_F^2/m - phi^2."""
    j = j.double()
    m = j.shape[0]
    gram = j @ j.T if j.shape[0] <= j.shape[1] else j.T @ j
    phi = float(j.pow(2).sum() / m)
    return phi, float(gram.pow(2).sum() / m) - phi * phi


# ------------------------------------------------------------------------------------------------
# Components table (A.2.6) and Tables 4/5 (A.2.9): spec reference values
# ------------------------------------------------------------------------------------------------


def test_table3_closed_forms_reference_values() -> None:
    # Table 3 rows, values computed by hand from the spec's formulas
    assert G.relu_moments() == pytest.approx((0.5, 0.25))
    assert G.relu_moments(0.8) == pytest.approx((0.8, 0.16))
    # leaky ReLU slope 0.3, p=1/2: phi = 0.545, varphi = 0.0081*0.5 + 0.5 - 0.545^2 = 0.207025
    assert G.leaky_relu_moments(0.3) == pytest.approx((0.545, 0.207025))
    assert G.tanh_moments() == (1.0, 0.0)
    assert G.dense_gaussian_moments(200, 300, 0.1) == pytest.approx((2.0, 6.0))
    assert G.orthogonal_moments(1.5) == pytest.approx((2.25, 0.0))
    assert G.data_norm_moments(64, 4.0) == pytest.approx((0.25, 2 / (64 * 16)))
    assert G.avg_pool_moments(4) == pytest.approx((0.25, 0.0))
    assert G.dropout_moments(0.5).phi == pytest.approx(2.0)
    # sPReLU with ReLU gain sqrt(2): block phi exactly 1 for every alpha (A.2.9)
    for a in (0.0, 0.25, 0.5):
        assert 2 * G.sprelu_moments(a).phi == pytest.approx(1.0)


@pytest.mark.parametrize("m_over_n, expected", [(1.0, 2.0), (0.25, 1.25), (4.0, 5.0)])
def test_table4_kaiming_relu_varphi(m_over_n: float, expected: float) -> None:
    # Table 4 / eq. 17: phi = 1 and varphi = 1 + m/n at sigma = sqrt(2/n)
    n = 400
    mom = G.linear_act_block_moments("relu", n, int(n * m_over_n))
    assert mom.phi == pytest.approx(1.0)
    assert mom.varphi == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("slope, expected", [(0.0, 1.0), (0.18, 0.878), (0.3, 0.697), (0.5, 0.360)])
def test_table5_orthogonal_leaky_relu_varphi(slope: float, expected: float) -> None:
    # spec A.4 item 2: orthogonal + leaky ReLU theory values 1/0.878/0.697/0.360 (3 decimals)
    mom = G.linear_act_block_moments("leaky_relu", 300, 300, kind="orthogonal", slope=slope)
    assert mom.phi == pytest.approx(1.0)
    assert abs(mom.varphi - expected) < 1e-3
    # the Gaussian kernel adds m/n = 1 (A.4 item 2)
    gauss = G.linear_act_block_moments("leaky_relu", 300, 300, slope=slope)
    assert gauss.varphi - mom.varphi == pytest.approx(1.0)


def test_gains_table() -> None:
    # A.2.9 [CODE] gains and Table 4 optimal sigma
    assert G.gne_gain("relu") == pytest.approx(math.sqrt(2))
    assert G.gne_gain("leaky_relu", slope=0.3) == pytest.approx(math.sqrt(2 / 1.09))
    assert G.gne_gain(nn.LeakyReLU(0.18)) == pytest.approx(math.sqrt(2 / (1 + 0.18**2)))
    assert G.gne_gain("tanh") == 1.0
    assert G.gne_gain(None) == 1.0
    assert G.gne_gain("sprelu") == pytest.approx(math.sqrt(2))
    assert G.gne_gain("selu", gamma0=2.0) == pytest.approx(math.sqrt(2))
    assert G.gne_std(50, G.gne_gain("relu")) == pytest.approx(math.sqrt(2 / 50))
    with pytest.raises(PrecondError):
        G.gne_gain("sigmoid")
    with pytest.raises(PrecondError):
        G.gne_gain(nn.Sigmoid())


def test_fixup_branch_scale() -> None:
    # A.2.14: ResNet-56, L=27 blocks, m=2 convs, p=1.5 -> each conv scaled by 27^(-0.375)
    s = G.fixup_branch_scale(27, 2, 1.5)
    assert s == pytest.approx(27 ** -0.375)
    # a block then has phi = 1 + (alpha/2)^m with alpha = 2 s^2 -> 1 + 27^-1.5
    assert 1 + (2 * s**2 / 2) ** 2 == pytest.approx(1 + 27 ** -1.5)
    with pytest.raises(PrecondError):
        G.fixup_branch_scale(27, 2, 1.0)


def test_composition_rules() -> None:
    # A.2.4 check: two dense layers give varphi/phi^2 = m2/m1 + m2/m0
    m0, m1, m2 = 100, 200, 50
    a = G.dense_gaussian_moments(m0, m1, 1 / math.sqrt(m0))
    b = G.dense_gaussian_moments(m1, m2, 1 / math.sqrt(m1))
    s = G.serial_moments([(a, m1), (b, m2)])
    assert s.phi == pytest.approx(1.0)
    assert s.ratio == pytest.approx(m2 / m1 + m2 / m0)
    # A.2.5 check: J = I + G with phi(GG^T) = s gives varphi = 2s + s^2
    g = G.dense_gaussian_moments(300, 300, math.sqrt(0.5 / 300))
    r = G.residual_moments(g)
    assert r == pytest.approx((1.5, 2 * 0.5 + 0.25))
    # eq. 42: concat of identity (c_{i-1} rows) and branch (delta rows)
    assert G.concat_phi([(1.0, 64), (0.5, 32)]) == pytest.approx(64 / 96 + 32 / 96 * 0.5)


# ------------------------------------------------------------------------------------------------
# Measured Table 3/4/5 checks against explicit Jacobians
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [200, 50, 800])
def test_kaiming_relu_block_measured(m: int) -> None:
    # A.4 item 2: KM+ReLU phi ~ 1, varphi ~ 1 + m/n, 5 draws, +-5% (we allow 8% on varphi at n=200)
    # (phi is an expectation over weights and inputs: 5 weight draws x 8 inputs)
    torch.manual_seed(0)
    n = 200
    phis, phi2s = [], []
    for _ in range(5):
        w = torch.empty(m, n, dtype=torch.float64)
        G.gne_init_(w, gain=G.gne_gain("relu"))
        for _ in range(8):
            x = torch.randn(n, dtype=torch.float64)
            j = ((w @ x) > 0).double().unsqueeze(1) * w
            phi, vphi = _moments_of(j)
            phis.append(phi)
            phi2s.append(vphi + phi * phi)
    phi = sum(phis) / len(phis)
    varphi = sum(phi2s) / len(phis) - phi**2
    assert phi == pytest.approx(1.0, rel=0.05)
    assert varphi == pytest.approx(1 + m / n, rel=0.08)


@pytest.mark.parametrize("m", [200, 400])
def test_orthogonal_leaky_relu_block_measured(m: int) -> None:
    # Table 5 (m = n) and the [DERIVED] expanding-layer beta^2 m/n correction (m = 2n):
    # phi = 1; varphi = 0.697 (square) and 0.697 + (m/n - 1) = 1.697 (expanding)
    torch.manual_seed(1)
    n, slope = 100, 0.3
    m = m // 2
    phis, phi2s = [], []
    for _ in range(4):
        w = torch.empty(m, n, dtype=torch.float64)
        G.gne_init_(w, gain=G.gne_gain("leaky_relu", slope=slope), kind="orthogonal")
        for _ in range(8):
            pre = w @ torch.randn(n, dtype=torch.float64)
            d = torch.where(pre > 0, 1.0, slope).double()
            phi, vphi = _moments_of(d.unsqueeze(1) * w)
            phis.append(phi)
            phi2s.append(vphi + phi * phi)
    phi = sum(phis) / len(phis)
    varphi = sum(phi2s) / len(phis) - phi**2
    expected = ((1 - slope**2) / (1 + slope**2)) ** 2 + (m / n - 1)
    assert phi == pytest.approx(1.0, rel=0.05)
    assert varphi == pytest.approx(expected, rel=0.08)


def test_dense_and_residual_measured() -> None:
    # Table 3 dense row (n sigma^2, m n sigma^4) and A.2.5's I + G rule, explicit matrices
    torch.manual_seed(2)
    n, m, sigma = 200, 300, 0.05
    w = torch.randn(m, n, dtype=torch.float64) * sigma
    phi, varphi = _moments_of(w)
    ref = G.dense_gaussian_moments(n, m, sigma)
    assert phi == pytest.approx(n * sigma**2, rel=0.03)
    assert ref.phi == pytest.approx(n * sigma**2)
    assert varphi == pytest.approx(m * n * sigma**4, rel=0.08)
    s = 0.5
    g = torch.randn(400, 400, dtype=torch.float64) * math.sqrt(s / 400)
    phi, varphi = _moments_of(torch.eye(400, dtype=torch.float64) + g)
    assert phi == pytest.approx(1 + s, rel=0.03)
    assert varphi == pytest.approx(2 * s + s * s, rel=0.08)


def test_data_norm_exact_finite_m() -> None:
    # A.2.6 [DERIVED] exact forms vs the explicit Jacobian of a per-vector normalization
    torch.manual_seed(3)
    m = 64
    y = 3.0 + 2.0 * torch.randn(m, dtype=torch.float64)
    var = float(y.var(unbiased=False))
    j = torch.autograd.functional.jacobian(lambda t: F.layer_norm(t, (m,), eps=0.0), y)
    phi, varphi = _moments_of(j)
    exact = G.data_norm_moments(m, var, exact=True)
    assert phi == pytest.approx(exact.phi, rel=1e-8)
    assert varphi == pytest.approx(exact.varphi, rel=1e-6)
    table = G.data_norm_moments(m, var)
    assert phi == pytest.approx(table.phi, rel=2.5 / m)


def test_pooling_measured() -> None:
    # A.2.6 [DERIVED]: non-overlapping 2x2 average pool (1/4, 0), max pool (1, 0)
    torch.manual_seed(4)
    x = torch.randn(1, 3, 8, 8, dtype=torch.float64)
    j = torch.autograd.functional.jacobian(lambda t: F.avg_pool2d(t, 2), x).reshape(48, 192)
    assert _moments_of(j) == pytest.approx(tuple(G.avg_pool_moments(4)), abs=1e-12)
    j = torch.autograd.functional.jacobian(lambda t: F.max_pool2d(t, 2), x).reshape(48, 192)
    assert _moments_of(j) == pytest.approx(tuple(G.max_pool_moments()), abs=1e-12)


def test_pointwise_and_selu_moments_monte_carlo() -> None:
    # Prop. 5.7 / A.2.6: phi = E[f'^2], varphi = E[f'^4] - phi^2 vs a 1M-sample Monte-Carlo
    g = torch.Generator().manual_seed(5)
    for var in (0.5, 2.0):
        x = torch.randn(1_000_000, generator=g, dtype=torch.float64) * math.sqrt(var)
        d = torch.where(x > 0, SELU_LAMBDA, SELU_LAMBDA * SELU_ALPHA * torch.exp(x))
        mc_phi = float(d.pow(2).mean())
        mc_varphi = float(d.pow(4).mean()) - mc_phi**2
        mom = G.selu_moments(SELU_LAMBDA, SELU_ALPHA, var)
        assert mom.phi == pytest.approx(mc_phi, rel=5e-3)
        assert mom.varphi == pytest.approx(mc_varphi, rel=2e-2)
        selu = F.selu(x)
        assert G.selu_second_moment(SELU_LAMBDA, SELU_ALPHA, var) == pytest.approx(float(selu.pow(2).mean()), rel=5e-3)
        assert G.selu_mean(SELU_LAMBDA, SELU_ALPHA, var) == pytest.approx(float(selu.mean()), abs=5e-3)
        tanh_mc = float((1 - torch.tanh(x) ** 2).pow(2).mean())
        assert G.tanh_moments(var).phi == pytest.approx(tanh_mc, rel=5e-3)


# ------------------------------------------------------------------------------------------------
# SELU coefficients (A.2.11)
# ------------------------------------------------------------------------------------------------

SELU_TABLE = [  # spec A.2.11 table: (gamma0, epsilon, lambda, alpha)
    (1, 0.0, 1.41421, 0.00000),
    (1, 0.01, 1.36924, 0.47994),
    (1, 0.03, 1.27453, 0.89304),
    (1, 1 / 32, 1.26838, 0.91588),
    (1, 0.06, 1.11753, 1.44039),
    (1, 1 / 16, 1.10344, 1.48886),
    (1, 0.07, 1.06004, 1.64017),
    (1, 0.0716, 1.05055, 1.67379),
    (2, 0.0, 1.00000, 0.00000),
    (2, 0.03, 0.94414, 0.78025),
]


@pytest.mark.parametrize("gamma0, eps, lam, alpha", SELU_TABLE)
def test_selu_coefficients_table(gamma0: float, eps: float, lam: float, alpha: float) -> None:
    got_l, got_a = G.selu_coefficients(epsilon=eps, gamma0=gamma0)
    assert abs(got_l - lam) < 1e-5  # the table has 5 decimals
    assert abs(got_a - alpha) < 1e-5
    # the solution satisfies eq. 32 (block phi = 1 + eps, unit second-moment fixed point)
    assert gamma0 * G.selu_phi(got_l, got_a, gamma0) == pytest.approx(1 + eps, abs=1e-10)
    assert G.selu_second_moment(got_l, got_a, gamma0) == pytest.approx(1.0, abs=1e-10)


def test_selu_reference_values() -> None:
    # A.2.11: standard SELU gives phi = 1.071575, E[SeLU^2] = 1, E[SeLU] = 0 at unit variance
    assert G.selu_phi(SELU_LAMBDA, SELU_ALPHA, 1.0) == pytest.approx(1.071575, abs=1e-6)
    assert G.selu_second_moment(SELU_LAMBDA, SELU_ALPHA, 1.0) == pytest.approx(1.0, abs=1e-6)
    assert G.selu_mean(SELU_LAMBDA, SELU_ALPHA, 1.0) == pytest.approx(0.0, abs=1e-6)
    # A.4 item 6: eps = 0.0716 -> (1.0506, 1.6738), close to SELU's (1.0507, 1.6733)
    lam, alpha = G.selu_coefficients(epsilon=0.0716)
    assert (lam, alpha) == pytest.approx((1.0506, 1.6738), abs=1e-4)
    # A.4 item 7 (Fig. 3): phi(alpha2 = 0.5) = 1.213, phi(alpha2 = 2) = 0.947
    assert G.selu_block_phi(0.5, lam, alpha) == pytest.approx(1.213, abs=1e-3)
    assert G.selu_block_phi(2.0, lam, alpha) == pytest.approx(0.947, abs=1e-3)
    # depth rule: eps slightly below 1/L; eps = 0.2 has no real solution (fsolve failed there)
    eps = G.selu_epsilon_for_depth(32)
    assert 0.9 / 32 < eps < 1 / 32
    assert G.selu_coefficients(32) == pytest.approx(G.selu_coefficients(epsilon=eps))
    with pytest.raises(PrecondError):
        G.selu_coefficients(epsilon=0.2)


# ------------------------------------------------------------------------------------------------
# Effective kernel size (A.2.7)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size, ratio", [(32, 0.959), (16, 0.918), (8, 0.840), (4, 0.694)])
def test_effective_kernel_reference_values(size: int, ratio: float) -> None:
    k = G.effective_kernel_size((size, size), 3, padding=1)
    assert abs(k / 9 - ratio) < 5e-4  # spec values have 3 decimals
    assert k == pytest.approx(((3 * size - 2) / size) ** 2, rel=1e-12)  # (3H-2)/H per dim


def test_effective_kernel_conv_of_ones() -> None:
    # A.2.7's equivalent one-liner: mean(conv(1_{HxW}, 1_{kxk}, stride, padding, dilation))
    cases = [((32, 32), 3, 2, 1, 1), ((8, 12), (3, 5), 1, (1, 2), 1), ((9, 9), 3, 2, 2, 2), ((7, 7), 5, 1, 0, 1)]
    for size, k, s, p, d in cases:
        kt = (k, k) if isinstance(k, int) else k
        ref = F.conv2d(torch.ones(1, 1, *size), torch.ones(1, 1, *kt), stride=s, padding=p, dilation=d).mean()
        assert G.effective_kernel_size(size, k, s, p, d) == pytest.approx(float(ref), rel=1e-6)
    # 3x3/s2/p1 on 32 -> 16 gives the same ratio as 32x32 stride 1 (A.2.7)
    assert G.effective_kernel_size(32, 3, 2, 1) == pytest.approx(G.effective_kernel_size(32, 3, 1, 1))
    assert G.effective_kernel_size((8, 8), 3, padding="same") / 9 == pytest.approx(0.840, abs=5e-4)
    assert G.effective_kernel_size((8, 8), 3, padding="valid") == 9.0
    assert G.effective_kernel_size((8, 8), 3, padding=1, padding_mode="circular") == 9.0
    conv = nn.Conv2d(4, 4, 3, padding=1)
    assert G.conv_effective_kernel(conv, 8) / 9 == pytest.approx(0.840, abs=5e-4)


def test_effective_kernel_conv_jacobian_measured() -> None:
    # A.4 item 4: explicit conv Jacobian at 8x8, phi / (sigma^2 c_in 9) = 0.840 (4 draws)
    # The conv is linear, so its Jacobian's columns are the conv of the unit inputs.
    torch.manual_seed(6)
    c, sigma = 16, 0.1
    n = c * 64
    basis = torch.eye(n, dtype=torch.float64).reshape(n, c, 8, 8)

    def jac(w: torch.Tensor) -> torch.Tensor:
        return F.conv2d(basis, w, padding=1).reshape(n, n).T

    ratios = [
        _moments_of(jac(torch.randn(c, c, 3, 3, dtype=torch.float64) * sigma))[0] / (sigma**2 * c * 9)
        for _ in range(4)
    ]
    assert sum(ratios) / 4 == pytest.approx(0.840, rel=0.04)
    # and gne_init_ with the effective kernel size brings the conv to phi = gain^2 = 1 (the nominal
    # kernel size would give 0.840)
    w = torch.empty(c, c, 3, 3, dtype=torch.float64)
    phis = []
    for _ in range(4):
        G.gne_init_(w, gain=1.0, effective_k=G.effective_kernel_size((8, 8), 3, 1, 1))
        phis.append(_moments_of(jac(w))[0])
    assert sum(phis) / 4 == pytest.approx(1.0, rel=0.04)


# ------------------------------------------------------------------------------------------------
# Initializers
# ------------------------------------------------------------------------------------------------


def test_gne_init_shapes_and_scales() -> None:
    torch.manual_seed(7)
    # Gaussian: std = gain / sqrt(c_in k~)
    w = torch.empty(64, 32, 3, 3)
    G.gne_init_(w, gain=2.0, effective_k=7.5)
    assert float(w.std()) == pytest.approx(2.0 / math.sqrt(32 * 7.5), rel=0.03)
    # orthogonal, contracting: K K^T = beta^2 I
    w = torch.empty(20, 8, 2, 2, dtype=torch.float64)
    G.gne_init_(w, gain=1.3, kind="orthogonal")
    k = w.reshape(20, 32)
    assert torch.allclose(k @ k.T, 1.69 * torch.eye(20, dtype=torch.float64), atol=1e-10)
    # orthogonal, expanding (m > n): K^T K = beta^2 (m/n) I, so phi = ||K||_F^2 / m = beta^2
    w = torch.empty(60, 20, dtype=torch.float64)
    G.gne_init_(w, gain=1.3, kind="orthogonal")
    assert torch.allclose(w.T @ w, 1.69 * 3 * torch.eye(20, dtype=torch.float64), atol=1e-10)
    assert float(w.pow(2).sum() / 60) == pytest.approx(1.69)
    # delta orthogonal: only the centre tap, orthogonal there
    w = torch.empty(8, 8, 3, 3, dtype=torch.float64)
    G.gne_init_(w, gain=math.sqrt(2), kind="delta_orthogonal")
    centre = w[:, :, 1, 1]
    assert torch.allclose(centre @ centre.T, 2 * torch.eye(8, dtype=torch.float64), atol=1e-10)
    off_centre = w.clone()
    off_centre[:, :, 1, 1] = 0.0
    assert float(off_centre.abs().max()) == 0.0
    with pytest.raises(PrecondError):
        G.gne_init_(torch.empty(5), gain=1.0)
    with pytest.raises(PrecondError):
        G.gne_init_(torch.empty(4, 4), gain=1.0, kind="delta_orthogonal")


def test_gne_layer_init_module() -> None:
    torch.manual_seed(8)
    conv = nn.Conv2d(16, 32, 3, padding=1)
    G.gne_layer_init_(conv, activation=nn.LeakyReLU(0.3), input_size=(8, 8))
    expected = math.sqrt(2 / 1.09) / math.sqrt(16 * 9 * (((3 * 8 - 2) / 8) ** 2 / 9))
    assert float(conv.weight.detach().std()) == pytest.approx(expected, rel=0.05)
    assert float(conv.bias.detach().abs().sum()) == 0.0
    lin = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4))
    with pytest.raises(PrecondError):
        G.gne_layer_init_(lin)


def test_leaky_relu_mlp_gradient_norm_gain() -> None:
    # 32-layer leaky-ReLU(0.3) MLP of width 256 with the gne rule: prod phi = 1 (eq. 13, Table 4)
    torch.manual_seed(9)
    width, depth, slope = 256, 32, 0.3

    def make(gain: float) -> nn.Sequential:
        layers: list[nn.Module] = []
        for _ in range(depth):
            lin = nn.Linear(width, width)
            G.gne_init_(lin.weight, gain=gain)
            nn.init.zeros_(lin.bias)
            layers += [lin, nn.LeakyReLU(slope)]
        return nn.Sequential(*layers)

    def gain_of(net: nn.Module) -> float:
        x = torch.randn(16, width, requires_grad=True)
        y = net(x)
        ratios = []
        for _ in range(4):
            u = torch.randn_like(y)
            (g,) = torch.autograd.grad(y, x, u, retain_graph=True)
            ratios.append(float(g.pow(2).sum() / u.pow(2).sum()))
        return sum(ratios) / len(ratios)

    good = gain_of(make(G.gne_gain("leaky_relu", slope=slope)))
    assert 0.5 <= good <= 2.0
    # control: the plain ReLU gain sqrt(2) gives per-layer phi = (1 + 0.09) (Table 4 row), so the
    # gain is about 1.09^32 = 15.7
    bad = gain_of(make(math.sqrt(2)))
    assert 1.09**32 / 3 < bad < 1.09**32 * 3


# ------------------------------------------------------------------------------------------------
# Second Moment Normalization (A.2.10)
# ------------------------------------------------------------------------------------------------


def test_smn_train_eval_running_stats() -> None:
    torch.manual_seed(10)
    smn = G.SecondMomentNorm(3, eps=1e-5, momentum=0.1, affine=True)
    x = torch.randn(16, 3, 5, 5) * torch.tensor([0.5, 2.0, 4.0]).view(1, 3, 1, 1) + 0.3
    y = smn(x)
    # unit per-channel second moment, mean NOT removed (eq. 25)
    second = y.pow(2).mean(dim=(0, 2, 3))
    assert torch.allclose(second, torch.ones(3), atol=1e-4)
    rms = x.pow(2).mean(dim=(0, 2, 3)).sqrt()
    assert torch.allclose(y.mean(dim=(0, 2, 3)), x.mean(dim=(0, 2, 3)) / rms, atol=1e-4)
    # BN-style running average of the RMS
    assert torch.allclose(smn.running_rms, 0.9 + 0.1 * rms, atol=1e-6)
    assert int(smn.num_batches_tracked) == 1
    # eval divides by the running RMS + eps, with the affine transform
    with torch.no_grad():
        smn.weight.fill_(2.0)
        smn.bias.fill_(0.5)
    smn.eval()
    y = smn(x)
    ref = x / (smn.running_rms + 1e-5).view(1, 3, 1, 1) * 2.0 + 0.5
    assert torch.allclose(y, ref, atol=1e-6)
    # momentum=None: cumulative average
    smn2 = G.SecondMomentNorm(3, momentum=None)
    xs = [torch.randn(8, 3) * s for s in (1.0, 3.0)]
    for t in xs:
        smn2(t)
    mean_rms = sum(t.pow(2).mean(0).sqrt() for t in xs) / 2
    assert torch.allclose(smn2.running_rms, mean_rms, atol=1e-6)
    # L1 variant (eq. 29): unit mean absolute value
    l1 = G.SecondMomentNorm(3, norm="l1", affine=False)
    assert torch.allclose(l1(x).abs().mean(dim=(0, 2, 3)), torch.ones(3), atol=1e-4)
    with pytest.raises(PrecondError):
        smn(torch.randn(4, 5, 2, 2))


def test_smn_swaps_for_batchnorm() -> None:
    bn = nn.BatchNorm3d(4, eps=1e-3, momentum=0.2)
    with torch.no_grad():
        bn.weight.fill_(1.5)
    smn = G.SecondMomentNorm.from_batchnorm(bn)
    assert (smn.num_features, smn.eps, smn.momentum, smn.affine) == (4, 1e-3, 0.2, True)
    assert torch.equal(smn.weight, bn.weight.detach())
    y = smn(torch.randn(2, 4, 3, 3, 3))
    assert y.shape == (2, 4, 3, 3, 3)
    y.sum().backward()
    assert smn.weight.grad is not None


def test_weight_centering_and_smn_phi() -> None:
    torch.manual_seed(11)
    conv = nn.Conv2d(3, 2, 3, padding=1, bias=False)
    with torch.no_grad():
        conv.weight.add_(0.7)  # non-zero mean
    G.register_weight_centering(conv)
    assert torch.allclose(conv.weight.mean(dim=(1, 2, 3)), torch.zeros(2), atol=1e-6)
    # eq. 27 [RECON]: the SMN Jacobian has phi ~= 1/alpha_2 (not 1/alpha_2^2).  Exact for a
    # per-channel RMS normalization over N values: phi = (1/alpha_2)(N-1)/N.
    smn = G.SecondMomentNorm(2, eps=0.0, affine=False).double()
    x = torch.randn(8, 2, 4, 4, dtype=torch.float64) * torch.tensor([3.0, 5.0], dtype=torch.float64).view(1, 2, 1, 1)
    alpha2 = x.pow(2).mean(dim=(0, 2, 3))
    j = torch.autograd.functional.jacobian(smn, x, vectorize=True).reshape(x.numel(), x.numel())
    phi, _ = _moments_of(j)
    expected = float((1 / alpha2).mean()) * (128 - 1) / 128
    assert phi == pytest.approx(expected, rel=1e-6)
    assert float(alpha2.min()) > 2.0  # so that 1/alpha_2 and 1/alpha_2^2 are far apart
    assert phi > 1.5 * float((1 / alpha2**2).mean())
