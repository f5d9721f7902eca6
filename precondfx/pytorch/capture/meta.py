"""Models on the meta device: shapes without data, run under fake tensors.

A model built under ``torch.device("meta")`` (a 7B transformer that never sits whole on one
device) can be planned from shapes alone.  Its forward cannot run on meta tensors when it reads
a tensor's value (``.item()``, ``if mask.all():``, ``nonzero``), which libraries such as
transformers skip when they see fake tensors.  So every forward the planner needs on such a
model runs under a ``FakeTensorMode``; where the model really depends on values, the error names
the operation and the line of the model that asked for it.
"""
from __future__ import annotations

import contextlib
import copy
import traceback
from typing import Any, Callable, Iterator

import torch
from torch import nn

from precondfx.errors import PrecondError

_DATA_ERRORS = ("DataDependentOutputException", "DynamicOutputShapeException",
                "GuardOnDataDependentSymNode", "UnsupportedOperatorException")


def on_meta(model: nn.Module) -> bool:
    """True when the model's parameters live on the meta device (shapes, no data)."""
    return any(p.device.type == "meta" for p in model.parameters())


@contextlib.contextmanager
def fake_mode() -> Iterator[Any]:
    """A FakeTensorMode that accepts the model's own meta tensors as inputs.  Tensors the
    forward creates without a device (``torch.zeros(n)``, ``generate_square_subsequent_mask``)
    are made on the meta device, where the model's own tensors are (:func:`default_meta`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with default_meta(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


@contextlib.contextmanager
def default_meta() -> Iterator[None]:
    """The meta device as the default device: a forward that creates a tensor without
    ``device=`` runs on any single device, so on meta its new tensors must be meta too (on the
    CPU they would meet the model's meta tensors and fail with a device mismatch)."""
    with torch.device("meta"):
        yield


def _user_frame(e: BaseException) -> str:
    """``file:line in fn: code`` of the innermost frame outside torch and precondfx."""
    frames = traceback.extract_tb(e.__traceback__)
    for fr in reversed(frames):
        f = fr.filename.replace("\\", "/")
        if "/torch/" in f or "/precondfx/" in f or f.startswith("<"):
            continue
        return f"{f}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}"
    return "unknown location"


def data_dependent(e: BaseException) -> bool:
    """Whether ``e`` says the forward needed tensor values that meta/fake tensors lack."""
    msg = str(e)
    return type(e).__name__ in _DATA_ERRORS or "cannot be called on meta tensors" in msg or \
        "data-dependent" in msg.lower()


_OPS = {"_local_scalar_dense": "Tensor.item(), or a tensor used as a Python bool or number",
        "nonzero": "nonzero / boolean-mask indexing (the output shape depends on values)",
        "masked_select": "masked_select (the output shape depends on values)",
        "unique": "unique (the output shape depends on values)"}


def explain(e: BaseException, what: str) -> PrecondError:
    """A PrecondError naming the value-reading operation and where the model asked for it."""
    op = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
    op += "".join(f" = {v}" for k, v in _OPS.items() if k in op)[:100]
    return PrecondError(
        f"{what}: the model is on the meta device (shapes, no data) and its forward reads a "
        f"tensor value ({type(e).__name__}: {op}) at {_user_frame(e)}. Planning on meta works "
        f"for forwards whose control flow does not depend on values: make that branch "
        f"value-independent, or materialize the model (model.to_empty(device='cpu') and an "
        f"init) and plan on real data")


def _specific(e: BaseException, what: str) -> PrecondError | None:
    """The meta device's own error for ``e``: a value read, or a device mismatch."""
    if data_dependent(e):
        return explain(e, what)
    if type(e).__name__ == "FakeTensorDeviceMismatchError":
        return PrecondError(
            f"{what}: the model is on the meta device, and its forward mixes a meta tensor "
            f"with one on another device ({str(e).strip()[:160]}) at {_user_frame(e)}: a "
            f"plain tensor attribute made outside torch.device('meta'), or a tensor made "
            f"with an explicit device. Build the whole model under torch.device('meta') "
            f"(register tensors as buffers), or create tensors on the input's device "
            f"(device=x.device)")
    return None


def forward(model: nn.Module, run: Callable[[nn.Module], Any], what: str = "the forward") -> Any:
    """Run ``run(model)`` under fake tensors; value-reading operations and tensors on another
    device get a clear error."""
    try:
        with torch.no_grad(), fake_mode():
            return run(model)
    except PrecondError as e:
        cause = e.__cause__
        err = _specific(cause, what) if cause is not None else None
        if err is not None:
            raise err from cause
        raise
    except Exception as e:
        err = _specific(e, what)
        if err is not None:
            raise err from e
        raise PrecondError(f"{what}: the model raised {type(e).__name__} on the meta device "
                           f"under fake tensors: {str(e).strip()[:300]} (at {_user_frame(e)}). "
                           f"Check that the sample is what the model's forward expects") from e


def _aliases(model: nn.Module) -> dict[str, str]:
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n) for n, p in model.named_parameters(
        remove_duplicate=False)}


def untied_declared(model: nn.Module) -> list[tuple[str, str]]:
    """Parameter pairs the model's own ``tie_weights()`` (transformers models) would tie but
    that are separate tensors: ``accelerate.init_empty_weights()`` builds GPT-2's ``lm_head``
    untied, since every parameter it registers is a new meta tensor.  Checked on a deep copy
    (cheap on the meta device), so the model is not changed."""
    tie = getattr(model, "tie_weights", None)
    if not callable(tie):
        return []
    try:
        probe = copy.deepcopy(model)
        probe.tie_weights()
    except Exception:  # noqa: BLE001 - a tie_weights we cannot run on a copy: nothing known
        return []
    have, want = _aliases(model), _aliases(probe)
    return [(a, c) for a, c in want.items() if a != c and have.get(a, a) != have.get(c, c)]


def check_ties(model: nn.Module) -> None:
    """Refuse a meta model whose declared tied weights are separate (see
    :func:`untied_declared`): planned apart, they would be drawn and trained apart."""
    pairs = untied_declared(model)
    if pairs:
        names = ", ".join(f"{a} and {c}" for a, c in pairs[:4])
        raise PrecondError(
            f"the model ties {names} (its tie_weights()), but they are separate parameters "
            f"here: accelerate.init_empty_weights() creates them untied. Call "
            f"model.tie_weights() before precondfx (it ties them on the meta device too), or "
            f"build the model under torch.device('meta'), which keeps the tie")
