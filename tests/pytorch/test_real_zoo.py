"""Stand-ins for what a sweep over torchvision and timm found (``bench/zoo_sweep.py`` on a GPU
machine; timm and torchvision do not import on the CI machine, so each pattern is written out
here the way those libraries write it).

* timm's ViTs (DeiT, EVA-02, FlexiViT) take ``is_causal: bool = False`` in ``forward`` and pass it
  to ``scaled_dot_product_attention``; the pass's fx Interpreter runs filled every argument the
  sample leaves out with ``None`` instead of the recorded default, and the token stage failed.
* ConvNeXt-V2's global response norm calls ``torch.addcmul``, Swin builds its shifted-window
  mask with ``new_zeros``/``expand_as``/``zero_``, EdgeNeXt calls ``F.normalize`` and ``~mask``:
  all were "unknown" to the op table.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx


class _Attn(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h, self.qkv, self.proj = h, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, attn_mask=None, is_causal: bool = False):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.h, c // self.h).permute(2, 0, 3, 1, 4) \
            .unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0,
                                           is_causal=is_causal)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class TimmStyleViT(nn.Module):
    """A class token and position embedding (the token stage probes them through an fx
    Interpreter run) and optional arguments with non-None defaults, as timm writes them."""

    def __init__(self, d: int = 32, h: int = 4) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, 4, 4)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, 17, d) * 0.02)
        self.n1, self.attn = nn.LayerNorm(d), _Attn(d, h)
        self.n2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))
        self.head = nn.Linear(d, 10)

    def forward(self, x, attn_mask=None, is_causal: bool = False):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        x = x + self.attn(self.n1(x), attn_mask=attn_mask, is_causal=is_causal)
        x = x + self.mlp(self.n2(x))
        return self.head(x[:, 0])


def test_forward_defaults_reach_the_interpreter_runs():
    torch.manual_seed(0)
    model, x = TimmStyleViT(), torch.randn(16, 3, 16, 16)
    pm, rep = precondfx.precondition(model, x)
    assert rep.capture == "fx"
    assert rep.output_std_after == pytest.approx(1.0, rel=1e-3)
    # the token stage ran (it is the one that probes): the class token now has the patch
    # embedding's output rms, measured here with a hook
    got = {}

    def hook(mod, inp, out) -> None:
        got["rms"] = out.pow(2).mean().sqrt()

    h = pm.patch.register_forward_hook(hook)
    with torch.no_grad():
        out = pm(x)
    h.remove()
    assert float(pm.cls.pow(2).mean().sqrt()) == pytest.approx(float(got["rms"]), rel=0.25)
    with torch.no_grad():
        torch.testing.assert_close(out, pm(x, None, False))


class GRN(nn.Module):
    """ConvNeXt-V2's global response normalization, as timm writes it (channels last)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.zeros(c)), nn.Parameter(torch.zeros(c))

    def forward(self, x):
        gx = x.norm(p=2, dim=(1, 2), keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + 1e-6)
        return x + torch.addcmul(self.bias, self.weight, x * nx)


