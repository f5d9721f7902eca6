"""The user's model contract (hunt user7): plain weights loaded into a part of the result, a
property setter calling a submodule, the cost of property access on the fx result, an optional
input passed through to attention (and one whose branch the graph would fix silently), and a
copy of a block made inside a method."""
from __future__ import annotations

import copy
import inspect
import io
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from precondfx.errors import PrecondError


def _quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **k)


class AE(nn.Module):
    """An autoencoder with a temperature property whose setter re-encodes a probe, a method
    snapshotting the encoder (an EMA-style copy) and cheap introspection properties."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.decoder = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self._t = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)

    @property
    def temperature(self) -> float:
        return self._t

    @temperature.setter
    def temperature(self, t: float) -> None:
        self._t = t
        self.probe_code = self.encoder(torch.ones(1, 8))

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def num_layers(self) -> int:
        return len(self.encoder) + len(self.decoder)

    def snapshot(self) -> nn.Module:
        return copy.deepcopy(self.encoder)

    def make_ema(self) -> nn.Module:
        return copy.deepcopy(self)

    def save(self, f: io.BytesIO) -> None:
        torch.save(self, f)


def _result(capture: str = "fx") -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    user = AE()
    # lr_scale='user': the layers' calls carry constants other than 1
    res, rep = _quiet(precondfx.precondition, user, torch.randn(32, 8), lr_scale="user",
                      capture=capture, seed=0)
    assert rep.capture == capture
    return user, res


def test_property_setter_runs_with_the_constants() -> None:
    """Before: ``model.temperature = 2.0`` ran the setter without the mirror hooks, so its
    ``self.encoder(...)`` computed without the constants: probe code 1.326 where ``encode``
    gives 3.481.  Now the setter (and deleter) runs like a method."""
    _, res = _result()
    res.temperature = 2.0
    assert res.temperature == 2.0
    want = res.encode(torch.ones(1, 8))
    assert torch.allclose(res.probe_code, want, rtol=1e-5, atol=1e-6), \
        (res.probe_code, want)


def test_copy_of_a_block_made_in_a_method_is_plain_and_pickles() -> None:
    """Before: ``copy.deepcopy(self.encoder)`` inside a method kept the mirror hooks installed
    at that moment (local functions): ``torch.save`` of the copy failed with "Can't pickle
    local object '_install.<locals>.hook'", and the copy applied the result's constants
    whenever a method of the result ran.  Now the copy is a plain module, as one made outside
    a method, and pickles."""
    _, res = _result()
    snap = res.snapshot()
    outside = copy.deepcopy(res.encoder)
    buf = io.BytesIO()
    torch.save(snap, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    o = torch.ones(1, 8)
    assert torch.equal(snap(o), outside(o)) and torch.equal(back(o), outside(o))

    class Probe(AE):
        def with_copy(self, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return m(x)                # the copy called while a method of the result runs
    torch.manual_seed(0)
    res2, _ = _quiet(precondfx.precondition, Probe(), torch.randn(32, 8), lr_scale="user",
                     seed=0)
    snap2 = res2.snapshot()
    assert torch.equal(res2.with_copy(snap2, o), snap2(o))
    # the result's own methods still see the constants
    assert not torch.allclose(res2.encode(o), snap2(o))
    # the whole model copied or saved inside one of its methods: the copy computes as the
    # result (bit for bit once its inert hooks have gone at the first call), and carries none
    x = torch.randn(16, 8)
    ema = res.make_ema()
    ema(x)
    assert torch.equal(ema(x), res(x)) and torch.equal(ema.encode(x), res.encode(x))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in ema.modules())
    buf = io.BytesIO()
    res.save(buf)
    buf.seek(0)
    back = _quiet(torch.load, buf, weights_only=False)
    assert torch.allclose(back(x), res(x)) and torch.equal(back.encode(x), res.encode(x))


def test_cheap_properties_install_no_hooks() -> None:
    """Before: every property access on the fx result installed and removed the mirror hooks
    (27 on a 13-layer MLP): ``model.device`` took 1566 us against the user's model's 16 us.
    A getter that calls no module now runs as it is; one that calls a module still gets the
    constants (the setter test)."""
    user, res = _result()
    # not wrapped: no hooks to install
    assert inspect.getattr_static(type(res), "device").fget is AE.device.fget

    def cost(obj: nn.Module) -> float:
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(200):
                obj.device, obj.num_layers
            best = min(best, time.perf_counter() - t)
        return best
    assert res.device == user.device and res.num_layers == 6
    mine, theirs = cost(res), cost(user)
    assert mine < 3 * theirs + 2e-3, (mine, theirs)


class KeyValue(nn.Module):
    """Submodules named ``keys`` and ``values``: a getter calling them needs the hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.keys = nn.Linear(8, 8)
        self.values = nn.Linear(8, 8)
        self.mem = nn.Parameter(torch.randn(2, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.values(torch.relu(self.keys(x)))

    @property
    def memory_values(self) -> torch.Tensor:
        return self.values(torch.relu(self.keys(self.mem)))


def test_getter_calling_a_submodule_named_like_a_dict_method() -> None:
    """A getter calling ``self.values(...)`` (a submodule) is not taken for ``dict.values``:
    it runs with the constants, as ``forward`` on the same input."""
    torch.manual_seed(0)
    res, rep = _quiet(precondfx.precondition, KeyValue(), torch.randn(32, 8), seed=0,
                      lr_scale="user")
    assert rep.capture == "fx"
    assert torch.allclose(res.memory_values, res(res.mem), rtol=1e-5, atol=1e-6)


class Attn(nn.Module):
    """``attn_mask`` passed through to SDPA, which takes None: no branch on it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.o = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


class Context(nn.Module):
    """A branch on an optional input whose taken side does not read it."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        if ctx is not None:
            h = h * 2.0
        return self.l2(h)


def test_optional_input_passed_through_runs_without_it() -> None:
    """Before: the fx result traced with ``(x, mask)`` refused ``model(x)`` with a
    PrecondError ("called without 'mask'"), although the graph with None is the user's
    function (SDPA takes ``attn_mask=None``).  Now it runs, equal to an all-True mask."""
    torch.manual_seed(0)
    x = torch.randn(4, 5, 16)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    res, rep = _quiet(precondfx.precondition, Attn(), (x, mask), seed=0)
    assert rep.capture == "fx"
    full = torch.ones(5, 5, dtype=torch.bool)
    assert torch.allclose(res(x), res(x, full), rtol=1e-5, atol=1e-6)
    assert torch.allclose(res(x, mask=None), res(x, full), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(res(x, mask), res(x, full))


def test_optional_input_whose_branch_the_graph_would_fix() -> None:
    """Before: traced with ``ctx`` given, the fx result called without it ran the ``ctx is
    not None`` branch silently (``h * 2``: output difference 0.0 between the two calls, where
    the user's model differs by 1.16).  Now the fx graph is declined for a capture that keeps
    the forward, and both calls compute as the user's class does."""
    torch.manual_seed(0)
    x, ctx = torch.randn(4, 8), torch.ones(4, 8)
    res, rep = _quiet(precondfx.precondition, Context(), (x, ctx), seed=0,
                      capture=["fx", "eager"])
    assert rep.capture == "eager"
    with_ctx, without = res(x, ctx), res(x)
    assert not torch.allclose(with_ctx, without)
    assert float((with_ctx - without).abs().max()) > 0.1


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_plain_weights_loaded_into_a_part(capture: str) -> None:
    """Before: ``result.encoder.load_state_dict(user.encoder.state_dict(), strict=False)``
    (the user's own, un-preconditioned weights) was accepted without a word on every capture:
    the weights then ran under the result's constants (x1.43, x1.84 here).  Now the eager and
    export results (constants on the layers) refuse it with the top-level load's PrecondError,
    and the fx result (constants on the root: a part's state dict holds none either way) warns
    where no mark of the result's own state dict is there.  The result's own state dicts
    (a part's, through torch.save; the whole; into a deep copy) load without a word."""
    user, res = _result(capture)
    plain = user.encoder.state_dict()
    leaf = user.encoder[0].state_dict()
    if capture == "fx":
        for sd, part in ((plain, res.encoder), (leaf, res.encoder[0])):
            with pytest.warns(RuntimeWarning, match="plain weights .* into encoder.0"):
                part.load_state_dict(sd)
    else:
        for sd, part in ((plain, res.encoder), (leaf, res.encoder[0])):
            with pytest.raises(PrecondError, match="none of its .* precondfx constants"):
                part.load_state_dict(sd, strict=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="precondfx: load_state_dict")
        buf = io.BytesIO()
        torch.save(res.encoder.state_dict(), buf)
        buf.seek(0)
        res.encoder.load_state_dict(torch.load(buf))
        res.load_state_dict(res.state_dict())
        ema = copy.deepcopy(res)
        ema.encoder.load_state_dict(res.encoder.state_dict())
    with pytest.raises(PrecondError):     # the whole user checkpoint: refused as before
        res.load_state_dict(user.state_dict(), strict=False)


def test_plain_weights_loaded_into_a_part_of_a_transformers_result() -> None:
    """A transformers result saves its constants folded (non-persistent buffers), so a part's
    state dict holds none either way.  Before: ``res.bert.encoder.load_state_dict(
    user.bert.encoder.state_dict())`` was accepted without a word and moved the logits by
    1.80.  Now it warns; the root's (folded) and a part's own state dicts reload silently,
    the same function."""
    pytest.importorskip("transformers")
    from tests.hf_tiny import build, quiet_precondition
    model, batch = build("bert", dropout=False)
    user = copy.deepcopy(model)
    res, _ = quiet_precondition(model, batch)
    x = {k: v for k, v in batch.items() if k != "labels"}
    ref = res(**x).logits.detach()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="precondfx: load_state_dict")
        res.load_state_dict(res.state_dict())
        buf = io.BytesIO()
        torch.save(res.bert.encoder.state_dict(), buf)
        buf.seek(0)
        res.bert.encoder.load_state_dict(torch.load(buf))
    assert torch.allclose(res(**x).logits, ref, rtol=1e-5, atol=1e-5)
    with pytest.warns(RuntimeWarning, match="plain weights .* into bert.encoder"):
        res.bert.encoder.load_state_dict(user.bert.encoder.state_dict())
