"""lr='auto' (precondfx.pytorch.first_step), second hunt: a model cast in parts, a layer no
optimizer holds, a rate raised by hand after the first step, a first step inside autocast.
Each test compares numbers that differed before its fix."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from precondfx.pytorch import first_step
from tests.pytorch.test_first_step import _data, _mlp

#: a rate above the MLP's suggested SGD rate (about 0.47): the ceiling acts (factor about 0.48)
HIGH = 2.0


def _factor_at(model: nn.Module, rep, inp: torch.Tensor, y: torch.Tensor) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=HIGH)
    F.cross_entropy(model(inp).float(), y).backward()
    opt.step()
    return rep.conditioning["lr_target"]


class _BodyHead(nn.Module):
    """A body and a head; the forward casts the body's features for the head (the way a
    model whose body is cast to bfloat16 and head kept in float32 is written)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).float())


@pytest.mark.parametrize("dtype,rel", [(torch.bfloat16, 0.02), (torch.float64, 1e-4)])
def test_a_body_cast_apart_from_its_head_is_measured(dtype, rel):
    """``model.to(bfloat16); model.head.float()`` after precondition: the kept float32 batch
    met the bfloat16 body ("mat1 and mat2 must have the same dtype"), the measurement failed
    with a warning and the ceiling was not applied (factor 1 at 4.3x the suggested rate); the
    batch now takes the dtype of the first layer it reaches, and the factor is the float32
    model's."""
    x, y = _data()
    ref, rep_ref = precondfx.precondition(_BodyHead(), x)
    sec_ref = _factor_at(ref, rep_ref, x, y)
    model, rep = precondfx.precondition(_BodyHead(), x)
    model.to(dtype)
    model.head.float()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        sec = _factor_at(model, rep, x.to(dtype), y)
    assert "kept" not in sec
    assert sec_ref["factor"] < 0.7
    assert sec["factor"] == pytest.approx(sec_ref["factor"], rel=rel)



class _CastsForItsLayers(_BodyHead):
    """The same body and head; the forward casts each input to its layer's dtype (a model
    meant to run with parts in bfloat16: ``x.to(self.fc.weight.dtype)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x.to(self.body[0].weight.dtype))
        return self.head(h.to(self.head.weight.dtype))


def test_a_forward_reading_a_weights_dtype_keeps_the_layer_in_the_plan():
    """fx traced ``self.head.weight.dtype`` as a node reading the weight, so the two layers
    whose dtype the forward reads were 'read outside its layer': left out of balancing and
    of the lr multipliers.  lr='auto' then scaled 1 of 3 layers, by 0.296 instead of 0.482,
    and warned that 'the curvature sits on parameters outside the scaled layers'.  A read of
    a weight's dtype, device or shape reads none of its values: the three layers are scaled
    as in the same model without the casts."""
    x, y = _data()
    plain, rep_p = precondfx.precondition(_BodyHead(), x)
    casts, rep_c = precondfx.precondition(_CastsForItsLayers(), x)
    assert rep_c.capture == "fx"
    assert "outside its layer" not in str(rep_c)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        secs = [_factor_at(m, r, x, y) for m, r in ((plain, rep_p), (casts, rep_c))]
    assert secs[0]["factor"] < 0.7
    assert secs[1]["factor"] == pytest.approx(secs[0]["factor"], rel=1e-6)
    consts = [float(b) for n, b in casts.named_buffers() if "precondfx_lr" in n]
    assert consts == pytest.approx([secs[0]["factor"]] * 3, rel=1e-6)

def _kept_bytes(model: nn.Module) -> int:
    pend = model.__dict__[first_step.ATTR]
    return 0 if pend.sample is None else sum(t.numel() * t.element_size()
                                             for t in pend.sample.tensors())


def test_a_trainable_layer_no_optimizer_holds_does_not_keep_the_batch():
    """SGD over the head of a model whose body is trainable but stepped by nobody: the body's
    layers stayed pending for an optimizer that never came, and the kept calibration batch
    (5120 bytes here; a real batch: megabytes of GPU memory) lived as long as the model.  It
    is released at that optimizer's second step, and the report says the body's storage is
    kept.  An optimizer that exists but steps less often (a GAN's generator, 1 step per 3 of
    the discriminator) still sets its layers' ceiling at its first step."""
    x, y = _data()
    model, rep = precondfx.precondition(_mlp(), x)
    opt = torch.optim.SGD(model[4].parameters(), lr=HIGH)
    held = []
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        held.append(_kept_bytes(model))
    assert held == [x.numel() * 4, 0, 0]
    assert "stepped by no optimizer" in rep.conditioning["lr_target"]["unheld"]

    gan, rep_g = precondfx.precondition(_mlp(), x)
    ps = list(gan.parameters())
    d, g = torch.optim.SGD(ps[4:], lr=HIGH), torch.optim.SGD(ps[:4], lr=HIGH)
    del ps
    for _ in range(3):
        d.zero_grad()
        F.cross_entropy(gan(x), y).backward()
        d.step()
    g.zero_grad()
    F.cross_entropy(gan(x), y).backward()
    g.step()
    consts = [float(b) for n, b in gan.named_buffers() if "precondfx_lr" in n]
    assert consts[0] == consts[1] < 0.75 and consts[2] < 0.75
    assert _kept_bytes(gan) == 0 and "unheld" not in rep_g.conditioning["lr_target"]


