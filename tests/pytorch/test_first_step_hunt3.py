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
