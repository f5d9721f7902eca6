"""Every zoo architecture through precondition: the properties the result must have (issue 2,
point 7) and a status for every node."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import precondfx
from precondfx.core import optable
from tests import zoo
from tests.helpers import all_tensors, call, frozen, main, train_std

NAMES = zoo.names()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def results():
    """Precondition every zoo model once (seed 0); tests below read the results."""
    out = {}
    for name in NAMES:
        model, sample = zoo.build(name)
        before = _state(model)
        pm, rep = precondfx.precondition(model, sample, seed=0, target_std=0.05)
        out[name] = (model, sample, before, pm, rep)
    return out


def test_zoo_has_at_least_15_architectures():
    assert len(zoo.names(include_transformers=False)) >= 15


@pytest.mark.parametrize("name", NAMES)
def test_output_std_hits_target(results, name):
    _, sample, _, pm, rep = results[name]
    std = train_std(pm, sample)  # measured here, independently of the library
    assert abs(std / 0.05 - 1) < 0.02, (name, std)
    assert rep.output_std_after == pytest.approx(std, rel=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_every_node_has_status_and_reason(results, name):
    _, _, _, _, rep = results[name]
    assert len(rep.nodes) > 3
    for r in rep.nodes:
        assert r.status in optable.STATUSES, (r.name, r.status)
        assert len(r.reason) > 10, (r.name, r.reason)
    assert rep.counts().get("weighted", 0) >= 1


@pytest.mark.parametrize("name", NAMES)
def test_user_model_not_mutated(results, name):
    model, _, before, _, _ = results[name]
    after = _state(model)
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert not any(k.startswith("precondfx") or ".precondfx" in k for k in after)


@pytest.mark.parametrize("name", NAMES)
def test_result_is_trainable_and_keeps_keys(results, name):
    model, sample, _, pm, rep = results[name]
    orig_keys = {k for k, _ in model.named_parameters()}
    new_keys = set(pm.state_dict())
    missing = orig_keys - new_keys
    assert not missing, f"parameter keys lost: {sorted(missing)[:5]}"
    if rep.capture == "fx":
        assert isinstance(pm, torch.fx.GraphModule)
    else:
        assert type(pm) is type(model)
    # train / eval switch reaches every submodule
    pm.eval()
    assert not any(m.training for m in pm.modules())
    pm.train()
    assert all(m.training for m in pm.modules())
    # backward: every re-initialized trainable parameter gets a finite gradient
    pm.zero_grad()
    loss = sum(t.float().pow(2).mean() for t in all_tensors(call(pm, sample)))
    loss.backward()
    named = dict(pm.named_parameters())
    reinit = [n for n, p in rep.plan.inits.items() if p.rule not in ("keep",) and n in named]
    with_grad = [n for n in reinit if named[n].grad is not None]
    assert len(with_grad) >= 0.8 * len(reinit)
    for n in with_grad:
        assert torch.isfinite(named[n].grad).all(), n
    # dtype and device kept
    for n, p in pm.named_parameters():
        assert p.dtype == torch.float32 and p.device.type == "cpu", n


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_roundtrip_deepcopy_and_pickle(results, name):
    model, sample, _, pm, rep = results[name]
    with frozen(pm, train=False):
        ref = main(call(pm, sample)).clone()
    buf = io.BytesIO()
    torch.save(pm.state_dict(), buf)
    buf.seek(0)
    fresh, _ = zoo.build(name, seed=5)
    pm2, _ = precondfx.precondition(fresh, sample, seed=7)
    pm2.load_state_dict(torch.load(buf, weights_only=True))
    with frozen(pm2, train=False):
        got = main(call(pm2, sample))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    cp = copy.deepcopy(pm)
    with frozen(cp, train=False):
        torch.testing.assert_close(main(call(cp, sample)), ref, rtol=1e-6, atol=1e-7)
    if "transformers" not in zoo.TAGS.get(name, ()):
        clone = pickle.loads(pickle.dumps(pm))
        with frozen(clone, train=False):
            torch.testing.assert_close(main(call(clone, sample)), ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["mlp", "resnet_bottleneck", "data_dependent", "hf_bert"]
                         if zoo.HAS_TRANSFORMERS else ["mlp", "resnet_bottleneck",
                                                       "data_dependent"])
def test_deterministic_given_seed(name):
    m1, s = zoo.build(name)
    m2, _ = zoo.build(name)
    a, _ = precondfx.precondition(m1, s, seed=3)
    b, _ = precondfx.precondition(m2, s, seed=3)
    c, _ = precondfx.precondition(m2, s, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point()
               and sa[k].numel() > 1)


def test_structured_outputs_are_kept(results):
    _, sample, _, pm, _ = results["two_inputs_dict_out"]
    out = call(pm, sample)
    assert isinstance(out, dict) and set(out) == {"logits", "aux"}
    if zoo.HAS_TRANSFORMERS:
        model, sample, _, pm, _ = results["hf_bert"]
        out = call(pm, sample)
        assert type(out).__name__ == "SequenceClassifierOutput"


def test_capture_methods_reported(results):
    assert results["mlp"][4].capture == "fx"
    rep = results["data_dependent"][4]
    assert rep.capture in ("draft_export", "eager")
    assert any(n.startswith("fx failed") for n in rep.capture_notes)
    assert any(n.startswith("export failed") for n in rep.capture_notes)


def test_inplace_edits_the_users_object():
    model, sample = zoo.build("resnet_bottleneck")
    pm, rep = precondfx.precondition(model, sample, inplace=True, target_std=0.05)
    assert pm is model
    assert abs(train_std(model, sample) / 0.05 - 1) < 0.02


def test_extra_forward_kwargs_reach_the_model():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, scale=1.0):
            if scale != 2.0:
                raise RuntimeError("scale not passed")
            return self.lin(x) * scale

    # seeded, and batches of 256: with 16 unseeded rows the std of a new batch moved 31% from
    # the calibration batch's in one test order (0.0655 for 0.05)
    torch.manual_seed(0)
    pm, rep = precondfx.precondition(M(), torch.randn(256, 8), scale=2.0, target_std=0.05)
    assert abs(train_std(pm, {"x": torch.randn(256, 8), "scale": 2.0}) / 0.05 - 1) < 0.1
