"""The result trains exactly like the user's model with the planned weights and constants.

Each test builds a model with a construct a traced graph would lose (issue 12), preconditions it,
then builds the expected model independently: a deep copy of the user's model holding the
result's weights, with the output constant multiplied in by hand.  Outputs (train and eval mode)
and the gradient of every parameter after one backward pass must agree.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from torch import nn

import precondfx


class RoundSTE(torch.autograd.Function):
    """Straight-through rounding: round forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class STENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.b(RoundSTE.apply(4 * self.a(x)))


class Distill(nn.Module):
    """A frozen teacher run under no_grad (its parameters still require grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher, self.student = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        with torch.no_grad():
            h = torch.relu(self.teacher(x))
        return self.student(h)


class EnergyGrad(nn.Module):
    """Computes with grad on even when called under no_grad (e.g. an input-gradient model)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        with torch.enable_grad():
            return self.b(torch.relu(self.a(x)))


class TrainBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.training:
            h = h * 3.0 + 1.0
        return self.b(h)


class CountedLinear(nn.Linear):
    calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a, self.b = CountedLinear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = ckpt.checkpoint(self.a, x, use_reentrant=self.reentrant)
        return self.b(torch.relu(h))


def _expected(model: nn.Module, result: nn.Module, scale: float) -> nn.Module:
    """The user's model holding the result's weights; ``scale`` multiplies its output."""
    ref = copy.deepcopy(model)
    sd = {k: v for k, v in result.state_dict().items() if "precondfx_" not in k}
    ref.load_state_dict(sd)
    ref.precond_scale = scale
    return ref


def _run(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = m(x)
    return out * getattr(m, "precond_scale", 1.0)


def _grads(m: nn.Module, x: torch.Tensor, t: torch.Tensor) -> dict[str, torch.Tensor | None]:
    m.zero_grad(set_to_none=True)
    (_run(m, x) * t).sum().backward()
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in m.named_parameters()}


def _precondition(model: nn.Module, x: torch.Tensor, **kw):
    # lr=None: no lr multipliers (lr='auto' puts one, at 1, on every re-drawn layer)
    res = precondfx.precondition(model, x, balance="none",
                                 **{"target_std": 0.05, "lr": None, **kw})
    others = [s for s in res.report.plan.scales if s.tag != "output"]
    assert not others, others  # only the output constant: the expected model multiplies it in
    return res


def _same_training(model: nn.Module, res, x: torch.Tensor) -> dict:
    """Outputs in train and eval mode and every gradient agree with the expected model."""
    ref = _expected(model, res.model, res.report.output_scale)
    t = torch.randn_like(_run(ref, x))
    for train in (True, False):
        ref.train(train)
        res.model.train(train)
        torch.testing.assert_close(res.model(x), _run(ref, x), rtol=1e-5, atol=1e-6)
    ref.train()
    res.model.train()
    want, got = _grads(ref, x, t), _grads(res.model, x, t)
    assert set(got) == set(want)
    for name, g in want.items():
        if g is None:
            assert got[name] is None, f"{name} gets a gradient; the user's model gives none"
        else:
            assert got[name] is not None, f"{name} gets no gradient"
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7)
    return want


def test_custom_autograd_function_keeps_its_backward():
    torch.manual_seed(0)
    model, x = STENet(), torch.randn(16, 6)
    res = _precondition(model, x)
    want = _same_training(model, res, x)
    # round() has zero gradient: a graph that traced through the Function gives `a` none
    assert want["a.weight"].abs().max() > 1e-3
    assert any("RoundSTE" in n for n in res.report.capture_notes)
    assert not isinstance(res.model, torch.fx.GraphModule)


def test_no_grad_block_stays_no_grad():
    torch.manual_seed(0)
    model, x = Distill(), torch.randn(16, 6)
    res = _precondition(model, x)
    want = _same_training(model, res, x)
    assert want["teacher.weight"] is None and want["student.weight"] is not None
    assert any("grad mode" in n for n in res.report.capture_notes)


