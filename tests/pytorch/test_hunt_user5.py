"""The result is the user's model, used the way user scripts use it (hunt ``user5``)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from tests.user_models import AutoEncoder
from precondfx.errors import PrecondError


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


class _Looped(nn.Module):
    """One block applied three times (weight sharing across depth, a recurrent refinement)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.block = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.inp(x))
        for _ in range(3):
            h = F.relu(self.block(h))
        return h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x)).argmax(-1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def test_a_block_applied_in_a_loop_carries_its_alpha_in_the_users_methods() -> None:
    """The block's alpha (on its input) at its first call was mirrored upstream on ``inp``'s
    output (through the relu), so its second and third calls' alphas were listed forward-only
    and ``features``/``logits`` ran without them: 1.55 relative from ``forward`` (balance
    'hessian', alphas 0.63).  Now mirrored on the block at every call: 2e-7."""
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    pm, rep = precondfx.precondition(_Looped(), x, balance="hessian")
    assert rep.capture == "fx"
    assert abs(float(pm.get_buffer("precondfx_alpha_block")) - 1) > 0.05
    assert rep.result["forward_only"] == []
    assert _rel(pm.logits(x), pm(x)) < 1e-5
    assert torch.equal(pm.predict(x), pm(x).argmax(-1))


class _NumpyConfig(nn.Module):
    """Config values that came from numpy (a YAML/np.load'ed config) and a long index list."""

    def __init__(self) -> None:
        super().__init__()
        import numpy as np
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 2)
        self.scale = np.float32(2.0)
        self.use_half = np.bool_(True)
        self.keep = list(range(300))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc(x))
        if self.use_half:
            h = h * 0.5
        return self.out(h) * float(self.scale) + self.keep[0]


def test_numpy_scalars_the_traced_forward_read_cannot_change_silently() -> None:
    """``model.scale = np.float32(4.0)`` (or a numpy flag set False) on the fx result: it kept
    computing with the traced 2.0 (relative output change 0 where the user's forward doubles),
    silently; numpy scalars are now compared like Python numbers and refused."""
    import numpy as np
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    pm, rep = precondfx.precondition(_NumpyConfig(), x)
    assert rep.capture == "fx"
    y = pm(x)
    pm.scale = np.float32(4.0)
    with pytest.raises(PrecondError, match=r"scale is np.float32\(4.0\)"):
        pm(x)
    pm.scale = np.float32(2.0)
    pm.use_half = np.bool_(False)
    with pytest.raises(PrecondError, match="use_half is"):
        pm(x)
    pm.use_half = np.bool_(True)
    assert torch.equal(pm(x), y)


def test_a_container_too_big_to_check_is_said_in_the_report() -> None:
    """A 300-item list read by the traced forward is past the per-call check's 256 values: it
    was left unchecked with nothing said (changed, the result computes with the traced
    value); now a NOT APPLIED line names it."""
    torch.manual_seed(0)
    pm, rep = precondfx.precondition(_NumpyConfig(), torch.randn(16, 8))
    lines = [why for what, why in rep.skipped if what == "attribute keep"]
    assert len(lines) == 1 and "more than 256 values" in lines[0]
    assert not any(what == "attribute scale" for what, _ in rep.skipped)


@pytest.mark.parametrize("capture,opt_cls", [("fx", torch.optim.SGD),
                                             ("eager", torch.optim.AdamW)])
