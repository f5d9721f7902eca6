"""transformers architectures and setups from a second adversarial hunt (tiny configs,
offline).  Each test failed before the fix it names:

* a head module returning its own layer's output through a reshape
  (``ElectraDiscriminatorPredictions``: ``self.dense_prediction(h).squeeze(-1)``): the output
  scale sat on the head module, which has no parameter scaling its output, so checkpoints
  stayed raw and ``from_pretrained`` gave other logits;
* transformers' output-capturing hooks (which record ``hidden_states``) installed by the
  calibration forwards while the flag saying so was restored away: every later forward
  installed them again, so DPT's depth head, which reads the encoder's hidden states, got the
  first layer's output four times (64 hidden states for 5) and trained without its other
  encoder layers (48 parameters without gradients); ``output_hidden_states=True`` returned
  duplicates, and Llava (which reads its vision tower's hidden state -2) was refused by every
  capture method;
* a depth head ending in ``(sigmoid(conv(h)) * max_depth).squeeze(1)`` inside its module
  (GLPN): the bounded-output check looked at the module's last node only, so the output scale
  (0.77) was applied and the predicted depth could never exceed 7.7 of ``max_depth`` 10.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import precondfx

tf = pytest.importorskip("transformers")

# the first hunt's tiny sizes and helpers (ids, a quiet precondition, logits, the checkpoint
# round trip)
from tests.integrations.test_hf_hunt import V, _ids, _logits, _pre, _reloads  # noqa: E402
_ENC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            vocab_size=V, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)




@pytest.mark.parametrize("masked", [False, True])   # export, and eager capture (padding)
def test_head_returning_its_layer_squeezed_folds(masked: bool, tmp_path) -> None:
    torch.manual_seed(0)
    model = tf.ElectraForPreTraining(tf.ElectraConfig(embedding_size=16, **_ENC))
    ids = _ids()
    mask = torch.ones_like(ids)
    if masked:
        mask[0, -4:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    labels = ids % 2
    res, rep = _pre(model, {**batch, "labels": labels})
    _reloads(res, batch, tmp_path)
    head = res.discriminator_predictions.dense_prediction
    assert float(head.precondfx_output_scale) == pytest.approx(rep.output_scale)
    logits = _logits(res, batch)
    assert abs(float(logits.std()) - 1.0) < 0.1
    with torch.no_grad():
        out = res.eval()(**batch, labels=labels)
    keep = mask.bool()
    want = F.binary_cross_entropy_with_logits(out.logits[keep].double(), labels[keep].double())
    assert abs(float(out.loss) - float(want)) < 1e-5


def test_hidden_states_recorded_once_and_every_encoder_layer_trains(tmp_path) -> None:
    torch.manual_seed(0)
    model = tf.DPTForDepthEstimation(tf.DPTConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=8, backbone_out_indices=[0, 1, 2, 3],
        neck_hidden_sizes=[8, 8, 16, 16], fusion_hidden_size=16, reassemble_factors=[4, 2, 1, 0.5],
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    res, rep = _pre(model, {"pixel_values": x})
    with torch.no_grad():
        out = res.eval()(pixel_values=x, output_hidden_states=True)
    assert len(out.hidden_states) == 5
    assert abs(float(out.predicted_depth.std()) - 1.0) < 0.1
    res.train()
    res(pixel_values=x).predicted_depth.pow(2).mean().backward()
    for i in range(4):
        w = res.dpt.encoder.layer[i].output.dense.weight
        assert w.grad is not None and float(w.grad.abs().max()) > 0, i
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0   # the user's model
    assert res.config.precondfx["checkpoints"] == "folded"


def test_llava_reading_a_vision_hidden_state_preconditions(tmp_path) -> None:
    torch.manual_seed(0)
    vision = tf.CLIPVisionConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                 intermediate_size=64, image_size=16, patch_size=8)
    text = tf.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=64, vocab_size=V,
                          max_position_embeddings=64, pad_token_id=0)
    model = tf.LlavaForConditionalGeneration(tf.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=V - 1, vision_feature_layer=-2))
    ids = torch.randint(3, V - 2, (2, 10), generator=torch.Generator().manual_seed(1))
    ids[:, 1:5] = V - 1                     # the image's 4 patch tokens
    batch = {"input_ids": ids, "pixel_values": torch.randn(2, 3, 16, 16)}
    res, rep = _pre(model, {**batch, "labels": ids}, use_cache=False)
    assert abs(float(_logits(res, batch, use_cache=False).std()) - 1.0) < 0.1
    _reloads(res, batch, tmp_path, use_cache=False)


def test_sigmoid_times_a_depth_range_keeps_its_range() -> None:
    torch.manual_seed(0)
    model = tf.GLPNForDepthEstimation(tf.GLPNConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
        num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2],
        decoder_hidden_size=16, drop_path_rate=0.0, max_depth=10))
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with pytest.warns(RuntimeWarning, match="sigmoid"):
        res, rep = precondfx.precondition(model, {"pixel_values": x})
    assert rep.output_scale is None
    big = 1e3 * torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        depth = res.eval()(pixel_values=big).predicted_depth
    assert float(depth.min()) >= 0.0 and float(depth.max()) <= 10.0
    assert float(depth.max()) > 7.8     # the full range is reachable
