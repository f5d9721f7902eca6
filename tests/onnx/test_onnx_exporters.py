"""The ONNX front end on files from torch.onnx.export, both exporters (dynamo=True, the default
since torch 2.9, and the TorchScript exporter dynamo=False), for zoo models in eval mode with a
dynamic batch dim.

Checked independently of precondfx: the ONNX checker, onnxruntime runs of the original and the
rewritten files at a batch size other than the export's, output std on fresh random inputs, and
the PyTorch path's plan for the same model (``precondfx.analyze``).
"""
from __future__ import annotations

import contextlib
import io
import logging
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import precondfx
from tests import zoo
from precondfx.onnx import inspect_onnx, precondition_onnx

MODELS = ["mlp", "strided_cnn", "maxpool_cnn", "resnet_bottleneck", "vgg_bn",
          "two_inputs_dict_out"]
EXPORTERS = ["dynamo", "legacy"]


def _export(name: str, exporter: str, path: str) -> None:
    model, sample = zoo.build(name)
    model.eval()
    args = sample if isinstance(sample, tuple) else (sample,)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            batch = torch.export.Dim("batch", min=1, max=1024)
            torch.onnx.export(model, args, path, dynamo=True,
                              dynamic_shapes=tuple({0: batch} for _ in args))
        else:
            names = [f"in{i}" for i in range(len(args))]
            torch.onnx.export(model, args, path, dynamo=False, input_names=names,
                              dynamic_axes={n: {0: "batch"} for n in names})


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    cache: dict[tuple[str, str], str] = {}

    def get(name: str, exporter: str) -> str:
        key = (name, exporter)
        if key not in cache:
            path = str(root / f"{name}_{exporter}.onnx")
            _export(name, exporter, path)
            cache[key] = path
        return cache[key]
    return get


def _feeds(path: str, batch: int, seed: int) -> dict[str, np.ndarray]:
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([batch if not isinstance(d, int) else d
                                         for d in i.shape]).astype(np.float32)
            for i in s.get_inputs()}


def _run(path: str, feeds: dict) -> list[np.ndarray]:
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", MODELS)
def test_rewritten_export(exported, tmp_path, name, exporter):
    src = exported(name, exporter)
    out = str(tmp_path / "out.onnx")
    rep = precondition_onnx(src, out, feeds=_feeds(src, 256, seed=1), seed=0,
                            target_std=0.05)
    onnx.checker.check_model(out, full_check=True)
    m = onnx.load(out, load_external_data=False)
    assert "MaxPool" not in [n.op_type for n in m.graph.node]
    src_m = onnx.load(src, load_external_data=False)
    assert [o.name for o in m.graph.output] == [o.name for o in src_m.graph.output]
    assert [d.dim_param for d in m.graph.input[0].type.tensor_type.shape.dim][:1] == ["batch"]
    # batch 7 differs from the export's; 512 fresh random samples for the std
    ys = _run(out, _feeds(out, 512, seed=2))
    assert ys[0].shape[0] == 512
    assert abs(float(ys[0].astype(np.float64).std()) / 0.05 - 1) < 0.05, ys[0].std()
    assert _run(out, _feeds(out, 7, seed=3))[0].shape[0] == 7
    assert rep.output_std_after == pytest.approx(0.05, rel=1e-6)
    assert rep.skipped == []


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", ["maxpool_cnn", "resnet_bottleneck", "vgg_bn",
                                  "two_inputs_dict_out"])
def test_no_reinit_keeps_the_function(exported, tmp_path, name, exporter):
    """--no-reinit, maxpool keep, residual none, balance none: outputs equal the original's
    times the output scale; with analytic alphas the weights are divided by alpha, so too."""
    src = exported(name, exporter)
    calib = _feeds(src, 16, seed=4)
    test = _feeds(src, 5, seed=5)
    y0 = _run(src, test)
    for balance in ("none", "analytic"):
        out = str(tmp_path / f"{balance}.onnx")
        rep = precondition_onnx(src, out, feeds=calib, reinit_weights=False, maxpool="keep",
                                residual="none", balance=balance)
        y1 = _run(out, test)
        ref = y0[0] * rep.output_scale
        assert np.abs(y1[0] - ref).max() <= 1e-5 * np.abs(ref).max(), balance
        for a, b in zip(y0[1:], y1[1:]):          # other outputs are not scaled
            assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max()


