"""Measurements that cannot be fooled: statistics are taken on copies made when a tensor is
produced, the model never sees the user's own sample tensors, and calibration, analysis and
measurement runs leave no trace on the model (modes, buffers, Python state, renormalized
weights).  Every reference value here comes from plain forward hooks and torch code, not from
precondfx."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import precondfx


class InplaceCNN(nn.Module):
    """Conv -> ReLU(inplace) twice, a Linear whose output is scaled in place (``mul_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.r1 = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True)
        self.c2, self.r2 = nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True)
        self.fc = nn.Linear(8 * 8 * 8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.r2(self.c2(self.r1(self.c1(x))))
        h = self.fc(h.flatten(1)).mul_(2.0)
        return self.head(h.div_(0.5))


def hooked_variances(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """Population variance of each Conv/Linear output, cloned in a forward hook.  The layer
    producing the main output carries the output scale (a loss computed inside forward must
    see it); its variance is read before that scale, as LSUV fits it."""
    got: dict[str, float] = {}
    hs = [m.register_forward_hook(
        lambda mod, i, o, n=n, c=float(getattr(m, "precondfx_output_scale", 1.0)):
        got.__setitem__(n, float((o.detach().clone().double() / c).var(correction=0))))
          for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        with torch.no_grad():
            model(x.clone())
    finally:
        for h in hs:
            h.remove()
    return got


@pytest.mark.parametrize("capture", ["fx", "eager"])
def test_lsuv_reports_the_variance_an_independent_hook_sees(capture):
    torch.manual_seed(0)
    m, x = InplaceCNN(), torch.randn(16, 3, 8, 8)
    res = precondfx.precondition(m, x, scheme="lsuv", capture=capture, balance="none")
    assert res.report.capture == capture
    sites = res.report.conditioning["lsuv"]["sites"]
    truth = hooked_variances(res.model, x)
    assert [s["module"] for s in sites] == ["c1", "c2", "fc", "head"]
    for s in sites:
        ref = truth[s["module"]]
        assert s["variance"] == pytest.approx(ref, rel=1e-5), (s["node"], s["variance"], ref)
        assert abs(ref - 1.0) < 0.1, (s["node"], ref)  # really unit variance, not just reported


def test_sample_changed_in_place_by_forward_is_not_the_users_tensor():
    class Halve(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(6, 12), nn.Linear(12, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.div_(2.0)  # the user's forward changes its input in place
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(1)
    x = torch.randn(32, 6)
    x0 = x.clone()
    res = precondfx.precondition(Halve(), x, balance="hessian", balance_samples=4,
                                 target_std=0.05)
    assert torch.equal(x, x0)  # the user's tensor is untouched
    # calibration saw the batch the user passed: the result's output std is the target on it
    with torch.no_grad():
        y = res.model(x.clone())
    assert float(y.double().std(correction=0)) == pytest.approx(0.05, rel=1e-4)
    assert torch.equal(x, x0)


class Stateful(nn.Module):
    """A max_norm embedding (forward renormalizes its rows in place), a Python counter and a
    list the forward appends to, a BatchNorm the user put in eval inside a training model."""

    def __init__(self, python_state: bool = True) -> None:
        super().__init__()
        self.python_state = python_state  # off: a forward fx can keep in a GraphModule
        self.emb = nn.Embedding(20, 8, max_norm=1.0)
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)
        self.calls = 0
        self.cache: list[torch.Tensor] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.python_state:
            self.calls += 1
            self.cache.append(ids[:1])
        h = self.emb(ids).mean(1)
        return self.out(self.bn(torch.relu(self.fc(h))))


def _state(m: nn.Module) -> tuple:
    return ({k: v.clone() for k, v in m.state_dict().items()},
            {n: x.training for n, x in m.named_modules()}, (m.calls, len(m.cache)))


def _same(a: tuple, b: tuple) -> None:
    assert a[0].keys() == b[0].keys()
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k
    assert a[1] == b[1]
    assert a[2] == b[2]


def _stateful(python_state: bool = True) -> tuple[Stateful, torch.Tensor]:
    torch.manual_seed(2)
    m = Stateful(python_state)
    with torch.no_grad():
        m.emb.weight.mul_(5.0)  # rows far above max_norm: any forward would renormalize them
    m.bn.eval()
    return m, torch.randint(0, 20, (16, 5))


def test_analyze_is_side_effect_free():
    m, ids = _stateful()
    before = _state(m)
    assert float(m.emb.weight.detach().norm(dim=1).min()) > 1.5
    precondfx.analyze(m, ids)
    _same(before, _state(m))


@pytest.mark.parametrize("capture", ["fx", "eager"])
def test_precondition_with_measure_leaves_the_users_model_alone(capture):
    # a GraphModule cannot keep the Python counter (fx refuses it), so the fx case goes without
    m, ids = _stateful(python_state=capture != "fx")
    before = _state(m)
    res = precondfx.precondition(m, ids, capture=capture, measure=True, balance_samples=4)
    assert isinstance(res.model, torch.fx.GraphModule) == (capture == "fx")
    _same(before, _state(m))


def test_preserved_restores_modes_attributes_buffers_and_renormed_weights():
    from precondfx.pytorch.calibrate import preserved
    m, ids = _stateful()
    ref = copy.deepcopy(m)
    before = _state(m)
    with preserved(m):
        m.train()
        m(ids)
        m.extra_flag = True
    _same(before, _state(m))
    assert not hasattr(m, "extra_flag")
    for (k, v), (_, w) in zip(m.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(v, w), k


def test_runs_leave_the_global_random_generator_where_it_was():
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 12), nn.Linear(12, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x + 0.1 * torch.randn_like(x))))

    x = torch.randn(16, 6)
    torch.manual_seed(123)
    expected = torch.rand(3)  # the user's next draw without precondfx in between
    m1, m2 = Noisy(), Noisy()
    for run in (lambda: precondfx.analyze(m1, x),
                lambda: precondfx.precondition(m2, x, measure=True, balance_samples=4)):
        torch.manual_seed(123)
        run()
        assert torch.equal(torch.rand(3), expected)


def test_measured_statistics_respect_a_frozen_batchnorm_in_a_training_model():
    from precondfx.pytorch.balance import measured_statistics
    from precondfx.pytorch.capture.common import make_sample

    torch.manual_seed(3)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    with torch.no_grad():  # running statistics far from a sample's own: the modes differ
        m[1].running_mean.fill_(0.7)
        m[1].running_var.fill_(5.0)
    m.train()
    m[1].eval()  # the user froze the BatchNorm
    s = make_sample(torch.randn(8, 3, 6, 6))
    w = ["0.weight", "4.weight"]
    got = measured_statistics(m, s, w, n_samples=4, mode="train")["values"]
    ref_model = copy.deepcopy(m).eval()  # every module as it will train: BN in eval
    ref = measured_statistics(ref_model, s, w, n_samples=4, mode="eval")["values"]
    flat = copy.deepcopy(m).train()  # the flattened mode the measurement must not use
    other = measured_statistics(flat, s, w, n_samples=4, mode="train")
    for k in w:
        assert got[k] == pytest.approx(ref[k], rel=1e-6), k
    assert abs(other["values"]["0.weight"] / got["0.weight"] - 1) > 0.05
    assert not m[1].training and m[0].training  # modes left as the user set them
