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


# -- (b) a constant main output on the sample -----------------------------------------------------
class _Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.cosine_similarity(self.enc(a), self.enc(b), dim=-1)


def test_constant_output_on_the_sample_is_refused_with_what_to_do():
    """A siamese net calibrated on identical pairs: cosine 1 +- 1e-7.  Before: output std
    8.75e-08 scaled by 1.14e7 (rounding noise), then 'the output std is 0.8268 after
    calibration, not the target 1 ... (please report this model)'.  Now: refused, saying the
    output is constant and what to do; distinct pairs calibrate as before."""
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    with pytest.raises(PrecondError) as e:
        precondfx.precondition(_Siamese(), (x, x))
    msg = str(e.value)
    assert "constant on the calibration batch" in msg and "target_std=None" in msg
    assert "please report" not in msg
    _, rep = precondfx.precondition(_Siamese(), (x, torch.randn(32, 8)))
    assert rep.output_std_after == pytest.approx(1.0, rel=1e-3)
    assert not [w for w, _ in rep.skipped if "constant" in w]


class _IgnoresInput(nn.Module):
    """forward reads the wrong tensor: the output is the bias path for every sample."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(torch.zeros_like(x)) + 1.0))


def test_output_that_ignores_the_input_is_said():
    """Before: calibrated silently (no note).  Now a note that every sample's output is the
    same; a model that reads its input gets none."""
    torch.manual_seed(0)
    _, rep = precondfx.precondition(_IgnoresInput(), torch.randn(32, 8), balance="none")
    said = [why for what, why in rep.skipped if what == "note: constant output"]
    assert len(said) == 1 and "does not depend on the inputs" in said[0]


# -- (e) two preconditions in two threads -------------------------------------------------------
_EVENTS: dict[str, threading.Event] = {}


class _Staged(nn.Module):
    """An MLP whose forwards wait on events, so that two threads' captures overlap in a known
    order: A's fx trace starts and waits (at most 1.5 s) for B's to start; B's first real
    forward waits for A's trace, and B's trace lasts 1 s, past A's end."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.role, self.first = role, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.fx.Proxy):
            if self.role == "a":
                _EVENTS["a_in"].set()
                _EVENTS["b_in"].wait(1.5)
            else:
                _EVENTS["b_in"].set()
                time.sleep(1.0)
        elif self.role == "b" and self.first:
            self.first = False
            _EVENTS["a_in"].wait(30)
        return self.b(torch.relu(self.a(x)))


def test_two_threads_leave_no_warning_filter_or_stream_behind():
    """Thread A's capture starts first and ends first, thread B's overlaps it.  Before: B's
    warnings.catch_warnings() and redirect_stdout saved A's silenced state and put it back at
    its exit: warnings.filters kept an 'ignore everything' entry and sys.stdout stayed a
    StringIO (every later print and warning of the process lost).  Now the state is the one
    the process had."""
    filters, out, err = list(warnings.filters), sys.stdout, sys.stderr
    results: dict[str, object] = {}

    def work(name: str, model: nn.Module) -> None:
        try:
            torch.manual_seed(0)
            results[name] = precondfx.precondition(model, torch.randn(16, 8), balance="none",
                                                   lr=None)[1]
        except BaseException as e:          # pragma: no cover - reported below
            results[name] = e

    _EVENTS.update(a_in=threading.Event(), b_in=threading.Event())
    threads = [threading.Thread(target=work, args=(r, _Staged(r))) for r in ("a", "b")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        left = (list(warnings.filters) != filters, sys.stdout is not out, sys.stderr is not err)
    finally:
        warnings.filters[:] = filters
        sys.stdout, sys.stderr = out, err
    assert not any(isinstance(r, BaseException) for r in results.values()), results
    assert left == (False, False, False)
