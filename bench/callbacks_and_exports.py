"""Figures for issue 21, items 2 and 3 (CPU, tiny models, a few seconds each).

Callbacks: on a small CNN whose max-pool becomes a strided conv (``maxpool='conv'``) and on
transformers' ResNetForImageClassification (``embedder.pooler``), how many of the result's
parameters the optimizer holds and how far 3 training steps move the added conv: the old
callback's timing (preconditioning in ``on_train_begin``, after the optimizer is built) against
``precondition_trainer`` and the Lightning callback (``setup``).

Exports: the largest difference between each export of the result (both ONNX exporters run by
onnxruntime, ``torch.jit.trace``, ``torch.export.export``) and the result run eagerly, on an
input other than the one exported with.

    python bench/callbacks_and_exports.py
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def callbacks() -> None:
    import transformers as tf

    import precondfx
    from precondfx.integrations import lightning as pl_int
    from precondfx.integrations.hf import precondition_trainer
    from tests.integrations import test_callbacks as T

    class OldTiming(tf.TrainerCallback):
        """What the callback did before: precondition in on_train_begin, no check."""

        def on_train_begin(self, args, state, control, model=None, train_dataloader=None,
                           **kw):
            precondfx.precondition(model, dict(next(iter(train_dataloader))), inplace=True,
                                   maxpool="conv")

    for which in ("cnn", "resnet"):
        for mode in ("on_train_begin (old)", "precondition_trainer"):
            model = T.LossCNN() if which == "cnn" else T._hf_resnet()
            trainer = T._trainer(model, T._images(size=8 if which == "cnn" else 32),
                                 tempfile.mkdtemp())
            if mode == "precondition_trainer":
                precondition_trainer(trainer, maxpool="conv")
            else:
                trainer.add_callback(OldTiming())
            snap = T._hf_snapshot()
            trainer.add_callback(snap)
            trainer.train()
            held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
            name = "net.pool.weight" if which == "cnn" else "resnet.embedder.pooler.weight"
            p = dict(model.named_parameters())[name]
            print(f"HF Trainer {which:6s} {mode:22s} params {len(list(model.parameters()))}, "
                  f"in optimizer {sum(id(q) in held for q in model.parameters())}, {name} "
                  f"moved {float((p.detach() - snap.at_start[name]).abs().max()):.3e}")
    if T.pl is None:
        print("Lightning not installed")
        return
    x, y = T._data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    module = T._lit_module()
    cb = pl_int.precondition_callback(module_attr="model", maxpool="conv")
    trainer, snap = T._fit(module, loader, cb, tempfile.mkdtemp())
    held = {id(p) for o in trainer.optimizers for g in o.param_groups for p in g["params"]}
    p = module.model.pool.weight
    print(f"Lightning  cnn    {'setup (default sample)':22s} params "
          f"{len(list(module.parameters()))}, in optimizer "
          f"{sum(id(q) in held for q in module.parameters())}, model.pool.weight moved "
          f"{float((p.detach() - snap.at_start['model.pool.weight']).abs().max()):.3e}")


def exports() -> None:
    from tests.pytorch import test_exports as E
    for name in ("cnn_fx", "cnn_eager", "bert", "gpt2"):
        cells = []
        for exporter in E.EXPORTERS:
            model, args, other, _ = E._case(name)
            model.eval()
            with torch.no_grad():
                want = model(*other)
            got = E._exported(model, args, other, exporter,
                              os.path.join(tempfile.mkdtemp(), "m.onnx"))
            cells.append(f"{exporter} {float((got - want).abs().max()):.1e}")
        print(f"exports {name:9s} " + ", ".join(cells))


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    callbacks()
    exports()
