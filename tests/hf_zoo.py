"""Tiny transformers models of many architectures, built from configs (offline), with a batch as
a dict carrying labels where the head takes them, and the kind of loss the head computes."""
from __future__ import annotations

from typing import Any, Callable

import torch

V, T, B = 97, 10, 3
_T = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
          vocab_size=V, max_position_embeddings=64)
_NODROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_LM = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _ids(g: torch.Generator, hi: int = V, shape: tuple = (B, T)) -> torch.Tensor:
    return torch.randint(3, hi, shape, generator=g)


def _mask(n: int = T) -> torch.Tensor:
    m = torch.ones(B, n, dtype=torch.long)
    m[0, -3:] = 0    # right padding on one row
    return m


def _causal(cfg_cls: str, model_cls: str = "AutoModelForCausalLM", **kw: Any) -> Callable:
    def make(g: torch.Generator) -> tuple[torch.nn.Module, dict, str]:
        import transformers as tf
        cfg = getattr(tf, cfg_cls)(**kw)
        m = getattr(tf, model_cls).from_config(cfg)
        ids = _ids(g)
        return m, {"input_ids": ids, "attention_mask": _mask(), "labels": ids.clone()}, "causal"
    return make


def _cls(cfg_cls: str, **kw: Any) -> Callable:
    def make(g: torch.Generator) -> tuple[torch.nn.Module, dict, str]:
        import transformers as tf
        cfg = getattr(tf, cfg_cls)(num_labels=3, **kw)
        m = tf.AutoModelForSequenceClassification.from_config(cfg)
        return m, {"input_ids": _ids(g), "attention_mask": _mask(),
                   "labels": torch.randint(0, 3, (B,), generator=g)}, "cls"
    return make


def _s2s(cfg_cls: str, **kw: Any) -> Callable:
    def make(g: torch.Generator) -> tuple[torch.nn.Module, dict, str]:
        import transformers as tf
        cfg = getattr(tf, cfg_cls)(**kw)
        m = tf.AutoModelForSeq2SeqLM.from_config(cfg)
        lab = _ids(g, shape=(B, 6))
        return m, {"input_ids": _ids(g), "attention_mask": _mask(), "labels": lab}, "s2s"
    return make


def _img(cfg_cls: str, size: int = 32, **kw: Any) -> Callable:
    def make(g: torch.Generator) -> tuple[torch.nn.Module, dict, str]:
        import transformers as tf
        cfg = getattr(tf, cfg_cls)(num_labels=5, **kw)
        m = tf.AutoModelForImageClassification.from_config(cfg)
        return m, {"pixel_values": torch.randn(B, 3, size, size, generator=g),
                   "labels": torch.randint(0, 5, (B,), generator=g)}, "cls"
    return make


_DEC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            vocab_size=V, max_position_embeddings=64, **_LM)
_S2S = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=V,
            max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
            decoder_start_token_id=2, **_LM)

def _whisper(g: torch.Generator) -> tuple[torch.nn.Module, dict, str]:
    import transformers as tf
    cfg = tf.WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=2,
                           encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=V, num_mel_bins=8,
                           max_source_positions=16, max_target_positions=32, dropout=0.0,
                           attention_dropout=0.0, decoder_start_token_id=1, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2)
    return tf.WhisperForConditionalGeneration(cfg), {
        "input_features": torch.randn(B, 8, 32, generator=g),
        "labels": _ids(g, shape=(B, 6))}, "s2s"


def _wav2vec2(g: torch.Generator) -> tuple[torch.nn.Module, dict, str]:
    import transformers as tf
    cfg = tf.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                            conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                            num_conv_pos_embedding_groups=2, vocab_size=V, hidden_dropout=0.0,
                            attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                            layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0)
    return tf.Wav2Vec2ForCTC(cfg), {"input_values": torch.randn(B, 400, generator=g),
                                    "labels": _ids(g, shape=(B, 5))}, "ctc"


def _clip(tower: str) -> Callable:
    def make(g: torch.Generator) -> tuple[torch.nn.Module, dict, str]:
        import transformers as tf
        kw = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64, projection_dim=16)
        if tower == "text":
            m = tf.CLIPTextModelWithProjection(tf.CLIPTextConfig(
                vocab_size=V, max_position_embeddings=32, **kw))
            return m, {"input_ids": _ids(g), "attention_mask": _mask()}, "embed"
        m = tf.CLIPVisionModelWithProjection(tf.CLIPVisionConfig(image_size=32, patch_size=8,
                                                                 **kw))
        return m, {"pixel_values": torch.randn(B, 3, 32, 32, generator=g)}, "embed"
    return make


