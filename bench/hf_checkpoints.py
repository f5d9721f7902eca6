"""Figures for the transformers integration (issues 12 and 15), on tiny models built from
configs (offline): the model's own loss against the loss of its returned logits, fold and
checkpoints (logits max abs difference), Trainer against a plain loop, and Trainer
checkpoint/resume against an uninterrupted run.  Writes docs/results/hf_checkpoints.json.

    python bench/hf_checkpoints.py
"""
from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import precondfx  # noqa: E402
from tests import hf_tiny  # noqa: E402
from tests.test_hf import (_StopAt, _gpt2_pre, _lm_data, _plain_loop, _trained,  # noqa: E402
                           run_trainer)


def _logits(m, batch, fwd):
    with torch.no_grad():
        return m.eval()(**batch, **fwd).logits.double()


def main() -> dict:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    out: dict = {"loss": {}, "checkpoints": {}}
    print(f"{'model':6s} {'outputs.loss':>12s} {'CE(logits)':>11s} {'fold rel':>9s} "
          f"{'(float64)':>9s} {'save/load':>10s} {'fold+save/load':>14s}")
    for name in hf_tiny.NAMES:
        model, batch = hf_tiny.build(name)
        fwd = hf_tiny.FORWARD[name]
        pre, _ = precondfx.precondition(model, batch, **fwd)
        with torch.no_grad():
            o = pre.eval()(**batch, **fwd)
        own, ref = float(o.loss), float(hf_tiny.LOSS[name](o.logits, batch["labels"]))
        lg = o.logits.double()
        folded = precondfx.fold(pre)
        rel = float((_logits(folded, batch, fwd) - lg).norm() / lg.norm())
        p64 = copy.deepcopy(pre).double()
        b64 = {k: (v.double() if v.is_floating_point() else v) for k, v in batch.items()}
        l64 = _logits(p64, b64, fwd)
        rel64 = float((_logits(precondfx.fold(p64), b64, fwd) - l64).norm() / l64.norm())
        with tempfile.TemporaryDirectory() as d:
            pre.save_pretrained(d)
            a = float((_logits(type(model).from_pretrained(d), batch, fwd) - lg).abs().max())
            folded.save_pretrained(d)
            b = float((_logits(type(model).from_pretrained(d), batch, fwd) - lg).abs().max())
        out["loss"][name] = {"outputs.loss": own, "ce_of_logits": ref}
        out["checkpoints"][name] = {"fold_rel": rel, "fold_rel_float64": rel64, "save_load_max_abs": a,
                                    "fold_save_load_max_abs": b,
                                    "logits_max_abs": float(lg.abs().max())}
        print(f"{name:6s} {own:12.6f} {ref:11.6f} {rel:9.1e} {rel64:9.1e} {a:10.1e} {b:14.1e}")
    data = _lm_data(80)
    _, pre = _gpt2_pre()
    a = copy.deepcopy(pre)
    plain = _plain_loop(a, data, 20, 4, 1e-2)
    with tempfile.TemporaryDirectory() as d:
        losses, trainer = run_trainer(copy.deepcopy(pre), data, 20, 4, 1e-2, d)
        trainer.train()
        full_losses, full = _trained(copy.deepcopy(pre), data, d + "/a")
        _trained(copy.deepcopy(pre), data, d + "/b", [_StopAt(10)], save_strategy="steps",
                 save_steps=10)
        res_losses, resumed = _trained(_gpt2_pre()[1], data, d + "/b",
                                       resume=d + "/b/checkpoint-10")
    pdiff = max(float((p - q).abs().max()) for p, q in zip(a.parameters(),
                                                           trainer.model.parameters()))
    rdiff = max(float((p - q).abs().max()) for p, q in zip(full.parameters(),
                                                           resumed.parameters()))
    moved = max(float((p - q).abs().max()) for p, q in zip(full.parameters(),
                                                           pre.parameters()))
    out["trainer_vs_loop"] = {"losses_trainer": losses, "losses_loop": plain,
                              "max_loss_diff": max(abs(x - y) for x, y in zip(losses, plain)),
                              "max_param_diff": pdiff}
    out["resume"] = {"losses_full": full_losses, "losses_resumed": res_losses,
                     "max_loss_diff": max(abs(x - y) for x, y in zip(res_losses,
                                                                     full_losses[10:])),
                     "max_param_diff": rdiff, "max_param_moved": moved}
    print(f"GPT-2, 20 steps AdamW lr 1e-2: Trainer losses {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"plain loop {plain[0]:.4f} -> {plain[-1]:.4f}; max loss diff "
          f"{out['trainer_vs_loop']['max_loss_diff']:.1e}, max param diff {pdiff:.1e}")
    print(f"checkpoint at 10 + resume vs uninterrupted: final loss {res_losses[-1]:.6f} vs "
          f"{full_losses[-1]:.6f}; max loss diff {out['resume']['max_loss_diff']:.1e}, "
          f"max param diff {rdiff:.1e} (params moved up to {moved:.2e})")
    os.makedirs(os.path.join(ROOT, "docs", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "docs", "results", "hf_checkpoints.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
