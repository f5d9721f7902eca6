"""Defects found by running models written the way popular repositories write them (torchvision,
timm, StyleGAN, DLRM, N-BEATS, FT-Transformer, TabNet, Perceiver, siamese nets...) through the
pass on every back end; each test failed before its fix, named in its docstring."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from tests.helpers import frozen


class _Siamese(nn.Module):
    """A siamese net as tutorials write it: one encoder called on both inputs, and the
    contrastive loss computed in forward from the two embeddings."""

    def __init__(self, margin: float = 1.0) -> None:
        super().__init__()
        self.cnn = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3, 2),
                                 nn.ReLU(), nn.Flatten(), nn.Linear(16 * 6 * 6, 32))
        self.margin = margin

    def forward_once(self, x: torch.Tensor) -> torch.Tensor:
        return self.cnn(x)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, label: torch.Tensor):
        o1, o2 = self.forward_once(x1), self.forward_once(x2)
        d = F.pairwise_distance(o1, o2)
        loss = torch.mean((1 - label) * d.pow(2) + label * torch.clamp(self.margin - d, min=0).pow(2))
        return o1, o2, loss


@pytest.mark.parametrize("capture", ["fx", "export", "eager"])
def test_a_shared_encoder_keeps_the_loss_forward_computes(capture):
    """On the fx back end the output scale went on the first call of the shared encoder's last
    Linear inside the graph, so only one twin's embedding was scaled and the contrastive loss
    forward returns changed (0.145 -> 4.80 on this net, the scale 5.6) while export and eager
    left it as the user's.  Now a module called more than once takes the scale on the returned
    value only, on every back end: the loss is the user's, the main output the user's times the
    scale."""
    g = torch.Generator().manual_seed(0)
    sample = (torch.randn(16, 1, 16, 16, generator=g), torch.randn(16, 1, 16, 16, generator=g),
              torch.randint(0, 2, (16,), generator=g).float())
    torch.manual_seed(0)
    model = _Siamese()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, rep = precondfx.precondition(model, sample, capture=capture, reinit_weights=False,
                                          balance="none", residual="none", maxpool="keep")
    assert isinstance(out, _Siamese)
    sc = rep.output_scale
    assert sc is not None and abs(sc - 1) > 0.1          # the test needs a real scale
    with frozen(model):
        o1, o2, loss = model(*sample)
    with frozen(out):
        p1, p2, ploss = out(*sample)
    assert float((p1 - o1 * sc).abs().max()) <= 1e-5 * float((o1 * sc).abs().max())
    assert float(ploss) == pytest.approx(float(loss), rel=1e-5)
    # the default pass trains from the loss it returns: every parameter gets a finite gradient
    out2, _ = precondfx.precondition(model, sample, capture=capture)
    out2(*sample)[2].backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in out2.parameters())


class _EqualLinear(nn.Module):
    """StyleGAN2's equalized-learning-rate linear (rosinality's port): the weight is stored at
    unit scale and multiplied by a constant in forward."""

    def __init__(self, d_in: int, d_out: int, lr_mul: float = 0.01) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in).div_(lr_mul))
        self.bias = nn.Parameter(torch.zeros(d_out))
        self.scale, self.lr_mul = lr_mul / d_in ** 0.5, lr_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight * self.scale)
        return F.leaky_relu(out + self.bias * self.lr_mul, 0.2) * 2 ** 0.5


class _Mapping(nn.Module):
    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.style = nn.Sequential(*[_EqualLinear(d, d) for _ in range(n)])

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = z * torch.rsqrt(z.pow(2).mean(1, keepdim=True) + 1e-8)      # PixelNorm
        return self.style(z)


@pytest.mark.parametrize("capture", ["fx", "export", "eager"])
def test_a_weight_with_a_fixed_gain_is_preconditioned(capture):
    """A StyleGAN mapping network (equalized learning rate: ``F.linear(x, self.weight *
    self.scale)``) was refused with "the model has no weighted layer ... there is nothing to
    precondition"; a later round named each layer whose weight is computed in forward in that
    refusal.  Since the nineteenth round the product of a parameter and a number is the
    layer's weight with a fixed gain (``core.nodes.weight_gains``): each layer is re-drawn so
    that its effective weight ``weight * scale`` has the geometric rule's std, sqrt(2/16) for
    16x16 with the ReLU-family gain 2, the output std is 1, measured balancing leaves the
    three layers out, saying why (their gain sets their rate by design), and the result folds
    to 1e-5 on every capture."""
    model = _Mapping()
    z = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, rep = precondfx.precondition(model, z, capture=capture)
    assert [n.status for n in rep.nodes if n.kind == "linear"] == ["weighted"] * 3
    for i in range(3):
        lay = out.style[i]
        eff = float((lay.weight * lay.scale).detach().pow(2).mean()) ** 0.5
        assert eff == pytest.approx((2 / 16) ** 0.5, rel=0.05), i
        assert "divided by the gain" in rep.plan.inits[f"style.{i}.weight"].reason
    with torch.no_grad():
        assert float(out(z).std()) == pytest.approx(1.0, abs=0.03)
    left = rep.conditioning["hessian"]["left_out"]
    assert all("fixed gain" in left[f"style.{i}.weight"] for i in range(3))
    # and it folds: on fx, leaky_relu(F.linear(x, W * s) + b * lr_mul) carries the output
    # scale in W and b (refused before: "multiplies the output of add_3")
    with torch.no_grad():
        plain = precondfx.fold(out)
        assert type(plain) is _Mapping
        assert float((plain(z) - out(z)).abs().max()) < 1e-5


class _SplitAttention(nn.Module):
    """nanoGPT's fused qkv (``.split``), CLIP's feature normalization (``.norm``) and an
    ``.unflatten`` to heads: Tensor methods torch defines in Python, not in C."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.c_attn, self.c_proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=2)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.c_proj(y.transpose(1, 2).flatten(2))
        return y / y.norm(dim=-1, keepdim=True)


