"""Issue 21's listed defects on the ONNX path and its command line: external data that points
outside the model's folder, ``inspect``'s choices, ``--report`` into an unwritable folder.  Each
test failed on the code before the fix."""
from __future__ import annotations

import os

import numpy as np
import pytest

from precondfx.errors import PrecondError
from tests.helpers import cli_help


# -- G. ONNX external data outside the model's folder -------------------------------------------
def _outside_model(tmp_path, how: str) -> tuple[str, str]:
    """A model in tmp/model/ whose external data is tmp/secret.bin, reached by ``how``."""
    onnx = pytest.importorskip("onnx")
    from tests.batteries.test_onnx_files import _mlp, _save
    folder = tmp_path / "model"
    folder.mkdir()
    src = _save(_mlp(), folder / "m.onnx", save_as_external_data=True, location="m.bin",
                size_threshold=0)
    secret = tmp_path / "secret.bin"
    os.replace(folder / "m.bin", secret)
    loc = {"dotdot": "../secret.bin", "absolute": str(secret), "link": "link.bin",
           "nested": "sub/../../secret.bin"}[how]
    if how == "link":
        os.symlink(secret, folder / "link.bin")
    m = onnx.load(src, load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = loc
    onnx.save_model(m, src)
    return src, str(secret)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "link", "nested"])
def test_external_data_outside_the_folder_is_refused_untouched(tmp_path, how, monkeypatch,
                                                              capsys):
    src, secret = _outside_model(tmp_path, how)
    from precondfx.cli import main
    from precondfx.onnx import inspect_onnx, precondition_onnx
    touched = []
    real_stat = os.stat

    def stat(p, *a, **k):
        touched.append(os.fspath(p) if not isinstance(p, int) else "")
        return real_stat(p, *a, **k)
    monkeypatch.setattr(os, "stat", stat)
    out = str(tmp_path / "model" / "out.onnx")
    for call in (lambda: precondition_onnx(src, out, feeds={"x": np.ones((4, 8), np.float32)}),
                 lambda: inspect_onnx(src)):
        with pytest.raises(PrecondError, match="outside the model's folder|absolute path"):
            call()
    monkeypatch.setattr(os, "stat", real_stat)
    assert not any(os.path.abspath(p) == secret for p in touched if p)   # never statted
    capsys.readouterr()
    assert main(["precondition", src, "-o", out, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "outside the model's folder" in err[0] or "absolute path" in err[0]
    assert "bytes" not in err[0] and not os.path.exists(out)


def test_inspect_does_not_offer_balance_hessian():
    pytest.importorskip("onnx")
    choices = next(ln for ln in cli_help("inspect").splitlines() if "--balance {" in ln)
    assert "hessian" not in choices and "analytic" in choices
    assert "hessian" in next(ln for ln in cli_help("precondition").splitlines()
                             if "--balance {" in ln)   # PyTorch models still have it


def test_report_into_an_unwritable_folder_fails_before_the_output(tmp_path, capsys):
    pytest.importorskip("onnx")
    folder = "/sys"     # a read-only file system, even for root
    if os.access(folder, os.W_OK) and not os.path.isdir(folder):
        pytest.skip("no read-only folder")
    try:
        open(os.path.join(folder, "precondfx_probe.json"), "xb").close()
        pytest.skip(f"{folder} is writable here")
    except OSError:
        pass
    from precondfx.cli import main
    from tests.batteries.test_onnx_files import _mlp, _save
    src = _save(_mlp(), tmp_path / "m.onnx")
    out = tmp_path / "out.onnx"
    r = main(["precondition", src, "-o", str(out), "--quiet", "--report",
              os.path.join(folder, "report.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert r == 2 and len(err) == 1 and "--report" in err[0] and "cannot write" in err[0]
    assert not out.exists()                               # refused before any work
