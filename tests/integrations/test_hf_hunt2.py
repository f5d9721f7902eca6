"""transformers architectures and setups from a second adversarial hunt (tiny configs,
offline).  Each test failed before the fix it names:

* a head module returning its own layer's output through a reshape
  (``ElectraDiscriminatorPredictions``: ``self.dense_prediction(h).squeeze(-1)``): the output
  scale sat on the head module, which has no parameter scaling its output, so checkpoints
  stayed raw and ``from_pretrained`` gave other logits.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import precondfx
from precondfx.integrations.hf import reattach

tf = pytest.importorskip("transformers")

V, T, B = 101, 12, 4
_ENC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            vocab_size=V, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _pre(model, batch: dict, **fwd):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return precondfx.precondition(model, batch, **fwd)


def _logits(model, batch: dict, **fwd) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**batch, **fwd).logits.double()


def _reloads(res, batch: dict, tmp_path, **fwd) -> None:
    """The checkpoint folds; from_pretrained (transformers alone) and reattach give the
    result's logits."""
    entry = res.config.precondfx
    assert entry["checkpoints"] == "folded", entry["problems"]
    ref = _logits(res, batch, **fwd)
    res.save_pretrained(tmp_path)
    back = type(res).from_pretrained(tmp_path)
    assert not any("precondfx" in n for n, _ in back.named_buffers())
    tol = 1e-5 * float(ref.abs().max())
    assert float((_logits(back, batch, **fwd) - ref).abs().max()) <= tol
    again = reattach(type(res).from_pretrained(tmp_path))
    assert float((_logits(again, batch, **fwd) - ref).abs().max()) <= tol


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

