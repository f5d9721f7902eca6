"""Hunt fx10: the captures (fx, export, eager), the apply step and fold, on user code written
the way real code is written: a layer class of the user's computing ``F.linear`` on its own
parameters, a view of the output returned beside it and taken before an in-place change, a
max-pool module called twice, a main output after a ReLU that another output reads."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx

CAPTURES = ("fx", "export", "eager")


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _state(m: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


# -- (a) a layer class of the user's: F.linear on its own weight and bias ---------------------
class MyLinear(nn.Module):
    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i) * 0.1)
        self.bias = nn.Parameter(torch.zeros(o))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class OwnLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = MyLinear(8, 32), MyLinear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("capture", CAPTURES)
def test_fold_puts_the_output_scale_into_a_custom_linear_layers_weight_and_bias(capture):
    """The output scale sits on the output of ``b`` (a user's class computing
    ``F.linear(x, self.weight, self.bias)``).  Before, fold refused on every capture ('no
    parameter of it scales its output exactly'; on fx 'no module of your class can absorb
    it'), though scaling b.weight and b.bias does exactly that.  Now it folds: the plain model
    equals the result to 1e-5, and b's weight and bias carry the scale."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    res, rep = _quiet(precondfx.precondition, OwnLayers(), x, capture=capture, lr=None)
    assert rep.capture == capture
    scale = float(rep.plan.scales[[s.tag for s in rep.plan.scales].index("output")].value)
    assert abs(scale - 1.0) > 0.1          # an output scale to fold
    assert precondfx.fold_problems(res) == []
    with torch.no_grad():
        want = res(x)
        plain = precondfx.fold(res)
        got = plain(x)
    assert type(plain) is OwnLayers
    assert float((got - want).abs().max()) < 1e-5
    assert abs(float(got.std()) - 1.0) < 0.02


# -- (c) a view of the output taken before an in-place change, returned beside it ------------
class ViewThenClamp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(8, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor):
        y = self.o(torch.relu(self.a(x)))
        flat = y.view(-1)
        y.clamp_(-0.3, 0.3)
        return y, flat


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_returned_view_taken_before_an_in_place_change_is_the_output_itself(capture):
    """``flat = y.view(-1)`` is ``y``'s own numbers in the user's forward.  Before, fx scaled
    only the returned ``y``: ``flat`` differed from ``y.view(-1)`` by 0.82 (std 0.269 against
    1.002); eager and export scaled both.  Now every capture returns ``flat == y.view(-1)``."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    torch.manual_seed(1)
    res, rep = _quiet(precondfx.precondition, ViewThenClamp(), x, capture=capture, lr=None)
    assert rep.capture == capture
    with torch.no_grad():
        y, flat = res(x)
    assert float((flat - y.reshape(-1)).abs().max()) == 0.0
    assert abs(float(y.std()) - 1.0) < 0.02


# -- (d) a max-pool module called twice ------------------------------------------------------
class PoolTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.pool, self.fc = nn.MaxPool2d(2), nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(torch.relu(self.c1(x)))
        h = self.pool(torch.relu(self.c2(h)))
        return self.fc(h.flatten(1))


def test_a_pool_module_called_twice_folds_the_same_on_every_capture():
    """Each call of ``self.pool`` follows a convolution called once.  Before, fx folded both
    calls into the convolutions' strides while eager and export kept the max-pool ('called
    more than once'): two different results from one plan.  Now every capture folds both, the
    report says so, the results agree to 1e-6 and the user's model is unchanged."""
    torch.manual_seed(0)
    x = torch.randn(16, 3, 16, 16)
    outs = {}
    for capture in CAPTURES:
        torch.manual_seed(1)
        model = PoolTwice()
        before = _state(model)
        res, rep = _quiet(precondfx.precondition, model, x, capture=capture, lr=None, seed=0)
        assert rep.capture == capture
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
        assert isinstance(model.pool, nn.MaxPool2d) and model.c1.stride == (1, 1)
        assert isinstance(res.pool, nn.Identity), capture
        assert res.c1.stride == (2, 2) and res.c2.stride == (2, 2)
        assert not [w for w, _ in rep.skipped if "maxpool" in w], rep.skipped
        assert sorted(p.action for p in rep.plan.pools) == ["fold", "fold"]
        with torch.no_grad():
            outs[capture] = res(x)
    for capture in ("export", "eager"):
        assert float((outs[capture] - outs["fx"]).abs().max()) < 1e-6


# -- (e) the main output after a ReLU, read by another output ---------------------------------
class HiddenAndHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return h, self.head(h)


def test_a_main_output_read_by_another_output_is_scaled_where_it_is_computed_everywhere():
    """The main output (the first floating-point output) is ``relu(b(.))``, which the head
    reads.  Before, fx scaled it where it is computed (the head saw the scale: its output std
    2.295) and eager and export on the returned value only (1.331).  Now eager and export put
    the scale on ``b`` (exact through the ReLU, checked by running): all three agree to 1e-6
    and say the second output is computed from the scaled value."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    outs = {}
    for capture in CAPTURES:
        torch.manual_seed(1)
        res, rep = _quiet(precondfx.precondition, HiddenAndHead(), x, capture=capture,
                          lr=None, balance="none", seed=0)
        assert rep.capture == capture
        assert "output[1] is computed from" in str(rep), capture
        with torch.no_grad():
            outs[capture] = res(x)
        assert abs(float(outs[capture][0].std()) - 1.0) < 0.02
    for capture in ("export", "eager"):
        for i in (0, 1):
            assert float((outs[capture][i] - outs["fx"][i]).abs().max()) < 1e-6, (capture, i)


# -- (b) ``x @ self.weight.t() + self.bias`` on a layer's own parameters ----------------------
class MyMatT(MyLinear):
    """The same layer as :class:`MyLinear`, written as a matrix product with the transpose."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias


class MyMatTranspose(MyLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight.transpose(0, 1)) + self.bias


def _net(layer: type) -> nn.Module:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = layer(8, 64), layer(64, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))
    return Net()


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("layer", [MyMatT, MyMatTranspose])
def test_a_product_with_a_weights_transpose_is_the_linear_layer_it_is(capture, layer):
    """``x @ self.weight.t()`` with ``weight`` stored (out, in) is ``F.linear``.  Before, no
    capture saw a weighted layer (the transpose node read the parameter, the product read an
    activation): precondition refused 'the model has no weighted layer'.  Now the product is
    a weighted matmul with the Linear's fans: re-drawn weights, alphas, output scale and
    result equal to the F.linear model's (difference 0, default options), and it folds."""
    _same_as_linear(capture, layer)


