"""Exports of the result (issue 21, item 2): ``torch.onnx.export`` with both exporters
(dynamo=True and the TorchScript exporter dynamo=False), ``torch.jit.trace`` and
``torch.export.export`` of a preconditioned model give the result's function.

Checked independently of precondfx: onnxruntime (or the traced/exported program) against the
result run eagerly, on an input other than the one exported with, within 1e-4.  Models: a
small CNN on the fx path, the same CNN on the eager (hooks) back end, and tiny transformers
BERT and GPT-2 built from configs (hooks, constants folded into checkpoints)."""
from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
import warnings

import pytest
import torch
from torch import nn

import precondfx
from tests.user_models import PoolCNN

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

EXPORTERS = ["onnx_dynamo", "onnx_torchscript", "jit_trace", "torch_export"]


class Logits(nn.Module):
    """A transformers model called with ids and an all-ones mask, returning its logits."""

    def __init__(self, model: nn.Module, **fwd) -> None:
        super().__init__()
        self.model, self.fwd = model, fwd

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask, **self.fwd).logits


def _case(name: str) -> tuple[nn.Module, tuple, tuple, str]:
    """(the result to export, inputs to export with, other inputs, capture method).

    The result of each model is preconditioned once per session (``_preconditioned``: the
    same seeds every time, so the same result) and each test exports its own deep copy of it,
    so an exporter that touched the module could not leak into the next test."""
    model, args, other, capture = _preconditioned(name)
    return copy.deepcopy(model), args, other, capture


@functools.lru_cache(maxsize=None)
def _preconditioned(name: str) -> tuple[nn.Module, tuple, tuple, str]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    if name in ("cnn_fx", "cnn_eager"):
        x = torch.randn(4, 3, 16, 16)
        capture = "fx" if name == "cnn_fx" else "eager"
        pm, rep = precondfx.precondition(PoolCNN(), x, maxpool="conv", capture=capture,
                                         input_scale="auto")
        return pm, (x,), (torch.randn(4, 3, 16, 16, generator=g),), rep.capture
    pytest.importorskip("transformers")
    from tests import hf_tiny
    model, batch = hf_tiny.build(name, dropout=False)
    fwd = hf_tiny.FORWARD[name]
    ids = batch["input_ids"]
    pm, rep = precondfx.precondition(model, {"input_ids": ids}, **fwd)
    other = torch.randint(0, hf_tiny.VOCAB, ids.shape, generator=g)
    return Logits(pm, **fwd), (ids, torch.ones_like(ids)), (other, torch.ones_like(other)), \
        rep.capture


def _exported(model: nn.Module, args: tuple, other: tuple, exporter: str, path: str) -> torch.Tensor:
    """The exported program's output on ``other``."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter.startswith("onnx"):
            names = [f"in{i}" for i in range(len(args))]
            torch.onnx.export(model, args, path, dynamo=exporter == "onnx_dynamo",
                              input_names=names)
            s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
            out = s.run(None, {n: a.numpy() for n, a in zip(names, other)})[0]
            return torch.from_numpy(out)
        if exporter == "jit_trace":
            return torch.jit.trace(model, args, check_trace=False)(*other)
        return torch.export.export(model, args).module()(*other)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", ["cnn_fx", "cnn_eager", "bert", "gpt2"])
def test_export_gives_the_results_function(name: str, exporter: str, tmp_path) -> None:
    model, args, other, capture = _case(name)
    if name.startswith("cnn"):
        assert capture == name[4:]
    model.eval()
    with torch.no_grad():
        want = model(*other)
    got = _exported(model, args, other, exporter, str(tmp_path / "m.onnx"))
    assert got.shape == want.shape
    err = float((got - want).abs().max())
    assert err < 1e-4 * max(1.0, float(want.abs().max())), err
    # the export is of the preconditioned function, not the user's: the output scale is in it
    assert float(want.std()) > 0.3


def test_state_dict_of_live_variables_is_not_folded() -> None:
    """``state_dict(keep_vars=True)`` (what tracers take) holds the parameters themselves;
    a checkpoint (``state_dict()``) holds them folded, and loads back exactly."""
    pytest.importorskip("transformers")
    from tests import hf_tiny
    model, batch = hf_tiny.build("bert", dropout=False)
    pm, _ = precondfx.precondition(model, {"input_ids": batch["input_ids"]})
    params = dict(pm.named_parameters())
    live = pm.state_dict(keep_vars=True)
    assert all(live[n] is p for n, p in params.items())
    ckpt = pm.state_dict()
    folded = [n for n, p in params.items() if not torch.equal(ckpt[n], p.detach())]
    assert folded    # the output/embedding scales are folded into some weights
    before = {n: p.detach().clone() for n, p in params.items()}
    pm.load_state_dict(ckpt)
    assert max(float((p - before[n]).abs().max()) for n, p in pm.named_parameters()) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["onnx_dynamo", "onnx_torchscript"])
@pytest.mark.parametrize("name", ["cnn_fx", "cnn_eager", "bert"])
def test_onnx_export_with_a_dynamic_batch(name: str, exporter: str, tmp_path) -> None:
    """Exported with a dynamic batch dimension, run at another batch size (5, exported at 4).
    The TorchScript exporter needs ``output_names`` with ``dynamic_axes`` on any fx
    GraphModule (torch reads ``model.graph`` as a TorchScript graph otherwise)."""
    model, args, other, _ = _case(name)
    model.eval()
    other = tuple(torch.cat([o, o[:1]]) for o in other)
    with torch.no_grad():
        want = model(*other)
    names = [f"in{i}" for i in range(len(args))]
    path = str(tmp_path / "m.onnx")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter == "onnx_dynamo":
            batch = torch.export.Dim("batch", min=1, max=64)
            torch.onnx.export(model, args, path, dynamo=True, input_names=names,
                              dynamic_shapes=tuple({0: batch} for _ in args))
        else:
            torch.onnx.export(model, args, path, dynamo=False, input_names=names,
                              output_names=["out"], dynamic_axes={n: {0: "b"} for n in names})
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = torch.from_numpy(s.run(None, {n: a.numpy() for n, a in zip(names, other)})[0])
    assert got.shape == want.shape and got.shape[0] == 5
    assert float((got - want).abs().max()) < 1e-4 * max(1.0, float(want.abs().max()))