def test_enable_grad_block_stays_enabled():
    torch.manual_seed(0)
    model, x = EnergyGrad(), torch.randn(16, 6)
    res = precondfx.precondition(model, x, balance="none", target_std=None, lr=None)
    assert not res.report.plan.scales
    ref = _expected(model, res.model, 1.0)
    t = torch.randn(16, 3)
    for m in (ref, res.model):
        with torch.no_grad():  # the user's model still builds a graph here
            out = m(x)
        (out * t).sum().backward()
    for (name, p), q in zip(ref.named_parameters(), res.model.parameters()):
        assert p.grad is not None and p.grad.abs().max() > 0
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7)
    assert any("grad mode" in n for n in res.report.capture_notes)


def test_training_branch_follows_the_mode():
    torch.manual_seed(0)
    model, x = TrainBranch(), torch.randn(16, 6)
    res = _precondition(model, x)
    _same_training(model, res, x)
    res.model.train()
    y_train = res.model(x)
    res.model.eval()
    assert (res.model(x) - y_train).abs().max() > 1e-3  # the two behaviours stay distinct
    assert any("train and eval" in n for n in res.report.capture_notes)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_is_kept(reentrant):
    torch.manual_seed(0)
    model, x = Checkpointed(reentrant), torch.randn(16, 6)
    res = _precondition(model, x)
    _same_training(model, res, x)
    m = res.model
    m.train()
    m.a.calls = 0
    m(x.requires_grad_(reentrant)).sum().backward()
    assert m.a.calls == 2  # forward, then the recomputation during backward
    assert any("checkpoint" in n for n in res.report.capture_notes)


def test_module_left_in_eval_stays_in_eval():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():  # running statistics that differ from any batch's
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    model.train()
    model[1].eval()  # the user froze this BatchNorm
    x = torch.randn(16, 6)
    res = _precondition(model, x)
    assert res.model.training and not res.model.get_submodule("1").training
    ref = _expected(model, res.model, res.report.output_scale)
    assert ref.training and not ref[1].training
    torch.testing.assert_close(res.model(x), _run(ref, x), rtol=1e-5, atol=1e-6)
    t = torch.randn(16, 3)
    want, got = _grads(ref, x, t), _grads(res.model, x, t)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(res.model.get_submodule("1").running_mean, ref[1].running_mean)
    # calibrated in the modes it trains in: the output std is the target there
    with torch.no_grad():
        assert float(res.model(x).double().std(correction=0)) == pytest.approx(0.05, rel=1e-5)
    # a BatchNorm flipped to train mode would normalize with the batch's statistics instead
    res.model.get_submodule("1").train()
    assert (res.model(x) - _run(ref, x)).abs().max() > 1e-3


class NoisyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return F.dropout(torch.relu(self.lin(x)), 0.5, training=self.training)


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.frozen, self.live, self.out = (nn.Linear(6, 16), NoisyBlock(), NoisyBlock(),
                                                      nn.Linear(16, 3))

    def forward(self, x):
        return self.out(self.live(self.frozen(self.inp(x))))


def test_functional_dropout_follows_its_own_module():
    torch.manual_seed(0)
    model, x = TwoBlocks(), torch.randn(64, 6)
    model.train()
    model.frozen.eval()  # the user switched this block's dropout off
    res = _precondition(model, x)
    assert isinstance(res.model, torch.fx.GraphModule)
    ref = _expected(model, res.model, res.report.output_scale)
    # `live` drops half its units in both, `frozen` none: same draws, same outputs
    torch.manual_seed(1)
    want = _run(ref, x)
    torch.manual_seed(1)
    torch.testing.assert_close(res.model(x), want, rtol=1e-5, atol=1e-6)
    ref.live.eval()
    res.model.get_submodule("live").eval()
    torch.testing.assert_close(res.model(x), _run(ref, x), rtol=1e-5, atol=1e-6)


