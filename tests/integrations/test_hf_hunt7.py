"""transformers models from a seventh hunt (tiny configs, offline).  Each test failed before the
fix it names:

* DeiT and ViT planned on the meta device: their class tokens and position embeddings (rule
  ``match``: drawn at the rms of the patch embedding's output, measured on data) were left as
  is, so after ``to_empty`` they held uninitialized memory; ``distributed.calibrate`` raised
  "NaN/inf" advising the rule 'keep' init (or, with finite garbage, calibrated on it).
  ``reinit`` now records them and ``distributed.calibrate`` measures and draws them from the
  stream ``precondition`` uses with data: the logits equal the data path's.
* CLIP planned on the meta device: the check that ``logit_scale`` carries the output scale
  (adding ``log 2`` doubles the logits) needs data, so checkpoints stayed ``"raw"``
  (``save_pretrained`` warned, ``from_pretrained`` lost the scale).  ``distributed.calibrate``
  now runs that check on the materialized model: checkpoints fold, reload to 2e-7.
* ``save_pretrained`` before ``lr='auto'``'s first step: ``from_pretrained`` + ``reattach``
  gives a model with no pending step (a tiny Swin under SGD took another first step: loss
  after it 0.987 against the result's 1.138), and nothing said so (pickling warns).  The
  checkpoint now warns, as pickling does.
"""
from __future__ import annotations

import pytest
import torch

import precondfx
from tests.hf_tiny import build as tiny, meta_flow, pretrained_round_trip, \
    quiet_precondition as _pre

tf = pytest.importorskip("transformers")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _deit() -> tuple:
    from tests.integrations.test_hf_hunt6 import _deit as d
    build, batch, _ = d()
    return build, batch


def _vit() -> tuple:
    m, batch = tiny("vit", dropout=False)
    cfg = m.config
    return (lambda: tf.ViTForImageClassification(cfg)), {"pixel_values": batch["pixel_values"]}


@pytest.mark.parametrize("name", ["deit", "vit"])
def test_meta_planned_tokens_are_drawn_by_calibrate(name: str) -> None:
    """The user inits what the plan keeps (rule 'keep'), not the tokens: calibrate draws
    them as precondition does with data (was: PrecondError NaN/inf, tokens never drawn)."""
    from precondfx.pytorch import distributed
    build, batch = {"deit": _deit, "vit": _vit}[name]()
    torch.manual_seed(0)
    real = build()
    with torch.device("meta"):
        meta = build()
    res, rep = _pre(meta, batch, seed=0, balance="analytic")
    tokens = sorted(n for n, pi in rep.plan.inits.items() if pi.rule == "match")
    assert tokens, rep.plan.inits
    res.to_empty(device="cpu")
    params = dict(res.named_parameters())
    with torch.no_grad():
        for n, t in real.named_parameters():
            pi = rep.plan.inits.get(n)
            if pi is None or pi.rule == "keep":
                params[n].copy_(t)
            if n in tokens:         # what to_empty may leave: finite garbage
                params[n].fill_(1e30)
    precondfx.reinit(res, rep.plan, seed=0)
    distributed.calibrate(res, batch)
    torch.manual_seed(0)
    data = _pre(build(), batch, seed=0, balance="analytic")[0].eval()
    res.eval()
    with torch.no_grad():
        want = data(**batch).logits
        got = res(**batch).logits
        for n in tokens:
            assert torch.equal(params[n], dict(data.named_parameters())[n]), n
    assert _rel(got, want) < 1e-6
    back = pretrained_round_trip(res)
    with torch.no_grad():
        assert _rel(back(**batch).logits, got) < 1e-5


def test_meta_planned_clip_folds_into_logit_scale() -> None:
    from tests.integrations.test_hf_hunt5 import _clip, _clip_batch
    batch = _clip_batch()
    _, res = meta_flow(_clip, batch, {})
    entry = res.config.precondfx
    assert entry["checkpoints"] == "folded", entry["problems"]          # was "raw"
    assert entry["output_log_param"] == "logit_scale"
    torch.manual_seed(0)
    data = _pre(_clip(), batch, seed=0, balance="analytic")[0].eval()
    res.eval()
    with torch.no_grad():
        got = res(**batch).logits_per_image
        assert _rel(got, data(**batch).logits_per_image) < 1e-6
    back = pretrained_round_trip(res)      # warned "constants dropped" before
    with torch.no_grad():
        assert _rel(back(**batch).logits_per_image, got) < 1e-5          # was 0.54 off


def test_save_pretrained_before_the_first_step_says_the_step_is_lost() -> None:
    """A checkpoint taken before lr='auto''s first step loses it silently: reloaded with
    reattach, a tiny Swin trained with SGD(lr=1e-2) took another first step than the result
    (loss after one step 0.987 against 1.138).  The save now warns, as pickling does; after
    the first step (the storage settled) it does not."""
    import warnings
    model, batch = tiny("gpt2", dropout=False)
    res, _ = _pre(model, {"input_ids": batch["input_ids"]}, use_cache=False)
    with pytest.warns(RuntimeWarning, match="first step is pending"):
        res.state_dict()
    opt = torch.optim.SGD(res.parameters(), lr=1e-2)
    res(**batch, use_cache=False).loss.backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res.state_dict()
