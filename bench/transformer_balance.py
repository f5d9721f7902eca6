"""Held-out Hessian-block spread of transformers before and after measured balancing.

For tiny configurations (from transformers, offline) of BERT, GPT-2 (``Conv1D`` layers), ViT,
a Llama-style decoder (RMSNorm, rotary embeddings, gated MLP) and T5, ``precondition(...,
measure=True)`` is run twice with the same seed: ``balance="auto"`` with a threshold out of
reach (the rewritten model with its alpha sites, measured but not rebalanced: "before") and
``balance="hessian"`` (measured balancing: "after").  The table gives the max/min over weighted
layers of ``E[(G_l r)^2]`` measured on the held-out half of the calibration batch with fresh
cotangents (``report.conditioning["measure"]``) for the user's model (transformers init), before
and after balancing; how many weighted layers were rebalanced; the largest change of the logits
that balancing made (a reparametrization: rounding only); and the output std after balancing
(target 0.05).  Attention dropout is set to 0 in the configs (``scaled_dot_product_attention``'s
``dropout_p`` is not turned off by the calibration runs in this version; balancing then refuses,
as it cannot check that the function is kept); hidden dropout stays at its default.

    python bench/transformer_balance.py           # ~2 min on one CPU thread

Writes docs/results/transformer_balance.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

import precondfx  # noqa: E402


def _ids(b: int, t: int, vocab: int = 100) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(1))


def models(batch: int, seq: int):
    """(name, model, sample, forward kwargs)."""
    import transformers as T
    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    yield "BERT", T.BertForSequenceClassification(T.BertConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, num_labels=4,
        attention_probs_dropout_prob=0.0)), \
        {"input_ids": _ids(batch, seq), "attention_mask": torch.ones(batch, seq, dtype=torch.long)}, {}
    torch.manual_seed(0)
    yield "GPT-2", T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0)), \
        {"input_ids": _ids(batch, seq)}, {"use_cache": False}
    torch.manual_seed(0)
    yield "ViT", T.ViTForImageClassification(T.ViTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, num_labels=10, attention_probs_dropout_prob=0.0)), \
        {"pixel_values": torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(1))}, {}
    torch.manual_seed(0)
    yield "Llama-style", T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)), \
        {"input_ids": _ids(batch, seq)}, {"use_cache": False}
    torch.manual_seed(0)
    yield "T5", T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=100, d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        d_kv=16)), {"input_ids": _ids(batch, seq), "decoder_input_ids": _ids(batch, seq // 2)}, \
        {"use_cache": False}


def _logits(model, sample, kw):
    with torch.no_grad():
        return model.eval()(**sample, **kw).logits.double()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--samples", type=int, default=16, help="balance_samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=C.RESULTS)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    C.setup(args.threads)
    say = C.Progress("transformer_balance")
    rows = []
    for name, model, sample, kw in models(args.batch, args.seq):
        row = {"model": name}
        outs = {}
        for mode in ("planned", "hessian"):
            t0 = time.perf_counter()
            opts = dict(balance="auto", balance_threshold=1e30) if mode == "planned" else \
                dict(balance="hessian")
            res, rep = precondfx.precondition(model, sample, measure=True, **opts,
                                              balance_samples=args.samples, seed=args.seed,
                                              **kw)
            m = rep.conditioning["measure"]
            row[f"{mode}_s"] = time.perf_counter() - t0
            row["original"] = m["before"]["spread"]
            row[mode] = m["after"]["spread"]
            outs[mode] = _logits(res, sample, kw)
            if mode == "hessian":
                h = rep.conditioning["hessian"]
                row.update(layers=h["layers"], rebalanced=len(h.get("factors") or {}),
                           left_out=list(h["left_out"]), engine=h.get("engine"),
                           fit_before=h["spread_before"], summary=h["summary"],
                           output_std=rep.output_std_after)
        a, b = outs["planned"], outs["hessian"]
        row["logit_change"] = float((a - b).abs().max() / a.abs().max())
        rows.append(row)
        say(f"{name}: held-out spread original {row['original']:.3g}x, before "
            f"{row['planned']:.3g}x, balanced {row['hessian']:.3g}x; {row['rebalanced']} of "
            f"{row['layers']} layers rebalanced; logits changed {row['logit_change']:.1e}; "
            f"output std {row['output_std']:.6f}; engine {str(row['engine'])[:60]}")
    path = C.write_json(os.path.join(args.out, "transformer_balance.json"),
                        {"rows": rows, "args": vars(args), "env": C.env_info(),
                         "wall_s": say.elapsed()})
    print("\n| model | original (transformers init) | precondfx, before balancing | after "
          "balancing | layers rebalanced | logit change | output std |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['original']:.3g}x | {r['planned']:.3g}x | {r['hessian']:.3g}x "
              f"| {r['rebalanced']} of {r['layers']} | {r['logit_change']:.1e} | "
              f"{r['output_std']:.6f} |")
    say(f"wrote {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
