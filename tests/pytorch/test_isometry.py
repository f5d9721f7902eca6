"""Tests for precondfx.pytorch.measure.isometry (spec A.2.2 Hutchinson estimators of phi and varphi).

Targets come from independent exact computations (per-sample Jacobians via
torch.autograd.functional.jacobian, closed-form Gaussian-matrix moments), never from the code
under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from precondfx.errors import PrecondError
from precondfx.pytorch.measure.isometry import (
    estimate_block_isometry,
    forward_moment_ratio,
    gradient_norm_gain,
    positive_fraction,
)




def _small_block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 32), nn.Tanh(), nn.Linear(32, 16)).double()


def _exact(block: nn.Module, x: torch.Tensor) -> tuple[float, float, float]:
    """(phi, phi2, varphi) from per-sample Jacobians, computed independently of the library."""
    t1, t2 = [], []
    for b in range(x.shape[0]):
        j = torch.autograd.functional.jacobian(lambda v: block(v.unsqueeze(0)).squeeze(0), x[b])
        a = j @ j.T
        t1.append(float(torch.trace(a)) / j.shape[0])
        t2.append(float(torch.trace(a @ a)) / j.shape[0])
    phi, phi2 = sum(t1) / len(t1), sum(t2) / len(t2)
    return phi, phi2, phi2 - phi * phi


@pytest.mark.parametrize("method, probes", [("vjp", 64), ("jvp", 32)])
def test_estimator_within_standard_error_of_exact(method: str, probes: int) -> None:
    block = _small_block()
    x = 1.5 * torch.randn(4, 24, dtype=torch.float64)
    phi, phi2, varphi = _exact(block, x)
    est = estimate_block_isometry(block, x, num_probes=probes, method=method, generator=torch.Generator().manual_seed(1))
    assert (est.m, est.n, est.batch_size, est.num_probes) == (16, 24, 4, probes)
    # 3 SE for everything except the VJP-only second-order terms: their jackknife SE comes from a
    # heavy-tailed sample variance and under-covers slightly (~96% within 3 SE in our sweeps)
    wide = 4 if method == "vjp" else 3
    for got, se, ref, k in ((est.phi, est.phi_se, phi, 3), (est.phi2, est.phi2_se, phi2, wide),
                            (est.varphi, est.varphi_se, varphi, wide)):
        assert se > 0
        assert abs(got - ref) <= k * se
    # the band is informative, not vacuous
    assert est.phi_se < 0.1 * phi
    assert est.phi2_se < (0.35 if method == "vjp" else 0.1) * phi2


def test_exact_method_matches_independent_jacobian() -> None:
    block = _small_block()
    x = torch.randn(3, 24, dtype=torch.float64)
    phi, phi2, varphi = _exact(block, x)
    est = estimate_block_isometry(block, x, method="exact")
    assert (est.phi, est.phi2, est.varphi) == pytest.approx((phi, phi2, varphi), rel=1e-10)
    assert est.phi_se == 0.0


def test_standard_error_is_calibrated() -> None:
    # over 30 independent runs the z-scores of phi should look standard normal: E|Z| = 0.80
    block = _small_block()
    x = torch.randn(2, 24, dtype=torch.float64)
    phi, phi2, _ = _exact(block, x)
    zs, zs2 = [], []
    for seed in range(30):
        est = estimate_block_isometry(block, x, num_probes=16, method="jvp", generator=torch.Generator().manual_seed(seed))
        zs.append(abs(est.phi - phi) / est.phi_se)
        zs2.append(abs(est.phi2 - phi2) / est.phi2_se)
    for z in (zs, zs2):
        assert 0.5 < sum(z) / len(z) < 1.2
        assert sum(1 for v in z if v <= 2) >= 24  # nominal 95% of 30


def test_unbatched_block() -> None:
    torch.manual_seed(2)
    w = torch.randn(10, 20, dtype=torch.float64)
    a = w @ w.T
    est = estimate_block_isometry(lambda v: w @ v, torch.randn(20, dtype=torch.float64), num_probes=64,
                                  batched=False, method="jvp", generator=torch.Generator().manual_seed(3))
    assert est.batch_size == 1 and est.m == 10
    assert abs(est.phi - float(torch.trace(a)) / 10) <= 3 * est.phi_se
    assert abs(est.phi2 - float(torch.trace(a @ a)) / 10) <= 3 * est.phi2_se


def test_weight_redraws_target_gaussian_expectation() -> None:
    # Table 3 dense row: for W in R^{m x n} i.i.d. N(0, s^2), E tr(WW^T)/m = n s^2 and the exact
    # finite-size E Tr((WW^T)^2)/m = s^4 (n^2 + n(m+1)), so varphi = s^4 n (m+1) (-> m n s^4).
    m, n = 40, 60
    s2 = 1.0 / n
    lin = nn.Linear(n, m, bias=False).double()
    gen = torch.Generator().manual_seed(4)

    def redraw() -> None:
        with torch.no_grad():
            lin.weight.normal_(0.0, math.sqrt(s2), generator=gen)

    est = estimate_block_isometry(lin, torch.randn(2, n, dtype=torch.float64), method="exact", redraw=redraw, num_draws=40)
    assert est.num_draws == 40 and est.phi_se > 0
    assert abs(est.phi - n * s2) <= 3 * est.phi_se
    assert abs(est.varphi - s2 * s2 * n * (m + 1)) <= 3 * est.varphi_se
    assert est.varphi == pytest.approx(m * n * s2 * s2, rel=0.2)


def test_gradient_norm_gain_and_forward_ratio() -> None:
    torch.manual_seed(5)
    q, _ = torch.linalg.qr(torch.randn(30, 30, dtype=torch.float64))
    x = torch.randn(5, 30, dtype=torch.float64)
    gain, se = gradient_norm_gain(lambda v: v @ q.T, x, num_probes=3)
    assert gain == pytest.approx(1.0, abs=1e-12)  # orthogonal: exact isometry for every probe
    gain, _ = gradient_norm_gain(lambda v: 2 * v, x, num_probes=2)
    assert gain == pytest.approx(4.0)
    # Prop. 5.5 / Table 4: for Linear(Kaiming)+ReLU stacks the forward moment ratio and phi are
    # both 1 in expectation over the weights (12 draws of a 2-block stack)
    frs, phis = [], []
    for _ in range(12):
        layers: list[nn.Module] = []
        for _ in range(2):
            lin = nn.Linear(256, 256, bias=False)
            nn.init.normal_(lin.weight, 0.0, math.sqrt(2 / 256))
            layers += [lin, nn.ReLU()]
        net = nn.Sequential(*layers)
        xb = torch.randn(32, 256)
        frs.append(forward_moment_ratio(net, xb))
        phis.append(estimate_block_isometry(net, xb, num_probes=4).phi)
    assert sum(frs) / 12 == pytest.approx(1.0, abs=0.08)
    assert sum(phis) / 12 == pytest.approx(1.0, abs=0.08)
    assert positive_fraction(torch.tensor([-1.0, 0.0, 2.0, 3.0])) == 0.5


def test_input_validation() -> None:
    block = _small_block()
    x = torch.randn(2, 24, dtype=torch.float64)
    with pytest.raises(PrecondError):
        estimate_block_isometry(block, x, method="hutch")
    with pytest.raises(PrecondError):
        estimate_block_isometry(block, x, num_probes=2)
    with pytest.raises(PrecondError):
        estimate_block_isometry(block, x, num_draws=3)
    with pytest.raises(PrecondError):
        estimate_block_isometry(lambda v: torch.ones(2, 3), x)
