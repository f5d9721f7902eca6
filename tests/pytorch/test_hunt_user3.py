"""The result is the user's model, used the way user code uses it (hunt ``user3``)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from tests.user_models import SmallCNN as _SmallCNN


def test_torch_jit_script_of_the_fx_result_computes_and_trains_it() -> None:
    """docs/troubleshooting.md tells users to ``torch.jit.script`` the result; the fx result's
    constants-on-weights calls (``weight_side.layer``, which takes a module) made TorchScript
    fail ("undefined value precondfx_pytorch_apply_weight_side_layer")."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16)
    pm, rep = precondfx.precondition(_SmallCNN(), x)
    assert rep.capture == "fx" and isinstance(pm, _SmallCNN)
    scripted = torch.jit.script(pm)
    x2 = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        ref = pm(x2)
        out = scripted(x2)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6), float((out - ref).abs().max())
    # the scripted module trains the result's own parameters (shared, as scripting a module
    # shares them), and the result keeps its fast form afterwards
    n = sum(p.numel() for p in pm.parameters())
    assert sum(p.numel() for p in scripted.parameters()) == n
    scripted(x2).square().mean().backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in pm.parameters())
    assert isinstance(pm, _SmallCNN) and "weight_side_layer" in pm.code


class _Decoder(nn.Module):
    """A method that computes logits from the head's parameters without calling the head (as
    code that shares a head between a forward and a sampling loop does)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 32)
        self.mid = nn.Linear(32, 32)
        self.out = nn.Linear(32, 40)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return F.relu(self.mid(self.emb(ids)))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.out.weight, self.out.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(ids))


@pytest.mark.parametrize("capture", ["fx", "eager"])
def test_a_method_reading_a_weight_outside_its_module_call_is_said(capture: str) -> None:
    """``logits`` reads ``self.out.weight`` directly: the constants at ``out`` (its alpha, rate
    and output scale, applied by a call of ``out``) are not in it, so ``logits(hidden(ids))``
    differs from ``forward(ids)`` (by about 100% here).  It was silent: ``forward_only`` empty
    and the report's result line said every method computes with the constants."""
    torch.manual_seed(0)
    ids = torch.randint(0, 40, (16, 5))
    pm, rep = precondfx.precondition(_Decoder(), ids, capture=capture)
    with torch.no_grad():
        gap = float((pm.logits(pm.hidden(ids)) - pm(ids)).abs().max() / pm(ids).abs().max())
    assert gap > 0.1          # the method does compute without the constants
    said = [s for s in rep.result["forward_only"] if s.startswith("method logits")]
    assert len(said) == 1 and "self.out.weight and self.out.bias" in said[0], rep.result
    assert not any("hidden" in s for s in rep.result["forward_only"])
    assert "every method computes with the constants" not in rep.result_line()
    assert "method logits reads self.out.weight" in rep.result_line()


class _Tempered(nn.Module):
    """A classifier whose forward reads plain attributes the user sets later (a temperature
    for calibration, a flag for probabilities at inference)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 32)
        self.fc2 = nn.Linear(32, 5)
        self.temperature = 1.0
        self.return_logits = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(F.relu(self.fc1(x))) / self.temperature
        if not self.return_logits:
            out = out.softmax(-1)
        return out


def test_an_attribute_the_traced_forward_read_cannot_change_silently() -> None:
    """The fx result runs the graph traced with ``temperature=1.0`` and the logits branch: set
    afterwards to 0.5 (or to probabilities), the user's forward computes 2x the logits (or a
    softmax) and the result computed the same as before, silently.  Now it refuses, naming the
    attribute; set back, it runs again; the hook back end keeps reading it."""
    torch.manual_seed(0)
    pm, rep = precondfx.precondition(_Tempered(), torch.randn(32, 10))
    assert rep.capture == "fx" and isinstance(pm, torch.fx.GraphModule)
    x = torch.randn(4, 10)
    with torch.no_grad():
        before = pm(x)
        pm.temperature = 0.5
        with pytest.raises(precondfx.errors.PrecondError, match="temperature is 0.5"):
            pm(x)
        pm.temperature = 1.0
        assert torch.equal(pm(x), before)
        pm.return_logits = False
        with pytest.raises(precondfx.errors.PrecondError, match="return_logits"):
            pm(x)
    # a copy carries the values the graph holds; training does not touch them
    pm.return_logits = True
    cp = copy.deepcopy(pm)
    cp.temperature = 2.0
    with pytest.raises(precondfx.errors.PrecondError, match="temperature"):
        cp(x)
    pm(x).square().mean().backward()
    torch.manual_seed(0)
    pe, rep_e = precondfx.precondition(_Tempered(), torch.randn(32, 10), capture="export")
    with torch.no_grad():
        a = pe(x)
        pe.temperature = 0.5
        assert torch.allclose(pe(x), 2 * a, rtol=1e-5, atol=1e-6)


_PROPERTY_READS = [0]


class _ClassScaled(nn.Module):
    cls_scale = 1.0          # a class attribute the user may set on the class

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 32)
        self.fc2 = nn.Linear(32, 4)

    @property
    def rank(self) -> int:   # a property (Lightning's global_rank): read by forward only
        _PROPERTY_READS[0] += 1
        return 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        if self.rank == 0:
            h = h * self.cls_scale
        return self.fc2(h)


def test_a_class_attribute_is_checked_and_a_property_never_evaluated_by_the_check() -> None:
    torch.manual_seed(0)
    pm, rep = precondfx.precondition(_ClassScaled(), torch.randn(32, 10))
    assert rep.capture == "fx"
    x = torch.randn(3, 10)
    n = _PROPERTY_READS[0]
    for _ in range(3):
        pm(x)
    assert _PROPERTY_READS[0] == n       # the graph holds the value; the check reads no property
    try:
        _ClassScaled.cls_scale = 2.0
        with pytest.raises(precondfx.errors.PrecondError, match="cls_scale is 2.0"):
            pm(x)
    finally:
        _ClassScaled.cls_scale = 1.0
    pm(x)


@dataclasses.dataclass
class _Cfg:
    hidden: int = 32
    return_dict: bool = True


class _Configured(nn.Module):
    def __init__(self, cfg: _Cfg) -> None:
        super().__init__()
        self.config = cfg
        self.fc1 = nn.Linear(10, cfg.hidden)
        self.fc2 = nn.Linear(cfg.hidden, 4)

    def forward(self, x: torch.Tensor):
        out = self.fc2(F.relu(self.fc1(x)))
        if self.config.return_dict:
            return {"logits": out}
        return (out,)


def test_a_config_field_the_traced_forward_read_cannot_change_silently() -> None:
    """``model.config.return_dict = False`` afterwards: the user's forward returns a tuple, the
    fx result kept returning the dict of the trace."""
    torch.manual_seed(0)
    pm, rep = precondfx.precondition(_Configured(_Cfg()), torch.randn(32, 10))
    assert rep.capture == "fx"
    x = torch.randn(3, 10)
    assert isinstance(pm(x), dict)
    pm.config.return_dict = False
    with pytest.raises(precondfx.errors.PrecondError, match="config.return_dict is False"):
        pm(x)
