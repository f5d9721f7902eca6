"""transformers architectures beyond the four of tests/hf_tiny.py (tiny configs, offline).

Each model is preconditioned on a batch given as a dict (input_ids, attention_mask, labels) and
checked against the user's model: the contract of tests/batteries/test_models_pytorch.py (structure, state_dict
keys, the user's model unchanged, gradients to the same parameters, output std calibrated); the
model's own loss equals a cross-entropy computed here from its logits; greedy ``generate()``
with the KV cache gives the tokens of an argmax loop without it; ``save_pretrained`` /
``from_pretrained`` with transformers alone gives the same logits; and changing the attention
mask changes the logits at the same positions as in the user's model."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import precondfx
from precondfx.integrations.hf import reattach

pytest.importorskip("transformers")
from tests import hf_zoo  # noqa: E402
from tests.batteries.test_models_pytorch import check, main  # noqa: E402

NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in ("mobilevit",) else n
         for n in hf_zoo.BUILDERS]


def _build(name: str):
    return hf_zoo.BUILDERS[name](torch.Generator().manual_seed(1))


def _fwd(kind: str) -> dict:
    return {"use_cache": False} if kind == "causal" else {}


def _pre(name: str, **opts):
    model, batch, kind = _build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res, rep = precondfx.precondition(model, batch, **_fwd(kind), **opts)
    return model, res, rep, batch, kind


def _manual_loss(kind: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss the head computes, written here: next-token CE for causal LMs, CE of every
    target token for seq2seq, CE of the class for classifiers."""
    v = logits.shape[-1]
    if kind == "causal":
        return F.cross_entropy(logits[:, :-1].reshape(-1, v).double(), labels[:, 1:].reshape(-1))
    if kind == "s2s":
        return F.cross_entropy(logits.reshape(-1, v).double(), labels.reshape(-1))
    if kind == "ctc":   # every frame and every label kept (no padding in these batches)
        lp = F.log_softmax(logits.double(), -1).transpose(0, 1)
        n, t = logits.shape[:2]
        return F.ctc_loss(lp, labels, torch.full((n,), t), torch.full((n,), labels.shape[1]),
                          blank=0, reduction="sum")   # Wav2Vec2Config's default
    return F.cross_entropy(logits.double(), labels)



def _logits(model, batch: dict, kind: str) -> torch.Tensor:
    """The main output (logits; a CLIP tower's projected embeddings) in eval mode."""
    with torch.no_grad():
        return main(model.eval()(**batch, **_fwd(kind))).double()


@pytest.mark.parametrize("name", NAMES)
def test_architecture(name: str, tmp_path) -> None:
    """One preconditioning per model, every check of the module docstring on it."""
    model, batch, kind = _build(name)
    user = copy.deepcopy(model)
    res, rep = check(model, batch, fwd=_fwd(kind))
    assert rep.output_scale is not None
    # the model's own loss from labels is the cross-entropy of its logits
    ref = _logits(res, batch, kind)
    if "labels" in batch:
        with torch.no_grad():
            out = res.eval()(**batch, **_fwd(kind))
        assert torch.isfinite(out.loss)
        own, want = float(out.loss), float(_manual_loss(kind, out.logits, batch["labels"]))
        assert abs(own - want) < 1e-5 * max(1.0, abs(want)), (own, want)
    # masking one more position changes the logits where it does in the user's model
    if "attention_mask" in batch:
        b2 = dict(batch, attention_mask=batch["attention_mask"].clone())
        b2["attention_mask"][1, 4] = 0

        def changed(m) -> torch.Tensor:
            a, b = _logits(m, batch, kind), _logits(m, b2, kind)
            d = (a - b).abs() if a.dim() == 2 else (a - b).abs().amax(-1)
            return d > 1e-6 * float(a.abs().max())
        want_c, have_c = changed(user), changed(res)
        # (CLIP's text tower pools one token, which may come before the masked one)
        assert (want_c.any() or kind == "embed") and torch.equal(want_c, have_c), (want_c,
                                                                                   have_c)
    # greedy generate() with the KV cache gives the tokens of an argmax loop without it
    if kind == "causal":
        ids = batch["input_ids"][:2, :6]
        with torch.no_grad():
            gen = res.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                               do_sample=False, use_cache=True, pad_token_id=0)
            cur = ids
            for _ in range(3):
                nxt = res(input_ids=cur, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                cur = torch.cat([cur, nxt], 1)
        assert gen.shape == cur.shape and torch.equal(gen, cur), (gen, cur)
    # checkpoints (to float32 rounding): folded ones reload with transformers alone; raw ones
    # (constants that cannot fold) say why, warn, and load into a model preconditioned alike
    entry = res.config.precondfx
    if entry["checkpoints"] == "folded":
        res.save_pretrained(tmp_path)
        back = type(model).from_pretrained(tmp_path)
        assert not any("precondfx" in n for n, _ in back.named_buffers())
        got = _logits(back, batch, kind)
        assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), name
        # reattach divides the recorded constants back out: the same function again
        again = reattach(type(model).from_pretrained(tmp_path))
        got = _logits(again, batch, kind)
        assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), name
        return
    assert entry["checkpoints"] == "raw" and entry["problems"], entry
    assert name in RAW, entry["problems"]
    with pytest.warns(UserWarning, match="from_pretrained drops"):
        sd = res.state_dict()
    again = copy.deepcopy(res)
    with torch.no_grad():
        for p in again.parameters():
            p.add_(1.0)
    again.load_state_dict(sd)
    got = _logits(again, batch, kind)
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), name


# Checkpoints that keep precondfx_* entries (from_pretrained alone would drop them): Gemma's
# tied embedding / LM head get different scales and its RMSNorm computes (1 + weight) * x, so
# the head's factor cannot move into it; ResNet's max-pool made a strided convolution
# (maxpool='keep' folds).  T5 and Marian fold: their never-called `shared` embedding does not
# constrain the tied weight, and T5's head factor moves through `* d_model**-0.5` to its norm.
RAW = {"gemma", "resnet"}


def test_logits_bias_buffer_carries_the_scale_only_when_exact() -> None:
    """BART adds a buffer (final_logits_bias) to its head's output: the output scale goes on
    the head when doubling the head's output doubles the logits (the buffer is zero, as built),
    and a nonzero bias (a loaded checkpoint's) is refused, not scaled inexactly."""
    from precondfx import PrecondError
    model, batch, _ = _build("bart")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res, rep = precondfx.precondition(model, batch)
    scale = float(res.lm_head.precondfx_output_scale)
    assert abs(scale - rep.output_scale) < 1e-6 and abs(scale - 1) > 0.1
    with torch.no_grad():
        model.final_logits_bias.normal_()
    with pytest.raises(PrecondError, match="loss"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            precondfx.precondition(model, batch)


def test_soft_capped_logits_refuse_an_internal_loss_and_calibrate_without_labels() -> None:
    """Gemma-2 soft-caps its logits after the head (tanh(z / c) * c): no module's output scales
    them exactly, so with labels (a loss inside forward) precondition refuses and says what to
    do; without labels the scale sits on the returned logits and the contract holds."""
    model, batch, _ = hf_zoo.GEMMA2(torch.Generator().manual_seed(1))
    check(model, batch, fwd={"use_cache": False}, must_refuse=True)
    batch.pop("labels")
    res, rep = check(model, batch, fwd={"use_cache": False})
    assert rep.output_scale is not None
