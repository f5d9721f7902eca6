"""lr_scale= (precondfx.lr_transfer): the function is unchanged, the factors are the documented
formula, and training sees them as the predicted change of curvature and of the optimizer's step
(c^2 under SGD, c under Adam), checked with autograd Hessian-vector products and torch.optim."""
import pytest
import torch
from torch import nn

import precondfx
from precondfx.errors import PrecondError
from precondfx.options import Options, from_text


def _mlp(n_in=64, width=100, depth=3, n_out=10, seed=0):
    torch.manual_seed(seed)
    layers, prev = [], n_in
    for _ in range(depth):
        layers += [nn.Linear(prev, width), nn.ReLU()]
        prev = width
    return nn.Sequential(*layers, nn.Linear(prev, n_out))


class _Res(nn.Module):
    """stem, two residual blocks without normalization (conv-relu-conv + skip), head."""

    def __init__(self, c=12):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.b1 = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.b2 = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        z = torch.relu(self.stem(x))
        z = torch.relu(z + self.b1(z))
        z = torch.relu(z + self.b2(z))
        return self.head(z.mean((2, 3)))


def _weights(m):
    return {n: p for n, p in m.named_parameters() if n.endswith("weight")}


def _alphas(m):
    return [float(b) for n, b in m.named_buffers() if "alpha" in n]


