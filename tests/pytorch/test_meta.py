"""Planning on the meta device: same plan as on real data, width-independent where the rules
say so, a clear error where the forward needs values, and a plan that materializes exactly."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import precondfx
from tests import zoo
from precondfx.core.compare import differences, width_invariant
from precondfx.pytorch.distributed import restore_constants

needs_hf = pytest.mark.skipif(not zoo.HAS_TRANSFORMERS, reason="transformers not installed")


def _llama(hidden: int, *, meta: bool, layers: int = 2, vocab: int = 101) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(cfg)
    return LlamaForCausalLM(cfg)


def _ids(vocab: int = 101) -> dict:
    return {"input_ids": torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))}


def _geometric_ok(plan) -> int:
    """Every re-drawn weight follows Eq. 7, E[W^2] alpha^2 = 2 / (k^2 sqrt(n_in n_out)),
    recomputed here from the layer's fans; returns the number of weights checked."""
    checked = 0
    for la in plan.layers:
        pi = plan.inits[la.weight]
        if pi.rule != "geometric" or la.kind == "embedding":
            continue
        want = 2.0 / (la.k2 * math.sqrt(la.n_in * la.n_out))
        assert pi.std ** 2 * la.alpha ** 2 == pytest.approx(want, rel=1e-12), la.weight
        checked += 1
    return checked


@needs_hf
@pytest.mark.parametrize("method", ["export", "eager"])
def test_llama_meta_plan_equals_real_plan(method: str) -> None:
    kw = dict(balance="analytic", target_std=None, use_cache=False, capture=method)
    real = precondfx.analyze(_llama(32, meta=False), _ids(), **kw)
    fake = precondfx.analyze(_llama(32, meta=True), _ids(), **kw)
    assert fake.capture == method
    a, b = fake.plan.to_dict(), real.plan.to_dict()
    if method == "eager":
        # Under fake tensors transformers skips its value checks (is_tracing), so functional
        # nodes are numbered differently; module calls, inits and constants must agree.
        for d in (a, b):
            d["scales"] = [(x["tag"], x["where"], x["index"], x["value"]) for x in d["scales"]]
            d["residuals"] = [(x["branch_layers"], x["s"]) for x in d["residuals"]]
    assert a == b
    assert len(fake.plan.layers) == 2 * 7 + 2 and len(fake.plan.residuals) == 4


@needs_hf
def test_llama_plan_is_width_invariant_on_meta() -> None:
    kw = dict(balance="analytic", target_std=None, use_cache=False)
    small = precondfx.analyze(_llama(32, meta=True), _ids(), **kw)
    wide = precondfx.analyze(_llama(128, meta=True), _ids(), **kw)
    a = width_invariant(small.plan, small.nodes)
    b = width_invariant(wide.plan, wide.nodes)
    assert differences(a, b) == []
    assert [r.s for r in wide.plan.residuals] == [0.5] * 4          # 1/sqrt(4 joins)
    head = wide.plan.layers[-1]
    assert head.alpha == pytest.approx(0.5 / math.sqrt(1.25))       # s/sqrt(1+s^2), App. E.1
    assert _geometric_ok(small.plan) == _geometric_ok(wide.plan) == 15
    q = "model.layers.0.self_attn.q_proj.weight"                    # std ~ width^(-1/2)
    assert wide.plan.inits[q].std / small.plan.inits[q].std == pytest.approx(0.5, rel=1e-12)


class _ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:  # reads a value: cannot run without data
            return y
        return -y


@pytest.mark.parametrize("entry", ["analyze", "precondition"])
def test_meta_value_dependent_forward_names_the_operation(entry: str) -> None:
    with torch.device("meta"):
        m = _ValueBranch()
    fn = getattr(precondfx, entry)
    with pytest.raises(precondfx.PrecondError) as ei:
        fn(m, torch.randn(2, 4), balance="analytic")
    msg = str(ei.value)
    assert "meta device" in msg and "_local_scalar_dense" in msg and "Tensor.item()" in msg
    assert "test_meta.py" in msg and "if y.sum() > 0" in msg
    assert "Check that the sample" not in msg


