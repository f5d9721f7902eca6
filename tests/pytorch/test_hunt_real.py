"""Defects found by running real-world model code (diffusion U-Net, VAE, PointNet, NeRF,
MLP-Mixer, ConvNeXt, EfficientNet, a GCN, DCGAN, Swin windows, a char-RNN, a two-tower
retriever, a multi-task head, LeNet) through the pass on every back end; each test failed
before its fix, named in its docstring."""
from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx


class _NeRF(nn.Module):
    """A NeRF-style MLP: positional encoding, and an output that concatenates colours through a
    sigmoid with a density through a softplus."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3 + 12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.rgb = nn.Linear(32, 3)
        self.sigma = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        enc = torch.cat([x] + [f(2.0 ** i * x) for i in range(2) for f in (torch.sin, torch.cos)],
                        -1)
        h = self.body(enc)
        return torch.cat([torch.sigmoid(self.rgb(h)), F.softplus(self.sigma(h))], -1)


@pytest.mark.parametrize("capture", ["fx", "export", "eager"])
def test_a_concatenated_output_with_a_sigmoid_part_keeps_its_range(capture):
    """The output scale went on the whole concatenation, so the sigmoid's colours came out in
    0..12 on the fx and export back ends (a sigmoid output alone was already left unscaled,
    with a warning).  Now a bounded part of a concatenated main output leaves it unscaled on
    every back end, said the same way (``outputs.bounded_producer`` walks the parts)."""
    x = torch.rand(64, 3, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = _NeRF()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out, rep = precondfx.precondition(model, x, capture=capture)
    said = [str(m.message) for m in w if "concatenation" in str(m.message)]
    assert len(said) == 1 and "sigmoid" in said[0]
    with torch.no_grad():
        y = out(x)
    assert 0.0 < float(y[:, :3].min()) and float(y[:, :3].max()) < 1.0
    assert not [b for b, _ in out.named_buffers() if "output_scale" in b]
    assert any("output" in str(s) for s in rep.skipped)


# ------------------------------------------ a policy that returns a torch.distributions object

class _Policy(nn.Module):
    """An actor as RL code writes it: the forward returns a distribution built from the head."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.body = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)
        self.log_std = nn.Parameter(torch.zeros(4))

    def forward(self, obs: torch.Tensor) -> torch.distributions.Distribution:
        D = torch.distributions
        h = self.head(self.body(obs))
        if self.kind == "categorical":
            return D.Categorical(logits=h)
        if self.kind == "normal":
            return D.Normal(h, self.log_std.exp())
        if self.kind == "independent":
            return D.Independent(D.Normal(h, self.log_std.exp()), 1)
        return D.TransformedDistribution(D.Normal(h, self.log_std.exp()),
                                         [D.TanhTransform(cache_size=1)])


def _raw(d: torch.distributions.Distribution) -> torch.Tensor:
    while hasattr(d, "base_dist"):
        d = d.base_dist
    return d.logits if isinstance(d, torch.distributions.Categorical) else d.loc


@pytest.mark.parametrize("kind", ["categorical", "normal", "independent", "tanh"])
def test_a_distribution_output_gets_its_scale(kind):
    """A forward returning a ``torch.distributions`` object was refused ("cannot find a
    floating-point tensor in the model's output (Normal)"; ``output_key='loc'``: "'Normal'
    object is not subscriptable").  Its parameters are now outputs: the mean (or the logits)
    is brought to the target std, the distribution is rebuilt around it where the scale cannot
    go on the module (a Categorical normalizes its logits, which the calibration refines
    since that is not linear in the scale), and its log-probability trains every parameter."""
    obs = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = _Policy(kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)     # no "output std ... not the target"
        out, rep = precondfx.precondition(model, obs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(out, _Policy)
    d = out(obs)
    assert type(d) is type(model(obs))
    assert float(_raw(d).std()) == pytest.approx(1.0, abs=2e-3)
    assert rep.output_std_after == pytest.approx(1.0, abs=1e-3)
    if kind != "categorical":      # the scale multiplies the head: scale ~ 1, exp(0)
        assert float(d.base_dist.scale.mean() if hasattr(d, "base_dist") else d.scale.mean()) \
            == pytest.approx(1.0)
    loss = -d.log_prob(d.sample()).mean()
    loss.backward()
    missing = [n for n, p in out.named_parameters() if p.grad is None or
               not torch.isfinite(p.grad).all()]
    assert missing == ([] if kind != "categorical" else ["log_std"])


def test_a_distribution_that_cannot_be_rebuilt_is_refused_clearly():
    """A distribution subclass whose constructor does not take its parameters by name cannot
    be rebuilt around a scaled value: a PrecondError that says what to do, not a raw
    TypeError from inside the forward."""
    class Shifted(torch.distributions.Normal):
        def __init__(self, mean: torch.Tensor) -> None:
            super().__init__(mean * 0 + mean, torch.ones_like(mean))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 2)

        def forward(self, x: torch.Tensor) -> torch.distributions.Distribution:
            return Shifted(self.b(torch.relu(self.a(x))))

    with pytest.raises(precondfx.PrecondError, match="build the distribution outside"):
        precondfx.precondition(Net(), torch.randn(32, 8))


