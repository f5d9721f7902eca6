"""lr='auto' and calibration, fifth hunt: parameter groups at different rates, modules whose
class name says 'Dropout' but hold layers.  Each test compares numbers that differed before
its fix."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from precondfx.pytorch.calibrate import is_stochastic, quiet_run
from tests.pytorch.test_first_step import _data, _mlp, _train


def test_a_head_group_at_a_far_higher_rate_is_lowered_for_its_own_rate():
    """One SGD optimizer, the body at 0.01 and the head at 50: the ceiling was read from the
    group holding most of the layers' weights (the body, 0.01), nothing was lowered and the
    loss went 2.84 -> 28.4 -> 51.8 in the first steps.  Now each layer's rate is read from its
    own group: the head's storage is lowered for 50 (factor 0.14), the body's kept, and the loss
    falls from the first step (2.84 -> 2.50 -> 2.33)."""
    x, _ = _data()
    model, rep = precondfx.precondition(_mlp(), x)
    head = model[4]
    body = [p for n, p in model.named_parameters() if not n.startswith("4.")]
    opt = torch.optim.SGD([{"params": body, "lr": 0.01},
                           {"params": head.parameters(), "lr": 50.0}])
    losses = _train(model, opt, 20)
    sec = rep.conditioning["lr_target"]
    assert max(losses[1:5]) < losses[0], losses         # 51.8 before
    assert sec["factor"] < 0.5, sec["summary"]          # 1.0 before
    by_group = {g["group"]: g["factor"] for g in sec["groups"]}
    assert by_group[0] == 1.0 and by_group[1] < 0.5     # the body at 0.01 keeps its storage


def test_groups_at_one_rate_below_the_ceiling_keep_the_storage():
    """The same two groups both at 0.01 (below the suggested rate): nothing changes."""
    x, _ = _data()
    model, rep = precondfx.precondition(_mlp(), x)
    w = model[4].weight.detach().clone()
    body = [p for n, p in model.named_parameters() if not n.startswith("4.")]
    opt = torch.optim.SGD([{"params": body, "lr": 0.01},
                           {"params": model[4].parameters(), "lr": 0.01}])
    _train(model, opt, 1)
    assert rep.conditioning["lr_target"]["factor"] == 1.0


class MLPWithDropout(nn.Module):
    """A user's model whose class name says 'Dropout': it holds layers and a hand-written
    batch normalization that reads its own ``training`` flag."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(20, 64), nn.Linear(64, 10)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("rm", torch.zeros(64))
        self.register_buffer("rv", torch.ones(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x) + 3.0
        h = F.batch_norm(h, self.rm, self.rv, training=self.training)
        return self.fc2(self.drop(F.relu(h)))


def test_a_model_class_named_with_dropout_is_not_dropout():
    """``MLPWithDropout`` (parameters, children) was taken for dropout: calibration and the
    measurements forced its own ``training`` flag off, so its forward ran in eval mode there
    (its batch norm on running statistics).  Only torch's dropout classes and parameter-free
    leaves whose name says so are dropout now."""
    torch.manual_seed(0)
    m = MLPWithDropout()
    assert not is_stochastic(m)
    assert is_stochastic(m.drop)
    with quiet_run(m, "train"):
        assert m.training and not m.drop.training
    x, _ = _data()
    res, _ = precondfx.precondition(MLPWithDropout(), x)
    res.train()
    res.drop.p = 0.0
    with torch.no_grad():
        std = res(x).std().item()
    assert 0.5 < std < 2.0, std


def test_calibration_eval_with_a_loop_in_train_mode_measures_the_train_function():
    """``calibration='eval'`` (a batch too small for batch statistics at precondition), then a
    loop in train mode: the first step measured the eval-mode function (running statistics
    the loop never uses).  The first step measures each module in the mode the loop trains
    it in, whatever the calibration mode."""
    from tests.pytorch.test_first_step_hunt3 import _bn_mlp
    from precondfx.pytorch import first_step
    from precondfx.pytorch.measure.suggest import suggest_lr
    x, y = _data()
    model, rep = precondfx.precondition(_bn_mlp(), x, calibration="eval")
    model.train()
    kept = model.__dict__[first_step.ATTR].sample
    by_hand = {m: suggest_lr(model, kept, mode=m, families=("sgd",))["sgd"]
               for m in ("eval", "train")}
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    sec = rep.conditioning["lr_target"]
    assert abs(by_hand["train"] / by_hand["eval"] - 1) > 0.5, by_hand
    assert abs(sec["suggested_before"] / by_hand["train"] - 1) < 1e-6, (sec, by_hand)


def test_a_group_at_rate_zero_beside_a_high_rate_keeps_its_layers_and_lowers_the_others():
    """A group at rate 0 (layers frozen by their rate) beside the rest at a rate above the
    ceiling: the frozen group's layers keep their storage, the others are lowered."""
    x, _ = _data()
    model, rep = precondfx.precondition(_mlp(), x)
    w0 = model[0].weight.detach().clone()
    rest = [p for n, p in model.named_parameters() if not n.startswith("0.")]
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.0},
                           {"params": rest, "lr": 50.0}])
    _train(model, opt, 1)
    sec = rep.conditioning["lr_target"]
    assert sec["factor"] < 0.5, sec["summary"]
    assert sec["still"] == ["0.weight"]
    assert torch.equal(model[0].weight.detach(), w0)