def _by_module(plan) -> dict:
    out = {}
    for lay in plan.layers:
        pi = plan.inits.get(lay.weight)
        out[lay.module] = (lay.kind, lay.alpha, pi.rule if pi else None,
                           round(pi.std, 12) if pi and pi.std else None)
    return out


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", MODELS)
def test_same_plan_as_pytorch(exported, name, exporter):
    model, sample = zoo.build(name)
    model.eval()
    pt = precondfx.analyze(model, sample, balance="analytic").plan
    ox = inspect_onnx(exported(name, exporter), balance="analytic").plan
    torch_layers, onnx_layers = _by_module(pt), _by_module(ox)
    assert len(onnx_layers) == len(ox.layers)          # every ONNX layer has a module path
    if name == "vgg_bn":
        # the exporters fold BatchNorm into the convs: the ONNX graph has no BN, so its
        # max-pools follow conv -> relu and are folded, where PyTorch must replace them
        # (conv -> BN -> relu -> pool), which adds three pool layers on the PyTorch side
        assert [p.action for p in pt.pools] == ["conv"] * 3
        assert [p.action for p in ox.pools] == ["fold"] * 3
        torch_layers = {k: v for k, v in torch_layers.items() if k in onnx_layers}
        assert sorted(torch_layers) == sorted(onnx_layers)
    else:
        assert [(p.node and p.action, p.new_param) for p in pt.pools] == \
            [(p.node and p.action, p.new_param) for p in ox.pools]
    assert torch_layers == onnx_layers
    assert [r.s for r in pt.residuals] == [r.s for r in ox.residuals]
    assert [len(r.branch_layers) for r in pt.residuals] == \
        [len(r.branch_layers) for r in ox.residuals]
    if exporter == "dynamo" and name != "vgg_bn":
        # parameter names are the torch names: the whole init table agrees
        assert {k: (v.rule, v.std) for k, v in pt.inits.items()} == \
            {k: (v.rule, v.std) for k, v in ox.inits.items()}
        assert pt.alphas() == ox.alphas()


@pytest.mark.slow
@pytest.mark.skipif(not zoo.HAS_TRANSFORMERS, reason="needs transformers")
def test_bert_embeddings_at_constant_ids_same_plan_as_pytorch(tmp_path):
    """BERT's position ids and default token-type ids are buffers: the exported file looks the
    embeddings up at constant ids (Gather of an initializer), which the PyTorch path sees as
    nn.Embedding calls.  Both paths plan the three embeddings and every layer alike (analytic
    constants: 'auto' measures on PyTorch only)."""
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    # 512 positions (BERT's default): the exporter's optimizer folds a lookup of a small table
    # at constant ids into a constant, leaving no parameter in the file (README)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=3, attn_implementation="eager")).eval()
    sample = {"input_ids": torch.randint(0, 100, (4, 16)),
              "attention_mask": torch.ones(4, 16, dtype=torch.long)}
    path = str(tmp_path / "bert.onnx")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (), path, kwargs=sample, dynamo=True)
    pt = precondfx.analyze(model, sample, balance="analytic").plan
    ox = inspect_onnx(path, balance="analytic").plan
    emb = {f"bert.embeddings.{k}_embeddings" for k in ("word", "position", "token_type")}

    def layers(plan):    # the exporter writes Linear as MatMul of a transposed copy
        return {m: ("linear" if k == "matmul" else k, *rest)
                for m, (k, *rest) in _by_module(plan).items()}
    assert emb <= set(layers(ox))
    assert layers(pt) == layers(ox)
    assert len(pt.layers) == len(ox.layers) == 17
    for name in ("position", "token_type"):
        w = f"bert.embeddings.{name}_embeddings.weight"
        assert ox.inits[w].rule == pt.inits[w].rule == "geometric"
        assert ox.inits[w].std == pt.inits[w].std
    assert [r.s for r in pt.residuals] == [r.s for r in ox.residuals]
