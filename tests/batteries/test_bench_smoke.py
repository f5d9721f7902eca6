"""Smoke tests of the benchmark studies (bench/*.py): each study's ``--quick`` variant runs in
process, writes its JSON, and the JSON has the expected keys and finite numbers.  Timings are
not checked (CI machines are shared), only that they were measured."""
from __future__ import annotations

import gc
import importlib
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")


def _study(name: str):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    return importlib.import_module(name)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _load(path: str) -> dict:
    assert os.path.exists(path), path
    with open(path) as f:
        return json.load(f)


def test_libsvm_quick(tmp_path):
    mod = _study("libsvm_study")
    mod.main(["--quick", "--out", str(tmp_path)])
    data = _load(tmp_path / "libsvm_quick.json")
    assert os.path.exists(tmp_path / "libsvm_quick.png")
    for key in ("protocol", "configs", "datasets", "tables", "results", "env"):
        assert key in data
    assert len(data["datasets"]) >= 3
    (cfg,) = data["configs"]
    tab = data["tables"][cfg["name"]]["all"]
    assert set(tab) == set(cfg["methods"])
    for m, row in tab.items():
        assert _finite(row["avg_normalized"]) and 0 < row["avg_normalized"] <= 1.0, (m, row)
        assert 0 <= row["worst_in"] <= row["datasets"] and 0 <= row["best_in"] <= row["datasets"]
    assert sum(r["best_in"] for r in tab.values()) >= len(data["datasets"])
    for ds, per in data["results"][cfg["name"]].items():
        for m, rec in per.items():
            assert _finite(rec["best"]) and rec["best"] > 0, (ds, m)
            assert rec["best_lr"] in cfg["lrs"]
            assert _finite(rec["init"]["spread_per_sample"])


