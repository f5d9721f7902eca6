"""transformers: checkpoints that keep the preconditioned function, the preconditioning recorded
in the model's config, and a ``TrainerCallback`` that preconditions on the first batch.

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

from precondfx.pytorch.apply.common import PREFIX
from precondfx.errors import PrecondError
from precondfx.integrations.hf_checkpoints import CONFIG_KEY, is_transformers_model, prepare, \
    reattach

__all__ = ["CONFIG_KEY", "is_transformers_model", "prepare", "reattach", "precondition_callback"]


def _batch_sample(batch: Any, model: nn.Module, drop: tuple[str, ...]) -> Any:
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        return {k: v for k, v in dict(batch).items() if k not in drop}
    return batch


def precondition_callback(**options: Any) -> Any:
    """A ``transformers.TrainerCallback`` that preconditions the Trainer's model in place on the
    first training batch (``options`` go to ``precondition``, e.g. ``use_cache=False``).

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

        def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module = None,
                           train_dataloader: Any = None, **kw: Any) -> None:
            if model is None or train_dataloader is None:
                raise PrecondError("the Trainer passed no model or train dataloader to the "
                                   "callback")
            if any(PREFIX in n for n, _ in model.named_buffers()):
                return   # already preconditioned (e.g. by the user before the Trainer)
            batch = next(iter(train_dataloader))
            sample = _batch_sample(batch, model, drop)
            resumed = state.global_step > 0
            saved = copy.deepcopy(model.state_dict()) if resumed else None
            _, self.report = precondition(model, sample, inplace=True, **options)
            if resumed:
                model.load_state_dict(saved)

    return PreconditionCallback()
