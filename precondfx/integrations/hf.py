"""transformers: checkpoints that keep the preconditioned function, the preconditioning recorded
in the model's config, and preconditioning inside a ``Trainer`` (``precondition_trainer``: before
the optimizer is built; ``precondition_callback``: on the first batch, refusing parameters the
optimizer lacks).

**Checkpoints.**  ``from_pretrained`` builds a fresh model of the config's class and drops
every ``precondfx_*`` buffer ("UNEXPECTED"), so the constants cannot travel as buffers.  For a
transformers model, ``precondition`` therefore makes them non-persistent buffers and folds them
into the weights whenever ``state_dict()`` is taken (``save_pretrained``, Trainer checkpoints):

* a checkpoint is a *plain* model computing the preconditioned function: ``from_pretrained``
  with transformers alone gives the same logits (no precondfx needed);
* ``load_state_dict`` on a preconditioned model divides the constants back out, so Trainer's
  ``resume_from_checkpoint`` restores the trained weights exactly (to float rounding) on a model
  preconditioned the same way (same seed and calibration batch, or this module's callback);
* ``reattach(model)`` puts the preconditioning recorded in ``model.config.precondfx`` back on a
  model loaded with ``from_pretrained`` (constants, hooks, weights divided back), to go on
  training it preconditioned.

When a constant cannot fold (see ``precondfx.fold``: a max-pool turned into a strided
convolution, an input scale...), the constants stay persistent ``precondfx_*`` buffers (loading
into a model preconditioned the same way keeps working), the config says
``"checkpoints": "raw"`` with the reasons, and every ``state_dict()`` warns that
``from_pretrained`` would drop them.
"""
from __future__ import annotations

import copy
from typing import Any

from torch import nn

from precondfx.errors import PrecondError
from precondfx.integrations.common import is_preconditioned, missing_from_optimizers, \
    parameter_ids, refuse_missing
from precondfx.integrations.hf_checkpoints import CONFIG_KEY, is_transformers_model, prepare, \
    reattach

__all__ = ["CONFIG_KEY", "is_transformers_model", "prepare", "reattach", "precondition_callback",
           "precondition_trainer", "sgd_rate"]


def _batch_sample(batch: Any, drop: tuple[str, ...]) -> Any:
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        return {k: v for k, v in dict(batch).items() if k not in drop}
    return batch


_REMEDY = (
    "Precondition before the Trainer builds its optimizer: "
    "precondfx.integrations.hf.precondition_trainer(trainer, **options) in place of the callback "
    "(it preconditions inside the Trainer, just before create_optimizer), or "
    "precondfx.precondition(model, batch, inplace=True) before building the Trainer; or pass "
    "maxpool='keep' or maxpool='avgpool', which add no parameters.")


def precondition_callback(**options: Any) -> Any:
    """A ``transformers.TrainerCallback`` that preconditions the Trainer's model in place on the
    first training batch (``options`` go to ``precondition``, e.g. ``use_cache=False``;
    ``drop_keys=("labels",)`` leaves batch keys out of the sample).

    A callback first hears from the Trainer in ``on_train_begin``, after the optimizer is
    built.  When preconditioning adds parameters there (the strided convolution that replaces a
    max-pool), the optimizer does not hold them and the callback refuses with a
    ``PrecondError``; use ``precondition_trainer(trainer, **options)``, which preconditions
    before ``create_optimizer``.

    On ``resume_from_checkpoint`` the Trainer has already loaded the checkpoint (a folded,
    plain model) when training begins: the callback preconditions again, which with the same
    seed and first batch gives the same constants, then loads the checkpoint's weights back
    through the unfolding hook, so training resumes where it stopped."""
    try:
        from transformers import TrainerCallback
    except ImportError as e:
        raise PrecondError("precondition_callback needs transformers: pip install "
                           "'precondfx[models]'") from e
    from precondfx.api import precondition

    drop = tuple(options.pop("drop_keys", ()))

    class PreconditionCallback(TrainerCallback):
        """Preconditions the model on the first training batch (see ``precondition_callback``)."""

        def __init__(self) -> None:
            self.report = None

        def precondition(self, model: nn.Module, batch: Any, resumed: bool) -> set[int]:
            """Precondition ``model`` in place on ``batch`` (a resumed run's weights are put
            back through the unfolding hook); returns the ids of its parameters before."""
            before = parameter_ids(model)
            saved = copy.deepcopy(model.state_dict()) if resumed else None
            _, self.report = precondition(model, _batch_sample(batch, drop), inplace=True,
                                          **options)
            if resumed:
                model.load_state_dict(saved)
            return before

        def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module = None,
                           train_dataloader: Any = None, optimizer: Any = None,
                           **kw: Any) -> None:
            if model is None or train_dataloader is None:
                raise PrecondError("the Trainer passed no model or train dataloader to the "
                                   "callback")
            if is_preconditioned(model):
                return   # already preconditioned (precondition_trainer, or the user)
            before = self.precondition(model, next(iter(train_dataloader)),
                                       state.global_step > 0)
            refuse_missing(missing_from_optimizers(model, before, [optimizer]),
                           "after the Trainer built its optimizer (a callback runs first in "
                           "on_train_begin)", _REMEDY)

    return PreconditionCallback()


