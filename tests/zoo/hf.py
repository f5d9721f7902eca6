"""Hugging Face transformers models from tiny configs (no downloads), registered when transformers imports."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from precondfx import demo
from tests.zoo.registry import HAS_TRANSFORMERS, _register, _seeded


# ---------------------------------------------------------------------------
# 23. Hugging Face transformers (tiny configs, no downloads)
# ---------------------------------------------------------------------------

if HAS_TRANSFORMERS:

    @_register("hf_bert", "transformers", "attention", "layernorm", "embedding")
    def hf_bert(seed: int = 0, *, seq: int = 8, batch: int = 2, vocab: int = 100, num_labels: int = 2) -> tuple[nn.Module, Any]:
        """transformers BertForSequenceClassification (hidden 32, 2 layers); sample {input_ids, attention_mask}."""
        from transformers import BertConfig, BertForSequenceClassification

        def make() -> tuple[nn.Module, Any]:
            cfg = BertConfig(
                vocab_size=vocab,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                max_position_embeddings=64,
                type_vocab_size=2,
                num_labels=num_labels,
                attn_implementation="eager",
            )
            model = BertForSequenceClassification(cfg)
            sample = {
                "input_ids": torch.randint(0, vocab, (batch, seq)),
                "attention_mask": torch.ones(batch, seq, dtype=torch.long),
            }
            return model, sample

        return _seeded(make, seed)

    @_register("hf_gpt2", "transformers", "attention", "layernorm", "embedding", "tied")
    def hf_gpt2(seed: int = 0, *, seq: int = 8, batch: int = 2, vocab: int = 100) -> tuple[nn.Module, Any]:
        """transformers GPT2LMHeadModel (n_embd 32, 2 layers); sample {input_ids, use_cache=False}."""
        from transformers import GPT2Config, GPT2LMHeadModel

        def make() -> tuple[nn.Module, Any]:
            cfg = GPT2Config(
                vocab_size=vocab,
                n_positions=64,
                n_embd=32,
                n_layer=2,
                n_head=2,
                bos_token_id=vocab - 1,
                eos_token_id=vocab - 1,
                attn_implementation="eager",
            )
            model = GPT2LMHeadModel(cfg)
            sample = {"input_ids": torch.randint(0, vocab, (batch, seq)), "use_cache": False}
            return model, sample

        return _seeded(make, seed)

    @_register("hf_vit", "transformers", "attention", "layernorm", "conv")
    def hf_vit(seed: int = 0, *, image: int = 32, batch: int = 2, num_labels: int = 10) -> tuple[nn.Module, Any]:
        """transformers ViTForImageClassification (hidden 32, 2 layers, patch 8); sample {pixel_values}."""
        from transformers import ViTConfig, ViTForImageClassification

        def make() -> tuple[nn.Module, Any]:
            cfg = ViTConfig(
                image_size=image,
                patch_size=8,
                num_channels=3,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                num_labels=num_labels,
                attn_implementation="eager",
            )
            model = ViTForImageClassification(cfg)
            return model, {"pixel_values": torch.randn(batch, 3, image, image)}

        return _seeded(make, seed)

    @_register("hf_resnet", "transformers", "conv", "residual", "maxpool", "batchnorm")
    def hf_resnet(seed: int = 0, *, image: int = 32, batch: int = 2, num_labels: int = 10) -> tuple[nn.Module, Any]:
        """transformers ResNetForImageClassification (bottleneck, stem 8, 2 stages of 16/32); sample {pixel_values}."""
        from transformers import ResNetConfig, ResNetForImageClassification

        def make() -> tuple[nn.Module, Any]:
            cfg = ResNetConfig(
                num_channels=3,
                embedding_size=8,
                hidden_sizes=[16, 32],
                depths=[1, 1],
                layer_type="bottleneck",
                num_labels=num_labels,
            )
            model = ResNetForImageClassification(cfg)
            return model, {"pixel_values": torch.randn(batch, 3, image, image)}

        return _seeded(make, seed)

    @_register("hf_convnext", "transformers", "conv", "depthwise", "layernorm", "residual")
    def hf_convnext(seed: int = 0, *, image: int = 32, batch: int = 2, num_labels: int = 10) -> tuple[nn.Module, Any]:
        """transformers ConvNextForImageClassification (2 stages, width 8-16); sample {pixel_values}."""
        from transformers import ConvNextConfig, ConvNextForImageClassification

        def make() -> tuple[nn.Module, Any]:
            cfg = ConvNextConfig(
                num_channels=3,
                patch_size=4,
                num_stages=2,
                hidden_sizes=[8, 16],
                depths=[1, 1],
                num_labels=num_labels,
            )
            model = ConvNextForImageClassification(cfg)
            return model, {"pixel_values": torch.randn(batch, 3, image, image)}

        return _seeded(make, seed)
