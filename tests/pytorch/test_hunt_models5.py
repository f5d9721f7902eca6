"""Defects found by the fifth model hunt (research-code models: UNet, WaveNet, seq2seq, MoE, GNN,
NeRF, diffusion, Perceiver, Mamba-like scans, Conv-TasNet, PointNet, capsules, VAEs, siamese
nets, tied weights, parametrizations, hand-written running statistics, dict/dataclass I/O,
channels_last, float64), each checked against the contract; the cases here failed before
their fix."""
from __future__ import annotations

import math

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


# ---------------------------------------------------------------- shape arithmetic under fx
# fx records ``x.size(-1)``, ``math.sqrt(...)`` and ``h.shape[-1] ** -0.5`` as graph nodes.  They
# were classified as activations: ``h / math.sqrt(d)`` as a "product of two activations
# (gating)", ``math.sqrt`` as an unknown op, and ``h.view(h.size(0), -1)`` as a view that
# "combines 2 activations", so scheme='tat' refused the commonest flatten idiom.  torch.export
# and the eager tracer see the numbers; fx now takes them as constants too.


class ShapeScaled(nn.Module):
    """Scaled by numbers computed from shapes, as attention code writes ``/ math.sqrt(d)``."""

    def __init__(self, literal: bool = False) -> None:
        super().__init__()
        self.literal = literal
        self.l1, self.l2, self.l3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.literal:
            h = F.relu(self.l1(x)) / 4.0
            h = F.relu(self.l2(h)) * 32 ** -0.5
        else:
            h = F.relu(self.l1(x)) / math.sqrt(x.size(-1))
            h = F.relu(self.l2(h)) * h.shape[-1] ** -0.5
        return self.l3(h)


def test_shape_arithmetic_is_a_constant_not_an_activation() -> None:
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    rep = _quiet(precondfx.analyze, ShapeScaled(), x)
    lit = _quiet(precondfx.analyze, ShapeScaled(literal=True), x)
    assert rep.capture == lit.capture == "fx"
    assert not rep.rows("unknown"), [(r.name, r.reason) for r in rep.rows("unknown")]
    muls = {r.name: r.status for r in rep.nodes if r.kind == "mul"}
    assert muls == {r.name: r.status for r in lit.nodes if r.kind == "mul"} \
        == {"truediv": "preserves", "mul": "preserves"}, muls


class FlattenBySize(nn.Module):
    """A plain deep MLP on images, flattened with ``x.view(x.size(0), -1)`` (or torch.flatten)."""

    def __init__(self, by_size: bool, depth: int = 20, width: int = 16) -> None:
        super().__init__()
        self.by_size = by_size
        layers: list[nn.Module] = [nn.Linear(3 * 4 * 4, width), nn.ReLU()]
        for _ in range(depth - 2):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.size(0), -1) if self.by_size else torch.flatten(x, 1)
        return self.head(self.body(x))


def test_tat_accepts_a_flatten_written_with_size() -> None:
    x = torch.randn(16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    out = {}
    for by_size in (False, True):
        torch.manual_seed(0)
        res, rep = _quiet(precondfx.precondition, FlattenBySize(by_size), x, scheme="tat",
                          seed=0)
        assert rep.capture == "fx"
        out[by_size] = (rep.output_scale, res(x))
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-6)
    torch.testing.assert_close(out[True][1], out[False][1])