def test_python_defined_tensor_methods_are_classified_on_the_eager_back_end():
    """The eager tracer recorded ``Tensor.split``, ``Tensor.norm`` and ``Tensor.unflatten``
    (plain Python functions in torch/_tensor.py, without ``__objclass__``) as unknown ops,
    while fx and export classified them (select, reduce_other, reshape).  Now every back end
    gives them the same kind."""
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = _SplitAttention()
    kinds = {}
    for capture in ("fx", "eager"):
        rep = precondfx.analyze(model, x, capture=capture)
        assert not [r.name for r in rep.nodes if r.status == "unknown"], capture
        kinds[capture] = sorted((r.name, r.kind) for r in rep.nodes
                                if r.name.startswith(("split", "norm", "unflatten")))
    assert kinds["eager"] == kinds["fx"] == [("norm", "reduce_other"), ("split", "select"),
                                             ("unflatten", "reshape"), ("unflatten_1", "reshape"),
                                             ("unflatten_2", "reshape")]


class _IndexHead(nn.Module):
    """Integer results taken from activations, as seq2seq greedy decoding (``pred.argmax(1)``)
    and TabNet (``.long()``) write them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.e, self.b = nn.Linear(8, 16), nn.Embedding(17, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(self.e(h.argmax(-1) + (h.sum(-1) > 0).long()))


@pytest.mark.parametrize("capture", ["fx", "export", "eager"])
def test_argmax_and_integer_casts_are_classified(capture):
    """``argmax`` was an unknown op on every back end and ``.long()`` on fx and eager (export
    saw its ``aten.to``): now an index (no gradient flows through it) and a cast."""
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    rep = precondfx.analyze(_IndexHead(), x, capture=capture)
    assert not [(r.name, r.target) for r in rep.nodes if r.status == "unknown"]
    assert [r.kind for r in rep.nodes if r.name.startswith("argmax")] == ["constant"]


class _SiamesePool(_Siamese):
    """The tutorial siamese net with a max-pool in its shared encoder."""

    def __init__(self) -> None:
        super().__init__()
        self.cnn = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(16 * 5 * 5, 32))


@pytest.mark.parametrize("capture", ["fx", "export", "eager"])
def test_a_max_pool_in_a_shared_encoder_is_not_replaced_per_call(capture):
    """On the fx back end each call of the shared encoder's max-pool got a replacement
    convolution of its own (``precondfx_pool_cnn_2``, ``precondfx_pool_cnn_9``), so the two
    twins computed different functions: the contrastive loss was not symmetric in its two
    inputs any more (242.6 against 280.0; export and eager kept the pool: 116.1 both ways).
    Now a pool fed by a module called more than once is kept on every back end, with the
    reason."""
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(8, 1, 16, 16, generator=g), torch.randn(8, 1, 16, 16, generator=g)
    label = torch.zeros(8)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, rep = precondfx.precondition(_SiamesePool(), (x1, x2, label), capture=capture)
    with frozen(out):
        a, b = out(x1, x2, label)[2], out(x2, x1, label)[2]
    assert float(a) == pytest.approx(float(b), rel=1e-5)
    assert not [n for n, _ in out.named_parameters() if "precondfx_pool" in n]
    assert any(pc.action == "keep" and "called more than once" in pc.reason
               for pc in rep.plan.pools)
