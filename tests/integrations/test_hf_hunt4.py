"""transformers models from a fourth hunt (tiny configs, offline).  Each test failed before the
fix it names:

* ``fold`` and folded checkpoints of ESM's masked LM: its output scale sits on ``EsmLMHead``,
  whose forward is ``self.decoder(x) + self.bias`` (a module of no known kind, with a tied
  decoder).  It now moves to the decoder (and on to the ``layer_norm`` feeding the tied
  weight) with the head's own bias scaled too, checked by running when preconditioned.
* WavLM's residual branch scale sits on the dropout after its attention, whose output comes
  from ``F.multi_head_attention_forward`` reading ``out_proj``'s weights without calling it:
  the check by running that the scale may move to ``out_proj`` hooked a module never called.
  It now doubles such a module's weight and bias, as fold would.
* CLIP with ``return_loss=True``: the refusal said "do not pass labels", which CLIP users did
  not; it names ``return_loss`` now.
* MobileBERT's masked-LM head (``h @ cat([decoder.weight.T, dense.weight]) + decoder.bias``)
  did not fold; the inner-module rule above folds it.
* LoRA-style adapters written by hand on a frozen BERT: the zero ``lora_B`` was redrawn and
  the frozen attention branches holding the adapters got a branch scale, so the model did not
  start at the base model's function.  In a model with frozen weights, an all-zero trainable
  weight whose output is added to another path is now kept at zero (a report note lists it),
  and such adapters do not count as trainable weights of a branch (no ``s``).  A zero head in
  a model without frozen weights is drawn as before.
"""
from __future__ import annotations


import pytest
import torch

import precondfx
from tests.hf_tiny import quiet_precondition, pretrained_round_trip

tf = pytest.importorskip("transformers")

V = 50


_pre = quiet_precondition


def _fold_and_reload(model, batch, other, key):
    res, _ = _pre(model, batch, balance="analytic")     # constants without the measurement
    assert res.config.precondfx["checkpoints"] == "folded", res.config.precondfx["problems"]
    plain = precondfx.fold(res)
    res.eval()
    plain.eval()
    with torch.no_grad():
        want = res(**other)[key]
        got = plain(**other)[key]
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert not any("precondfx" in k for k in plain.state_dict())
    loaded = pretrained_round_trip(res)   # no "constants dropped" warning
    with torch.no_grad():
        again = loaded(**other)[key]
    assert float((again - want).abs().max() / want.abs().max()) < 1e-5


def _ids(seed):
    ids = torch.randint(4, V, (4, 10), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def test_esm_masked_lm_folds() -> None:
    torch.manual_seed(0)
    cfg = tf.EsmConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=32, max_position_embeddings=32, pad_token_id=1,
                       mask_token_id=2, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    _fold_and_reload(tf.EsmForMaskedLM(cfg), _ids(0), _ids(1), "logits")


def test_wavlm_branch_scale_folds_into_functional_attention() -> None:
    torch.manual_seed(0)
    cfg = tf.WavLMConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, conv_dim=(16, 16), conv_stride=(5, 2),
                         conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                         num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
                         attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                         layerdrop=0.0, mask_time_prob=0.0, num_buckets=16,
                         max_bucket_distance=32)
    g = torch.Generator().manual_seed(0)
    x = {"input_values": torch.randn(4, 400, generator=g)}
    y = {"input_values": torch.randn(4, 400, generator=g)}
    _fold_and_reload(tf.WavLMModel(cfg), x, y, "last_hidden_state")


def test_clip_return_loss_refusal_names_return_loss() -> None:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V - 1, (4, 8), generator=g)
    ids[:, -1] = V - 1
    cfg = tf.CLIPConfig(
        text_config=dict(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=16, eos_token_id=V - 1,
                         bos_token_id=0),
        vision_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, image_size=16, patch_size=8),
        projection_dim=8)
    batch = {"input_ids": ids, "pixel_values": torch.randn(4, 3, 16, 16, generator=g),
             "return_loss": True}
    with pytest.raises(precondfx.errors.PrecondError, match="return_loss"):
        _pre(tf.CLIPModel(cfg), batch)


