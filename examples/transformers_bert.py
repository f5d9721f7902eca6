"""Precondition a Hugging Face model built from a config (no download): BERT for classification.

Run:  python examples/transformers_bert.py      (needs: pip install transformers)

transformers models defeat torch.fx; precondfx captures them with torch.export and applies the
plan through hooks and buffers, so the result keeps its class, its outputs and its config.
"""
import torch

import precondfx


def main() -> precondfx.Report:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, num_labels=3,
                        attn_implementation="eager")
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    batch = {"input_ids": torch.randint(0, 100, (8, 16)),
             "attention_mask": torch.ones(8, 16, dtype=torch.long)}
    model_pc, report = precondfx.precondition(model, batch)
    print(report.table())
    out = model_pc(**batch)
    print(type(out).__name__, tuple(out.logits.shape))
    return report


if __name__ == "__main__":
    main()
