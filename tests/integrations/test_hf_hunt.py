"""transformers architectures and uses found by an adversarial hunt (tiny configs, offline).

Each test failed before the fix it names:

* a tied head with a bias (BERT's masked-LM ``decoder``, whose bias is also held by its parent
  ``cls.predictions``, which never reads it): checkpoints stayed raw, so ``from_pretrained``
  gave other logits;
* a tied head behind a norm whose output the export follows with a dtype assertion
  (``CohereLayerNorm``'s ``weight.to(float32) * x``): raw checkpoints;
* a residual scale on a dropout after transformers' ``Conv1D`` captured as ``addmm``
  (OpenAI GPT's post-norm blocks): raw checkpoints;
* a decoder's sequence classifier, which pools the last token's logits by indexing
  (``logits[arange(b), last]``): refused with labels;
* ``resize_token_embeddings`` on an untied result built a new ``lm_head`` without its
  constants: the logits of the old vocabulary changed silently.
"""
from __future__ import annotations

import copy
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
_DEC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=64, vocab_size=V, max_position_embeddings=32, bos_token_id=0,
            eos_token_id=0, pad_token_id=0)


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


def test_tied_masked_lm_head_with_a_bias_folds(tmp_path) -> None:
    torch.manual_seed(0)
    model = tf.BertForMaskedLM(tf.BertConfig(**_ENC))
    head = model.cls.predictions
    assert head.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert head.decoder.bias is head.bias         # the parent holds it, only decoder reads it
    ids = _ids()
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    res, rep = _pre(model, {**batch, "labels": ids})
    assert abs(float(_logits(res, batch).std()) - 1.0) < 0.05
    _reloads(res, batch, tmp_path)
    # the tie is kept and the model's own loss is the cross-entropy of its logits
    assert res.cls.predictions.decoder.weight is res.bert.embeddings.word_embeddings.weight
    with torch.no_grad():
        out = res.eval()(**batch, labels=ids)
    want = F.cross_entropy(out.logits.reshape(-1, V).double(), ids.reshape(-1))
    assert abs(float(out.loss) - float(want)) < 1e-5


def test_tied_head_behind_a_norm_with_a_dtype_assertion_folds(tmp_path) -> None:
    torch.manual_seed(0)
    model = tf.CohereForCausalLM(tf.CohereConfig(logit_scale=0.5, tie_word_embeddings=True,
                                                 **_DEC))
    ids = _ids()
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    res, _ = _pre(model, {**batch, "labels": ids}, use_cache=False)
    assert res.lm_head.weight is res.model.embed_tokens.weight
    _reloads(res, batch, tmp_path, use_cache=False)


def test_residual_scale_after_a_conv1d_captured_as_addmm_folds(tmp_path) -> None:
    torch.manual_seed(0)
    model = tf.OpenAIGPTLMHeadModel(tf.OpenAIGPTConfig(
        n_embd=32, n_layer=2, n_head=2, vocab_size=V, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))
    ids = _ids()
    batch = {"input_ids": ids}
    res, _ = _pre(model, {**batch, "labels": ids})
    scaled = [n for n, b in res.named_buffers() if n.endswith("dropout.precondfx_out_scale")
              and abs(float(b) - 1.0) > 0.1]
    assert scaled    # the residual branch scales sit on the dropouts after c_proj
    _reloads(res, batch, tmp_path)


def test_decoder_sequence_classifier_pooling_by_index_takes_labels(tmp_path) -> None:
    torch.manual_seed(0)
    model = tf.LlamaForSequenceClassification(tf.LlamaConfig(num_labels=3, **_DEC))
    ids = _ids()
    labels = torch.tensor([0, 2, 1, 2])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    user = copy.deepcopy(model)
    res, rep = _pre(model, {**batch, "labels": labels}, use_cache=False)
    assert float(res.score.precondfx_output_scale) == pytest.approx(rep.output_scale)
    logits = _logits(res, batch, use_cache=False)
    assert abs(float(logits.std()) - 1.0) < 0.1
    assert logits.std() > 5 * _logits(user, batch, use_cache=False).std()
    with torch.no_grad():
        out = res.eval()(**batch, labels=labels, use_cache=False)
    want = F.cross_entropy(out.logits.double(), labels)
    assert abs(float(out.loss) - float(want)) < 1e-5
    _reloads(res, batch, tmp_path, use_cache=False)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("copy_by", ["deepcopy", "torch.save"])
def test_resize_token_embeddings_keeps_the_constants(tied: bool, copy_by: str, tmp_path) -> None:
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(tie_word_embeddings=tied, **_DEC))
    ids = _ids()
    res, rep = _pre(model, {"input_ids": ids}, use_cache=False)
    if copy_by == "deepcopy":   # a copy keeps the behaviour
        res = copy.deepcopy(res)
    else:                       # so does a pickled one (torch.save of the whole model)
        torch.save(res, tmp_path / "whole.pt")
        res = torch.load(tmp_path / "whole.pt", weights_only=False)
    before = _logits(res, {"input_ids": ids}, use_cache=False)
    res.resize_token_embeddings(V + 8)
    after = _logits(res, {"input_ids": ids}, use_cache=False)
    assert after.shape[-1] == V + 8
    # the old vocabulary's logits are unchanged: input and output scales moved to the new head
    assert float((after[..., :V] - before).abs().max()) <= 1e-6 * float(before.abs().max())
    assert float(res.lm_head.precondfx_output_scale) == pytest.approx(rep.output_scale)
    assert (res.lm_head.weight is res.model.embed_tokens.weight) == tied
    _reloads(res, {"input_ids": ids}, tmp_path, use_cache=False)
    assert "set_output_embeddings" not in vars(precondfx.fold(res))


def test_question_answering_head_split_into_start_and_end_takes_positions(tmp_path) -> None:
    """One module's output is cut into start and end logits: the output scale sits on that
    module, so the model's own loss (the mean of both cross-entropies) sees it, and the end
    logits carry the same factor (the checkpoint reloads both)."""
    torch.manual_seed(0)
    model = tf.BertForQuestionAnswering(tf.BertConfig(**_ENC))
    ids = _ids()
    pos = {"start_positions": torch.tensor([1, 5, 7, 2]),
           "end_positions": torch.tensor([3, 6, 9, 11])}
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    res, rep = _pre(model, {**batch, **pos})
    assert float(res.qa_outputs.precondfx_output_scale) == pytest.approx(rep.output_scale)
    with torch.no_grad():
        out = res.eval()(**batch, **pos)
    assert abs(float(out.start_logits.std()) - 1.0) < 0.05
    want = (F.cross_entropy(out.start_logits.double(), pos["start_positions"]) +
            F.cross_entropy(out.end_logits.double(), pos["end_positions"])) / 2
    assert abs(float(out.loss) - float(want)) < 1e-5
    assert res.config.precondfx["checkpoints"] == "folded"
    res.save_pretrained(tmp_path)
    with torch.no_grad():
        back = type(res).from_pretrained(tmp_path).eval()(**batch)
    for k in ("start_logits", "end_logits"):
        ref = getattr(out, k)
        assert float((getattr(back, k) - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