@pytest.mark.parametrize("name", ["resnet_bottleneck", "mlp"])
def test_meta_plan_materializes_to_the_real_result(name: str) -> None:
    """Plan and apply on meta, then to_empty + reinit (+ the recorded constants) + output
    calibration: the same function as preconditioning the materialized model directly."""
    model, x = zoo.build(name)
    ref, rref = precondfx.precondition(model, x, balance="analytic", seed=3, target_std=0.05)
    with torch.device("meta"):
        mm, _ = zoo.build(name)
    pm, rep = precondfx.precondition(mm, x, balance="analytic", seed=3)
    assert all(p.device.type == "meta" for p in pm.parameters())
    assert rep.plan.to_dict()["layers"] == rref.plan.to_dict()["layers"]
    assert any(k == "output scale" and "meta device" in why for k, why in rep.skipped)
    pm = pm.to_empty(device="cpu")
    precondfx.reinit(pm, rep.plan, seed=3)      # also writes the recorded constants back
    stats = precondfx.pytorch.distributed.calibrate(pm, x, target_std=0.05)
    assert stats["scale"] == pytest.approx(rref.output_scale, rel=1e-6)
    assert stats["std_after"] == pytest.approx(0.05, rel=1e-6)   # float32 model
    with torch.no_grad():
        assert torch.allclose(pm(x), ref(x), rtol=1e-5, atol=1e-7)


def test_restore_constants_after_to_empty() -> None:
    model, x = zoo.build("resnet_bottleneck")
    pm, rep = precondfx.precondition(model, x, balance="analytic")
    want = {n: float(b) for n, b in pm.named_buffers() if "precondfx_" in n}
    assert want and set(want) == set(pm.precondfx_constants)
    pm.to_empty(device="cpu")
    with torch.no_grad():
        for n, b in pm.named_buffers():
            b.fill_(float("nan"))
    assert sorted(restore_constants(pm)) == sorted(want)
    assert {n: float(b) for n, b in pm.named_buffers() if "precondfx_" in n} == want


@needs_hf
def test_llama_meta_precondition_materializes_to_the_real_result() -> None:
    """The eager back end (your own class, hooks and buffers) on a meta Llama: after to_empty,
    the user's own init of what the plan keeps (norm weights, rotary frequencies: taken here
    from a real model), reinit and calibrate give the real run's model."""
    kw = dict(balance="analytic", seed=5, use_cache=False, target_std=0.05)
    real = _llama(32, meta=False)
    ref, rref = precondfx.precondition(real, _ids(), **kw)
    pm, rep = precondfx.precondition(_llama(32, meta=True), _ids(), **kw)
    assert type(pm).__name__ == "LlamaForCausalLM"
    assert pm.precondfx_constants["lm_head.precondfx_output_scale"] == 1.0
    pm.to_empty(device="cpu")
    params, bufs = dict(pm.named_parameters()), dict(pm.named_buffers())
    with torch.no_grad():       # what the user's own init does for what the plan keeps
        for n, t in real.named_parameters():
            if rep.plan.inits.get(n) is None or rep.plan.inits[n].rule == "keep":
                params[n].copy_(t)
        for n, t in real.named_buffers():   # rotary frequencies
            bufs[n].copy_(t)
    precondfx.reinit(pm, rep.plan, seed=5)
    stats = precondfx.pytorch.distributed.calibrate(pm, _ids(), target_std=0.05)
    assert stats["scale"] == pytest.approx(rref.output_scale, rel=1e-5)
    with torch.no_grad():
        a, b = ref(**_ids(), use_cache=False).logits, pm(**_ids(), use_cache=False).logits
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert float(b.double().std(correction=0)) == pytest.approx(0.05, rel=1e-5)
