"""Each back end driven directly with a hand-written plan (no ``precondition``): the fx
applier on a GraphModule, the eager applier on the user's module (hooks, then rollback), the
ONNX applier on an onnx-ir model.  The expected outputs are computed here from the original
weights with plain torch/numpy ops: ``out_scale * W2 (alpha * relu(W1 (in_scale * x) + b1)) + ...``.
"""
import copy

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import torch
import torch.fx as fx
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from precondfx.apply.eager_apply import EagerApplier
from precondfx.apply.fx_apply import FxApplier
from precondfx.graph import Graph, Node
from precondfx.plan import Plan, PoolChange, Scale

ALPHA, IN_SCALE, OUT_SCALE = 0.5, 2.0, 3.0


def _mlp():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), torch.randn(5, 4)


def _expected(m, x):
    w1, b1, w2, b2 = (t.detach() for t in (m[0].weight, m[0].bias, m[2].weight, m[2].bias))
    h = torch.relu((IN_SCALE * x) @ w1.T + b1)
    return OUT_SCALE * ((ALPHA * h) @ w2.T + b2)


def test_fx_applier_scales_probe_and_fold():
    model, x = _mlp()
    gm = fx.symbolic_trace(copy.deepcopy(model))
    ShapeProp(gm).propagate(x)
    ap = FxApplier(gm)
    buf = ap.scale(Scale("alpha", "_2", "input", 0, ALPHA, "test"))
    assert ap.input_scale(IN_SCALE) and buf in dict(gm.named_buffers())
    out_buf = ap.output_scale([])
    ap.finish()
    gm.get_buffer(out_buf).fill_(OUT_SCALE)
    torch.testing.assert_close(gm(x), _expected(model, x), rtol=1e-6, atol=1e-7)
    got = ap.probe(lambda m: m(x), ["_1"])        # the relu output, input scale included
    torch.testing.assert_close(got["_1"], torch.relu(model[0](IN_SCALE * x)))
    assert ap.scale(Scale("alpha", "nope", "input", 0, 2.0, "")) is None and ap.skipped

    conv = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    xi = torch.randn(2, 3, 8, 8)
    gm = fx.symbolic_trace(copy.deepcopy(conv))
    ap = FxApplier(gm)
    ap.pools(Plan({}, pools=[PoolChange("_2", "fold", "", into="_0",
                                        geometry={"conv_stride": [2, 2]})]))
    ap.finish()
    assert not any(isinstance(m, nn.MaxPool2d) for m in gm.modules())
    ref = torch.relu(F.conv2d(xi, conv[0].weight, conv[0].bias, stride=2, padding=1))
    torch.testing.assert_close(gm(xi), ref)


def _graph_of_mlp():
    def node(name, kind, inputs, module, params=()):
        return Node(name, kind, kind, inputs, {r: f"{module}.{r}" for r in params}, {}, module,
                    status="weighted" if params else "preserves")
    return Graph([Node("x", "input", "x", status="structural"),
                  node("fc1", "linear", ["x"], "0", ("weight", "bias")),
                  node("act", "relu", ["fc1"], "1"),
                  node("fc2", "linear", ["act"], "2", ("weight", "bias"))], "eager")


def test_eager_applier_hooks_then_rollback():
    model, x = _mlp()
    y0 = model(x).detach()
    ap = EagerApplier(model, _graph_of_mlp())
    assert ap.scale(Scale("alpha", "fc2", "input", 0, ALPHA, "")) == "2.precondfx_in_scale"
    ap.input_scale(IN_SCALE)
    out_buf = ap.output_scale([])
    ap.finish()
    model.get_buffer(out_buf).fill_(OUT_SCALE)
    torch.testing.assert_close(model(x), _expected(model, x), rtol=1e-6, atol=1e-7)
    assert type(model) is nn.Sequential                   # the user's class is kept
    got = ap.probe(lambda m: m(x), ["fc1"])
    torch.testing.assert_close(got["fc1"], model[0](IN_SCALE * x))
    # a scale with no module to hook is reported, not guessed
    assert ap.scale(Scale("residual", "x", "output", 0, 2.0, "")) is None
    ap.rollback()
    assert torch.equal(model(x), y0)
    assert not [b for b, _ in model.named_buffers() if "precondfx" in b]
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _onnx_mlp(model):
    ws = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    inits = [numpy_helper.from_array(ws[k], k.replace("0.", "fc1.").replace("2.", "fc2."))
             for k in ("0.weight", "0.bias", "2.weight", "2.bias")]
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["h"], name="fc1", transB=1),
         helper.make_node("Relu", ["h"], ["r"], name="act"),
         helper.make_node("Gemm", ["r", "fc2.weight", "fc2.bias"], ["y"], name="fc2", transB=1)],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])], inits)
    return ir.serde.deserialize_model(helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 17)]))


def test_onnx_applier_scales_and_output_constant():
    from precondfx.onnx.apply import OnnxApplier
    from precondfx.onnx.normalize import normalize
    from precondfx.onnx.pipeline import capture_model
    model, x = _mlp()
    m = _onnx_mlp(model)
    cap = capture_model(m, normalize(m), {}, 5)
    assert [(n.name, n.kind) for n in cap.graph if n.status == "weighted"] == \
        [("fc1", "linear"), ("fc2", "linear")]
    ap = OnnxApplier(m, cap)
    assert ap.scale(Scale("alpha", "fc2", "input", 0, ALPHA, "")) is not None
    ap.input_scale(IN_SCALE)
    ap.output_scale([])
    ap.finish()
    ap.set_output_scale(OUT_SCALE)
    sess = ort.InferenceSession(ir.serde.serialize_model(m).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": x.numpy()})
    np.testing.assert_allclose(y, _expected(model, x).numpy(), rtol=1e-5, atol=1e-6)
    assert [o.name for o in sess.get_outputs()] == ["y"]          # public names kept
