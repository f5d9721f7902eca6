"""Free token and position parameters (precondfx.core.tokens): a class token concatenated to
the patch embeddings and a position embedding added to them are drawn at the rms of the patch
embedding's output, measured after re-initialization; bias-like parameters are left alone."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import precondfx
from precondfx.core import tokens
from tests.helpers import rms


class TinyViT(nn.Module):
    """patch conv -> tokens, cat(cls, tokens) + pos, one pre-norm MLP block, head on cls."""

    def __init__(self, dim: int = 16, patches: int = 16) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, patches + 1, dim) * 0.02)
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(x.shape[0], -1, -1), t], dim=1) + self.pos
        t = t + self.fc2(torch.relu(self.fc1(self.norm(t))))
        return self.head(t[:, 0])


class HandBias(nn.Module):
    """A bias written by hand (one varying axis): not a token."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8, bias=False)
        self.offset = nn.Parameter(torch.full((8,), 0.5))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(x) + self.offset))


@pytest.mark.parametrize("capture", ["fx", "eager"])
def test_tokens_drawn_at_the_patch_embedding_rms(capture):
    torch.manual_seed(0)
    m = TinyViT()
    x = torch.randn(8, 3, 16, 16)
    out, rep = precondfx.precondition(m, x, capture=capture, seed=3)
    for name in ("cls", "pos"):
        pi = rep.plan.inits[name]
        assert pi.rule == "match" and pi.match is not None, pi
    # the patch conv's output on the same batch, measured here with a hook on the result
    seen = []
    h = out.patch.register_forward_hook(lambda mod, a, o: seen.append(rms(o)))
    with torch.no_grad():
        out(x)
    h.remove()
    assert seen and seen[0] > 0.1          # not transformers' 0.02: the re-drawn conv's scale
    for name in ("cls", "pos"):
        p = dict(out.named_parameters())[name]
        assert rms(p) == pytest.approx(seen[0], rel=1e-4), name
        assert rep.plan.inits[name].std == pytest.approx(seen[0], rel=1e-4)
    assert "token/position parameters drawn at the rms" in str(rep)
    # the user's model is not touched
    assert rms(m.cls) < 0.05 and rms(m.pos) < 0.05
    # the output scale is calibrated after the draw
    with torch.no_grad():
        assert float(out(x).std(correction=0)) == pytest.approx(1.0, rel=1e-3)


def test_reinit_from_the_plan_reproduces_every_parameter():
    torch.manual_seed(0)
    m = TinyViT()
    x = torch.randn(8, 3, 16, 16)
    out, rep = precondfx.precondition(m, x, seed=5)
    again = copy.deepcopy(out)
    with torch.no_grad():
        for p in again.parameters():
            p.add_(1.0)
    precondfx.reinit(again, rep.plan)
    for (n, a), b in zip(out.named_parameters(), again.parameters()):
        if rep.plan.inits[n].rule not in ("keep", "scale"):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=n)


def test_a_bias_written_by_hand_is_not_a_token():
    torch.manual_seed(0)
    m = HandBias()
    x = torch.randn(32, 8)
    out, rep = precondfx.precondition(m, x)
    assert rep.plan.inits["offset"].rule == "keep"
    assert torch.equal(dict(out.named_parameters())["offset"].detach(), torch.full((8,), 0.5))


def test_meta_device_leaves_tokens_as_they_are_and_says_so():
    with torch.device("meta"):
        m = TinyViT()
    x = torch.randn(8, 3, 16, 16, device="meta")
    out, rep = precondfx.precondition(m, x, balance="analytic")
    assert rep.plan.inits["cls"].rule == "match" and rep.plan.inits["cls"].std is None
    said = [why for what, why in rep.skipped if what == "init cls"]
    assert said and "left as is" in said[0]


def test_token_partners_rule_on_the_graph():
    """The join and partner found on the captured graph: the patch conv for both, at the
    concatenation (cls) and the addition (pos)."""
    torch.manual_seed(0)
    rep = precondfx.analyze(TinyViT(), torch.randn(4, 3, 16, 16))
    kinds = {r.name: r.kind for r in rep.nodes}
    inits = rep.plan.inits
    assert inits["cls"].match == inits["pos"].match
    assert kinds[inits["cls"].match] == "conv"
    assert "concatenated" in inits["cls"].reason and "added" in inits["pos"].reason
    assert tokens.bias_like((8,)) and tokens.bias_like((1, 8, 1)) and \
        not tokens.bias_like((1, 17, 8))


def test_transformers_vision_tokens():
    """transformers models: DeiT's class, distillation and position parameters are matched to
    the patch embedding's output rms; Swin's relative position bias tables (added to attention
    scores, not to a layer's output) are left alone."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    deit = tf.DeiTForImageClassificationWithTeacher(tf.DeiTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, num_labels=5))
    out, rep = precondfx.precondition(deit, {"pixel_values": x})
    got = {k: pi.std for k, pi in rep.plan.inits.items() if pi.rule == "match"}
    assert set(got) == {"deit.embeddings.cls_token", "deit.embeddings.distillation_token",
                        "deit.embeddings.position_embeddings"}
    seen = []
    proj = out.deit.embeddings.patch_embeddings.projection
    h = proj.register_forward_hook(lambda mod, a, o: seen.append(rms(o)))
    with torch.no_grad():
        out(pixel_values=x)
    h.remove()
    for k, std in got.items():
        assert std == pytest.approx(seen[0], rel=1e-4), k
    swin = tf.SwinForImageClassification(tf.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
        window_size=4, num_labels=5))
    _, rep = precondfx.precondition(swin, {"pixel_values": x})
    tables = [k for k in rep.plan.inits if "relative_position_bias_table" in k]
    assert tables and all(rep.plan.inits[k].rule == "keep" for k in tables)
