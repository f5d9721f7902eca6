"""scheme='lsuv' (Mishkin & Matas, Alg. 1): every weighted call site ends at unit output variance,
measured here with forward hooks on the rewritten model (not with the scheme's own numbers), in
execution order, including both call sites of a shared module and a model whose ``__init__``
lists its layers in the reverse of their use."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import precondfx
from tests import zoo
from tests.helpers import call, frozen, main

TOL = 0.1


def site_variances(model: nn.Module, sample) -> list[tuple[str, float]]:
    """(module path, population variance of its output) for every call of a Conv/Linear
    module, in the order the calls happen (train mode, dropout off, buffers restored).  The
    module producing the main output carries the output scale (so that a loss computed inside
    forward sees it); its variance is read before that scale."""
    got: list[tuple[str, float]] = []
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)):
            out_scale = float(getattr(mod, "precondfx_output_scale", 1.0))
            hooks.append(mod.register_forward_hook(
                lambda m, i, o, name=name, c=out_scale:
                got.append((name, float((o / c).double().var(correction=0))))))
    try:
        with frozen(model, True):
            call(model, sample)
    finally:
        for h in hooks:
            h.remove()
    return got


@pytest.fixture(scope="module")
def shared_fx():
    m, x = zoo.build("shared_module")
    res = precondfx.precondition(m, x, scheme="lsuv", target_std=0.05)
    return res, x


def test_shared_module_every_call_site_unit_variance(shared_fx):
    res, x = shared_fx
    assert res.report.capture == "fx"
    sites = site_variances(res.model, x)
    names = [n for n, _ in sites]
    # execution order, the shared Linear twice (max pool folded into the conv's stride)
    assert names == ["conv", "fc_in", "shared", "shared", "head"]
    for name, v in sites:
        assert abs(v - 1.0) < TOL, (name, v)
    shared = [v for n, v in sites if n == "shared"]
    assert len(shared) == 2 and all(abs(v - 1) < TOL for v in shared)
    rep = res.report.conditioning["lsuv"]
    assert [s["node"] for s in rep["sites"]] == ["conv", "fc_in", "shared", "shared_1", "head"]
    assert rep["all_converged"]
    # one step per call site: forwards = 1 + total iterations <= sites + 1
    assert rep["forwards"] == 1 + sum(s["iterations"] for s in rep["sites"])
    assert rep["forwards"] <= len(rep["sites"]) + 1


def test_shared_module_scales_are_independent_and_folded(shared_fx):
    res, _ = shared_fx
    plan = res.report.plan
    alphas = {sc.node: sc.value for sc in plan.scales if sc.tag == "alpha"}
    # the first call site's scale went into the weight, the second keeps its ratio in its alpha
    assert alphas["shared"] == pytest.approx(1.0)
    assert abs(alphas["shared_1"] - 1.0) > 0.01
    buf = dict(res.model.named_buffers())
    assert float(buf["precondfx_alpha_shared_1"]) == pytest.approx(alphas["shared_1"])
    # the plan's init equals what the model holds: an orthonormal matrix times its std
    w = res.model.get_parameter("fc_in.weight").detach().double()
    pi = plan.inits["fc_in.weight"]
    assert pi.rule == "orthogonal"
    gram = w @ w.T  # 32 x 512: orthonormal rows scaled by std
    assert torch.allclose(gram, pi.std ** 2 * torch.eye(32, dtype=torch.float64), atol=1e-4)
    assert all(plan.inits[b].rule == "zeros" for b in ("fc_in.bias", "shared.bias"))


def test_output_scale_after_lsuv(shared_fx):
    res, x = shared_fx
    with frozen(res.model, True):
        std = float(main(call(res.model, x)).double().std(correction=0))
    assert std == pytest.approx(0.05, rel=0.02)


def test_conv_net_execution_order():
    m, x = zoo.build("maxpool_cnn", batch=8)
    res = precondfx.precondition(m, x, scheme="lsuv")
    sites = site_variances(res.model, x)
    # 4 convs, the unfoldable max pool replaced by a strided conv, the linear head
    assert len(sites) == 6
    for name, v in sites:
        assert abs(v - 1.0) < TOL, (name, v)
    rep = res.report.conditioning["lsuv"]
    assert rep["forwards"] <= len(rep["sites"]) + 1


class ReversedDefinition(nn.Module):
    """Layers defined in the reverse of their use; ``mid`` is called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(48, 10)
        self.mid = nn.Linear(48, 48)
        self.inp = nn.Linear(24, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        h = torch.relu(self.mid(h))
        h = torch.relu(self.mid(h))
        return self.head(h)


def naive_lsuv(model: nn.Module, x: torch.Tensor, tol: float = TOL, t_max: int = 10) -> None:
    """What LSUV packages do: modules in definition order, hooks that keep the last call's
    output, the weight divided by the output std."""
    for mod in model.modules():
        if not isinstance(mod, nn.Linear):
            continue
        out = {}
        h = mod.register_forward_hook(lambda m, i, o: out.__setitem__("o", o))
        for _ in range(t_max):
            with torch.no_grad():
                model(x)
            v = float(out["o"].var())
            if abs(v - 1) < tol:
                break
            with torch.no_grad():
                mod.weight.div_(v ** 0.5)
        h.remove()


def test_definition_order_differs_from_execution_order():
    torch.manual_seed(0)
    x = 3.0 * torch.randn(64, 24)
    naive = ReversedDefinition()
    for mod in naive.modules():
        if isinstance(mod, nn.Linear):
            nn.init.orthogonal_(mod.weight)
            nn.init.zeros_(mod.bias)
    naive_lsuv(naive, x)
    naive_vars = site_variances(naive, x)
    assert [n for n, _ in naive_vars] == ["inp", "mid", "mid", "head"]
    assert any(abs(v - 1) >= TOL for _, v in naive_vars)  # the model defeats the naive order

    res = precondfx.precondition(ReversedDefinition(), x, scheme="lsuv", target_std=None)
    ours = site_variances(res.model, x)
    assert [n for n, _ in ours] == ["inp", "mid", "mid", "head"]
    for name, v in ours:
        assert abs(v - 1) < TOL, (name, v)
    rep = res.report.conditioning["lsuv"]
    assert [s["node"] for s in rep["sites"]] == ["inp", "mid", "mid_1", "head"]


def test_eager_shared_module_falls_back_to_one_scale():
    m, x = zoo.build("shared_module")
    res = precondfx.precondition(m, x, scheme="lsuv", capture="eager")
    assert res.report.capture == "eager"
    rep = res.report.conditioning["lsuv"]
    assert any("share one scale buffer" in n for n in rep["notes"])
    sites = site_variances(res.model, x)
    assert [n for n, _ in sites] == ["conv", "fc_in", "shared", "shared", "head"]
    for name, v in sites:
        if name != "shared":
            assert abs(v - 1) < TOL, (name, v)
    a, b = [v for n, v in sites if n == "shared"]
    assert abs((a * b) ** 0.5 - 1) < TOL  # one scale fitted to their geometric mean


def test_options_and_balance_modes():
    m, x = zoo.build("mlp")
    res = precondfx.precondition(m, x, scheme="lsuv", scheme_options={"tol": 0.01,
                                                                      "target_var": 2.0})
    assert res.report.plan.options["balance"] == "none"
    for name, v in site_variances(res.model, x):
        assert abs(v / 2.0 - 1) < 0.01, (name, v)
    with pytest.raises(precondfx.PrecondError):
        precondfx.precondition(m, x, scheme="lsuv", scheme_options={"tol": 0})


def test_hessian_balancing_after_lsuv_keeps_unit_variances():
    m, x = zoo.build("shared_module")
    res = precondfx.precondition(m, x, scheme="lsuv", balance="hessian")
    assert res.report.plan.options["balance"] == "hessian"
    alphas = [sc.value for sc in res.report.plan.scales if sc.tag == "alpha"]
    assert max(alphas) / min(alphas) > 1.2  # balancing moved the alphas ...
    for name, v in site_variances(res.model, x):
        assert abs(v - 1) < TOL, (name, v)  # ... without changing the forward pass
