"""Bad input gets one exception class (a ValueError subclass) with a message that says what was
wrong and what to do, and the user's model is left exactly as it was."""
import pytest
import torch
from torch import nn

import precondfx
from precondfx import PrecondError
from tests import zoo


def _snapshot(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_error_class_is_value_error():
    assert issubclass(PrecondError, ValueError)


@pytest.mark.parametrize("inplace", [False, True])
def test_sample_that_does_not_fit(inplace):
    model, _ = zoo.build("strided_cnn")
    before = _snapshot(model)
    with pytest.raises(PrecondError, match=r"raised .* when called with the sample.*shapes"):
        precondfx.precondition(model, torch.randn(2, 5, 32, 32), inplace=inplace)
    assert _same(before, _snapshot(model))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_in_sample(bad):
    model, x = zoo.build("mlp")
    x = x.clone()
    x[0, 3] = bad
    before = _snapshot(model)
    with pytest.raises(PrecondError, match="NaN/inf"):
        precondfx.precondition(model, x)
    assert _same(before, _snapshot(model))


def test_empty_batch():
    model, _ = zoo.build("mlp")
    with pytest.raises(PrecondError, match="empty"):
        precondfx.precondition(model, torch.randn(0, 100))


def test_wrong_sample_type():
    model, _ = zoo.build("mlp")
    with pytest.raises(PrecondError, match="sample must be a tensor"):
        precondfx.precondition(model, "not a tensor")


def test_not_a_module():
    with pytest.raises(PrecondError, match="torch.nn.Module"):
        precondfx.precondition(lambda x: x, torch.randn(2, 2))


class Constant(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x) * 0.0 + 1.0


@pytest.mark.parametrize("inplace", [False, True])
def test_zero_variance_output(inplace):
    model = Constant()
    before = _snapshot(model)
    with pytest.raises(PrecondError, match="zero variance"):
        precondfx.precondition(model, torch.randn(8, 4), inplace=inplace)
    assert _same(before, _snapshot(model))
    assert not any(k.startswith("precondfx") for k in model.state_dict())
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_no_weighted_layer():
    with pytest.raises(PrecondError, match="no weighted layer"):
        precondfx.precondition(nn.Sequential(nn.ReLU(), nn.Tanh()), torch.randn(4, 3))


@pytest.mark.parametrize("opt", [{"maxpool": "nope"}, {"init": "kaiming"}, {"balance": "x"},
                                 {"target_std": -1.0}, {"residual_scale": 3.0},
                                 {"input_scale": "big"}, {"capture": ["jit"]}])
def test_bad_options(opt):
    model, x = zoo.build("mlp")
    with pytest.raises(PrecondError):
        precondfx.precondition(model, x, **opt)


def test_model_raising_inside_forward():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            raise RuntimeError("kaboom")

    with pytest.raises(PrecondError, match="kaboom"):
        precondfx.precondition(Boom(), torch.randn(2, 3))


def test_output_key_that_does_not_exist():
    model, sample = zoo.build("two_inputs_dict_out")
    with pytest.raises(PrecondError, match="output_key"):
        precondfx.precondition(model, sample, output_key="nope")


def test_output_key_selects_output():
    model, sample = zoo.build("two_inputs_dict_out")
    pm, rep = precondfx.precondition(model, sample, output_key="aux", target_std=0.05)
    from tests.helpers import call, frozen
    with frozen(pm):
        out = call(pm, sample)
    assert abs(float(out["aux"].double().std(correction=0)) / 0.05 - 1) < 0.02