class TimmStyleOps(nn.Module):
    """GRN (addcmul), a Swin-like mask built with new_zeros / zero_ / expand_as, F.normalize
    and an inverted boolean mask (EdgeNeXt's cross-covariance attention)."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem = nn.Linear(12, c)
        self.fc1, self.grn, self.fc2 = nn.Linear(c, 2 * c), GRN(2 * c), nn.Linear(2 * c, c)
        self.q, self.head = nn.Linear(c, c), nn.Linear(c, 5)
        self.temp = nn.Parameter(torch.ones(1))

    def forward(self, x):                                   # x: (B, H, W, 12)
        x = self.stem(x)
        x = x + self.fc2(self.grn(F.gelu(self.fc1(x))))
        b, hh, ww, c = x.shape
        t = x.reshape(b, hh * ww, c)
        mask = t.new_zeros(hh * ww, hh * ww)
        mask.zero_()
        keep = ~(mask.expand_as(mask) > 0)
        q = F.normalize(self.q(t), dim=-1)
        k = F.normalize(t, dim=-1)
        attn = (q @ k.transpose(1, 2) * self.temp).masked_fill(~keep, -1e4).softmax(-1)
        return self.head((attn @ t).mean(1))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_timm_ops_are_in_the_table(capture):
    torch.manual_seed(0)
    model, x = TimmStyleOps(), torch.randn(32, 4, 4, 12)
    pm, rep = precondfx.precondition(model, x, capture=capture)
    assert rep.capture == capture
    unknown = [(r.name, r.target) for r in rep.nodes if r.status == "unknown"]
    assert unknown == []
    assert rep.output_std_after == pytest.approx(1.0, rel=1e-3)
    if capture == "fx":          # torch.export decomposes F.normalize into norm, clamp, div
        assert [r.kind for r in rep.nodes if r.target.endswith("normalize")] == \
            ["normalization", "normalization"]
    grn = [r for r in rep.nodes if "addcmul" in r.target]
    assert grn and all(r.kind == "mul" and r.status == "breaks" for r in grn)


class AutocastRegion(nn.Module):
    """EfficientViT's pattern: attention computed in float32 inside ``autocast(enabled=False)``,
    a no-op while tracing (autocast is off then) but not under the user's own autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        with torch.autocast("cpu", enabled=False):
            h = torch.relu(self.b(h.float()))
            region = h
        return self.head(h), region


