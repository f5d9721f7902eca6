"""Defects found by the sixth ONNX hunt (the command line and the ONNX back end); each test
fails without its fix."""
from __future__ import annotations

import os
import resource
import signal
import textwrap

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn

from precondfx.cli import main

ort = pytest.importorskip("onnxruntime")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's ``module:callable`` (the command line imports it from the working folder)."""
    (tmp_path / "hunt6_models.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def build():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)), \\
                torch.randn(16, 64)
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "hunt6_models:build"


def _with_file_size_limit(nbytes, fn):
    """Run ``fn`` with writes beyond ``nbytes`` failing with EFBIG (a real short write, as on a
    full disk or over a quota), then lift the limit again."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        return fn()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


@pytest.mark.parametrize("out", ["model.pt", "model.onnx"])
def test_a_full_disk_on_the_pytorch_path_says_so(tmp_path, user_module, capsys, out):
    """Writing the state_dict (torch.save) into a full folder was an internal error with a
    traceback (exit 1); the .onnx export was 'torch.onnx.export could not export ... write
    its state_dict instead' (which fails the same way).  Both now say the disk is full."""
    code = _with_file_size_limit(
        16384, lambda: main(["precondition", user_module, "-o", str(tmp_path / out),
                             "--quiet"]))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "bug" not in err and "could not export" not in err
    assert "File too large" in err and "free space" in err and str(tmp_path) in err
    assert sorted(os.listdir(tmp_path)) == ["__pycache__", "hunt6_models.py"] or \
        sorted(os.listdir(tmp_path)) == ["hunt6_models.py"]


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


@pytest.mark.parametrize("dynamo", [False, True])
def test_weights_exported_as_inputs_are_named_as_such(tmp_path, capsys, dynamo):
    """A file exported with export_params=False (weights as graph inputs, or with the dynamo
    exporter not defined at all) was refused as 'no weighted layer ... pass the model that
    holds the layers' or as 'a sparse initializer?': now it says the weights were left out of
    the file and to export with export_params=True."""
    torch.manual_seed(0)
    src = str(tmp_path / "m.onnx")
    torch.onnx.export(_ConvNet().eval(), (torch.randn(2, 3, 8, 8),), src, dynamo=dynamo,
                      export_params=False, **({} if dynamo else {"input_names": ["x"]}))
    assert not onnx.load(src).graph.initializer
    code = main(["precondition", src, "-o", str(tmp_path / "out.onnx"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "export_params=True" in err and "no weighted layer" not in err
    if not dynamo:
        assert "conv.weight" in err and "fc.weight" in err
    assert not (tmp_path / "out.onnx").exists()


def test_initializers_that_are_graph_inputs_are_named_in_the_report(tmp_path, capsys):
    """keep_initializers_as_inputs=True: the weights are re-drawn in the file, but onnxruntime
    lets a caller feed them, which replaces the re-drawn weights at run time; nothing said
    so.  Now the report and the command line name them."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    src, out, rep = (str(tmp_path / n) for n in ("m.onnx", "out.onnx", "r.json"))
    torch.onnx.export(m, (torch.randn(2, 8),), src, dynamo=False, input_names=["x"],
                      keep_initializers_as_inputs=True, dynamic_axes={"x": {0: "batch"}})
    original = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(src).graph.initializer}
    assert set(original) <= {i.name for i in onnx.load(src).graph.input}
    assert main(["precondition", src, "-o", out, "--report", rep, "--quiet"]) == 0
    err = capsys.readouterr().err
    import json
    notes = [n for n in json.loads(open(rep).read())["capture_notes"]
             if "are also graph inputs" in n]
    assert len(notes) == 1 and all(k in notes[0] for k in original), notes
    assert "4 of them re-initialized" in notes[0] and "feed only the real inputs (x)" in notes[0]
    assert "are also graph inputs" in err
    # what the note says: feeding the original weights undoes the re-initialization
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(out, opts, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((64, 8)).astype(np.float32)
    y_file = sess.run(None, {"x": x})[0]
    y_fed = sess.run(None, {"x": x, **original})[0]
    assert np.linalg.norm(y_fed - y_file) / np.linalg.norm(y_file) > 0.1


def test_report_refuses_every_name_the_outputs_data_file_may_have(tmp_path, capsys):
    """--report protected OUT.data but not OUT.<8 hex>.data, the name Staging gives the
    weights when the earlier output reads OUT.data: the JSON was written to a name the
    output's weights file has or may have.  Both names are now refused before any work."""
    torch.manual_seed(0)
    src, out = str(tmp_path / "m.onnx"), str(tmp_path / "out.onnx")
    torch.onnx.export(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).eval(),
                      (torch.randn(2, 64),), src, dynamo=False, input_names=["x"])
    cmd = ["precondition", src, "-o", out, "--external-data", "always", "--quiet"]
    assert main(cmd) == 0 and main(cmd) == 0
    hexed = [f for f in os.listdir(tmp_path) if f.startswith("out.onnx.") and f != "out.onnx.data"]
    assert len(hexed) == 1 and len(hexed[0]) == len("out.onnx.01234567.data")   # in use now
    capsys.readouterr()
    before = sorted(os.listdir(tmp_path))
    for name in (hexed[0], "out.onnx.0badf00d.data"):
        assert main(cmd + ["--report", str(tmp_path / name)]) == 2
        assert "weights file" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == before
    assert main(cmd + ["--report", str(tmp_path / "out.onnx.json")]) == 0