# ------------------------------------------------------------------ lazy modules, not yet run

class _LazyNet(nn.Module):
    """Shapes left to the first forward: LazyConv2d, LazyBatchNorm2d, LazyLinear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.LazyConv2d(8, 3)
        self.bn = nn.LazyBatchNorm2d()
        self.head = nn.LazyLinear(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_lazy_modules_get_their_shapes_from_the_sample():
    """A model with lazy modules never run failed with "the model cannot be deep-copied
    (ValueError: Attempted to use an uninitialized parameter ...)" and advice to pass
    inplace=True or define __deepcopy__ (torch's UninitializedBuffer cannot be deep-copied);
    past that, every buffer snapshot raised the same.  The copy is now initialized on the
    sample; the user's model keeps its uninitialized modules."""
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    model = _LazyNet()
    out, rep = precondfx.precondition(model, x)
    assert isinstance(model.conv.weight, nn.parameter.UninitializedParameter)
    assert isinstance(model.bn.running_mean, nn.parameter.UninitializedBuffer)
    assert isinstance(out, _LazyNet)
    assert tuple(out.conv.weight.shape) == (8, 3, 3, 3)
    assert tuple(out.head.weight.shape) == (5, 8 * 6 * 6)
    assert float(out(x).std(correction=0)) == pytest.approx(1.0, abs=1e-3)
    assert any("lazy modules" in n for n in rep.capture_notes)
    # every parameter is a real tensor the optimizer can take and step
    opt = torch.optim.SGD(out.parameters(), lr=0.1)
    out(x).square().mean().backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in out.parameters())


# ------------------------------------- an output whose structure differs in train and eval mode

