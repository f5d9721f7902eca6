"""Regression tests from the schemes hunt: scheme_options values that were accepted and then
crashed, silently changed or did nothing, and a report line that misstated the gamma used."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import precondfx
from precondfx.errors import PrecondError


def _mlp(act: type[nn.Module], depth: int = 2) -> nn.Sequential:
    layers: list[nn.Module] = []
    n = 16
    for _ in range(depth):
        layers += [nn.Linear(n, 32), act()]
        n = 32
    layers.append(nn.Linear(n, 10))
    return nn.Sequential(*layers)


def _wn_mlp() -> nn.Sequential:
    return nn.Sequential(weight_norm(nn.Linear(16, 32)), nn.ReLU(), weight_norm(nn.Linear(32, 10)))


def _run(model: nn.Module, scheme: str, **so):
    torch.manual_seed(0)
    kw = {k[1:]: v for k, v in so.items() if k.startswith("_")}     # precondition options
    so = {k: v for k, v in so.items() if not k.startswith("_")}
    return precondfx.precondition(model, torch.randn(64, 16), scheme=scheme, scheme_options=so,
                                  **kw)


@pytest.mark.parametrize("scheme,opts,model,names", [
    # wn: a negative gamma on a plain-weight ReLU layer was math.sqrt's ValueError; NaN was a
    # misleading "NaN after re-initialization" error about the model
    ("wn", {"gamma_relu": -1.0}, lambda: _mlp(nn.ReLU), "gamma_relu"),
    ("wn", {"gamma_relu": float("nan")}, lambda: _mlp(nn.ReLU), "gamma_relu"),
    ("wn", {"gamma_relu": 0.0}, _wn_mlp, "gamma_relu"),
    # gne: a string epsilon was a TypeError; diag_probes=0 became 4 silently; gamma0=inf passed
    ("gne", {"selu": "depth", "selu_epsilon": "x"},
     lambda: nn.Sequential(nn.Linear(16, 32), nn.SELU(), nn.Linear(32, 10)), "selu_epsilon"),
    ("gne", {"diagnostics": True, "diag_probes": 0}, lambda: _mlp(nn.ReLU), "diag_probes"),
    ("gne", {"gamma0": float("inf")}, lambda: _mlp(nn.ReLU), "gamma0"),
    # tat/dks: NaN tau reached the solver ("solve_increasing: fn(0.1) returned 0.3"); q_slope<=0
    # ended in "failed to find transformation parameters" without naming the option
    ("tat", {"tau": float("nan")}, lambda: _mlp(nn.Tanh), "tau"),
    ("dks", {"q_slope": 0.0}, lambda: _mlp(nn.Tanh), "q_slope"),
    ("dks", {"zeta": float("inf")}, lambda: _mlp(nn.Tanh), "zeta"),
    # w = 1 multiplied every residual branch by sqrt(1 - w^2) = 0: the branch layers got zero
    # gradient (measured: 0.0 on a residual tanh net), silently
    ("tat", {"shortcut_weight": 1.0}, lambda: _mlp(nn.Tanh), "shortcut_weight"),
])
def test_bad_scheme_option_values_are_refused_by_name(scheme, opts, model, names):
    with pytest.raises(PrecondError, match=names):
        _run(model(), scheme, **opts)


@pytest.mark.parametrize("scheme,opts,model,key", [
    ("gne", {"selu_epsilon": 0.1}, lambda: _mlp(nn.ReLU), "selu_epsilon"),
    ("gne", {"diag_probes": 8}, lambda: _mlp(nn.ReLU), "diag_probes"),
    ("gne", {"smn_center": False}, lambda: _mlp(nn.ReLU), "smn_center"),
    ("gne", {"gamma0": 4.0}, lambda: _mlp(nn.ReLU), "gamma0"),
    ("tat", {"eta": 0.5}, lambda: _mlp(nn.Tanh), "eta"),            # smooth: tau is read
    ("tat", {"eta": 0.5, "tau": 0.5}, lambda: _mlp(nn.ReLU, 12), "tau"),   # TReLU: eta is read
    ("wn", {"gamma_relu": 3.0}, lambda: _mlp(nn.Tanh), "gamma_relu"),
    ("tat", {"shortcut_weight": 0.5}, lambda: _mlp(nn.Tanh), "shortcut_weight"),  # no join
    ("dks", {"delta": False}, lambda: _mlp(nn.Tanh), "delta"),                    # no conv
    ("lsuv", {"alphas": "keep", "_balance": "none"}, lambda: _mlp(nn.Tanh), "alphas"),
    ("gne", {"effective_kernel": False}, lambda: _mlp(nn.ReLU), "effective_kernel"),
    ("gne", {"norm": "smn"}, lambda: _mlp(nn.ReLU), "norm='smn'"),      # no BatchNorm
    ("wn", {"residual": "pipeline"}, _wn_mlp, "residual"),                # no residual join
])
def test_scheme_option_without_effect_is_said(scheme, opts, model, key):
    _, rep = _run(model(), scheme, **opts)
    notes = rep.plan.notes + rep.conditioning[scheme]["notes"]
    said = [n for n in notes if key in n and "no effect" in n]
    assert said, notes


def test_wn_report_states_the_gamma_relu_used():
    """gamma_relu=3 sets g = sqrt(3 fan_in/fan_out) (checked on the weights), and the report
    said 'gamma = 2' for those layers."""
    model, rep = _run(_wn_mlp(), "wn", gamma_relu=3.0)
    g = model[0].parametrizations.weight.original0.detach()
    assert torch.allclose(g, torch.full_like(g, math.sqrt(3.0 * 16 / 32)))
    row = rep.conditioning["wn"]["layers"][0]
    assert row["gamma"] == 3.0
    assert "gamma = 3" in row["gamma_source"] and "gamma = 2" not in row["gamma_source"]


def test_lsuv_that_scales_nothing_does_not_report_convergence():
    """Every layer weight-normalized (parametrized): LSUV skips them all; its section said
    all_converged=True with no site, and the summary line showed it."""
    _, rep = _run(_wn_mlp(), "lsuv")
    sec = rep.conditioning["lsuv"]
    assert sec["sites"] == [] and len(sec["skipped"]) == 2
    assert sec["all_converged"] is False
    assert any("scaled no call site" in n for n in sec["notes"])


class _AvgPoolTanhCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        self.pool = nn.AvgPool2d(2)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = self.pool(torch.tanh(self.c1(x)))
        x = self.pool(torch.tanh(self.c2(x)))
        return self.fc(torch.flatten(x, 1))


def test_tat_self_check_says_when_q_at_an_activation_is_far_from_one():
    """A 2x2 average pooling between two transformed tanh layers averages four weakly
    correlated locations: q drops to ~1/4 at the next activation (measured here on a held-out
    batch), where the transform was solved for q = 1.  The q self-check measured it and the
    report did not say it."""
    torch.manual_seed(0)
    x, held = torch.randn(32, 3, 16, 16), torch.randn(32, 3, 16, 16)
    model, rep = precondfx.precondition(_AvgPoolTanhCNN(), x, scheme="tat")
    got = {}
    hook = model.c2.register_forward_hook(lambda m, i, o: got.setdefault("q_in", i[0]))
    with torch.no_grad():
        model(held)
    hook.remove()
    assert float(got["q_in"].pow(2).mean()) < 0.5      # q entering c2 (delta-orthogonal keeps q)
    notes = rep.conditioning["tat"]["notes"]
    assert any("self-check" in n and "q = 1" in n for n in notes), notes
    assert rep.conditioning["tat"]["q_at_activations"]["off_target"]


# -- activation parameters (ELU/CELU alpha, Softplus beta/threshold, GELU's tanh form) --------
# They were not captured for modules (and positional functional arguments were not parsed), so
# every scheme worked with torch's default activation: TAT/DKS replaced ELU(0.5) by a transform
# of ELU(1) (the network computed another activation, 34% off), gne/wn drew the weights for
# the default activation's E[f'(x)^2] (gne std 0.90-1.21x the formula, wn gamma up to 46% off).

def _phi_closed_form(name: str) -> float:
    """E[f'(x)^2], x ~ N(0, 1), in closed form: f' = 1 for x > 0, and for x < 0 ELU(alpha)
    has f' = alpha e^x (E[alpha^2 e^(2x); x<0] = alpha^2 e^2 Phi(-2)), CELU(alpha) has
    f' = e^(x/alpha) (alpha = 2: E[e^x; x<0] = e^(1/2) Phi(-1))."""
    Phi = lambda t: 0.5 * math.erfc(-t / math.sqrt(2))  # noqa: E731
    if name == "elu0.5":
        return 0.5 + 0.25 * math.exp(2.0) * Phi(-2.0)
    if name == "celu2":     # E[exp(2x/2); x<0] = e^(1/2) Phi(-1)
        return 0.5 + math.exp(0.5) * Phi(-1.0)
    raise KeyError(name)


@pytest.mark.parametrize("name,act", [("elu0.5", lambda: nn.ELU(0.5)),
                                      ("celu2", lambda: nn.CELU(2.0))])
def test_gne_and_wn_gains_use_the_activation_parameters(name, act):
    phi = _phi_closed_form(name)
    model, _ = _run(_mlp(act), "gne")
    w = model[2].weight.detach().double()            # 32 -> 32, followed by the activation
    assert float(w.pow(2).mean().sqrt()) == pytest.approx(1 / math.sqrt(phi * 32), rel=1e-6)
    _, rep = _run(_mlp(act), "wn")
    assert rep.conditioning["wn"]["layers"][1]["gamma"] == pytest.approx(1 / phi, rel=1e-6)


def test_gne_reads_positional_functional_activation_parameters():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 10)

        def forward(self, x):
            return self.b(nn.functional.elu(self.a(x), 0.5))

    model, _ = _run(Net(), "gne")
    phi = _phi_closed_form("elu0.5")
    w = model.a.weight.detach().double()
    assert float(w.pow(2).mean().sqrt()) == pytest.approx(1 / math.sqrt(phi * 16), rel=1e-6)


