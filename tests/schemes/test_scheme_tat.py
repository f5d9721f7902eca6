"""The TAT and DKS schemes through the whole pipeline (``precondition(..., scheme="tat"|"dks")``).

Expected numbers come from ``shared/spec/tat-dks-spec.md`` (cited "spec §x"): its §4.2 table of
TReLU slopes for vanilla nets, the dks reference test value of §4.1 for the ResNet-101-like
architecture, the §4.4 smooth TAT/DKS parameters and the §4.5 theory values of the App. E.1
kernel experiment.  Predicted cosines are computed here from the closed-form leaky-ReLU C map
written out in this file (spec §2.3), not with precondfx code; measured cosines come from
running the rewritten model.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from precondfx.errors import PrecondError
from precondfx.pytorch.modules import ScaledLeakyReLU, TransformedActivation


# ---------------------------------------------------------------------------------------------
# models (written here) and an independent C map
# ---------------------------------------------------------------------------------------------
def plain_mlp(depth: int, width: int = 8, act=nn.ReLU) -> nn.Sequential:
    """Linear, (act, Linear) * depth: ``depth`` nonlinear layers (spec §4.2's L)."""
    layers: list[nn.Module] = [nn.Linear(width, width)]
    for _ in range(depth):
        layers += [act(), nn.Linear(width, width)]
    return nn.Sequential(*layers)


class FunctionalMLP(nn.Module):
    """The same plain net with functional ``F.relu`` calls (rewritten in the fx graph)."""

    def __init__(self, depth: int, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        for lin in self.layers[1:]:
            x = lin(F.relu(x))
        return x


class BottleneckV2(nn.Module):
    """Pre-activation bottleneck: shortcut ``x`` (or act+1x1 conv in a transition block) plus
    the branch conv(act(conv(act(conv(act(x)))))), the structure of spec §4.1/§4.3."""

    def __init__(self, c: int, transition: bool) -> None:
        super().__init__()
        self.transition = transition
        self.c1, self.c2, self.c3 = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 3, padding=1), \
            nn.Conv2d(c, c, 1)
        if transition:
            self.sc = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = F.relu(x)
        sc = self.sc(p) if self.transition else x
        return sc + self.c3(F.relu(self.c2(F.relu(self.c1(p)))))


class ResNetV2(nn.Module):
    """Stem conv, bottleneck groups (first block of each a transition), final act, mean, head."""

    def __init__(self, groups=(3, 4, 23, 3), c: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*[BottleneckV2(c, j == 0) for n in groups for j in range(n)])
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.blocks(self.stem(x))).mean((2, 3)))


def c_map(c: float, a: float) -> float:
    """TReLU local C map, spec §2.3: c + (1-a)^2/(pi(1+a^2)) (sqrt(1-c^2) - c arccos c)."""
    c = min(1.0, max(-1.0, c))
    return c + (1 - a) ** 2 / (math.pi * (1 + a * a)) * (math.sqrt(1 - c * c) - c * math.acos(c))


def composed(c: float, a: float, depth: int) -> float:
    for _ in range(depth):
        c = c_map(c, a)
    return c


def trelus(model: nn.Module) -> list[ScaledLeakyReLU]:
    return [m for m in model.modules() if isinstance(m, ScaledLeakyReLU)]


# ---------------------------------------------------------------------------------------------
# TReLU slopes through the graph pass
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth,functional,slope,scale", [
    (100, False, 0.5704395324, 1.2284042441),   # spec §4.2, L=100, eta=0.9
    (50, True, 0.4305229485, 1.2989477863),     # spec §4.2, L=50, eta=0.9
])
def test_plain_mlp_slope(depth, functional, slope, scale):
    torch.manual_seed(0)
    model = FunctionalMLP(depth) if functional else plain_mlp(depth)
    out, rep = precondfx.precondition(model, torch.randn(16, 8), scheme="tat")
    info = rep.conditioning["tat"]
    assert abs(info["negative_slope"] - slope) < 5e-10
    assert abs(info["output_scale"] - scale) < 5e-10
    assert info["nonlinear_layers"] == depth and info["joins"] == 0
    mods = trelus(out)
    assert len(mods) == depth                   # every ReLU, module or functional, replaced
    for m in mods:
        assert abs(m.negative_slope - slope) < 5e-10
        assert abs(float(m.scale) - scale) < 1e-6
    assert not any(isinstance(m, nn.ReLU) for m in out.modules())
    # init plan: orthogonal weights, zero biases
    w = [p for n, p in rep.plan.inits.items() if n.endswith("weight")]
    b = [p for n, p in rep.plan.inits.items() if n.endswith("bias")]
    assert {p.rule for p in w} == {"orthogonal"} and {p.rule for p in b} == {"zeros"}
    lin = next(m for m in out.modules() if isinstance(m, nn.Linear))
    eye = torch.eye(8)
    assert torch.allclose(lin.weight.detach() @ lin.weight.detach().T, eye, atol=1e-5)


