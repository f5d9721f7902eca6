"""More models written the way people write them (second battery), checked against the same
contract as ``tests/test_realworld.py`` (its ``check``), plus an independent equivalence check:
preconditioned with ``balance="none", residual="none", maxpool="keep"`` (only the output scale
among the constants), the result must compute, in train and eval mode and on another batch,
what the user's model computes with the result's weights, times the output scale.

The cases marked in comments failed before the fix they name (fx traces that ran a
computation on parameter values once, at trace time, and froze it into the graph).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import random
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import precondfx
from tests.test_realworld import call, check, clone_sample, main, structure

B = 6


def _x(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _ids(*shape: int, hi: int = 20, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, hi, shape, generator=torch.Generator().manual_seed(seed))


def mlp(d_in: int = 8, d_out: int = 4) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, 16), nn.ReLU(), nn.Linear(16, d_out))


def equivalent(model: nn.Module, sample: Any, other: Any | None = None, fwd: dict | None = None,
               **opts: Any) -> tuple[nn.Module, Any]:
    """Precondition with only the output scale as a constant and check that the result is the
    user's model holding the result's weights, times that scale: main output in train and eval
    mode (same seed) on ``other`` (default: the sample), and every gradient."""
    fwd = fwd or {}
    other = sample if other is None else other
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res, rep = precondfx.precondition(model, clone_sample(sample), balance="none",
                                          residual="none", maxpool="keep", **fwd, **opts)
    assert not [s for s in rep.plan.scales if s.tag != "output"]
    scale = rep.output_scale or 1.0
    ref = copy.deepcopy(model)
    ref.load_state_dict({k: v for k, v in res.state_dict().items() if "precondfx_" not in k})
    for train in (True, False):
        a_m, b_m = copy.deepcopy(res).train(train), copy.deepcopy(ref).train(train)
        torch.manual_seed(1)
        a = call(a_m, clone_sample(other), fwd)
        torch.manual_seed(1)
        b = call(b_m, clone_sample(other), fwd)
        assert structure(a) == structure(b)
        torch.testing.assert_close(main(a), main(b) * scale, rtol=1e-4, atol=1e-5)
        if train:
            names = [k for k, p in b_m.named_parameters() if p.requires_grad]   # by name
            ga = torch.autograd.grad(main(a).pow(2).sum(),
                                     [a_m.get_parameter(k) for k in names], allow_unused=True)
            gb = torch.autograd.grad((main(b) * scale).pow(2).sum(),
                                     [b_m.get_parameter(k) for k in names], allow_unused=True)
            for k, x, y in zip(names, ga, gb):
                assert (x is None) == (y is None), k
                if x is not None:
                    torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6, msg=k)
    return res, rep


# ---------------------------------------------------------------- forwards a trace would freeze


class PenaltyOverParameters(nn.Module):
    """Returns an L2 penalty summed over ``self.parameters()`` next to the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        y = self.b(F.relu(self.a(x)))
        return y, sum(p.pow(2).sum() for p in self.parameters())


class NormOfWeights(nn.Module):
    """Divides by the (detached) norm of a layer's weight, reached through parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        norm = [p.detach().norm() for p in self.a.parameters()][0]
        return self.b(F.relu(self.a(x) / norm))


class WGANCritic(nn.Module):
    """Clips its weights in forward (WGAN): ``p.data.clamp_`` on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        for p in self.parameters():
            p.data.clamp_(-0.05, 0.05)
        return self.b(F.leaky_relu(self.a(x), 0.2))


class BufferCounter(nn.Module):
    """A step counter kept in a buffer, incremented by ``+=`` in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = mlp()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps += 1
        return self.a(x)


class DataAssignedBuffer(nn.Module):
    """A running mean updated through ``.data`` (no no_grad block) and used in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = mlp()
        self.register_buffer("mu", torch.zeros(8))

    def forward(self, x):
        if self.training:
            self.mu.data = 0.9 * self.mu.data + 0.1 * x.mean(0).data
        return self.a(x - self.mu)