def _first_batch(trainer: Any) -> Any:
    """The Trainer's first training batch, drawn without moving the global random state (the
    run's own shuffling stays what it would be)."""
    import torch
    with torch.random.fork_rng(devices=[]):
        return next(iter(trainer.get_train_dataloader()))


def sgd_rate(trainer: Any) -> float | None:
    """The learning rate ``trainer`` will train with if its optimizer is SGD (torch's, or a
    subclass), else None: an optimizer given to the Trainer (``optimizers=``), else
    ``optimizer_cls_and_kwargs``, else ``args.optim == "sgd"`` with ``args.learning_rate``."""
    import torch
    opt = getattr(trainer, "optimizer", None)
    if opt is not None:
        inner = getattr(opt, "optimizer", opt)          # accelerate's AcceleratedOptimizer
        if isinstance(inner, torch.optim.SGD) and inner.param_groups:
            return float(inner.param_groups[0]["lr"])
        return None
    given = getattr(trainer, "optimizer_cls_and_kwargs", None)
    if given:
        cls, kw = given
        if isinstance(cls, type) and issubclass(cls, torch.optim.SGD):
            return float((kw or {}).get("lr", trainer.args.learning_rate))
        return None
    optim = getattr(trainer.args, "optim", None)
    if str(getattr(optim, "value", optim)) == "sgd":
        return float(trainer.args.learning_rate)
    return None


def precondition_trainer(trainer: Any, **options: Any) -> Any:
    """Make ``trainer`` (a ``transformers.Trainer``, any subclass) precondition its model in
    place on its first training batch *before* it builds its optimizer, so that parameters
    preconditioning adds (the strided convolution that replaces a max-pool) are trained.
    Returns the callback it registers (its ``report`` is set once preconditioned).

    Preconditioning happens when ``train()`` first loads a checkpoint (so that
    ``resume_from_checkpoint`` loads into the preconditioned model, unfoldable constants and
    added parameters included) or builds the optimizer, whichever comes first.  An optimizer
    passed to the Trainer (``optimizers=``) was built before: if it misses an added parameter
    the call refuses with a ``PrecondError``.

    With an SGD optimizer (:func:`sgd_rate`) and neither ``lr`` nor ``optimizer`` among
    ``options``, it passes ``lr=`` the Trainer's rate and ``optimizer="sgd"``
    (:mod:`precondfx.pytorch.lr_target`): at the rate tuned for the framework's init the
    default's stored scale diverged under SGD on two of the suite's four transformers, and with
    ``lr=`` none was worse than the framework's init (docs/results/keep_rate_check.md).  With
    Adam-family optimizers nothing is passed: on a transformers model ``lr=`` would keep the
    default's storage anyway (``lr_target.kept_for_adam``)."""
    rate = sgd_rate(trainer)
    if rate is not None and "lr" not in options and "optimizer" not in options:
        options = {**options, "lr": rate, "optimizer": "sgd"}
    cb = precondition_callback(**options)
    trainer.add_callback(cb)

    def run(model: nn.Module, resumed: bool) -> None:
        if is_preconditioned(model):
            return
        before = cb.precondition(model, _first_batch(trainer), resumed)
        refuse_missing(missing_from_optimizers(model, before, [trainer.optimizer]),
                       "after the optimizer given to the Trainer was built",
                       "Build the optimizer after preconditioning (let the Trainer build it, or "
                       "call precondfx.precondition(model, batch, inplace=True) first), or "
                       "pass maxpool='keep' or maxpool='avgpool', which add no parameters.")

    create = trainer.create_optimizer

    def create_optimizer(model: nn.Module | None = None) -> Any:
        run(trainer.model, getattr(trainer.state, "global_step", 0) > 0)
        return create(model)

    trainer.create_optimizer = create_optimizer
    load = getattr(trainer, "_load_from_checkpoint", None)
    if load is not None:
        def load_from_checkpoint(*a: Any, **kw: Any) -> Any:
            run(trainer.model, False)   # before loading: the checkpoint loads into it
            return load(*a, **kw)
        trainer._load_from_checkpoint = load_from_checkpoint
    return cb
