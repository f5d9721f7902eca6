"""Free token and position parameters on the ONNX path (precondfx.core.tokens): the exported
class token (an Expand by a shape computed from the input, then a Concat) and the position
embedding (an Add) are drawn at the rms of the patch convolution's output, read here by
onnxruntime from the written file, and the plan's rules agree with the PyTorch path's."""
from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
from onnx import numpy_helper  # noqa: E402

import precondfx  # noqa: E402
from precondfx.onnx.pipeline import precondition_onnx  # noqa: E402
from tests.pytorch.test_tokens import TinyViT  # noqa: E402


def _rms(a: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.asarray(a, np.float64) ** 2)))


@pytest.mark.parametrize("dynamo", [False, True])
def test_onnx_tokens_drawn_at_the_patch_conv_rms(tmp_path, dynamo):
    torch.manual_seed(0)
    m = TinyViT().eval()
    x = torch.randn(8, 3, 16, 16)
    src, out = str(tmp_path / "vit.onnx"), str(tmp_path / "out.onnx")
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (x,), src, dynamo=dynamo, input_names=["x"])
    rep = precondition_onnx(src, out, feeds={"x": x.numpy()}, seed=0)
    model = onnx.load(out)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    # the patch convolution's output, read by onnxruntime from the written file
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    model.graph.output.append(onnx.helper.make_tensor_value_info(conv.output[0],
                                                                 onnx.TensorProto.FLOAT, None))
    import onnxruntime as ort
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = _rms(sess.run([conv.output[0]], {"x": x.numpy()})[0])
    assert want > 0.1
    tok = {k: v for k, v in inits.items() if v.ndim == 3}          # cls (1,1,D), pos (1,17,D)
    assert sorted(v.shape[1] for v in tok.values()) == [1, 17]
    for k, v in tok.items():
        assert _rms(v) == pytest.approx(want, rel=1e-4), k
        assert rep.plan.inits[k].rule == "match"
    # the same rule as the PyTorch path's plan
    ref = precondfx.analyze(m, x).plan.inits
    assert ref["cls"].rule == ref["pos"].rule == "match"
