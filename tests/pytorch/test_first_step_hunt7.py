"""lr='auto' and the suggested SGD rate in real training loops (hunt 7): a segmentation net's
``(B, C, H, W)`` logits measured over the classes in dim 1 (not a softmax over W), a kept
batch of one measured in eval mode said as a warning with advice that fits lr='auto',
gradient accumulation said in the report, LBFGS's message, a rate set above a scheduler's
initial_lr before the first step, a later optimizer at a higher rate said."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev

import precondfx
from precondfx.core.outputs import class_dim
from precondfx.pytorch import first_step
from precondfx.pytorch.capture.common import Sample
from precondfx.pytorch.measure.suggest import suggest_lr


class Seg(nn.Module):
    """A small segmentation net: 1x1 conv head to ``classes`` channels, optionally upsampled
    (an FCN) or permuted channels-last."""

    def __init__(self, classes: int = 5, up: bool = False, last: bool = False) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1, stride=2 if up else 1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Conv2d(8, classes, 1)
        self.up, self.last = up, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.head(F.relu(self.c2(F.relu(self.c1(x)))))
        if self.up:
            z = F.interpolate(z, scale_factor=2, mode="bilinear", align_corners=False)
        return z.permute(0, 2, 3, 1) if self.last else z


def _ce_dim1_rate(model: nn.Module, x: torch.Tensor) -> float:
    """1 / the top eigenvalue of the Gauss-Newton matrix of F.cross_entropy over dim 1 (mean
    over pixels), built densely from the Jacobian: independent of suggest_lr's products."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def rows(p: dict) -> torch.Tensor:
        z = functional_call(model, p, (x,))
        return z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
    z = rows(params).double()
    jac = jacrev(rows)(params)
    j = torch.cat([jac[n].reshape(z.numel(), -1) for n in params], 1).double()
    n, c = z.shape
    prob = torch.softmax(z, -1)
    h = torch.block_diag(*[torch.diag(pr) - torch.outer(pr, pr) for pr in prob])
    lam = torch.linalg.eigvalsh(j.T @ h @ j / n)[-1].item()
    return 1.0 / lam


def test_segmentation_logits_are_measured_over_the_classes_in_dim_1():
    """A conv net ending in a 1x1 conv to 5 classes, trained with F.cross_entropy over dim 1:
    the suggested rate read the (4, 5, 8, 8) logits as rows of a softmax over W: 1.20 where
    the curvature of the cross-entropy over dim 1 gives 0.279; now 0.279."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    result, rep = precondfx.precondition(Seg(), x, suggest_lr=True, lr=None)
    ref = _ce_dim1_rate(result, x)
    got = rep.suggested_lr["sgd"]
    assert abs(got / ref - 1) < 0.03, (got, ref)
    assert "dim 1" in rep.conditioning["suggested_lr"]["loss"]


def test_lr_auto_ceiling_on_segmentation_logits_is_the_dim_1_curvature():
    """lr='auto' at SGD lr=1 on the same net: the first step read 1.53 (no factor below it at
    1.0) where the cross-entropy over dim 1 gives 0.30: the ceiling now lowers the rate to it."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 8, 8)
    y = torch.randint(0, 5, (8, 8, 8))
    result, rep = precondfx.precondition(Seg(), x)
    ref = _ce_dim1_rate(result, x)
    opt = torch.optim.SGD(result.parameters(), lr=1.0, momentum=0.9)
    F.cross_entropy(result(x), y).backward()
    opt.step()
    sec = rep.conditioning["lr_target"]
    assert abs(sec["suggested_before"] / ref - 1) < 0.03, (sec["suggested_before"], ref)
    assert sec["factor"] < 0.8, sec["summary"]


