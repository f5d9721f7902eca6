"""lr='auto' (precondfx.pytorch.first_step), third hunt: a model fine-tuned in eval mode, a
model cast in parts whose batch holds an additive mask.  Each test compares numbers that
differed before its fix."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from precondfx.pytorch import first_step
from precondfx.pytorch.measure.suggest import suggest_lr
from tests.pytorch.test_first_step import _data


def _bn_mlp() -> nn.Module:
    """An MLP with BatchNorm whose running statistics are far from the batch's (a
    pretrained network: the statistics of another data set)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(),
                        nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.running_mean.copy_(torch.rand(64, generator=g) * 2 - 1)
                m.running_var.copy_(torch.rand(64, generator=g) * 0.3 + 0.05)
    return net


def test_a_model_fine_tuned_in_eval_mode_is_measured_in_eval_mode():
    """``model.eval()`` before the loop (fine-tuning with frozen BatchNorm statistics): the
    first step measured the curvature with batch statistics (the calibration mode), a
    function the loop never trains, and set the ceiling for it.  The suggested rate it acts
    on is now the eval-mode function's, as measured by hand on the kept batch."""
    x, y = _data()
    model, rep = precondfx.precondition(_bn_mlp(), x)
    model.eval()
    kept = model.__dict__[first_step.ATTR].sample
    by_hand = {m: suggest_lr(model, kept, mode=m, families=("sgd",))["sgd"]
               for m in ("eval", "train")}
    assert abs(by_hand["eval"] / by_hand["train"] - 1) > 0.5    # the two functions differ
    lr = 4 * max(by_hand.values())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    sec = rep.conditioning["lr_target"]
    assert sec["suggested_before"] == pytest.approx(by_hand["eval"], rel=1e-6)
    assert sec["factor"] < 0.6
    assert not model.training and not any(m.training for m in model.modules())


class _MaskedAttention(nn.Module):
    """One attention block over padded sequences, its scores' softmax computed in float32
    with the additive mask passed in (the way a model run with a float16 body is written)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.qkv = nn.Linear(16, 32), nn.Linear(32, 96)
        self.out, self.head = nn.Linear(32, 32), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        q, k, v = self.qkv(h).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / 32 ** 0.5
        att = (scores.float() + mask).softmax(-1).to(v.dtype)
        h = h + self.out(att @ v)
        return self.head(h.float().mean(1))


def test_a_float16_body_keeps_a_minus_1e9_mask_finite():
    """``model.half(); model.head.float()`` with an additive mask of -1e9 on padded
    positions in the kept batch: the batch was cast to the body's float16 whole, the mask's
    -1e9 became -inf, the rows masked whole gave NaN, and the first step kept the storage
    (factor 1, 'suggested sgd rate not measurable', no warning) at 25x the suggested rate.
    The mask now stays in its float32 (the cast would overflow it) and the factor is the
    float32 model's."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 10, 16, generator=g), torch.randint(0, 5, (16,), generator=g)
    pad = torch.arange(10)[None] >= torch.randint(3, 11, (16,), generator=g)[:, None]
    mask = torch.zeros(16, 10, 10).masked_fill(pad[:, None, :] | pad[:, :, None], -1e9)
    secs = []
    for dtype in (torch.float32, torch.float16):
        model, rep = precondfx.precondition(_MaskedAttention(), (x,),
                                            forward_kwargs={"mask": mask})
        model.to(dtype)
        model.head.float()
        opt = torch.optim.SGD(model.parameters(), lr=5.0)
        out = model(x.to(dtype), mask)
        assert torch.isfinite(out).all()            # the user's loop computes
        F.cross_entropy(out, y).backward()
        opt.step()
        secs.append(rep.conditioning["lr_target"])
    assert secs[0]["factor"] < 0.5
    assert secs[1]["suggested_before"] is not None
    assert secs[1]["factor"] == pytest.approx(secs[0]["factor"], rel=2e-3)


class _CastsItsMask(_MaskedAttention):
    """The same block, the mask cast to the scores' dtype (the user passes a float16 mask
    built with float16's minimum; the calibration batch had float32's, as built for the
    float32 model)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        q, k, v = self.qkv(h).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / 32 ** 0.5
        att = (scores + mask.to(scores.dtype)).softmax(-1)
        return self.head((h + self.out(att @ v)).float().mean(1))


def test_a_rate_not_measurable_at_the_first_step_is_said():
    """The kept float32 mask (float32's minimum on padded positions) reaches a float16 body
    that casts it: -inf, NaN on the rows masked whole, no rate.  The first step kept the
    storage with no word but 'not measurable' in the report, while the loop, given a
    float16 mask, trained at 5 (34x the float32 model's suggested rate, 0.145).  It now warns,
    naming the dtypes and what to do."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 10, 16, generator=g), torch.randint(0, 5, (16,), generator=g)
    pad = torch.arange(10)[None] >= torch.randint(3, 11, (16,), generator=g)[:, None]
    masked = pad[:, None, :] | pad[:, :, None]
    mask = torch.zeros(16, 10, 10).masked_fill(masked, torch.finfo(torch.float32).min)
    model, rep = precondfx.precondition(_CastsItsMask(), (x,), forward_kwargs={"mask": mask})
    model.half()
    model.head.float()
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    mask16 = torch.zeros(16, 10, 10, dtype=torch.float16).masked_fill(
        masked, torch.finfo(torch.float16).min)
    out = model(x.half(), mask16)
    assert torch.isfinite(out).all()
    F.cross_entropy(out, y).backward()
    with pytest.warns(RuntimeWarning, match="not measurable") as got:
        opt.step()
    said = [str(w.message) for w in got if "not measurable" in str(w.message)][0]
    assert "float16" in said and "settle_rate" in said
    assert rep.conditioning["lr_target"]["factor"] == 1.0
