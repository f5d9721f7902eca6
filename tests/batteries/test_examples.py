"""The examples run as they are; their figures are checked here."""
import importlib.util
import pathlib

import pytest

from precondfx.core.options import DEFAULTS

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quickstart_runs_and_trains(capsys):
    report, losses = _load("quickstart").main(steps=15)
    out = capsys.readouterr().out
    assert "precondfx report" in out and "folded into" in out
    assert report.output_std_after == pytest.approx(DEFAULTS.target_std, rel=0.02)
    assert losses[-1] < losses[0]


def test_transformers_example(capsys):
    pytest.importorskip("transformers")
    report = _load("transformers_bert").main()
    assert report.capture == "export"
    assert report.output_std_after == pytest.approx(DEFAULTS.target_std, rel=0.02)
    assert "SequenceClassifierOutput" in capsys.readouterr().out
