"""Options, schemes and the command line (hunt opts3): scheme_options on the command line,
init='keep' with reinit_weights=False, and how a DKS/TAT solve that cannot succeed ends."""
from __future__ import annotations

import json
import textwrap
import time

import pytest
import torch
from torch import nn

import precondfx
from precondfx import PrecondError
from precondfx.cli import main

MODELS = textwrap.dedent("""
    from torch import nn

    def build():
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                             nn.Linear(32, 4))
""")


@pytest.fixture
def spec(tmp_path, monkeypatch):
    (tmp_path / "opts3_models.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "opts3_models:build"


def _run(spec, tmp_path, *flags):
    out, rep = tmp_path / "out.pt", tmp_path / "r.json"
    rc = main(["precondition", spec, "--sample-shape", "32x16", "-o", str(out), "--quiet",
               "--report", str(rep), *flags])
    return rc, (json.loads(rep.read_text()) if rc == 0 else None)


def test_cli_scheme_option_reaches_the_scheme(spec, tmp_path, capsys):
    """Before: 'unrecognized arguments: --scheme-option' (exit 2), the CLI had no way to pass
    scheme_options; now each KEY=VALUE reaches the scheme, values read as numbers/bools."""
    rc, rep = _run(spec, tmp_path, "--scheme", "tat", "--scheme-option", "tau=0.5",
                   "--scheme-option", "delta=false")
    assert rc == 0, capsys.readouterr().err
    assert rep["conditioning"]["tat"]["tau"] == 0.5
    # the same as the API with the same options
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 4))
    _, r = precondfx.precondition(model, torch.randn(32, 16), scheme="tat",
                                  scheme_options={"tau": 0.5, "delta": False})
    assert r.conditioning["tat"]["local_curvature"] == pytest.approx(
        rep["conditioning"]["tat"]["local_curvature"])


@pytest.mark.parametrize("flags, says", [
    (("--scheme", "tat", "--scheme-option", "tua=0.5"), "'tua'"),               # misspelled
    (("--scheme", "tat", "--scheme-option", "tau=abc"), "must be a number"),    # mis-typed
    (("--scheme", "tat", "--scheme-option", "tau=1", "--scheme-option", "tau=2"),
     "given twice"),                                                           # conflicting
    (("--scheme-option", "tau=1"), "is an option of scheme='tat'"),            # wrong scheme
    (("--scheme", "tat", "--scheme-option", "tau"), "KEY=VALUE"),              # malformed
])
def test_cli_scheme_option_errors(spec, tmp_path, capsys, flags, says):
    rc, _ = _run(spec, tmp_path, *flags)
    err = capsys.readouterr().err
    assert rc == 2 and says in err and "Traceback" not in err


def test_cli_scheme_option_flag_is_from_the_option_table():
    """One definition: the flag is built from the Options field (and its docs row)."""
    from dataclasses import fields
    from precondfx.core.options import Options, flag_of
    f = next(f for f in fields(Options) if f.name == "scheme_options")
    assert flag_of(f) == "--scheme-option"
    from tools.docs_hooks import options_table
    assert "`--scheme-option`" in options_table()


def test_init_keep_with_reinit_false_says_init_has_no_effect():
    """Before: no note at all; reinit_weights=False keeps the bias (0.3) and the gain (2.0),
    which init='keep' alone resets to 0 and 1, so init='keep' was silently ignored."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))
    with torch.no_grad():
        m[0].bias.fill_(0.3)
        m[1].weight.fill_(2.0)
    r, rep = precondfx.precondition(m, torch.randn(32, 8), init="keep", reinit_weights=False)
    assert r[0].bias[0].item() == pytest.approx(0.3)
    assert r[1].weight[0].item() == pytest.approx(2.0)
    said = [n for n in rep.plan.notes if n.startswith("init='keep' has no effect")]
    assert said and "reinit_weights=False" in said[0]
    assert any(k == "option" and "init='keep'" in v for k, v in rep.skipped)
    # init='keep' alone: no such note (it acts: the bias restarts at 0)
    r2, rep2 = precondfx.precondition(m, torch.randn(32, 8), init="keep")
    assert r2[0].bias[0].item() == 0.0
    assert not [n for n in rep2.plan.notes if "init='keep' has no effect" in n]


def test_cli_option_given_twice_is_refused(spec, tmp_path, capsys):
    """Before: '--seed 3 --seed 4' ran with seed 4 (exit 0), the 3 dropped silently."""
    rc, _ = _run(spec, tmp_path, "--seed", "3", "--seed=4")
    err = capsys.readouterr().err
    assert rc == 2 and "--seed (3 and 4)" in err
    rc, rep = _run(spec, tmp_path, "--seed", "3", "--seed", "3")    # the same value: fine
    assert rc == 0 and rep["plan"]["options"]["seed"] == 3


def test_scheme_value_refusal_is_not_called_a_type_error():
    """Before: "scheme_options of scheme='tat': PrecondError: eta=1 must be in (0, 1) ...;
    check the values' types against the scheme's options" although the type was right."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    with pytest.raises(PrecondError) as e:
        precondfx.precondition(model, torch.randn(8, 8), scheme="tat",
                               scheme_options={"eta": 1.0})
    msg = str(e.value)
    assert "eta=1.0 must be in (0, 1)" in msg and "scheme='tat'" in msg
    assert "PrecondError:" not in msg and "types" not in msg


def test_solver_quadrature_rule_is_built_once():
    """A DKS/TAT solve that cannot succeed evaluates the Gaussian moments ~26,000 times (50
    starts x damped Newton); the smooth-activation rule was rebuilt at each (a third of the
    time: tanh with C'(1)=1.05, Q'(1)=3 took 19.6 s on main, 12.0 s here in one run). The rule
    is now built once, the same numbers, and cannot be changed by a caller."""
    import numpy as np
    from precondfx.schemes.activations import _QUAD_PANELS, _rule, gaussian_rule
    z, w = gaussian_rule(())
    assert gaussian_rule(np.zeros(0))[0] is z
    fresh = _rule(np.zeros(0), _QUAD_PANELS)
    assert np.array_equal(z, fresh[0]) and np.array_equal(w, fresh[1])
    with pytest.raises(ValueError):
        w[0] = 1.0
    # a kinked activation still gets its own split rule
    zk, _ = gaussian_rule([0.3])
    assert zk is not z and zk.size > z.size
