"""Regressions found by a hunt over adversarial and unusual inputs to the public API (samples,
forward signatures, global state, options): every test fails without its fix."""
from __future__ import annotations

import torch
from torch import nn

import precondfx


class _BNResMLP(nn.Module):
    """An MLP with a BatchNorm1d after its first layer and two residual blocks: in train mode
    (a freshly built model) its layers' Hessian blocks are 16x apart."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 64)
        self.bn = nn.BatchNorm1d(64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 64)
        self.o = nn.Linear(64, 3)

    def forward(self, x):
        h = torch.relu(self.bn(self.a(x)))
        h = h + torch.relu(self.b(h))
        h = h + torch.relu(self.c(h))
        return self.o(h)


def _bn_net():
    torch.manual_seed(0)
    return _BNResMLP(), torch.randn(32, 10, generator=torch.Generator().manual_seed(1))


def test_train_mode_batchnorm1d_is_balanced_not_refused_for_a_batch_of_one():
    """The check that rescaling keeps the function ran two forwards of ONE sample in train
    mode, which BatchNorm1d refuses: balance='auto' left the 16x spread as it was with the
    reason 'pass a batch of at least two samples' (the batch had 32), balance='hessian'
    raised it."""
    model, x = _bn_net()
    _, rep = precondfx.precondition(model, x)
    h = rep.conditioning["hessian"]
    assert h.get("applied") is True, h.get("decision")
    assert h["spread_before"] > 4.0
    assert h["output_change"] < 1e-4
    assert not any("at least two samples" in why for _, why in rep.skipped), rep.skipped
    _, rep2 = precondfx.precondition(model, x, balance="hessian")
    assert rep2.conditioning["hessian"]["applied"] is True


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))


def test_precondition_inside_inference_mode_returns_a_trainable_model():
    """Called inside ``torch.inference_mode()`` (a sample made there too), precondition raised
    autograd's raw 'element 0 of tensors does not require grad' from measured balancing, and
    with balance='none' returned a model whose re-drawn weights were inference tensors: its
    first training step raised 'Inference tensors cannot be saved for backward'."""
    for opts in ({}, {"balance": "none"}):
        model = _mlp()
        with torch.inference_mode():
            x = torch.randn(16, 10, generator=torch.Generator().manual_seed(1))
            res, rep = precondfx.precondition(model, x, **opts)
            precondfx.analyze(model, x)
        assert not any(p.is_inference() for p in res.parameters())
        y = res(x.clone())
        y.sum().backward()
        assert all(p.grad is not None for p in res.parameters())
        assert abs(float(y.detach().double().std(correction=0)) - 1.0) < 1e-3


def test_model_built_inside_inference_mode_is_refused_with_what_to_do():
    with torch.inference_mode():
        model = _mlp()
    x = torch.randn(16, 10)
    try:
        precondfx.precondition(model, x)
    except precondfx.PrecondError as e:
        assert "inference_mode" in str(e) and "0.weight" in str(e)
    else:
        raise AssertionError("a model of inference tensors was not refused")


def test_report_does_not_say_re_init_when_no_weight_was_drawn():
    """With reinit_weights=False the report's output-std line said '(after re-init)'."""
    x = torch.randn(16, 10, generator=torch.Generator().manual_seed(1))
    _, rep = precondfx.precondition(_mlp(), x, reinit_weights=False, balance="none")
    line = next(l for l in str(rep).splitlines() if l.startswith("output std:"))
    assert "re-init" not in line and "weights kept" in line, line
    _, rep = precondfx.precondition(_mlp(), x, balance="none")
    line = next(l for l in str(rep).splitlines() if l.startswith("output std:"))
    assert "(after re-init)" in line, line


