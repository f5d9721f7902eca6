"""Hunt (models9): models a user may bring, and the options.  Each test failed on the code
before its fix (figures in the docstrings)."""
from __future__ import annotations

import math
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from precondfx.errors import PrecondError


def _notes(rep) -> list[str]:
    return list(rep.plan.notes)


# -- (c) output_key with target_std=None --------------------------------------------------------
class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x)
        return {"logits": self.b(torch.relu(h)), "aux": h}


def test_output_key_without_output_scale_is_said():
    """output_key='aux' with target_std=None: no note at all before (the option was read by
    nothing, or only by the measurements, and the report did not say so)."""
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    _, rep = precondfx.precondition(_TwoHeads(), x, output_key="aux", target_std=None,
                                    balance="none", lr=None)
    idle = [n for n in _notes(rep) if n.startswith("output_key='aux' has no effect")]
    assert len(idle) == 1 and "target_std=None" in idle[0]
    # read by measured balancing (the default): said, not called idle
    _, rep = precondfx.precondition(_TwoHeads(), x, output_key="aux", target_std=None)
    said = [n for n in _notes(rep) if n.startswith("output_key='aux'")]
    assert len(said) == 1 and "scales no output" in said[0] and "no effect" not in said[0]
    # with an output scale: nothing to say
    _, rep = precondfx.precondition(_TwoHeads(), x, output_key="aux")
    assert not [n for n in _notes(rep) if n.startswith("output_key=")]