def test_resnet101_like_slope_and_normalized_sums():
    """Spec §4.1: the dks test architecture (ResNet-101-V2-like, shortcut weight 0.6) at eta=0.75
    gives negative slope 0.6291800290346146 and scale 1.196996549778802; its mu^2 coefficient
    (effective depth) is (101-6)(1-0.36)+5 = 65.8 (paper App. B.5)."""
    torch.manual_seed(0)
    out, rep = precondfx.precondition(
        ResNetV2(), torch.randn(2, 3, 4, 4), scheme="tat",
        scheme_options={"eta": 0.75, "shortcut_weight": 0.6})
    info = rep.conditioning["tat"]
    assert abs(info["negative_slope"] - 0.6291800290346146) < 1e-12
    assert abs(info["output_scale"] - 1.196996549778802) < 1e-12
    assert abs(info["effective_depth"] - 65.8) < 1e-9
    assert info["nonlinear_layers"] == 100 and info["normalized_sums"] == 33
    mods = trelus(out)
    assert len(mods) == 100
    assert all(abs(m.negative_slope - 0.6291800290346146) < 1e-12 for m in mods)
    bufs = dict(out.named_buffers())
    sc = [float(v) for k, v in bufs.items() if k.startswith("precondfx_shortcut")]
    br = [float(v) for k, v in bufs.items() if k.startswith("precondfx_residual")]
    assert len(sc) == len(br) == 33
    assert all(abs(v - 0.6) < 1e-6 for v in sc) and all(abs(v - 0.8) < 1e-6 for v in br)
    # Delta-orthogonal 3x3 convs: off-centre taps zero, centre tap orthogonal (4 -> 4 channels)
    w = out.get_submodule("blocks.5.c2").weight.detach()
    centre = w[:, :, 1, 1]
    assert float(w.abs().sum() - centre.abs().sum()) == 0.0
    assert torch.allclose(centre @ centre.T, torch.eye(4), atol=1e-5)
    for i in range(3):
        assert float(out.get_submodule(f"blocks.{i}.c1").bias.detach().abs().max()) == 0


def test_predicted_vs_measured_cosine():
    """A wide (1024) plain TReLU net with 50 nonlinear layers, eta=0.9 (spec §4.5, App. E.1).

    The predicted map is the closed-form C map composed with the slope found in the model.
    Its values at c0=0 after 10/25/50 layers must equal the spec's theory column (0.5256,
    0.7737, 0.9000; 4 decimals given).  Measured: the mean cosine over 100 input pairs of
    exact cosine c0 and q=1, after layers 10, 25 and at the output, averaged over 4 networks
    (seeds 0-3).  Tolerance 0.02 on that average.  One network's means move with its draw:
    at width 512 the worst of the 9 errors was 0.012-0.048 over seeds 0-5, either sign, and
    the 6-network average still missed by 0.023 after layer 10 (finite-width error; the spec's
    App. E.1 experiment, SUO at width 300 and depth 50, reports a per-pair std of 0.028).  At
    width 1024 the 4-network average is within 0.0052 of the prediction everywhere.  The old
    single network (width 512, seed 0) passed only because its first layer's weight rows were
    copies of the sample (the weights' stream was the sample's: ``core.draw.weight_seed``).
    0.02 still fails for a wrong slope (slope 0, plain ReLU, gives 0.988 at the output; slope
    0.5 gives 0.849)."""
    width, depth, seeds = 1024, 50, range(4)
    sums: dict[tuple[float, int], float] = {}
    for seed in seeds:
        torch.manual_seed(0)
        out, rep = precondfx.precondition(plain_mlp(depth, width), torch.randn(64, width),
                                          scheme="tat", seed=seed)
        a = trelus(out)[0].negative_slope
        for layer, theory in ((10, 0.5256), (25, 0.7737), (50, 0.9000)):
            assert abs(composed(0.0, a, layer) - theory) < 6e-5
        g = torch.Generator().manual_seed(1)
        seen: dict[int, torch.Tensor] = {}
        hooks = [out.get_submodule(str(2 * layer)).register_forward_hook(
            lambda mod, i, o, layer=layer: seen.__setitem__(layer, o)) for layer in (10, 25)]
        try:
            for c0 in (-0.5, 0.0, 0.5):
                z = torch.randn(100, width, 2, generator=g, dtype=torch.float64)
                q, _ = torch.linalg.qr(z)
                u, v = q[..., 0], q[..., 1]
                x1 = math.sqrt(width) * u
                x2 = math.sqrt(width) * (c0 * u + math.sqrt(1 - c0 * c0) * v)
                with torch.no_grad():
                    y1 = out(x1.float()).double()
                    h1 = {k: t.double() for k, t in seen.items()}
                    y2 = out(x2.float()).double()
                    h2 = {k: t.double() for k, t in seen.items()}
                measured = {50: F.cosine_similarity(y1, y2, dim=1)}
                measured.update({k: F.cosine_similarity(h1[k], h2[k], dim=1) for k in h1})
                for layer, cos in measured.items():
                    sums[(c0, layer)] = sums.get((c0, layer), 0.0) + float(cos.mean())
                    assert float(cos.std()) < 0.05
        finally:
            for h in hooks:
                h.remove()
    for (c0, layer), total in sums.items():
        pred = composed(c0, a, layer)       # the slope depends on depth and eta only
        assert abs(total / len(seeds) - pred) < 0.02, (c0, layer, total / len(seeds), pred)


