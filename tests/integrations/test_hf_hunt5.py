"""transformers models from a fifth hunt (tiny configs, offline).  Each test failed before the
fix it names:

* CLIP (the eager back end: the output scale on the returned value): only
  ``logits_per_image`` was scaled, ``logits_per_text`` (its transpose, the other half of
  CLIP's contrastive loss) stayed raw: its std 1.57 against 1.03.  Outputs that are views of
  the main output's tensor now take the same scale.
* DeiT with its distillation head: ``logits`` (the average of the two heads) was scaled on the
  returned value, ``cls_logits`` and ``distillation_logits`` left raw (``logits`` was 0.49 off
  their average), and checkpoints were raw.  The scale now sits on both heads (a sum or
  average of heads, checked by running), so every output agrees and checkpoints fold.  The fx
  back end did the same to a hand-written model of that shape (the scale after the average,
  heads raw: 1.54 off); it scales each head now.
* ESM's masked LM planned on the meta device: the search for the inner module that carries
  ``EsmLMHead``'s output scale (``self.decoder(x) + self.bias``) needs values, and
  ``distributed.calibrate`` never ran it: checkpoints stayed raw and ``fold`` refused, where
  the same model preconditioned with data folds.  It now runs when the model gets its data.
* A transformers model without tied weights (Qwen2, untied) planned on the meta device:
  after ``to_empty``, ``reinit`` and ``distributed.calibrate`` its config still said
  ``"checkpoints": "raw"`` ("it is on the meta device"), ``save_pretrained`` warned and
  ``from_pretrained`` gave logits 60% off.  Such a model now waits as "pending" and calibrate
  settles it: the checkpoint folds and reloads to 1e-5.
"""
from __future__ import annotations


import pytest
import torch

import precondfx
from tests.hf_tiny import meta_flow, quiet_precondition, pretrained_round_trip

tf = pytest.importorskip("transformers")

V = 61


_pre = quiet_precondition


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _clip_batch(n: int = 4) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V - 1, (n, 8), generator=g)
    ids[:, -1] = V - 1                                # each text ends with its EOS token
    return {"input_ids": ids, "pixel_values": torch.randn(n, 3, 16, 16, generator=g)}


def _clip() -> torch.nn.Module:
    cfg = tf.CLIPConfig(
        text_config=dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=16, eos_token_id=V - 1,
                         bos_token_id=0),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, image_size=16, patch_size=8),
        projection_dim=16)
    torch.manual_seed(0)
    return tf.CLIPModel(cfg)


def test_clip_logits_per_text_is_the_transpose_of_logits_per_image() -> None:
    """The user's contrastive loss reads both logits: they stay each other's transpose, both
    at the calibrated scale."""
    batch = _clip_batch()
    res, rep = _pre(_clip(), batch, balance="analytic")
    res.eval()
    with torch.no_grad():
        out = res(**batch)
    assert torch.equal(out.logits_per_text, out.logits_per_image.t())   # std 1.57 vs 1.03
    assert abs(float(out.logits_per_image.std(correction=0)) - 1.0) < 1e-3
    # the embeddings the user reads through get_*_features are not scaled
    with torch.no_grad():
        img = res.get_image_features(pixel_values=batch["pixel_values"])
    img = img if isinstance(img, torch.Tensor) else img.pooler_output
    assert _rel(img / img.norm(dim=-1, keepdim=True), out.image_embeds) < 1e-5


def _deit():
    torch.manual_seed(0)
    cfg = tf.DeiTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, image_size=16, patch_size=4, num_labels=5,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return tf.DeiTForImageClassificationWithTeacher(cfg), {"pixel_values": x}


def test_deit_distillation_head_is_scaled_with_the_class_head_and_folds() -> None:
    model, batch = _deit()
    res, rep = _pre(model, batch, balance="analytic")
    res.eval()
    with torch.no_grad():
        out = res(**batch)
    avg = (out.cls_logits + out.distillation_logits) / 2
    assert _rel(out.logits, avg) < 1e-6                          # was 0.49 off (abs)
    assert abs(float(out.logits.std(correction=0)) - 1.0) < 1e-3
    scales = {n: float(b) for n, b in res.named_buffers() if n.endswith("output_scale")}
    assert set(scales) == {"cls_classifier.precondfx_output_scale",
                           "distillation_classifier.precondfx_output_scale"}, scales
    assert len(set(scales.values())) == 1 and abs(rep.output_scale - 1.0) > 0.05
    entry = res.config.precondfx
    assert entry["checkpoints"] == "folded", entry["problems"]   # was raw
    plain = precondfx.fold(res).eval()
    with torch.no_grad():
        assert _rel(plain(**batch).distillation_logits, out.distillation_logits) < 1e-5
    back = pretrained_round_trip(res)   # no "constants dropped" warning
    with torch.no_grad():
        assert _rel(back(**batch).logits, out.logits) < 1e-5


def _reloads(res, batch: dict, fwd: dict) -> None:
    entry = res.config.precondfx
    assert entry["checkpoints"] == "folded", entry["problems"]
    res.eval()
    with torch.no_grad():
        want = res(**batch, **fwd).logits
        assert _rel(precondfx.fold(res).eval()(**batch, **fwd).logits, want) < 1e-5
    back = pretrained_round_trip(res)   # no "constants dropped" warning
    with torch.no_grad():
        assert _rel(back(**batch, **fwd).logits, want) < 1e-5      # qwen2: was 0.60


def test_esm_masked_lm_planned_on_meta_folds_after_calibrate() -> None:
    cfg = tf.EsmConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=32, max_position_embeddings=32, pad_token_id=1,
                       mask_token_id=2, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    ids = torch.randint(4, V, (4, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    _, res = meta_flow(lambda: tf.EsmForMaskedLM(cfg), batch, {})
    assert res.config.precondfx["upstream"].get("lm_head") == "lm_head.decoder"
    _reloads(res, batch, {})


def test_untied_causal_lm_planned_on_meta_folds_after_calibrate() -> None:
    cfg = tf.Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, vocab_size=V,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = torch.randint(3, V, (3, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    fwd = {"use_cache": False}
    _, res = meta_flow(lambda: tf.Qwen2ForCausalLM(cfg), batch, fwd)
    _reloads(res, batch, fwd)


class TwoHeads(torch.nn.Module):
    """A DeiT-style classifier written by hand: the average of a class head and a
    distillation head, returned with both heads' own logits."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU())
        self.cls = torch.nn.Linear(32, 5)
        self.dist = torch.nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> dict:
        h = self.body(x)
        a, b = self.cls(h), self.dist(h)
        return {"logits": (a + b) / 2, "cls_logits": a, "distillation_logits": b}


@pytest.mark.parametrize("capture", ["fx", "eager"])
def test_hand_written_two_head_average_scales_both_heads(capture: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    res, rep = _pre(TwoHeads(), x, capture=capture)
    with torch.no_grad():
        out = res(x)
    avg = (out["cls_logits"] + out["distillation_logits"]) / 2
    assert float((avg - out["logits"]).abs().max()) < 1e-6         # fx: 1.54 before
    assert abs(rep.output_scale - 1.0) > 0.05
    plain = precondfx.fold(res)
    with torch.no_grad():
        assert _rel(plain(x)["distillation_logits"], out["distillation_logits"]) < 1e-5