def test_an_optimizer_built_on_the_model_before_precondition_is_refused(
        capture: str, opt_cls: type) -> None:
    """``opt = SGD(model.parameters())`` then ``model2, _ = precondition(model, x)`` and the
    loop on ``model2``: the result's parameters got the gradients, the optimizer stepped the
    untouched original, and the result never moved (0 of 4 parameters changed after 3 steps,
    SGD and AdamW, fx and eager), with no error or warning.  Now the first step raises a
    PrecondError saying to build the optimizer from the result; that one, and an optimizer
    training the original model itself, step as before."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    stale = opt_cls(model.parameters(), lr=0.01)
    pm, rep = precondfx.precondition(model, x, capture=capture, lr=None)   # no rate step
    assert rep.capture == capture
    stale.zero_grad()
    F.cross_entropy(pm(x), y).backward()
    with pytest.raises(PrecondError, match="holds the parameters of the model you passed"):
        stale.step()
    before = [p.detach().clone() for p in pm.parameters()]
    opt = opt_cls(pm.parameters(), lr=0.01)
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, pm.parameters()))
    own = opt_cls(model.parameters(), lr=0.01)      # training the original itself is fine
    F.cross_entropy(model(x), y).backward()
    w0 = model[0].weight.detach().clone()
    own.step()
    assert not torch.equal(model[0].weight, w0)


def test_a_hook_on_a_block_the_graph_runs_through_is_said_not_to_run() -> None:
    """Feature extraction the usual way, ``model.layer1.register_forward_hook(save)``, on the
    fx result: the graph calls the layers inside ``layer1``, never ``layer1`` itself, so the
    hook never ran (0 of 2 container hooks fired; the eager result fires both), silently: the
    features dict stayed empty.  Now a RuntimeWarning names the module and what to do; a hook
    on a layer the graph calls runs as before, without a warning."""
    import warnings
    from tests.user_models import TimmResNet
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16)
    pm, rep = precondfx.precondition(TimmResNet(), x, lr=None)
    assert rep.capture == "fx"
    got: dict[str, torch.Tensor] = {}
    h = pm.layer1[0].conv1.register_forward_hook(lambda m, a, o: got.__setitem__("conv", o))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        pm(x)
    assert "conv" in got
    h.remove()
    pm.layer1.register_forward_hook(lambda m, a, o: got.__setitem__("layer1", o))
    with pytest.warns(RuntimeWarning, match="does not call layer1 as a module"):
        pm(x)
    with pytest.warns(RuntimeWarning, match="does not call layer1 as a module"):
        copy.deepcopy(pm)(x)
    assert "layer1" not in got


class _Stages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = F.relu(b(x))
        return self.head(x)

    def iter_features(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        """Each block's output in turn (a feature pyramid, a streaming generate)."""
        for b in self.blocks:
            x = F.relu(b(x))
            yield x


def test_a_generator_method_computes_with_the_constants() -> None:
    """``for f in model.iter_features(x)``: the method wrapper installed the mirror hooks and
    removed them as soon as the generator object was made, before its body ran, so every
    yielded feature was computed without the blocks' alphas (0.72 and 0.48 relative from the
    folded model's, first and last), silently.  Now each resumption runs with the hooks
    (1.6e-7); none is left installed after a ``break``."""
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    pm, rep = precondfx.precondition(_Stages(), x, balance="hessian", lr=None)
    assert rep.capture == "fx"
    assert abs(float(pm.get_buffer("precondfx_alpha_blocks_0")) - 1) > 0.05
    ref = precondfx.fold(pm)
    got, want = list(pm.iter_features(x)), list(ref.iter_features(x))
    assert len(got) == 3
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-5
    for f in pm.iter_features(x):
        break
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in pm.modules())
    assert _rel(f, want[0]) < 1e-5


class _WithLock(nn.Module):
    """A model holding what cannot pickle (a lock; a tokenizer or file handle alike), dropped
    by its own ``__getstate__`` and made again by its ``__setstate__``."""

    def __init__(self) -> None:
        super().__init__()
        import threading
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)
        self._lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict) -> None:
        import threading
        super().__setstate__(state)
        self._lock = threading.Lock()


