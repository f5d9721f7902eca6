"""The user's model contract (hunt user6): an optional input left out of a call on the fx
result, properties that call submodules, parameters added in place and an optimizer built
before, and methods whose instance is not named ``self``."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from precondfx.errors import PrecondError


class MaskedMLP(nn.Module):
    """An optional mask, applied where given (the common ``attention_mask=None`` pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        if mask is not None:
            h = h * mask
        return self.l2(h)


class AlwaysMasked(MaskedMLP):
    """The mask has a default of None, but the forward always uses it."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)) * mask)


def test_optional_input_left_out_later() -> None:
    """Before: ``model(x)`` after preconditioning on ``(x, mask)`` failed inside the fx graph with
    ``TypeError: unsupported operand type(s) for *: 'Tensor' and 'NoneType'``.  Now a forward
    that handles ``mask=None`` gets a capture that keeps it (the fx graph, which holds the
    branch the sample took, is declined), and one that cannot run without it gets a
    PrecondError that says which input is missing."""
    torch.manual_seed(0)
    x, mask = torch.randn(32, 8), (torch.rand(32, 16) > 0.5).float()
    model, _ = precondfx.precondition(MaskedMLP(), (x, mask), verbose=False)
    ones = torch.ones(32, 16)
    for call in (lambda: model(x), lambda: model(x, None), lambda: model(x, mask=None)):
        assert torch.allclose(call(), model(x, ones), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(model(x, mask), model(x, ones))
    strict, _ = precondfx.precondition(AlwaysMasked(), (x, mask), verbose=False)
    assert hasattr(strict, "graph")          # the fx result (the case of the defect)
    assert strict(x, mask).shape == (32, 4)
    for call in (lambda: strict(x), lambda: strict(x, None), lambda: strict(x, mask=None)):
        with pytest.raises(PrecondError, match=r"AlwaysMasked\.forward was called without 'mask'"):
            call()
    assert strict(x, mask=mask).shape == (32, 4)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


class ProtoNet(nn.Module):
    """Class prototypes exposed as a property (and a cached one) computed by the model."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), Block(), Block())
        self.head = nn.Linear(16, 4)
        self.table = nn.Parameter(torch.randn(5, 8))

    def prototypes_now(self) -> torch.Tensor:
        return self.head(self.enc(self.table))

    @property
    def prototypes(self) -> torch.Tensor:
        return self.head(self.enc(self.table))

    @functools.cached_property
    def cached_prototypes(self) -> torch.Tensor:
        return self.head(self.enc(self.table))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


def test_property_and_cached_property_compute_with_the_constants() -> None:
    """Before: ``model.prototypes`` differed from ``model(model.table)`` by up to 21.9 (no
    constants: the property ran outside the mirror hooks that methods get)."""
    torch.manual_seed(0)
    model, _ = precondfx.precondition(ProtoNet(), torch.randn(32, 8), verbose=False)
    assert hasattr(model, "graph")
    want = model(model.table)
    assert torch.allclose(model.prototypes_now(), want, atol=1e-5)
    assert (model.prototypes - want).abs().max().item() < 1e-5
    assert (model.cached_prototypes - want).abs().max().item() < 1e-5


class PoolCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool2 = nn.MaxPool2d(2)
        self.fc = nn.Linear(8 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.c1(x)))
        x = self.pool2(torch.relu(self.c2(x)))
        return self.fc(x.flatten(1))


def test_inplace_optimizer_built_before_without_new_convs_is_refused_at_first_step() -> None:
    """Before: the report said so, and ``opt.step()`` ran, silently leaving the 4 parameters of
    the max-pool replacement convolutions at their init."""
    torch.manual_seed(0)
    model = PoolCNN()
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
    stale = torch.optim.SGD(model.parameters(), lr=0.01)
    head_only = torch.optim.SGD(model.fc.parameters(), lr=0.01)     # a choice: not refused
    res, _ = precondfx.precondition(model, x, inplace=True, maxpool="conv", verbose=False)
    assert res is model and "pool.weight" in dict(model.named_parameters())
    fresh = torch.optim.SGD(model.parameters(), lr=0.01)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrecondError, match=r"not the 4 it added \(pool\.weight"):
        stale.step()
    head_only.step()
    fresh.step()
    stale.add_param_group({"params": [model.pool.weight, model.pool.bias,
                                      model.pool2.weight, model.pool2.bias]})
    stale.step()                            # holds them now


class ThisNet(nn.Module):
    """Methods that name their instance ``this``."""

    def __init__(this) -> None:
        super().__init__()
        this.l1 = nn.Linear(8, 16)
        this.head = nn.Linear(16, 4)
        this.temperature = 1.0

    def forward(this, x: torch.Tensor) -> torch.Tensor:
        return this.head(torch.relu(this.l1(x))) / this.temperature

    def logits_raw(this, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.relu(this.l1(x)), this.head.weight, this.head.bias)


def test_reads_are_found_whatever_the_instance_is_named() -> None:
    """Before: ``model.temperature = 2.0`` left the fx result's output unchanged (difference
    0.0: the graph holds 1.0) without an error, and the report did not name ``logits_raw``'s
    read of ``head.weight``; with ``self`` both were caught."""
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    model, report = precondfx.precondition(ThisNet(), x, verbose=False)
    assert hasattr(model, "graph")
    said = " ".join(str(report).split())
    assert "method logits_raw reads self.head.weight and self.head.bias" in said
    model(x)
    model.temperature = 2.0
    with pytest.raises(PrecondError, match="attribute temperature is 2.0"):
        model(x)


def test_first_step_hook_leaves_other_global_step_hooks_running() -> None:
    """Before: lr='auto''s global step pre-hook removed itself inside torch's loop over the
    global hooks once nothing was pending, so with any global hook registered after it (a
    user's, or precondfx's own optimizer checks) that first step raised
    ``RuntimeError: OrderedDict mutated during iteration``."""
    import gc

    from torch.optim.optimizer import register_optimizer_step_pre_hook
    gc.collect()                            # earlier tests' pending results: collected
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    model, _ = precondfx.precondition(MaskedMLP(), x, verbose=False)
    seen: list[int] = []
    handle = register_optimizer_step_pre_hook(lambda opt, a, k: seen.append(1))
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model(x).square().mean().backward()
        opt.step()
        opt.step()
    finally:
        handle.remove()
    assert seen == [1, 1]