def test_unreachable_eta_is_refused():
    with pytest.raises(PrecondError, match="unreachable.*0.604826"):   # spec §4.2: L=3 max
        precondfx.precondition(plain_mlp(3), torch.randn(8, 8), scheme="tat")


# ---------------------------------------------------------------------------------------------
# smooth activations: TAT and DKS transforms (spec §4.4)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme,act,expected", [
    ("tat", nn.Tanh, (0.0576408356, 0.5218106577, -0.4795954874, 22.5069464204)),
    ("dks", nn.Softplus, (0.2280237626, 0.4075095828, -0.9237196072, 7.3032530363)),
])
def test_smooth_transforms_and_unit_q(scheme, act, expected):
    """Spec §4.4 (vanilla L=100; TAT tau=0.3, DKS zeta=1.5): (alpha, beta, delta, gamma).  The
    transforms give Q(1)=1, so with the input scaled to q=1 (input_norm 'auto' = 'scale') the
    measured second moment after every activation of a width-256 net stays near 1."""
    torch.manual_seed(0)
    out, rep = precondfx.precondition(plain_mlp(100, 256, act), 3 * torch.randn(64, 256),
                                      scheme=scheme)
    mods = [m for m in out.modules() if isinstance(m, TransformedActivation)]
    assert len(mods) == 100
    a, b, d, g = expected
    m = mods[0]
    for got, want in ((m.alpha, a), (m.beta, b), (m.delta, d), (m.gamma, g)):
        assert abs(float(got) - want) < 1e-6 * max(1.0, abs(want))
    info = rep.conditioning[scheme]
    assert abs(info["input"]["scale"] - 1 / 3) < 0.02
    q = info["q_at_activations"]
    assert q["measured"] == 100 and 0.8 < q["min"] and q["max"] < 1.25


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ self.k(x).transpose(1, 2) / 4
        return self.o(torch.softmax(s, -1) @ self.v(x))


def deep_cnn(pool: nn.Module, norm: bool = False) -> nn.Sequential:
    body: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1)]
    for _ in range(20):
        body += ([nn.BatchNorm2d(8)] if norm else []) + [nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)]
    return nn.Sequential(*body, pool, nn.Flatten(), nn.Linear(8 * 4 * 4, 10))


@pytest.mark.parametrize("model,sample,kwargs,match", [
    (deep_cnn(nn.MaxPool2d(2), norm=True), (4, 3, 8, 8), {}, r"BatchNorm2d.*without\* normal"),
    (Attention(), (2, 5, 16), {}, r"attention, softmax"),
    (nn.Sequential(nn.Linear(16, 16), nn.MultiheadAttention(16, 2)), None, {},
     r"MultiheadAttention"),
    (deep_cnn(nn.MaxPool2d(2)), (4, 3, 8, 8), {"maxpool": "keep"}, r"maxpool='stride'"),
])
def test_refusals(model, sample, kwargs, match):
    if sample is None:   # nn.MultiheadAttention needs (q, k, v): a wrapper
        class MHA(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.o = nn.MultiheadAttention(16, 2, batch_first=True), nn.Linear(16, 4)

            def forward(self, x):
                return self.o(self.a(x, x, x)[0])
        model, sample = MHA(), (2, 5, 16)
    with pytest.raises(PrecondError, match=match):
        precondfx.precondition(model, torch.randn(*sample), scheme="tat", **kwargs)


def test_replaced_max_pooling_is_accepted():
    for mode in ("stride", "avgpool"):
        out, rep = precondfx.precondition(deep_cnn(nn.MaxPool2d(2)), torch.randn(4, 3, 8, 8),
                                          scheme="tat", maxpool=mode)
        assert abs(rep.conditioning["tat"]["negative_slope"] - 0.1813802719) < 5e-10  # §4.2 L=20
        assert len(trelus(out)) == 20


# ---------------------------------------------------------------------------------------------
# the eager back end
# ---------------------------------------------------------------------------------------------
class SharedReLU(nn.Module):
    """One nn.ReLU module called at every layer (eager replacement needs every call)."""

    def __init__(self, depth: int = 30, width: int = 16) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(width, width) for _ in range(depth + 1))
        self.act = nn.ReLU()

    def forward(self, x):
        x = self.lins[0](x)
        for lin in self.lins[1:]:
            x = lin(self.act(x))
        return x


