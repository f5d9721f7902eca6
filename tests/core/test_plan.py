"""The plan: analytic constants of Sec. 5 / App. E, residual detection, fans, JSON round trip,
and function preservation when nothing is re-drawn."""
import json
import math

import pytest
import torch
from torch import nn

import precondfx
from tests import zoo
from precondfx.core.plan import Plan
from tests.helpers import call, frozen, main


def _layers(rep):
    return {lay.module or lay.node: lay for lay in rep.plan.layers}


def test_bottleneck_resnet_constants_match_appendix_e():
    model, x = zoo.build("resnet_bottleneck")
    rep = precondfx.analyze(model, x, balance="analytic")
    joins = [r for r in rep.plan.residuals if r.s is not None]
    n_blocks = sum(1 for n, _ in model.named_modules() if n.count(".") == 1 and
                   n.startswith("layer"))
    assert len(joins) == n_blocks
    s = joins[0].s
    assert s == pytest.approx(1 / math.sqrt(n_blocks))
    lay = _layers(rep)
    # the 3x3 conv of every bottleneck carries 1/sqrt(3) (App. E), the 1x1 convs 1
    for name, la in lay.items():
        if la.in_residual_branch and la.k2 == 9:
            assert la.alpha == pytest.approx(1 / math.sqrt(3))
        elif la.in_residual_branch and la.k2 == 1:
            assert la.alpha == pytest.approx(1.0)
    # stem: alpha^2 = (k1/k0) s^2/(1+s^2) with k0 = 7 (stem width), k1 = 1 (first 1x1 conv)
    assert lay["conv1"].alpha ** 2 == pytest.approx((1 / 7) * s * s / (1 + s * s))
    # final linear: alpha^2 = k_{L-1} s^2/(1+s^2) with k_{L-1} = 1 (last 1x1 conv)
    assert lay["fc"].alpha ** 2 == pytest.approx(1 * s * s / (1 + s * s))
    # every branch: three convs, the projection shortcut is not part of it
    for r in joins:
        assert len(r.branch_layers) == 3


def test_branches_with_normalization_get_no_s_unless_asked():
    model, x = zoo.build("resnet_bottleneck_bn")
    rep = precondfx.analyze(model, x)
    assert rep.plan.residuals and all(r.s is None for r in rep.plan.residuals)
    rep_all = precondfx.analyze(model, x, residual="all", residual_scale=0.3)
    assert all(r.s == 0.3 for r in rep_all.plan.residuals)


def test_independent_inputs_are_not_a_residual_join():
    model, x = zoo.build("two_inputs_dict_out")
    rep = precondfx.analyze(model, x)
    assert rep.plan.residuals == []


def test_kernel_alphas_on_alexnet():
    model, x = zoo.build("alexnet_strided")
    rep = precondfx.analyze(model, x, balance="analytic")
    convs = [la for la in rep.plan.layers if la.kind == "conv"]
    assert [la.k2 for la in convs] == [121, 25, 9, 9, 9]
    for la in convs:
        assert la.alpha == pytest.approx(la.k2 ** -0.25)  # Sec. 5: alpha^4 k^2 = const
    assert all(la.alpha == 1.0 for la in rep.plan.layers if la.kind == "linear")


def test_depthwise_and_grouped_fans():
    conv_dw = nn.Conv2d(8, 16, 3, groups=8, padding=1)
    model = nn.Sequential(conv_dw, nn.ReLU(), nn.Conv2d(16, 4, 1), nn.Flatten(),
                          nn.Linear(4 * 8 * 8, 3))
    rep = precondfx.analyze(model, torch.randn(2, 8, 8, 8), balance="analytic")
    la = rep.plan.layers[0]
    assert (la.n_in, la.n_out, la.k2) == (1, 2, 9)
    pi = rep.plan.inits["0.weight"]
    # zero padding on an 8x8 map: (3*8 - 2)/8 taps reach the input per dimension (App. A.2.7)
    taps = ((3 * 8 - 2) / 8) ** 2
    assert la.k2_eff == pytest.approx(taps)
    assert pi.std == pytest.approx(math.sqrt(2 / (taps * math.sqrt(2))) / la.alpha)


def test_plan_json_round_trip():
    model, x = zoo.build("resnet_bottleneck")
    plan = precondfx.analyze(model, x).plan
    again = Plan.from_dict(json.loads(plan.to_json()))
    assert json.loads(again.to_json()) == json.loads(plan.to_json())


@pytest.mark.parametrize("name,capture", [("resnet_bottleneck", "fx"),
                                          ("alexnet_strided", "fx"),
                                          ("alexnet_strided", "eager"),
                                          ("vit", "fx"), ("lstm_lm", "fx"),
                                          ("data_dependent", "draft_export"),
                                          ("densenet", "export")])
def test_function_unchanged_without_reinit(name, capture):
    """reinit off, no s, pools kept: only reparametrizations remain (alpha with weights divided
    by alpha), so the output is the original times the output scale."""
    model, x = zoo.build(name)
    with frozen(model):
        ref = main(call(model, x)).clone()
    pm, rep = precondfx.precondition(model, x, reinit_weights=False, residual="none",
                                     maxpool="keep", capture=capture)
    assert rep.capture == capture
    with frozen(pm):
        got = main(call(pm, x))
    want = ref * rep.output_scale
    err = float((got - want).abs().max() / want.abs().max())
    assert err < 1e-4, err
