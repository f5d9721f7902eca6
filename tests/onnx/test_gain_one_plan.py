"""One plan for a weight with a fixed gain, from PyTorch and from the same graph in ONNX: the
planned std of ``F.linear(x, self.weight * c)`` (an equalized-learning-rate layer) and of
``MatMul(x, Mul(Transpose(W), c))`` is the rule's std divided by ``|c|`` on both front ends
(``core.plan.divide_gains``), and the weight the layer applies has the rule's std in the
written file.  (``torch.onnx.export`` folds ``W * c`` into one initializer: the file then has
no gain, so the ONNX graph is written here as the forward reads.)"""
import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

import precondfx
from precondfx.onnx import precondition_onnx


class Scaled(torch.nn.Module):
    def __init__(self, c: float) -> None:
        super().__init__()
        self.c = c
        self.w1 = torch.nn.Parameter(torch.randn(32, 8))
        self.w2 = torch.nn.Parameter(torch.randn(4, 32))

    def forward(self, x):
        return F.linear(torch.relu(F.linear(x, self.w1 * self.c)), self.w2)


@pytest.mark.parametrize("c", [0.25, -3.0])
def test_torch_and_its_onnx_export_plan_one_std(tmp_path, c):
    torch.manual_seed(0)
    model = Scaled(c).eval()
    x = torch.randn(64, 8)
    _, rep = precondfx.precondition(model, x)
    src = str(tmp_path / "m.onnx")
    nodes = [helper.make_node("Transpose", ["w1"], ["w1t"], perm=[1, 0]),
             helper.make_node("Mul", ["w1t", "c"], ["w1s"]),
             helper.make_node("MatMul", ["x", "w1s"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Transpose", ["w2"], ["w2t"], perm=[1, 0]),
             helper.make_node("MatMul", ["r", "w2t"], ["y"])]
    inits = [numpy_helper.from_array(model.w1.detach().numpy(), "w1"),
             numpy_helper.from_array(model.w2.detach().numpy(), "w2"),
             numpy_helper.from_array(np.array(c, np.float32), "c")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     ["N", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
                          inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    out = str(tmp_path / "out.onnx")
    orep = precondition_onnx(src, out, feeds={"x": x.numpy()})
    rule = (2.0 / (8 * 32) ** 0.5) ** 0.5               # geometric, ReLU gain 2, 8 -> 32
    assert rep.plan.inits["w1"].std == pytest.approx(rule / abs(c))
    assert orep.plan.inits["w1"].std == pytest.approx(rule / abs(c))
    w1 = {t.name: numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}["w1"]
    assert float(np.sqrt(np.mean((c * w1.astype(np.float64)) ** 2))) == \
        pytest.approx(rule, rel=0.03)
