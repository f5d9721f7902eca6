"""The constants on the weight side (issue 21: the result trains as fast as the user's model).

``precondition`` ends by rewriting the fx result so that a constant multiplying a Linear/Conv
layer's input or output is applied to the layer's weight (``apply.weight_side``).  The
reference here is the result the pass built before that rewrite (the old form, constants on
the activations), obtained by running ``precondition`` with the rewrite switched off: the two
must compute the same function and train identically (same losses and gradients over SGD
steps), fold to the same model, keep the user's methods, state_dict, pickling, hooks and
exports working.
"""
from __future__ import annotations

import copy
import io
import operator
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from precondfx.pytorch import pipeline
from precondfx.pytorch.apply import weight_side
from precondfx.pytorch.apply.common import PREFIX
from precondfx.pytorch.measure.conditioning.api import measure_conditioning
from tests.user_models import TimmResNet


def _x(n: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def _model(norm: bool) -> TimmResNet:
    torch.manual_seed(0)
    return TimmResNet(norm=norm, widths=(8, 16, 32), blocks=(1, 2, 1))


def _both(monkeypatch, norm: bool, policy: str = "cheaper", **kw):
    """(old form, new form, report) of the same preconditioning (same seed, same model)."""
    with monkeypatch.context() as mp:
        mp.setattr(pipeline.weight_side, "to_weight_side", lambda gm, policy="cheaper": [])
        old, _ = precondfx.precondition(_model(norm), _x(), maxpool="keep", **kw)
    orig = weight_side.to_weight_side
    with monkeypatch.context() as mp:
        mp.setattr(pipeline.weight_side, "to_weight_side",
                   lambda gm, policy_=policy: orig(gm, policy_))
        new, rep = precondfx.precondition(_model(norm), _x(), maxpool="keep", **kw)
    return old, new, rep


def _const_muls(gm: torch.fx.GraphModule) -> int:
    """mul nodes with a precondfx constant operand."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and
               n.target in (operator.mul, torch.mul) and
               any(isinstance(a, torch.fx.Node) and a.op == "get_attr" and
                   str(a.target).startswith(PREFIX) for a in n.args))


def _train(model: nn.Module, steps: int = 3, compiled: bool = False):
    """Losses and every parameter's gradient over ``steps`` SGD steps."""
    model.train()
    run = torch.compile(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    y = torch.arange(8) % 10
    losses, grads = [], []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(run(_x(seed=10 + s)), y)
        loss.backward()
        losses.append(float(loss))
        grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
        opt.step()
    return losses, grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ||a - b|| / ||b||."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _assert_same_training(a, b, rtol=1e-5):
    la, ga = a
    lb, gb = b
    assert la == pytest.approx(lb, rel=rtol)
    for s, (x, y) in enumerate(zip(ga, gb)):
        assert x.keys() == y.keys()
        for k in x:
            assert _rel(x[k], y[k]) < rtol, (s, k, _rel(x[k], y[k]))


@pytest.mark.parametrize("norm", [True, False], ids=["bn", "normfree"])
@pytest.mark.parametrize("policy", ["cheaper", "weight"])
def test_trains_exactly_like_the_activation_form(monkeypatch, norm, policy):
    old, new, rep = _both(monkeypatch, norm, policy)
    assert isinstance(new, TimmResNet) and rep.graph_module is new
    sites = weight_side.sites(new)
    assert sites, new.code
    # every constant moved is one product less on the activations
    moved = sum(len(n.args[2]) + len(n.args[3]) for n in sites)
    assert _const_muls(new) == _const_muls(old) - moved
    if policy == "weight":      # every layer's constants on its weight: only the output
        # scale is left a product (the main output is the layers' output times it)
        assert _const_muls(new) == 1
        assert [str(a.target) for n in new.graph.nodes if n.target is operator.mul
                for a in n.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"] == \
            [weight_side.OUTPUT_SCALE]
        assert all(n.args[4] and n.args[5] for n in sites)
    with torch.no_grad():
        for mode in ("train", "eval"):
            getattr(old, mode)()
            getattr(new, mode)()
            assert _rel(new(_x(seed=5)), old(_x(seed=5))) < 1e-5
    _assert_same_training(_train(new), _train(old))


def test_cheaper_side_is_chosen_by_the_sample_shapes(monkeypatch):
    """'cheaper': in eager the constant goes to the weight exactly where the layer's weight
    (and bias) has at most as many elements as the activations its products ran over (the
    inputs and outputs measured here by hooks on the user's model run on the sample)."""
    old, new, _ = _both(monkeypatch, norm=True)
    user = _model(True)
    seen = {}
    for name, m in user.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            m.register_forward_hook(lambda mod, a, out, name=name:
                                    seen.__setitem__(name, (a[0].numel(), out.numel())))
    with torch.no_grad():
        user(_x())
    checked = 0
    for n in weight_side.sites(new):
        path = str(n.args[0].target)
        mod = new.get_submodule(path)
        wn = sum(p.numel() for p in mod.parameters())
        act = seen[path][0] * len(n.args[2]) + seen[path][1] * len(n.args[3])
        assert bool(n.args[4]) == (wn <= act), path
        checked += 1
    assert checked >= 5
    # a deep layer of a small batch keeps the product on the activations in eager
    assert any(not n.args[4] for n in weight_side.sites(new)) or _const_muls(new) > 0


def test_fold_and_methods(monkeypatch):
    old, new, rep = _both(monkeypatch, norm=False)
    f_new, f_old = precondfx.fold(new), precondfx.fold(old)
    assert type(f_new) is TimmResNet
    for k, v in f_old.state_dict().items():
        assert torch.allclose(f_new.state_dict()[k], v, rtol=1e-6, atol=1e-7), k
    x = _x(seed=3)
    for m in (new, old, f_new):
        m.eval()
    with torch.no_grad():
        assert torch.allclose(f_new(x), new(x), rtol=1e-5, atol=1e-5)
        # the user's other methods run the user's code with the constants (mirror hooks)
        assert torch.allclose(new.forward_features(x), old.forward_features(x), rtol=1e-5,
                              atol=1e-6)
        assert torch.allclose(new.forward_features(x), f_new.forward_features(x), rtol=1e-4,
                              atol=1e-5)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in new.modules())
    assert rep.result["forward_only"] == []


def test_state_dict_pickle_copy_and_live_constants(monkeypatch):
    old, new, _ = _both(monkeypatch, norm=False)
    assert list(new.state_dict()) == list(old.state_dict())
    assert {k for k, _ in new.named_buffers() if PREFIX in k} == \
        {k for k, _ in old.named_buffers() if PREFIX in k}
    x = _x(seed=4)
    new.eval()
    old.eval()
    n_sites = len(weight_side.sites(new))
    buf = io.BytesIO()
    torch.save(new, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (loaded, copy.deepcopy(new)):
        assert isinstance(other, TimmResNet) and len(weight_side.sites(other)) == n_sites
        other.eval()
        with torch.no_grad():
            assert torch.allclose(other(x), new(x), rtol=1e-6, atol=1e-7)
    # the constants stay live buffers: a changed alpha (a loaded checkpoint, set_constant)
    # acts in the weight-side form exactly as in the product form
    site = next(n for n in weight_side.sites(new) if n.args[2])
    alpha = str(site.args[2][0].target)
    sd = new.state_dict()
    sd[alpha] = sd[alpha] * 3.0
    new.load_state_dict(sd)
    old.load_state_dict(sd)
    with torch.no_grad():
        assert torch.allclose(new(x), old(x), rtol=1e-5, atol=1e-6)
        old_out = old(x)
        new.get_buffer(alpha).fill_(1.0)
        assert not torch.allclose(new(x), old_out, rtol=1e-3, atol=1e-4)


def test_hooks_and_replaced_modules_see_the_module_call(monkeypatch):
    """A hook registered on a rewritten layer fires and sees the input the product form gives
    it (the constant applied); a layer replaced after preconditioning is called."""
    old, new, _ = _both(monkeypatch, norm=False)
    site = next(n for n in weight_side.sites(new) if n.args[2] and n.args[4])
    path = str(site.args[0].target)
    got = {}

    def pre(tag):
        return lambda m, a: got.__setitem__(tag, a[0].detach().clone())
    x = _x(seed=6)
    hs = [new.get_submodule(path).register_forward_pre_hook(pre("new")),
          old.get_submodule(path).register_forward_pre_hook(pre("old"))]
    new.eval()
    old.eval()
    with torch.no_grad():
        assert torch.allclose(new(x), old(x), rtol=1e-5, atol=1e-6)
    assert torch.allclose(got["new"], got["old"], rtol=1e-6, atol=1e-7)
    for h in hs:
        h.remove()
    # replaced by a wrapper (as LoRA or quantization tools do): the wrapper runs
    for m in (new, old):
        parent, _, leaf = path.rpartition(".")
        inner = m.get_submodule(path)
        setattr(m.get_submodule(parent) if parent else m, leaf,
                nn.Sequential(inner, nn.Dropout(0.0)))
    with torch.no_grad():
        assert torch.allclose(new(x), old(x), rtol=1e-5, atol=1e-6)
    assert isinstance(new.get_submodule(path), nn.Sequential)


def test_compiled_and_exported(monkeypatch):
    old, new, _ = _both(monkeypatch, norm=False)
    ref = _train(copy.deepcopy(old), steps=2)
    _assert_same_training(_train(copy.deepcopy(new), steps=2, compiled=True), ref, rtol=1e-4)
    new.eval()
    x = _x(seed=7)
    with torch.no_grad():
        want = new(x)
        ep = torch.export.export(new, (x,))
        assert torch.allclose(ep.module()(x), want, rtol=1e-5, atol=1e-6)
        traced = torch.jit.trace(new, (x,))
        assert torch.allclose(traced(x), want, rtol=1e-5, atol=1e-6)


def test_measurement_hooks_see_the_product_form(monkeypatch):
    """``measure_conditioning`` hooks the layers: on the weight-side form it measures what it
    measures on the product form."""
    old, new, _ = _both(monkeypatch, norm=False)
    kw = dict(stats=("gr",), n_samples=2, n_probes=1, seed=0, verbose=False)
    a = measure_conditioning(new, _x(4), **kw)
    b = measure_conditioning(old, _x(4), **kw)
    assert len(a.layers) == len(b.layers) > 3
    for la, lb in zip(a.layers, b.layers):
        assert la.gr.mean == pytest.approx(lb.gr.mean, rel=1e-4), la


def test_module_call_form_round_trip(monkeypatch):
    """``to_module_calls`` restores the product form: the same products and module calls as
    the pass built."""
    old, new, _ = _both(monkeypatch, norm=False, policy="weight")
    g = copy.deepcopy(new.graph)
    assert weight_side.to_module_calls(g) == len(weight_side.sites(new))
    view = torch.fx.GraphModule(new, g)
    assert _const_muls(view) == _const_muls(old)
    calls = sorted(str(n.target) for n in g.nodes if n.op == "call_module")
    assert calls == sorted(str(n.target) for n in old.graph.nodes if n.op == "call_module")


# -- the eager back end (hooks): a weight-side forward on the layers ---------------------------
def _both_eager(monkeypatch, model_fn, sample, **kw):
    with monkeypatch.context() as mp:
        mp.setattr(pipeline, "weight_side_forwards", lambda model: [])
        old, _ = precondfx.precondition(model_fn(), sample, **kw)
    new, rep = precondfx.precondition(model_fn(), sample, **kw)
    return old, new, rep


def _own_forwards(m: nn.Module) -> list[str]:
    return [n for n, mod in m.named_modules() if "forward" in vars(mod)]


def test_eager_back_end_trains_exactly_like_the_hooks(monkeypatch):
    old, new, rep = _both_eager(monkeypatch, lambda: _model(False), _x(), maxpool="keep",
                                capture="eager")
    assert rep.capture == "eager" and type(new) is TimmResNet
    assert weight_side.sites(new) == [] and _own_forwards(old) == []
    fw = _own_forwards(new)
    # every Conv/Linear carrying only scale hooks, whose weight is at most the activation
    # (all of them at this batch but the deepest convolutions)
    assert "conv1" in fw and "fc" in fw and len(fw) >= 5
    # the hooks stay (they apply the constants where the forward does not)
    assert all(new.get_submodule(p)._forward_pre_hooks or new.get_submodule(p)._forward_hooks
               for p in fw)
    with torch.no_grad():
        for mode in ("train", "eval"):
            getattr(old, mode)()
            getattr(new, mode)()
            assert _rel(new(_x(seed=5)), old(_x(seed=5))) < 1e-5
    _assert_same_training(_train(copy.deepcopy(new)), _train(copy.deepcopy(old)))
    # copies keep the forward, bound to their own layer; fold removes it
    for other in (copy.deepcopy(new), torch.load(_saved(new), weights_only=False)):
        assert _own_forwards(other) == fw
        assert all(vars(mod)["forward"].args[0] is mod for mod in other.modules()
                   if "forward" in vars(mod))
    folded = precondfx.fold(new)
    assert _own_forwards(folded) == [] and type(folded) is TimmResNet
    new.eval()
    folded.eval()
    with torch.no_grad():
        assert _rel(folded(_x(seed=6)), new(_x(seed=6))) < 1e-5


def _saved(m: nn.Module) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return buf


def test_eager_back_end_hooks_see_the_scaled_input(monkeypatch):
    """A user's hook on a layer gets what the hooks-only result gave it (the input already
    scaled by precondfx's pre-hook, registered first); the output is unchanged."""
    old, new, _ = _both_eager(monkeypatch, lambda: _model(False), _x(), maxpool="keep",
                              capture="eager")
    path = "conv1"
    assert path in _own_forwards(new)
    got = {}
    for tag, m in (("new", new), ("old", old)):
        m.eval()
        m.get_submodule(path).register_forward_pre_hook(
            lambda mod, a, tag=tag: got.__setitem__(tag, a[0].detach().clone()))
    x = _x(seed=8)
    with torch.no_grad():
        assert _rel(new(x), old(x)) < 1e-5
    assert torch.equal(got["new"], got["old"])
    assert not torch.allclose(got["new"], x)      # the constant was applied


def test_eager_back_end_transformers_tied_embedding(monkeypatch):
    """GPT-2 (export capture, the eager back end): the tied embedding and head, the per-block
    Conv1D layers; same loss and gradients as the hooks-only result."""
    tf = pytest.importorskip("transformers")

    def make():
        torch.manual_seed(0)
        cfg = tf.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=97, n_positions=32,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(0))
    old, new, rep = _both_eager(monkeypatch, make, {"input_ids": ids}, use_cache=False)
    assert not isinstance(new, torch.fx.GraphModule)
    fw = _own_forwards(new)
    assert "transformer.wte" in fw and "lm_head" in fw and \
        any(p.endswith("attn.c_attn") for p in fw)
    res = []
    for m in (new, old):
        m.train()
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        res.append((float(loss), {k: p.grad.clone() for k, p in m.named_parameters()}))
    assert res[0][0] == pytest.approx(res[1][0], rel=1e-6)
    for k, g in res[1][1].items():
        assert _rel(res[0][1][k], g) < 1e-5, k
    folded = precondfx.fold(new)
    assert _own_forwards(folded) == []
    new.eval()
    folded.eval()
    with torch.no_grad():
        a = new(input_ids=ids, use_cache=False).logits
        b = folded(input_ids=ids, use_cache=False).logits
    assert _rel(b, a) < 1e-5


def test_eager_back_end_compiled(monkeypatch):
    """Under torch.compile the eager back end's layers put the constants on their weights too
    (the traced graph multiplies weights, not activations, for the layers whose weight is at
    most the activation) and train like the hooks-only result."""
    old, new, _ = _both_eager(monkeypatch, lambda: _model(False), _x(), maxpool="keep",
                              capture="eager")
    import torch._dynamo
    torch._dynamo.reset()
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward
    new.eval()
    with torch.no_grad():
        out = torch.compile(copy.deepcopy(new), backend=backend)(_x(seed=9))
        assert _rel(out, new(_x(seed=9))) < 1e-5
    code = "\n".join(g.code for g in graphs)
    # the weight times its input scale, or times the product of its constants (s: the lr
    # multiplier lr='auto' places, times the input scale)
    assert len(re.findall(r"parameters_weight_ \* (\S+in_scale|s\b|s_\d+)", code)) >= 3, code
    torch._dynamo.reset()
    _assert_same_training(_train(copy.deepcopy(new), steps=2, compiled=True),
                          _train(copy.deepcopy(old), steps=2), rtol=1e-4)
