"""Training-framework callbacks cannot lose a parameter (issue 21, item 3).

Preconditioning replaces a max-pool with a strided convolution: a new parameter.  Each callback
must precondition before the optimizer is built, so that every parameter of the result is in
the optimizer and training moves the new convolution, or refuse.  Real Lightning
(``pytorch-lightning``, test extra) and a real transformers ``Trainer``."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import precondfx
from precondfx import PrecondError
from precondfx.integrations import lightning as pl_int

pl = pl_int._lightning()


class PoolCNN(nn.Module):
    """A small CNN with a max-pool after the stem (ResNet-like): preconditioning replaces the
    pool with a strided convolution (``maxpool='conv'``), a new parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.pool(self.act(self.stem(x))))
        return self.head(torch.relu(h).mean((2, 3)))


def _data(n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def _added(net: nn.Module, plain: nn.Module) -> list[str]:
    """Names of the parameters preconditioning added (not in the plain model)."""
    old = {n for n, _ in plain.named_parameters()}
    return [n for n, _ in net.named_parameters() if n not in old]


# ---------------------------------------------------------------- Lightning
needs_pl = pytest.mark.skipif(pl is None, reason="Lightning is not installed")


def _lit_module(batch_kind: str = "tuple") -> object:
    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = PoolCNN()

        def training_step(self, batch, idx):
            x, y = (batch["image"], batch["label"]) if batch_kind == "dict" else batch
            return nn.functional.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
    return Module()


class _DictSet(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"image": self.x[i], "label": self.y[i]}


class _Snapshot:
    """A Lightning callback that keeps the parameters as they are when training starts."""

    def __new__(cls) -> object:
        class Snap(pl.Callback):
            def __init__(self) -> None:
                self.at_start: dict[str, torch.Tensor] = {}

            def on_train_start(self, trainer, pl_module) -> None:
                self.at_start = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        return Snap()


def _fit(module: object, loader: object, cb: object, tmp_path) -> tuple[object, object]:
    snap = _Snapshot()
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cb, snap],
                         default_root_dir=str(tmp_path))
    trainer.fit(module, loader)
    return trainer, snap


@needs_pl
@pytest.mark.parametrize("batch_kind", ["tuple", "dict", "explicit"])
def test_lightning_every_parameter_is_trained(batch_kind: str, tmp_path) -> None:
    """Default batch_to_sample on (x, y) and dict batches, and an explicit one: the strided
    conv that replaces the max-pool is in the optimizer and moves; so does every other
    parameter."""
    x, y = _data()
    ds = (_DictSet(x, y) if batch_kind == "dict" else torch.utils.data.TensorDataset(x, y))
    loader = torch.utils.data.DataLoader(ds, batch_size=16)
    module = _lit_module(batch_kind)
    plain = copy.deepcopy(module.model)
    extra = {"batch_to_sample": lambda b: b[0]} if batch_kind == "explicit" else {}
    cb = pl_int.precondition_callback(module_attr="model", maxpool="conv", **extra)
    trainer, snap = _fit(module, loader, cb, tmp_path)
    assert cb.report is not None
    added = _added(module.model, plain)
    assert added == ["pool.weight", "pool.bias"], added
    held = {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in module.parameters()}
    for n, p in module.named_parameters():
        moved = float((p.detach() - snap.at_start[n]).abs().max())
        assert moved > 1e-6, (n, moved)


@needs_pl
def test_lightning_calibrates_on_the_first_batch_input(tmp_path) -> None:
    """The sample is x of the first (x, y) batch: the output std is the target on it."""
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    module = _lit_module()
    cb = pl_int.precondition_callback(module_attr="model", maxpool="conv", target_std=0.5)
    seen = {}

    class Before(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            with torch.no_grad():
                seen["std"] = float(pl_module.model(x[:16]).std(correction=0))
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[cb, Before()], default_root_dir=str(tmp_path))
    trainer.fit(module, loader)
    assert abs(seen["std"] - 0.5) < 0.02, seen


