"""Lightning callback defects found by the integrations hunt: options checked when the
callback is built, one callback reused for several modules, and validate/test/predict with
``ckpt_path`` on a fresh LightningModule (the checkpoint holds precondfx constants and the
convolution that replaced a max-pool)."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn

from precondfx import PrecondError
from precondfx.integrations import lightning as pl_int

pl = pl_int._lightning()
needs_pl = pytest.mark.skipif(pl is None, reason="Lightning is not installed")


def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 5))


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 1, 8, 8, generator=g),
                                          torch.randint(0, 5, (32,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=16)


def _module() -> object:
    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.model(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val", nn.functional.cross_entropy(self.model(x), y))

        def predict_step(self, batch, batch_idx):
            return self.model(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
    return Module()


def _trainer(callback, root, steps: int = 2):
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    return pl.Trainer(max_steps=steps, callbacks=[callback], accelerator="cpu", logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(root),
                      num_sanity_val_steps=0)


def _preconditioned(module) -> bool:
    return any("precondfx" in k for k in module.state_dict())


@needs_pl
def test_callback_checks_its_options_when_built() -> None:
    """``inplace=`` used to reach precondition twice (a raw TypeError at the first fit) and a
    bad option value was found only when training started."""
    with pytest.raises(PrecondError, match="in place"):
        pl_int.precondition_callback(module_attr="model", inplace=False)
    with pytest.raises(PrecondError, match="balance='hesian'"):
        pl_int.precondition_callback(module_attr="model", balance="hesian")
    with pytest.raises(PrecondError, match="module_attr"):
        pl_int.precondition_callback(module_attr=3)


@needs_pl
def test_one_callback_preconditions_every_module_it_fits(tmp_path) -> None:
    """The callback used to skip any module after the first (it kept its first report), so a
    second module trained without preconditioning, silently."""
    callback = pl_int.precondition_callback(module_attr="model", seed=1)
    for _ in range(2):
        module = _module()
        trainer = _trainer(callback, tmp_path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, _loader())
        assert _preconditioned(module)
        held = {id(p) for o in trainer.optimizers for g in o.param_groups for p in g["params"]}
        assert held == {id(p) for p in module.parameters()}


@needs_pl
@pytest.mark.parametrize("stage", ["validate", "predict"])
def test_evaluation_with_ckpt_path_loads_a_preconditioned_checkpoint(stage, tmp_path) -> None:
    """``trainer.validate/test/predict(fresh_module, ckpt_path=...)`` used to fail with
    torch's 'Unexpected key(s) in state_dict: precondfx_*' (the callback preconditioned only
    for fit): now the fresh network is preconditioned before the checkpoint is loaded, and
    gives the saved network's outputs exactly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = _module()
        trainer = _trainer(pl_int.precondition_callback(module_attr="model"), tmp_path)
        trainer.fit(module, _loader())
        ckpt = tmp_path / "a.ckpt"
        trainer.save_checkpoint(ckpt)
        x = next(iter(_loader()))[0]
        module.eval()
        with torch.no_grad():
            want = module.model(x)
        fresh = _module()
        other = _trainer(pl_int.precondition_callback(module_attr="model"), tmp_path)
        if stage == "validate":
            other.validate(fresh, _loader(), ckpt_path=str(ckpt), verbose=False)
            fresh.eval()
            with torch.no_grad():
                got = fresh.model(x)
        else:
            got = other.predict(fresh, _loader(), ckpt_path=str(ckpt))[0]
        assert "on_load_checkpoint" not in fresh.__dict__     # the hook wrapper is gone
        assert torch.equal(got, want)
        # without a checkpoint, evaluation leaves the module as it is
        plain = _module()
        _trainer(pl_int.precondition_callback(module_attr="model"), tmp_path).validate(
            plain, _loader(), verbose=False)
        assert not _preconditioned(plain) and "on_load_checkpoint" not in plain.__dict__


def _late_module(where: str) -> object:
    class Late(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if where == "configure_model" and self.model is None:
                self.model = _net()

        def setup(self, stage: str) -> None:
            if where == "setup" and self.model is None:
                self.model = _net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
    return Late()


@needs_pl
@pytest.mark.parametrize("where", ["setup", "configure_model"])
def test_resume_of_a_network_built_late_loads_the_checkpoint(where, tmp_path) -> None:
    """A network built in the LightningModule's setup or configure_model was preconditioned
    just before configure_optimizers, but resuming loads the checkpoint before that: torch's
    'Unexpected key(s) ... precondfx_*'.  Now it is preconditioned before the load, and the
    resumed run starts from exactly the saved weights and constants."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = _late_module(where)
        trainer = _trainer(pl_int.precondition_callback(module_attr="model"), tmp_path)
        trainer.fit(module, _loader())
        ckpt = tmp_path / "a.ckpt"
        trainer.save_checkpoint(ckpt)
        saved = {k: v.clone() for k, v in module.state_dict().items()}
        seen = {}

        class Spy(pl.Callback):
            def on_train_start(self, trainer, pl_module) -> None:
                seen.update({k: v.clone() for k, v in pl_module.state_dict().items()})

        fresh = _late_module(where)
        resumed = _trainer(pl_int.precondition_callback(module_attr="model"), tmp_path, steps=3)
        resumed.callbacks.append(Spy())
        resumed.fit(fresh, _loader(), ckpt_path=str(ckpt))
    assert resumed.global_step == 3
    assert seen.keys() == saved.keys() and any("precondfx" in k for k in saved)
    assert all(torch.equal(seen[k], saved[k]) for k in saved)
    held = {id(p) for o in resumed.optimizers for g in o.param_groups for p in g["params"]}
    assert held == {id(p) for p in fresh.parameters()}