def test_analyze_of_a_preconditioned_result_says_what_it_holds():
    """precondition refuses a result and points to ``analyze(model, sample)`` to show what it
    holds, but analyze said nothing of the constants ('constants: none set') and, on an fx
    result, hid the last Linear inside precondfx's fused layer() call, reporting its weight
    and bias as 'never used on the sample's path'."""
    x = torch.randn(16, 10, generator=torch.Generator().manual_seed(1))
    for capture in ("fx", "eager"):
        res, rep = precondfx.precondition(_mlp(), x, capture=capture)
        before = {k: v.clone() for k, v in res.state_dict().items()}
        a = precondfx.analyze(res, x)
        text = str(a)
        # two alphas, two lr multipliers (lr='auto'), the output scale
        assert "already preconditioned" in text and "5 precondfx constant(s)" in text, text
        assert f"{rep.output_scale:.4g}" in text
        assert "never used" not in text, text
        assert {r.module for r in a.rows("weighted")} == {"0", "2"}, [r.module for r in a.rows()]
        assert all(torch.equal(before[k], v) for k, v in res.state_dict().items())


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 16)
        self.b = nn.Linear(16, 3)

    def forward(self, x, *, scale=1.0):
        return self.b(torch.relu(self.a(x)) * scale)


def test_a_keyword_both_in_the_sample_dict_and_in_forward_kwargs_is_refused():
    """``precondition(model, {"x": x, "scale": 1.0}, forward_kwargs={"scale": 3.0})`` calibrated
    with scale=3 without a word: the result's output std was 1/3 when called as the sample
    says."""
    torch.manual_seed(0)
    model = _Scaled()
    x = torch.randn(16, 10)
    for call in (lambda: precondfx.precondition(model, {"x": x, "scale": 1.0},
                                                forward_kwargs={"scale": 3.0}),
                 lambda: precondfx.precondition(model, {"x": x, "scale": 1.0}, scale=3.0),
                 lambda: precondfx.analyze(model, {"x": x, "scale": 1.0}, scale=3.0)):
        try:
            call()
        except precondfx.PrecondError as e:
            assert "scale" in str(e) and "forward_kwargs" in str(e), str(e)
        else:
            raise AssertionError("a keyword given twice was not refused")
    res, _ = precondfx.precondition(model, {"x": x}, forward_kwargs={"scale": 3.0})
    with torch.no_grad():
        assert abs(float(res(x, scale=3.0).double().std(correction=0)) - 1.0) < 1e-3


