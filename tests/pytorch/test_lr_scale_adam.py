"""lr_scale='adam' (precondfx.pytorch.lr_transfer): one AdamW rate across MLP widths and depths.
The factor follows the documented formula, computed here from the layer shapes alone; the
function is unchanged; one AdamW step moves each layer's effective weight by c times the step
without the option; on a model that declares its init (transformers) it multiplies the storage
lr_scale='auto' chooses."""
import pytest
import torch
from torch import nn

import precondfx


def _mlp(widths, n_in=64, n_out=10, seed=0):
    torch.manual_seed(seed)
    layers, prev = [], n_in
    for w in widths:
        layers += [nn.Linear(prev, w), nn.ReLU()]
        prev = w
    return nn.Sequential(*layers, nn.Linear(prev, n_out))


@pytest.mark.parametrize("widths", [[32, 32], [512], [96, 96, 96, 96, 96], [96, 48, 200]])
def test_factors_follow_width_and_depth(widths):
    """One factor on every layer, c = (128 / h) ** 0.5 * (3 / L) ** 1.5: L the number of
    weighted layers, h the median of the layers' widths, each its fan-in except the first
    layer's, whose fan-in is the data's 64 features (its fan-out instead).  So the option is
    the default trained at c times the AdamW rate: the layers' rates relative to each other
    are the default's."""
    m = _mlp(widths)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    out, rep = precondfx.precondition(m, x, lr_scale="adam", seed=0)
    sec = rep.conditioning["lr_scale"]
    L = len(widths) + 1
    assert sec["depth"] == L
    names = [n for n, p in m.named_parameters() if n.endswith("weight")]
    hs = sorted([widths[0]] + list(widths))          # first: fan-out; the others: fan-in
    h = hs[len(hs) // 2] if len(hs) % 2 else (hs[len(hs) // 2 - 1] + hs[len(hs) // 2]) / 2
    c = (128 / h) ** 0.5 * (3 / L) ** 1.5
    want = {n: c for n in names}
    got = {n: sec["factors"].get(n, 1.0) for n in names}
    assert got == pytest.approx(want, rel=1e-6)
    ref, _ = precondfx.precondition(m, x, seed=0)
    xt = torch.randn(100, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert float((out(xt) - ref(xt)).abs().max()) <= 1e-5 * float(ref(xt).abs().max())
    # the stored weight is the reference's divided by c
    for n in names:
        r = float(ref.get_parameter(n).detach().norm() / out.get_parameter(n).detach().norm())
        assert r == pytest.approx(want[n], rel=1e-5)


def test_one_adamw_step_moves_each_layer_by_c():
    """One torch.optim.AdamW step at one rate: the change of each layer's alpha * c * W is c
    times the change without the option (Adam's step does not scale with the gradient)."""
    m = _mlp([256, 256, 256])
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 64, generator=g), torch.randint(0, 10, (40,), generator=g)
    ref, _ = precondfx.precondition(m, x, balance="none", seed=0)
    out, rep = precondfx.precondition(m, x, balance="none", seed=0, lr_scale="adam")
    names = [n for n, p in m.named_parameters() if n.endswith("weight")]
    fac = rep.conditioning["lr_scale"]["factors"]
    moved = []
    for model in (ref, out):
        lr_bufs = [b for n, b in model.named_buffers() if "precondfx_lr" in n]
        al = [b for n, b in model.named_buffers() if "alpha" in n]
        def eff():
            ws = [model.get_parameter(n).detach().clone() for n in names]
            cs = [float(b) for b in lr_bufs] or [1.0] * len(ws)
            a = [float(b) for b in al] or [1.0] * len(ws)
            return [ai * ci * w for ai, ci, w in zip(a, cs, ws)]
        before = eff()
        o = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-12, weight_decay=0.0)
        nn.functional.cross_entropy(model(x), y).backward()
        o.step()
        moved.append([float((a - b).norm()) for a, b in zip(eff(), before)])
    for n, d0, d1 in zip(names, *moved):
        assert d1 == pytest.approx(d0 * fac.get(n, 1.0), rel=1e-3)


def test_conv_widths_count_the_kernel():
    """A convolution's width is its channels times the kernel taps that see the input (the fans
    the geometric init uses: on an 8x8 input with padding 1 a 3-tap row sees 2 taps at both
    edges and 3 inside, 22/8 on average): the stem reading the image is sized by its fan-out,
    the others by their fan-in, and the median of the three sets the one factor."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                      nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    _, rep = precondfx.precondition(m, x, lr_scale="adam", seed=0)
    fac = rep.conditioning["lr_scale"]["factors"]
    taps = (22 / 8) ** 2
    c = (128 / (16 * taps)) ** 0.5      # widths 16 taps, 16 taps, 32: median 16 taps; L = 3
    want = {"0.weight": c, "2.weight": c, "6.weight": c}
    assert {n: fac.get(n, 1.0) for n in want} == pytest.approx(want, rel=1e-6)


def test_on_top_of_the_declared_init_storage():
    """A transformers GPT-2 (initializer_range 0.02): 'adam' multiplies the storage 'auto'
    chooses (a power-of-two factor per layer) by its one factor, here (128 / 64) ** 0.5 *
    (3 / 2) ** 1.5 (width 64, main-path depth 2: the embeddings and the head)."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    m = GPT2LMHeadModel(cfg)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    _, ra = precondfx.precondition(m, x, seed=0)
    _, rb = precondfx.precondition(m, x, lr_scale="adam", seed=0)
    fa = ra.conditioning["lr_scale"]["factors"]
    fb = rb.conditioning["lr_scale"]["factors"]
    assert rb.conditioning["lr_scale"]["depth"] == 2 and fa
    c = (128 / 64) ** 0.5 * (3 / 2) ** 1.5
    assert {n: fb[n] for n in fa} == pytest.approx({n: v * c for n, v in fa.items()}, rel=1e-6)