def test_a_rate_raised_by_hand_after_the_first_step_is_said():
    """A warm-up set by hand from 0.2 to 2 (or an LR finder): the ceiling was decided at the
    first step's rate 0.2, below the suggested 0.47 (storage kept), and the loop then trained
    at 2 (4.3x the ceiling) without a word.  Now the step whose rate passes the suggested one
    warns once, saying where the ceiling was decided and what to do; a constant rate below
    the ceiling and a scheduler's warm-up (whose peak is read) say nothing."""
    x, y = _data()

    def loop(sched: str) -> tuple[dict, list[str]]:
        model, rep = precondfx.precondition(_mlp(), x)
        opt = torch.optim.SGD(model.parameters(), lr=0.1 if sched == "constant" else HIGH,
                              momentum=0.9)
        lin = torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=9) \
            if sched == "scheduler" else None
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            for step in range(12):
                if sched == "by hand":
                    for group in opt.param_groups:
                        group["lr"] = HIGH * min(1.0, (step + 1) / 10)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                if lin is not None:
                    lin.step()
        return rep.conditioning["lr_target"], [str(w.message) for w in got
                                               if "precondfx" in str(w.message)]

    sec, said = loop("by hand")
    assert sec["factor"] == 1.0 and sec["suggested_after"] > 0.2
    assert len(said) == 1 and "decided at the first step of SGD, at its rate 0.2" in said[0]
    assert "settle_rate" in said[0] and sec["raised"] in said[0]
    assert sec["raised"] in sec["summary"]          # the printed report says it too
    for quiet in ("constant", "scheduler"):
        sec, said = loop(quiet)
        assert said == [] and "raised" not in sec
    assert sec["factor"] < 0.7          # the scheduler's peak: the ceiling acted


def test_a_first_step_inside_autocast_is_measured_in_float32():
    """``opt.step()`` inside a bfloat16 ``torch.autocast`` region: the measurement ran in
    bfloat16 and its factor was 0.48246 against the float32 step's 0.48228 (3.6e-4 off, a
    draw of bfloat16 rounding); autocast is off inside the measurement, and the factor is the
    float32 one."""
    x, y = _data()
    got = []
    for on in (False, True):
        model, rep = precondfx.precondition(_mlp(), x)
        opt = torch.optim.SGD(model.parameters(), lr=HIGH)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            assert torch.is_autocast_enabled("cpu") == on     # the user's region kept
        got.append(rep.conditioning["lr_target"]["factor"])
    assert got[0] < 0.7
    assert got[1] == pytest.approx(got[0], rel=1e-7)


def test_the_first_step_under_warnings_as_errors(tmp_path):
    """``python -W error`` (pytest's ``filterwarnings = error``): torch's first jvp in a
    process imports its decompositions through ``torch.jit.script``, which warns
    (DeprecationWarning); the warning failed the measurement, and the RuntimeWarning saying so
    then raised from the user's ``opt.step()``.  Run in a fresh process, where that import
    has not happened yet."""
    import subprocess
    import sys
    from pathlib import Path
    script = tmp_path / "loop.py"
    script.write_text(
        "import torch, torch.nn.functional as F, precondfx\n"
        "from tests.pytorch.test_first_step import _data, _mlp\n"
        "torch.set_num_threads(1)\n"
        "x, y = _data()\n"
        "model, rep = precondfx.precondition(_mlp(), x)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=2.0)\n"
        "F.cross_entropy(model(x), y).backward()\n"
        "opt.step()\n"
        "print(rep.conditioning['lr_target']['factor'])\n")
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-W", "error", str(script)], capture_output=True,
                         text=True, cwd=root, env={**__import__("os").environ,
                                                   "PYTHONPATH": str(root)}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.split()[-1]) < 0.7


def test_layers_frozen_after_precondition_are_said_at_the_first_step():
    """The body frozen after precondition for a head warm-up (``requires_grad_(False)``), then
    unfrozen into the same optimizer: the first step set the head's ceiling alone, and the
    report said '1 layers' stored weights ... / 0.709' with no word of the two body layers,
    which then trained at 2, 4.3x their ceiling (multipliers 1 against lr='s 0.482).  The
    report now names them and what to do."""
    x, y = _data()
    model, rep = precondfx.precondition(_mlp(), x)
    body = [p for n, p in model.named_parameters() if not n.startswith("4.")]
    for p in body:
        p.requires_grad_(False)
    opt = torch.optim.SGD(model[4].parameters(), lr=HIGH)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    sec = rep.conditioning["lr_target"]
    assert sec["frozen"] == ["0.weight", "2.weight"]
    assert "2 layers frozen at this step" in sec["summary"] and "settle_rate" in sec["summary"]
    assert sec["layers"] == 1 and sec["factor"] < 0.8


def test_a_slice_of_a_sequential_result_says_what_to_do():
    """``result[:-1]`` (a feature extractor from an nn.Sequential) on the fx result: torch
    built the slice with the GraphModule class and it failed on its first call with
    ``AttributeError: 'GraphModuleImpl' object has no attribute '_backward_hooks'``; and its
    modules alone compute without the constants (alphas, lr multipliers, output scale).  It
    is refused with what to do; the slice of ``fold(result)`` computes the result's first
    layers, and an index still returns the module."""
    from precondfx.errors import PrecondError
    x, y = _data()
    model, rep = precondfx.precondition(_mlp(), x)
    assert rep.capture == "fx"
    precondfx.settle_rate(model, HIGH)          # lr multipliers far from 1
    with pytest.raises(PrecondError, match="fold"):
        model[:-1]
    assert isinstance(model[0], nn.Linear) and len(model) == 5
    folded = precondfx.fold(model)
    with torch.no_grad():
        torch.testing.assert_close(folded[-1](folded[:-1](x)), model(x), rtol=1e-5,
                                   atol=1e-5)
