"""Tiny transformers models built from configs (offline), with a batch carrying labels, and the
loss each model's head should compute, written independently of transformers' loss code."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

VOCAB, SEQ, BATCH = 97, 12, 4
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
              "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
              "vit": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
              "llama": {}}


def build(name: str, seed: int = 0, dropout: bool = True) -> tuple[torch.nn.Module, dict]:
    """(model, batch with labels) for 'gpt2', 'bert', 'vit' or 'llama' (n_embd 32, 2 layers)."""
    import transformers as tf
    torch.manual_seed(seed)
    extra = {} if dropout else NO_DROPOUT[name]
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    if name == "gpt2":
        cfg = tf.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=32,
                            bos_token_id=0, eos_token_id=0, **extra)
        return tf.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids.clone()}
    if name == "bert":
        cfg = tf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=32,
                            num_labels=3, **extra)
        return tf.BertForSequenceClassification(cfg), {
            "input_ids": ids, "labels": torch.randint(0, 3, (BATCH,), generator=g)}
    if name == "vit":
        cfg = tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, image_size=16, patch_size=4, num_labels=5,
                           **extra)
        return tf.ViTForImageClassification(cfg), {
            "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
            "labels": torch.randint(0, 5, (BATCH,), generator=g)}
    if name == "llama":
        cfg = tf.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=64, vocab_size=VOCAB,
                             max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                             pad_token_id=0)
        return tf.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids.clone()}
    raise ValueError(name)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: position t predicts token t+1."""
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, v).double(), labels[:, 1:].reshape(-1))


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.double(), labels)


LOSS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "gpt2": causal_lm_loss, "llama": causal_lm_loss,
    "bert": classification_loss, "vit": classification_loss}
FORWARD: dict[str, dict[str, Any]] = {"gpt2": {"use_cache": False}, "llama": {"use_cache": False},
                                      "bert": {}, "vit": {}}
NAMES = ("gpt2", "bert", "vit", "llama")


def quiet_precondition(model: torch.nn.Module, batch: Any, **options: Any) -> Any:
    """``precondfx.precondition`` with its warnings (and transformers') silenced: for tests
    that check the result, not what it says."""
    import warnings

    import precondfx
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return precondfx.precondition(model, batch, **options)


def meta_flow(build: Callable[[], torch.nn.Module], batch: dict, fwd: dict,
              calib: dict | None = None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Plan on the meta device, then to_empty, the user's own init of what the plan keeps or
    leaves as is (taken from a model built with data: rule 'keep', and 'match' without a
    std), reinit and distributed calibration (on ``calib``, else ``batch``).  Returns the
    model built with data and the result."""
    import precondfx
    from precondfx.pytorch import distributed
    torch.manual_seed(0)
    real = build()
    with torch.device("meta"):
        meta = build()
    res, rep = quiet_precondition(meta, batch, seed=0, balance="analytic", **fwd)
    assert res.config.precondfx["checkpoints"] == "pending"
    res.to_empty(device="cpu")
    params, bufs = dict(res.named_parameters()), dict(res.named_buffers())
    with torch.no_grad():
        for n, t in real.named_parameters():
            pi = rep.plan.inits.get(n)
            if pi is None or pi.rule == "keep" or (pi.rule == "match" and pi.std is None):
                params[n].copy_(t)
        for n, t in real.named_buffers():
            if n in bufs and "precondfx_" not in n:
                bufs[n].copy_(t)
    precondfx.reinit(res, rep.plan, seed=0)
    distributed.calibrate(res, calib or batch, forward_kwargs=fwd or None)
    return real, res


def pretrained_round_trip(model: torch.nn.Module) -> torch.nn.Module:
    """``save_pretrained`` then ``from_pretrained`` (in eval mode) through a temporary folder;
    a ``UserWarning`` while saving (precondfx's "constants dropped") fails the test."""
    import tempfile
    import warnings
    with tempfile.TemporaryDirectory() as d:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            model.save_pretrained(d)
        return type(model).from_pretrained(d).eval()
