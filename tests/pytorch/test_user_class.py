"""The result of ``precondition`` is the user's model (issue 21, item 1): an instance of the user's
class, with its methods and attributes, whatever the capture method; every method computes with
the constants; the rewritten GraphModule is available (``report.graph_module``) and is itself of
the user's class.

timm and torchvision cannot import here: ``tests.user_models.TimmResNet`` is a small stand-in
with timm's ``ResNet`` interface; transformers models are built from tiny configs
(``tests.hf_tiny``).
"""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from precondfx.pytorch.apply.common import PREFIX
from tests.user_models import BasicBlock, Branchy, TimmResNet


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def _pre(model: nn.Module, **kw):
    torch.manual_seed(0)
    return precondfx.precondition(model, _x(), **kw)


def _consts(m: nn.Module) -> set[str]:
    return {k for k in m.state_dict() if PREFIX in k}


# -- the fx path: a GraphModule of the user's class ---------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"norm": False}, {"norm": False, "functional_relu": True}],
                         ids=["bn", "normfree", "normfree_frelu"])
def test_fx_result_is_the_users_class_and_methods_see_the_constants(kw):
    model = TimmResNet(**kw)
    pm, rep = _pre(model, input_scale=0.5)
    assert rep.capture == "fx"
    assert isinstance(pm, TimmResNet) and isinstance(pm, torch.fx.GraphModule)
    assert rep.graph_module is pm and rep.result["is_user_class"]
    assert rep.result["forward_only"] == [], rep.result
    # the user's blocks keep their class (the user's code runs inside them)
    assert type(pm.layer1[0]) is BasicBlock
    # attributes
    assert pm.pretrained_cfg == model.pretrained_cfg and pm.num_classes == 10
    assert pm.get_classifier() is pm.fc
    x = _x(1)
    for mode in ("train", "eval"):
        getattr(pm, mode)()
        torch.manual_seed(3)
        with torch.no_grad():
            feats = pm.forward_features(x)
            via_methods = pm.forward_head(feats)
            whole = pm(x)
        assert torch.allclose(via_methods, whole, rtol=1e-5, atol=1e-6), mode
        assert feats.shape == (8, 8, 8, 8)
    # the hooks that apply them exist only while a method runs: training runs none
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in pm.modules())
    # the methods do compute with the constants: the same code and weights without them differs
    plain = TimmResNet(**kw)
    plain.load_state_dict({k: v for k, v in pm.state_dict().items() if PREFIX not in k},
                          strict=False)
    plain.maxpool = pm.maxpool
    plain.eval()
    pm.eval()
    with torch.no_grad():
        gap = (plain.forward_features(x) - pm.forward_features(x)).abs().max()
    assert float(gap) > 1e-3
    # the constants are visible in the graph the forward runs
    assert PREFIX in pm.code
    # forward_features is the graph's own intermediate (the value the head's mean reads), and
    # fx's Interpreter runs the graph as forward does (the methods' hooks stay off)
    seen = {}

    class Rec(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_method" and n.target == "mean":
                seen["feats"] = self.env[n.args[0]]
            return out
    with torch.no_grad():
        ran = Rec(pm).run(x)
        assert torch.allclose(ran, pm(x), rtol=1e-6, atol=1e-7)
        feats = pm.forward_features(x)
        # float32 rounding: the forward applies the constants on the weights, the method on
        # the activations (2.4e-6 apart at features of size 5.3), so atol is relative to them
        assert torch.allclose(seen["feats"], feats, rtol=1e-5,
                              atol=1e-6 * float(feats.abs().max()))


def test_fx_methods_equal_the_folded_model():
    """An independent check of the constants the methods see: ``fold`` multiplies them into
    the weights of a plain model of the user's class (maxpool kept, so it folds)."""
    pm, rep = _pre(TimmResNet(norm=False), maxpool="keep", input_scale=None)
    assert isinstance(pm, TimmResNet)
    folded = precondfx.fold(pm)
    assert type(folded) is TimmResNet and not _consts(folded)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in folded.modules())
    x = _x(2)
    pm.eval()
    folded.eval()
    with torch.no_grad():
        assert torch.allclose(pm.forward_features(x), folded.forward_features(x), rtol=1e-4,
                              atol=1e-5)
        assert torch.allclose(pm(x), folded(x), rtol=1e-4, atol=1e-5)