def _same_as_linear(capture: str, layer: type) -> None:
    """``_net(layer)`` preconditioned equals ``_net(MyLinear)``'s result: the same re-drawn
    weights (difference 0), outputs to 1e-6, and it folds to 1e-5."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    got = {}
    for cls in (MyLinear, layer):
        torch.manual_seed(1)
        res, rep = _quiet(precondfx.precondition, _net(cls), x, capture=capture, seed=0)
        assert rep.capture == capture
        with torch.no_grad():
            got[cls] = (res(x), res.a.weight.detach().clone(), res.b.weight.detach().clone(),
                        res)
    weighted = [n for n in rep.nodes if n.status == "weighted"]
    assert [n.kind for n in weighted] == ["matmul", "matmul"]
    inits = rep.plan.inits
    assert inits["a.weight"].rule == "geometric" and inits["b.weight"].rule == "geometric"
    ref, mine = got[MyLinear], got[layer]
    assert float((mine[1] - ref[1]).abs().max()) == 0.0
    assert float((mine[2] - ref[2]).abs().max()) == 0.0
    assert float((mine[0] - ref[0]).abs().max()) < 1e-6
    with torch.no_grad():
        plain = precondfx.fold(mine[3])
        assert float((plain(x) - mine[0]).abs().max()) < 1e-5


# -- probabilities returned beside other outputs of their shape --------------------------------
class ProbsFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(8, 32), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor):
        logits = self.head(torch.relu(self.a(x)))
        return {"probs": logits.softmax(-1), "top": logits.max(-1).values,
                "aux": torch.tanh(logits)}


@pytest.mark.parametrize("capture", CAPTURES)
def test_probabilities_as_the_main_output_are_never_scaled(capture):
    """The main output (the first floating-point output) is a softmax, returned beside a tanh
    of the same shape.  Before, eager and export could not tell which graph output it was
    and multiplied the probabilities by 4.91 (rows summing to 4.91, std 1.0016); fx refused
    the scale.  Now every capture finds the softmax by the output's place and says so."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    torch.manual_seed(1)
    res, rep = _quiet(precondfx.precondition, ProbsFirst(), x, capture=capture, lr=None)
    assert rep.capture == capture
    with torch.no_grad():
        probs = res(x)["probs"]
    assert float((probs.sum(-1) - 1).abs().max()) < 1e-5
    assert float(probs.max()) <= 1.0
    assert any("softmax" in why for _, why in rep.skipped)
