"""lr= with optimizer=: one factor c on every re-drawn layer (output x c, weight and bias / c)
puts the result's suggested rate on the user's.  Checked here without the pass's own
arithmetic: the function is unchanged; the stored weights are the lr=None result's divided by
the reported factor; that factor is sqrt(r0 / lr) under SGD and r0 / lr under Adam with r0
measured here on the lr=None result with 10x more power iterations; one SGD step at lr on the
result is one SGD step at lr c^2 on the lr=None result (Adam: lr c); an independent
measurement of the result's suggested rate lands within half an octave of lr."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import precondfx
from precondfx.core.options import Options
from precondfx.core.scheme import resolve_options
from precondfx.errors import PrecondError
from precondfx.pytorch.capture.common import Sample
from precondfx.pytorch.measure.suggest import suggest_lr
from tests import zoo


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(),
                         nn.Linear(48, 6))


X = torch.randn(64, 12, generator=torch.Generator().manual_seed(3))
Y = torch.randint(0, 6, (64,), generator=torch.Generator().manual_seed(4))


def _pair(lr: float, opt: str):
    m = _mlp()
    ref, _ = precondfx.precondition(m, X, lr_scale=None)
    out, rep = precondfx.precondition(m, X, lr_scale=None, lr=lr, optimizer=opt)
    return ref, out, rep


def _rate(model: nn.Module, fam: str, iters: int = 200, seed: int = 7) -> float:
    """The suggested rate of one family (only that family's power iteration is run)."""
    return suggest_lr(model, Sample((X,), {}), iters=iters, seed=seed, families=(fam,))[fam]


@pytest.fixture(scope="module")
def lr_none_result():
    """The lr=None result (the same in every case below: the same model, sample and seed) and
    its suggested rates of both families, measured once with 200 power iterations."""
    ref, _ = precondfx.precondition(_mlp(), X, lr_scale=None)
    rates = suggest_lr(ref, Sample((X,), {}), iters=200, seed=0, tol=0)
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}, rates


@pytest.mark.parametrize("opt,lr", [("sgd", 2 ** -7), ("sgd", 2.0), ("adam", 2 ** -12),
                                    ("adamw", 2 ** -5)])
def test_same_function_weights_divided_by_the_formula_factor(opt, lr, lr_none_result):
    ref, out, rep = _pair(lr, opt)
    sec = rep.conditioning["lr_target"]
    c = sec["factor"]
    fam = "sgd" if opt == "sgd" else "adam"
    # the lr=None result's suggested rate, measured once for the module on this same result
    state, rates = lr_none_result
    sd = ref.state_dict()
    assert sd.keys() == state.keys() and all(torch.equal(sd[k], state[k]) for k in sd)
    r0 = rates[fam]
    want = math.sqrt(r0 / lr) if fam == "sgd" else r0 / lr
    assert c == pytest.approx(want, rel=0.1)
    with torch.no_grad():
        a, b = ref(X), out(X)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(a.abs().max()))
    want_p = dict(ref.named_parameters())
    for n, p in out.named_parameters():
        assert torch.allclose(p * c, want_p[n], rtol=1e-5, atol=1e-7), n
    # the suggested rate, measured again here with another start vector, is on lr
    assert abs(math.log2(_rate(out, fam) / lr)) < 0.5
    assert sec["summary"] in " ".join(str(rep).split())    # wrapped at the terminal's width


@pytest.mark.parametrize("opt,lr", [("sgd", 2 ** -6), ("adam", 2 ** -9)])
def test_step_is_the_unscaled_results_step_at_the_moved_rate(opt, lr):
    """Three steps at lr on the result equal three steps on the lr=None result at lr c^2 (SGD:
    the stored weights' gradients are c times the function's) or lr c (Adam: its step does
    not scale with the gradient; eps made negligible)."""
    ref, out, rep = _pair(lr, opt)
    c = rep.conditioning["lr_target"]["factor"]
    assert abs(math.log2(c)) > 0.5                     # the case is not trivial
    moved = lr * c * c if opt == "sgd" else lr * c
    for model, rate in ((out, lr), (ref, moved)):
        o = torch.optim.SGD(model.parameters(), lr=rate) if opt == "sgd" else \
            torch.optim.Adam(model.parameters(), lr=rate, eps=1e-14)
        for _ in range(3):
            o.zero_grad()
            nn.functional.cross_entropy(model(X), Y).backward()
            o.step()
    with torch.no_grad():
        a, b = ref(X), out(X)
    assert float((a - b).abs().max()) < 1e-4 * float(a.abs().max())