@pytest.mark.parametrize("scheme", ["tat", "dks"])
def test_tat_dks_refuse_activation_parameters_they_cannot_transform(scheme):
    with pytest.raises(PrecondError, match="alpha=0.5"):
        _run(_mlp(lambda: nn.ELU(0.5), 3), scheme)
    with pytest.raises(PrecondError, match="beta=2"):
        _run(_mlp(lambda: nn.Softplus(beta=2.0), 3), scheme)


@pytest.mark.parametrize("scheme", ["tat", "dks"])
def test_tat_dks_transform_gelu_tanh_with_its_own_function(scheme):
    """nn.GELU('tanh') got the exact GELU's transform and the replacement computed the exact
    GELU; now the activation computes gamma*(gelu_tanh(alpha x + beta) + delta)."""
    model, rep = _run(_mlp(lambda: nn.GELU("tanh"), 3), scheme)
    (name, t), = rep.conditioning[scheme]["transforms"].items()
    z = torch.linspace(-3, 3, 13, dtype=torch.float64)
    want = t["gamma"] * (nn.functional.gelu(t["alpha"] * z + t["beta"], approximate="tanh")
                         + t["delta"])
    with torch.no_grad():
        got = model[1](z.float()).double()
    assert float((got - want).abs().max()) < 1e-5 * float(want.abs().max())


