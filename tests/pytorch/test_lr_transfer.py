"""lr_scale= (precondfx.pytorch.lr_transfer): the function is unchanged, the factors are the documented
formula, and training sees them as the predicted change of curvature and of the optimizer's step
(c^2 under SGD, c under Adam), checked with autograd Hessian-vector products and torch.optim."""
import copy

import pytest
import torch
from torch import nn

import precondfx
from precondfx.errors import PrecondError
from precondfx.core.options import Options, from_text
from tests.helpers import rms as _rms


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


def _lrs(m):
    """lr_scale's multipliers (one buffer per layer), in execution order."""
    return [float(b) for n, b in m.named_buffers() if "precondfx_lr" in n]


@pytest.mark.parametrize("balance", ["auto", "none", "hessian"])
@pytest.mark.parametrize("mode", ["sgd", "adam", "user"])
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
    out, rep = precondfx.precondition(m, x, seed=1, lr_scale="user")
    with torch.no_grad():
        assert (out(x) - ref(x)).abs().max().item() <= 1e-5
    # main path: stem and head (both residual branches cut)
    assert rep.conditioning["lr_scale"]["depth"] == 2


def test_factors_match_the_formula():
    """SGD: c = 3/L, L = depth + 1 for an MLP; 'user': c_l = (rms(W_l) / rms(W_l in the user's
    model)) ** 0.5, so that every stored weight ends at the geometric mean of the two rms.  (lr_scale='adam' was
    removed; its formula was checked here.)"""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    for width, depth in [(100, 3), (37, 1), (300, 6)]:
        m = _mlp(width=width, depth=depth)
        L = depth + 1
        fans = [64] + [width] * depth
        ref, _ = precondfx.precondition(m, x, balance="none", seed=5, lr=None)
        assert _alphas(ref) == _lrs(ref) == []         # no constant without the options
        a, _ = precondfx.precondition(m, x, balance="none", seed=5, lr_scale="user")
        s, _ = precondfx.precondition(m, x, balance="none", seed=5, lr_scale="sgd")
        assert _alphas(a) == _alphas(s) == []          # the multiplier is not an alpha
        rms = [_rms(w) for w in _weights(ref).values()]
        user = [_rms(w) for w in _weights(m).values()]
        assert _lrs(a) == pytest.approx([(r / u) ** 0.5 for r, u in zip(rms, user)], rel=1e-6)
        assert [_rms(w) for w in _weights(a).values()] == pytest.approx(
            [(r * u) ** 0.5 for r, u in zip(rms, user)], rel=1e-5)
        assert _lrs(s) == pytest.approx([3 / L] * len(fans), rel=1e-6)
        # with measured balancing the alphas stay the measured ones, and the stored weights
        # end at the same rms
        bal, _ = precondfx.precondition(m, x, balance="hessian", seed=0)
        bal_a, _ = precondfx.precondition(m, x, balance="hessian", seed=0, lr_scale="user")
        assert _alphas(bal_a) == pytest.approx(_alphas(bal), rel=1e-12)
        bal_rms = [_rms(w) for w in _weights(bal).values()]
        assert [_rms(w) for w in _weights(bal_a).values()] == pytest.approx(
            [(r * u) ** 0.5 for r, u in zip(bal_rms, user)], rel=1e-5)


def _loss(m, x, y):
    return nn.functional.cross_entropy(m(x), y)


def _layer_product(m, kind="weight"):
    """alpha_l * c_l * W_l (``kind="weight"``) or c_l * b_l (``"bias"``) per layer: what the
    function depends on, in execution order (alpha, c: 1 where the model has none)."""
    ps = [p for n, p in m.named_parameters() if n.endswith(kind)]
    al = (_alphas(m) or [1.0] * len(ps)) if kind == "weight" else [1.0] * len(ps)
    cs = _lrs(m) or [1.0] * len(ps)
    assert len(al) == len(cs) == len(ps)
    return [a * c * p.detach().clone() for a, c, p in zip(al, cs, ps)]


@pytest.mark.parametrize("mode", ["sgd", "adam", "user"])
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


