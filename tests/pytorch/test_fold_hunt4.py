"""fold and the capture paths' consistency (helper fold4): the same model preconditioned through
fx, torch.export and the eager tracer gets the same constants, and fold either folds them into
a plain model of the user's class computing the same function or says what to do.  (A residual
scale on a block ending in a functional op stays skipped and reported on the eager and export
captures: placed on the block's output, it kept Mixtral's, Qwen2-MoE's and wav2vec2's
checkpoints from folding.)"""
from __future__ import annotations

import math
from typing import Any

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


class _TiedTemp(nn.Module):
    """A tied LM head reading ``ln(h) * self.temp`` (a learned temperature)."""

    def __init__(self, vocab: int = 20, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.temp = nn.Parameter(torch.tensor(2.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + torch.relu(self.fc(h))
        return self.head(self.scaled(self.ln(h)))

    def scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.temp


class _TiedOverTemp(_TiedTemp):
    def scaled(self, h: torch.Tensor) -> torch.Tensor:
        return self.temp / h        # not linear in h: the difference may not pass


def _train_fold_compare(r: nn.Module, make: Any, x: torch.Tensor) -> float:
    opt = torch.optim.SGD(r.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        r(x).pow(2).mean().backward()
        opt.step()
    f = precondfx.fold(r)
    fresh = make()
    fresh.load_state_dict(f.state_dict())
    with torch.no_grad():
        a, b = r(x), fresh(x)
    return ((a - b).abs().max() / a.abs().max()).item()


@pytest.mark.parametrize("capture", ["fx", "eager", "export"])
def test_fold_tied_head_after_learned_temperature(capture: str) -> None:
    """The tied embedding and head need different factors; the difference passes to ``ln``
    through the product by the parameter ``temp``.  fx's rule walked through a product by a
    parameter, the hooks' back end's only through one by a Python number: eager and export
    refused ("a tied weight whose users need different scales (emb x1.26441, head
    x0.117423)") where fx folded.  One rule now: all three fold, trained, to float rounding,
    into a state_dict your class loads."""
    torch.manual_seed(0)
    ids = torch.randint(0, 20, (4, 10))
    r, _ = _pre(_TiedTemp(), ids, capture)
    assert _train_fold_compare(r, _TiedTemp, ids) < 1e-5


@pytest.mark.parametrize("capture", ["fx", "eager", "export"])
def test_fold_tied_head_after_factor_over_activation_never_wrong(capture: str) -> None:
    """``temp / h`` is not linear in ``h``: fold refuses (or folds exactly), never folds a
    different function."""
    torch.manual_seed(0)
    ids = torch.randint(0, 20, (4, 10))
    r, _ = _pre(_TiedOverTemp(), ids, capture)
    try:
        d = _train_fold_compare(r, _TiedOverTemp, ids)
    except PrecondError as e:
        assert "tied weight" in str(e)
    else:
        assert d < 1e-5


class _LayerScale(nn.Module):
    """A block ending in a layer scale: ``self.fc(x) * self.gamma``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gamma = nn.Parameter(torch.full((d,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.gamma


class _ResLS(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.b1, self.b2 = _LayerScale(d), _LayerScale(d)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        x = x + self.b1(x)
        x = x + self.b2(x)
        return self.head(x)


@pytest.mark.parametrize("capture", ["eager", "export"])
def test_layer_scale_branch_like_fx_and_folds(capture: str) -> None:
    """``x + self.block(x)`` with the block ending in ``fc(x) * gamma``: fx scales fc's output
    through the product (linear in it) and folds; the hooks' back ends skipped both residual
    scales ("produced by a functional op", a different function from fx's). Now the scale
    passes the product by a fixed factor (the fold rule, core.nodes.fixed_factor_node) to
    ``fc``: fx's function, and it folds after training."""
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    base = _ResLS()
    rfx, _ = _pre(base, x, "fx")
    r, rep = _pre(base, x, capture)
    assert [w for w, _ in rep.skipped if "residual" in w] == []
    assert float(r.b1.fc.precondfx_out_scale) == pytest.approx(1 / math.sqrt(2), rel=1e-6)
    with torch.no_grad():
        a, b = rfx(x), r(x)
    assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()
    assert _train_fold_compare(r, _ResLS, x) < 1e-5


@pytest.mark.parametrize("method", ["eager", "fx"])
def test_fixed_factor_rule_on_captured_quotients(method: str) -> None:
    """The rule's reading of every quotient spelling: ``h / c`` and ``h * c`` are linear in
    ``h``; ``c / h`` (by a number or a parameter, ``torch.div(c, h)``) is not."""
    from precondfx.core.nodes import fixed_factor_node
    from precondfx.pytorch.capture import ladder
    from precondfx.pytorch.capture.common import Sample

    class Q(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.t = nn.Parameter(torch.tensor(2.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return (2.0 / h) + (self.t / h) + (h / self.t) + (h / 2.0) + \
                torch.div(self.t, h) + h * self.t
    graph = ladder.capture(Q(), Sample((torch.randn(3, 4),), {}), (method,)).graph
    got = [fixed_factor_node(n) for n in graph
           if n.kind == "mul" or "div" in n.target.lower()]
    assert got == [False, False, True, True, False, True]
