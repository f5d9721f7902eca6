"""Two measurements in two threads leave torch as they found it.

The measurements run reentrant checkpoints as plain calls and attention on its math kernel,
both process-wide switches.  Entered by one thread and left by the other first, the switches
used to stay on for the rest of the process: a later ``torch.utils.checkpoint`` did not
recompute (the suite's checkpoint tests failed after the fx thread tests, in some runs), and
fused attention stayed off.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import precondfx
from precondfx.pytorch import calibrate

_REAL = torch.utils.checkpoint.CheckpointFunction


def _flags() -> tuple[bool, ...]:
    b = torch.backends.cuda
    return (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled())


def _interleave(enter_and_wait):
    """Thread A enters, then B; A leaves first, then B (not nested)."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def a():
        try:
            with enter_and_wait():
                a_in.set()
                assert b_in.wait(30)
        except Exception as e:          # pragma: no cover - reported below
            errors.append(e)
        finally:
            a_out.set()

    t = threading.Thread(target=a)
    t.start()
    assert a_in.wait(30)
    with enter_and_wait():
        b_in.set()
        assert a_out.wait(30)
    t.join(30)
    assert not errors, errors


def test_checkpoint_stand_in_is_removed_when_threads_leave_out_of_order():
    _interleave(calibrate.checkpoint_as_call)
    assert torch.utils.checkpoint.CheckpointFunction is _REAL


def test_math_attention_flags_restored_when_threads_leave_out_of_order():
    before = _flags()
    _interleave(calibrate.math_attention)
    assert _flags() == before


class _Counted(nn.Linear):
    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return super().forward(x)


def test_another_threads_checkpoint_recomputes_while_one_measures():
    """While a measurement holds the stand-in, a training thread's reentrant checkpoint still
    recomputes its forward in backward (and its gradient equals the plain one)."""
    lin = _Counted(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    inside, done = threading.Event(), threading.Event()

    def hold():
        with calibrate.checkpoint_as_call():
            inside.set()
            done.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert inside.wait(30)
        _Counted.calls = 0
        y = torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=True)
        y.square().sum().backward()
        assert _Counted.calls == 2          # the forward, then its recomputation
        g = x.grad.clone()
        x.grad = None
        lin(x).square().sum().backward()
        torch.testing.assert_close(g, x.grad)
    finally:
        done.set()
        t.join(30)
    # in the measuring thread itself the checkpoint is a plain call
    _Counted.calls = 0
    with calibrate.checkpoint_as_call():
        torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=True).sum().backward()
    assert _Counted.calls == 1


class _Attn(nn.Module):
    """A small attention model whose forward, inside this thread's learning-rate measurement
    (under torch.func's jvp, the weights are wrapped), calls ``gate`` once."""

    def __init__(self, gate):
        super().__init__()
        self.qkv, self.out, self.gate, self.gated = nn.Linear(8, 24), nn.Linear(8, 4), gate, False

    def forward(self, x):
        if not self.gated and torch._C._functorch.is_functorch_wrapped_tensor(self.qkv.weight):
            self.gated = True
            self.gate()
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = F.scaled_dot_product_attention(q, k, v)
        h = torch.utils.checkpoint.checkpoint(torch.tanh, h, use_reentrant=True)
        return self.out(h).mean(1)


def _suggested(gate):
    torch.manual_seed(0)
    _, rep = precondfx.precondition(_Attn(gate), torch.randn(16, 5, 8), suggest_lr=True)
    return rep.suggested_lr


def test_two_preconditions_in_threads_measure_as_alone_and_restore_torch():
    """A's rate measurement starts and waits (3 s at most) for B's to start; B's waits for A's
    precondition to end.  Before: B's measurement ran beside A's, its forward-mode products
    failed on torch's shared forward-AD levels and its SGD rate came out None; A left first
    and put the real checkpoint back under B's jvp, or B left last and kept the stand-in and
    the math-only attention installed for the process.  Now the measurements take turns: both
    rates equal a lone run's, and torch is as it was."""
    before = _flags()
    alone = _suggested(lambda: None)
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    out = {}

    def run(name, gate, then=None):
        try:
            out[name] = _suggested(gate)
        except Exception as e:
            out[name] = e
        finally:
            if then is not None:
                then.set()

    ta = threading.Thread(target=run, args=("a", lambda: (a_in.set(), b_in.wait(3)), a_done))
    ta.start()
    assert a_in.wait(120), out
    tb = threading.Thread(target=run, args=("b", lambda: (b_in.set(), a_done.wait(3))))
    tb.start()
    ta.join(120)
    tb.join(120)
    assert not [v for v in out.values() if isinstance(v, Exception)], out
    for k in "ab":
        for fam in ("sgd", "adam"):
            assert out[k][fam] is not None, (k, out[k])
            assert out[k][fam] == pytest.approx(alone[fam], rel=1e-5), (k, fam)
    assert torch.utils.checkpoint.CheckpointFunction is _REAL
    assert _flags() == before