@pytest.mark.parametrize("mode,opt", [("sgd", "sgd"), ("user", "adam"), ("adam", "adam")])
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
    assert from_text("lr_scale", "user") == "user"
    assert from_text("lr_scale", "ADAM") == "adam"
    m = _mlp(width=16, depth=1)
    with pytest.raises(PrecondError, match="lr_scale"):
        precondfx.precondition(m, torch.randn(8, 64), scheme="lsuv", lr_scale="sgd")


def test_plan_records_the_factors():
    """The plan holds what the model holds: one ``lr`` scale per layer equal to its buffer and
    to the factor, the weight's std divided by it; the alphas are untouched."""
    m = _mlp(width=100, depth=3)
    x = torch.randn(32, 64)
    ref, rref = precondfx.precondition(m, x, balance="none")
    out, rep = precondfx.precondition(m, x, balance="none", lr_scale="user")
    assert rep.plan.options["lr_scale"] == "user"
    assert any("lr_scale='user'" in n for n in rep.plan.notes)
    fac = rep.conditioning["lr_scale"]["factors"]
    buffers = dict(out.named_buffers())
    lr = {sc.node: sc for sc in rep.plan.scales if sc.tag == "lr"}
    assert len(lr) == len(rep.plan.layers) == 4
    for lay in rep.plan.layers:
        assert lay.alpha == 1.0
        sc = lr[lay.node]
        assert sc.value == pytest.approx(fac[lay.weight], rel=1e-12)
        assert "lr_scale='user'" in sc.reason
        assert rep.plan.inits[lay.weight].std == pytest.approx(
            rref.plan.inits[lay.weight].std / fac[lay.weight], rel=1e-12)
        assert rep.plan.inits[lay.bias].rule == "zeros"
    assert sorted(sc.value for sc in lr.values()) == pytest.approx(
        sorted(float(b) for n, b in buffers.items() if "precondfx_lr" in n))
    # the intent (planned) has the multipliers at 1; the record says what lr_scale set
    assert all(sc.value == 1.0 for sc in rep.planned.scales if sc.tag == "lr")
    assert {ch.stage for ch in rep.measured.changes if ch.kind == "scale"} >= {"lr_scale"}


def _precondition(m, x, backend, **kw):
    """fx (a GraphModule) or eager (the user's own module: inplace=True on a copy)."""
    if backend == "eager":
        m = copy.deepcopy(m)
        kw["inplace"] = True
    out, rep = precondfx.precondition(m, x, **kw)
    assert isinstance(out, torch.fx.GraphModule) == (backend == "fx")
    return out, rep


@pytest.mark.parametrize("backend", ["fx", "eager"])
@pytest.mark.parametrize("balance", ["none", "hessian"])
@pytest.mark.parametrize("mode,opt", [("sgd", "sgd"), ("user", "adam"), ("adam", "adam")])
def test_one_optimizer_step_moves_weight_and_bias_by_the_same_factor(mode, opt, balance,
                                                                      backend):
    """The whole layer sees the same change of effective learning rate: one torch.optim step
    at the same rate moves c*b (the bias the function sees) by c^2 times the move without the
    option under SGD, c times under Adam, exactly as it moves alpha*c*W.  (Before the bias was
    covered it moved by 1x.)"""
    m = _mlp(width=40, depth=3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 64, generator=g), torch.randint(0, 10, (40,), generator=g)
    ref, _ = _precondition(m, x, backend, balance=balance, seed=0)
    out, rep = _precondition(m, x, backend, balance=balance, seed=0, lr_scale=mode)
    fac = list(rep.conditioning["lr_scale"]["factors"].values())
    assert len(fac) == 4 and min(abs(c - 1) for c in fac) > 0.02   # >> rel 1e-3
    deltas = {}
    for tag, model in (("ref", ref), ("out", out)):
        before = _layer_product(model, "weight") + _layer_product(model, "bias")
        o = (torch.optim.SGD(model.parameters(), lr=1e-2) if opt == "sgd" else
             torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-14))
        o.zero_grad()
        _loss(model, x, y).backward()
        o.step()
        after = _layer_product(model, "weight") + _layer_product(model, "bias")
        deltas[tag] = [float((a - b).norm()) for a, b in zip(after, before)]
    want = [c * c if mode == "sgd" else c for c in fac] * 2        # weights, then biases
    assert all(d > 0 for d in deltas["ref"])
    assert [d1 / d0 for d0, d1 in zip(deltas["ref"], deltas["out"])] == pytest.approx(want,
                                                                                      rel=1e-3)