@needs_pl
def test_lightning_batch_it_cannot_read_mentions_batch_to_sample(tmp_path) -> None:
    """A dict batch with two input tensors the forward does not name: refused, saying
    batch_to_sample."""
    x, y = _data()

    class Two(_DictSet):
        def __getitem__(self, i: int) -> dict:
            return {"image": self.x[i], "other": self.x[i], "label": self.y[i]}
    loader = torch.utils.data.DataLoader(Two(x, y), batch_size=16)
    cb = pl_int.precondition_callback(module_attr="model")
    with pytest.raises(PrecondError, match="batch_to_sample"):
        _fit(_lit_module("dict"), loader, cb, tmp_path)


@needs_pl
def test_lightning_refuses_a_parameter_the_optimizer_lacks(tmp_path) -> None:
    """Where no dataloader is known in setup (an iterable Lightning cannot name), the callback
    preconditions on the first batch, after configure_optimizers: the added conv is not in the
    optimizer, and it refuses saying how to precondition in setup."""
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    cb = pl_int.precondition_callback(module_attr="model", maxpool="conv")
    cb.setup = lambda *a, **k: None      # as if setup saw no dataloader
    with pytest.raises(PrecondError, match="sample="):
        _fit(_lit_module(), loader, cb, tmp_path)


def test_default_batch_to_sample() -> None:
    """x from (x, y); a tensor as it is; dict keys the forward takes; the one non-label tensor
    of a dict; two leading entries for a forward requiring two inputs."""
    net = PoolCNN()
    x, y = _data(4)
    f = pl_int.default_batch_to_sample
    assert f((x, y), net) is x
    assert f([x, y], net) is x
    assert f(x, net) is x
    assert f({"image": x, "label": y}, net) is x
    d = f({"x": x, "y": y}, net)
    assert isinstance(d, dict) and list(d) == ["x"] and d["x"] is x

    class Two(nn.Module):
        def forward(self, a, b, mask=None):
            return a + b
    s = f((x, x + 1, y), Two())
    assert isinstance(s, tuple) and len(s) == 2 and s[1] is not y
    with pytest.raises(PrecondError, match="batch_to_sample"):
        f({"a": x, "b": x, "label": y}, net)
    with pytest.raises(PrecondError, match="batch_to_sample"):
        f((x,), Two())


# ---------------------------------------------------------------- transformers Trainer
class LossCNN(nn.Module):
    """PoolCNN with the Trainer's calling convention: keyword inputs, the loss inside."""

    def __init__(self) -> None:
        super().__init__()
        self.net = PoolCNN()

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.net(pixel_values)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def _hf_resnet() -> nn.Module:
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                          layer_type="basic", num_labels=3)
    return tf.ResNetForImageClassification(cfg)


def _images(n: int = 48, size: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"pixel_values": torch.randn(3, size, size, generator=g),
             "labels": torch.randint(0, 3, (), generator=g)} for _ in range(n)]


def _trainer(model: nn.Module, data: list[dict], out: str, steps: int = 3, **args) -> object:
    import transformers as tf
    targs = tf.TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-2,
        lr_scheduler_type="constant", report_to=[], use_cpu=True, disable_tqdm=True,
        logging_steps=1, seed=0, train_sampling_strategy="sequential",
        **{"save_strategy": "no", **args})
    return tf.Trainer(model=model, args=targs, train_dataset=data)


def _hf_snapshot() -> object:
    import transformers as tf

    class Snap(tf.TrainerCallback):
        def __init__(self) -> None:
            self.at_start: dict[str, torch.Tensor] = {}

        def on_step_begin(self, args, state, control, model=None, **kw) -> None:
            if not self.at_start:
                self.at_start = {n: p.detach().clone() for n, p in model.named_parameters()}
    return Snap()