def test_lr_scale_sgd_with_lr_is_refused():
    """lr_scale='sgd' is one factor shared by every layer (3/depth), and lr= sets that same
    shared factor from the measured curvature, so lr= would undo it (measured before the
    refusal: 2.683 then x 1/2.667, ending at 1.006 against 1.000 for lr= alone).  The
    combination is refused rather than swallowed, whichever optimizer lr= is for."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(12, 48), nn.ReLU(),
                      *[mod for _ in range(6) for mod in (nn.Linear(48, 48), nn.ReLU())],
                      nn.Linear(48, 6))                                  # depth 8
    base, _ = precondfx.precondition(m, X, lr_scale="sgd")
    c_sgd = {float(b) for n, b in base.named_buffers() if "precondfx_lr" in n}
    assert len(c_sgd) == 1 and next(iter(c_sgd)) != pytest.approx(1.0)   # one shared factor
    for opt in ("sgd", "adam"):
        with pytest.raises(PrecondError, match="lr_scale='sgd' with lr=.*drop lr_scale"):
            precondfx.precondition(m, X, lr_scale="sgd", lr=0.05, optimizer=opt)


def test_refusals():
    m = _mlp()
    with pytest.raises(PrecondError, match="go together"):
        precondfx.precondition(m, X, lr=0.1)
    with pytest.raises(PrecondError, match="optimizer='sgd' without lr="):
        precondfx.precondition(m, X, optimizer="sgd")
    with pytest.raises(PrecondError, match="go together"):
        precondfx.precondition(m, X, lr=None, optimizer="sgd")
    with pytest.raises(PrecondError, match="positive"):
        precondfx.precondition(m, X, lr=-1.0, optimizer="sgd")
    with pytest.raises(PrecondError, match="optimizer='rmsprop' is not an optimizer family"):
        precondfx.precondition(m, X, lr=0.1, optimizer="rmsprop")
    with pytest.raises(PrecondError, match="RMSprop.* is not an optimizer family"):
        precondfx.precondition(m, X, lr=0.1, optimizer=torch.optim.RMSprop)
    # any case, or the torch class: stored as the family's string
    assert Options(lr=0.1, optimizer="AdamW").optimizer == "adamw"
    assert Options(lr=0.1, optimizer=torch.optim.SGD).optimizer == "sgd"
    assert Options(lr=0.1, optimizer=torch.optim.AdamW).optimizer == "adam"
    with pytest.raises(PrecondError, match="scheme='geometric'"):
        precondfx.precondition(m, X, lr=0.1, optimizer="sgd", scheme="lsuv")
    meta = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to("meta")
    with pytest.raises(PrecondError, match="curvature"):
        precondfx.precondition(meta, torch.randn(3, 4), lr=0.1, optimizer="sgd",
                               balance="analytic")
    from precondfx.onnx.pipeline import ONNX
    with pytest.raises(PrecondError, match="not available for ONNX"):
        resolve_options(Options(lr=0.1, optimizer="sgd"), ONNX)
    with pytest.raises(PrecondError, match="suggest_lr=True"):
        resolve_options(Options(suggest_lr=True), ONNX)


def test_user_model_untouched_and_far_rate_warned():
    m = _mlp()
    before = {n: p.clone() for n, p in m.state_dict().items()}
    with pytest.warns(RuntimeWarning, match="check that optimizer='adam'"):
        _, rep = precondfx.precondition(m, X, lr=1e3, optimizer="adam")
    sec = rep.conditioning["lr_target"]
    assert "limit" in sec["warning"]
    assert sec["factor"] == pytest.approx(2.0 ** -8, rel=1e-9)   # clamped: weights x 256 at most
    # Adam's suggested rate moves by 1/c: 256x up, still far below lr
    assert sec["suggested_after"] == pytest.approx(256 * sec["suggested_before"], rel=0.1)
    assert sec["suggested_after"] < 1e3 / 16
    for n, p in m.state_dict().items():
        assert torch.equal(p, before[n])


@pytest.mark.skipif(not zoo.HAS_TRANSFORMERS, reason="transformers not installed")
def test_adam_keeps_the_declared_init_storage_sgd_moves_it():
    """On a transformers model lr_scale='auto' stored the weights for the declared init: with an
    Adam rate lr= keeps that storage (state dict bit-equal to the call without lr=); with an SGD
    rate it divides every scaled layer by one more factor (logits equal)."""
    from tests.pytorch.test_lr_auto import _gpt2
    model = _gpt2()
    ids = torch.randint(0, model.config.vocab_size, (4, 16),
                        generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids}
    base, rb = precondfx.precondition(model, sample, use_cache=False)
    assert rb.plan.lr_mode == "user"
    same, ra = precondfx.precondition(model, sample, lr=1e-3, optimizer="adamw", use_cache=False)
    assert ra.conditioning["lr_target"]["factor"] == 1.0
    sa, sb = same.state_dict(), base.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    moved, rs = precondfx.precondition(model, sample, lr=1.0, optimizer="sgd", use_cache=False)
    c = rs.conditioning["lr_target"]["factor"]
    assert abs(math.log2(c)) > 0.5
    scaled = [n for n in rs.conditioning["lr_target"].get("left_out", {})]
    wb = dict(base.named_parameters())
    n_div = sum(torch.allclose(p * c, wb[n], rtol=1e-5, atol=1e-8)
                for n, p in moved.named_parameters() if p.dim() >= 2 and n in wb)
    assert n_div >= 6, (n_div, scaled)
    with torch.no_grad():
        a, b = base(**sample).logits, moved(**sample).logits
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(a.abs().max()))


def test_frozen_layer_left_out_with_its_reason():
    """A frozen weight gets no factor (no optimizer step to move) and the report says why; the
    trainable layers still carry one, and the function is unchanged."""
    m = _mlp()
    m[0].weight.requires_grad_(False)
    m[0].bias.requires_grad_(False)
    ref, _ = precondfx.precondition(m, X, lr_scale=None)
    out, rep = precondfx.precondition(m, X, lr_scale=None, lr=2 ** -7, optimizer="sgd")
    sec = rep.conditioning["lr_target"]
    assert sec["layers"] == 2
    assert sec["left_out"]["0.weight"].startswith("frozen")
    assert torch.equal(out[0].weight, ref[0].weight)
    with torch.no_grad():
        a, b = ref(X), out(X)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(a.abs().max()))


@pytest.mark.skipif(not zoo.HAS_TRANSFORMERS, reason="transformers not installed")
def test_transformers_checkpoint_round_trip(tmp_path):
    """lr='s factors fold into save_pretrained's weights like any constant: from_pretrained with
    transformers alone gives the result's logits, and reattach gives back its stored weights."""
    from transformers import GPT2LMHeadModel
    from precondfx.integrations.hf import reattach
    from tests.pytorch.test_lr_auto import _gpt2, _ids
    ids = _ids()
    out, rep = precondfx.precondition(_gpt2(), {"input_ids": ids}, use_cache=False, lr=0.5,
                                      optimizer="sgd")
    assert abs(math.log2(rep.conditioning["lr_target"]["factor"])) > 0.5
    out.save_pretrained(tmp_path)
    plain = GPT2LMHeadModel.from_pretrained(tmp_path)
    back = reattach(GPT2LMHeadModel.from_pretrained(tmp_path))
    with torch.no_grad():
        a = out(input_ids=ids).logits
        b, c = plain(input_ids=ids).logits, back(input_ids=ids).logits
    tol = 1e-5 * float(a.abs().max())
    assert float((a - b).abs().max()) < tol and float((a - c).abs().max()) < tol
    mine = dict(out.named_parameters())
    for n, p in back.named_parameters():
        assert torch.allclose(p, mine[n], rtol=1e-5, atol=1e-7), n


