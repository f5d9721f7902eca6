"""The result is the user's model, used the way user code uses it (hunt ``user4``)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
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
