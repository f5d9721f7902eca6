"""Options: one definition, checked on the user's values first, resolved once (scheme overrides
and back-end limits, each noted), the same defaults in every entry point and the CLI."""
import argparse
import dataclasses
import inspect

import pytest
import torch
from torch import nn

import precondfx
from precondfx import PrecondError
from precondfx.onnx import inspect_onnx, precondition_onnx
from precondfx.core.options import (DEFAULTS, Options, cli_fields, cli_flags, from_text, keyword_of,
                               resolve)
from precondfx.core.scheme import resolve_options


def _mlp():
    with torch.random.fork_rng():          # leave the global RNG as other tests expect it
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), torch.randn(8, 6)


BAD = [
    ({"target_std": "0.05"}, "a string: pass the number"),
    ({"target_std": True}, "a bool is not a number"),
    ({"target_std": float("nan")}, "positive number"),
    ({"seed": None}, "integer in"),
    ({"seed": 1.5}, "pass an int"),
    ({"seed": 2 ** 70}, "integer in"),
    ({"seed": -1}, "integer in"),
    ({"seed": True}, "a bool is not an integer"),
    ({"balance_samples": -3}, r"integer in \[1, 4096\]"),
    ({"balance_samples": 2.0}, "pass an int"),
    ({"scheme_options": {"bogus": 1}}, "not options of scheme='geometric'"),
    ({"scheme": "lsuv", "scheme_options": {"bogus": 1}}, "its options are"),
    ({"scheme": "tat", "balance": "x"}, "balance='x' is not one of"),
    ({"scheme": "gne", "balance": "x"}, "balance='x' is not one of"),
    ({"scheme": "nope"}, "scheme='nope' is not one of"),
    ({"balance_threshold": 0.5}, "number >= 1"),
    ({"reinit_weights": 1}, "reinit_weights=1 must be True or False"),
    ({"measure": "yes"}, "must be True or False"),
    ({"output_key": 1.5}, "output name"),
    ({"calibration": "test"}, "not one of"),
    ({"capture": ["jit"]}, "not among"),
    ({"residual_scale": "0.5"}, "a string"),
    ({"scheme_options": [1]}, "dict of keyword arguments"),
]


@pytest.mark.parametrize("kw,needle", BAD)
def test_bad_values_are_refused_before_anything_runs(kw, needle):
    with pytest.raises(PrecondError, match=needle.replace("(", r"\(")):
        resolve_options(Options.from_keywords(**kw))      # what every entry point runs first
    model, x = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PrecondError, match=needle.replace("(", r"\(")):
        precondfx.precondition(model, x, **kw)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_values_are_normalized():
    o = Options(target_std=1, seed=torch.tensor(3).item(), residual_scale=1,
                capture="fx", scheme_options=None)
    assert o.target_std == 1.0 and type(o.target_std) is float
    assert o.residual_scale == 1.0 and o.capture == ("fx",) and o.scheme_options == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.seed = 1


def test_unknown_keyword():
    with pytest.raises(PrecondError, match="unknown option"):
        Options.from_keywords(target_sdt=0.1)


@pytest.mark.parametrize("fn", [precondfx.precondition, precondfx.analyze, precondition_onnx,
                                inspect_onnx])
def test_entry_points_use_the_one_set_of_defaults(fn):
    sig = inspect.signature(fn).parameters
    for f in dataclasses.fields(Options):
        k = keyword_of(f)
        if k in sig:
            assert sig[k].default == getattr(DEFAULTS, f.name), (fn.__name__, k)


def test_cli_flags_are_built_from_the_definition():
    p = argparse.ArgumentParser()
    cli_flags(p.add_argument)
    args = p.parse_args([])
    for f in cli_fields():
        assert getattr(args, keyword_of(f)) == f.default
    a = p.parse_args(["--target-std", "none", "--seed", "7", "--no-reinit", "--input-scale",
                      "auto", "--output-key", "2", "--residual-scale", "0.5"])
    assert (a.target_std, a.seed, a.reinit_weights, a.input_scale, a.output_key,
            a.residual_scale) == (None, 7, False, "auto", 2, 0.5)
    with pytest.raises(PrecondError, match="pass an int"):
        from_text("seed", "1.5")
    with pytest.raises(PrecondError, match="positive"):
        from_text("target_std", "-1")


def test_scheme_overrides_are_resolved_once_and_noted():
    r = resolve_options(Options(scheme="gne"))
    assert (r.user.balance, r.options.balance) == ("auto", "none")
    assert [(c.option, c.old, c.new) for c in r.changes] == [("balance", "auto", "none")]
    r = resolve_options(Options(scheme="tat", balance="hessian", residual="all"))
    assert (r.options.balance, r.options.residual) == ("none", "none")
    assert len(r.notes()) == 2 and "tat fixes the scales" in r.notes()[0]
    r = resolve_options(Options(scheme="gne", balance="hessian"))   # asked for: kept
    assert r.options.balance == "hessian" and not r.changes
    model, x = _mlp()
    rep = precondfx.analyze(model, x, scheme="gne")
    assert rep.plan.options["balance"] == "none"
    assert any("balance='auto' -> 'none' (scheme gne)" in n for n in rep.plan.notes)
    assert any("balance='auto' -> 'none'" in n for n in rep.capture_notes)


def test_backend_limits():
    from precondfx.api import META
    from precondfx.onnx.pipeline import INSPECT, ONNX
    r = resolve(Options(), ONNX)
    assert r.options.balance == "analytic" and r.changes[0].by == "ONNX back end"
    with pytest.raises(PrecondError, match="not available for ONNX"):
        resolve(Options(balance="hessian"), ONNX)
    with pytest.raises(PrecondError, match="measure=True"):
        resolve(Options(measure=True), ONNX)
    assert resolve(Options(input_scale="auto"), ONNX, INSPECT).options.input_scale is None
    for kw, needle in (({"scheme": "lsuv"}, "scheme="), ({"capture": "fx"}, "capture="),
                       ({"calibration": "eval"}, "calibration=")):
        with pytest.raises(PrecondError, match=needle):
            resolve(Options(**kw), ONNX)
    with pytest.raises(PrecondError, match="unknown option"):   # before the file is read
        inspect_onnx("no-such-file.onnx", target_sdt=0.1)
    assert resolve(Options(balance="none", target_std=None), META).changes == ()
    with pytest.raises(PrecondError, match="meta device"):
        resolve(Options(balance="analytic", input_scale="auto"), META)
    with pytest.raises(PrecondError, match="meta device"):
        resolve_options(Options(balance="none", scheme="lsuv"), META)
    model = nn.Linear(4, 4, device="meta")
    # measured balancing on the meta device is deferred to precondfx.distributed.balance (issue
    # 21, item 6): an alpha at 1 on every weighted layer, the report says what to call
    _, rep = precondfx.precondition(model, torch.randn(2, 4), balance="hessian")
    assert rep.conditioning["hessian"]["applied"] is False
    assert "distributed.balance" in rep.conditioning["hessian"]["decision"]
    assert [s.value for s in rep.planned.scales if s.tag == "alpha"] == [1.0]
    with pytest.raises(PrecondError, match="meta device"):
        precondfx.precondition(nn.Linear(4, 4, device="meta"), torch.randn(2, 4),
                               balance="auto")


def test_measured_balancing_mode_is_explicit():
    from precondfx.pytorch.balance import balance_measured
    with pytest.raises(PrecondError, match="measured balancing is 'auto' or 'hessian'"):
        balance_measured(nn.Linear(2, 2), None, None, {}, balance="analytic")
