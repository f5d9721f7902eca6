"""Lightning callback (pytorch-lightning is in the test extra); more in test_callbacks.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from precondfx import PrecondError
from precondfx.integrations import lightning as pl_int


def test_missing_lightning_says_what_to_install() -> None:
    if pl_int.available():
        pytest.skip("Lightning is installed here")
    with pytest.raises(PrecondError, match="pip install lightning"):
        pl_int.precondition_callback()


def test_lightning_callback_preconditions_on_the_first_batch(tmp_path) -> None:
    pl = pl_int._lightning()     # lightning.pytorch or pytorch_lightning (the test extra)
    if pl is None:
        pytest.skip("Lightning is not installed")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))

        def training_step(self, batch, idx):
            x, y = batch
            return nn.functional.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    cb = pl_int.precondition_callback(module_attr="model", batch_to_sample=lambda b: b[0],
                                      target_std=0.05)   # the default was 0.05 when written
    module = Module()
    trainer = pl.Trainer(max_steps=2, callbacks=[cb], logger=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path), enable_progress_bar=False)
    trainer.fit(module, loader)
    assert cb.report is not None
    with torch.no_grad():
        std = float(module.model(x[:16]).std(correction=0))
    assert 0.02 < std < 0.2   # the output scale set on the first batch (two SGD steps since)
