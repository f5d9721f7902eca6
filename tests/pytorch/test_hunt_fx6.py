"""Regression tests of hunt fx6: shape-valued operands in the fx applier, dtype properties read
in forward, namedtuple outputs under TAT, a layer applied to a parameter (hypernetwork)."""
import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from precondfx.core.plan import Scale
from precondfx.pytorch.apply.fx_apply import FxApplier
from precondfx.pytorch.capture import fx_capture
from precondfx.pytorch.capture.common import make_sample


class _ShapePlusAct(nn.Module):
    """A join whose first operand is a number computed from the input's shape."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return x.size(-1) + self.fc(x)


def test_operand_index_skips_shape_values_as_the_captured_graph_does():
    torch.manual_seed(0)
    model, x = _ShapePlusAct(), torch.randn(3, 6)
    gm = fx_capture.trace(model, make_sample(x))
    fx_capture.run_shape_prop(gm, make_sample(x))
    graph = fx_capture.to_graph(gm)
    add = next(n for n in graph if n.kind == "add")
    assert add.inputs == ["fc"]           # the size is a constant, not an activation operand
    ap = FxApplier(gm, graph)
    assert ap.scale(Scale("residual", add.name, "operand", 0, 0.5, "test")) is not None
    ap.finish()
    with torch.no_grad():
        want = x.size(-1) + 0.5 * model.fc(x)     # operand 0 of the graph: the activation
        torch.testing.assert_close(gm(x), want)


class _DtypeProperty(nn.Module):
    """transformers-style: ``self.dtype`` is a property reading the parameters' dtype."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    @property
    def dtype(self):
        return next(self.parameters()).dtype

    def forward(self, x):
        x = x.to(self.dtype)
        return self.fc2(torch.relu(self.fc1(x)) + torch.zeros(16, dtype=self.dtype))


def test_dtype_property_is_not_frozen_into_the_result():
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    result, report = precondfx.precondition(_DtypeProperty(), x)
    with torch.no_grad():
        ref = result(x)
        low = result.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, rtol=0.05, atol=0.05)
    assert report.capture != "fx"           # the fx graph would keep float32
    with pytest.raises(precondfx.errors.PrecondError, match=r"_DtypeProperty\.dtype"):
        precondfx.precondition(_DtypeProperty(), x, capture="fx")


_Out = collections.namedtuple("_Out", ["logits", "hidden"])


class _NamedTupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.body:
            x = torch.tanh(layer(x))
        return _Out(self.head(x), hidden=x)


@pytest.mark.parametrize("scheme", ["geometric", "tat"])
def test_namedtuple_output_is_a_container_not_an_unknown_op(scheme):
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    result, report = precondfx.precondition(_NamedTupleOut(), x, scheme=scheme)
    assert report.capture == "fx"
    assert not [r.name for r in report.nodes if r.status == "unknown"]
    with torch.no_grad():
        out = result(x)
    assert type(out) is _Out
    assert abs(float(out.logits.std()) - 1.0) < 0.05       # the output scale on the logits


class _Hyper(nn.Module):
    """A hypernetwork: ``gen`` (a Linear) applied to the parameter ``z`` draws the weight of
    the functional linear that the input goes through."""

    def __init__(self, i=16, o=8, nz=4):
        super().__init__()
        self.z = nn.Parameter(torch.randn(nz))
        self.gen = nn.Linear(nz, o * i)
        self.head = nn.Linear(o, 3)
        self.o, self.i = o, i

    def forward(self, x):
        w = self.gen(self.z).view(self.o, self.i)
        return self.head(torch.relu(F.linear(x, w)))


def test_alpha_of_a_layer_applied_to_a_parameter_scales_that_parameter():
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    result, report = precondfx.precondition(_Hyper(), x)
    assert report.capture == "fx"
    assert not [s for s in report.skipped if "gen" in str(s)], report.skipped
    alpha = result.get_buffer("precondfx_alpha_gen")     # placed, as the eager back end does
    with torch.no_grad():
        alpha.fill_(2.0)
        got = result(x)
        alpha.fill_(1.0)
        result.z.mul_(2.0)
        want = result(x)
    torch.testing.assert_close(got, want)