def test_tat_says_which_weights_it_did_not_draw_orthogonal():
    """A frozen layer (kept with its own init) and weight-normalized layers (parametrized, not
    in the plan) are not drawn orthogonal, which the kernel analysis assumes; reinit=False was
    said, these were not (only q at the activations, 0.3 instead of 1, showed it)."""
    frozen = _mlp(nn.Tanh, 3)
    for p in frozen[2].parameters():
        p.requires_grad_(False)
    _, rep = _run(frozen, "tat")
    said = [n for n in rep.conditioning["tat"]["notes"] if "not drawn orthogonal" in n]
    assert said and "2.weight" in said[0] and "frozen" in said[0]
    wn = nn.Sequential(weight_norm(nn.Linear(16, 32)), nn.Tanh(), weight_norm(nn.Linear(32, 32)),
                       nn.Tanh(), nn.Linear(32, 10))
    _, rep = _run(wn, "dks")
    said = [n for n in rep.conditioning["dks"]["notes"] if "not drawn orthogonal" in n]
    assert said and said[0].startswith("2 weighted layer(s)"), rep.conditioning["dks"]["notes"]


def test_printed_report_shows_the_scheme_notes():
    """The scheme's notes (an option without effect, what it skipped) were only in
    report.conditioning[scheme]['notes']; the printed report showed the scalars alone."""
    _, rep = _run(_mlp(nn.Tanh), "wn", gamma_relu=3.0)
    text = str(rep)
    assert "wn note: gamma_relu=3.0 has no effect" in text
    _, rep = _run(_wn_mlp(), "lsuv")
    assert "lsuv note: LSUV scaled no call site" in str(rep)


