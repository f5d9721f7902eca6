"""The pair-cotangent estimator of the Hessian-block statistic against exact computations, and
measured balancing (balance='hessian') against independent measurements."""
import math

import pytest
import torch
from torch import nn

import precondfx
from tests import zoo
from precondfx.pytorch.measure.sketch import hessian_sketch


def _exact_block_stat(model, x, wname, n_out):
    """E_R E_r ||G r||^2/numel with G = J^T R J, computed from the explicit Jacobian J (no
    precondfx code): for R = (A + A^T)/2 it equals (tr(K)^2 + ||K||_F^2) / (2 numel),
    K = J J^T; and checked here by brute force over an explicit average of R draws."""
    w = model.get_parameter(wname)

    def f(wv):
        params = dict(model.named_parameters())
        params[wname] = wv
        return torch.func.functional_call(model, params, (x,)).flatten()

    J = torch.autograd.functional.jacobian(f, w.detach()).reshape(n_out, -1).double()
    K = J @ J.T
    return float((torch.trace(K) ** 2 + (K * K).sum()) / (2 * w.numel())), J


def test_closed_form_matches_brute_force_over_R():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    x = torch.randn(1, 4)
    exact, J = _exact_block_stat(model, x, "0.weight", 3)
    g = torch.Generator().manual_seed(1)
    acc = 0.0
    n = 20000
    for _ in range(n):
        a = torch.randn(3, 3, generator=g, dtype=torch.float64)
        r = (a + a.T) / 2
        G = J.T @ r @ J
        acc += float((G * G).sum()) / J.shape[1]   # E_r ||G r||^2 = ||G||_F^2 (unit probes)
    mc = acc / n
    assert mc == pytest.approx(exact, rel=0.05)


@pytest.mark.parametrize("name", ["mlp_small", "conv_small"])
def test_sketch_converges_to_exact(name):
    torch.manual_seed(0)
    if name == "mlp_small":
        model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.ReLU(),
                              nn.Linear(6, 3))
        x = torch.randn(1, 5)
        n_out = 3
    else:
        model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 2, 3),
                              nn.Flatten(), nn.Linear(2 * 4 * 4, 4))
        x = torch.randn(1, 2, 6, 6)
        n_out = 4
    weights = [k for k, p in model.named_parameters() if k.endswith("weight")]
    res = hessian_sketch(model, x, weights, n_samples=400, n_cotangents=6, seed=3)
    for w in weights:
        exact, _ = _exact_block_stat(model, x, w, n_out)
        est = res.values[w]
        assert abs(est.mean - exact) < 4 * est.stderr + 1e-12, (w, est.mean, exact, est.stderr)
        assert est.stderr < 0.15 * exact


def test_sketch_agrees_with_hvp_measurement():
    """Same statistic by explicit Hessian-vector products (measure.conditioning, method hvp)."""
    from precondfx.pytorch.measure.conditioning import measure_conditioning
    model, x = zoo.build("strided_cnn", batch=8)
    ws = [n for n, p in model.named_parameters() if n.endswith("weight")]
    sk = hessian_sketch(model, x, ws, n_samples=48, n_cotangents=4, seed=0)
    hv = measure_conditioning(model, x, ws, stats=("hessian",), n_samples=48, n_probes=4, seed=1)
    for lay in hv.layers:
        a, b = sk.values[lay.weight], lay.hessian
        z = abs(a.mean - b.mean) / math.hypot(a.stderr, b.stderr)
        assert z < 4, (lay.weight, a.mean, b.mean)


def test_hessian_balancing_on_alexnet_heldout():
    """balance='hessian' on the strided AlexNet: held-out spread (fresh inputs, fresh probes,
    measured with explicit HVPs, not the balancing estimator) below 2x, against geometric alone."""
    from precondfx.pytorch.measure.conditioning import measure_conditioning
    model, calib = zoo.build("alexnet_strided", width_div=16, image=16, batch=32)
    fresh = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(9))
    pm, rep = precondfx.precondition(model, calib, balance="hessian", balance_samples=16)
    ws = [lay.weight for lay in rep.plan.layers]
    hv = measure_conditioning(pm, fresh, ws, stats=("hessian",), n_samples=16, n_probes=4,
                              seed=5)
    spread = hv.spread("hessian")
    model2, _ = zoo.build("alexnet_strided", width_div=16, image=16, batch=32)
    pg, _ = precondfx.precondition(model2, calib, balance="none")
    hv2 = measure_conditioning(pg, fresh, ws, stats=("hessian",), n_samples=16, n_probes=4,
                               seed=5)
    print(f"held-out Hessian spread: geometric {hv2.spread('hessian'):.3g}x, "
          f"balanced {spread:.3g}x")
    assert spread < 2.0
    assert hv2.spread("hessian") > spread


def test_balancing_keeps_the_function():
    model, x = zoo.build("alexnet_strided", width_div=16, image=16, batch=16)
    pa, ra = precondfx.precondition(model, x, balance="analytic", seed=1)
    ph, rh = precondfx.precondition(model, x, balance="hessian", seed=1)
    with torch.no_grad():
        ya, yh = pa(x), ph(x)
    # the same draws, different alphas with compensating weights: identical functions
    torch.testing.assert_close(ya * (0.05 / ya.std(correction=0)),
                               yh * (0.05 / yh.std(correction=0)), rtol=1e-3, atol=1e-5)
    f = rh.conditioning["hessian"]["factors"]
    # balancing moved the alphas (so the equality above compares two different storages): the
    # spread depends on the draws (1.32 with the weights' own stream, 1.5+ on the old one,
    # whose first-layer rows copied the sample); an uncompensated factor of even 1.01 would
    # fail the rtol=1e-3 comparison
    assert len(f) == 8 and max(f.values()) / min(f.values()) > 1.2
