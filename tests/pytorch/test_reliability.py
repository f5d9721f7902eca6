"""Reliability catalog: dtypes, devices, compiled models, odd parameters, second calls."""
import copy

import pytest
import torch
from torch import nn

import precondfx
from precondfx import PrecondError
from tests import zoo
from tests.helpers import call, main, train_std


def _std(model, x):
    return train_std(model, x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_dtypes(dtype):
    model, x = zoo.build("strided_cnn")
    model = model.to(dtype)
    pm, rep = precondfx.precondition(model, x.to(dtype), target_std=0.05)
    assert all(p.dtype == dtype for p in pm.parameters())
    assert all(b.dtype == dtype for b in pm.buffers() if b.is_floating_point())
    out = main(call(pm, x.to(dtype)))
    assert out.dtype == dtype
    tol = 0.02 if dtype == torch.float64 else 0.05  # half precision rounding of the output
    assert abs(float(out.double().std(correction=0)) / 0.05 - 1) < tol


def test_float32_sample_for_float64_model_is_cast():
    model, x = zoo.build("mlp")
    pm, _ = precondfx.precondition(model.double(), x.float())
    assert all(p.dtype == torch.float64 for p in pm.parameters())


def test_meta_device_plans_from_shapes():
    with torch.device("meta"):
        model, x = zoo.build("resnet_bottleneck")
    model = model.to("meta")
    with pytest.raises(PrecondError, match="meta device"):
        precondfx.precondition(model, x)
    pm, rep = precondfx.precondition(model, x, balance="analytic", target_std=None)
    assert all(p.device.type == "meta" for p in pm.parameters())
    assert rep.plan.layers and rep.plan.residuals
    # materialize, then apply the plan's inits: the geometric second moments appear
    pm = pm.to_empty(device="cpu")
    precondfx.reinit(pm, rep.plan, seed=0)
    la = rep.plan.layers[1]
    w = pm.get_parameter(la.weight)
    assert float(w.double().pow(2).mean()) == pytest.approx(rep.plan.inits[la.weight].std ** 2,
                                                            rel=1e-4)


def test_compiled_model_preconditions_the_original():
    model, x = zoo.build("mlp")
    compiled = torch.compile(model)
    pm, rep = precondfx.precondition(compiled, x, target_std=0.05)
    assert any("torch.compile" in n for n in rep.capture_notes)
    assert abs(_std(pm, x) / 0.05 - 1) < 0.02


def test_batch_of_one_with_batchnorm_gets_advice():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(PrecondError, match="at least two samples|calibration='eval'"):
        precondfx.precondition(model, torch.randn(1, 4))
    pm, rep = precondfx.precondition(model, torch.randn(1, 4), calibration="eval",
                                     balance="none", target_std=0.05)
    assert rep.output_std_after == pytest.approx(0.05, rel=0.02)


def test_integer_input_where_floats_expected():
    model, _ = zoo.build("mlp")
    with pytest.raises(PrecondError, match="raised"):
        precondfx.precondition(model, torch.randint(0, 5, (8, 100)))


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.spare = nn.Linear(6, 6)         # never used in forward
        self.register_buffer("counter", torch.zeros(1))

    def forward(self, x):
        return self.a(x)


def test_parameters_the_output_does_not_use_are_kept_and_reported():
    model = Unused()
    pm, rep = precondfx.precondition(model, torch.randn(8, 6))
    assert {"spare.weight", "spare.bias", "counter"} <= set(pm.state_dict())
    assert torch.equal(pm.state_dict()["spare.weight"], model.spare.weight)
    assert "not read by any captured operation" in rep.plan.inits["spare.weight"].reason


def test_frozen_parameters_are_left_alone():
    model, x = zoo.build("strided_cnn")
    first = next(model.parameters())
    first.requires_grad_(False)
    name = next(n for n, _ in model.named_parameters())
    before = first.detach().clone()
    pm, rep = precondfx.precondition(model, x)
    assert torch.equal(pm.get_parameter(name), before)
    assert "frozen" in rep.plan.inits[name].reason


@pytest.mark.parametrize("wrap", ["weight_norm", "spectral_norm"])
def test_parametrized_weights_are_reported(wrap):
    from torch.nn.utils import parametrizations as P
    torch.manual_seed(0)   # the check below is on a held-out batch of 16: fix the draw
    lin = nn.Linear(8, 8)
    lin = getattr(P, wrap)(lin)
    model = nn.Sequential(lin, nn.ReLU(), nn.Linear(8, 3))
    pm, rep = precondfx.precondition(model, torch.randn(16, 8), target_std=0.05)
    row = next(r for r in rep.nodes if r.kind == "linear" and "parametrized" in r.reason)
    assert row is not None
    assert abs(_std(pm, torch.randn(16, 8)) / 0.05 - 1) < 0.5


def test_second_call_is_refused_and_changes_nothing():
    """A second pass would stack constants on the first ones: refused (as on the ONNX path),
    with what to do, and the preconditioned model left as it is (inplace=True too)."""
    model, x = zoo.build("strided_cnn")
    pm, _ = precondfx.precondition(model, x)
    sd1 = {k: v.clone() for k, v in pm.state_dict().items()}
    for inplace in (False, True):
        with pytest.raises(PrecondError, match="already preconditioned.*original model"):
            precondfx.precondition(pm, x, inplace=inplace)
    sd2 = pm.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert precondfx.analyze(pm, x).rows()   # analyze still describes it


def test_eager_inplace_rollback_restores_hooks_and_modules():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 4, 3, padding=1)
            self.p = nn.MaxPool2d(2)
            self.fc = nn.Linear(4 * 4 * 4, 2)

        def forward(self, x):
            return self.fc(self.p(torch.relu(self.c(x))).flatten(1)) * 0.0 + 1.0

    m = Bad()
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(PrecondError, match="zero variance"):
        precondfx.precondition(m, torch.randn(2, 3, 8, 8), inplace=True, capture="eager")
    assert isinstance(m.p, nn.MaxPool2d) and m.c.stride == (1, 1)
    assert not any(mod._forward_hooks or mod._forward_pre_hooks for mod in m.modules())
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_input_scale_behind_a_normalization_is_reported():
    m = nn.Sequential(nn.LayerNorm(13, elementwise_affine=False), nn.Linear(13, 64), nn.ReLU(),
                      nn.Linear(64, 3))
    x = torch.randn(32, 13) * 5
    pm, rep = precondfx.precondition(m, x, balance="none", input_scale="auto")
    assert rep.input_scale == pytest.approx((13 ** -0.5 / float(x.pow(2).mean())) ** 0.5)
    assert any(what == "input scale" and "normalization" in why for what, why in rep.skipped)


def test_a_folded_result_can_be_preconditioned_again():
    """The refusal's advice works: fold() gives a plain model (no precondfx_* constants, same
    function) that a second pass takes, calibrated to the target again."""
    model, x = zoo.build("strided_cnn")
    pm, rep = precondfx.precondition(model, x)
    with pytest.raises(PrecondError, match=r"precondfx\.fold\(model\)"):
        precondfx.precondition(pm, x)
    plain = precondfx.fold(pm)
    assert not any("precondfx" in n for n, _ in plain.named_buffers())
    pm.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(x), pm(x), rtol=1e-4, atol=1e-5)
    pm2, _ = precondfx.precondition(plain, x, target_std=0.5)
    with torch.no_grad():
        assert float(pm2.eval()(x).std()) == pytest.approx(0.5, rel=0.05)