class BufferDerived(nn.Module):
    """Normalizes by a statistic computed from a buffer (a checkpoint's normalizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = mlp()
        self.register_buffer("std", torch.ones(8))

    def forward(self, x):
        return self.a(x / self.std.clamp(min=1e-3))


class TransposedReuse(nn.Module):
    """A projection's weight reused, transposed, as the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.p, self.m = nn.Linear(8, 16, bias=False), nn.Linear(16, 16)

    def forward(self, x):
        return F.linear(F.relu(self.m(self.p(x))), self.p.weight.t())


@pytest.mark.parametrize("build", [PenaltyOverParameters, NormOfWeights])
def test_computation_on_parameters_outside_the_trace_is_kept(build: Callable) -> None:
    """A penalty summed over ``self.parameters()`` was computed once while tracing and frozen
    into the GraphModule as a constant carrying a grad_fn: it did not follow the weights, got
    no gradient, and ``copy.deepcopy`` of the result raised RuntimeError.  A norm of a weight
    reached the same way stayed at its value before re-initialization."""
    torch.manual_seed(0)
    res, rep = equivalent(build(), _x(B, 8), _x(3, 8, seed=2))
    assert not isinstance(res, torch.fx.GraphModule)
    assert any("outside the traced graph" in n for n in rep.capture_notes)
    assert not [k for k in vars(res) if k.startswith("_tensor_constant")]
    check(build(), _x(B, 8))
    if build is PenaltyOverParameters:
        _, pen = copy.deepcopy(res)(_x(B, 8))
        want = sum(float(p.double().pow(2).sum()) for p in res.parameters())
        assert float(pen) == pytest.approx(want, rel=1e-5)


def test_weight_clipping_in_forward_still_clips() -> None:
    """``p.data.clamp_`` in forward ran once on the traced copy and was absent from the
    GraphModule: the result's weights grew past the clip after re-initialization."""
    torch.manual_seed(0)
    res, rep = equivalent(WGANCritic(), _x(B, 8))
    out = check(WGANCritic(), _x(B, 8))
    assert out is not None
    m = copy.deepcopy(res)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(100)
    m(_x(B, 8))
    assert max(float(p.abs().max()) for p in m.parameters()) <= 0.05 + 1e-7


@pytest.mark.parametrize("build", [BufferCounter, DataAssignedBuffer])
def test_buffer_assigned_in_forward_keeps_updating(build: Callable) -> None:
    """``self.steps += 1`` on a buffer was executed once at trace time and dropped from the
    graph (the result's counter stayed at 0); with buffers traced as graph values it stored a
    traced value in the model's buffer and broke every later capture."""
    torch.manual_seed(0)
    model = build()
    res, rep = equivalent(model, _x(B, 8), _x(3, 8, seed=2))
    check(build(), _x(B, 8))
    name = "steps" if build is BufferCounter else "mu"
    m, ref = copy.deepcopy(res).train(), copy.deepcopy(model).train()
    for i in range(3):
        m(_x(B, 8, seed=i))
        ref(_x(B, 8, seed=i))
    torch.testing.assert_close(m.get_buffer(name), ref.get_buffer(name))
    assert float(m.get_buffer(name).abs().sum()) > 0


def test_buffer_derived_value_follows_a_loaded_buffer() -> None:
    """A value computed from a buffer in forward follows the buffer when a checkpoint is loaded
    into the result (it was a constant frozen at trace time)."""
    torch.manual_seed(0)
    res, rep = equivalent(BufferDerived(), _x(B, 8))
    sd = res.state_dict()
    before = res(_x(B, 8))
    sd["std"] = torch.full((8,), 2.0)
    res.load_state_dict(sd)
    after = res(_x(B, 8))
    assert not torch.allclose(before, after)


