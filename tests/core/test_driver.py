"""The driver (precondfx.core.driver.run) on its own, and the plan/measured split it keeps.

Expected values: the stage order and undo order written out here; the constants the rewritten
model holds (its buffers), read directly; the planned values from the options (alpha sites at 1,
the output scale at 1 before calibration).
"""
import json

import numpy as np
import pytest
import torch
from torch import nn

import precondfx
from precondfx.core import driver
from precondfx.core.driver import Stage, State
from precondfx.core.measured import Measured
from precondfx.core.options import Options, resolve
from precondfx.core.plan import Layer, Plan, Scale
from precondfx.core.report import Report


def _state(**kw):
    return State(resolve(Options()), **kw)


def test_runner_order_contracts_timings_and_undo():
    seen, undone = [], []

    def step(name, fail=False):
        def fn(st):
            seen.append(name)
            st.undo.append(lambda: undone.append(name))
            if name == "b":
                st.report = Report("x", [], [])
            if fail:
                raise ValueError("boom")
        return fn
    stages = [Stage("a", step("a")), Stage("b", step("b"), ensures=("report",)),
              Stage("skip", step("skip"), when=lambda st: False), Stage("b", step("b2"))]
    st = driver.run(stages, _state())
    assert seen == ["a", "b", "b2"] and undone == []
    # two stages of one name add up; total is their sum
    assert set(st.report.stage_seconds) == {"a", "b", "total"}
    assert st.report.stage_seconds["total"] == pytest.approx(
        st.report.stage_seconds["a"] + st.report.stage_seconds["b"], rel=1e-9)

    seen.clear()
    with pytest.raises(ValueError, match="boom"):
        driver.run([Stage("a", step("a")), Stage("c", step("c", fail=True)),
                    Stage("d", step("d"))], _state())
    assert seen == ["a", "c"] and undone == ["c", "a"]          # newest first
    # a stage that does not deliver what it ensures is a bug, caught at once
    with pytest.raises(AssertionError, match="ensures"):
        driver.run([Stage("a", step("a"), ensures=("plan",))], _state())
    with pytest.raises(AssertionError, match="requires"):
        driver.run([Stage("a", step("a"), requires=("backend",))], _state())


def test_measured_replays_onto_a_copy():
    plan = Plan({}, layers=[Layer("fc", "linear", "fc", "fc.weight", None, 4, 4, 1, 1.0, "")],
                scales=[Scale("alpha", "fc", "input", 0, 1.0, "site"),
                        Scale("output", "output", "output", 0, 1.0, "planned")])
    m = Measured()
    m.add("balance", "alpha", "fc", 2.0, op="mul", note="measured balancing x2")
    m.add("balance", "scale", "alpha:fc:input:0", 2.0, op="mul")
    m.add("calibrate", "scale", "output:output:output:0", 0.25, reason="output std 4 -> 1")
    final = m.final(plan)
    assert plan.layers[0].alpha == 1.0 and plan.scales[1].value == 1.0   # intent untouched
    assert final.layers[0].alpha == 2.0
    assert final.layers[0].alpha_reason == "measured balancing x2"
    assert [s.value for s in final.scales] == [2.0, 0.25]
    assert final.scales[1].reason == "output std 4 -> 1"
    assert Measured.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_report_keeps_the_intent_and_what_was_measured():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 3))
    x = torch.randn(32, 6)
    res, rep = precondfx.precondition(model, x, balance="hessian", input_scale=0.5, lr=None)
    # planned: alpha sites at 1, the input scale as given, the output scale waiting at 1
    assert [(s.tag, s.value) for s in rep.planned.scales] == \
        [("alpha", 1.0)] * 3 + [("input", 0.5), ("output", 1.0)]
    # report.plan: the values the model holds
    bufs = {n: float(b) for n, b in res.named_buffers() if n.startswith("precondfx_")}
    alphas = [s.value for s in rep.plan.scales if s.tag == "alpha"]
    assert alphas == pytest.approx([bufs[f"precondfx_alpha__{i}"] for i in (0, 2, 4)],
                                   rel=1e-6)
    assert rep.plan.scale("output").value == pytest.approx(bufs["precondfx_output_scale"],
                                                           rel=1e-6)
    assert rep.plan.scale("output").value == rep.output_scale
    stages = {c.stage for c in rep.measured.changes}
    assert stages == {"calibrate", "balance"}
    # the weights' stds in report.plan are the planned ones divided by the balancing factors
    f = rep.conditioning["hessian"]["factors"]
    for w, c in f.items():
        assert rep.plan.inits[w].std == pytest.approx(rep.planned.inits[w].std / c, rel=1e-12)
    back = Report.from_dict(json.loads(rep.to_json()))
    assert back.planned == rep.planned and back.measured == rep.measured
    assert back.plan == rep.plan


def test_onnx_report_records_the_calibration(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    from precondfx.onnx import precondition_onnx
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((3, 8)).astype(np.float32), "w2")]
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w1"], ["h"], name="fc1", transB=1),
         helper.make_node("Relu", ["h"], ["r"], name="act"),
         helper.make_node("Gemm", ["r", "w2"], ["y"], name="fc2", transB=1)],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])], inits)
    src = str(tmp_path / "m.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    rep = precondition_onnx(src, str(tmp_path / "o.onnx"),
                            feeds={"x": rng.standard_normal((64, 4)).astype(np.float32)})
    (ch,) = rep.measured.changes
    assert (ch.stage, ch.key) == ("calibrate", "output:output:output:0")
    assert ch.value == rep.output_scale == pytest.approx(1.0 / rep.output_std_before)
    assert rep.planned.scale("output").value == 1.0
    assert rep.plan.scale("output").value == rep.output_scale
    assert list(rep.stage_seconds)[:3] == ["load", "normalize", "capture"]