def test_autocast_region_kept_under_the_users_autocast():
    torch.manual_seed(0)
    model, x = AutocastRegion(), torch.randn(64, 16)
    pm, rep = precondfx.precondition(model, x)
    assert rep.capture != "fx" and type(pm) is AutocastRegion
    assert rep.output_std_after == pytest.approx(1.0, rel=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, r_user = model(x)
        out, r_pm = pm(x)
    assert r_user.dtype == r_pm.dtype == torch.float32      # a traced graph gave bfloat16
    assert out.dtype == torch.bfloat16                       # the rest follows the autocast


def _maybe_autocast(device: str, enabled: bool):
    """transformers.utils.generic.maybe_autocast: a real autocast region only when autocast is
    on already (as in the user's training) or asked for."""
    if torch.is_autocast_enabled(device) or enabled:
        return torch.autocast(device, enabled=enabled)
    return contextlib.nullcontext()


class RotaryStyle(nn.Module):
    """Rotary-embedding style: cos/sin computed in float32 under ``maybe_autocast(enabled=False)``,
    which is a null context while tracing."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = self.a(x)
        with _maybe_autocast("cpu", enabled=False):
            angle = h.float() * 0.5
            rot = torch.cos(angle) + torch.sin(angle)
        return self.head(h * rot), rot


def test_a_forward_that_reads_the_autocast_state_is_not_traced():
    torch.manual_seed(0)
    model, x = RotaryStyle(), torch.randn(64, 16)
    pm, rep = precondfx.precondition(model, x)
    assert rep.capture != "fx" and type(pm) is RotaryStyle
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, r_user = model(x)
        _, r_pm = pm(x)
    assert r_user.dtype == r_pm.dtype == torch.float32


def window_attention(x, qkv_weight, proj_weight, qkv_bias, proj_bias, num_heads: int):
    """torchvision's Swin calls its attention as a function with the layers' weights, and
    registers it with ``torch.fx.wrap``: a trace records one opaque call."""
    b, n, c = x.shape
    qkv = F.linear(x, qkv_weight, qkv_bias).reshape(b, n, 3, num_heads, c // num_heads) \
        .permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    attn = (q * (c // num_heads) ** -0.5) @ k.transpose(-2, -1)
    x = (attn.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)
    return F.linear(x, proj_weight, proj_bias)


torch.fx.wrap("window_attention")


class _WindowAttention(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.qkv, self.proj, self.h = nn.Linear(d, 3 * d), nn.Linear(d, d), h

    def forward(self, x):
        return window_attention(x, self.qkv.weight, self.proj.weight, self.qkv.bias,
                                self.proj.bias, self.h)


class SwinStyle(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.emb, self.n1, self.attn = nn.Linear(12, d), nn.LayerNorm(d), _WindowAttention(d, 4)
        self.n2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        x = self.emb(x)
        x = x + self.attn(self.n1(x))
        x = x + self.mlp(self.n2(x))
        return self.head(x.mean(1))


def test_layers_inside_an_fx_wrapped_function_are_planned():
    torch.manual_seed(0)
    model, x = SwinStyle(), torch.randn(32, 16, 12)
    before = model.attn.qkv.weight.detach().clone()
    pm, rep = precondfx.precondition(model, x)
    assert rep.capture == "export"
    assert any("window_attention" in n and "hidden" in n for n in rep.capture_notes)
    for name, (n_in, n_out) in {"attn.qkv.weight": (32, 96), "attn.proj.weight": (32, 32)}.items():
        assert rep.plan.inits[name].rule == "geometric"
        got = float(pm.get_parameter(name).pow(2).mean())
        assert got == pytest.approx(2 * (n_in * n_out) ** -0.5, rel=0.2)   # D&B eq. 2
    torch.testing.assert_close(model.attn.qkv.weight, before)               # yours untouched
    assert rep.output_std_after == pytest.approx(1.0, rel=1e-3)
    # only fx works: the fx graph is used after all, and the report says what it hides
    pm2, rep2 = precondfx.precondition(model, x, capture=("fx",))
    assert rep2.capture == "fx" and rep2.plan.inits["attn.qkv.weight"].rule == "keep"


class RegionsWithoutParameters(nn.Module):
    """EfficientViT's linear attention (``autocast(enabled=False)`` around the kernel math) and
    a vision tower's position ids built under ``torch.no_grad()``: torch.export keeps each
    region as one higher-order op (``wrap_with_autocast``, ``wrap_with_set_grad_enabled``)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.qkv, self.proj, self.head = nn.Linear(12, 3 * d), nn.Linear(d, d), nn.Linear(d, 5)
        self.pos = nn.Embedding(16, d)

    def forward(self, x):                                   # x: (B, 16, 12)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        with torch.autocast("cpu", enabled=False):
            q, k, v = torch.relu(q.float()), torch.relu(k.float()), v.float()
            kv = k.transpose(-1, -2) @ v
            out = (q @ kv) / (q @ k.sum(1, keepdim=True).transpose(-1, -2) + 1e-6)
        with torch.no_grad():
            ids = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        h = self.proj(out) + self.pos(ids)
        return self.head(h.mean(1)), out


@pytest.mark.parametrize("capture", [None, "export"])
def test_autocast_and_no_grad_regions_are_seen_into(capture):
    """The regions' ops are classified (not one unknown node each), the layers around them
    planned, and the user's module keeps the regions under their own autocast."""
    torch.manual_seed(0)
    model, x = RegionsWithoutParameters(), torch.randn(32, 16, 12)
    kw = {} if capture is None else {"capture": capture}
    pm, rep = precondfx.precondition(model, x, **kw)
    assert rep.capture == "export" and type(pm) is RegionsWithoutParameters
    unknown = [(r.name, r.target) for r in rep.nodes if r.status == "unknown"]
    assert unknown == []                      # was: wrap_with_autocast, wrap_with_set_grad_enabled
    targets = " ".join(r.target for r in rep.nodes)
    assert "aten.matmul" in targets or "aten.bmm" in targets
    assert "aten.arange" in targets
    for name in ("qkv.weight", "proj.weight", "head.weight"):
        assert rep.plan.inits[name].rule == "geometric"
    assert rep.output_std_after == pytest.approx(1.0, rel=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, r_user = model(x)
        _, r_pm = pm(x)
    assert r_user.dtype == r_pm.dtype == torch.float32
