"""lr='auto' (precondfx.pytorch.first_step) and the training loop, fourth hunt: the modes the
first step measures in, functional dropout, the user's hooks, clipping, schedulers and
optimizer flags.  Each test compares numbers that differed before its fix."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from precondfx.pytorch import first_step
from precondfx.pytorch.measure.suggest import suggest_lr
from tests.pytorch.test_first_step import _data, _mlp, _train
from tests.pytorch.test_first_step_hunt3 import _bn_mlp


def test_batchnorms_put_back_in_train_under_a_root_in_eval_are_measured_in_train():
    """``model.eval()`` then the BatchNorms put back in ``train()`` (the loop trains with
    batch statistics, the rest frozen in eval): the first step measured every module in eval
    mode (running statistics the loop never uses): suggested 0.017 for the 1.0 of the
    function trained, factor 0.018 at 4x that rate.  Now each module keeps its own flag."""
    x, y = _data()
    model, rep = precondfx.precondition(_bn_mlp(), x)
    model.eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.train()
    kept = model.__dict__[first_step.ATTR].sample
    by_hand = {m: suggest_lr(model, kept, mode=m, families=("sgd",))["sgd"]
               for m in ("eval", "train")}    # 'train': the whole model, as the BNs are here
    assert by_hand["train"] / by_hand["eval"] > 10
    lr = 4 * by_hand["train"]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    sec = rep.conditioning["lr_target"]
    assert sec["suggested_before"] == pytest.approx(by_hand["train"], rel=1e-6)
    assert 0.3 < sec["factor"] < 0.6        # about sqrt(1/4); 0.018 before
    flags = [m.training for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    assert flags == [True, True] and not model.training


class _InlineMasks(nn.Module):
    """An MLP whose dropout is written in forward, ``F.dropout(h, p, self.training)`` (as a
    transformers attention writes it): no ``nn.Dropout`` module for the mode to reach."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(20, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.relu(self.a(x)), 0.3, self.training)
        h = F.dropout(F.relu(self.b(h)), 0.3, self.training)
        return self.c(h)


def test_functional_dropout_is_off_while_the_rate_is_measured():
    """The eager result (the user's class) ran its functional dropout while the curvature
    was measured: every product drew its own masks, the suggested rate moved with the global
    seed (0.49 or 0.65 for 0.47) and lr='auto' took other steps than lr= (loss 2.5581 vs
    2.5582 at step 2).  Now it is the dropout-free function's, as the fx result's."""
    x, _ = _data()
    fx, rep_fx = precondfx.precondition(_InlineMasks(), x, capture="fx")
    rates = []
    eager, _ = precondfx.precondition(_InlineMasks(), x, capture="eager")
    kept = eager.__dict__[first_step.ATTR].sample
    for seed in (1, 2):
        torch.manual_seed(seed)
        rates.append(suggest_lr(eager, kept, families=("sgd",))["sgd"])
    assert rates[0] == pytest.approx(rates[1], rel=1e-9)
    kept = fx.__dict__[first_step.ATTR].sample
    assert rates[0] == pytest.approx(suggest_lr(fx, kept, families=("sgd",))["sgd"], rel=1e-6)
    auto, rep = precondfx.precondition(_InlineMasks(), x, capture="eager")
    told, rep_t = precondfx.precondition(_InlineMasks(), x, capture="eager", lr=2.0,
                                         optimizer="sgd")
    torch.manual_seed(5)
    la = _train(auto, torch.optim.SGD(auto.parameters(), lr=2.0), 4)
    torch.manual_seed(5)
    lt = _train(told, torch.optim.SGD(told.parameters(), lr=2.0), 4)
    assert rep.conditioning["lr_target"]["factor"] < 0.7
    assert rep.conditioning["lr_target"]["factor"] == \
        pytest.approx(rep_t.conditioning["lr_target"]["factor"], rel=1e-9)
    assert la == pytest.approx(lt, rel=1e-6)


@pytest.mark.parametrize("opt_class", [torch.optim.SGD, torch.optim.AdamW])
def test_an_optimizer_created_before_precondition_is_refused(opt_class):
    """``opt = SGD(model.parameters()); model, rep = precondition(model, x)``: the optimizer
    stepped the parameters of the model passed in (no gradients) and the returned copy never
    changed: loss 2.8389 at each of 5 steps, no warning, the report still 'pending'.  Now its
    first step says so; created after precondition, or with inplace=True, it trains."""
    from precondfx.errors import PrecondError
    x, y = _data()
    src = _mlp()
    opt = opt_class(src.parameters(), lr=0.05)
    model, _ = precondfx.precondition(src, x)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(PrecondError, match="parameters of the model you passed to precond"):
        opt.step()
    assert all(p.grad is None for p in src.parameters())
    if opt_class is not torch.optim.SGD:
        return
    # the original trained side by side with the result (its own gradients): not refused
    model, _ = precondfx.precondition(src, x)
    losses = {}
    for name, m in (("src", src), ("result", model)):
        o = opt_class(m.parameters(), lr=0.05) if name == "result" else opt
        losses[name] = _train(m, o, 3)
        assert losses[name][-1] < losses[name][0]
    src2 = _mlp()
    opt2 = opt_class(src2.parameters(), lr=0.05)
    same, _ = precondfx.precondition(src2, x, inplace=True)
    assert same is src2
    ls = _train(same, opt2, 3)
    assert ls[-1] < ls[0]
