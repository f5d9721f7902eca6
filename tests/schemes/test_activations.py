"""The shared Gaussian-expectation and activation engine of the gne and tat schemes."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from precondfx.schemes import gne as G
from precondfx.schemes.activations import get_activation, normal_expectation

TORCH = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "softplus": F.softplus, "elu": F.elu,
         "celu": F.celu, "selu": F.selu, "swish": F.silu, "gelu_exact": F.gelu,
         "gelu": lambda x: F.gelu(x, approximate="tanh"), "mish": F.mish,
         "hardswish": F.hardswish, "softsign": F.softsign, "relu": torch.relu}


@pytest.mark.parametrize("name", sorted(TORCH))
def test_registry_derivatives_match_autograd(name):
    act = get_activation(name)
    x = np.linspace(-5.5, 5.5, 221) + 1e-3          # off the kinks
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = TORCH[name](t)
    (d1,) = torch.autograd.grad(y.sum(), t, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), t)
    np.testing.assert_allclose(act.fn(x), y.detach().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(act.d1(x), d1.detach().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(act.d2(x), d2.numpy(), rtol=1e-5, atol=1e-6)


def test_normal_expectation_closed_forms():
    m, v = 0.5, 2.0
    s = math.sqrt(v)
    assert normal_expectation(lambda x: x * x, m, v) == pytest.approx(m * m + v, rel=1e-12)
    # E[max(x, 0)] = m Phi(m/s) + s phi(m/s)
    ref = m * 0.5 * math.erfc(-m / s / math.sqrt(2)) + s * math.exp(-m * m / v / 2) / \
        math.sqrt(2 * math.pi)
    assert normal_expectation(lambda x: np.maximum(x, 0), m, v, (0.0,)) == \
        pytest.approx(ref, rel=1e-12)


def test_pointwise_moments_of_rectifiers_and_kinked_gates():
    # ReLU at N(0, v): f' is a 0/1 step, phi = varphi + phi^2 = 1/2 (Table 3)
    mo = G.pointwise_moments(lambda x: (x > 0) * 1.0, 1.7)
    assert mo.phi == pytest.approx(0.5, abs=1e-13) and mo.varphi == pytest.approx(0.25, abs=1e-13)
    # hardswish: f' = (2x+3)/6 on (-3, 3), 1 above; a Monte Carlo reference
    act = get_activation("hardswish")
    rng = np.random.default_rng(0)
    mc = float(np.mean(act.d1(rng.standard_normal(4_000_000)) ** 2))
    assert G.pointwise_moments(act.d1, 1.0, breaks=act.kinks).phi == pytest.approx(mc, rel=2e-3)