@pytest.mark.parametrize("which", ["cnn", "resnet"])
def test_trainer_every_parameter_is_trained(which: str, tmp_path) -> None:
    """precondition_trainer preconditions before create_optimizer: the strided conv that
    replaces the max-pool (transformers ResNet: embedder.pooler) is in the optimizer and moves."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from precondfx.integrations.hf import precondition_trainer
    model = LossCNN() if which == "cnn" else _hf_resnet()
    plain = copy.deepcopy(model)
    data = _images(size=8 if which == "cnn" else 32)
    trainer = _trainer(model, data, str(tmp_path))
    cb = precondition_trainer(trainer, maxpool="conv")
    snap = _hf_snapshot()
    trainer.add_callback(snap)
    trainer.train()
    assert cb.report is not None
    added = _added(model, plain)
    want = (["net.pool.weight", "net.pool.bias"] if which == "cnn"
            else ["resnet.embedder.pooler.weight", "resnet.embedder.pooler.bias"])
    assert added == want, added
    held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters()}
    for n in added:
        p = dict(model.named_parameters())[n]
        assert float((p.detach() - snap.at_start[n]).abs().max()) > 1e-6, n


def test_trainer_callback_refuses_a_parameter_the_optimizer_lacks(tmp_path) -> None:
    """The callback alone runs in on_train_begin, after the optimizer is built: on a model
    whose max-pool becomes a strided conv it refuses, naming the parameters and the way out."""
    pytest.importorskip("accelerate")
    from precondfx.integrations.hf import precondition_callback
    model = _hf_resnet()
    trainer = _trainer(model, _images(size=32), str(tmp_path))
    trainer.add_callback(precondition_callback(maxpool="conv"))
    with pytest.raises(PrecondError, match=r"embedder\.pooler\.weight.*precondition_trainer"):
        trainer.train()


def test_trainer_given_optimizer_lacking_a_parameter_is_refused(tmp_path) -> None:
    """An optimizer built by the user before the Trainer cannot hold the added conv: refused."""
    pytest.importorskip("accelerate")
    import transformers as tf
    from precondfx.integrations.hf import precondition_trainer
    model = LossCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    targs = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=2,
                                 per_device_train_batch_size=8, report_to=[], use_cpu=True,
                                 disable_tqdm=True, save_strategy="no")
    trainer = tf.Trainer(model=model, args=targs, train_dataset=_images(), optimizers=(opt, None))
    precondition_trainer(trainer, maxpool="conv")
    with pytest.raises(PrecondError, match=r"net\.pool\.weight"):
        trainer.train()


@pytest.mark.slow
def test_trainer_resume_keeps_the_added_parameters(tmp_path) -> None:
    """Its checkpoints cannot fold (the added conv): an interrupted run resumed on a fresh plain
    model with precondition_trainer ends where an uninterrupted run does (the checkpoint loads
    into the preconditioned model, added conv included)."""
    pytest.importorskip("accelerate")
    import transformers as tf
    from precondfx.integrations.hf import precondition_trainer
    data = _images(size=32)
    full = _trainer(_hf_resnet(), data, str(tmp_path / "a"), steps=6)
    precondition_trainer(full, maxpool="conv")
    full.train()

    class Stop(tf.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step >= 3:
                control.should_training_stop = True
                control.should_save = True
    part = _trainer(_hf_resnet(), data, str(tmp_path / "b"), steps=6, save_strategy="steps",
                    save_steps=3)
    precondition_trainer(part, maxpool="conv")
    part.add_callback(Stop())
    part.train()
    resumed = _trainer(_hf_resnet(), data, str(tmp_path / "b"), steps=6)
    precondition_trainer(resumed, maxpool="conv")
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-3"))
    a, b = dict(full.model.named_parameters()), dict(resumed.model.named_parameters())
    assert set(a) == set(b)
    moved = float((a["resnet.embedder.pooler.weight"]
                   - part.model.resnet.embedder.pooler.weight).abs().max())
    for n in a:
        diff = float((a[n] - b[n]).abs().max())
        assert diff < 1e-5 + 0.01 * moved, (n, diff, moved)


@needs_pl
@pytest.mark.parametrize("where", ["configure_model", "setup"])
def test_lightning_network_built_late_is_preconditioned_before_the_optimizer(
        where: str, tmp_path) -> None:
    """A network built in configure_model or in the LightningModule's own setup (both after
    the callback's setup) is preconditioned just before configure_optimizers: the optimizer
    holds the added conv and training moves it."""
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)

    class Late(pl.LightningModule):
        def _build(self) -> None:
            if not hasattr(self, "model"):
                torch.manual_seed(0)
                self.model = PoolCNN()

        def configure_model(self) -> None:
            if where == "configure_model":
                self._build()

        def setup(self, stage: str) -> None:
            if where == "setup":
                self._build()

        def training_step(self, batch, idx):
            return nn.functional.cross_entropy(self.model(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
    module = Late()
    cb = pl_int.precondition_callback(module_attr="model", maxpool="conv")
    trainer, snap = _fit(module, loader, cb, tmp_path)
    assert cb.report is not None
    assert "configure_optimizers" not in module.__dict__    # the wrapper removed itself
    held = {id(p) for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in module.parameters()}
    moved = float((module.model.pool.weight.detach() - snap.at_start["model.pool.weight"])
                  .abs().max())
    assert moved > 1e-6, moved


def test_trainer_trains_as_a_model_preconditioned_beforehand(tmp_path) -> None:
    """precondition_trainer gives the run of a model preconditioned by hand on the first batch
    with the same options: same constants, same data order (the sample is drawn without moving
    the random state), same parameters after 3 steps."""
    pytest.importorskip("accelerate")
    from precondfx.integrations.hf import precondition_trainer
    data = _images()
    by_hand = LossCNN()
    auto = copy.deepcopy(by_hand)
    first = {k: torch.stack([r[k] for r in data[:8]]) for k in data[0]}
    precondfx.precondition(by_hand, first, inplace=True, maxpool="conv")
    a = _trainer(by_hand, data, str(tmp_path / "a"), steps=3)
    a.train()
    b = _trainer(auto, data, str(tmp_path / "b"), steps=3)
    precondition_trainer(b, maxpool="conv")
    b.train()
    pa, pb = dict(by_hand.named_parameters()), dict(auto.named_parameters())
    assert set(pa) == set(pb)
    assert max(float((pa[n] - pb[n]).abs().max()) for n in pa) < 1e-6
    bufs = dict(by_hand.named_buffers())
    assert all(torch.equal(bufs[n], b_) for n, b_ in auto.named_buffers())


@pytest.mark.parametrize("how", ["args", "given", "explicit", "adamw"])
def test_trainer_with_sgd_puts_the_suggested_rate_on_its_rate(how: str, tmp_path) -> None:
    """precondition_trainer with an SGD optimizer passes lr= the Trainer's rate and
    optimizer='sgd' (precondfx.pytorch.lr_target): the preconditioned model's suggested SGD rate,
    measured here again with another start vector, is within half an octave of it.  The
    options the user passes win; with AdamW (the Trainer's default) nothing is passed."""
    pytest.importorskip("accelerate")
    import math
    import transformers as tf
    from precondfx.integrations.hf import precondition_trainer
    from precondfx.pytorch.capture.common import Sample
    from precondfx.pytorch.measure.suggest import suggest_lr
    model = LossCNN()
    data = _images()
    if how == "given":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        targs = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=2,
                                     per_device_train_batch_size=8, report_to=[], use_cpu=True,
                                     disable_tqdm=True, save_strategy="no")
        trainer = tf.Trainer(model=model, args=targs, train_dataset=data,
                             optimizers=(opt, None))
        want = 0.05
    else:
        trainer = _trainer(model, data, str(tmp_path),
                           **({} if how == "adamw" else {"optim": "sgd"}))
        want = 2 ** -8 if how == "explicit" else 1e-2
    cb = precondition_trainer(trainer, **({"lr": want, "optimizer": "sgd"}
                                          if how == "explicit" else {}))
    trainer.train()
    sec = cb.report.conditioning.get("lr_target")
    if how == "adamw":      # lr='auto' at AdamW's first step: the storage is kept
        assert sec["factor"] == 1.0 and "AdamW is not SGD" in sec["kept"]
        return
    assert sec["lr"] == want and sec["optimizer"] == "sgd"
    x = torch.stack([d["pixel_values"] for d in data[:8]])
    fresh = LossCNN()
    out, _ = precondfx.precondition(fresh, {"pixel_values": x}, lr=want, optimizer="sgd")
    got = suggest_lr(out, Sample((), {"pixel_values": x}), iters=100, seed=5,
                     families=("sgd",))["sgd"]
    assert abs(math.log2(got / want)) < 0.5
