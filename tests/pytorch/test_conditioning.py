"""Tests of precondfx.pytorch.measure.conditioning against independent computations.

Expected values come from explicit Hessians (torch.autograd.functional.hessian on hand-written
forward functions of the flattened parameters), hand-derived layer geometry, and the paper's
propositions (Prop. 4, Sec. 6) -- never from the code under test.
"""
from __future__ import annotations

import math
import struct
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precondfx.errors import PrecondError
from precondfx.pytorch.measure.conditioning import (
    LayerRef,
    default_output_fn,
    hessian_block_matrix,
    measure_conditioning,
    resolve_layers,
    spread,
)
from precondfx.core.plots import plot_bars, plot_heatmap


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------


def _sym(n: int, g: torch.Generator) -> torch.Tensor:
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    return (a + a.T) / 2


def _tiny_mlp() -> nn.Sequential:
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    with torch.no_grad():
        for m in net:
            if isinstance(m, nn.Linear):
                m.bias.normal_(0, 0.1)
    return net.double()


def _unflatten(theta: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    """Split a flat parameter vector into tensors of the given shapes."""
    ps, k = [], 0
    for s in shapes:
        n = int(np.prod(s))
        ps.append(theta[k:k + n].reshape(s))
        k += n
    return ps


def _mlp_forward(theta: torch.Tensor, shapes: list, x: torch.Tensor) -> torch.Tensor:
    """Hand-written forward of the tiny MLP from flat [W1, W2, W3, b1, b2, b3]."""
    w1, w2, w3, b1, b2, b3 = _unflatten(theta, shapes)
    h = torch.relu(x @ w1.T + b1)
    h = torch.relu(h @ w2.T + b2)
    return (h @ w3.T + b3).reshape(-1)


def _tiny_conv() -> nn.Sequential:
    torch.manual_seed(5)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(3, 4, 3, stride=2), nn.ReLU(),
                        nn.Flatten(), nn.Linear(16, 3))
    return net.double()


def _conv_forward(theta: torch.Tensor, shapes: list, x: torch.Tensor) -> torch.Tensor:
    """Hand-written forward of the tiny conv net from flat [W1, W2, W3, b1, b2, b3]."""
    w1, w2, w3, b1, b2, b3 = _unflatten(theta, shapes)
    h = torch.relu(F.conv2d(x, w1, b1, padding=1))
    h = torch.relu(F.conv2d(h, w2, b2, stride=2))
    return (h.reshape(1, -1) @ w3.T + b3).reshape(-1)


def _explicit_blocks(net, fwd, xs, Rs):
    """Per-sample explicit Hessian of y^T R y / 2 over [weights..., biases...]; returns
    (mean over samples of ||H_ml||_F^2 / numel_m as a matrix, block sizes, full Hessians)."""
    lin = [m for m in net if isinstance(m, (nn.Linear, nn.Conv2d))]
    params = [m.weight for m in lin] + [m.bias for m in lin]
    shapes = [tuple(p.shape) for p in params]
    sizes = [p.numel() for p in params]
    theta0 = torch.cat([p.detach().reshape(-1) for p in params])
    off = np.cumsum([0] + sizes)
    acc = np.zeros((len(sizes), len(sizes)))
    hs = []
    for x, R in zip(xs, Rs):
        def loss(th, x=x, R=R):
            y = fwd(th, shapes, x)
            return 0.5 * y @ R @ y
        H = torch.autograd.functional.hessian(loss, theta0, vectorize=True).numpy()
        hs.append(H)
        for m in range(len(sizes)):
            for l in range(len(sizes)):
                blk = H[off[m]:off[m + 1], off[l]:off[l + 1]]
                acc[m, l] += (blk ** 2).sum() / sizes[m]
    return acc / len(xs), sizes, hs


def _layers(net):
    idx = [i for i, m in enumerate(net) if isinstance(m, (nn.Linear, nn.Conv2d))]
    return [{"name": f"L{j}", "weight": f"{i}.weight", "bias": f"{i}.bias"} for j, i in enumerate(idx)]


def _geometric(sizes, seed):
    torch.manual_seed(seed)
    mods = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        m = nn.Linear(a, b)
        with torch.no_grad():
            m.weight.normal_(0, math.sqrt(2 / math.sqrt(a * b)))
            m.bias.zero_()
        mods += [m, nn.ReLU()]
    return nn.Sequential(*mods[:-1])


def _default(sizes, seed):
    torch.manual_seed(seed)
    mods = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        mods += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


