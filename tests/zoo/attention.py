"""Attention and token-mixing nets: ViT (hand-written and nn.MultiheadAttention), MLP-Mixer."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from precondfx import demo
from tests.zoo.registry import HAS_TRANSFORMERS, _register, _seeded


# ---------------------------------------------------------------------------
# 9/10. ViT (hand-written attention and nn.MultiheadAttention)
# ---------------------------------------------------------------------------


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class MHAWrapper(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_dim: int, use_mha: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = MHAWrapper(dim, heads) if use_mha else SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(
        self,
        image: int = 32,
        patch: int = 8,
        dim: int = 32,
        depth: int = 2,
        heads: int = 4,
        mlp_dim: int = 64,
        num_classes: int = 10,
        use_mha: bool = False,
    ) -> None:
        super().__init__()
        n_tokens = (image // patch) ** 2
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, n_tokens + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(ViTBlock(dim, heads, mlp_dim, use_mha) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


@_register("vit", "attention", "layernorm", "transformer")
def vit(seed: int = 0, *, image: int = 32, patch: int = 8, dim: int = 32, depth: int = 2, batch: int = 4,
        num_classes: int = 10) -> tuple[nn.Module, Any]:
    """Small ViT with hand-written attention (Linear qkv + F.scaled_dot_product_attention)."""

    def make() -> tuple[nn.Module, Any]:
        model = ViT(image, patch, dim, depth, num_classes=num_classes, use_mha=False)
        return model, torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


@_register("vit_mha", "attention", "layernorm", "transformer", "mha")
def vit_mha(seed: int = 0, *, image: int = 32, patch: int = 8, dim: int = 32, depth: int = 2, batch: int = 4,
            num_classes: int = 10) -> tuple[nn.Module, Any]:
    """Small ViT using nn.MultiheadAttention(batch_first=True)."""

    def make() -> tuple[nn.Module, Any]:
        model = ViT(image, patch, dim, depth, num_classes=num_classes, use_mha=True)
        return model, torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 11. MLP-Mixer
# ---------------------------------------------------------------------------


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, token_hidden), nn.GELU(), nn.Linear(token_hidden, tokens))
        self.norm2 = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(nn.Linear(dim, channel_hidden), nn.GELU(), nn.Linear(channel_hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x).transpose(1, 2)
        x = x + self.token_mlp(y).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, image: int = 32, patch: int = 8, dim: int = 32, depth: int = 2, num_classes: int = 10) -> None:
        super().__init__()
        tokens = (image // patch) ** 2
        self.stem = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*(MixerBlock(tokens, dim, 32, 64) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)
        x = self.norm(self.blocks(x))
        return self.head(x.mean(dim=1))


@_register("mixer", "layernorm", "linear")
def mixer(seed: int = 0, *, image: int = 32, batch: int = 4, num_classes: int = 10) -> tuple[nn.Module, Any]:
    """MLP-Mixer: token-mixing and channel-mixing MLPs with transposes, LayerNorm, GELU."""

    def make() -> tuple[nn.Module, Any]:
        return Mixer(image, num_classes=num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)
