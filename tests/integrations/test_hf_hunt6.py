"""transformers models from a sixth hunt (tiny configs, offline).  Each test failed before the
fix it names:

* BART and DeiT planned on the meta device: where the output scale can sit on a module is
  checked by running (BART's ``lm_head`` before ``+ final_logits_bias``, DeiT's two heads the
  logits average), which the meta device cannot do; the scale stayed on the returned value
  after ``distributed.calibrate``: checkpoints ``"raw"``, ``save_pretrained`` warned and
  ``from_pretrained`` lost the scale, and BART called with ``labels`` raised (its loss would
  not see the scale), where the same models preconditioned with data fold.  The candidates
  are now recorded on meta and checked when calibrate runs on the materialized model, before
  its first forward (so the training batch with labels calibrates: it raised).  Planning BART
  on meta with labels is still refused (it cannot be checked there), now saying to plan
  without them and that calibrate moves the scale onto ``lm_head`` (it said no module
  produces the main output).
* CLIP: the output scale multiplies the returned ``logit_scale.exp() * text @ image.T``, so
  checkpoints stayed ``"raw"`` (``save_pretrained`` warned, ``from_pretrained`` lost the scale,
  0.54 here) and ``fold`` refused.  It folds exactly into ``logit_scale`` (``+ log s``, checked
  by running: adding ``log 2`` doubles the logits): checkpoints fold, reload to 2e-7, and
  ``reattach`` gives back the preconditioned ``logit_scale``.
"""
from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
import torch.nn.functional as F

import precondfx
from tests.hf_tiny import meta_flow, pretrained_round_trip, quiet_precondition as _pre

tf = pytest.importorskip("transformers")

V = 61


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _deit() -> tuple:
    cfg = tf.DeiTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, image_size=16, patch_size=4, num_labels=5,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return (lambda: tf.DeiTForImageClassificationWithTeacher(cfg)), {"pixel_values": x}, {}


def _bart() -> tuple:
    cfg = tf.BartConfig(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    ids = torch.randint(3, V, (4, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return (lambda: tf.BartForConditionalGeneration(cfg)), batch, {"use_cache": False}


@pytest.mark.parametrize("name", ["deit", "bart"])
def test_meta_planned_output_scale_moves_onto_heads_and_folds(name: str) -> None:
    build, batch, fwd = {"deit": _deit, "bart": _bart}[name]()
    # BART: calibrated on the training batch, labels included (raised: loss before the scale)
    calib = {**batch, "labels": batch["input_ids"]} if name == "bart" else None
    _, res = meta_flow(build, batch, fwd, calib)
    entry = res.config.precondfx
    assert entry["checkpoints"] == "folded", entry["problems"]        # was "raw"
    scales = sorted(n for n, _ in res.named_buffers() if n.endswith("output_scale"))
    assert scales == {"deit": ["cls_classifier.precondfx_output_scale",
                               "distillation_classifier.precondfx_output_scale"],
                      "bart": ["lm_head.precondfx_output_scale"]}[name]   # was the root's
    res.eval()
    with torch.no_grad():
        want = res(**batch, **fwd).logits
        if name == "bart":      # DeiT's tokens are drawn from data, left as is on meta
            torch.manual_seed(0)
            data = _pre(build(), batch, seed=0, balance="analytic", **fwd)[0].eval()
            assert _rel(want, data(**batch, **fwd).logits) < 1e-5   # the plan made with data
        assert abs(float(want.std(correction=0)) - 1.0) < 1e-3
    back = pretrained_round_trip(res)   # no "constants dropped" warning
    with torch.no_grad():
        assert _rel(back(**batch, **fwd).logits, want) < 1e-5
    if name == "bart":      # its own loss sees the scale (was: PrecondError, loss before scale)
        with torch.no_grad():
            out = res(**batch, labels=batch["input_ids"], **fwd)
        ce = F.cross_entropy(out.logits.reshape(-1, V), batch["input_ids"].reshape(-1))
        assert abs(float(out.loss) - float(ce)) < 1e-5


def test_clip_output_scale_folds_into_logit_scale() -> None:
    from precondfx.integrations.hf import reattach
    from tests.integrations.test_hf_hunt5 import _clip, _clip_batch
    batch = _clip_batch()
    model = _clip()
    res, rep = _pre(model, batch, balance="analytic")
    assert abs(rep.output_scale - 1.0) > 0.05
    entry = res.config.precondfx
    assert entry["checkpoints"] == "folded", entry["problems"]          # was "raw"
    assert torch.equal(res.logit_scale, model.logit_scale)     # the live model's is untouched
    res.eval()
    with torch.no_grad():
        out = res(**batch)
        plain = precondfx.fold(res).eval()                               # refused before
        assert _rel(plain(**batch).logits_per_image, out.logits_per_image) < 1e-6
        assert _rel(plain(**batch).logits_per_text, out.logits_per_text) < 1e-6
    with tempfile.TemporaryDirectory() as d:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)      # no "constants dropped" warning
            res.save_pretrained(d)
        back = type(model).from_pretrained(d).eval()
        again = reattach(type(model).from_pretrained(d)).eval()
    with torch.no_grad():
        assert _rel(back(**batch).logits_per_image, out.logits_per_image) < 1e-6
        assert abs(float(again.logit_scale) - float(res.logit_scale)) < 1e-6
        assert _rel(again(**batch).logits_per_image, out.logits_per_image) < 1e-6


def test_meta_planned_bart_with_labels_says_to_plan_without_them() -> None:
    """The refusal said no module produces the main output (lm_head does: it cannot be
    checked on meta); it now says what to do."""
    build, batch, fwd = _bart()
    with torch.device("meta"):
        meta = build()
    with pytest.raises(precondfx.PrecondError) as e:
        _pre(meta, {**batch, "labels": batch["input_ids"]}, seed=0, balance="analytic", **fwd)
    msg = str(e.value)
    assert "lm_head" in msg and "distributed.calibrate" in msg and "labels" in msg, msg
