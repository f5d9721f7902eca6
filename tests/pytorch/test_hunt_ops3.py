"""Defects found by a hunt over operations and model shapes users write inside forward (each
test failed before its fix, named in the test's docstring)."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from tests.pytorch.test_hunt_layers import _run, _x


def _m2(t: torch.Tensor) -> float:
    return float(t.detach().abs().double().pow(2).mean())


# ------------------------------------------------------------ torch.einsum with a parameter


class _EinsumMLP(nn.Module):
    """Layers written as einsums with the weights (a common style in research code)."""

    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(16, 64) / 4)
        self.w_out = nn.Parameter(torch.randn(64, 10) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(torch.einsum("bi,ih->bh", x, self.w_in))
        return torch.einsum("bh,ho->bo", h, self.w_out)


def test_einsum_with_a_parameter_is_a_weighted_layer() -> None:
    """Before: an einsum of an activation and a parameter was 'a product of two activations',
    its weight kept at the user's init, and a model of einsum layers raised 'no weighted
    layer'. Now each is a linear layer with geometric init, fans from the equation."""
    torch.manual_seed(0)
    model = _EinsumMLP()
    before = model.w_in.detach().clone()
    x = _x(64, 16)
    res, rep = _run(model, x)
    rows = {r.name: r for r in rep.nodes}
    assert rows["einsum"].status == rows["einsum_1"].status == "weighted"
    # E[W^2] = 2 / sqrt(n_in n_out): (16, 64) and (64, 10)
    assert abs(_m2(res.w_in) - 2 / (16 * 64) ** 0.5) < 1e-3 * 2 / (16 * 64) ** 0.5
    assert abs(_m2(res.w_out) - 2 / (64 * 10) ** 0.5) < 1e-3 * 2 / (64 * 10) ** 0.5
    with torch.no_grad():
        assert abs(float(res(x).std(correction=0)) - 1.0) < 1e-3
    assert torch.equal(model.w_in, before)                    # the user's model is untouched