# ------------------------------------------------------------------------------------------
# 1. Hessian-block statistic vs the explicit Hessian
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlp_case():
    net = _tiny_mlp()
    g = torch.Generator().manual_seed(11)
    xs = torch.randn(6, 4, generator=g, dtype=torch.float64)
    Rs = [_sym(3, g) for _ in range(6)]
    exact, sizes, hs = _explicit_blocks(net, _mlp_forward, xs, Rs)
    return net, xs, Rs, exact, sizes, hs


@pytest.fixture(scope="module")
def conv_case():
    net = _tiny_conv()
    g = torch.Generator().manual_seed(12)
    xs = torch.randn(4, 2, 6, 6, generator=g, dtype=torch.float64)
    Rs = [_sym(3, g) for _ in range(4)]
    exact, sizes, hs = _explicit_blocks(net, _conv_forward, [x[None] for x in xs], Rs)
    return net, xs, Rs, exact, sizes, hs


def test_basis_probes_reproduce_explicit_block_matrix_mlp(mlp_case):
    """n_probes >= block size -> basis probes: every block of B must equal the explicit one."""
    net, xs, Rs, exact, sizes, _ = mlp_case
    bm = hessian_block_matrix(net, xs, _layers(net), n_samples=6, n_probes=max(sizes),
                              include_bias=True, quadratic=lambda i, n: Rs[i])
    assert bm.names == ["L0", "L1", "L2", "L0.bias", "L1.bias", "L2.bias"]
    np.testing.assert_allclose(bm.mean, exact, rtol=1e-9, atol=1e-12)
    assert exact[0, 0] > 0 and exact[2, 0] > 0  # a non-trivial check


@pytest.mark.parametrize("probe", ["gaussian", "rademacher"])
def test_random_probes_converge_within_ci_mlp(mlp_case, probe):
    """E over probes of ||H_ll r||^2/numel = tr(H_ll^2)/numel.

    One sample and one R held fixed (the batch is that sample, the callable returns the same R
    for every draw), so the reported CI measures probe noise alone.  Over 2 samples x 3 layers
    the exact per-sample value must lie within 3 reported SE every time and inside the 95% CI at
    least 5 times of 6 (per-probe values are chi-square-like for these rank <= 3 blocks, so the
    t interval covers a little under 95%); then over 6 samples the (wider) CI must contain the
    6-sample mean."""
    net, xs, Rs, exact, sizes, hs = mlp_case
    off = np.cumsum([0] + sizes)
    inside = 0
    for i in (0, 3):
        res = measure_conditioning(net, xs[i:i + 1], _layers(net), stats=("hessian",),
                                   n_samples=32, n_probes=8, probe=probe, seed=i,
                                   quadratic=lambda j, n, R=Rs[i]: R)
        for l, layer in enumerate(res.layers):
            assert layer.numel > 8  # the random-probe path, not the basis path
            blk = hs[i][off[l]:off[l + 1], off[l]:off[l + 1]]
            target = (blk ** 2).sum() / sizes[l]
            est = layer.hessian
            inside += est.contains(target)
            assert abs(est.mean - target) <= 3 * est.stderr, (i, layer.name, est, target)
            assert est.rel_stderr < 0.15, (i, layer.name, est)
    assert inside >= 5
    res = measure_conditioning(net, xs, _layers(net), stats=("hessian",), n_samples=6,
                               n_probes=12, probe=probe, seed=1, quadratic=lambda j, n: Rs[j])
    for l, layer in enumerate(res.layers):
        assert layer.hessian.contains(exact[l, l]), (layer.name, layer.hessian, exact[l, l])


def test_conv_blocks_match_explicit_hessian(conv_case):
    net, xs, Rs, exact, sizes, _ = conv_case
    nw = 3
    res = measure_conditioning(net, xs, _layers(net), stats=("hessian",), n_samples=4,
                               n_probes=max(sizes[:nw]), quadratic=lambda i, n: Rs[i])
    np.testing.assert_allclose(res.blocks.mean, exact[:nw, :nw], rtol=1e-9, atol=1e-12)
    # random Gaussian probes: exact value inside the reported CI
    res = measure_conditioning(net, xs, _layers(net), stats=("hessian",), n_samples=4,
                               n_probes=10, probe="gaussian", seed=2,
                               quadratic=lambda i, n: Rs[i])
    for l, layer in enumerate(res.layers):
        assert layer.hessian.contains(exact[l, l]), (layer.name, layer.hessian, exact[l, l])


