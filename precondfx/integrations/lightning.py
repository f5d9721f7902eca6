"""Lightning: a ``Callback`` that preconditions the network of a ``LightningModule``.

Lightning is not a dependency of precondfx: this module imports ``lightning.pytorch`` (or the
older ``pytorch_lightning``) when the callback is built, and says what to install otherwise.

Two moments, both in place (the parameters stay the same objects, so optimizers that already
hold them keep working):

* ``sample=`` given: in ``setup`` (stage ``fit``), before Lightning restores a checkpoint, so
  that ``trainer.fit(..., ckpt_path=...)`` loads the saved weights and constants into a model
  that has them (same seed and sample give the same constants);
* otherwise on the first training batch (``on_train_batch_start``), as ``batch_to_sample``
  turns it into what the network is called with (default: the batch itself).  A run resumed
  from a checkpoint of a preconditioned model must use ``sample=``: the checkpoint holds the
  ``precondfx_*`` buffers and Lightning's strict loading refuses them on a plain model.

``module_attr`` names the network inside the LightningModule (``"model"`` for
``self.model``); by default the LightningModule itself is preconditioned.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from precondfx.pytorch.apply.common import PREFIX
from precondfx.errors import PrecondError


def _lightning() -> Any:
    try:
        import lightning.pytorch as pl
        return pl
    except ImportError:
        try:
            import pytorch_lightning as pl
            return pl
        except ImportError:
            return None


def available() -> bool:
    """Whether Lightning can be imported here."""
    return _lightning() is not None


def precondition_callback(*, module_attr: str | None = None, sample: Any = None,
                          batch_to_sample: Callable[[Any], Any] | None = None,
                          **options: Any) -> Any:
    """A Lightning ``Callback`` that preconditions the network (see the module docstring);
    ``options`` go to ``precondfx.precondition``.  The report is kept as ``callback.report``."""
    pl = _lightning()
    if pl is None:
        raise PrecondError("the Lightning callback needs Lightning: pip install lightning")
    from precondfx.api import precondition

    def net_of(pl_module: nn.Module) -> nn.Module:
        if module_attr is None:
            return pl_module
        net = getattr(pl_module, module_attr, None)
        if not isinstance(net, nn.Module):
            raise PrecondError(f"the LightningModule has no network at .{module_attr}")
        return net

    class PreconditionCallback(pl.Callback):
        """Preconditions the network once, in place."""

        def __init__(self) -> None:
            super().__init__()
            self.report = None

        def _run(self, pl_module: nn.Module, data: Any) -> None:
            net = net_of(pl_module)
            if any(PREFIX in n for n, _ in net.named_buffers()):
                return
            _, self.report = precondition(net, data, inplace=True, **options)

        def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
            if sample is not None and stage == "fit":
                self._run(pl_module, sample)

        def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any,
                                 batch_idx: int) -> None:
            if sample is None and self.report is None:
                self._run(pl_module, batch_to_sample(batch) if batch_to_sample else batch)

    return PreconditionCallback()
