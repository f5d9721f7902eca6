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
"""
from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

import precondfx

tf = pytest.importorskip("transformers")

V = 50


def _pre(model, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return precondfx.precondition(model, batch)


def _fold_and_reload(model, batch, other, key):
    res, _ = _pre(model, batch)
    assert res.config.precondfx["checkpoints"] == "folded", res.config.precondfx["problems"]
    plain = precondfx.fold(res)
    res.eval()
    plain.eval()
    with torch.no_grad():
        want = res(**other)[key]
        got = plain(**other)[key]
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    assert not any("precondfx" in k for k in plain.state_dict())
    with tempfile.TemporaryDirectory() as d:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)   # no "constants dropped" warning
            res.save_pretrained(d)
        loaded = type(model).from_pretrained(d).eval()
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
                       attention_probs_dropout_prob=0.0, position_embedding_type="rotary")
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
