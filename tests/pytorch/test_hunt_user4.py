"""The result is the user's model, used the way user code uses it (hunt ``user4``)."""
from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import precondfx
from tests.user_models import SmallCNN as _SmallCNN, AutoEncoder
from precondfx.errors import PrecondError


class _Routed(nn.Module):
    """Forward reads a list (which blocks get dropout), a dict config and a dataclass config."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.gate = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.dropout_layers_to_use = [0, 2]
        self.cfg = {"use_gate": True, "scale": 1.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = F.relu(block(x))
            if i in self.dropout_layers_to_use:
                x = 0.5 * x
        if self.cfg["use_gate"]:
            x = x * torch.sigmoid(self.gate(x))
        return self.head(x) * self.cfg["scale"]


@pytest.mark.parametrize("change", ["append", "assign", "dict_item"])
def test_a_container_the_traced_forward_read_cannot_change_silently(change: str) -> None:
    """A list or dict attribute read by the traced forward and changed afterwards (in place or
    reassigned): the fx result kept computing with the traced value (relative output change 0,
    the user's forward would change), silently; now refused like a plain attribute."""
    torch.manual_seed(0)
    pm, rep = precondfx.precondition(_Routed(), torch.randn(32, 16))
    assert rep.capture == "fx"
    x = torch.randn(4, 16)
    pm(x)
    if change == "append":
        pm.dropout_layers_to_use.append(1)
        want = r"dropout_layers_to_use is \[0, 2, 1\]"
    elif change == "assign":
        pm.dropout_layers_to_use = [0]
        want = r"dropout_layers_to_use is \[0\]"
    else:
        pm.cfg["use_gate"] = False
        want = "cfg is .*'use_gate': False"
    with pytest.raises(PrecondError, match=want):
        pm(x)


def test_an_unchanged_container_is_no_refusal_and_copies_keep_the_check() -> None:
    torch.manual_seed(0)
    pm, _ = precondfx.precondition(_Routed(), torch.randn(32, 16))
    x = torch.randn(4, 16)
    y = pm(x)
    pm.dropout_layers_to_use = [0, 2]           # a new list, the same value
    pm.cfg = dict(pm.cfg)
    assert torch.equal(pm(x), y)
    cp = copy.deepcopy(pm)
    cp.cfg["scale"] = 3.0
    with pytest.raises(PrecondError, match="cfg is"):
        cp(x)
    assert torch.equal(pm(x), y)                # the original's own dict is untouched


@dataclasses.dataclass
class _Cfg:
    act: str = "relu"
    layers: tuple = (0, 1)


class _WithDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = _Cfg()
        self.fc1 = nn.Linear(10, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        h = self.fc1(x)
        h = F.relu(h) if cfg.act == "relu" else torch.tanh(h)
        return self.fc2(h)


def test_a_dataclass_config_read_through_a_local_name_is_checked() -> None:
    """``cfg = self.cfg; cfg.act``: the trace read the whole dataclass, not a field of it."""
    torch.manual_seed(0)
    pm, rep = precondfx.precondition(_WithDataclass(), torch.randn(32, 10))
    assert rep.capture == "fx"
    x = torch.randn(3, 10)
    pm(x)
    pm.cfg.act = "tanh"
    with pytest.raises(PrecondError, match="cfg is _Cfg\\(act='tanh'"):
        pm(x)


def test_the_plain_graphmodule_result_scripts_copies_and_pickles() -> None:
    """A GraphModule given (``fx.symbolic_trace(model)``) cannot be combined with itself: the
    result was torch.fx's plain GraphModule, which ``torch.jit.script`` refused (the
    constants-on-weights call takes a module) where the user-class result scripts."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    pm, rep = precondfx.precondition(fx.symbolic_trace(_SmallCNN()), x)
    assert isinstance(pm, fx.GraphModule)
    y = pm(x)
    scripted = torch.jit.script(pm)
    assert torch.allclose(scripted(x), y, rtol=1e-5, atol=1e-6)
    buf = io.BytesIO()
    torch.save(pm, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert torch.equal(back(x), y)
    assert torch.allclose(torch.jit.script(back)(x), y, rtol=1e-5, atol=1e-6)
    assert torch.equal(copy.deepcopy(pm)(x), y)


class _Sealed(_SmallCNN):
    """A class that refuses subclasses: the result falls back to a GraphModule."""

    def __init_subclass__(cls, **kw: object) -> None:
        raise TypeError("_Sealed cannot be subclassed")


def test_the_fallback_result_of_a_sealed_class_scripts() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    with pytest.warns(RuntimeWarning, match="not your class _Sealed"):
        pm, rep = precondfx.precondition(_Sealed(), x)
    assert rep.result["is_user_class"] is False
    assert torch.allclose(torch.jit.script(pm)(x), pm(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("capture", ["fx", "eager"])
def test_loading_the_checkpoint_saved_before_precondition_is_refused(capture: str) -> None:
    """``result.load_state_dict(original_state, strict=False)``: the user's weights at the user's
    scale times the constants that stayed (relative output change 0.27 fx, 0.49 eager from
    the model the checkpoint was saved from), silently; strict=True raised torch's bare
    missing-keys error.  Now a PrecondError saying what to do; the result's own state dict
    still loads."""
    torch.manual_seed(0)
    model = _SmallCNN()
    original = copy.deepcopy(model.state_dict())
    pm, rep = precondfx.precondition(model, torch.randn(8, 3, 16, 16), capture=capture)
    assert rep.capture == capture
    x = torch.randn(4, 3, 16, 16)
    y = pm(x)
    for strict in (True, False):
        with pytest.raises(PrecondError, match="saved before precondition"):
            pm.load_state_dict(original, strict=strict)
        assert torch.equal(pm(x), y)            # nothing was loaded
    mine = copy.deepcopy(pm.state_dict())
    with torch.no_grad():
        for p in pm.parameters():
            p.add_(1.0)
    pm.load_state_dict(mine)
    assert torch.equal(pm(x), y)
    plain = _SmallCNN()                         # the original model takes its own checkpoint
    plain.load_state_dict(original)
    wrapped = nn.Sequential(pm)                 # the result inside a model of the user's
    with pytest.raises(PrecondError, match="saved before precondition"):
        wrapped.load_state_dict({f"0.{k}": v for k, v in original.items()}, strict=False)


class _Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tower = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(32, 2)

    def embed(self, a: torch.Tensor) -> torch.Tensor:
        return self.tower(a)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.tower(a), self.tower(b)], -1))


def test_a_method_calling_a_module_forward_calls_twice_gets_its_constants() -> None:
    """A shared tower (forward calls it on both inputs): the fx result's ``embed`` (a method
    delegating to the tower) ran without the tower's alphas, which the graph applies at each
    of its two calls (relative change 8.5% from the folded model; export and eager exact)."""
    torch.manual_seed(0)
    a, b = torch.randn(32, 20), torch.randn(32, 20)
    pm, rep = precondfx.precondition(_Siamese(), (a, b), balance="hessian")
    assert rep.capture == "fx"
    assert rep.result["forward_only"] == []
    alphas = [float(v) for k, v in pm.named_buffers() if "alpha_tower" in k]
    assert max(abs(v - 1) for v in alphas) > 0.01      # constants the method must apply
    ref = precondfx.fold(pm)
    assert torch.allclose(pm(a, b), ref(a, b), rtol=1e-5, atol=1e-6)
    assert torch.allclose(pm.embed(a), ref.embed(a), rtol=1e-5, atol=1e-6)


class _LeafForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 32)
        self.fc1 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 30, bias=False)
        self.head.weight = self.emb.weight          # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.fc1(self.emb(ids))))

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.forward(F.relu(self.fc1(self.emb(ids))))


@pytest.mark.parametrize("capture", ["fx", "eager"])
def test_a_method_calling_a_layers_forward_directly_is_reported(capture: str) -> None:
    """``self.head.forward(h)`` runs no hook, so the method computed without the head's
    constants (relative change 1.0-1.4 from the folded model), and the report did not say so;
    ``__init__``'s tie ``self.out.weight = self.emb.weight`` was reported as a method computing
    without constants."""
    torch.manual_seed(0)
    ids = torch.randint(0, 30, (8, 6))
    pm, rep = precondfx.precondition(_LeafForward(), ids, capture=capture, balance="hessian")
    lines = [ln for ln in rep.result["forward_only"] if ln.startswith("method")]
    assert lines and all("method logits calls self.head.forward" in ln for ln in lines)
    assert not any("__init__" in ln for ln in rep.result["forward_only"])


def test_a_method_returning_a_modules_output_leaves_the_next_layers_alpha_out() -> None:
    """The decoder's first alpha (on its input) was mirrored on the encoder's output, so
    ``encode`` returned the code times that alpha (relative change 1.6% from the folded
    model's ``encode``, also through AveragedModel and torch.compile)."""
    torch.manual_seed(0)
    x = torch.randn(32, 20)
    pm, rep = precondfx.precondition(AutoEncoder(), x, balance="hessian")
    assert rep.capture == "fx"
    assert abs(float(pm.get_buffer("precondfx_alpha_decoder_0")) - 1) > 0.005
    ref = precondfx.fold(pm)
    assert torch.allclose(pm.encode(x), ref.encode(x), rtol=1e-5, atol=1e-6)
    assert torch.allclose(pm(x), ref(x), rtol=1e-5, atol=1e-6)


class _Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 3)
        self._temp = 2.0

    @property
    def temperature(self) -> float:
        return self._temp

    @temperature.setter
    def temperature(self, v: float) -> None:
        self._temp = v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x))) / self.temperature


def test_an_attribute_read_through_a_property_is_checked() -> None:
    """``model.temperature = 1.0`` through a property's setter: the fx result kept dividing by
    the traced 2.0 (relative output change 0 where the user's forward doubles), silently."""
    torch.manual_seed(0)
    pm, rep = precondfx.precondition(_Tempered(), torch.randn(32, 20))
    assert rep.capture == "fx"
    x = torch.randn(3, 20)
    pm(x)
    pm.temperature = 1.0
    with pytest.raises(PrecondError, match="_temp is 1.0"):
        pm(x)
    pm.temperature = 2.0
    pm(x)


def test_a_checkpoint_of_a_result_captured_otherwise_is_refused_saying_so() -> None:
    torch.manual_seed(0)
    sample = torch.randn(8, 3, 16, 16)
    fx_res, _ = precondfx.precondition(_SmallCNN(), sample, capture="fx")
    eager_res, _ = precondfx.precondition(_SmallCNN(), sample, capture="eager")
    with pytest.raises(PrecondError, match="named otherwise"):
        eager_res.load_state_dict(fx_res.state_dict(), strict=False)