def test_ggn_is_exact_expectation_over_R():
    """method='ggn' = E_R ||H_ll||_F^2/numel and E_R[dW^2], computed explicitly: H and dW are
    linear in R, so with symmetric basis matrices S_ab the expectation over the symmetrized
    Gaussian R is sum_{a<b} 1/2 ||H(S_ab)||^2 + sum_a ||H(S_aa)||^2."""
    for make, fwd, xshape in ((_tiny_mlp, _mlp_forward, (4,)), (_tiny_conv, _conv_forward, (2, 6, 6))):
        net = make()
        xs = torch.randn(3, *xshape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        basis, var = [], []
        for a in range(3):
            for b in range(a, 3):
                S = torch.zeros(3, 3, dtype=torch.float64)
                S[a, b] = S[b, a] = 1.0
                basis.append(S)
                var.append(1.0 if a == b else 0.5)
        lin = [m for m in net if isinstance(m, (nn.Linear, nn.Conv2d))]
        params = [m.weight for m in lin] + [m.bias for m in lin]
        shapes = [tuple(p.shape) for p in params]
        sizes = [p.numel() for p in params]
        off = np.cumsum([0] + sizes)
        theta0 = torch.cat([p.detach().reshape(-1) for p in params])
        h_exp = np.zeros(3)
        g_exp = np.zeros(3)
        for x in xs:
            xb = x[None]
            for S, v in zip(basis, var):
                def loss(th, S=S, xb=xb):
                    y = fwd(th, shapes, xb)
                    return 0.5 * y @ S @ y
                H = torch.autograd.functional.hessian(loss, theta0, vectorize=True).numpy()
                th = theta0.clone().requires_grad_(True)
                gr = torch.autograd.grad(loss(th), th)[0].numpy()
                for l in range(3):
                    blk = H[off[l]:off[l + 1], off[l]:off[l + 1]]
                    h_exp[l] += v * (blk ** 2).sum() / sizes[l]
                    g_exp[l] += v * (gr[off[l]:off[l + 1]] ** 2).sum() / sizes[l]
        h_exp /= len(xs)
        g_exp /= len(xs)
        res = measure_conditioning(net, xs, _layers(net), stats=("hessian", "ratio"), n_samples=3,
                                   method="ggn")
        np.testing.assert_allclose([la.hessian.mean for la in res.layers], h_exp, rtol=1e-9)
        np.testing.assert_allclose([la.grad_sq.mean for la in res.layers], g_exp, rtol=1e-9)


# ------------------------------------------------------------------------------------------
# 2. GR formula vs weight-to-gradient ratio (Prop. 4) and vs the Hessian statistic (Fig. 2)
# ------------------------------------------------------------------------------------------
def test_gr_equals_ratio_for_geometric_mlp():
    """Prop. 4: nu_l = gamma_l for MLPs.  Per sample dW = dy x^T exactly, so the two differ only
    through (a) E[y^2] = n_in E[W^2] E[x^2], which for a ReLU input (mean^2 share 1/pi of E[x^2])
    fluctuates like a chi-square of n_out dof along the mean direction: relative std
    ~ sqrt(2/n_out)/pi per layer (zero for the zero-mean first-layer input), and (b) pooled vs
    per-sample moments plus sampling noise (~3-5%, measured on the first layer).
    Tolerance: 0.05 + 3 sqrt(2/n_out)/pi for hidden layers, 0.05 for the first layer."""
    sizes = [64, 256, 256, 128]
    net = _geometric(sizes, 0)
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(100))
    res = measure_conditioning(net, x, stats=("ratio", "gr"), n_samples=128, seed=0)
    for l, layer in enumerate(res.layers):
        tol = 0.05 if l == 0 else 0.05 + 3 * math.sqrt(2 / sizes[l + 1]) / math.pi
        r = layer.gr.mean / layer.ratio.mean
        assert abs(r - 1) < tol, (layer.name, r, tol)


def test_gr_tracks_hessian_statistic_across_mlp_layers():
    """Fig. 2: theory/measured is near a constant across layers (spread within 2x)."""
    net = _geometric([100, 384, 64, 10], 0)
    x = torch.randn(32, 100, generator=torch.Generator().manual_seed(1))
    res = measure_conditioning(net, x, stats=("hessian", "gr"), n_samples=32, n_probes=2, seed=0)
    ratios = {la.name: la.gr.mean / la.hessian.mean for la in res.layers}
    assert spread(ratios) < 2.0, ratios
    assert all(0.3 < v < 3.0 for v in ratios.values()), ratios