def test_weight_read_outside_its_layer_is_left_out_of_balancing() -> None:
    """balance='hessian' raised 'measured balancing failed: rescaling changed the output' on a
    weight also used transposed as the output layer; it is now left out (with why) and the
    other layers are balanced, keeping the function."""
    torch.manual_seed(0)
    model, x = TransposedReuse(), _x(32, 8)
    res, rep = precondfx.precondition(model, x, balance="hessian", balance_samples=4)
    h = rep.conditioning["hessian"]
    assert "outside its layer" in h["left_out"]["p.weight"]
    check(TransposedReuse(), _x(B, 8), balance="hessian", balance_samples=4)
    # lr_scale divides the weight the same way: it changed the output by 3.1 (max abs) here
    res2, rep2 = precondfx.precondition(TransposedReuse(), x, balance="none", lr_scale="adam")
    res3, _ = precondfx.precondition(TransposedReuse(), x, balance="none")
    assert "outside its layer" in rep2.conditioning["lr_scale"]["left_out"]["p.weight"]
    torch.testing.assert_close(res2(x), res3(x), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the eager back end


class KeywordCalls(nn.Module):
    """Layers called by keyword (``self.fc(input=h)``); the no_grad block sends the model to
    the eager back end (hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        with torch.no_grad():
            shift = x.mean() * 0
        h = torch.tanh(self.a(input=x + shift))
        h = torch.tanh(self.b(input=h))
        return self.c(input=h)


def test_alpha_reaches_a_layer_called_by_keyword() -> None:
    """On the eager back end the input-scale hook read only positional arguments: a layer
    called as ``self.b(input=h)`` ran without its alpha (balancing of this tanh network then
    failed its function check: 'measured balancing failed').  The result must compute the
    planned function: each layer's input times the alpha buffer it holds, the output times
    the output scale (computed here by hand)."""
    torch.manual_seed(0)
    res, rep = precondfx.precondition(KeywordCalls(), _x(32, 8), balance="hessian",
                                      balance_samples=4)
    assert not isinstance(res, torch.fx.GraphModule)
    alphas = {n: float(res.get_buffer(f"{n}.precondfx_in_scale")) for n in "abc"}
    assert any(abs(a - 1) > 1e-3 for a in alphas.values())
    x = _x(5, 8, seed=3)

    def lin(n: str, h: torch.Tensor) -> torch.Tensor:
        m = res.get_submodule(n)
        return F.linear(h * alphas[n], m.weight, m.bias)
    want = lin("c", torch.tanh(lin("b", torch.tanh(lin("a", x))))) * float(rep.output_scale)
    torch.testing.assert_close(res(x), want, rtol=1e-5, atol=1e-6)
    check(KeywordCalls(), _x(B, 8), balance="hessian", balance_samples=4)


# ---------------------------------------------------------------- bad input, said clearly


class Estimator:
    """An sklearn-style wrapper (fit/predict) holding the network."""

    def __init__(self) -> None:
        self.net = mlp()
        self.lr = 0.1

    def predict(self, x):
        return self.net(x).argmax(-1)


@pytest.mark.parametrize("model, want", [
    (nn.Linear, r"the class Linear itself: pass an instance \(Linear\(...\)\)"),
    (Estimator(), r"holds the module\(s\) net: pass the module the forward runs"),
    (lambda x: x * 2, "wrap the computation in an nn.Module")])
def test_not_a_module_says_what_to_pass(model: Any, want: str) -> None:
    with pytest.raises(precondfx.PrecondError, match=want):
        precondfx.precondition(model, _x(B, 8))


def test_uint8_images_say_to_convert_them() -> None:
    """A uint8 image batch for a float conv net: the error says to convert it (and an
    out-of-range id batch for an embedding does not get that advice)."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    x = (_x(B, 3, 6, 6).abs() * 50).to(torch.uint8)
    with pytest.raises(precondfx.PrecondError, match=r"uint8 images: x.float\(\) / 255"):
        precondfx.precondition(model, x)
    emb = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))
    with pytest.raises(precondfx.PrecondError, match="index out of range") as info:
        precondfx.precondition(emb, _ids(B, 3, hi=20))
    assert "x.float()" not in str(info.value)


def test_sample_on_another_device_says_where_to_move_it() -> None:
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(precondfx.PrecondError, match=r"parameters are on cpu: move the sample"):
        precondfx.precondition(model, _x(B, 8).to("meta"))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