class _AuxInTrain(nn.Module):
    """Inception-style: ``(logits, aux_logits)`` in train mode, ``logits`` in eval.  With
    ``functional`` the logits come out of ``F.linear`` on the model's own parameters (no module
    produces them)."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.functional = functional
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU())
        self.head = nn.Linear(64, 5)
        self.aux = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor):
        h = self.body(x)
        logits = F.linear(h, self.head.weight, self.head.bias) * 1.0 if self.functional \
            else self.head(h)
        if self.training:
            return logits, self.aux(h)
        return logits


@pytest.mark.parametrize("functional", [False, True])
def test_an_output_that_changes_structure_in_eval_is_scaled_whole(functional):
    """The main output's path was found in train mode (``[0]`` of the tuple) and kept for eval,
    where the model returns the tensor itself: ``[0]`` then selected the tensor's first row,
    so in eval mode only row 0 was scaled, in place (output std 2.25 against 1.0 in train
    mode; the report said "verified ... in train and eval mode").  The path is now found per
    call by the same rule."""
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    out, rep = precondfx.precondition(_AuxInTrain(functional), x)
    ref = _AuxInTrain(functional)
    ref.load_state_dict({k: v for k, v in out.state_dict().items() if "precondfx" not in k})
    s = rep.output_scale
    out.train()
    ref.train()
    with torch.no_grad():
        assert float(out(x)[0].std(correction=0)) == pytest.approx(1.0, abs=1e-3)
        torch.testing.assert_close(out(x)[1], ref(x)[1])          # the aux head unscaled
        out.eval()
        ref.eval()
        got, want = out(x), ref(x) * s
    torch.testing.assert_close(got, want)                          # every row, once


def test_the_fx_result_prints_as_the_users_class():
    """``repr(result)`` began with torch.fx's per-instance class name, ``GraphModuleImpl(``,
    in logs and notebooks, and so did its copies; it now names the user's class."""
    x = torch.rand(32, 3, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    out, rep = precondfx.precondition(_NeRF(), x, target_std=None)
    assert rep.capture == "fx"
    for m in (out, copy.deepcopy(out), pickle.loads(pickle.dumps(out))):
        assert isinstance(m, _NeRF) and repr(m).startswith("_NeRF(\n  (body): Sequential(")


# ----------------------------------------------------- a forward that turns gradients off itself

class _NoGradForward(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = torch.no_grad() if self.mode == "no_grad" else torch.inference_mode()
        with ctx:
            return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_forward_without_gradients_is_said_not_a_raw_autograd_error(mode):
    """A forward under ``torch.no_grad()``/``inference_mode()`` failed with autograd's raw
    "element 0 of tensors does not require grad and does not have a grad_fn" from measured
    balancing.  Now balance='auto' leaves the planned alphas and says why, and what needs the
    gradient (balance='hessian', suggest_lr=True) is refused with what to do."""
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    out, rep = precondfx.precondition(_NoGradForward(mode), x)
    assert float(out(x).std(correction=0)) == pytest.approx(1.0, abs=1e-3)
    said = [why for what, why in rep.skipped if what == "balance='auto'"]
    assert len(said) == 1 and "carries no gradient" in said[0] and "no_grad" in said[0]
    for kw in ({"balance": "hessian"}, {"suggest_lr": True}):
        with pytest.raises(precondfx.PrecondError, match="carries no gradient"):
            precondfx.precondition(_NoGradForward(mode), x, **kw)


def test_an_option_without_effect_is_printed_with_what_was_not_applied():
    """An option the user set that the other options or the model leave without effect was
    noted in ``report.plan.notes`` only, which the printed report never shows: a user who
    passed ``balance_threshold=3.0`` with ``balance='none'`` or ``pool_conv='depthwise'`` on a
    model without a max-pool read nothing about it.  Both now appear under NOT APPLIED."""
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    _, rep = precondfx.precondition(model, x, balance="none", balance_threshold=3.0,
                                    pool_conv="depthwise")
    said = [why for what, why in rep.skipped if what == "option"]
    assert len(said) == 2
    assert any(w.startswith("balance_threshold=3.0 has no effect") for w in said)
    assert any(w.startswith("pool_conv='depthwise'") for w in said)
    text = str(rep)
    assert text.index("NOT APPLIED") < text.index("option: balance_threshold=3.0 has no effect")
    _, quiet = precondfx.precondition(model, x)          # defaults: nothing to say
    assert not [w for what, w in quiet.skipped if what == "option"]


def test_inplace_that_adds_parameters_says_to_build_the_optimizer_after():
    """With ``inplace=True`` the convolution that replaces a max-pool is a new parameter of
    the user's own model: an optimizer built before the call never trains it, and nothing
    said so.  The report now does (and says nothing when no parameter is added)."""
    from tests.user_models import PoolCNN
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = PoolCNN()
    before = {id(p) for p in model.parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out, rep = precondfx.precondition(model, x, inplace=True, maxpool="conv")
    new = [n for n, p in model.named_parameters() if id(p) not in before]
    said = [why for what, why in rep.skipped if what == "inplace=True"]
    assert new and len(said) == 1 and f"{len(new)} new parameter(s)" in said[0]
    assert not any(id(p) in {id(q) for g in opt.param_groups for q in g["params"]}
                   for n, p in model.named_parameters() if n in new)
    _, quiet = precondfx.precondition(nn.Sequential(nn.Linear(4, 8), nn.ReLU(),
                                                    nn.Linear(8, 2)),
                                      torch.randn(16, 4), inplace=True)
    assert not [w for what, w in quiet.skipped if what == "inplace=True"]


def test_a_parametrized_weight_is_kept_for_the_reason_it_is():
    """A weight_norm layer's tensors were "kept: read by an op that is not a weighted layer
    (e.g. a position embedding, a class token...)"; the report now says they belong to a
    parametrization and points at scheme='wn'."""
    from torch.nn.utils.parametrizations import weight_norm
    model = nn.Sequential(weight_norm(nn.Linear(8, 16)), nn.ReLU(), nn.Linear(16, 4))
    _, rep = precondfx.precondition(model, torch.randn(32, 8))
    kept = {n: p.reason for n, p in rep.plan.inits.items() if p.rule == "keep"}
    for t in ("original0", "original1"):
        why = kept[f"0.parametrizations.weight.{t}"]
        assert "parametrization" in why and "scheme='wn'" in why and "position" not in why


def test_option_values_that_hung_or_were_swallowed_are_refused(tmp_path):
    """``balance_samples=10**9`` allocated its arrays up front and hung; ``capture=['fx',
    'fx']`` was taken as it was; ``report.save(folder)`` raised a raw IsADirectoryError."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(16, 4)
    with pytest.raises(precondfx.PrecondError, match=r"balance_samples=1000000000 must be an "
                                                     r"integer in \[1, 4096\]"):
        precondfx.precondition(model, x, balance_samples=10 ** 9)
    with pytest.raises(precondfx.PrecondError, match=r"names \['fx'\] more than once"):
        precondfx.precondition(model, x, capture=["fx", "fx"])
    _, rep = precondfx.precondition(model, x, balance_samples=4096, balance="none")
    with pytest.raises(precondfx.PrecondError, match="is a folder: give the report a file"):
        rep.save(tmp_path)
    rep.save(tmp_path / "r.json")
    assert precondfx.Report.load(tmp_path / "r.json").output_scale == rep.output_scale


class _BufferScaled(nn.Module):
    """An input normalized by mean/std buffers, logits times a fixed temperature buffer, and a
    learned per-feature gain (a parameter) for contrast."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.full((1, 8), 0.5))
        self.register_buffer("std", torch.full((1, 8), 0.25))
        self.register_buffer("temp", torch.tensor(2.0))
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a((x - self.mean) / self.std))
        return self.b(h) * self.temp * self.gain


@pytest.mark.parametrize("capture", ["fx", "export", "eager"])
def test_a_product_with_a_buffer_is_a_product_with_a_constant(capture):
    """Dividing by a std buffer or multiplying by a temperature buffer was classified "product
    with a learned parameter (layer scale): breaks scaling"; a buffer is not learned, so it is
    a scaling layer (Sec. 7), as a Python number is.  A product with a parameter stays one."""
    x = torch.rand(32, 8, generator=torch.Generator().manual_seed(0))
    _, rep = precondfx.precondition(_BufferScaled(), x, capture=capture)
    rows = {n.name: n for n in rep.nodes if n.kind == "mul"}
    assert len(rows) == 3, sorted(rows)
    const = [n for n in rows.values() if n.reason.startswith("product with a constant")]
    learned = [n for n in rows.values() if "learned parameter" in n.reason]
    assert len(const) == 2 and all(n.status == "preserves" for n in const)
    assert len(learned) == 1 and learned[0].status == "breaks"


class _DepthHead(nn.Module):
    """A depth head as GLPN ends: ``sigmoid(...) * max_depth``, a range [0, 10] in metres."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.b(torch.relu(self.a(x)))) * 10.0


@pytest.mark.parametrize("capture", ["fx", "export", "eager"])
def test_a_sigmoid_times_a_number_keeps_its_range_on_every_back_end(capture):
    """The rule that sees through ``sigmoid(x) * k`` required one recorded input shape, which
    the fx capture never gives (it records one per argument, the number included): the fx
    result scaled the depth head by 0.31 (range 0..3.1 of 10) while eager refused.  Every
    back end now leaves it unscaled, with the warning."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out, rep = precondfx.precondition(_DepthHead(), x, capture=capture)
    assert rep.capture == capture and rep.output_scale is None
    assert any("sigmoid" in str(m.message) for m in w)
    with torch.no_grad():
        y = out(x)
    assert 0.0 < float(y.min()) and float(y.max()) < 10.0 and float(y.max()) > 3.2
