"""lr_scale='auto' (the default): 'user' where precondfx would store the median weight at least
AUTO_RATIO times larger than the init std the model declares (transformers' initializer_range),
off elsewhere; the ratios are recomputed here from Eq. 7 and the declared std, never read back
from the code under test."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import precondfx
from precondfx.core.lr_mode import AUTO_RATIO
from tests import zoo
from tests.helpers import rms

needs_hf = pytest.mark.skipif(not zoo.HAS_TRANSFORMERS, reason="transformers not installed")


def _mlp(std: float | None = None, widths=(64, 128, 128, 10), seed: int = 0) -> nn.Sequential:
    """An MLP with PyTorch's default init, or every weight drawn N(0, std^2) (biases 0)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    m = nn.Sequential(*layers[:-1])
    if std is not None:
        with torch.no_grad():
            for mod in m:
                if isinstance(mod, nn.Linear):
                    mod.weight.normal_(0, std)
                    mod.bias.zero_()
    return m


@pytest.mark.parametrize("std", [None, 0.01])
def test_model_without_declared_init_is_left_alone(std) -> None:
    """A plain PyTorch model declares no init (PyTorch's default, or weights drawn at 0.01 by
    the user): 'auto' adds nothing, no note, the lr_scale=None result exactly (lr=None: the
    lr multipliers lr='auto' places are tested in test_first_step.py)."""
    m = _mlp(std)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    out, rep = precondfx.precondition(m, x, balance="analytic", lr=None)
    off, _ = precondfx.precondition(m, x, balance="analytic", lr_scale=None, lr=None)
    assert rep.plan.lr_mode is None and "lr_scale" not in rep.conditioning
    assert not any(n.startswith("lr_scale") for n in rep.plan.notes)
    assert not any("precondfx_lr" in n for n, _ in out.named_buffers())
    for (a, p), (b, q) in zip(out.state_dict().items(), off.state_dict().items()):
        assert a == b and torch.equal(p, q)


def _gpt2(init: float = 0.02, n_embd: int = 32, device: str = "cpu"):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=n_embd, n_layer=1, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=init)
    torch.manual_seed(0)
    with torch.device(device):
        return GPT2LMHeadModel(cfg)


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))


def _eq7(lay) -> float:
    """Eq. 7's stored std of a linear layer's weight: sqrt(2 / sqrt(n_in n_out)) / alpha."""
    return math.sqrt(2.0 / (lay.k2 * math.sqrt(lay.n_in * lay.n_out))) / lay.constant()


@needs_hf
def test_transformers_declared_std_stores_halfway_same_logits() -> None:
    """transformers' initializer_range 0.02 at n_embd 32: 'user' with the declared std; logits
    equal the lr_scale=None result's; each Conv1D stored near sqrt(Eq. 7's std x 0.02): the
    lr_scale=None result's weight divided by (Eq. 7 std / 0.02)^0.5 rounded to a power of
    two."""
    m, x = _gpt2(), _ids()
    out, rep = precondfx.precondition(m, x, use_cache=False, balance="analytic")
    off, _ = precondfx.precondition(m, x, use_cache=False, balance="analytic", lr_scale=None)
    assert rep.plan.lr_mode == "user"
    note = next(n for n in rep.plan.notes if n.startswith("lr_scale='auto'"))
    lin = [lay for lay in rep.plan.layers if lay.kind == "linear" and "lm_head" not in lay.node]
    ratios = sorted(_eq7(lay) / 0.02 for lay in lin)
    assert min(ratios) > AUTO_RATIO and "-> 'user'" in note
    assert "lr_scale='auto' -> 'user'" in rep.table(width=150)      # the report says why
    with torch.no_grad():
        a, b = out(x, use_cache=False).logits, off(x, use_cache=False).logits
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    o, w = dict(off.named_parameters()), dict(out.named_parameters())
    for lay in lin:
        c = 2.0 ** round(math.log2(math.sqrt(_eq7(lay) / 0.02)))   # nearest power of two
        assert rms(w[lay.weight]) == pytest.approx(rms(o[lay.weight]) / c, rel=1e-5)