class Basic(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU(),
                               nn.Conv2d(c, c, 3, padding=1))

    def forward(self, x):
        return x + self.f(x)


def test_eager_paths():
    x = torch.randn(16, 16)
    out, rep = precondfx.precondition(SharedReLU(), x, scheme="tat", capture="eager")
    assert rep.capture == "eager" and isinstance(out.act, ScaledLeakyReLU) and not rep.skipped
    assert abs(composed(0.0, out.act.negative_slope, 30) - 0.9) < 1e-7   # C_f(0) = eta
    with pytest.raises(PrecondError, match="could not be replaced"):
        precondfx.precondition(FunctionalMLP(30), x[:, :8], scheme="tat", inplace=True)
    # residual joins in the eager back end: the shortcut operand has no module to hook, so the
    # branch alone carries sqrt(1-w^2)/w; a TReLU net is homogeneous, so output cosines equal
    # those of the fx rewrite (same seed, same weights)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *[Basic(8) for _ in range(20)],
                        nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16, 10))
    xs = torch.randn(8, 3, 4, 4)
    cos = []
    for inplace in (False, True):
        m, rep = precondfx.precondition(copy.deepcopy(net), xs, scheme="tat", inplace=inplace,
                                        target_std=None,
                                        scheme_options={"shortcut_weight": 0.5})
        assert not rep.skipped
        with torch.no_grad():
            y = F.normalize(m(xs).double(), dim=1)
        cos.append(y @ y.T)
    assert torch.allclose(cos[0], cos[1], atol=1e-6)


def test_per_location_normalize():
    from precondfx.schemes.tat import per_location_normalize
    x = torch.rand(4, 3, 5, 5)
    x[:, :, 0, 0] = 0.0                           # an all-zero location (blank pixel)
    y = per_location_normalize(x)
    assert y.shape == (4, 4, 5, 5)               # homogeneous channel appended
    assert torch.allclose(y.pow(2).mean(1), torch.ones(4, 5, 5), atol=1e-6)
    # spec §4.1: "one" mode with no features: [0.3] -> sqrt(2/1.09) * [0.3, 1.0]
    z = per_location_normalize(torch.tensor([[0.3]]))
    assert torch.allclose(z, math.sqrt(2 / 1.09) * torch.tensor([[0.3, 1.0]]), atol=1e-6)


class Inception(nn.Module):
    """Two parallel branches from one fork, concatenated along channels (4 + 12)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.a = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 1)
        self.b, self.out = nn.Conv2d(8, 12, 3, padding=1), nn.Conv2d(16, 8, 1)

    def forward(self, x):
        h = F.relu(self.stem(x))
        return self.out(F.relu(torch.cat([self.a(h), F.relu(self.b(h))], 1)))


def test_architecture_of_a_concat_block():
    """Spec §2.5 "Concatenation": a concat followed by an affine layer is a normalized sum with
    w_i^2 = d_i / sum d, so U(x) = r((4/16) * r(x) + (12/16) * r(r(x))) for this block."""
    from precondfx.schemes import tat as tm
    from precondfx.schemes.tat import architecture
    an = architecture(Inception(), torch.randn(2, 3, 6, 6))
    assert len(an.joins) == 1 and an.joins[0].kind == "concat"
    assert an.joins[0].weights == [4.0, 12.0]
    r = lambda y: y * y   # noqa: E731  (any map will do to check the composition)
    x = 0.3
    want = r(4 / 16 * r(x) + 12 / 16 * r(r(x)))
    assert abs(tm.u_map(an.arch, x, r) - want) < 1e-12
