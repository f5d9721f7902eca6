"""suggest_lr=True: the rates are 1/lambda of the cross-entropy Gauss-Newton matrix (SGD) and
of its Adam-preconditioned form; lambda checked against the dense matrix built here from the
full Jacobian (torch.autograd.functional.jacobian) and eigvalsh."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import precondfx
from precondfx.pytorch.capture.common import Sample
from precondfx.pytorch.measure import suggest


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4))


def _dense_ggn(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()]).double()

    def out(flat: torch.Tensor) -> torch.Tensor:
        ps, i = {}, 0
        for n, s in zip(names, shapes):
            k = int(torch.tensor(s).prod())
            ps[n] = flat[i:i + k].reshape(s).float()
            i += k
        return functional_call(model, ps, (x,)).double()

    z = out(flat0)
    jac = torch.autograd.functional.jacobian(out, flat0)          # (N, K, P)
    p = torch.softmax(z, -1)
    g = torch.zeros(flat0.numel(), flat0.numel(), dtype=torch.float64)
    for i in range(z.shape[0]):
        h = torch.diag(p[i]) - torch.outer(p[i], p[i])
        g += jac[i].T @ h @ jac[i]
    return g / z.shape[0], names


def test_sgd_rate_is_one_over_the_dense_ggn_top_eigenvalue():
    m = _mlp()
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(1))
    g, _ = _dense_ggn(m, x)
    lam = float(torch.linalg.eigvalsh(g)[-1])
    got = suggest.suggest_lr(m, Sample((x,), {}), iters=300, tol=0)
    assert got["loss"] == "cross-entropy"
    assert got["sgd_curvature"] == pytest.approx(lam, rel=1e-4)
    assert got["sgd"] == pytest.approx(1 / lam, rel=1e-4)
    # the default number of iterations is close
    quick = suggest.suggest_lr(m, Sample((x,), {}))
    assert quick["sgd_curvature"] == pytest.approx(lam, rel=0.05)


def test_adam_preconditioner_and_curvature_against_dense():
    """``_adam_scale``: v = mean over slices of the squared sampled-label gradient (labels drawn
    here with the same generator); ``_top`` with it = the top eigenvalue of D^-1/2 G D^-1/2."""
    m = _mlp()
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(2))
    params = {n: p.detach() for n, p in m.named_parameters()}

    def f(p):
        return functional_call(m, p, (x,))

    with torch.no_grad():
        z = f(params)
    d = suggest._adam_scale(f, params, z, "cross-entropy", 4, torch.Generator().manual_seed(7))
    y = torch.multinomial(torch.softmax(z.double(), -1), 1,
                          generator=torch.Generator().manual_seed(7)).squeeze(-1)
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    for rows in torch.arange(16).tensor_split(4):
        mm = {n: p.clone().requires_grad_(True) for n, p in params.items()}
        loss = F.cross_entropy(functional_call(m, mm, (x[rows],)), y[rows])
        for (n, _), gr in zip(mm.items(), torch.autograd.grad(loss, list(mm.values()))):
            v[n] += gr ** 2 / 4
    for n in params:
        torch.testing.assert_close(d[n], (v[n].sqrt() + suggest.EPS).sqrt(), rtol=1e-5,
                                   atol=1e-7)
    g, names = _dense_ggn(m, x)
    dflat = torch.cat([d[n].reshape(-1) for n in names]).double()
    lam = float(torch.linalg.eigvalsh(g / torch.outer(dflat, dflat))[-1])
    h, _ = suggest._out_hessian(z)
    got = suggest._top(f, params, h, z.shape[0], d, 400, torch.Generator().manual_seed(0))
    assert got == pytest.approx(lam, rel=1e-3)


def test_precondition_reports_the_rates_of_the_returned_model():
    m = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(24, 6, generator=torch.Generator().manual_seed(3))
    out, rep = precondfx.precondition(m, x, suggest_lr=True)
    sl = rep.suggested_lr
    g, _ = _dense_ggn(out, x)
    lam = float(torch.linalg.eigvalsh(g)[-1])
    assert sl["sgd"] == pytest.approx(1 / lam, rel=0.05)
    assert sl["adam"] > 0 and "Gauss-Newton" in sl["how"]
    assert "suggested learning rate: SGD" in str(rep)
    # off by default, and then not in the report
    _, rep2 = precondfx.precondition(m, x)
    assert rep2.suggested_lr is None


class _ClampF(torch.autograd.Function):
    """An autograd.Function without setup_context: torch.func's jvp/vjp refuse it."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x > 0)


class _CustomFn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(_ClampF.apply(self.a(x)))


class _LSTMHead(nn.Module):
    """CPU LSTM: its fused kernel has no forward-mode AD rule."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.out = nn.LSTM(5, 6, batch_first=True), nn.Linear(6, 4)

    def forward(self, x):
        return self.out(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("which", ["custom_function", "lstm"])
def test_reverse_mode_fallback_matches_the_dense_ggn(which):
    """Where forward-mode AD is refused, the products come from reverse mode only (J v as the
    gradient of <J^T u, v> in u): the top eigenvalue still matches the dense matrix."""
    torch.manual_seed(0)
    m = _CustomFn() if which == "custom_function" else _LSTMHead()
    shape = (16, 5) if which == "custom_function" else (6, 3, 5)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    with pytest.raises((NotImplementedError, RuntimeError)):      # the case is real
        torch.func.jvp(lambda p: functional_call(m, p, (x,)),
                       (dict(m.named_parameters()),),
                       ({n: torch.ones_like(p) for n, p in m.named_parameters()},))
    g, _ = _dense_ggn(m, x)
    lam = float(torch.linalg.eigvalsh(g)[-1])
    got = suggest.suggest_lr(m, Sample((x,), {}), iters=300, tol=0)
    assert got["sgd_curvature"] == pytest.approx(lam, rel=1e-3)


class _Bag(nn.Module):
    """An EmbeddingBag: no forward-mode rule and no second derivative."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(20, 6, mode="mean")
        self.head = nn.Linear(6, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(ids))


def test_a_model_without_forward_mode_or_second_derivative_is_measured_by_differences():
    """Both Gauss-Newton products failed on an EmbeddingBag (no jvp rule; the derivative of
    '_embedding_bag_backward' is not implemented), so suggest_lr raised and lr='auto' kept the
    storage with a warning.  Central differences for J v (reverse mode for J^T u) give the
    dense matrix's top eigenvalue."""
    m = _Bag()
    ids = torch.randint(0, 20, (16, 3), generator=torch.Generator().manual_seed(2))
    g, _ = _dense_ggn(m, ids)
    lam = float(torch.linalg.eigvalsh(g)[-1])
    got = suggest.suggest_lr(m, Sample((ids,), {}), iters=300, tol=0, families=("sgd",))
    assert got["sgd_curvature"] == pytest.approx(lam, rel=1e-3)
    # and a step of lr='auto' above that rate takes the factor lr= gives (no warning)
    y = torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(3))
    res, rep = precondfx.precondition(_Bag(), ids)
    told, rep_told = precondfx.precondition(_Bag(), ids, lr=4.0, optimizer="sgd")
    opt = torch.optim.SGD(res.parameters(), lr=4.0)
    F.cross_entropy(res(ids), y).backward()
    opt.step()
    assert rep.conditioning["lr_target"]["factor"] < 0.9
    assert rep.conditioning["lr_target"]["factor"] == pytest.approx(
        rep_told.conditioning["lr_target"]["factor"], rel=1e-6)
