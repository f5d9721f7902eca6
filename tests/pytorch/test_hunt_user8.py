"""The user's model contract (hunt user8): plain weights loaded into a part of an fx result
(one warning per load; the result's own state dict copied into a new dict loads silently),
deep copies trained one per run (each its own report entry), methods that bypass the
constants (a method calling ``self(x)`` and reading a layer, an installed library's class),
and the training-loop idioms around them."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx


def _quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **k)


def _caught(fn, *a, **k) -> list[str]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fn(*a, **k)
    return [str(w.message) for w in got if "precondfx" in str(w.message)]


class Net(nn.Module):
    """An encoder of three layers and a head: the encoder reloaded from a checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                                 nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.enc(x)))


def _fx_result() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    user = Net()
    # lr_scale='user': the layers' calls carry constants other than 1
    res, rep = _quiet(precondfx.precondition, user, torch.randn(64, 8), lr=None,
                      lr_scale="user", seed=0)
    assert rep.capture == "fx"
    return user, res


def test_plain_weights_into_a_part_warn_once_per_load() -> None:
    """Before: ``res.enc.load_state_dict(user.enc.state_dict())`` warned 3 times (once per
    Linear of the encoder), each naming one layer.  Now once per load, naming the three."""
    user, res = _fx_result()
    said = _caught(res.enc.load_state_dict, user.enc.state_dict())
    assert len(said) == 1, said
    assert "enc.0, enc.2, enc.4 (3 layer(s))" in said[0]
    # a second load is a second warning; a load into one layer names that layer
    said = _caught(res.enc[2].load_state_dict, user.enc[2].state_dict())
    assert len(said) == 1 and "into enc.2 (1 layer(s))" in said[0], said


def test_the_results_own_state_dict_copied_into_a_new_dict_loads_silently() -> None:
    """Before: ``{k: v for k, v in res.enc.state_dict().items()}`` (a new dict: no metadata)
    loaded back warned 3 times that the weights were plain, and said to ignore it.  Now the
    result's own tensors are recognized: no warning, the function unchanged."""
    _, res = _fx_result()
    x = torch.randn(16, 8)
    ref = res(x).detach()
    sd = res.enc.state_dict()
    for copied in (dict(sd), {k: v for k, v in sd.items()}, copy.copy(sd)):
        assert _caught(res.enc.load_state_dict, copied) == []
    assert torch.allclose(res(x), ref)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def _train(model: nn.Module, lr: float, x: torch.Tensor, y: torch.Tensor,
           steps: int = 2) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def test_runs_copied_from_a_template_each_get_their_own_report_entry() -> None:
    """``for lr in (4.0, 0.01): run = copy.deepcopy(template)``.  Before: every run wrote
    into the one report: ``conditioning['lr_target']`` ended as the latest run's section
    (0.01, factor 1), the 4.0 run's went nowhere, and the 4.0 run's factor 0.3267 went into
    the template's ``report.plan`` and ``report.measured`` (6 changes) though the template's
    storage was untouched.  Now each run's section is its entry of ``lr_target_copies`` (in
    the order of their first steps), ``lr_target`` is the first run's until the template
    itself steps, and the template's plan records only the template's own step."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 20), torch.randint(0, 10, (64,))
    template, rep = _quiet(precondfx.precondition, _mlp(), x, seed=0)
    for lr in (4.0, 0.01):
        run = copy.deepcopy(template)
        ema = copy.deepcopy(run)        # an EMA follows its run, in the run's entry
        _quiet(_train, run, lr, x, y)
        for a, b in zip(run.buffers(), ema.buffers()):
            assert torch.equal(a, b)
    copies = rep.conditioning["lr_target_copies"]
    assert [c["lr"] for c in copies] == [4.0, 0.01]
    assert copies[0]["factor"] < 0.5 and copies[1]["factor"] == 1.0
    assert rep.conditioning["lr_target"] is copies[0]
    assert rep.measured.of("lr_target") == []
    assert "copy 2 (its own first step)" in str(rep)
    _quiet(_train, template, 4.0, x, y)        # the template's own step: its own entry
    own = rep.conditioning["lr_target"]
    assert own is not copies[0] and "copy" not in own
    assert own["lr"] == 4.0 and own["factor"] == pytest.approx(copies[0]["factor"], rel=1e-4)
    assert len(rep.measured.of("lr_target")) > 0
    assert len(rep.conditioning["lr_target_copies"]) == 2


# -- (a) methods that bypass the constants ---------------------------------------------------
class TTA(nn.Module):
    """A residual net with a test-time augmentation method that averages ``self(x)`` with the
    layers run by hand on the flipped input, and a ``predict`` through ``self(x)`` alone."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(F.relu(self.a(x)))

    def tta(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.flip(-1)
        return (self(x) + xf + self.b(F.relu(self.a(xf)))) / 2

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).argmax(-1)