def test_libsvm_canonical_matches_torch_sgd():
    """The batched trainer reproduces torch.optim.SGD on each copy (momentum, weight decay)."""
    import torch
    mod = _study("libsvm_study")
    C = _study("common")
    C.setup()
    X, y = mod.load(mod.datasets()[1][1])
    d = X.shape[1]
    order = C.orders([0], len(y), 1)
    calib = X[order[0][0, :16]]
    for method in ("default", "precondfx_hessian"):
        model = C.build(method, lambda s: mod.make_net(d, 3), 0, calib)
        can = mod.canonical(model, calib)
        lr = 0.05
        fin = mod.train_mlps([can], torch.full((1, 3), lr), torch.full((1, 3), lr), [0],
                             torch.nn.functional.layer_norm(X, (d,)), y, order, batch=16,
                             epochs=1, momentum=0.9, wd=1e-5, device="cpu")
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-5)
        for j in range(len(y) // 16):
            idx = order[0][0, j * 16:(j + 1) * 16]
            loss = torch.nn.functional.cross_entropy(model(X[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            ref = float(torch.nn.functional.cross_entropy(model(X), y))
        assert abs(fin[0] - ref) < 1e-4 * max(1.0, ref), (method, fin[0], ref)


def test_conv_training_quick(tmp_path):
    mod = _study("conv_training")
    mod.main(["--quick", "--out", str(tmp_path)])
    data = _load(tmp_path / "conv_training_quick.json")
    assert os.path.exists(tmp_path / "conv_training_quick.png")
    for key in ("setup", "table", "runs", "env"):
        assert key in data
    for m, row in data["table"].items():
        assert _finite(row["final_train_loss"]) and row["final_train_loss"] > 0, m
        assert row["best_lr"] in data["setup"]["lrs"]
        curve = data["runs"][m]["best_curve"]
        assert curve and all(_finite(v) for v in curve)


def test_deep_plain_quick(tmp_path):
    mod = _study("deep_plain")
    mod.main(["--quick", "--out", str(tmp_path)])
    data = _load(tmp_path / "deep_plain_quick.json")
    assert os.path.exists(tmp_path / "deep_plain_quick.png")
    for key in ("setup", "runs", "table", "notes", "env"):
        assert key in data
    depths = [str(d) for d in data["setup"]["depths"]]
    for m in ("default", "fan_in", "precondfx", "lsuv"):
        for d in depths:
            r = data["runs"][m][d]
            assert _finite(r["best"]) and r["best"] > 0, (m, d)
            assert r["best_lr"] in data["setup"]["lrs"]
    # TAT is run when its scheme is registered; a refusal is recorded with its message
    for d, r in data["runs"].get("tat", {}).items():
        assert "best" in r or r.get("error"), d


def test_cost_quick(tmp_path):
    mod = _study("cost")
    # one timed training step (not the 0.5 s of steps a study takes: each timed step costs a
    # full gc.collect of the test session, ~0.25 s); the checks below read its time
    # gc.freeze: the study's gc.collect before each timed call (and in each forked child,
    # where it also copies every page it touches) skips the test session's own objects;
    # tests/conftest.py has frozen them already after collection, and gc.unfreeze() here would
    # hand them back to every later full collection of the session (it unfreezes everything)
    fresh = gc.get_freeze_count() == 0
    if fresh:
        gc.freeze()
    try:
        # the MLP family alone: every mode runs on it (the suite's time; GPT-2's rows are the
        # same code on a slower model)
        mod.main(["--quick", "--out", str(tmp_path), "--steps", "1", "--repeats", "1",
                  "--min-step-s", "0", "--family", "mlp"])
    finally:
        if fresh:
            gc.unfreeze()
    data = _load(tmp_path / "cost_quick.json")
    assert os.path.exists(tmp_path / "cost_quick.png")
    for key in ("rows", "peers", "memory_method", "env"):
        assert key in data
    modes = {r["mode"] for r in data["rows"]}
    assert {"none", "analytic", "auto", "hessian", "auto+measure"} <= modes
    for r in data["rows"]:
        for k in ("precondition_s", "step_s", "ratio_steps"):
            assert _finite(r[k]) and r[k] > 0, (r["model"], r["mode"], k)
        assert r["params"] > 0
    assert set(data["peers"]) == {"lsuv", "unit_scaling"}


@pytest.mark.slow
def test_train_suite_quick(tmp_path):
    """The training suite's smoke run: every (task, optimizer, method) cell has a finite best
    loss at a rate of its grid (at least 8 rates, 2x apart), a standard error over 3 seeds,
    and the claims and LR-movement sections are filled.  The LM task runs under AdamW only:
    its SGD cells are the MLP's code path (each rate's copy settled at its first step), at
    10x the cost of the rest of the run."""
    mod = _study("train_suite")
    mod.main(["--quick", "--out", str(tmp_path), "--tasks", "mlp_w32_d1"])
    mod.main(["--quick", "--out", str(tmp_path), "--tasks", "gpt2", "--optimizers", "adamw",
              "--tag", "quick_lm"])
    data = _load(tmp_path / "train_suite_quick.json")
    lm = _load(tmp_path / "train_suite_quick_lm.json")
    assert os.path.exists(tmp_path / "train_suite_quick.png")
    assert os.path.exists(tmp_path / "train_suite_quick.md")
    assert set(data["results"]) == {"mlp_w32_d1"} and set(lm["results"]) == {"gpt2"}
    for task, per in [*data["results"].items(), *lm["results"].items()]:
        assert set(per) == ({"sgd", "adamw"} if task != "gpt2" else {"adamw"})
        for opt, cells in per.items():
            assert set(cells) == set(data["methods"]), (task, opt)
            for m, r in cells.items():
                grid = r["lr_log2"]
                assert len(grid) >= 8 and grid == list(range(grid[0], grid[0] + len(grid)))
                assert r["best_lr_log2"] in grid
                assert _finite(r["best"]) and 0 < r["best"] < 10, (task, opt, m)
                assert len(r["losses"][r["metric"]][0]) == 3
    assert lm["tasks"]["gpt2"]["metric"] == "heldout"
    assert "gpt2_adamw" in lm["claims"] and "default_vs_framework_sgd" in data["claims"]
    assert "mlp_width" in data["lr_movement"]
    # --merge-seeds: a run joined with a copy of itself holding other seeds' losses (the
    # first seed's losses doubled) keeps the grid, has 6 values per rate, and chooses again
    # over all of them: the median moves to the copy's, and so may the chosen rate
    import numpy as np
    other = json.loads(json.dumps(data))
    cell = other["results"]["mlp_w32_d1"]["adamw"]["pfx"]
    for k in cell["losses"]:
        cell["losses"][k] = [[2 * v[0]] * len(v) for v in cell["losses"][k]]
    other["seeds"] = [3, 4, 5]
    with open(tmp_path / "other.json", "w") as f:
        json.dump(other, f)
    joined = mod.merge_seeds([str(tmp_path / "train_suite_quick.json"),
                              str(tmp_path / "other.json")], str(tmp_path / "joined"))
    j = joined["results"]["mlp_w32_d1"]["adamw"]["pfx"]
    r = data["results"]["mlp_w32_d1"]["adamw"]["pfx"]
    assert j["lr_log2"] == r["lr_log2"] and joined["seeds"] == [0, 1, 2, 3, 4, 5]
    key = r["select"]
    sel = np.median(np.concatenate([np.asarray(cell["losses"][key], float),
                                    np.asarray(r["losses"][key], float)], axis=1), axis=1)
    assert j["best_lr_log2"] == r["lr_log2"][int(np.argmin(sel))]
    assert len(j["losses"][key][0]) == 6


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_train_suite_batched_update_matches_torch_optim(opt):
    """The batched trainer's SGD (momentum) and AdamW updates, with a per-parameter learning
    rate multiplier, reproduce torch.optim on each copy."""
    import copy
    import torch
    mod = _study("train_suite")
    torch.manual_seed(0)
    models = [mod.mlp(5, 7, 2, 3) for _ in range(2)]
    lrs = [0.05, 0.01] if opt == "sgd" else [3e-3, 1e-3]
    mult = {"0.weight": 2.0, "4.bias": 0.5}
    hp = mod.Hyper(opt)
    tr = mod.VTrainer(models, lrs, hp, mult, "cpu")
    refs = [copy.deepcopy(m) for m in models]
    opts = [mod._optimizer(m, lr, hp, mult) for m, lr in zip(refs, lrs)]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(2, 8, 5, generator=g)
        y = torch.randint(0, 3, (2, 8), generator=g)
        tr.step(x, y)
        for i, (m, o) in enumerate(zip(refs, opts)):
            loss = torch.nn.functional.cross_entropy(m(x[i]), y[i])
            o.zero_grad()
            loss.backward()
            o.step()
    for i, m in enumerate(refs):
        for k, p in m.named_parameters():
            assert torch.allclose(tr.p[k][i], p.detach(), rtol=1e-5, atol=1e-6), (opt, i, k)


def test_paired_rules_use_precondfx_draws_at_their_own_scale():
    """``*_pair`` baselines: each weight is precondfx's draw for the seed times the rule's std
    over the planned one (correlation 1 with precondfx's weight, the rule's exact second
    moment), biases 0, output std 1; 'geometric_pair' computes what precondfx's result does."""
    import torch
    mod = _study("train_suite")
    common = _study("common")
    torch.manual_seed(0)
    calib = torch.rand(64, 64) * 16
    task = mod.Task("t", lambda readout=torch.nn.Linear: mod.mlp(64, 32, 1, 10, readout),
                    {}, 32)
    pfx, _ = mod.build(task, "pfx", 3, calib, "sgd")
    for method, rule in mod.PAIRED_RULES.items():
        model, mult = mod.build(task, method, 3, calib, "sgd")
        assert mult == {}
        assert float(model(calib).std(correction=0)) == pytest.approx(1.0, rel=1e-4)
        lin = [(n, m) for n, m in model.inner.named_modules()
               if isinstance(m, torch.nn.Linear)]
        assert len(lin) == 2
        for name, m in lin:
            w, ref = m.weight.detach().double(), pfx.get_parameter(f"{name}.weight").double()
            corr = float((w * ref).sum() / (w.norm() * ref.norm()))
            assert corr == pytest.approx(1.0, abs=1e-6), (method, name)
            n_in, n_out, k2 = common._fans(m)
            want = common.rule_std(rule, n_in, n_out, k2)
            assert float(w.pow(2).mean().sqrt()) == pytest.approx(want, rel=1e-5), (method, name)
            assert float(m.bias.abs().max()) == 0.0
        if rule == "geometric":
            torch.testing.assert_close(model(calib), pfx(calib), rtol=1e-4, atol=1e-4)


def test_eq_scale_paired_summary_from_known_cells():
    """bench/eq_scale_paired.py: each method's test losses at its validation-chosen rate, the
    paired per-seed differences, and the mean over nets of the loss over the best method."""
    import numpy as np
    mod = _study("eq_scale_paired")

    def cell(test_by_rate, chosen):                 # validation lowest at index ``chosen``
        val = [[1.0] * 4 for _ in test_by_rate]
        val[chosen] = [0.5] * 4
        return {"losses": {"val": val, "test": test_by_rate}, "select": "val",
                "metric": "test", "lr_log2": [-5, -4], "best_lr_log2": [-5, -4][chosen],
                "se": 0.01}

    base = {"pfx": [[9, 9, 9, 9], [0.2, 0.2, 0.2, 0.2]],      # chosen: 2nd rate
            "fan_in_pair": [[0.1, 0.1, 0.1, 0.1], [9, 9, 9, 9]],
            "fan_out_pair": [[0.3, 0.3, 0.3, 0.3], [9, 9, 9, 9]],
            "xavier_pair": [[9, 9, 9, 9], [0.4, 0.4, 0.4, 0.4]]}
    results = {"net_a": {"sgd": {m: cell(v, 0 if v[0][0] < 9 else 1) for m, v in base.items()}},
               "net_b": {"sgd": {m: cell([[0.1] * 4, [9] * 4], 0) for m in base}}}
    res = mod.analyse(results, n_boot=50, n_perm=0)     # the null: its own test below
    assert res["rows"]["net_a"]["fan_in_pair"]["pfx_minus"] == pytest.approx(0.1)
    assert res["rows"]["net_a"]["xavier_pair"]["pfx_minus"] == pytest.approx(-0.2)
    s = res["summary"]
    assert s["pfx"]["mean_over_best"] == pytest.approx((2.0 + 1.0) / 2)
    assert s["xavier_pair"]["mean_over_best"] == pytest.approx((4.0 + 1.0) / 2)
    assert s["fan_in_pair"]["best_on"] == ["net_a", "net_b"]
    assert s["xavier_pair"]["worst_on"] == ["net_a", "net_b"] and s["pfx_never_worst"] is False
    assert s["pfx_at_least_best_on_average"] is False
    assert np.isclose(s["pfx_at_or_below_best_other_share"], 0.0)


def test_eq_scale_paired_null_matches_exchangeable_methods():
    """bench/eq_scale_paired.py's null: with four methods drawn alike on 7 nets, precondfx is
    never the worst in about (3/4)^7 of the within-seed permutations and at or below the best
    other's mean in about 1/4 of them; a column 20% lower on every seed passes nearly always."""
    import numpy as np
    mod = _study("eq_scale_paired")
    rng = np.random.default_rng(3)
    per = {f"net{k}": {m: rng.lognormal(np.log(0.1), 0.3, 24) for m in mod.COMPARED}
           for k in range(7)}
    null = mod.null_pass_share(per, list(per), n_perm=400, gains=(0.0, 0.1, 0.2))
    assert null["never_worst"] == pytest.approx(0.75 ** 7, abs=0.05)      # 3 SE of 400 draws
    assert null["at_least_best_on_average"] == pytest.approx(0.25, abs=0.07)
    assert null["power"]["0.00"] == null["both"] < null["power"]["0.10"] < null["power"]["0.20"]
    assert null["power"]["0.20"] > 0.95 and 0.0 < null["gain_for_80pct"] <= 0.2
    assert mod.null_pass_share(per, list(per), n_perm=0) is None


def test_train_suite_half_octave_grid():
    """``--lr-step 0.5``: the grid's rates are sqrt(2) apart around the optimizer's centre,
    and widening at an edge continues at that spacing; step 1 keeps the integer grid."""
    mod = _study("train_suite")
    assert [mod._grid_point(k, 1.0) for k in (-6, -5)] == [-6, -5]
    assert all(isinstance(mod._grid_point(k, 1.0), int) for k in range(-3, 3))
    assert [mod._grid_point(k, 0.5) for k in (-13, -12, -11)] == [-6.5, -6, -5.5]


def precondfx_report_with_fx_refused():
    """The report of a model whose forward enters an autocast region (fx refuses it)."""
    import torch
    import precondfx

    class Region(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                h = torch.relu(self.a(x.float()))
            return self.b(h)

    return precondfx.precondition(Region(), torch.randn(16, 8))[1]


def test_zoo_sweep_rows_measure_what_they_claim(tmp_path):
    """bench/zoo_sweep.py's per-model checks on two of the tests' zoo models (torchvision and
    timm do not import here): on target, the user's model untouched, the user's class, finite
    gradients; and a planted defect is flagged by the summary."""
    mod = _study("zoo_sweep")
    rows = [mod.check(name, "cpu") for name in ("zoo:mlp", "zoo:two_inputs_dict_out")]
    for row in rows:
        assert row["std_ratio"] == pytest.approx(1.0, abs=1e-3)
        assert row["user_model_max_change"] == 0.0
        assert row["same_class"] is True and row["nonfinite_grads"] == []
        assert row["params_with_grad"] > 0
        assert mod.flags(row) == []
    assert rows[0]["params_with_grad"] == rows[0]["n_params"] == 6   # the MLP: 3 layers
    assert isinstance(rows[0]["capture_notes"], list)
    refused = mod.report_row(precondfx_report_with_fx_refused())
    assert refused["capture"] != "fx"
    assert any("autocast" in n for n in refused["capture_notes"])   # why fx was passed over
    bad = dict(rows[0], std_ratio=1.5, unknown_targets={"aten.foo": 2})
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (rows[1], bad)) + "\n")
    text = mod.summarize(str(path))
    assert text.startswith("2 models; every check held on 1;")
    assert "output std 1.500 x target" in text and "aten.foo x2" in text