class _Spectral(nn.Module):
    """A Fourier neural operator's spectral layer (complex weights, einsum over the modes)."""

    def __init__(self, c: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        self.weights = nn.Parameter(torch.rand(c, c, modes, dtype=torch.cfloat) / (c * c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_ft = torch.fft.rfft(x)
        out = torch.zeros(x.shape[0], self.weights.shape[1], x.size(-1) // 2 + 1,
                          dtype=torch.cfloat)
        out[:, :, :self.modes] = torch.einsum("bix,iox->box", x_ft[:, :, :self.modes],
                                              self.weights)
        return torch.fft.irfft(out, n=x.size(-1))


class _FNO(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lift = nn.Linear(2, width)
        self.spec = _Spectral(width, 8)
        self.w = nn.Conv1d(width, width, 1)
        self.proj = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(x).permute(0, 2, 1)
        h = F.gelu(self.spec(h) + self.w(h))
        return self.proj(h.permute(0, 2, 1))


def test_fourier_layer_complex_einsum_weight_is_drawn() -> None:
    """Before: the spectral weights ('bix,iox->box' with a complex parameter) were 'read by
    an op that is not a weighted layer' and kept at the user's init (rms 0.003). Now the
    einsum is a layer of fan-in = fan-out = 16 (the modes index is a batch of maps): complex
    draw with E|W|^2 = 2/16, both parts random; the result still equals its fold."""
    torch.manual_seed(0)
    model = _FNO()
    before = model.spec.weights.detach().clone()
    x = _x(8, 64, 2)
    res, rep = _run(model, x)
    w = res.spec.weights
    assert abs(_m2(w) - 2 / 16) < 1e-3 * 2 / 16
    assert _m2(w.real) > 0.2 * 2 / 16 and _m2(w.imag) > 0.2 * 2 / 16
    assert torch.equal(model.spec.weights, before)            # the user's model is untouched
    assert "kept spec.weights" not in str(rep)
    res.eval()
    folded = precondfx.fold(res).eval()
    with torch.no_grad():
        assert torch.allclose(folded(x), res(x), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------ ops users call inside forward


class _Prototypes(nn.Module):
    """Prototype classifier: negative distances to learned prototypes, a spectral filter, an
    in-place detach and the loss returned with the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.protos = nn.Parameter(torch.randn(5, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        h = torch.fft.irfft(torch.fft.rfft(self.enc(x)), n=8)
        z = torch.view_as_real(torch.view_as_complex(h.reshape(-1, 4, 2))).reshape(-1, 8)
        logits = -torch.cdist(z, self.protos)
        d = F.pairwise_distance(z, h)
        d.detach_()
        return F.cross_entropy(logits, y) + 0 * d.mean(), logits


def test_distance_fft_complex_views_detach_and_loss_are_in_the_op_table() -> None:
    """Before: cdist, pairwise_distance, rfft/irfft, view_as_complex/real, detach_ and
    cross_entropy were 'unknown' (8 rows). Now each has its kind from the one op table."""
    torch.manual_seed(0)
    x, y = _x(32, 16), torch.randint(0, 5, (32,), generator=torch.Generator().manual_seed(2))
    rep = precondfx.analyze(_Prototypes(), (x, y))
    kinds = {r.name: (r.kind, r.status) for r in rep.nodes}
    assert [n for n, (k, s) in kinds.items() if s == "unknown"] == []
    assert kinds["fft_rfft" if "fft_rfft" in kinds else "rfft"][0] == "fft"
    assert kinds["cdist"] == ("distance", "breaks")
    assert kinds["pairwise_distance"] == ("distance", "breaks")
    assert kinds["cross_entropy"] == ("loss", "breaks")
    assert kinds["view_as_complex"][1] == kinds["detach_"][1] == "structural"


# ------------------------------------------------- stochastic depth under the user's own name


def _drop_path(x: torch.Tensor, drop_prob: float, training: bool) -> torch.Tensor:
    if drop_prob == 0.0 or not training:
        return x
    keep = 1 - drop_prob
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask / keep


class MyDropPath(nn.Module):
    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _drop_path(x, self.drop_prob, self.training)


class SD(nn.Module):
    """Stochastic depth under a short name, drawing with torch.rand."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob == 0:
            return x
        mask = (torch.rand(x.shape[0], 1) > self.drop_prob).to(x.dtype)
        return x * mask / (1 - self.drop_prob)


class _ResMLP(nn.Module):
    def __init__(self, drop: type, n: int = 4, d: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.fc1 = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.fc2 = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.drop = nn.ModuleList(drop(0.1 * (i + 1) / n) for i in range(n))
        self.out = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for f1, f2, dp in zip(self.fc1, self.fc2, self.drop):
            x = x + dp(f2(F.relu(f1(x))))
        return self.out(x)


def test_a_drop_path_class_of_the_users_is_dropout_and_folds() -> None:
    """Before: MyDropPath was set to eval for calibration (its name says DropPath) but the op
    table called it 'unknown', so the residual branch scales sat on its output and fold
    raised 'cannot fold 4 precondfx constant(s)'. Now it is dropout (one name rule in
    core.optable) and the folded model computes the result's function."""
    torch.manual_seed(0)
    x = _x(64, 16)
    res, rep = _run(_ResMLP(MyDropPath), x)
    assert {r.kind for r in rep.nodes if r.name.startswith("drop")} == {"dropout"}
    res.eval()
    folded = precondfx.fold(res).eval()
    with torch.no_grad():
        assert torch.allclose(folded(x), res(x), atol=1e-5, rtol=1e-5)


def test_a_stochastic_depth_class_holding_drop_prob_is_dropout() -> None:
    """Before: SD(drop_prob) was traced through (its torch.rand drew in the graph, its
    `if not self.training` differed between modes), so the capture fell to torch.export, 3 of
    4 residual branch scales were NOT APPLIED, and the output scale was calibrated on random
    drops (eval output std 0.94, target 1). Now the parameter-free module holding drop_prob
    is dropout: fx keeps it as a leaf, calibration turns it off, every join gets s."""
    torch.manual_seed(0)
    x = _x(64, 16)
    res, rep = _run(_ResMLP(SD), x)
    assert rep.capture == "fx"
    assert not [k for k, _ in rep.skipped if k.startswith("residual")]
    assert sum(r.s is not None for r in rep.plan.residuals) == 4
    res.eval()
    with torch.no_grad():
        assert abs(float(res(x).std(correction=0)) - 1.0) < 1e-3


class _EinsumScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.g = nn.Parameter(torch.full((32,), 0.5))
        self.v = nn.Parameter(torch.randn(4, 32, 8) * 0.1)   # per-head projection (XLNet)
        self.b = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("bi,i->bi", torch.relu(self.a(x)), self.g)
        return self.b(torch.einsum("bh,nhd->bnd", h, self.v).flatten(1))


def test_an_elementwise_einsum_with_a_parameter_is_not_a_layer() -> None:
    """'bi,i->bi' sums over none of the weight's indices: a learned scale, not a layer (kept,
    with why); 'bh,nhd->bnd' is a layer of fan-in 32 (h) and fan-out 32 (n d)."""
    torch.manual_seed(0)
    res, rep = _run(_EinsumScale(), _x(32, 16))
    rows = {r.name: r for r in rep.nodes}
    assert rows["einsum"].status == "breaks" and "elementwise" in rows["einsum"].reason
    assert rows["einsum_1"].status == "weighted"
    assert torch.equal(res.g, torch.full((32,), 0.5))
    assert abs(_m2(res.v) - 2 / 32) < 1e-3 * 2 / 32


# ------------------------------------------------- a complex weight's Hessian-block statistic


class _ComplexMix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.w = nn.Parameter(torch.randn(4, 3, dtype=torch.cfloat) / 2)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.view_as_complex(self.a(x).reshape(x.shape[0], 4, 2)) @ self.w
        return self.b(torch.relu(torch.view_as_real(z).reshape(x.shape[0], 6)))


def test_a_complex_weights_statistic_counts_its_imaginary_parts() -> None:
    """Before: the per-sample loop cast each gradient with .double(), which keeps the real
    parts of a complex weight's gradient only: its statistic came out at 0.60x the exact one
    (13 standard errors off), so balancing set its alpha ~1.14x too large. Now the gradient is
    read as real and imaginary parts, each a real parameter, and matches the statistic from
    the explicit Jacobian over (Re w, Im w)."""
    from precondfx.pytorch.measure.sketch import hessian_sketch
    torch.manual_seed(0)
    model, x = _ComplexMix(), _x(1, 6)

    def f(wr: torch.Tensor) -> torch.Tensor:
        params = dict(model.named_parameters())
        params["w"] = torch.view_as_complex(wr)
        return torch.func.functional_call(model, params, (x,)).flatten()

    J = torch.autograd.functional.jacobian(f, torch.view_as_real(model.w.detach()).clone())
    J = J.reshape(3, -1).double()
    K = J @ J.T
    exact = float((torch.trace(K) ** 2 + (K * K).sum()) / (2 * J.shape[1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = hessian_sketch(model, x, ["w"], n_samples=400, n_cotangents=6, seed=0,
                             verbose=False).values["w"]
    assert abs(est.mean - exact) < 4 * est.stderr and est.stderr < 0.1 * exact


# ------------------------------------------------------------- several outputs returned raw


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU())
        self.cls = nn.Linear(64, 10)
        self.box = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor):
        h = self.body(x)
        return self.cls(h), self.box(h)


def test_the_report_says_which_of_two_heads_takes_the_output_scale() -> None:
    """Before: a model returning (class logits, box regression) had its first head scaled to
    std 1 while the second (std 2.2 after the re-draw) was left unscaled with nothing in the
    report. Now a note names the main output and the output left without the scale."""
    torch.manual_seed(0)
    x = _x(32, 16)
    res, rep = _run(_TwoHeads(), x)
    with torch.no_grad():
        cls, box = res(x)
    assert abs(float(cls.std(correction=0)) - 1.0) < 1e-3
    assert abs(float(box.std(correction=0)) - 1.0) > 0.2      # the second head is not scaled
    notes = [n for n in rep.capture_notes if n.startswith("output scale on output[0]")]
    assert len(notes) == 1 and "not on output[1]" in notes[0]
    assert "not on output[1]" in str(rep)


# ----------------------------------------------------------- weight_norm / spectral_norm


def test_a_parametrized_layers_bias_is_kept_with_its_own_reason() -> None:
    """Before: the bias of a weight_norm / spectral_norm Linear was kept as 'read by an op
    that is not a weighted layer (e.g. a position embedding, a class token, an activation
    slope)'. It is the bias of the parametrized layer, kept with its weight: now it says so."""
    from torch.nn.utils import parametrizations as P
    torch.manual_seed(0)
    model = nn.Sequential(P.weight_norm(nn.Linear(16, 32)), nn.ReLU(),
                          P.spectral_norm(nn.Linear(32, 32)), nn.ReLU(), nn.Linear(32, 4))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    res, rep = _run(model, _x(64, 16))
    for b in ("0.bias", "2.bias"):
        why = rep.plan.inits[b].reason
        assert "whose weight is parametrized" in why and "position embedding" not in why, why
        assert torch.equal(dict(res.named_parameters())[b], before[b])
    assert abs(_m2(res[4].weight) - 2 / (32 * 4) ** 0.5) < 1e-3 * 2 / (32 * 4) ** 0.5


# ------------------------------------------------------------- an ONNX file's Einsum layers


class _Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(4, 32, 8) * 0.1)    # (heads, hidden, head dim)
        self.o = nn.Parameter(torch.randn(32, 4, 8) * 0.1)    # (hidden, heads, head dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.relu(torch.einsum("bh,nhd->bnd", x, self.v))
        return torch.einsum("bnd,hnd->bh", q, self.o)


def test_onnx_einsum_layers_take_their_fans_from_the_equation(tmp_path) -> None:
    """Before: an ONNX Einsum with a weight initializer was read as MatMul(x, W): the fans of
    the (4, 32, 8) per-head weight came from its last two dims (32, 8), E[W^2] = 2/16 = 0.125
    instead of 2/sqrt(32 * 32) = 0.0625 (fan-in: hidden 32, fan-out: heads x head dim 32).
    Now the ONNX front end hands the equation to core.nodes, as torch.einsum does."""
    import numpy as np
    onnx = __import__("pytest").importorskip("onnx")
    from onnx import numpy_helper
    from precondfx.onnx import precondition_onnx
    torch.manual_seed(0)
    x = _x(64, 32)
    src, out = tmp_path / "heads.onnx", tmp_path / "out.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Heads(), (x,), str(src), dynamo=False)
        precondition_onnx(str(src), str(out), feeds={"x": x.numpy()}, seed=0)
    inits = {i.name: numpy_helper.to_array(i).astype(np.float64)
             for i in onnx.load(str(out)).graph.initializer}
    for name in ("v", "o"):
        assert abs(float((inits[name] ** 2).mean()) - 2 / 32) < 1e-3 * 2 / 32, name


# ------------------------------------------------- a parameter passed into a module call


class _Latents(nn.Module):
    """A Perceiver's latent array, normalized and projected by the parent's modules."""

    def __init__(self) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(8, 32))
        self.inp = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.q = nn.Linear(32, 32)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kv = self.inp(x)
        q = self.q(self.norm(self.latents)).expand(x.shape[0], -1, -1)
        att = torch.softmax(q @ kv.transpose(1, 2) / 32 ** 0.5, -1)
        return self.head((att @ kv).mean(1))


@__import__("pytest").mark.parametrize("capture", ["fx", "export", "eager"])
def test_a_parameter_passed_into_a_module_call_is_read(capture: str) -> None:
    """Before: self.norm(self.latents) did not record the parameter as read by the call (a
    module call's operands that were parameters were dropped; torch.export's group dropped
    every parameter placeholder), so the report said '1 parameter(s) never used on the
    sample's path' and 'not read by any captured operation' for latents, which the model
    uses and trains. Now it is an operand of the call: kept, with the reason of a read."""
    torch.manual_seed(0)
    model = _Latents()
    x = _x(8, 10, 16)
    res, rep = _run(model, x, capture=capture)
    assert rep.capture == capture
    assert not [n for n in rep.capture_notes if "never used" in n]
    assert "not read by any captured operation" not in rep.plan.inits["latents"].reason
    assert torch.equal(res.latents, model.latents)
    res(x).pow(2).mean().backward()
    assert float(res.latents.grad.abs().sum()) > 0


class _ComplexOnly(nn.Module):
    """_ComplexMix with its real layers frozen: the complex weight is all that trains."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8).requires_grad_(False)
        self.w = nn.Parameter(torch.randn(4, 3, dtype=torch.cfloat) / 2)
        self.b = nn.Linear(6, 5).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.view_as_complex(self.a(x).reshape(x.shape[0], 4, 2)) @ self.w
        return self.b(torch.relu(torch.view_as_real(z).reshape(x.shape[0], 6)))


class _AsReal(nn.Module):
    """The same function with the real and imaginary parts as two real parameters."""

    def __init__(self, c: _ComplexOnly) -> None:
        super().__init__()
        self.a, self.b = c.a, c.b
        self.wr = nn.Parameter(c.w.detach().real.clone())
        self.wi = nn.Parameter(c.w.detach().imag.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).reshape(x.shape[0], 4, 2)
        xr, xi = h[..., 0], h[..., 1]
        z = torch.stack([xr @ self.wr - xi @ self.wi, xr @ self.wi + xi @ self.wr], -1)
        return self.b(torch.relu(z.reshape(x.shape[0], 6)))


def test_the_suggested_rates_of_a_complex_weight_match_its_real_parametrization() -> None:
    """Before: the power iteration and Adam's second moment read a complex parameter with
    .double() and g ** 2 (a complex square): with the complex weight all that trains, the
    Adam rate came out 1.70x the real model's here (1.6x on another batch; on a third the
    curvature was <= 0, no Adam rate at all). Now both count real and imaginary parts as real
    coordinates, as torch.optim.Adam does, and equal the rates of the same function with (Re w,
    Im w) as two real parameters."""
    from precondfx.pytorch.capture.common import make_sample
    from precondfx.pytorch.measure.suggest import suggest_lr
    torch.manual_seed(0)
    c = _ComplexOnly()
    r, x = _AsReal(c), _x(64, 6)
    with torch.no_grad():      # the same function; bit-equal only where the CPU's complex
        a, b = c(x), r(x)      # matmul sums in the real model's order (not on an AVX2 EPYC)
        assert float((a - b).abs().max()) <= 1e-6 * float(b.abs().max())
    s = make_sample(x)
    adam = [suggest_lr(m, s, iters=60, tol=0, families=("adam",))["adam"] for m in (c, r)]
    sgd = [suggest_lr(m, s, iters=60, tol=0, families=("sgd",))["sgd"] for m in (c, r)]
    assert adam[0] is not None and abs(adam[0] / adam[1] - 1) < 1e-3, adam
    assert abs(sgd[0] / sgd[1] - 1) < 1e-3, sgd
