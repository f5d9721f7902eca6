"""transformers models and setups from a third adversarial hunt (tiny configs, offline).

Each test failed before the fix it names:

* CLIP's main output ``logits_per_image`` has one element per (image, text) pair: at batch
  size 1, where measured balancing runs each sample alone, it is ``(1, 1)``, and the rule that
  skips one-element outputs (a loss) picked ``text_embeds`` there.  The vision tower's Hessian
  statistics were measured as exactly 0 and every vision layer was left unbalanced (the report
  blamed "another head"); the per-sample passes now read the output picked on the whole batch.
  ``measure_conditioning`` (the user's API, no ``output_fn``) measured 0 for it the same way.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import precondfx

tf = pytest.importorskip("transformers")

V, B = 101, 4


def _clip() -> tuple:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V - 1, (B, 8), generator=g)
    ids[:, -1] = V - 1                                # each text ends with its EOS token
    cfg = tf.CLIPConfig(
        text_config=dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=16, eos_token_id=V - 1),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, image_size=16, patch_size=4),
        projection_dim=16)
    torch.manual_seed(0)
    return tf.CLIPModel(cfg), {"input_ids": ids, "pixel_values": torch.randn(B, 3, 16, 16,
                                                                             generator=g)}


def test_clip_balancing_measures_the_main_output_of_both_towers() -> None:
    model, batch = _clip()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res, rep = precondfx.precondition(model, batch)
    h = rep.conditioning["hessian"]
    vision = {w: v for w, v in h["before"].items() if w.startswith(("vision_model.", "visual_"))}
    assert len(vision) == 9
    assert min(vision.values()) > 1e-3, vision                     # was 0.0 for every one
    assert not [w for w, _ in rep.skipped if "vision_model" in w or "visual_" in w], rep.skipped
    assert all(w in h["factors"] for w in vision)


def test_measure_conditioning_reads_the_whole_batch_main_output() -> None:
    from precondfx.pytorch.measure.conditioning import measure_conditioning
    model, batch = _clip()
    fc1 = "vision_model.encoder.layers.0.mlp.fc1.weight"
    r = measure_conditioning(model, batch, [fc1, "text_model.encoder.layers.0.mlp.fc1.weight"],
                             stats=("hessian",), n_samples=2, verbose=False)
    assert r.layers[0].hessian.mean > 1e-3                        # was 0.0 (text_embeds)