class Coupling(nn.Module):
    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask)
        self.s = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))
        self.t = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xm = x * self.mask
        s, t = self.s(xm) * (1 - self.mask), self.t(xm) * (1 - self.mask)
        return xm + (1 - self.mask) * (x * torch.exp(s) + t)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        ym = y * self.mask
        s, t = self.s(ym) * (1 - self.mask), self.t(ym) * (1 - self.mask)
        return ym + (1 - self.mask) * (y - t) * torch.exp(-s)


class Flow(nn.Module):
    """A RealNVP flow whose ``roundtrip`` runs ``self(x)`` and then its own ``inverse``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            Coupling(torch.tensor([i % 2, (i + 1) % 2] * 2).float()) for i in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def inverse(self, z: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            z = layer.inverse(z)
        return z

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.inverse(self(x))


def _said(model: nn.Module, x: torch.Tensor, **kw) -> tuple[nn.Module, object, list[str]]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        res, rep = precondfx.precondition(model, x, seed=0, **kw)
    return res, rep, [str(w.message) for w in got if "run(s) your code" in str(w.message)]


@pytest.mark.parametrize("capture", ["fx", "export", "eager"])
def test_a_method_calling_self_and_the_layers_is_warned(capture: str) -> None:
    """Before: ``tta`` calls ``self(x)``, so it was taken for a method through the rewritten
    graph and never warned about, on every capture; its hand-run half computes without the
    output scale: 1.02-1.38 off the average of two forward calls (output std 0.78).  Now the
    warning names it, saying it calls self(...) too; ``predict`` (self(x) alone) is not named."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    res, rep, said = _said(TTA(), x, capture=capture, lr=None)
    assert rep.capture == capture
    with torch.no_grad():
        want = (res(x) + res(x.flip(-1))) / 2
        assert float((res.tta(x) - want).abs().max()) > 0.2 * float(want.std())
    assert len(said) == 1 and "TTA.tta run(s)" in said[0], said
    assert "tta call(s) self(...) too" in said[0] and "predict" not in said[0]
    assert "target_std=None" in said[0]


def test_a_method_calling_self_and_a_bypassing_method_is_named() -> None:
    """fx: ``roundtrip`` = ``self.inverse(self(x))`` was left out of the warning naming
    ``inverse`` (it calls self(x)); it is 30+ off x.  Now it is named with inverse."""
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    res, rep, said = _said(Flow(), x)
    assert rep.capture == "fx"
    with torch.no_grad():
        assert float((res.roundtrip(x) - x).abs().max()) > 1.0
    assert len(said) == 1 and "Flow.inverse, .roundtrip" in said[0], said
    assert "roundtrip call(s) self(...) too" in said[0]


@pytest.mark.parametrize("capture", ["export", "eager"])
def test_a_submodules_own_inverse_is_warned_on_eager_and_export(capture: str) -> None:
    """eager/export: the output scale rides on the last coupling's call (a hook), which
    ``Coupling.inverse`` never runs: ``roundtrip(x)`` was 30+ off x and nothing was said
    (``forward_only`` empty, no warning: only the root's constants were looked at).  Now a
    warning names Coupling.inverse, the module (layers.3) and the constant, with the remedy;
    with target_std=None there is nothing to say and the roundtrip is exact."""
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    model = Flow()
    res, rep, said = _said(model, x, capture=capture)
    with torch.no_grad():
        assert float((res.roundtrip(x) - x).abs().max()) > 1.0
    assert len(said) == 1 and "Coupling.inverse" in said[0], said
    assert "outside the call of layers.3" in said[0] and "precondfx_output_scale" in said[0]
    assert "target_std=None" in said[0]
    assert any("Coupling.inverse" in s for s in rep.result["forward_only"])
    res2, rep2, said2 = _said(model, x, capture=capture, target_std=None)
    assert said2 == []
    with torch.no_grad():
        assert float((res2.roundtrip(x) - x).abs().max()) < 1e-3