@pytest.mark.parametrize("backend", ["fx", "eager"])
@pytest.mark.parametrize("mode", ["sgd"])       # ('adam' was removed)
def test_nonzero_biases_kept_and_keys_kept(mode, backend):
    """reinit_weights=False keeps the user's (nonzero) biases: dividing them by c is what
    keeps the function (logits within 1e-5); the state_dict keeps every key of the user's
    model, the added ones are precondfx_* buffers; the plan records the biases' factor."""
    m = _mlp(width=30, depth=3)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    kw = dict(balance="none", reinit_weights=False, target_std=None)
    out, rep = _precondition(m, x, backend, lr_scale=mode, **kw)
    xt = torch.randn(100, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (out(xt) - m(xt)).abs().max().item() <= 1e-5
    fac = rep.conditioning["lr_scale"]["factors"]
    biases = {n: p for n, p in m.named_parameters() if n.endswith("bias")}
    got = dict(out.named_parameters())
    for lay in rep.plan.layers:
        c = fac[lay.weight]
        assert got[lay.bias].detach() * c == pytest.approx(biases[lay.bias].detach(), rel=1e-6)
        assert rep.plan.inits[lay.bias].rule == "scale"
        assert rep.plan.inits[lay.bias].std == pytest.approx(1 / c, rel=1e-12)
    keys, user = set(out.state_dict()), set(m.state_dict())
    assert user <= keys and all("precondfx_" in k for k in keys - user)
    assert sum("precondfx_lr" in k for k in keys) == 4


@pytest.mark.parametrize("backend", ["fx", "eager"])
@pytest.mark.parametrize("mode", ["sgd"])       # ('adam' was removed)
def test_residual_conv_unchanged_both_backends(mode, backend):
    """Residual conv net (branch scales and the multipliers on the same convs): same function
    with its own biases (reinit_weights=False) and after re-initialization."""
    m = _Res()
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    for kw in (dict(reinit_weights=False, target_std=None, balance="none"), dict(seed=1)):
        ref, _ = _precondition(m, x, backend, **kw)
        out, rep = _precondition(m, x, backend, lr_scale=mode, **kw)
        with torch.no_grad():
            assert (out(x) - ref(x)).abs().max().item() <= 1e-5
        assert rep.conditioning["lr_scale"]["left_out"] == {}
        assert len(rep.conditioning["lr_scale"]["factors"]) == 6


@pytest.mark.parametrize("backend", ["fx", "eager"])
def test_fold_keeps_the_function(backend):
    """fold() multiplies the multipliers back into weight and bias: the user's class, the
    user's keys, the same function."""
    m = _mlp(width=30, depth=3)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    out, _ = _precondition(m, x, backend, balance="none", reinit_weights=False,
                           target_std=None, lr_scale="sgd")
    f = precondfx.fold(out)
    assert type(f) is type(m) and set(f.state_dict()) == set(m.state_dict())
    with torch.no_grad():
        assert (f(x) - m(x)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("mode", ["sgd"])       # ('adam' was removed)
def test_meta_device_materializes_to_the_real_result(mode):
    """Planned on the meta device (no data), then to_empty + reinit (which writes the recorded
    multipliers back and draws W/c): the real run's model."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    kw = dict(balance="analytic", seed=3, target_std=None, lr_scale=mode)
    real, rreal = precondfx.precondition(_mlp(width=48, depth=3), x, **kw)
    with torch.device("meta"):
        mm = _mlp(width=48, depth=3)
    pm, rep = precondfx.precondition(mm, x, **kw)
    assert all(p.device.type == "meta" for p in pm.parameters())
    assert rep.conditioning["lr_scale"]["factors"] == pytest.approx(
        rreal.conditioning["lr_scale"]["factors"], rel=1e-6)
    pm = pm.to_empty(device="cpu")
    precondfx.reinit(pm, rep.plan, seed=3)
    assert _lrs(pm) == pytest.approx(_lrs(real), rel=1e-6) and len(_lrs(pm)) == 4
    with torch.no_grad():
        assert (pm(x) - real(x)).abs().max().item() <= 1e-5


def test_transformers_conv1d_fan_in_is_the_input_width():
    """transformers' Conv1D stores W as (in, out): the fan-in is read from the call's output
    (GPT-2 n_embd 32: c_attn, c_fc and attn.c_proj read 32 inputs, mlp.c_proj 128).  GPT-2
    from its config (the eager back end: fx cannot keep it): logits unchanged under both
    modes, every weighted layer scaled (the tied wte/lm_head once), the user's keys kept."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    m = GPT2LMHeadModel(cfg)
    x = torch.randint(0, 64, (4, 16))
    ref, _ = precondfx.precondition(m, x, use_cache=False, lr_scale=None)
    for mode in ("sgd", "user"):
        out, rep = precondfx.precondition(m, x, use_cache=False, lr_scale=mode)
        with torch.no_grad():
            d = out(x, use_cache=False).logits - ref(x, use_cache=False).logits
            assert d.abs().max() <= 1e-5
        sec = rep.conditioning["lr_scale"]
        assert sec["left_out"] == {} and len(sec["factors"]) == 6   # wte, wpe, 4 Conv1D
        keys, user = set(out.state_dict()), set(m.state_dict())
        assert user <= keys and all("precondfx_" in k for k in keys - user)
    L = sec["depth"]
    assert L == 2                       # embedding and head; the blocks are residual branches
    # 'user' (the last mode): every Conv1D and the tied embedding stored at the geometric mean
    # of precondfx's rms and the transformers init's (lr_scale='adam', removed, set rms
    # sqrt(fan_in)/64 (L/3)^1.5 here)
    w, u, r = (dict(out.named_parameters()), dict(m.named_parameters()),
               dict(ref.named_parameters()))
    for name in ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight",
                 "transformer.h.0.attn.c_proj.weight", "transformer.h.0.mlp.c_proj.weight",
                 "transformer.wte.weight"]:
        want = (_rms(u[name]) * _rms(r[name])) ** 0.5
        assert _rms(w[name]) == pytest.approx(want, rel=1e-5), name
        assert _rms(w[name]) > 1.5 * _rms(u[name])     # not the user's rms (power 1)


# -- lr_scale='user': every stored weight halfway to the user's model's own scale --------------
@pytest.mark.parametrize("inplace", [False, True])
def test_user_mode_stores_weights_at_the_users_rms_and_keeps_the_function(inplace):
    """lr_scale='user': the function equals the default pass's (same seed) and each weight
    matrix is stored at the geometric mean of precondfx's rms and the rms it had in the user's
    model (PyTorch's init, 1/sqrt(3 fan_in) here), the ratio carried by the layer's multiplier;
    also with inplace=True (the user's rms is read before the weights are re-drawn)."""
    m = _mlp()
    user = {n: float(p.detach().pow(2).mean().sqrt()) for n, p in m.named_parameters()
            if p.dim() == 2}
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    ref, _ = precondfx.precondition(copy.deepcopy(m), x, seed=1)
    out, rep = precondfx.precondition(m, x, seed=1, lr_scale="user", inplace=inplace)
    torch.testing.assert_close(out(x), ref(x), rtol=1e-4, atol=1e-5)
    got = {n: float(p.detach().pow(2).mean().sqrt()) for n, p in out.named_parameters()
           if p.dim() == 2}
    pfx = {n: float(p.detach().pow(2).mean().sqrt()) for n, p in ref.named_parameters()
           if p.dim() == 2}
    assert set(got) == set(user)
    for n in user:
        want = (user[n] * pfx[n]) ** 0.5
        assert abs(got[n] / want - 1) < 1e-5, (n, got[n], want)
    fac = rep.conditioning["lr_scale"]["factors"]
    assert len(fac) == 4 and all(c > 1.2 for c in fac.values())   # geometric init is larger
