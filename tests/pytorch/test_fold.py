"""precondfx.fold: a plain model of the user's class with every constant folded into the
weights (same function, same state_dict keys, no hooks, no extra buffers), refusals that name
the constant and why, and transformers checkpoints that keep the preconditioned function."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import precondfx
from precondfx import PrecondError
from tests import zoo
from precondfx.pytorch.capture.common import main_output, make_sample
from tests.helpers import frozen


def _out(model: nn.Module, sample) -> torch.Tensor:
    with frozen(model, train=False):
        return main_output(make_sample(sample, None).call(model)).double().clone()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _plain(model: nn.Module) -> None:
    """No precondfx object anywhere: no buffers, hooks or attributes, and a pickle of it names
    nothing of precondfx (so loading it does not import precondfx)."""
    assert not any("precondfx" in n for n, _ in model.named_buffers())
    for m in model.modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_state_dict_hooks",
                     "_load_state_dict_pre_hooks"):
            assert not getattr(m, attr), (m, attr)
    # the demo's classes (zoo mlp, maxpool_cnn) live in precondfx.demo: that is the user's class
    assert b"precondfx" not in pickle.dumps(model).replace(b"precondfx.demo", b"")


@pytest.mark.parametrize("name", ["mlp", "resnet_bottleneck", "vit_mha", "unet",
                                  "data_dependent", "gru_classifier"])
def test_fold_is_the_same_function_in_the_users_class(name: str) -> None:
    model, sample = zoo.build(name)
    result, report = precondfx.precondition(model, sample, maxpool="keep")
    folded = precondfx.fold(result)
    assert type(folded) is type(model)
    assert list(folded.state_dict()) == list(model.state_dict())
    assert _rel(_out(folded, sample), _out(result, sample)) < 1e-6
    _plain(folded)
    # the preconditioned model is untouched and still carries its constants
    assert any("precondfx" in n for n, _ in result.named_buffers())


def test_fold_of_an_fx_result_works_after_deepcopy_and_needs_source_after_pickle() -> None:
    model, sample = zoo.build("resnet_bottleneck")
    result, report = precondfx.precondition(model, sample, maxpool="keep")
    assert report.capture == "fx"
    ref = _out(result, sample)
    assert _rel(_out(precondfx.fold(copy.deepcopy(result)), sample), ref) < 1e-6
    clone = pickle.loads(pickle.dumps(result))
    with pytest.raises(PrecondError, match="source="):
        precondfx.fold(clone)
    fresh, _ = zoo.build("resnet_bottleneck", seed=9)
    assert _rel(_out(precondfx.fold(clone, source=fresh), sample), ref) < 1e-6


def test_unfoldable_constants_are_named() -> None:
    model, sample = zoo.build("maxpool_cnn")
    result, _ = precondfx.precondition(model, sample)      # maxpool='stride' changes structure
    problems = precondfx.fold_problems(result)
    assert any("maxpool" in w and "maxpool='keep'" in why for w, why in problems)
    with pytest.raises(PrecondError, match="maxpool"):
        precondfx.fold(result)
    # a tied weight whose users need different factors (the decoder has a bias: nothing can
    # take the difference)
    model, sample = zoo.build("lstm_lm")
    result, _ = precondfx.precondition(model, sample)
    with pytest.raises(PrecondError, match="tied weight"):
        precondfx.fold(result)
    # the input scale multiplies the model's inputs
    model, sample = zoo.build("mlp")
    result, _ = precondfx.precondition(model, sample, input_scale=0.5, capture="eager")
    assert any("input scale" in why for _, why in precondfx.fold_problems(result))


def test_shared_module_called_with_different_scales() -> None:
    """One scale per weight (measured balancing) folds; LSUV's per-call scales cannot."""
    model, sample = zoo.build("shared_module")
    result, _ = precondfx.precondition(model, sample, maxpool="keep")
    folded = precondfx.fold(result)
    assert _rel(_out(folded, sample), _out(result, sample)) < 1e-6
    result, _ = precondfx.precondition(model, sample, maxpool="keep", scheme="lsuv")
    problems = precondfx.fold_problems(result)
    assert any("called 2 times with different input scales" in why for _, why in problems)


def test_fold_of_a_tied_language_model_passes_the_scale_upstream() -> None:
    """GPT-2's lm_head shares the embedding: the output scale goes into ln_f instead."""
    pytest.importorskip("transformers")
    from tests import hf_tiny
    model, batch = hf_tiny.build("gpt2")
    result, _ = precondfx.precondition(model, batch, use_cache=False)
    factors = precondfx.pytorch.folding.fold_factors(result)
    assert "transformer.ln_f.weight" in factors and "lm_head.weight" not in factors
    folded = precondfx.fold(result)
    assert folded.lm_head.weight is folded.transformer.wte.weight
    with torch.no_grad():
        a = result.eval()(**batch, use_cache=False)
        b = folded.eval()(**batch, use_cache=False)
    assert _rel(b.logits.double(), a.logits.double()) < 1e-6
    assert abs(float(a.loss) - float(b.loss)) < 1e-5