class PINN(nn.Module):
    """A physics-informed net: returns u(x) and du/dx, by torch.autograd.grad in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                                 nn.Linear(16, 1))

    def forward(self, x):
        x = x.clone().requires_grad_(True)
        u = self.net(x)
        du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        return u, du


def test_forward_that_differentiates_itself() -> None:
    """Every calibration run is under torch.no_grad(), where a forward calling
    torch.autograd.grad raises: precondition refused the model ('element 0 of tensors does
    not require grad').  Such runs now retry with grad on; the result computes the user's
    function (u and du/dx) with its weights, its u has std 1, and it trains (second order)."""
    torch.manual_seed(0)
    x, other = _x(32, 2), _x(5, 2, seed=3)
    res, rep = equivalent(PINN(), x, other)     # u, with only the output scale as constant
    ref = PINN()
    ref.load_state_dict({k: v for k, v in res.state_dict().items() if "precondfx_" not in k})
    torch.testing.assert_close(res(other)[1], ref(other)[1] * rep.output_scale, rtol=1e-4,
                               atol=1e-6)          # du/dx sees the scale too
    res, rep = precondfx.precondition(PINN(), x)
    u, du = res(x)
    assert float(u.double().std(correction=0)) == pytest.approx(1.0, rel=0.02)
    loss = (du[:, 0] - u[:, 0]).pow(2).mean()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in res.parameters())
    _, rep_h = precondfx.precondition(PINN(), x, balance="hessian", balance_samples=4)
    assert rep_h.conditioning["hessian"]["applied"]
    res_l, _ = precondfx.precondition(PINN(), x, scheme="lsuv")   # its probes ran under no_grad
    assert float(res_l(x)[0].double().std(correction=0)) == pytest.approx(1.0, rel=0.02)


@dataclasses.dataclass
class Prediction:
    logits: torch.Tensor
    features: torch.Tensor
    n: int = 0


class DataclassOut(nn.Module):
    """Returns a plain ``@dataclass`` (not a transformers ModelOutput)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = F.relu(self.a(x))
        return Prediction(self.b(h), h, x.shape[0])


@pytest.mark.parametrize("inplace", [False, True])
def test_dataclass_output_is_scaled_and_kept(inplace: bool) -> None:
    """A dataclass output was refused ('cannot find a floating-point tensor'), and the advice
    to pass output_key= failed too ('Out' object is not subscriptable).  Its fields are the
    outputs: the first floating one (``logits``) gets the scale, ``output_key`` names another,
    the result returns the same dataclass, and computes the user's function with its weights
    times the scale."""
    torch.manual_seed(0)
    x, other = _x(B, 8), _x(3, 8, seed=2)
    model = DataclassOut()
    ref = copy.deepcopy(model)
    res, rep = precondfx.precondition(model, x, balance="none", inplace=inplace)
    out = res(x)
    assert type(out) is Prediction and out.n == B
    assert float(out.logits.double().std(correction=0)) == pytest.approx(1.0, rel=0.02)
    ref.load_state_dict({k: v for k, v in res.state_dict().items() if "precondfx_" not in k})
    got, want = res(other), ref(other)
    torch.testing.assert_close(got.logits, want.logits * rep.output_scale)
    torch.testing.assert_close(got.features, want.features)
    got.logits.pow(2).sum().backward()
    assert all(p.grad is not None for p in res.parameters())
    copy.deepcopy(res)
    res2, _ = precondfx.precondition(DataclassOut(), x, output_key="features")
    assert float(res2(x).features.double().std(correction=0)) == pytest.approx(1.0, rel=0.02)


class ResidualDropoutBlock(nn.Module):
    """A user's block whose class name says 'Dropout' but that holds a Linear and a
    BatchNorm (a name match made it an opaque dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.bn, self.drop = nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(F.relu(self.bn(self.l(x))))


class NamedBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.i, self.o = nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.Sequential(ResidualDropoutBlock(), ResidualDropoutBlock())

    def forward(self, x):
        return self.o(self.blocks(self.i(x)))


def test_block_named_like_dropout_is_not_a_dropout() -> None:
    """A module was taken for a dropout by its class name alone: kept as an opaque fx leaf, its
    Linear was never re-initialized ('keep'), and calibration put the whole block in eval mode,
    so its BatchNorm used running statistics there and the output std missed the target in
    training.  Modules holding weights are traced through; only their own flag is set."""
    torch.manual_seed(0)
    x = _x(16, 8)
    res, rep = precondfx.precondition(NamedBlocks(), x)
    assert rep.plan.inits["blocks.0.l.weight"].rule != "keep"
    w = res.get_parameter("blocks.1.l.weight")
    assert float(w.double().pow(2).mean().sqrt()) == pytest.approx(
        rep.plan.inits["blocks.1.l.weight"].std, rel=1e-3)
    check(NamedBlocks(), x)


# ---------------------------------------------------------------- more constructs that work


class SegNet(nn.Module):
    """MaxPool2d(return_indices=True) feeding MaxUnpool2d."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.pool, self.unpool = nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)
        self.c3 = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x):
        h = F.relu(self.c1(x))
        p, idx = self.pool(h)
        return self.c3(self.unpool(F.relu(self.c2(p)), idx, output_size=h.shape))