def test_the_fx_result_pickles_and_copies_through_the_classes_getstate() -> None:
    """``torch.save(model)`` and ``copy.deepcopy(model)`` of the fx result raised "cannot
    pickle '_thread.lock' object" where the user's model (and the eager result) pickle: the
    result pickled its ``__dict__`` past the class's ``__getstate__``.  Now the class's
    ``__getstate__``/``__setstate__`` are used: the copies compute the same and hold a lock."""
    import io
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    pm, rep = precondfx.precondition(_WithLock(), x, lr=None)
    assert rep.capture == "fx"
    buf = io.BytesIO()
    torch.save(pm, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    cp = copy.deepcopy(pm)
    for other in (back, cp):
        assert isinstance(other, _WithLock) and hasattr(other, "_lock")
        assert other._lock is not pm._lock
        assert torch.equal(other(x), pm(x))


class _GetattrFlag(nn.Module):
    """``getattr(self, "use_gate", False)``: how code reads a flag an older config may lack."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)
        self.use_gate = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        if getattr(self, "use_gate", False):
            h = h * 0.5
        return self.fc2(h)


def test_a_flag_read_through_getattr_cannot_change_silently() -> None:
    """``model.use_gate = False`` where forward reads ``getattr(self, "use_gate", False)``: the
    fx result kept the traced branch (relative output change 0 where the user's forward
    doubles the output), silently: only ``self.name`` reads were recorded.  Now refused like
    them."""
    torch.manual_seed(0)
    x = torch.randn(32, 16)
    pm, rep = precondfx.precondition(_GetattrFlag(), x, lr=None)
    assert rep.capture == "fx"
    y = pm(x)
    pm.use_gate = False
    with pytest.raises(PrecondError, match="use_gate is False"):
        pm(x)
    pm.use_gate = True
    assert torch.equal(pm(x), y)


def test_the_result_line_says_a_submodule_called_from_a_script_runs_without_constants() -> None:
    """``result.encoder(x)`` in a script on the fx result runs without the constants the graph
    applies around the encoder's layers (0.09 relative from the folded model here; a method,
    ``encode``, computes with them): documented in concepts, but the report's result line
    said 'every method computes with the constants' and nothing about it.  The line now
    says it (fx only: the eager result's constants ride on the modules)."""
    torch.manual_seed(0)
    x = torch.randn(32, 20)
    pm, rep = precondfx.precondition(AutoEncoder(), x, balance="hessian", lr=None)
    assert rep.capture == "fx"
    ref = precondfx.fold(pm)
    assert _rel(pm.encode(x), ref.encode(x)) < 1e-5
    assert _rel(pm.encoder(x), ref.encoder(x)) > 1e-3      # what the line warns about
    assert "model.encoder(x)" in rep.result_line()
    pe, rep_e = precondfx.precondition(AutoEncoder(), x, balance="hessian", lr=None,
                                       capture="eager")
    assert _rel(pe.encoder(x), precondfx.fold(pe).encoder(x)) < 1e-5
    assert "model.encoder(x)" not in rep_e.result_line()


class _WithMeta(nn.Module):
    """A label map kept in ``self.meta`` (a common name for a model's metadata)."""

    def __init__(self) -> None:
        super().__init__()
        self.meta = {"classes": ["cat", "dog"]}
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))

    def labels(self, x: torch.Tensor) -> list[str]:
        return [self.meta["classes"][i] for i in self(x).argmax(-1).tolist()]


def test_an_attribute_named_like_a_graphmodule_attribute_is_kept() -> None:
    """``self.meta = {"classes": [...]}``: the fx result (a GraphModule of the user's class)
    read GraphModule's own, empty ``meta``, so ``model.labels(x)`` raised KeyError 'classes'
    and ``model.meta`` was silently another dict.  fx now declines such a model (like a hook
    it would drop) and the next capture keeps the user's attribute."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    pm, rep = precondfx.precondition(_WithMeta(), x, lr=None)
    assert rep.capture != "fx" and rep.result["is_user_class"]
    assert pm.meta == {"classes": ["cat", "dog"]}
    assert set(pm.labels(x)) <= {"cat", "dog"}
    assert any("fx not used" in n and "'meta'" in n for n in rep.capture_notes)
