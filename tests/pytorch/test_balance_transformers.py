"""Measured balancing on transformers: every weighted layer rebalanced, the function kept."""
from __future__ import annotations

import types

import pytest
import torch

import precondfx
import precondfx.pytorch.balance as B

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _gpt2():
    c = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (8, 12), generator=torch.Generator().manual_seed(1))
    return transformers.GPT2LMHeadModel(c), {"input_ids": ids}, dict(use_cache=False)


def _bert():
    c = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                intermediate_size=64, vocab_size=100, max_position_embeddings=32,
                                num_labels=3, attention_probs_dropout_prob=0.0,
                                hidden_dropout_prob=0.0)
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (8, 12), generator=torch.Generator().manual_seed(1))
    return (transformers.BertForSequenceClassification(c),
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, {})


def _logits(model, sample, kw):
    with torch.no_grad():
        return model(**sample, **kw).logits.double()


@pytest.mark.parametrize("build", [_gpt2, _bert], ids=["gpt2", "bert"])
def test_every_layer_balanced_function_kept(build):
    model, sample, kw = build()
    ref, _ = precondfx.precondition(model, sample, balance="analytic", seed=3, target_std=0.05,
                                    **kw)
    res, rep = precondfx.precondition(model, sample, balance="hessian", seed=3, target_std=0.05,
                                      **kw)
    h = rep.conditioning["hessian"]
    assert h["applied"] and not h["left_out"]
    assert len(h["factors"]) == h["layers"] >= 10
    assert max(h["factors"].values()) / min(h["factors"].values()) > 1.5  # it did rescale
    assert f"{h['layers']} of {h['layers']} weighted layers rebalanced" in rep.table()
    assert not [s for s in rep.skipped if "alpha" in s[0] or "balance" in s[0]], rep.skipped
    # the same seed before balancing: balancing is a reparametrization, logits unchanged
    a, b = _logits(ref, sample, kw), _logits(res, sample, kw)
    assert float((a - b).abs().max() / a.abs().max()) < 1e-4
    std = float(b.std(correction=0))
    assert abs(std / 0.05 - 1) < 1e-5 and abs(rep.output_std_after / 0.05 - 1) < 1e-5


def test_gpt2_conv1d_carries_its_alpha():
    model, sample, kw = _gpt2()
    res, rep = precondfx.precondition(model, sample, balance="hessian", **kw)
    bufs = {n for n, _ in res.named_buffers()}
    for i in range(2):
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            assert f"transformer.h.{i}.{m}.precondfx_in_scale" in bufs
    assert not [s for s in rep.skipped if "addmm" in s[0]], rep.skipped


def test_undo_is_exact_when_the_function_changes(monkeypatch):
    model, sample, kw = _bert()
    # same alpha sites, measured but not rebalanced (threshold out of reach)
    ref, rep0 = precondfx.precondition(model, sample, balance="auto", balance_threshold=1e30,
                                       seed=1, **kw)
    assert rep0.conditioning["hessian"]["applied"] is False
    real = B._rescale

    def broken(m, w, bufs, c):  # rescale the weight only: the function changes
        real(m, w, [], c)
    monkeypatch.setattr(B, "_rescale", broken)
    res, rep = precondfx.precondition(model, sample, balance="auto", balance_threshold=1.0001,
                                      seed=1, **kw)
    h = rep.conditioning["hessian"]
    assert h["applied"] is False and "changed the output" in h["decision"]
    assert "0 of 17 weighted layers rebalanced" in h["summary"]
    sd0, sd1 = ref.state_dict(), res.state_dict()
    assert all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    assert rep.output_std_after == rep0.output_std_after
    with pytest.raises(precondfx.PrecondError, match="changed the output"):
        precondfx.precondition(model, sample, balance="hessian", seed=1, **kw)


def test_balanceable_counts_what_can_be_rescaled():
    lay = lambda w: types.SimpleNamespace(weight=w)  # noqa: E731
    plan = types.SimpleNamespace(layers=[lay("a"), lay("b"), lay("c"), lay("c"), lay("d")])
    ok, left = B.balanceable({"a": ["a.s"], "c": ["c.s1"], "d": ["d.s1", "d.s1"]}, plan)
    assert ok == {"a": ["a.s"], "c": ["c.s1"], "d": ["d.s1"]}
    assert list(left) == ["b"]
    ok, left = B.balanceable({"c": ["c.s1", "c.s2"]}, plan)
    assert list(ok) == ["c"] and set(left) == {"a", "b", "d"}
    line = B.summary_line({"layers": 5, "left_out": left, "factors": {"c": 1.0},
                           "applied": True, "spread_before": 4.0, "after_fit": {"c": 1.0},
                           "samples": 16})
    assert line.startswith("measured balancing: 1 of 5 weighted layers rebalanced, 3 left out")


def test_held_out_spread_recorded_with_measure():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 5, padding=2), torch.nn.ReLU(),
                              torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 4))
    _, rep = precondfx.precondition(net, torch.randn(8, 3, 8, 8), balance="hessian",
                                    measure=True)
    h, m = rep.conditioning["hessian"], rep.conditioning["measure"]
    assert h["held_out"] == m["after"]["spread"]
    assert f"held-out half of the batch: {m['after']['spread']:.3g}x" in rep.table()
