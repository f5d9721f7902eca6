"""The measurement stops as soon as its estimate is precise enough, on the draws a full run makes."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from precondfx.pytorch.measure.sketch import hessian_sketch, precise


def test_precise_is_the_t_interval_half_width():
    # two columns, 4 samples each: mean 1, sample sd s -> half-width t_{0.975,3} * s / 2
    col = np.array([0.9, 1.1, 0.9, 1.1])            # sd = 0.11547, half-width 0.1837
    hw = 3.182 * col.std(ddof=1) / math.sqrt(4)
    per = np.stack([col, 2 * col], axis=1)          # same relative precision
    assert precise(per, rtol=hw * 1.01) and not precise(per, rtol=hw * 0.99)
    assert not precise(per[:1], rtol=10.0)          # one sample: no interval
    assert not precise(np.stack([col, -col], axis=1), rtol=10.0)  # a mean <= 0


@pytest.mark.parametrize("batched", [True, False])
def test_stops_at_the_first_precise_prefix(batched):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 200))
    x = torch.randn(4, 64)                           # rounds of 4 samples (batched)
    w = ["0.weight", "2.weight"]
    full = hessian_sketch(net, x, w, n_samples=16, seed=3, batched=batched).per_sample
    step = 4 if batched else 1
    ns = [n for n in range(4, 16, step) if precise(full[:n], 0.4)]
    assert ns, "the test needs a prefix that is precise enough"
    got = hessian_sketch(net, x, w, n_samples=16, seed=3, batched=batched, first=4,
                         stop=lambda per: precise(per, 0.4))
    assert got.n_samples == ns[0] < 16
    np.testing.assert_allclose(got.per_sample, full[:ns[0]], rtol=1e-6)
    for j, name in enumerate(w):                     # the estimate is the prefix's mean
        assert got.values[name].mean == pytest.approx(full[:ns[0], j].mean(), rel=1e-6)


def test_rtol_keeps_the_noise_below_the_threshold():
    from precondfx.pytorch.measure.sketch import RTOL, rtol_for
    for thr in (1.5, 2.0, 4.0):
        r = rtol_for(thr)
        assert (1 + r) / (1 - r) == pytest.approx(thr)   # two layers' worst-case errors
    assert RTOL == pytest.approx(1 / 3) and rtol_for(1.0) == 0.0 and rtol_for(0.5) == 0.0


def _bn_net(n_out=200):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.Flatten(), nn.Linear(16 * 8 * 8, n_out))
    return net, torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def test_balancing_stops_once_precise_enough_for_its_threshold():
    import precondfx
    from precondfx.pytorch.measure.conditioning.estimates import t975
    from precondfx.pytorch.measure.sketch import rtol_for
    net, x = _bn_net()
    seen = {}
    for thr in (2.0, 1.1):
        _, rep = precondfx.precondition(net, x, balance="hessian", seed=0, verbose=False,
                                        balance_threshold=thr)
        h = rep.conditioning["hessian"]
        n = seen[thr] = h["samples"]
        if n < 16:   # stopped: every layer's 95% half-width within rtol_for(threshold)
            assert h["stopped_early"].startswith(f"stopped after {n} samples")
            for w, m in h["before"].items():
                assert t975(n - 1) * h["stderr_before"][w] / m <= rtol_for(thr) + 1e-12
        else:
            assert h["stopped_early"] == ""
    assert seen[2.0] < 16 and seen[1.1] > seen[2.0]   # a tighter threshold measures longer