def test_an_output_scale_out_of_range_because_of_the_data_or_the_target_says_so():
    """Unnormalized inputs (rms 1e6, 1e30) or an absurd target_std were blamed on the model:
    'the forward signal grows 1.58e+06-fold through the re-initialized model' / 'the signal
    explodes through the re-initialized model ... make the model shallower or wider', although
    the model keeps the input's scale (output std 1.5x the input rms)."""
    import warnings
    model = _mlp()
    x = torch.randn(16, 10, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _, rep = precondfx.precondition(model, x * 1e6)
    said = " ".join(str(m.message) for m in w) + " ".join(why for _, why in rep.skipped)
    assert "inputs have rms 1.0" in said and "input_scale='auto'" in said, said
    assert "through the re-initialized model" not in said, said
    for bad, words in ((dict(sample=x * 1e30), "inputs have rms"),
                       (dict(sample=x, target_std=1e-300), "target_std=1e-300 is")):
        try:
            precondfx.precondition(model, bad.pop("sample"), **bad)
        except precondfx.PrecondError as e:
            assert words in str(e) and "shallower" not in str(e), str(e)
        else:
            raise AssertionError(f"{bad} was not refused")
    # a model that does shrink the signal is still told so
    deep = nn.Sequential(*[nn.Sequential(nn.Linear(10, 10, bias=False), nn.Tanh())
                           for _ in range(3)], nn.Linear(10, 3, bias=False))
    with torch.no_grad():
        for m in deep.modules():
            if isinstance(m, nn.Linear):
                m.weight.mul_(1e-3)
    try:
        precondfx.precondition(deep, x, reinit_weights=False, balance="none")
    except precondfx.PrecondError as e:
        assert "vanishes through the model" in str(e), str(e)
    else:
        raise AssertionError("a vanishing model was not refused")


def _refused(fn, *words):
    try:
        fn()
    except precondfx.PrecondError as e:
        assert all(w in str(e) for w in words), str(e)
    else:
        raise AssertionError("not refused")


def test_reinit_checks_its_seed_plan_and_model_as_precondition_does():
    """precondfx.reinit took seed=1.5 as seed 1, and '1', -1, True without a word (precondition
    refuses each); a Report, None or a string in place of the plan or the model raised a raw
    AttributeError."""
    x = torch.randn(16, 10, generator=torch.Generator().manual_seed(1))
    res, rep = precondfx.precondition(_mlp(), x, seed=4, balance="none", target_std=None)
    for seed in (1.5, "1", -1, True):
        _refused(lambda: precondfx.reinit(_mlp(), rep.plan, seed=seed), "seed=")
    _refused(lambda: precondfx.reinit(_mlp(), rep), "report.plan")
    _refused(lambda: precondfx.reinit(_mlp(), None), "plan")
    _refused(lambda: precondfx.reinit("model", rep.plan), "torch.nn.Module")
    import json
    for plan in (rep.plan, json.loads(rep.to_json())["plan"]):   # a saved report's plan too
        m = _mlp()
        precondfx.reinit(m, plan)
        for k, v in m.state_dict().items():
            assert torch.equal(v, res.state_dict()[k]), k


def test_init_functions_refuse_a_bad_gain_padding_idx_or_non_tensor():
    """precondfx.init.geometric_(w, gain=-1.0) filled w with ~1e-17 (the square root of a
    negative second moment is complex; its real part was copied in with only a torch
    warning); padding_idx=20 on 10 rows raised a raw IndexError, a list a raw AttributeError."""
    import precondfx.init as pinit
    for gain in (-1.0, 0.0, float("nan"), "2"):
        _refused(lambda: pinit.geometric_(torch.empty(8, 8), gain=gain), "gain=")
    w = torch.empty(64, 64)
    pinit.geometric_(w, gain=1.0)
    assert abs(float(w.pow(2).mean()) / (1.0 / 64) - 1) < 1e-3
    _refused(lambda: pinit.embedding_(torch.empty(10, 4), padding_idx=20), "padding_idx=20")
    assert float(pinit.embedding_(torch.empty(10, 4), padding_idx=-1)[9].abs().sum()) == 0.0
    _refused(lambda: pinit.fan_in_([[1.0, 2.0]]), "torch.Tensor")


def test_a_batch_of_one_is_not_reported_as_held_out_nor_as_sixteen_samples():
    """With a batch of one there is no held-out half: measure=True measured the very sample
    balancing was fitted on, yet the report said '(held-out half of the batch)' and 'on the 16
    balancing samples' (16 draws on that one sample)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 3))
    _, rep = precondfx.precondition(model, torch.randn(1, 10), balance="hessian", measure=True)
    text = rep.table(width=400)
    assert "held-out" not in text.replace("no held-out half", ""), text
    assert "16 balancing draws over 1 sample(s)" in text, text
    h = rep.conditioning["hessian"]
    assert h["distinct_samples"] == 1 and h.get("held_out") is None and h["same_sample"] > 0
    assert rep.conditioning["measure"]["after"]["held_out"] is False
    _, rep = precondfx.precondition(model, torch.randn(64, 10), balance="hessian", measure=True)
    m = rep.conditioning["measure"]
    assert m["after"]["held_out"] is True
    assert f"held-out half of the batch: {m['after']['spread']:.3g}x" in rep.table(width=400)
    assert "16 balancing samples" in rep.table(width=400)


class _ComplexOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 32)
        self.b = nn.Linear(32, 6)

    def forward(self, x):
        return torch.view_as_complex(self.b(torch.relu(self.a(x))).reshape(-1, 3, 2))


def test_a_complex_output_is_calibrated_on_its_values_not_its_real_parts():
    """The output std was measured after a cast to float64, which keeps the real parts only
    (with a torch warning): the result's complex output had std 1.38 while the report said 1."""
    import warnings
    torch.manual_seed(0)
    x = torch.randn(64, 10, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)     # 'discards the imaginary part'
        res, rep = precondfx.precondition(_ComplexOut(), x)
    with torch.no_grad():
        std = float(res(x).std(correction=0))
    assert abs(std - 1.0) < 1e-3, std
    assert abs(rep.verification["std"] - std) < 1e-3


def test_a_bad_nf_schedule_is_not_told_to_pass_a_number():
    """residual_scale='nf:-1' or 'nf:abc' got the hint '(a string: pass the number itself)',
    which is wrong for a named schedule."""
    x = torch.randn(16, 10)
    for bad in ("nf:-1", "nf:abc"):
        _refused(lambda: precondfx.precondition(_mlp(), x, residual_scale=bad),
                 "a must be a positive number")
    _refused(lambda: precondfx.precondition(_mlp(), x, residual_scale="0.5"),
             "pass the number itself")


def test_options_that_together_change_nothing_are_said():
    """reinit_weights=False with balance='none' and target_std=None returned the model as it
    was, and the report's result line even said 'every method computes with the constants';
    that the combination does nothing was not said."""
    x = torch.randn(16, 10)
    model = _mlp()
    res, rep = precondfx.precondition(model, x, reinit_weights=False, balance="none",
                                      target_std=None)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in res.state_dict().items())
    assert sum("change nothing" in n for n in rep.plan.notes) == 1, rep.plan.notes
    assert "change nothing" in str(rep)
    for opts in ({}, dict(reinit_weights=False, balance="none"), dict(target_std=None)):
        _, rep = precondfx.precondition(model, x, **opts)
        assert not any("change nothing" in n for n in rep.plan.notes), (opts, rep.plan.notes)