def test_mobilebert_masked_lm_folds() -> None:
    torch.manual_seed(0)
    cfg = tf.MobileBertConfig(vocab_size=V, hidden_size=32, embedding_size=16,
                              num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                              intra_bottleneck_size=16, true_hidden_size=16,
                              num_feedforward_networks=1, max_position_embeddings=32,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    _fold_and_reload(tf.MobileBertForMaskedLM(cfg), _ids(0), _ids(1), "logits")


class LoraLinear(torch.nn.Module):
    """A LoRA adapter written by hand (as without peft): frozen base, A random, B zero."""

    def __init__(self, base: torch.nn.Linear, r: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_dropout = torch.nn.Dropout(0.0)
        self.lora_A = torch.nn.Linear(base.in_features, r, bias=False)
        self.lora_B = torch.nn.Linear(r, base.out_features, bias=False)
        torch.nn.init.zeros_(self.lora_B.weight)
        self.scaling = 2.0

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def test_lora_adapters_start_at_the_base_model() -> None:
    """A frozen BERT with zero-initialized LoRA adapters on query and value and a trainable
    head: the adapters' B stays zero and no branch scale goes on the attention branches the
    adapters sit in, so the encoder computes exactly what the base model computes (before:
    B redrawn and s=0.35 on the frozen attention branches: the encoder's output moved by 7.8%
    of its max on a 64-wide version)."""
    import copy
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = tf.BertForSequenceClassification(cfg)
    base = copy.deepcopy(model).eval()
    model.bert.requires_grad_(False)
    for layer in model.bert.encoder.layer:
        att = layer.attention.self
        att.query, att.value = LoraLinear(att.query), LoraLinear(att.value)
    batch = {k: v for k, v in _ids(0).items() if k != "labels"}
    res, rep = _pre(model, batch)
    res.eval()
    with torch.no_grad():
        want = base.bert(**batch).last_hidden_state
        got = res.bert(**batch).last_hidden_state
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())
    lora_b = [n for n, _ in res.named_parameters() if n.endswith("lora_B.weight")]
    assert len(lora_b) == 4
    named = dict(res.named_parameters())
    assert all(float(named[n].detach().abs().max()) == 0.0 for n in lora_b)
    assert all(rep.plan.inits[n].rule == "keep" for n in lora_b)
    assert any("zero-initialized adapters" in note for note in rep.plan.notes)
    assert float(res.classifier.weight.std()) > 0                   # the head is still drawn
    # the adapters train: B gets a gradient
    res.train()
    res(**batch).logits.pow(2).mean().backward()
    assert all(float(named[n].grad.abs().max()) > 0 for n in lora_b)


def test_zero_head_without_frozen_weights_is_still_drawn() -> None:
    """A zero-initialized weight in a model trained from scratch (torchvision's ViT head) is
    drawn as before: keeping it would make the output constant."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    torch.nn.init.zeros_(model[2].weight)
    res, _ = _pre(model, torch.randn(16, 8))
    assert float(res[2].weight.abs().max()) > 0


def test_lora_head_fold_is_never_silently_wrong_after_training() -> None:
    """LoRA on the classifier of a frozen BERT: the output scale sits on the adapter wrapper.
    With ``lora_B`` zero, doubling the base layer's output alone doubled the wrapper's, so the
    check by running (added with the ESM rule) moved the scale onto ``classifier.base``; once
    training moved ``lora_B``, ``fold`` was 99% off, silently.  The check now runs with the
    module's all-zero tensors given random values: nothing inside scales the output alone, and
    fold refuses, naming the wrapper."""
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = tf.BertForSequenceClassification(cfg)
    model.requires_grad_(False)
    model.classifier = LoraLinear(model.classifier)
    batch = {k: v for k, v in _ids(0).items() if k != "labels"}
    res, _ = _pre(model, batch, balance="analytic")
    with torch.no_grad():
        res.classifier.lora_B.weight.normal_()          # as after training
    problems = precondfx.fold_problems(res)
    if not problems:
        res.eval()
        plain = precondfx.fold(res).eval()
        with torch.no_grad():
            want, got = res(**batch).logits, plain(**batch).logits
        assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    else:
        assert problems[0][0] == "classifier" and "target_std=None" in problems[0][1]