# ------------------------------------------------------------------------------------------
# 3. The paper's MLP: per-sample weight-to-gradient ratios, geometric vs default init
# ------------------------------------------------------------------------------------------
def test_ratio_spread_paper_mlp_geometric_vs_default():
    sizes = [100, 384, 64, 10]
    x = torch.randn(384, 100, generator=torch.Generator().manual_seed(0))
    geo = measure_conditioning(_geometric(sizes, 0), x, stats=("ratio",), n_samples=384, seed=0)
    dflt = measure_conditioning(_default(sizes, 0), x, stats=("ratio",), n_samples=384, seed=0)
    assert geo.spread("ratio") <= 1.2, geo.values("ratio")
    assert dflt.spread("ratio") >= 20.0, dflt.values("ratio")
    assert all(la.ratio.rel_stderr < 0.1 for la in geo.layers + dflt.layers)


# ------------------------------------------------------------------------------------------
# GR geometry and moments by hand
# ------------------------------------------------------------------------------------------
def test_gr_geometry_and_moments_by_hand():
    torch.manual_seed(0)
    lin = nn.Linear(5, 7, bias=False).double()
    x = torch.randn(3, 4, 5, dtype=torch.float64)  # sequences of 4 positions
    R = _sym(4 * 7, torch.Generator().manual_seed(9))  # flattened output: 4 positions x 7
    res = measure_conditioning(lin, x, ["weight"], stats=("gr", "ratio"), n_samples=3,
                               quadratic=lambda i, n: R)
    la = res.layers[0]
    assert (la.n_in, la.k2, la.rho2) == (5, 1.0, 4.0)
    x2 = np.mean([float((xi ** 2).mean()) for xi in x])
    ys = [(xi @ lin.weight.T).reshape(-1).detach() for xi in x]
    y2 = np.mean([float((y ** 2).mean()) for y in ys])
    dy2 = np.mean([float(((R @ y) ** 2).mean()) for y in ys])
    assert la.gr.mean == pytest.approx(5 * 1 * 4 * x2 ** 2 * dy2 / y2, rel=1e-9)
    # dW = sum_t dy_t x_t^T
    dw2 = np.mean([float(((R @ y).reshape(4, 7).T @ xi).pow(2).mean()) for y, xi in zip(ys, x)])
    assert la.ratio.mean == pytest.approx(dw2 / float(lin.weight.detach().pow(2).mean()), rel=1e-9)

    net = nn.Sequential(nn.Conv2d(4, 6, (3, 5), stride=2, padding=1, groups=2),
                        nn.ConvTranspose2d(6, 3, 4, stride=2, groups=3))
    res = measure_conditioning(net, torch.randn(2, 4, 9, 9), ["0.weight", "1.weight"],
                               stats=("gr",), n_samples=2)
    c, t = res.layers
    # conv: 9x9 -> floor((9+2-3)/2)+1 = 5 rows, floor((9+2-5)/2)+1 = 4 cols
    assert (c.n_in, c.k2, c.rho2, c.rho2_bias) == (2, 15.0, 20.0, 20.0)
    # transposed: input 5x4 positions; kernel taps per output 16/4; output (5-1)*2+4=12 x 10
    assert (t.n_in, t.k2, t.rho2, t.rho2_bias) == (2, 4.0, 20.0, 120.0)


# ------------------------------------------------------------------------------------------
# model state, inputs, layer specs
# ------------------------------------------------------------------------------------------
class _Stateful(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x, scale=None):
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        out = self.fc(h.flatten(1))
        if scale is not None:
            out = out * scale
        return {"hidden": h, "logits": out}


def test_model_state_restored_and_dropout_off():
    torch.manual_seed(0)
    m = _Stateful().train()
    m.fc.weight.requires_grad_(False)
    bn_before = {k: v.clone() for k, v in m.bn.state_dict().items()}
    x = torch.randn(4, 3, 8, 8)
    r1 = measure_conditioning(m, x, stats=("hessian", "ratio", "gr"), n_samples=4, n_probes=1)
    r2 = measure_conditioning(m, x, stats=("hessian", "ratio", "gr"), n_samples=4, n_probes=1)
    assert m.training and m.drop.training and m.bn.training
    for k, v in m.bn.state_dict().items():
        assert torch.equal(v, bn_before[k]), k
    assert not m.fc.weight.requires_grad and m.conv.weight.requires_grad
    assert all(p.grad is None for p in m.parameters())
    # dropout off and same seed -> identical numbers
    assert r1.values("hessian") == r2.values("hessian")
    assert r1.values("ratio") == r2.values("ratio")
    assert [la.name for la in r1.layers] == ["conv", "fc"]