def test_wn_draws_the_maxpool_replacement_conv_by_its_rule():
    """maxpool='stride' replaces a max-pool that cannot be folded by a new strided 2x2 conv;
    wn walked the graph's weighted nodes only, so that conv kept the core's geometric init
    (std sqrt(2/(k^2 C)) = 0.177 here, 41% above the forward rule) and was not in its rows."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2d(3, 16, 3, padding=1)
            self.bn = nn.BatchNorm2d(16)
            self.pool = nn.MaxPool2d(2)
            self.c2 = nn.Conv2d(16, 8, 3, padding=1)
            self.fc = nn.Linear(8 * 4 * 4, 10)

        def forward(self, x):
            x = self.pool(torch.relu(self.bn(self.c1(x))))
            return self.fc(torch.flatten(self.pool(torch.relu(self.c2(x))), 1))

    torch.manual_seed(0)
    model, rep = precondfx.precondition(Net(), torch.randn(16, 3, 16, 16), scheme="wn")
    pool_convs = [m for n, m in model.named_modules()
                  if isinstance(m, nn.Conv2d) and n.startswith("precondfx_pool")]
    assert pool_convs
    for conv in pool_convs:           # followed by a conv or the flatten + fc: gamma = 1
        fan_out = conv.out_channels * conv.kernel_size[0] * conv.kernel_size[1]
        std = float(conv.weight.detach().double().pow(2).mean().sqrt())
        assert std == pytest.approx(math.sqrt(1.0 / fan_out), rel=1e-3)
    rows = {r["node"] for r in rep.conditioning["wn"]["layers"]}
    assert "pool" in rows and {lay.node for lay in rep.plan.layers} <= rows


def test_lsuv_does_not_fold_a_scale_into_a_tied_weight():
    """An LM head tied to the embedding: folding the head's LSUV scale (1.9x) into the shared
    weight also scaled the embedding lookup, so the hidden layer fitted before it ran at
    variance 3.6 on the very calibration batch while the report said 1.0."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 32)
            self.hidden = nn.Linear(32, 32)
            self.head = nn.Linear(32, 50, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(nn.functional.gelu(self.hidden(self.emb(ids))))

    torch.manual_seed(0)
    ids = torch.randint(0, 50, (64, 12))
    model, rep = precondfx.precondition(Tied(), ids, scheme="lsuv")
    got = {}
    hook = model.hidden.register_forward_hook(lambda m, i, o: got.setdefault("h", o.detach()))
    model.train()
    with torch.no_grad():
        model(ids)
    hook.remove()
    var = float(got["h"].double().var(correction=0))
    sec = rep.conditioning["lsuv"]
    assert abs(var - 1.0) < sec["tol"]                      # what the report claims
    assert "emb.weight" not in sec["folded"]
    assert any("also read by" in n for n in sec["notes"])