def test_options_without_effect_are_said_in_the_printed_report():
    """'balance_threshold=5.0 has no effect' and a scheme's override were in
    report.plan.notes only: print(report) did not show them."""
    x = torch.randn(16, 10)
    _, rep = precondfx.precondition(_mlp(), x, balance="none", balance_threshold=5.0)
    assert str(rep).count("balance_threshold=5.0 has no effect") == 1, str(rep)
    _, rep = precondfx.precondition(_mlp(), x, scheme="gne")
    assert "balance='auto' -> 'none' (scheme gne)" in str(rep)
    _, rep = precondfx.precondition(_mlp(), x, lr_scale="user")
    assert str(rep).count("lr_scale='user': main-path depth") == 1, str(rep)


def test_a_dataclass_batch_is_one_positional_input_as_a_namedtuple_is():
    """``precondition(model, batch)`` with a @dataclass batch (forward(self, batch)) was refused
    with 'sample must be a tensor, a tuple ... or a dict', although the same batch in a tuple,
    and a namedtuple batch, are one positional input."""
    from dataclasses import dataclass

    @dataclass
    class Batch:
        x: torch.Tensor
        tag: str = "train"

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(10, 32)
            self.b = nn.Linear(32, 3)

        def forward(self, batch):
            return self.b(torch.relu(self.a(batch.x)))

    torch.manual_seed(0)
    model = Net()
    batch = Batch(torch.randn(16, 10, generator=torch.Generator().manual_seed(1)))
    res, rep = precondfx.precondition(model, batch, balance="hessian")
    ref, _ = precondfx.precondition(model, (batch,), balance="hessian")
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in res.state_dict().items())
    with torch.no_grad():
        assert abs(float(res(batch).double().std(correction=0)) - 1.0) < 1e-3
    _refused(lambda: precondfx.precondition(model, object()), "(batch,)")


def test_report_load_of_a_file_that_is_not_a_report_says_so(tmp_path):
    """Report.load raised json's raw 'Expecting property name...' for a file that is not JSON
    and AttributeError for a JSON list."""
    bad, lst = tmp_path / "bad.json", tmp_path / "list.json"
    bad.write_text("{not json")
    lst.write_text("[1, 2]")
    _refused(lambda: precondfx.Report.load(bad), "not a precondfx report", "report.save")
    _refused(lambda: precondfx.Report.load(lst), "not a precondfx report")
    _, rep = precondfx.precondition(_mlp(), torch.randn(16, 10))
    rep.save(tmp_path / "r.json")
    assert str(precondfx.Report.load(tmp_path / "r.json")) == str(rep)