class PoolBySize(nn.Module):
    """A max-pool whose kernel follows the input's size (pool to a 4x4 grid)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.c1(x)), kernel_size=x.size(-1) // 4)
        h = F.relu(self.c2(h))
        return self.fc(h.view(h.size(0), -1))


def test_pool_sized_from_the_input_is_kept_and_says_why() -> None:
    """Its geometry is read from the sample's shape; a strided convolution would fix it there.
    Before, the pool was kept with a false reason (a kernel of 1, 'ceil_mode')."""
    gen = torch.Generator().manual_seed(0)
    model = PoolBySize()
    res, rep = _quiet(precondfx.precondition, model, torch.randn(4, 3, 16, 16, generator=gen))
    assert rep.capture == "fx"
    (pc,) = rep.plan.pools
    assert pc.action == "keep" and "shape" in pc.reason and "ceil_mode" not in pc.reason, pc
    big = torch.randn(2, 3, 32, 32, generator=gen)
    assert res(big).shape == model(big).shape == (2, 3)


# ---------------------------------------------------------------- weight tying in __init__
# ``self.decoder.weight = self.encoder.weight`` (the PyTorch word-language-model example) was
# reported as "method __init__ reads self.encoder.weight outside a call of self.encoder: it
# computes without the constants there": an assignment ties the two, it computes nothing.


class TiedRNNLM(nn.Module):
    def __init__(self, vocab: int = 30, dim: int = 16) -> None:
        super().__init__()
        self.encoder = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.decoder = nn.Linear(dim, vocab)
        self.tie_weights()

    def tie_weights(self) -> None:
        self.decoder.weight = self.encoder.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.encoder(ids))
        return self.decoder(out)


class TiedInInit(TiedRNNLM):
    def __init__(self, vocab: int = 30, dim: int = 16) -> None:
        nn.Module.__init__(self)
        self.encoder = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.encoder.weight


@pytest.mark.parametrize("cls", [TiedRNNLM, TiedInInit])
def test_tying_weights_is_not_a_read_outside_the_layer(cls) -> None:
    ids = torch.randint(0, 30, (4, 6), generator=torch.Generator().manual_seed(0))
    res, rep = _quiet(precondfx.precondition, cls(), ids)
    assert rep.result["forward_only"] == [], rep.result["forward_only"]
    assert "outside a call" not in rep.result_line()
    assert res.decoder.weight is res.encoder.weight


# ---------------------------------------------------------------- lr='auto' with nothing to carry it
# A spectral-normed GAN discriminator: every weight is parametrized and kept, the output std is
# 0.05 and the output scale ~20.  With no re-drawn layer, lr='auto' cannot lower the SGD rate
# (it was silently not armed), and the scale alone multiplies the loss curvature by ~400: the
# user's model trained at lr=0.05, the result diverged even at lr=0.001.  The report says so.


class SNCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        sn = nn.utils.parametrizations.spectral_norm
        self.net = nn.Sequential(sn(nn.Conv2d(3, 8, 3, 2, 1)), nn.LeakyReLU(0.1),
                                 sn(nn.Conv2d(8, 8, 3, 2, 1)), nn.LeakyReLU(0.1), nn.Flatten(),
                                 sn(nn.Linear(8 * 4 * 4, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_lr_auto_not_armed_says_what_the_output_scale_does_to_the_rate() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    res, rep = _quiet(precondfx.precondition, SNCritic(), x)
    assert rep.output_scale is not None and rep.output_scale > 4
    why = dict(rep.skipped).get("lr='auto'")
    assert why is not None, rep.skipped
    assert f"{rep.output_scale ** 2:.4g}" in why and "target_std=None" in why
    assert rep.conditioning["lr_target"]["pending"] is False
    assert "NOT APPLIED" in str(rep)


# ---------------------------------------------------------------- a hand-written drop path
# ``h.new_empty(B, 1).bernoulli_(keep)`` (timm's drop_path, written out in many repositories)
# and ``torch.bernoulli(...)`` draw a mask: the op table knew only aten ``bernoulli``, so the
# in-place method and the torch function were 'unknown' ops ("effect on scaling not known").


class RandomSkipBlock(nn.Module):
    def __init__(self, p: float = 0.2, functional: bool = False) -> None:
        super().__init__()
        self.p, self.functional = p, functional
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.functional:
            h = h * torch.bernoulli(torch.full((x.shape[0], 1), 1 - self.p)) / (1 - self.p)
        elif self.training:
            h = h * h.new_empty(h.shape[0], 1).bernoulli_(1 - self.p) / (1 - self.p)
        return self.b(x + h)


@pytest.mark.parametrize("functional", [False, True])
def test_bernoulli_mask_is_a_known_op(functional: bool) -> None:
    rep = _quiet(precondfx.analyze, RandomSkipBlock(functional=functional),
                 torch.randn(16, 8, generator=torch.Generator().manual_seed(0)))
    assert not rep.rows("unknown"), [(r.name, r.target) for r in rep.rows("unknown")]
    assert [r.status for r in rep.nodes if "bernoulli" in r.name] == ["structural"]