BUILDERS: dict[str, Callable] = {
    # decoder-only causal LMs
    "mistral": _causal("MistralConfig", num_key_value_heads=1, **_DEC),
    "qwen2": _causal("Qwen2Config", num_key_value_heads=1, **_DEC),
    "phi": _causal("PhiConfig", resid_pdrop=0.0, embd_pdrop=0.0, **_DEC),
    "gpt_neox": _causal("GPTNeoXConfig", hidden_dropout=0.0, attention_dropout=0.0, **_DEC),
    "falcon": _causal("FalconConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      vocab_size=V, **_LM),
    "opt": _causal("OPTConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   ffn_dim=64, vocab_size=V, max_position_embeddings=64, word_embed_proj_dim=32,
                   dropout=0.0, **_LM),
    "gptj": _causal("GPTJConfig", n_embd=32, n_layer=2, n_head=2, rotary_dim=8, vocab_size=V,
                    n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_LM),
    "bloom": _causal("BloomConfig", hidden_size=32, n_layer=2, n_head=2, vocab_size=V, **_LM),
    "gemma": _causal("GemmaConfig", num_key_value_heads=1, head_dim=16, **_DEC),
    "mixtral": _causal("MixtralConfig", num_key_value_heads=1, num_local_experts=4,
                       num_experts_per_tok=2, **_DEC),
    "qwen2_moe": _causal("Qwen2MoeConfig", num_key_value_heads=1, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32, **_DEC),
    "granite": _causal("GraniteConfig", num_key_value_heads=1, logits_scaling=4.0, **_DEC),
    "gpt_neo": _causal("GPTNeoConfig", hidden_size=32, num_layers=2, num_heads=2,
                       attention_types=[[["global", "local"], 1]], window_size=4, vocab_size=V,
                       max_position_embeddings=64, resid_dropout=0.0, embed_dropout=0.0,
                       attention_dropout=0.0, **_LM),
    # encoders
    "distilbert": _cls("DistilBertConfig", dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                       vocab_size=V, max_position_embeddings=64, dropout=0.0,
                       attention_dropout=0.0, seq_classif_dropout=0.0),
    "roberta": _cls("RobertaConfig", pad_token_id=1, **_T, **_NODROP),
    "albert": _cls("AlbertConfig", embedding_size=16, **_T, **_NODROP),
    "deberta_v2": _cls("DebertaV2Config", **_T, **_NODROP),
    "electra": _cls("ElectraConfig", embedding_size=16, **_T, **_NODROP),
    # encoder-decoders
    "t5": _s2s("T5Config", d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
               vocab_size=V, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
               eos_token_id=1),
    "bart": _s2s("BartConfig", **_S2S),
    "marian": _s2s("MarianConfig", **_S2S),
    # vision
    "swin": _img("SwinConfig", image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                 num_heads=[2, 2], window_size=4, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0, drop_path_rate=0.0),
    "convnext": _img("ConvNextConfig", num_channels=3, hidden_sizes=[8, 16], depths=[1, 1],
                     num_stages=2),
    "resnet": _img("ResNetConfig", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                   layer_type="basic"),
    "segformer": _img("SegformerConfig", num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                      hidden_sizes=[16, 32], num_attention_heads=[1, 2], patch_sizes=[7, 3],
                      strides=[4, 2], mlp_ratios=[2, 2], hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, drop_path_rate=0.0,
                      classifier_dropout_prob=0.0),
    # audio, contrastive towers
    "whisper": _whisper,
    "wav2vec2": _wav2vec2,
    "clip_text": _clip("text"),
    "clip_vision": _clip("vision"),
    "mobilevit": _img("MobileViTConfig", image_size=32, hidden_sizes=[16, 24, 32],
                      neck_hidden_sizes=[8, 8, 16, 16, 16, 24, 32], num_attention_heads=2,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      classifier_dropout_prob=0.0),
}

# logits soft-capped after the head (tanh(z / c) * c): no module's output scales them exactly
GEMMA2 = _causal("Gemma2Config", num_key_value_heads=1, head_dim=16, **_DEC)