@needs_hf
@pytest.mark.parametrize("side", [0.9, 1.1])
def test_threshold(side: float) -> None:
    """The decision flips at AUTO_RATIO: initializer_range set so that the median ratio of
    Eq. 7's std to it is 0.9x or 1.1x the threshold."""
    x = _ids()
    plan = precondfx.analyze(_gpt2(), x, use_cache=False, balance="analytic",
                             lr_scale=None).plan
    stds = sorted(plan.inits[w].std for w in dict.fromkeys(lay.weight for lay in plan.layers)
                  if plan.inits[w].std)         # each weight once (lm_head is tied to wte)
    n = len(stds)
    med = stds[n // 2] if n % 2 else math.sqrt(stds[n // 2 - 1] * stds[n // 2])
    rep = precondfx.analyze(_gpt2(init=med / (AUTO_RATIO * side)), x, use_cache=False,
                            balance="analytic")
    assert rep.plan.lr_mode == ("user" if side > 1 else None)
    assert f"{AUTO_RATIO * side:.3g}" in next(n for n in rep.plan.notes
                                              if n.startswith("lr_scale='auto'"))


@needs_hf
def test_meta_device_decides_as_with_values() -> None:
    """Data-free: on the meta device the same decision and the same lr constants."""
    kw = dict(use_cache=False, balance="analytic", target_std=None)
    real = precondfx.precondition(_gpt2(), _ids(), **kw)[1]
    fake = precondfx.precondition(_gpt2(device="meta"), _ids().to("meta"), **kw)[1]
    assert real.plan.lr_mode == fake.plan.lr_mode == "user"
    lr = lambda r: [(s.node, s.value) for s in r.plan.scales if s.tag == "lr"]  # noqa: E731
    assert len(lr(real)) >= 4
    assert [n for n, _ in lr(fake)] == [n for n, _ in lr(real)]
    assert [v for _, v in lr(fake)] == pytest.approx([v for _, v in lr(real)], rel=1e-12)


@needs_hf
@pytest.mark.parametrize("kw,why", [(dict(reinit_weights=False), "reinit_weights=False"),
                                    (dict(scheme="lsuv"), "scheme='lsuv'")])
def test_off_where_nothing_is_redrawn_or_another_scheme(kw, why) -> None:
    out, rep = precondfx.precondition(_gpt2(), _ids(), use_cache=False, **kw)
    assert rep.plan.lr_mode is None
    assert any(why in n for n in rep.plan.notes)
    assert not any("precondfx_lr" in n for n, _ in out.named_buffers())


def test_explicit_none_and_misspelled() -> None:
    m = _mlp(std=0.01)
    x = torch.randn(16, 64)
    rep = precondfx.analyze(m, x, lr_scale=None)
    assert rep.plan.lr_mode is None
    with pytest.raises(precondfx.PrecondError, match="auto"):
        precondfx.analyze(m, x, lr_scale="automatic")


def test_onnx_default_is_accepted_explicit_refused(tmp_path) -> None:
    pytest.importorskip("onnx")
    from precondfx.onnx import precondition_onnx
    m = _mlp(std=0.01).eval()
    x = torch.randn(8, 64)
    src = tmp_path / "m.onnx"
    torch.onnx.export(m, (x,), str(src), input_names=["x"], output_names=["y"], dynamo=False)
    rep = precondition_onnx(str(src), str(tmp_path / "o.onnx"), feeds={"x": x.numpy()})
    assert rep.plan.lr_mode is None
    with pytest.raises(precondfx.PrecondError, match="lr_scale"):
        precondition_onnx(str(src), str(tmp_path / "p.onnx"), feeds={"x": x.numpy()},
                          lr_scale="user")


@needs_hf
def test_nested_models_declare_their_own_init_std() -> None:
    """An encoder-decoder whose decoder declares initializer_range 0.05 and whose outer config
    declares 0.1: each weight gets the std of the innermost config that holds it."""
    import transformers as tf
    from precondfx.pytorch.lr_transfer import declared_stds

    def cfg(r: float, **kw):
        return tf.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                             num_attention_heads=2, intermediate_size=32, initializer_range=r,
                             **kw)
    both = tf.EncoderDecoderConfig.from_encoder_decoder_configs(
        cfg(0.02), cfg(0.05, is_decoder=True, add_cross_attention=True))
    both.initializer_range = 0.1
    got = declared_stds(tf.EncoderDecoderModel(config=both))
    assert got["encoder.encoder.layer.0.attention.self.query.weight"] == 0.02
    assert got["decoder.bert.encoder.layer.0.crossattention.self.query.weight"] == 0.05
    assert set(got.values()) == {0.02, 0.05}