class UNet(nn.Module):
    """Encoder output pooled and also concatenated back as a skip."""

    def __init__(self) -> None:
        super().__init__()
        self.e1, self.e2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1)
        self.pool, self.up = nn.MaxPool2d(2), nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.d1, self.o = nn.Conv2d(16, 8, 3, padding=1), nn.Conv2d(8, 2, 1)

    def forward(self, x):
        x1 = F.relu(self.e1(x))
        x2 = F.relu(self.e2(self.pool(x1)))
        return self.o(F.relu(self.d1(torch.cat([self.up(x2), x1], 1))))


class MoE(nn.Module):
    """Top-2 routing with index_add_, returning (logits, load-balancing loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.router, self.head = nn.Linear(8, 4), nn.Linear(8, 3)
        self.experts = nn.ModuleList([mlp(8, 8) for _ in range(4)])

    def forward(self, x):
        logits = self.router(x)
        w, idx = logits.softmax(-1).topk(2, -1)
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, ex(x[rows]) * w[rows, slot, None])
        return self.head(out), logits.softmax(-1).mean(0).pow(2).sum()


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(8, 32, bias=False), nn.Linear(8, 32, bias=False)
        self.w2, self.glu, self.h = nn.Linear(32, 8, bias=False), nn.Linear(8, 16), nn.Linear(8, 4)

    def forward(self, x):
        x = x + self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.h(F.glu(self.glu(x), dim=-1))


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.A = nn.Parameter(torch.randn(2, d_in) * 0.01)
        self.B = nn.Parameter(torch.zeros(d_out, 2))

    def forward(self, x):
        return self.base(x) + (x @ self.A.t() @ self.B.t()) * 2.0


class RelPosAttention(nn.Module):
    """Swin-style relative position bias: a table indexed by an integer buffer."""

    def __init__(self, t: int = 5, d: int = 16, h: int = 2) -> None:
        super().__init__()
        self.h, self.qkv, self.o, self.head = h, nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, 3)
        self.table = nn.Parameter(torch.randn(2 * t - 1, h) * 0.02)
        self.register_buffer("rel", torch.arange(t)[:, None] - torch.arange(t)[None, :] + t - 1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        bias = self.table[self.rel.view(-1)].view(t, t, self.h).permute(2, 0, 1)
        a = (q @ k.transpose(-1, -2) / math.sqrt(d // self.h) + bias).softmax(-1)
        return self.head(self.o((a @ v).transpose(1, 2).reshape(b, t, d)).mean(1))


class WSConv(nn.Conv2d):
    """Weight-standardized convolution (BiT/NFNet): standardizes self.weight in forward."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.var((1, 2, 3), keepdim=True) + 1e-5).sqrt()
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class WSNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.gn = WSConv(3, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.c2, self.h = WSConv(8, 8, 3, padding=1), nn.Linear(8, 3)

    def forward(self, x):
        return self.h(F.relu(self.c2(F.relu(self.gn(self.c1(x))))).mean((2, 3)))


class Diffusion(nn.Module):
    """A timestep embedding (sinusoidal, from integer timesteps) added to conv features."""

    def __init__(self) -> None:
        super().__init__()
        self.temb = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 8))
        self.c1, self.gn, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), \
            nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x, t):
        freqs = torch.exp(-math.log(10000) * torch.arange(8, dtype=torch.float32) / 8)
        arg = t.float()[:, None] * freqs[None]
        emb = torch.cat([arg.sin(), arg.cos()], -1)
        return self.c2(F.silu(self.gn(self.c1(x))) + self.temb(emb)[:, :, None, None])