def test_fx_keeps_parameter_names_and_state_dict_keys():
    model = TimmResNet()
    pm, _ = _pre(model, maxpool="keep")
    assert [n for n, _ in pm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert set(pm.state_dict()) - _consts(pm) == set(model.state_dict())
    # a state_dict round trip into another result, and into the user's class (folded)
    pm2, _ = _pre(TimmResNet(), maxpool="keep", seed=5)
    pm2.load_state_dict(pm.state_dict())
    x = _x(3)
    pm.eval()
    pm2.eval()
    with torch.no_grad():
        assert torch.equal(pm(x), pm2(x)) and torch.equal(pm.forward_features(x),
                                                         pm2.forward_features(x))


def test_fx_deepcopy_pickle_compile_keep_class_and_methods():
    pm, _ = _pre(TimmResNet(norm=False))
    pm.eval()
    x = _x(4)
    with torch.no_grad():
        want, feats = pm(x), pm.forward_features(x)
    buf = io.BytesIO()
    torch.save(pm, buf)
    buf.seek(0)
    copies = [copy.deepcopy(pm), pickle.loads(pickle.dumps(pm)),
              torch.load(buf, weights_only=False)]
    for c in copies:
        assert isinstance(c, TimmResNet) and isinstance(c, torch.fx.GraphModule)
        assert c.pretrained_cfg == pm.pretrained_cfg
        with torch.no_grad():
            assert torch.equal(c(x), want)
            assert torch.equal(c.forward_features(x), feats)
        # the copy's hooks read the copy's constants, not the original's (a constant the
        # features use: not the head's, and in a fixed order, not a set's hash order)
        name = min(n for n in _consts(c) if "_fc" not in n)
        with torch.no_grad():
            c.get_buffer(name).mul_(2.0)
            assert not torch.equal(c.forward_features(x), feats) or "output" in name
    compiled = torch.compile(pm)
    with torch.no_grad():
        assert torch.allclose(compiled(x), want, rtol=1e-4, atol=1e-5)


def test_fx_training_step_moves_the_same_parameters():
    model = TimmResNet(norm=False)
    pm, _ = _pre(model)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    loss = F.cross_entropy(pm(_x(5)), torch.arange(8) % 10)
    loss.backward()
    opt.step()
    moved = {n for n, p in pm.named_parameters() if not torch.equal(p, before[n])}
    assert moved == set(before)   # every parameter, the replacement pool conv included


def test_fx_reset_classifier_and_user_attributes():
    pm, _ = _pre(TimmResNet())
    pm.reset_classifier(4)
    assert pm.num_classes == 4 and isinstance(pm, TimmResNet)
    pm.eval()
    with torch.no_grad():
        out = pm(_x())
        assert out.shape == (8, 4)
        # the new head carries the same constants in forward (the graph) and in the methods
        assert torch.allclose(pm.forward_head(pm.forward_features(_x())), out, rtol=1e-5,
                              atol=1e-6)


def test_fx_functional_sites_are_reported_not_silent():
    """A functional max-pool in forward_features is replaced in the graph only: the method
    cannot see it, and the report says so."""
    pm, rep = _pre(TimmResNet(functional_pool=True))
    assert isinstance(pm, TimmResNet) and rep.result["is_user_class"]
    only = rep.result["forward_only"]
    assert len(only) == 1 and "max_pool2d" in only[0]
    assert "only its forward applies 1 change" in rep.table(width=200)
    assert "forward_only" in rep.to_dict()["result"]


# -- the eager path (data-dependent branch): the user's module itself ----------------------------
def test_eager_result_is_the_users_class_with_methods():
    model = Branchy(norm=False)
    pm, rep = _pre(model)
    assert rep.capture != "fx" and rep.graph_module is None
    assert type(pm) is Branchy and rep.result["is_user_class"] and not rep.result["graph_module"]
    assert pm.pretrained_cfg == model.pretrained_cfg
    pm.eval()
    x = _x(6)
    with torch.no_grad():
        assert torch.allclose(pm.forward_head(pm.forward_features(x)), pm(x), rtol=1e-5,
                              atol=1e-6)
    assert set(pm.state_dict()) - _consts(pm) >= set(model.state_dict())


def test_eager_input_scale_on_the_root_is_reported():
    _, rep = _pre(Branchy(norm=False), input_scale=0.5)
    assert any("precondfx_input_scale" in s for s in rep.result["forward_only"])


# -- transformers --------------------------------------------------------------------------------
def test_gpt2_generate_sees_the_output_scale():
    pytest.importorskip("transformers")
    from tests import hf_tiny
    model, batch = hf_tiny.build("gpt2", dropout=False)
    ids = batch["input_ids"]
    pm, rep = precondfx.precondition(model, {"input_ids": ids}, use_cache=False)
    assert isinstance(pm, type(model)) and rep.result["is_user_class"]
    assert rep.result["forward_only"] == []
    assert abs(rep.output_scale - 1.0) > 1e-3
    pm.eval()
    prompt = ids[:, :5]
    out = pm.generate(prompt, max_new_tokens=3, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        logits = pm(prompt).logits[:, -1]
    assert torch.allclose(out.logits[0], logits, rtol=1e-4, atol=1e-5)
    # greedy decoding by hand with the result's forward gives the same tokens
    seq = prompt
    for _ in range(3):
        with torch.no_grad():
            nxt = pm(seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out.sequences, seq)


def test_bert_submodules_and_head_compose_to_the_forward():
    pytest.importorskip("transformers")
    from tests import hf_tiny
    model, batch = hf_tiny.build("bert", dropout=False)
    ids = batch["input_ids"]
    pm, rep = precondfx.precondition(model, {"input_ids": ids})
    assert isinstance(pm, type(model)) and rep.result["is_user_class"]
    assert pm.config.num_labels == 3
    pm.eval()
    with torch.no_grad():
        pooled = pm.bert(input_ids=ids).pooler_output
        assert torch.allclose(pm.classifier(pm.dropout(pooled)), pm(input_ids=ids).logits,
                              rtol=1e-5, atol=1e-6)


def _count_saves(module, state_dict, prefix, local_metadata) -> None:
    module.saves += 1


class _Counted(TimmResNet):
    """A user state_dict hook on a leaf (fx keeps it) counting the saves."""

    def __init__(self) -> None:
        super().__init__()
        self.fc.saves = 0
        self.fc.register_state_dict_post_hook(_count_saves)


def test_fx_user_state_dict_hook_keeps_working():
    pm, rep = _pre(_Counted())
    assert rep.capture == "fx" and isinstance(pm, _Counted)
    before = pm.fc.saves
    pm.state_dict()
    assert pm.fc.saves == before + 1


class _Final(TimmResNet):
    """A class that refuses subclasses: the GraphModule cannot be of it."""

    def __init_subclass__(cls, **kw):
        raise TypeError("_Final cannot be subclassed")


def test_fx_result_that_cannot_be_the_users_class_says_so():
    with pytest.warns(RuntimeWarning, match="not your class _Final"):
        pm, rep = _pre(_Final())
    assert isinstance(pm, torch.fx.GraphModule) and not isinstance(pm, _Final)
    assert rep.result["is_user_class"] is False and "cannot be combined" in rep.result["note"]
    assert "not your class _Final" in rep.table(width=200)