class Counting(nn.Module):
    """Python-side state updated by forward (a step counter, a log)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)
        self.steps, self.seen = 0, []

    def forward(self, x):
        self.steps += 1
        self.seen.append(x.shape[0])
        return self.b(torch.relu(self.a(x)))


def test_python_side_effects_are_kept():
    torch.manual_seed(0)
    model, x = Counting(), torch.randn(16, 6)
    res = _precondition(model, x)
    assert (model.steps, model.seen) == (0, [])  # precondition left the user's model alone
    _same_training(model, res, x)
    m = res.model
    start = m.steps
    for n in (3, 5):
        m(x[:n])
    assert m.steps == start + 2 and m.seen[-2:] == [3, 5]
    assert any("Python state" in n for n in res.report.capture_notes)


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 16), nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = self.a(x) if x.mean() > 0 else self.b(x)
        return self.head(torch.relu(h))


@pytest.mark.parametrize("capture", ["eager", None])
def test_untaken_branch_is_reported(capture):
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(16, 6).abs()  # takes the `a` branch
    kw = {"capture": capture} if capture else {}
    res = _precondition(model, x, **kw)
    notes = [n for n in res.report.capture_notes if "never used" in n]
    assert len(notes) == 1 and "b.weight" in notes[0] and "b.bias" in notes[0]
    assert "a.weight" not in notes[0]
    # what the note says: `b` keeps its values, `a` was re-initialized
    torch.testing.assert_close(res.model.b.weight, model.b.weight, rtol=0, atol=0)
    assert (res.model.a.weight - model.a.weight).abs().max() > 1e-3
    _same_training(model, res, x)
    _same_training(model, res, -x)  # the other branch computes as the user's model does


def test_embedding_padding_row_stays_zero():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8, padding_idx=0), nn.Flatten(), nn.Linear(40, 3))
    x = torch.randint(0, 10, (16, 5))
    x[:, 0] = 0
    res = _precondition(model, x)
    w = res.model.get_submodule("0").weight
    assert torch.equal(w[0], torch.zeros(8))
    assert bool((w[1:] != 0).all())
    std = res.report.plan.inits["0.weight"].std
    # the rows that train have the planned second moment
    assert float(w[1:].detach().double().pow(2).mean()) == pytest.approx(std ** 2, rel=1e-5)
    opt = torch.optim.SGD(res.model.parameters(), lr=0.5)
    res.model(x).square().sum().backward()
    opt.step()
    assert torch.equal(w[0], torch.zeros(8))


class Spectral(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(8, 32), nn.Linear(32, 4)
        self.w = nn.Parameter(torch.randn(32, 32, dtype=torch.cfloat) / 6)

    def forward(self, x):
        h = torch.relu(self.a(x)).to(torch.cfloat) @ self.w
        return self.head(h.abs())


def test_complex_weight_draws_real_and_imaginary_parts():
    torch.manual_seed(0)
    model, x = Spectral(), torch.randn(32, 8)
    res = _precondition(model, x)
    w = res.model.w.detach()
    std = res.report.plan.inits["w"].std
    assert float(w.abs().double().pow(2).mean()) == pytest.approx(std ** 2, rel=1e-5)
    half = std / 2 ** 0.5  # E|w|^2 split evenly between the parts
    assert float(w.real.std()) == pytest.approx(half, rel=0.1)
    assert float(w.imag.std()) == pytest.approx(half, rel=0.1)
    _same_training(model, res, x)


class SDPANet(nn.Module):
    """Attention written with scaled_dot_product_attention and its own dropout_p."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 4)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5 if self.training else 0.0)
        return self.out(h)


@pytest.mark.parametrize("make", [
    lambda: nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.3, batch_first=True),
                          nn.Linear(16, 4)),
    SDPANet,
], ids=["TransformerEncoderLayer", "sdpa"])
def test_calibration_is_deterministic_with_attention_dropout(make):
    torch.manual_seed(0)
    model, x = make(), torch.randn(8, 5, 16)
    scales = []
    for _ in range(3):
        res = precondfx.precondition(model, x, seed=0, balance="none", target_std=0.05)
        scales.append(res.report.output_scale)
        assert res.report.output_std_after == pytest.approx(0.05, rel=1e-6)
    assert scales[0] == scales[1] == scales[2]
    # the calibrated std is the one of a dropout-free train-mode pass of the result
    m = res.model.train()
    for mod in m.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
        if isinstance(mod, nn.MultiheadAttention):
            mod.dropout = 0.0
    if isinstance(model, SDPANet):
        m.eval()  # the only randomness is attention dropout, off in eval
    with torch.no_grad():
        assert float(m(x).double().std(correction=0)) == pytest.approx(0.05, rel=1e-5)