class NoGradStats(nn.Module):
    """A @torch.no_grad() helper method inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    @torch.no_grad()
    def stats(self, h):
        return h.mean(0, keepdim=True), h.std(0, keepdim=True) + 1e-5

    def forward(self, x):
        h = self.a(x)
        m, s = self.stats(h)
        return self.b(F.relu((h - m) / s))


class MySequential(nn.Sequential):
    def forward(self, x):
        return super().forward(x.flatten(1))


MORE: dict[str, Callable[[], dict]] = {
    "segnet_unpool": lambda: dict(model=SegNet(), sample=_x(B, 3, 8, 8),
                                  other=_x(3, 3, 12, 12, seed=5)),
    "unet_pool_and_skip": lambda: dict(model=UNet(), sample=_x(B, 3, 8, 8),
                                       other=_x(3, 3, 12, 12, seed=4)),
    "moe_top2_index_add": lambda: dict(model=MoE(), sample=_x(16, 8), other=_x(5, 8, seed=3)),
    "swiglu_glu": lambda: dict(model=SwiGLU(), sample=_x(B, 8)),
    "lora_frozen_base": lambda: dict(model=nn.Sequential(LoRALinear(8, 16), nn.ReLU(),
                                                         LoRALinear(16, 4)), sample=_x(B, 8)),
    "relative_position_bias": lambda: dict(model=RelPosAttention(), sample=_x(B, 5, 16)),
    "weight_standardized_conv": lambda: dict(model=WSNet(), sample=_x(B, 3, 6, 6)),
    "diffusion_timesteps": lambda: dict(model=Diffusion(), sample=(
        _x(B, 3, 8, 8), _ids(B, hi=1000))),
    "no_grad_helper_method": lambda: dict(model=NoGradStats(), sample=_x(B, 8)),
    "sequential_super_forward": lambda: dict(model=MySequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), sample=_x(B, 2, 4)),
}


@pytest.mark.parametrize("name", sorted(MORE))
def test_more_models_keep_the_contract(name: str) -> None:
    torch.manual_seed(0)
    case = MORE[name]()
    check(case["model"], case["sample"])
    case = MORE[name]()
    equivalent(case["model"], case["sample"], case.get("other"))


class TwoHeads(nn.Module):
    """A classifier head (the main output) and an auxiliary regression head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16))
        self.cls, self.reg = nn.Linear(16, 5), nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.cls(h), self.reg(h).squeeze(-1)


def test_balancing_leaves_out_a_head_off_the_main_output() -> None:
    """A weight the main output does not depend on (an auxiliary head) has a zero statistic:
    measured balancing raised for balance='hessian' ('the hessian statistic of ['reg.weight']
    is zero') and gave up on every layer for 'auto'.  That weight is left out, with why, and
    the others are balanced without changing the function."""
    torch.manual_seed(0)
    x = _x(32, 8)
    res, rep = precondfx.precondition(TwoHeads(), x, balance="hessian", balance_samples=4)
    h = rep.conditioning["hessian"]
    assert h["applied"] and "does not depend on it" in h["left_out"]["reg.weight"]
    assert set(h["factors"]) == {"trunk.0.weight", "trunk.2.weight", "cls.weight"}
    ref, _ = precondfx.precondition(TwoHeads(), x, balance="none")
    for a, b in zip(res(x), ref(x)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    check(TwoHeads(), _x(B, 8), balance="hessian", balance_samples=4)
