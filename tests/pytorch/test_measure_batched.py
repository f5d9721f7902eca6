"""The batched sketch gives the per-sample loop's numbers (same cotangents), or falls back."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from precondfx.pytorch.measure.sketch import hessian_sketch


def _both(net, x, weights, n=10):
    a = hessian_sketch(net, x, weights, n_samples=n, seed=5, batched=False)
    b = hessian_sketch(net, x, weights, n_samples=n, seed=5)
    return a, b


def _rel(a, b):
    return max(abs(a.means()[w] / b.means()[w] - 1) for w in a.means())


class _Emb(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Embedding(20, 8, padding_idx=0)
        self.l = nn.Linear(8, 3)

    def forward(self, ids):
        return self.l(torch.tanh(self.e(ids))).mean(1)


def _cases():
    torch.manual_seed(0)
    yield "mlp", nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4)), \
        torch.randn(6, 12), ["0.weight", "2.weight"]
    yield "sequence", nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 4)), \
        torch.randn(6, 5, 12), ["0.weight", "2.weight"]
    yield "conv-bn-train", nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, groups=2, padding=2, dilation=2), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 8 * 8, 5)), torch.randn(4, 3, 16, 16), \
        ["0.weight", "3.weight", "6.weight"]
    yield "conv-few-positions", nn.Sequential(   # Gram over positions (L=16 < channels)
        nn.Conv2d(3, 32, 3, stride=4, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(), nn.Flatten(), nn.Linear(512, 5)), torch.randn(4, 3, 16, 16), \
        ["0.weight", "2.weight", "5.weight"]
    yield "conv-1x1", nn.Sequential(   # 1x1 convs: the (strided) input is the unfolding
        nn.Conv2d(3, 8, 1), nn.ReLU(), nn.Conv2d(8, 8, 1, stride=2, groups=2), nn.ReLU(),
        nn.Conv2d(8, 4, 1, stride=(1, 2)), nn.Flatten(), nn.Linear(4 * 4 * 2, 5)), \
        torch.randn(4, 3, 8, 8), ["0.weight", "2.weight", "4.weight", "6.weight"]
    yield "conv-circular-same", nn.Sequential(   # padded as the module pads, then unfolded
        nn.Conv2d(3, 6, 3, padding=1, padding_mode="circular"), nn.ReLU(),
        nn.Conv2d(6, 6, (3, 2), padding="same", padding_mode="reflect"), nn.ReLU(),
        nn.Conv2d(6, 4, 3, padding="valid"), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)), \
        torch.randn(4, 3, 8, 8), ["0.weight", "2.weight", "4.weight", "6.weight"]
    yield "conv1d", nn.Sequential(nn.Conv1d(3, 6, 5, padding=2, stride=2), nn.ReLU(),
                                  nn.Flatten(), nn.Linear(6 * 8, 4)), torch.randn(5, 3, 16), \
        ["0.weight", "3.weight"]
    ids = torch.randint(0, 20, (6, 9), generator=torch.Generator().manual_seed(2))
    ids[0, :3] = 0
    yield "embedding-padding", _Emb(), ids, ["e.weight", "l.weight"]


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_batched_equals_loop(case):
    _, net, x, weights = case
    net.train()
    a, b = _both(net, x, weights)
    assert b.engine == "batched" and a.engine == "per-sample loop"
    assert _rel(a, b) < 1e-5  # float32 Gram of the per-sample gradients
    assert b.per_sample.shape == (10, len(weights))


class _Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(torch.relu(self.a(x)))))


class _OutsideUse(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.a(x)) + x @ self.a.weight.T   # the weight also used functionally
        return self.b(h)


class _Mixing(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h - h.mean(0, keepdim=True) * 0.5)


@pytest.mark.parametrize("cls,why", [(_Shared, "called twice"), (_OutsideUse, "add up"),
                                     (_Mixing, "mixes samples")])
def test_falls_back_to_the_loop_when_not_exact(cls, why):
    torch.manual_seed(1)
    net, x = cls(), torch.randn(6, 8)
    a, b = _both(net, x, ["a.weight", "b.weight"])
    if cls is _Shared:  # one module called twice: positions pooled, still exact
        assert b.engine == "batched" and _rel(a, b) < 1e-6
        return
    assert b.engine.startswith("per-sample loop (Unsupported") and why in b.engine
    assert _rel(a, b) == 0.0


class _ViewFlatten(nn.Module):
    """``x.view(n, -1)`` after a conv: needs contiguous activations."""

    def __init__(self):
        super().__init__()
        self.c, self.l = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        h = torch.relu(self.c(x))
        return self.l(h.view(h.shape[0], -1))


def test_contiguous_only_forward_stays_batched():
    torch.manual_seed(0)
    a, b = _both(_ViewFlatten(), torch.randn(5, 3, 6, 6), ["c.weight", "l.weight"])
    assert b.engine == "batched" and _rel(a, b) < 1e-5


def _hf(name, seq):
    import tests.hf_tiny as H
    model, batch = H.build(name, dropout=False)
    batch.pop("labels")
    batch["input_ids"] = batch["input_ids"][:, :seq]
    return model.train(), batch, H.FORWARD[name]


@pytest.mark.parametrize("name,seq", [("gpt2", 12), ("gpt2", 3), ("bert", 12), ("llama", 12)])
def test_transformers_take_the_batched_path(name, seq):
    """Position embeddings looked up on (1, T) position ids (shared by the samples) and GPT-2's
    word embedding tied to its LM head (one parameter, two modules; seq 12: per-sample
    gradients, seq 3: Gram over positions) are measured batched, with the loop's numbers."""
    pytest.importorskip("transformers")
    model, batch, kw = _hf(name, seq)
    weights = [n for n, p in model.named_parameters() if p.dim() == 2]
    args = dict(n_samples=6, seed=5, forward_kwargs=kw, output_fn=lambda o: o.logits)
    a = hessian_sketch(model, batch, weights, batched=False, **args)
    b = hessian_sketch(model, batch, weights, **args)
    assert b.engine == "batched" and a.engine == "per-sample loop"
    assert _rel(a, b) < 1e-5
    if name == "gpt2":   # the tied weight's value includes the cross terms of its two uses
        assert "transformer.wte.weight" in weights and "lm_head.weight" not in weights
        assert model.lm_head.weight is model.transformer.wte.weight
