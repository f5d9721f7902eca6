"""fold and the capture paths' consistency (helper fold4): the same model preconditioned through
fx, torch.export and the eager tracer gets the same constants, and fold either folds them into
a plain model of the user's class computing the same function or says what to do."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from precondfx.errors import PrecondError


class _GeluMLP(nn.Module):
    """A block of the user's whose forward ends in a functional op (no module to hook)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class _Res(nn.Module):
    """Two residual joins: a branch ending in an ``nn.GELU`` module and one ending in a block
    whose forward ends in ``F.gelu``."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.fc = nn.Linear(d, d)
        self.act = nn.GELU()
        self.mlp = _GeluMLP(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        x = x + self.act(self.fc(x))
        x = x + self.mlp(x)
        return self.head(x)


def _pre(model: nn.Module, x: torch.Tensor, capture: str, **kw):
    return precondfx.precondition(model, x, capture=capture, lr=None, seed=0, **kw)


def test_eager_residual_scale_on_block_ending_in_functional_op() -> None:
    """``x + self.mlp(x)`` with ``mlp.forward`` ending in ``F.gelu``: fx scales the branch;
    the eager tracer skipped it ("produced by a functional op with no module to hook"), so the
    two results computed different functions (max abs diff 0.37 before). Now the block's own
    output carries the scale: no skip, the same function as fx's."""
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    base = _Res()
    rfx, _ = _pre(base, x, "fx")
    reg, rep = _pre(base, x, "eager")
    assert [w for w, _ in rep.skipped if "residual" in w] == []
    assert float(reg.mlp.precondfx_out_scale) == pytest.approx(1 / math.sqrt(2), rel=1e-6)
    with torch.no_grad():
        a, b = rfx(x), reg(x)
    assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()


def test_eager_block_called_twice_still_reported() -> None:
    """A block called twice cannot carry two call sites' scales on one hook: reported, never
    placed on a wrong call."""

    class Twice(_Res):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.inp(x)
            x = x + self.mlp(x)
            x = x + self.mlp(x)
            return self.head(x)
    torch.manual_seed(0)
    _, rep = _pre(Twice(), torch.randn(16, 8), "eager")
    assert len([w for w, _ in rep.skipped if "residual" in w]) == 2


@pytest.mark.parametrize("capture", ["fx", "eager"])
def test_fold_refusal_says_what_to_do_and_remedy_folds(capture: str) -> None:
    """A residual scale after a GELU folds into no weight: both back ends refuse, and the fx
    message now names the option that leaves it out (it said only "no module of your class
    can absorb exactly" before); with that option fold gives the same function."""
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    r, _ = _pre(_Res(), x, capture)
    with pytest.raises(PrecondError, match="residual='none'"):
        precondfx.fold(r)
    r2, _ = _pre(_Res(), x, capture, residual="none")
    f = precondfx.fold(r2)
    assert type(f) is _Res and not [n for n, _ in f.named_buffers() if "precondfx" in n]
    with torch.no_grad():
        a, b = r2(x), f(x)
    assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()


class _TupleBlock(nn.Module):
    """A block returning ``(input, value)``: its output hook would scale the input."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, F.gelu(self.fc(x))


class _ResTuple(_Res):
    def __init__(self, d: int = 16) -> None:
        super().__init__(d)
        self.tb = _TupleBlock(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        x = x + self.mlp(x)
        _, h = self.tb(x)
        return self.head(x + h)


def test_export_residual_scale_on_block_ending_in_functional_op() -> None:
    """The same under torch.export's capture (its result is applied by hooks as the eager
    tracer's): the block ``mlp`` carries the scale (skipped before); a block returning a
    tuple whose second item is the branch keeps the skip (reported), never scaling the wrong
    item; export's and the eager tracer's results compute the same function."""
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    base = _ResTuple()
    rex, rep = _pre(base, x, "export")
    skipped = [w for w, _ in rep.skipped if "residual" in w]
    assert len(skipped) == 1, rep.skipped
    assert float(rex.mlp.precondfx_out_scale) == pytest.approx(1 / math.sqrt(2), rel=1e-6)
    assert "precondfx_out_scale" not in rex.tb._buffers
    reg, rep_e = _pre(base, x, "eager")
    assert len([w for w, _ in rep_e.skipped if "residual" in w]) == 1
    with torch.no_grad():
        a, b = reg(x), rex(x)
    assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()