def test_analyze_says_the_factor_is_set_by_precondition():
    """analyze plans the lr multipliers at 1 and says precondition measures them; precondition's
    report holds the measured factor (the constants the plan records equal the buffers)."""
    rep = precondfx.analyze(_mlp(), X, lr=2 ** -7, optimizer="sgd")
    assert "lr = 1 (lr=: precondition sets them" in rep.constants_line()
    out, rep = precondfx.precondition(_mlp(), X, lr=2 ** -7, optimizer="sgd")
    c = rep.conditioning["lr_target"]["factor"]
    bufs = [float(b) for n, b in out.named_buffers() if "precondfx_lr" in n]
    assert len(bufs) == 3 and all(v == pytest.approx(c, rel=1e-6) for v in bufs)
    assert "precondition sets them" not in rep.constants_line()


def test_batchnorm_statistics_untouched_by_the_measurement():
    """The curvature is measured with the BatchNorm buffers cloned: the result's running
    statistics equal those of the call without lr=, and the user's model keeps its own."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 6))
    mean0 = m[1].running_mean.clone()
    ref, _ = precondfx.precondition(m, X, lr_scale=None)
    out, rep = precondfx.precondition(m, X, lr_scale=None, lr=2 ** -6, optimizer="sgd")
    assert abs(math.log2(rep.conditioning["lr_target"]["factor"])) > 0.25
    assert torch.equal(out[1].running_mean, ref[1].running_mean)
    assert torch.equal(out[1].running_var, ref[1].running_var)
    assert int(out[1].num_batches_tracked) == int(ref[1].num_batches_tracked)
    assert torch.equal(m[1].running_mean, mean0)