@pytest.mark.parametrize("balance", ["auto", "none", "hessian"])
@pytest.mark.parametrize("mode", ["sgd", "adam"])
def test_function_unchanged(mode, balance):
    m = _mlp(width=100, depth=3)
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    ref, _ = precondfx.precondition(m, x, balance=balance, seed=3)
    out, rep = precondfx.precondition(m, x, balance=balance, seed=3, lr_scale=mode)
    xt = torch.randn(200, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (out(xt) - ref(xt)).abs().max().item() <= 1e-5
    sec = rep.conditioning["lr_scale"]
    assert sec["mode"] == mode and sec["depth"] == 4
    # the stored weights did change (by the factor): the option is not a no-op
    w0, w1 = _weights(ref), _weights(out)
    k = next(iter(w0))
    ratio = float(w0[k].detach().norm() / w1[k].detach().norm())
    assert ratio == pytest.approx(sec["factors"][k], rel=1e-5)


def test_function_unchanged_residual_conv():
    m = _Res()
    torch.manual_seed(0)
    x = torch.randn(16, 3, 8, 8)
    ref, _ = precondfx.precondition(m, x, seed=1)
    out, rep = precondfx.precondition(m, x, seed=1, lr_scale="adam")
    with torch.no_grad():
        assert (out(x) - ref(x)).abs().max().item() <= 1e-5
    # main path: stem and head (both residual branches cut)
    assert rep.conditioning["lr_scale"]["depth"] == 2


def _rms(t):
    return float(t.detach().double().pow(2).mean().sqrt())


def test_factors_match_the_formula():
    """Adam: c_l = 64 rms(W_l) / sqrt(fan_in_l) (3/L)^2, so that every stored weight ends with
    rms sqrt(fan_in)/64 (L/3)^2; SGD: c = 3/L.  fan_in of the first layer is the input
    dimension, of the others the width; L = depth + 1 for an MLP."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    for width, depth in [(100, 3), (37, 1), (300, 6)]:
        m = _mlp(width=width, depth=depth)
        L = depth + 1
        fans = [64] + [width] * depth
        ref, _ = precondfx.precondition(m, x, balance="none", seed=5)
        assert _alphas(ref) == []                      # no alpha without the option
        a, _ = precondfx.precondition(m, x, balance="none", seed=5, lr_scale="adam")
        s, _ = precondfx.precondition(m, x, balance="none", seed=5, lr_scale="sgd")
        rms = [_rms(w) for w in _weights(ref).values()]
        want_a = [64 * r / f ** 0.5 * (3 / L) ** 2 for r, f in zip(rms, fans)]
        assert _alphas(a) == pytest.approx(want_a, rel=1e-6)
        assert [_rms(w) for w in _weights(a).values()] == pytest.approx(
            [f ** 0.5 / 64 * (L / 3) ** 2 for f in fans], rel=1e-5)
        assert _alphas(s) == pytest.approx([3 / L] * len(fans), rel=1e-6)
        # with measured balancing the factor multiplies the measured alpha, and the stored
        # weights end at the same rms
        bal, _ = precondfx.precondition(m, x, balance="hessian", seed=0)
        bal_a, _ = precondfx.precondition(m, x, balance="hessian", seed=0, lr_scale="adam")
        rms_b = [_rms(w) for w in _weights(bal).values()]
        got = [u / v for u, v in zip(_alphas(bal_a), _alphas(bal))]
        assert got == pytest.approx([64 * r / f ** 0.5 * (3 / L) ** 2
                                     for r, f in zip(rms_b, fans)], rel=1e-6)


def _loss(m, x, y):
    return nn.functional.cross_entropy(m(x), y)


def _layer_product(m):
    """alpha_l * W_l per layer (what the function depends on), in execution order."""
    al = _alphas(m)
    ws = list(_weights(m).values())
    return [a * w.detach().clone() for a, w in zip(al, ws)] if al else [w.detach().clone()
                                                                      for w in ws]


@pytest.mark.parametrize("mode", ["sgd", "adam"])
def test_curvature_scales_by_c_squared(mode):
    """Hessian block of the training loss (cross-entropy with labels) w.r.t. each stored
    weight, u^T H u along one random direction, by autograd double backward: the stored weight
    is W/c for the same function, so the block is c^2 times the one without the option."""
    m = _mlp(width=24, depth=3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 64, generator=g), torch.randint(0, 10, (40,), generator=g)
    ref, _ = precondfx.precondition(m, x, balance="none", seed=0)
    out, rep = precondfx.precondition(m, x, balance="none", seed=0, lr_scale=mode)
    fac = rep.conditioning["lr_scale"]["factors"]
    for name in _weights(ref):
        u = torch.randn(_weights(ref)[name].shape, generator=g)

        def quad(model):
            w = _weights(model)[name]
            gr = torch.autograd.grad(_loss(model, x, y), w, create_graph=True)[0]
            hu = torch.autograd.grad((gr * u).sum(), w)[0]
            return float((hu * u).sum())
        h0, h1 = quad(ref), quad(out)
        assert h1 == pytest.approx(h0 * fac[name] ** 2, rel=1e-4)


@pytest.mark.parametrize("mode,opt", [("sgd", "sgd"), ("adam", "adam")])
def test_one_optimizer_step_moves_the_function_by_the_predicted_factor(mode, opt):
    """One torch.optim step at the same learning rate: the change of alpha*W of each layer is
    c^2 times the change without the option under SGD, c times under Adam."""
    m = _mlp(width=50, depth=3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 64, generator=g), torch.randint(0, 10, (40,), generator=g)
    ref, _ = precondfx.precondition(m, x, balance="none", seed=0)
    out, rep = precondfx.precondition(m, x, balance="none", seed=0, lr_scale=mode)
    fac = list(rep.conditioning["lr_scale"]["factors"].values())
    deltas = []
    for model in (ref, out):
        before = _layer_product(model)
        o = (torch.optim.SGD(model.parameters(), lr=1e-3) if opt == "sgd" else
             torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-12))
        o.zero_grad()
        _loss(model, x, y).backward()
        o.step()
        deltas.append([float((a - b).norm()) for a, b in zip(_layer_product(model), before)])
    for d0, d1, c in zip(*deltas, fac):
        want = c * c if mode == "sgd" else c
        assert d1 == pytest.approx(d0 * want, rel=1e-3)


def test_option_checked_and_on_the_command_line():
    with pytest.raises(PrecondError, match="lr_scale"):
        Options(lr_scale="adamw")
    assert from_text("lr_scale", "none") is None
    assert from_text("lr_scale", "adam") == "adam"
    m = _mlp(width=16, depth=1)
    with pytest.raises(PrecondError, match="lr_scale"):
        precondfx.precondition(m, torch.randn(8, 64), scheme="lsuv", lr_scale="sgd")


def test_plan_records_the_factors():
    m = _mlp(width=100, depth=3)
    x = torch.randn(32, 64)
    out, rep = precondfx.precondition(m, x, balance="none", lr_scale="adam")
    assert rep.plan.options["lr_scale"] == "adam"
    assert any("lr_scale='adam'" in n for n in rep.plan.notes)
    fac = rep.conditioning["lr_scale"]["factors"]
    buffers = dict(out.named_buffers())
    for lay in rep.plan.layers:
        assert lay.alpha == pytest.approx(fac[lay.weight], rel=1e-9)
        assert "lr_scale='adam'" in lay.alpha_reason
    vals = sorted(sc.value for sc in rep.plan.scales if sc.tag == "alpha")
    assert vals == pytest.approx(sorted(float(b) for n, b in buffers.items() if "alpha" in n))


def test_transformers_conv1d_fan_in_is_the_input_width():
    """transformers' Conv1D stores W as (in, out): the fan-in is read from the call's output
    (GPT-2 n_embd 32: c_attn, c_fc and attn.c_proj read 32 inputs, mlp.c_proj 128)."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    m = GPT2LMHeadModel(cfg)
    x = torch.randint(0, 64, (4, 16))
    ref, _ = precondfx.precondition(m, x, use_cache=False)
    out, rep = precondfx.precondition(m, x, use_cache=False, lr_scale="adam")
    with torch.no_grad():
        assert (out(x, use_cache=False).logits - ref(x, use_cache=False).logits).abs().max() <= 1e-5
    sec = rep.conditioning["lr_scale"]
    L = sec["depth"]
    assert L == 2                       # embedding and head; the blocks are residual branches
    w = dict(out.named_parameters())
    for name, fan in [("transformer.h.0.attn.c_attn.weight", 32), ("transformer.h.0.mlp.c_fc.weight", 32),
                      ("transformer.h.0.attn.c_proj.weight", 32),
                      ("transformer.h.0.mlp.c_proj.weight", 128)]:
        assert _rms(w[name]) == pytest.approx(fan ** 0.5 / 64 * (L / 3) ** 2, rel=1e-5), name
