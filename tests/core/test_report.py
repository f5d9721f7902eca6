"""The report: readable unique rows, every constant visible, fits a width, JSON round trip,
timings and verification on the PyTorch path."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import precondfx
from tests import zoo
from precondfx.errors import PrecondError
from precondfx.core.report import SCHEMA_VERSION, Report, _cut, _fit_unique


def _rows(table: str) -> list[str]:
    lines = table.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("-----")) + 1
    end = next(i for i in range(start, len(lines)) if not lines[i].strip()
               or lines[i].startswith("("))
    return lines[start:end]


@pytest.fixture(scope="module")
def cnn():
    torch.manual_seed(0)
    model, sample = zoo.build("maxpool_cnn")
    return model, sample, precondfx.precondition(model, sample, balance="hessian",
                                                 measure=True, target_std=0.05)


def test_round_trip_field_by_field(cnn, tmp_path):
    _, _, (_, rep) = cnn
    path = tmp_path / "r.json"
    rep.save(path)
    d = json.loads(path.read_text())
    assert d["schema_version"] == SCHEMA_VERSION
    back = Report.load(path)
    for f in dataclasses.fields(Report):
        assert getattr(back, f.name) == getattr(rep, f.name), f.name
    d["schema_version"] = SCHEMA_VERSION + 1
    path.write_text(json.dumps(d))
    with pytest.raises(PrecondError, match="schema_version"):
        Report.load(path)


def test_pytorch_path_fills_timings_verification_and_held_out(cnn):
    model, sample, (result, rep) = cnn
    st = rep.stage_seconds
    assert {"capture", "plan", "apply", "reinit", "calibrate", "balance", "measure",
            "verify"} <= set(st)
    assert st["total"] == pytest.approx(sum(v for k, v in st.items() if k != "total"), rel=1e-6)
    # the verification's std against an independent forward of the result (no dropout or BN)
    with torch.no_grad():
        y = result(sample).double()
    assert rep.verification["std"] == pytest.approx(float(y.std(unbiased=False)), rel=1e-5)
    assert rep.verification["std"] == pytest.approx(0.05, rel=1e-3)   # after balancing
    assert rep.verification["finite"] is True
    h = rep.conditioning["hessian"]
    assert h["applied"] and h["held_out"] == rep.conditioning["measure"]["after"]["spread"]
    assert "not measured here" not in rep.table(width=200)
    assert f"held-out half of the batch: {h['held_out']:.3g}x" in rep.table(width=200)


def test_every_alpha_visible_with_its_origin(cnn):
    _, _, (_, rep) = cnn
    rows = _rows(rep.table(width=200))
    alphas = [sc for sc in rep.plan.scales if sc.tag == "alpha"]
    assert len(alphas) == 6
    label = {r.name: r.label for r in rep.nodes}
    for sc in alphas:
        row = next(r for r in rows if r.startswith(label[sc.node] + " "))
        assert f"alpha={sc.value:.3g} (measured)" in row, row
    assert f"output scale {rep.output_scale:.4g}" in rep.table(width=200)


def test_cut_keeps_labels_distinct():
    names = [f"bert.encoder.layer.{i}.attention.self.{w}" for i in range(12)
             for w in ("query", "key", "value")]
    w = _fit_unique(names, 20)
    cut = [_cut(n, w) for n in names]
    assert len(set(cut)) == len(names)
    assert all(len(c) <= w for c in cut) and all("\u2026" in c for c in cut)
    assert _cut("short", 20) == "short"


@pytest.mark.skipif(not zoo.HAS_TRANSFORMERS, reason="needs transformers")
@pytest.mark.parametrize("name", ["hf_bert", "hf_gpt2"])
def test_transformers_rows_distinct_module_paths_fit_width(name):
    torch.manual_seed(0)
    model, sample = zoo.build(name)
    _, rep = precondfx.precondition(model, sample)
    labels = [r.label for r in rep.nodes]
    assert len(set(labels)) == len(labels)
    assert not any(lab.startswith("L__self__") for lab in labels)
    mods = {r.module for r in rep.nodes if r.module}
    assert mods <= set(labels) | {lab.split("#")[0].split(":")[0] for lab in labels}
    narrow, wide = rep.table(width=100), rep.table(width=220)
    rn, rw = _rows(narrow), _rows(wide)
    assert len(set(r.split(" ")[0] for r in rn)) == len(rn)      # every row distinguishable
    assert max(len(ln) for ln in narrow.splitlines()) <= 100       # fits the width
    assert max(len(r) for r in rw) > max(len(r) for r in rn)      # width= widens columns
    assert not re.search(r"L__self__", wide)
    for sc in rep.plan.scales:                                     # every constant visible
        if sc.tag == "alpha" and sc.value != 1.0:
            row = next(r for r in rw if r.startswith(
                next(x.label for x in rep.nodes if x.name == sc.node) + " "))
            assert f"alpha={sc.value:.3g}" in row
        if sc.tag == "residual":
            assert f"s={sc.value:.3g}" in wide
