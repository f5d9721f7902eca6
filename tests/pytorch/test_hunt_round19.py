"""Round 19: user code written with the conjugate transposes of a real weight (``W.H``,
``W.mH``, ``torch.adjoint(W)``), which are its transpose, read as the linear layer they are on
every capture."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from tests.pytorch.test_hunt_fx10 import MyLinear, _same_as_linear
from tests.pytorch.test_hunt_user9 import PoolNet

CAPTURES = ("fx", "export", "eager")


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


class ByH(MyLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.H + self.bias


class BymH(MyLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.mH + self.bias


class ByAdjoint(MyLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, torch.adjoint(self.weight)) + self.bias


@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("layer", [ByH, BymH, ByAdjoint])
def test_a_product_with_a_weights_conjugate_transpose_is_the_linear_layer_it_is(capture, layer):
    """Before, ``x @ self.weight.H`` was refused on every capture ('the model has no weighted
    layer': export records ``aten.matrix_H``/``aten.mH``, fx and eager the property, none of
    them a transpose).  Now each is the F.linear model: the same re-drawn weights (difference
    0), the same output to 1e-6, and it folds."""
    _same_as_linear(capture, layer)


def test_inplace_optimizer_built_after_from_names_is_refused_with_both_reasons():
    """``inplace=True``, then an optimizer built *after* the call from parameter names that
    leave the max-pool's replacement out: refused at its first step (the conv would never
    move) as before, but the message said only 'it was built before the call', which is not
    what happened here; it now names both causes and the fix.  The step did not run: every
    weight is where it was."""
    from precondfx.errors import PrecondError
    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    net = PoolNet()
    precondfx.precondition(net, x, lr=None, maxpool="conv", inplace=True)
    names = [n for n, _ in net.named_parameters()]
    assert "features.2.weight" in names
    opt = torch.optim.SGD([p for n, p in net.named_parameters()
                           if n.startswith(("features.0", "head"))], lr=0.1)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    F.cross_entropy(net(x), y).backward()
    with pytest.raises(PrecondError) as e:
        opt.step()
    text = " ".join(str(e.value).split())
    assert "features.2.weight" in text
    assert "built before the call, or from parameter names that leave these out" in text
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())


def test_reattach_of_an_fx_result_refuses_before_changing_anything():
    """A user's own ``PreTrainedModel`` that fx traces gets the fx capture, whose constants
    live in the traced forward.  Its folded checkpoint reloads exactly, but ``reattach``
    registered buffers one by one and then failed on the first traced one with 'records an
    unknown constant precondfx_alpha_fc', leaving the loaded model half changed.  Now it
    refuses first, says why and what to do, and the loaded model is untouched (no buffer
    added, the same output)."""
    import tempfile
    pytest.importorskip("transformers")
    from transformers import PretrainedConfig, PreTrainedModel

    from precondfx.errors import PrecondError
    from precondfx.integrations.hf import reattach

    class Cfg(PretrainedConfig):
        model_type = "pfx_round19_probe"

    class Net(PreTrainedModel):
        config_class = Cfg

        def __init__(self, config: Cfg) -> None:
            super().__init__(config)
            self.fc, self.head = nn.Linear(8, 32), nn.Linear(32, 4)
            self.post_init()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.fc(x)))

    torch.manual_seed(0)
    x = 5 * torch.randn(64, 8)
    res, rep = _quiet(precondfx.precondition, Net(Cfg()), x, lr=None, seed=0)
    assert rep.capture == "fx" and res.config.precondfx["capture"] == "fx"
    with tempfile.TemporaryDirectory() as d:
        _quiet(res.save_pretrained, d)
        back = _quiet(Net.from_pretrained, d).eval()
    with torch.no_grad():
        want = res.eval()(x)
        assert float((back(x) - want).abs().max()) < 1e-5        # the folded checkpoint
    with pytest.raises(PrecondError, match="capture='eager'"):
        reattach(back)
    assert [n for n, _ in back.named_buffers()] == []
    with torch.no_grad():
        assert float((back(x) - want).abs().max()) < 1e-5


# -- a weight with a fixed gain in the forward (equalized learning rate) -----------------------
class EqualLinear(nn.Module):
    """StyleGAN's equalized-learning-rate layer: unit-scale storage, the He constant and a
    learning-rate multiplier applied in the forward."""

    def __init__(self, i: int, o: int, lr_mul: float = 1.0, gain: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i) / lr_mul)
        self.bias = nn.Parameter(torch.zeros(o))
        self.scale = (1 / i ** 0.5) * lr_mul if gain else 1.0
        self.lr_mul = lr_mul if gain else 1.0
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gain:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight * self.scale, bias=self.bias * self.lr_mul)


class EqualConv(nn.Module):
    def __init__(self, i: int, o: int, gain: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i, 3, 3))
        self.scale = 1 / (i * 9) ** 0.5 if gain else 1.0
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight / (1 / self.scale) if self.gain else self.weight
        return F.conv2d(x, w, padding=1)


def _styled(gain: bool) -> nn.Module:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = EqualConv(3, 8, gain)
            self.fc = EqualLinear(8 * 6 * 6, 32, lr_mul=0.01, gain=gain)
            self.out = EqualLinear(32, 5, gain=gain)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.conv(x)).flatten(1)
            return self.out(torch.relu(self.fc(h)))
    return Net()


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_weight_with_a_fixed_gain_is_the_layer_it_is(capture):
    """``F.linear(x, self.weight * self.scale, bias=self.bias * self.lr_mul)`` and
    ``F.conv2d(x, self.weight / c)``: before, every such layer was 'breaks' on every capture
    (the product of a parameter and a number read as an activation), so none was re-drawn
    and the pass scaled around them.  Now each is the weighted layer it is, its weight drawn
    at the rule's std divided by the gain: the effective weights (weight x gain) equal the
    same model's without the gains to 1e-6, the outputs agree, the output std is 1, and the
    result folds (analytic alphas: the same on both models).  Measured balancing (the
    default) leaves these layers out, saying why: the gain sets their rate against the other
    layers' by design (StyleGAN's lr_mul=0.01 on the mapping network), which rescaling alphas
    to balance the stored weights' curvature would undo."""
    torch.manual_seed(0)
    x = torch.randn(32, 3, 6, 6)
    res = {}
    for gain in (False, True):
        torch.manual_seed(1)
        res[gain] = _quiet(precondfx.precondition, _styled(gain), x, capture=capture, seed=0,
                           balance="analytic")
    (plain, rep_p), (styled, rep) = res[False], res[True]
    assert rep.capture == capture
    assert len([n for n in rep.nodes if n.status == "weighted"]) == 3
    assert not [n for n in rep.nodes if n.status == "breaks"]
    for layer in ("conv", "fc", "out"):
        got = getattr(styled, layer).weight.detach() * getattr(styled, layer).scale
        want = getattr(plain, layer).weight.detach()
        assert float((got - want).abs().max()) < 1e-6 * float(want.abs().max()), layer
    assert rep.plan.inits["fc.weight"].std == pytest.approx(
        rep_p.plan.inits["fc.weight"].std / (0.01 / 288 ** 0.5), rel=1e-9)
    with torch.no_grad():
        y = styled(x)
        assert float((y - plain(x)).abs().max()) < 1e-5
        assert float(y.std()) == pytest.approx(1.0, abs=0.03)
        folded = precondfx.fold(styled)
        assert float((folded(x) - y).abs().max()) < 1e-5
    torch.manual_seed(1)
    auto, rep_a = _quiet(precondfx.precondition, _styled(True), x, capture=capture, seed=0)
    left = rep_a.conditioning["hessian"]["left_out"]
    assert sorted(left) == ["conv.weight", "fc.weight", "out.weight"]
    assert all("fixed gain" in why for why in left.values())
    with torch.no_grad():
        assert float(auto(x).std()) == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_mask_found_by_its_uses_leaves_the_input_scales_rms(capture):
    """``input_scale='auto'`` sets E[(s x)^2] = 1/sqrt(n_in k^2) of the first layer from the
    floating-point inputs.  A mask named for what it is (``attention_mask``) was left out of
    that mean; a mask found by its uses (``h.masked_fill(m < 0.5, 0)``, argument ``m``) was
    not: its 0/1 entries pulled the scale (0.153 where x alone gives 0.145).  Now the scale is
    the one of x alone, on every capture."""
    from tests.pytorch.test_hunt_masks11 import _data, _LtMask
    x, m = _data()
    torch.manual_seed(0)
    _, rep = _quiet(precondfx.precondition, _LtMask(), (x, m), capture=capture,
                    input_scale="auto", lr=None)
    got = [s.value for s in rep.plan.scales if s.tag == "input"]
    want = ((1 / 8 ** 0.5) / float(x.double().pow(2).mean())) ** 0.5
    assert got and got[0] == pytest.approx(want, rel=1e-5)


def test_a_method_running_a_module_another_method_returns_is_named():
    """``for layer in reversed(self.get_layers()): z = layer.inverse(z)``: the method runs the
    couplings that ``get_layers`` returns, outside the rewritten forward (fx), so it computes
    without the residual scales only forward applies: decode(result(x)) is far from x.  Before,
    the warning named ``inverse`` and ``sample`` but not ``decode``; now it names it too."""
    from tests.pytorch.test_hunt_models8 import RealNVP, _precondition_caught

    class Flow(RealNVP):
        def get_layers(self):
            return self.layers

        def decode(self, z):
            for layer in reversed(self.get_layers()):
                z = layer.inverse(z)
            return z

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    res, rep, said = _precondition_caught(Flow(), x, capture="fx")
    with torch.no_grad():
        assert float((res.decode(res(x)) - x).abs().max()) > 1e-2
    assert len(said) == 1 and "Flow.decode" in said[0] and ".inverse" in said[0], said
    assert ".get_layers" not in said[0]
