"""Tests for the test zoo (tests/zoo.py): every entry builds, runs forward/backward, is seeded."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch import nn

from tests import zoo

ALL = zoo.names()


def _forward(model: nn.Module, sample: Any) -> torch.Tensor:
    # Fixed RNG for the forward so that dropout is reproducible between builds.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        return zoo.main_tensor(zoo.call(model, sample))


def _tensors(sample: Any) -> list[torch.Tensor]:
    if isinstance(sample, torch.Tensor):
        return [sample]
    if isinstance(sample, dict):
        return [v for v in sample.values() if isinstance(v, torch.Tensor)]
    return [v for v in sample if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("name", ALL)
def test_entry_forward_backward_deterministic(name: str) -> None:
    rng_before = torch.random.get_rng_state()
    model, sample = zoo.build(name, seed=0)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "builder changed the global RNG"
    assert isinstance(model, nn.Module)
    assert isinstance(sample, (torch.Tensor, tuple, dict))

    # same seed -> identical parameters/buffers and sample (compared before the
    # forward pass, which updates BatchNorm running statistics) and outputs
    model2, sample2 = zoo.build(name, seed=0)
    for a, b in zip(_tensors(sample), _tensors(sample2), strict=True):
        assert torch.equal(a, b)
    sd1, sd2 = model.state_dict(), model2.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k

    out = _forward(model, sample)
    assert isinstance(out, torch.Tensor)
    assert torch.isfinite(out).all()
    out.float().sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads, "no parameter received a gradient"
    assert all(torch.isfinite(g).all() for g in grads)
    out2 = _forward(model2, sample2)
    assert torch.equal(out.detach(), out2.detach())

    # different seed -> different parameters
    model3, _ = zoo.build(name, seed=1)
    p1 = dict(model.named_parameters())
    p3 = dict(model3.named_parameters())
    assert p1.keys() == p3.keys()
    assert any(not torch.equal(p1[k].detach(), p3[k].detach()) for k in p1)


@pytest.mark.parametrize("name", ALL)
def test_entry_has_description(name: str) -> None:
    desc = zoo.describe(name)
    assert desc and desc != name
    assert callable(zoo.ZOO[name])
    assert isinstance(zoo.TAGS[name], frozenset)


def test_names_and_transformers_registration() -> None:
    has_tf = importlib.util.find_spec("transformers") is not None
    hf = [n for n in zoo.names() if n.startswith("hf_")]
    assert bool(hf) == (has_tf and zoo.HAS_TRANSFORMERS)
    no_tf = zoo.names(include_transformers=False)
    assert not any(n.startswith("hf_") for n in no_tf)
    assert set(no_tf) | set(hf) == set(zoo.names())
    with pytest.raises(KeyError):
        zoo.build("no_such_model")
    if zoo.HAS_TRANSFORMERS:
        _, sample = zoo.build("hf_gpt2")
        assert sample["use_cache"] is False


def test_resnet50_param_count() -> None:
    with torch.device("meta"):
        model, sample = zoo.resnet50(norm=True, width=64, layers=(3, 4, 6, 3), num_classes=1000)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 25_557_032) <= 0.01 * 25_557_032
    assert sample.shape == (2, 3, 224, 224)
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert n_bn == 53  # 1 stem + 16 blocks * 3 + 4 projection shortcuts
    with torch.device("meta"):
        plain, _ = zoo.resnet50(norm=False)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in plain.modules())
    assert all(m.bias is not None for m in plain.modules() if isinstance(m, nn.Conv2d))


def test_structural_properties() -> None:
    m, x = zoo.build("mlp")
    shapes = [tuple(l.weight.shape) for l in m.modules() if isinstance(l, nn.Linear)]
    assert shapes == [(384, 100), (64, 384), (10, 64)] and x.shape == (32, 100)

    m, _ = zoo.build("maxpool_cnn")
    pools = [p for p in m.modules() if isinstance(p, nn.MaxPool2d)]
    assert len(pools) == 3

    m, _ = zoo.build("lstm_lm")
    assert m.decoder.weight is m.embedding.weight

    m, _ = zoo.build("vit_mha")
    assert any(isinstance(l, nn.MultiheadAttention) for l in m.modules())

    m, _ = zoo.build("plain_deep_cnn")
    assert sum(isinstance(l, nn.Conv2d) for l in m.modules()) == 30

    m, _ = zoo.build("alexnet_strided", width_div=1)
    convs = [l for l in m.modules() if isinstance(l, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [64, 192, 384, 256, 256]
    assert [c.stride[0] for c in convs] == [1, 2, 2, 1, 1]
    assert all(c.padding_mode == "circular" for c in convs)
    assert [l.out_features for l in m.modules() if isinstance(l, nn.Linear)] == [4096, 4096, 10]

    m, (img, feat) = zoo.build("two_inputs_dict_out")
    out = m(img, feat)
    assert set(out) == {"logits", "aux"}

    m, s = zoo.build("kwargs_model")
    assert set(s) == {"x", "mask"}


def test_data_dependent_branches() -> None:
    m, x = zoo.build("data_dependent")
    assert x.mean() > 0
    assert torch.equal(m(x), m.path_a(x))
    m, x = zoo.build("data_dependent", shift=-0.5)
    assert x.mean() <= 0
    assert torch.equal(m(x), m.path_b(x))