# -- (c) plain weights written into the result -------------------------------------------------
@pytest.mark.parametrize("capture", ["fx", "export", "eager"])
def test_unfold_writes_plain_weights_into_the_result(capture: str) -> None:
    """Pretrained plain weights for the encoder (a checkpoint of your model): before, there
    was no way to write them into the result but fold-then-precondition again; the docs said
    an in-place ``copy_`` is not seen.  ``precondfx.unfold`` divides them by what fold
    multiplies: loaded through the part, the root, or ``copy_`` of one tensor, the result
    computes what your model computes with those weights (to 1e-5; the raw plain weights
    copied in are 1.92x the output's max off it), with no warning."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    res, rep = _quiet(precondfx.precondition, Net(), x, lr=None, lr_scale="user",
                      capture=capture, seed=0)
    assert rep.capture == capture
    torch.manual_seed(1)
    pretrained = Net()
    pre = pretrained.enc.state_dict()
    want = copy.deepcopy(precondfx.fold(res))
    want.enc.load_state_dict(pre)
    with torch.no_grad():
        ref = want(x)
        scale = float(ref.abs().max())
        raw = copy.deepcopy(res)
        for k, v in pre.items():        # copy_ of the raw weights: not seen, off
            raw.enc.get_parameter(k).copy_(v)
        assert float((raw(x) - ref).abs().max()) > 0.1 * scale
        part = copy.deepcopy(res)
        assert _caught(part.enc.load_state_dict, precondfx.unfold(part, pre, prefix="enc.")) \
            == []
        assert torch.allclose(part(x), ref, rtol=1e-5, atol=1e-5 * scale)
        root = copy.deepcopy(res)
        whole = {f"enc.{k}": v for k, v in pre.items()}
        whole.update({k: v for k, v in precondfx.fold(root).state_dict().items()
                      if not k.startswith("enc.")})
        assert _caught(root.load_state_dict, precondfx.unfold(root, whole)) == []
        assert torch.allclose(root(x), ref, rtol=1e-5, atol=1e-5 * scale)
        one = copy.deepcopy(res)
        stored = precondfx.unfold(one, pre, prefix="enc.")
        for k, v in stored.items():
            if "precondfx" not in k:
                one.enc.get_parameter(k).copy_(v)
        assert torch.allclose(one(x), ref, rtol=1e-5, atol=1e-5 * scale)
    with pytest.raises(precondfx.PrecondError, match="nothing of precondfx"):
        precondfx.unfold(Net(), pre)


# -- a parametrization registered on a layer of the result -------------------------------------
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.fc = nn.Linear(20, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.l2(F.relu(self.l1(x)))))


@pytest.mark.parametrize("capture", ["export", "eager"])
def test_weight_norm_registered_on_a_layer_of_the_result(capture: str) -> None:
    """``torch.nn.utils.parametrizations.weight_norm(result.l2)`` after precondition (a
    training recipe that adds weight norm to some layers): torch swaps the layer's class for
    ``ParametrizedLinear``, and the next forward of an export or eager result failed with
    ``KeyError: ParametrizedLinear`` (the weight-side forward looked layers up by exact
    class).  Now the function is unchanged (1e-6), it trains, and the parametrization's
    parameters get gradients."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 20), torch.randint(0, 10, (64,))
    res, rep = _quiet(precondfx.precondition, MLP(), x, capture=capture, lr=None,
                      lr_scale="user", seed=0)
    assert rep.capture == capture
    with torch.no_grad():
        ref = res(x)
    torch.nn.utils.parametrizations.weight_norm(res.l2)
    with torch.no_grad():
        assert torch.allclose(res(x), ref, atol=1e-5)
    opt = torch.optim.SGD(res.parameters(), lr=0.1)
    loss0 = F.cross_entropy(res(x), y)
    loss0.backward()
    g = res.l2.parametrizations.weight.original1.grad
    assert g is not None and float(g.abs().sum()) > 0
    opt.step()
    assert float(F.cross_entropy(res(x), y)) < float(loss0)


# -- parameter groups built by name leave out the parameters precondition added ----------------
class CNN(nn.Module):
    """A max-pool module called twice: fx replaces it by a strided convolution of its own
    (``precondfx_pool_pool``), a trainable layer the user's names do not cover."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.conv2, self.fc = nn.Conv2d(8, 16, 3, padding=1), nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(F.relu(self.bn1(self.conv1(x))))
        h = self.pool(F.relu(self.conv2(h)))
        return self.fc(h.flatten(1))


def test_parameters_added_by_precondition_left_out_of_named_groups_are_said() -> None:
    """Parameter groups by name (body at 0.05, head at 0.2): the replacement convolution
    ``precondfx_pool_pool`` is in no group; before, it got gradients and never moved, and
    nothing said so.  Now the first step warns, naming it, and the report says it; built from
    ``model.parameters()`` nothing is said."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    res, rep = _quiet(precondfx.precondition, CNN(), x, seed=0)
    assert rep.capture == "fx"
    added = [n for n, _ in res.named_parameters() if n.startswith("precondfx_")]
    assert added, [n for n, _ in res.named_parameters()]
    ok = copy.deepcopy(res)
    body = [p for n, p in res.named_parameters() if n.startswith(("conv", "bn"))]
    head = [p for n, p in res.named_parameters() if n.startswith("fc")]
    opt = torch.optim.SGD([{"params": body, "lr": 0.05}, {"params": head, "lr": 0.2}])
    opt.zero_grad()
    F.cross_entropy(res(x), y).backward()
    said = _caught(opt.step)
    assert len(said) == 1 and "precondfx_pool_pool.weight" in said[0], said
    assert "no optimizer's parameter group holds" in said[0]
    assert "precondfx_pool_pool.weight" in rep.conditioning["lr_target"]["unstepped"]
    opt2 = torch.optim.SGD(ok.parameters(), lr=0.05)
    opt2.zero_grad()
    F.cross_entropy(ok(x), y).backward()
    assert not any("no optimizer's parameter group" in s for s in _caught(opt2.step))
