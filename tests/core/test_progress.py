"""Progress of measurements: stderr only, off unless a terminal or forced, ETA on the logger."""
from __future__ import annotations

import logging

import torch
from torch import nn

from precondfx.pytorch.measure.sketch import hessian_sketch
from precondfx.core.progress import Progress, showing


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), torch.randn(4, 6)


def test_bar_on_stderr_when_forced(monkeypatch, capfd):
    monkeypatch.setenv("PRECONDFX_PROGRESS", "1")
    net, x = _net()
    hessian_sketch(net, x, ["0.weight", "2.weight"], n_samples=6, desc="test sketch")
    out, err = capfd.readouterr()
    assert out == ""
    assert "precondfx: test sketch" in err and "6/6" in err


def test_off_when_not_a_terminal_or_verbose_false(monkeypatch, capfd):
    monkeypatch.delenv("PRECONDFX_PROGRESS", raising=False)
    net, x = _net()
    hessian_sketch(net, x, ["0.weight", "2.weight"], n_samples=3)  # stderr is captured: no tty
    monkeypatch.setenv("PRECONDFX_PROGRESS", "1")
    hessian_sketch(net, x, ["0.weight", "2.weight"], n_samples=3, verbose=False)
    assert capfd.readouterr() == ("", "")
    assert showing(None) is True and showing(False) is False


def test_logger_gets_count_and_eta(caplog, monkeypatch):
    monkeypatch.delenv("PRECONDFX_PROGRESS", raising=False)
    t = iter([0.0, 20.0, 40.0, 40.0])
    monkeypatch.setattr("precondfx.core.progress.time.perf_counter", lambda: next(t))
    with caplog.at_level(logging.INFO, logger="precondfx"):
        with Progress(4, "blocks", unit="block", verbose=False) as p:
            p.step()      # t=20: 1 of 4 in 20 s -> 60 s left
            p.step()      # t=40: 2 of 4 -> 40 s left
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[0] == "blocks: 4 blocks"
    assert "blocks: 1/4 blocks, 20.0 s elapsed, ETA 60.0 s" in msgs
    assert "blocks: 2/4 blocks, 40.0 s elapsed, ETA 40.0 s" in msgs
    assert msgs[-1] == "blocks: 2/4 blocks in 40.0 s"
