"""Defects found by the seventh model hunt (diffusion blocks with timestep FiLM, rotary
attention, Perceiver latents, NeRF, PointNet, a selective scan, RealNVP coupling, a
hypernetwork, a Neural-ODE loop, capsules, dict heads with losses, ``labels=`` models, causal
SDPA, Bilinear, EmbeddingBag, PixelShuffle, ResNeXt, a frozen backbone), each checked against
the contract; the cases here failed before their fix."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx


def _quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **k)


class LabelsModel(nn.Module):
    """The transformers convention: ``labels=`` given, (loss, logits); else the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.net(x)
        if labels is None:
            return logits
        return F.cross_entropy(logits, labels), logits


class MultiHead(nn.Module):
    """A detector-style dict of heads, with the losses computed in forward when the targets
    are passed (positionally here)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU())
        self.cls = nn.Linear(32, 4)
        self.reg = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor, y_cls: torch.Tensor | None = None,
                y_reg: torch.Tensor | None = None) -> dict:
        h = self.body(x)
        out = {"logits": self.cls(h), "box": self.reg(h)}
        if y_cls is not None:
            out["loss"] = F.cross_entropy(out["logits"], y_cls) + F.mse_loss(out["box"], y_reg)
        return out


@pytest.mark.parametrize("case", ["labels_kw", "targets_positional"])
def test_model_preconditioned_with_its_labels_still_runs_without_them(case: str) -> None:
    """Preconditioned on a training batch with its labels, the fx graph fixed the
    ``if labels is not None`` branch: the result, called as the user's class allows for
    inference (``model(x)``), raised TypeError in cross_entropy (target None).  The capture
    now runs the graph without each optional input the sample gives and, where it fails, uses
    a capture that keeps the user's forward (export)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 10, generator=gen)
    torch.manual_seed(0)
    if case == "labels_kw":
        model = LabelsModel()
        y = torch.randint(0, 3, (16,), generator=gen)
        res, rep = _quiet(precondfx.precondition, model, x, labels=y, seed=0)
        loss, logits = res(x, labels=y)
        plain = res(x)
        assert torch.allclose(plain, logits)
        assert float(loss) > 0
    else:
        model = MultiHead()
        yc, yr = torch.randint(0, 4, (16,), generator=gen), torch.randn(16, 2, generator=gen)
        res, rep = _quiet(precondfx.precondition, model, (x, yc, yr), seed=0)
        full = res(x, yc, yr)
        plain = res(x)
        assert set(plain) == {"logits", "box"} and "loss" in full
        assert torch.allclose(plain["logits"], full["logits"])
    assert isinstance(res, type(model))
    main = plain["logits"] if isinstance(plain, dict) else plain
    assert abs(float(main.std()) - 1.0) < 0.2, float(main.std())
    assert rep.capture != "fx", rep.capture


class HyperLinear(nn.Module):
    """A hypernetwork: ``hyper`` maps a learned code to every weight of ``target``, which runs
    on them through ``torch.func.functional_call`` (its own parameters are never read)."""

    def __init__(self, dz: int = 4, din: int = 10, dout: int = 6) -> None:
        super().__init__()
        self.target = nn.Linear(din, dout)
        n = sum(p.numel() for p in self.target.parameters())
        self.hyper = nn.Sequential(nn.Linear(dz, 32), nn.ReLU(), nn.Linear(32, n))
        self.z = nn.Parameter(torch.randn(dz))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat, weights, i = self.hyper(self.z), {}, 0
        for name, p in self.target.named_parameters():
            weights[name] = flat[i:i + p.numel()].view_as(p)
            i += p.numel()
        return torch.func.functional_call(self.target, weights, (x,))


def test_fold_refuses_a_scale_on_a_module_run_on_borrowed_weights() -> None:
    """The output scale (0.355) sits on ``target``'s output; fold multiplied it into
    target.weight/bias, which functional_call never reads: the folded model's output std was
    2.83 against the result's 1.00 (max relative error 2.68), silently.  The run at
    precondition now records modules whose parameter slots hold other tensors when called, and
    fold refuses their factors, saying why."""
    torch.manual_seed(0)
    model = HyperLinear()
    x = torch.randn(16, 10, generator=torch.Generator().manual_seed(0))
    res, rep = _quiet(precondfx.precondition, model, x, seed=0)
    assert isinstance(res, HyperLinear)
    assert abs(float(res(x).std()) - 1.0) < 0.1
    problems = precondfx.pytorch.folding.fold_problems(res)
    assert any(w == "target.weight" and "functional_call" in why for w, why in problems), problems
    with pytest.raises(precondfx.errors.PrecondError, match="functional_call"):
        precondfx.fold(res)