def test_inputs_dicts_tuples_kwargs_and_output_fn():
    torch.manual_seed(0)
    m = _Stateful().eval()
    x = torch.randn(3, 3, 8, 8)
    scale = torch.tensor([[1.0], [2.0], [3.0]])
    base = measure_conditioning(m, x, stats=("ratio",), n_samples=3)
    as_dict = measure_conditioning(m, {"x": x}, stats=("ratio",), n_samples=3)
    as_tuple = measure_conditioning(m, (x,), stats=("ratio",), n_samples=3)
    assert base.values("ratio") == as_dict.values("ratio") == as_tuple.values("ratio")
    # a per-sample kwarg is sliced: scaling sample i by s_i scales dW by s_i^2 (y -> s y, dL/dy -> s R s y)
    scaled = measure_conditioning(m, x, stats=("ratio",), n_samples=3,
                                  forward_kwargs={"scale": scale})
    unit = measure_conditioning(m, x, stats=("ratio",), n_samples=3,
                                forward_kwargs={"scale": torch.ones(3, 1)})
    assert scaled.values("ratio")["fc"] > 4 * unit.values("ratio")["fc"]
    # output_fn picks another output
    hid = measure_conditioning(m, x, ["conv.weight"], stats=("ratio",), n_samples=2,
                               output_fn=lambda o: o["hidden"])
    assert hid.layers[0].name == "conv"
    assert default_output_fn((torch.ones(1), 3)).shape == (1,)
    with pytest.raises(PrecondError):
        default_output_fn(3)


def test_layer_specs():
    net = _tiny_mlp()

    class Node:  # shaped like precondfx.core.graph.Node
        name = "second"
        params = {"weight": "2.weight", "bias": "2.bias"}
        module = "2"

    refs = resolve_layers(net, ["0.weight", {"name": "a", "weight": "4.weight", "alpha": 2.0},
                                Node()])
    assert [(r.name, r.weight, r.bias, r.module, r.alpha) for r in refs] == [
        ("0", "0.weight", None, "0", 1.0), ("a", "4.weight", None, "4", 2.0),
        ("second", "2.weight", "2.bias", "2", 1.0)]
    (ref,) = resolve_layers(net, [LayerRef("z", "0.weight", "0.bias")])
    assert (ref.module, ref.bias) == ("0", "0.bias")
    with pytest.raises(PrecondError):
        resolve_layers(net, ["nope.weight"])
    with pytest.raises(PrecondError):
        resolve_layers(net, ["0.weight", {"weight": "0.weight"}])
    # alpha multiplies gamma by alpha^4
    xs = torch.randn(4, 4, dtype=torch.float64)
    a1 = measure_conditioning(net, xs, [{"weight": "4.weight"}], stats=("gr",), n_samples=4)
    a2 = measure_conditioning(net, xs, [{"weight": "4.weight", "alpha": 2.0}], stats=("gr",),
                              n_samples=4)
    assert a2.layers[0].gr.mean == pytest.approx(16 * a1.layers[0].gr.mean, rel=1e-12)


def test_spread_helper():
    assert spread({"a": 1.0, "b": 4.0}) == 4.0
    assert spread([2.0, 3.0, 6.0]) == 3.0
    assert spread([0.0, 1.0]) == math.inf


def test_ci_covers_at_nominal_rate_roughly():
    """Coverage sanity of the reported CI: the ggn statistic over 20 disjoint batches of 8
    samples vs a 1000-sample reference; 95% intervals should miss rarely (<= 4 of 20)."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(1000, 8, generator=torch.Generator().manual_seed(2))
    ref = measure_conditioning(net, x, stats=("hessian",), n_samples=1000, method="ggn")
    miss = 0
    for k in range(20):
        r = measure_conditioning(net, x[8 * k:8 * k + 8], stats=("hessian",), n_samples=8,
                                 method="ggn")
        miss += not r.layers[0].hessian.contains(ref.layers[0].hessian.mean)
    assert miss <= 4


# ------------------------------------------------------------------------------------------
# plots
# ------------------------------------------------------------------------------------------
def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_plots_write_png_of_expected_size(tmp_path, mlp_case):
    pytest.importorskip("matplotlib")
    exact = mlp_case[3]
    p = plot_heatmap(exact, [f"b{i}" for i in range(6)], tmp_path / "heat.png")
    assert _png_size(p) == (600, 500)
    p = plot_bars({"a": 1.0, "b": 30.0}, {"a": 1.0, "b": 1.1}, tmp_path / "sub" / "bars.png",
                  "ratio", figsize=(5, 3), dpi=80)
    assert _png_size(p) == (400, 240)


def test_plots_without_matplotlib(tmp_path, monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PrecondError, match="pip install matplotlib"):
        plot_bars({"a": 1.0}, None, tmp_path / "x.png")