def test_class_dim_follows_the_layout_of_the_main_output():
    """Dim 1 of a convolution's output through an upsampling; the last dim of the same output
    permuted channels-last, of a language model's (B, T, V) logits and of a classifier."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    res, _ = precondfx.precondition(Seg(up=True), x)
    graph = res.__dict__[first_step.ATTR].graph
    assert class_dim(graph, tuple(res(x).shape)) == 1
    res_l, _ = precondfx.precondition(Seg(last=True), x)
    g_l = res_l.__dict__[first_step.ATTR].graph
    assert class_dim(g_l, tuple(res_l(x).shape)) == -1

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.out = nn.Embedding(11, 16), nn.Linear(16, 11)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(torch.relu(self.emb(ids)))
    ids = torch.randint(0, 11, (4, 6))
    lm, _ = precondfx.precondition(LM(), ids)
    assert class_dim(lm.__dict__[first_step.ATTR].graph, (4, 6, 11)) == -1
    # an LM's rate unchanged by the rule: rows over the vocabulary, as before
    a = suggest_lr(lm, Sample((ids,), {}), families=("sgd",))["sgd"]
    b = suggest_lr(lm, Sample((ids,), {}), families=("sgd",),
                   graph=lm.__dict__[first_step.ATTR].graph)["sgd"]
    assert a == b


def test_a_kept_batch_of_one_measured_in_eval_mode_warns_with_advice_for_lr_auto():
    """calibration='eval' on one sample with a train-mode BatchNorm, trained in train mode at
    SGD lr=1: the first step measured the eval-mode function on that sample (0.16, where the
    train-mode function the loop trains gives 2.7 on a batch of 32) and said so only in the
    report, as if it were what lr= does.  Now a warning says it and advises a calibration
    batch of at least two samples."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
    result, rep = precondfx.precondition(model, torch.randn(1, 8), calibration="eval")
    result.train()
    opt = torch.optim.SGD(result.parameters(), lr=1.0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        F.cross_entropy(result(torch.randn(4, 8)), torch.tensor([0, 1, 2, 3])).backward()
        opt.step()
    text = [str(w.message) for w in said if "eval mode" in str(w.message)]
    assert text, [str(w.message) for w in said]
    assert "at least two samples" in text[0] and "lr='auto'" in text[0]
    assert "at least two samples" in rep.conditioning["lr_target"]["warning"]


def test_gradient_accumulation_without_dividing_is_said_in_the_report():
    """4 micro-batches summed per step, the loss not divided by 4, SGD lr=0.5: the ceiling
    reads 0.5, not 2.0 (the optimizer cannot show k); the report said nothing of it.  Now its
    section says the rate read and what to do (divide the loss, or settle_rate with k * lr);
    settle_rate(model, 4 * 0.5) gives the storage lr=2.0 would (factor equal to 1e-6)."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 20), torch.randint(0, 10, (64,))

    def make() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))
    result, rep = precondfx.precondition(make(), x)
    opt = torch.optim.SGD(result.parameters(), lr=0.5)
    for part in x.chunk(4):
        F.cross_entropy(result(part), y[:16]).backward()
    opt.step()
    sec = rep.conditioning["lr_target"]
    assert "0.5" in sec["rate_read"] and "k * lr" in sec["rate_read"], sec
    assert "settle_rate" in sec["summary"]
    settled, rep2 = precondfx.precondition(make(), x)
    sec2 = precondfx.settle_rate(settled, 4 * 0.5)
    told, rep3 = precondfx.precondition(make(), x, lr=2.0, optimizer="sgd")
    assert abs(sec2["factor"] / rep3.conditioning["lr_target"]["factor"] - 1) < 1e-6


def test_an_lbfgs_first_step_says_why_without_advice_that_is_refused():
    """LBFGS with a closure: the first step kept the storage and said "under Adam-family
    optimizers ...; other optimizers: pass lr= and optimizer= to set it", but optimizer=
    refuses LBFGS (PrecondError).  Now it says LBFGS is neither SGD nor Adam-family and gives
    no advice that precondition refuses; an AdamW still reads as before."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 20), torch.randint(0, 10, (32,))
    net = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 10))
    result, rep = precondfx.precondition(net, x)
    opt = torch.optim.LBFGS(result.parameters(), lr=1.0, max_iter=2)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(result(x), y)
        loss.backward()
        return loss
    opt.step(closure)
    kept = rep.conditioning["lr_target"]["kept"]
    assert "neither SGD nor Adam-family" in kept and "optimizer= to set it" not in kept
    try:
        precondfx.precondition(net, x, lr=1.0, optimizer=opt)
        refused = False
    except precondfx.PrecondError:
        refused = True
    assert refused


def test_a_rate_set_above_a_schedulers_initial_lr_before_the_first_step_is_the_peak():
    """A sweep reusing its set-up: SGD(lr=0.1) with a CosineAnnealingLR, then every group's lr
    set to 4.0 before training.  The first step read initial_lr (0.1): no factor (1.0), a
    'raised' warning, and the loss rose mid-run (0.94 -> 1.84 -> 2.36) where the same loop
    built at lr=4.0 falls steadily (factor 0.34).  Now the first step takes the larger of
    initial_lr and lr: the same factor and losses as the loop built at 4.0."""
    x, y = torch.randn(128, 20), torch.randint(0, 10, (128,))

    def make() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                             nn.Linear(64, 10))

    def run(set_later: bool) -> tuple[float, list[float], list[str]]:
        model, rep = precondfx.precondition(make(), x)
        opt = torch.optim.SGD(model.parameters(), lr=0.1 if set_later else 4.0, momentum=0.9)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30)
        if set_later:
            for g in opt.param_groups:
                g["lr"] = 4.0
        losses = []
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for _ in range(8):
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                sched.step()
                losses.append(float(loss))
        raised = [str(w.message) for w in said if "decided at the first step" in str(w.message)]
        return rep.conditioning["lr_target"]["factor"], losses, raised

    f_set, l_set, raised = run(True)
    f_built, l_built, _ = run(False)
    assert f_built < 0.6
    assert abs(f_set / f_built - 1) < 1e-6, (f_set, f_built)
    assert max(abs(a - b) for a, b in zip(l_set, l_built)) < 1e-5, (l_set, l_built)
    assert not raised, raised


def test_a_later_optimizer_at_a_higher_rate_is_said_not_silent():
    """Two phases, each with its own optimizer: SGD at 0.01 for 3 steps (below the ceiling:
    storage kept), then a new SGD at 4.0.  The second trained without the ceiling and said
    nothing: the loss went 2.68 -> 3.68 where an optimizer at 4.0 from the start falls
    steadily.  Now a warning and the report's 'raised' say it once, with what to do; a new
    optimizer at the first one's rate (rebuilt per epoch) says nothing."""
    x, y = torch.randn(128, 20), torch.randint(0, 10, (128,))

    def make() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                             nn.Linear(64, 10))

    def phases(model: nn.Module, rates: list[float]) -> list[str]:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for lr in rates:
                opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
                for _ in range(2):
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
        return [str(w.message) for w in said if "later optimizer" in str(w.message)]

    model, rep = precondfx.precondition(make(), x)
    said = phases(model, [0.01, 4.0, 4.0])
    assert len(said) == 1 and "lr= (the highest rate" in said[0], said
    assert "later optimizer" in rep.conditioning["lr_target"]["raised"]
    again, rep2 = precondfx.precondition(make(), x)
    assert phases(again, [0.01, 0.01, 0.01]) == []
    assert "raised" not in rep2.conditioning["lr_target"]
