"""Lightning: a ``Callback`` that preconditions the network of a ``LightningModule``.

Lightning is not a dependency of precondfx: this module imports ``lightning.pytorch`` (or the
older ``pytorch_lightning``) when the callback is built, and says what to install otherwise.

The callback preconditions in place before the optimizers are built, so that parameters
preconditioning adds (the strided convolution that replaces a max-pool) are trained: in
``setup`` (stage ``fit``) when the network and a sample are there, which is also before
Lightning restores a checkpoint, so that ``trainer.fit(..., ckpt_path=...)`` loads the saved
weights and constants into a model that has them (the same seed and sample give the same
constants); otherwise (a network built in the LightningModule's ``setup`` or
``configure_model``, a dataset its ``setup`` builds) just before ``configure_optimizers``.

The sample is ``sample=`` when given, else the first batch of the training dataloader (drawn
without moving the global random state; the ``train_dataloader`` hook is called once more)
turned by ``batch_to_sample`` into what the network is called with.  The default takes ``x``
from ``(x, y)`` batches (as many leading entries as the network's forward requires), a tensor
as it is, and from a dict batch the keys the forward takes (or its one tensor that is not a
label).  Where neither moment finds a network and a batch, the callback preconditions on the
first training batch; an optimizer then exists, and if it misses a parameter preconditioning
added, the callback refuses with a ``PrecondError`` that says what to do.

``module_attr`` names the network inside the LightningModule (``"model"`` for
``self.model``); by default the LightningModule itself is preconditioned.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import nn

from precondfx.core.backend import PREFIX
from precondfx.errors import PrecondError
from precondfx.integrations.common import is_preconditioned, missing_from_optimizers, \
    parameter_ids, refuse_missing

#: dict keys taken for labels, never for the network's input
LABEL_KEYS = frozenset({"y", "label", "labels", "target", "targets"})


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


def _forward_parameters(net: nn.Module) -> tuple[int, set[str], bool]:
    """(number of required positional parameters, names of all parameters, takes ``**kwargs``)
    of ``net.forward``."""
    try:
        params = list(inspect.signature(net.forward).parameters.values())
    except (TypeError, ValueError):
        return 1, set(), True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = sum(1 for p in params if p.kind in positional and p.default is p.empty)
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return required, names, any(p.kind == p.VAR_KEYWORD for p in params)


def _cannot(batch: Any, why: str) -> PrecondError:
    return PrecondError(
        f"the Lightning callback cannot tell the network's input in a training batch "
        f"({type(batch).__name__}): {why}. Pass batch_to_sample= (a function from a batch to "
        f"what the network is called with, e.g. batch_to_sample=lambda b: b['image']) or "
        f"sample= to precondition_callback")


def default_batch_to_sample(batch: Any, net: nn.Module) -> Any:
    """What ``net`` is called with, taken from a training batch: a tensor as it is; from a
    tuple or list ``(x, y)`` the leading entries the forward requires (``x`` alone when it
    requires one); from a dict the entries whose keys the forward takes (a dict of keyword
    inputs), else its one tensor that is not a label."""
    required, names, var_kw = _forward_parameters(net)
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields"):
        if not batch:
            raise _cannot(batch, "it is empty")
        n = max(required, 1)
        if len(batch) < n:
            raise _cannot(batch, f"it has {len(batch)} entries and the forward requires {n} "
                                 f"inputs")
        return batch[0] if n == 1 else tuple(batch[:n])
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        d = dict(batch)
        inputs = {k: v for k, v in d.items() if k not in LABEL_KEYS or k in names}
        if inputs and (set(inputs) <= names or (var_kw and set(inputs) & names)):
            return inputs    # keyword inputs of the forward
        tensors = [k for k, v in inputs.items() if isinstance(v, torch.Tensor)]
        if len(tensors) == 1:
            return d[tensors[0]]
        raise _cannot(batch, f"its keys {sorted(d)} are not all parameters of the forward "
                             f"({sorted(names)}) and it holds {len(tensors)} tensors that are "
                             f"not labels")
    raise _cannot(batch, "it is neither a tensor, a tuple/list nor a dict")


#: the Trainer's loop for each stage (its ``_data_source`` says where the batches come from)
LOOPS = {"fit": "fit_loop", "validate": "validate_loop", "test": "test_loop",
         "predict": "predict_loop"}


def _first_batch(trainer: Any, stage: str = "fit") -> Any:
    """The first batch of the trainer's dataloader for ``stage`` (training by default; the
    first dataloader of an evaluation stage), or None where Lightning does not say which
    dataloader it will use before the stage starts."""
    source = getattr(getattr(trainer, LOOPS.get(stage, "fit_loop"), None), "_data_source", None)
    if source is None or not hasattr(source, "dataloader"):
        return None
    if hasattr(source, "is_defined") and not source.is_defined():
        return None
    with torch.random.fork_rng(devices=[]):
        try:
            loader = source.dataloader()   # the train_dataloader hook, called once more
        except Exception:  # noqa: BLE001 - e.g. a dataset the LightningModule's setup builds
            return None
        if stage != "fit" and isinstance(loader, (list, tuple)) and loader:
            loader = loader[0]   # an evaluation stage runs its dataloaders one after another
        if isinstance(loader, (dict, list, tuple)) or loader is None:
            return None   # several dataloaders (combined by Lightning): not guessed
        return next(iter(loader))


def precondition_callback(*, module_attr: str | None = None, sample: Any = None,
                          batch_to_sample: Callable[[Any], Any] | None = None,
                          **options: Any) -> Any:
    """A Lightning ``Callback`` that preconditions the network (see the module docstring);
    ``options`` go to ``precondfx.precondition``.  The report is kept as ``callback.report``."""
    pl = _lightning()
    if pl is None:
        raise PrecondError("the Lightning callback needs Lightning: pip install lightning")
    from precondfx.api import precondition
    from precondfx.core.options import Options, option_names
    if "inplace" in options:
        raise PrecondError("precondition_callback always preconditions the LightningModule's "
                           "network in place (the optimizer Lightning builds must hold its "
                           "parameters): drop inplace=")
    if module_attr is not None and not (isinstance(module_attr, str) and module_attr):
        raise PrecondError(f"module_attr={module_attr!r} must be the name of the network's "
                           f"attribute (a string such as 'model') or None")
    # the options' values are checked now, not at the first fit (other keywords go to the
    # network's forward, which precondition checks when it has the network)
    Options.from_keywords(**{k: v for k, v in options.items() if k in set(option_names())})

    def net_of(pl_module: nn.Module) -> nn.Module:
        if module_attr is None:
            return pl_module
        net = getattr(pl_module, module_attr, None)
        if not isinstance(net, nn.Module):
            raise PrecondError(f"the LightningModule has no network at .{module_attr}")
        return net

    def to_sample(batch: Any, net: nn.Module) -> Any:
        return batch_to_sample(batch) if batch_to_sample else default_batch_to_sample(batch, net)

    def has_net(pl_module: nn.Module) -> bool:
        return module_attr is None or isinstance(getattr(pl_module, module_attr, None), nn.Module)

    def done(pl_module: nn.Module) -> bool:
        """Whether the network is there and already preconditioned."""
        return has_net(pl_module) and is_preconditioned(net_of(pl_module))

    class PreconditionCallback(pl.Callback):
        """Preconditions the network once, in place, before the optimizers are built."""

        def __init__(self) -> None:
            super().__init__()
            self.report = None

        def _run(self, trainer: Any, pl_module: nn.Module, data: Any, late: bool) -> None:
            net = net_of(pl_module)
            if is_preconditioned(net):
                return
            before = parameter_ids(net)
            try:
                _, self.report = precondition(net, data, inplace=True, **options)
            except PrecondError as e:
                if sample is not None or batch_to_sample is not None:
                    raise
                raise PrecondError(f"{e}\n(The sample was taken from the first training batch "
                                   f"by the default batch_to_sample; if it is not what the "
                                   f"network takes, pass batch_to_sample= or sample= to "
                                   f"precondition_callback.)") from e
            if late:
                refuse_missing(
                    missing_from_optimizers(net, before, list(trainer.optimizers or [])),
                    "after Lightning built the optimizers (neither in setup nor before "
                    "configure_optimizers did the callback find the network and a training "
                    "batch, so it preconditioned on the first batch)",
                    "Pass sample= (a batch the network takes) to precondition_callback, and "
                    "build the network in the LightningModule's __init__, setup or "
                    "configure_model; or pass maxpool='keep' or maxpool='avgpool', which add "
                    "no parameters.")

        def _sample_now(self, trainer: Any, pl_module: nn.Module, stage: str = "fit") -> Any:
            """``sample``, else the stage's first batch (training for fit) turned into the
            network's input; None when there is no network or no batch yet."""
            if not has_net(pl_module):
                return None
            if sample is not None:
                return sample
            batch = _first_batch(trainer, stage)
            return None if batch is None else to_sample(batch, net_of(pl_module))

        def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
            if done(pl_module):
                return
            if stage != "fit":
                self._before_restore(trainer, pl_module, stage)
                return
            data = self._sample_now(trainer, pl_module)
            if data is not None:   # before checkpoint restore and configure_optimizers
                self._run(trainer, pl_module, data, late=False)
                return
            # the network or its data comes later (the LightningModule's setup or
            # configure_model): precondition just before configure_optimizers, or, resuming
            # (ckpt_path), just before Lightning loads the checkpoint, which comes first
            self._before_restore(trainer, pl_module, stage)
            original = pl_module.configure_optimizers

            def configure_optimizers(*args: Any, **kwargs: Any) -> Any:
                pl_module.__dict__.pop("configure_optimizers", None)
                if not done(pl_module):
                    data = self._sample_now(trainer, pl_module)
                    if data is not None:
                        self._run(trainer, pl_module, data, late=False)
                return original(*args, **kwargs)
            pl_module.configure_optimizers = configure_optimizers

        def _before_restore(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
            """validate/test/predict with ``ckpt_path``, and resuming a fit whose network is
            built late (after the callback's ``setup``): a checkpoint of a preconditioned
            network holds its ``precondfx_*`` constants (and the parameters preconditioning
            added), which a fresh LightningModule lacks.  Lightning calls the module's
            ``on_load_checkpoint`` just before loading the weights: precondition there (on
            ``sample=`` or the stage's first batch; the checkpoint then overwrites the weights
            and constants), only when the checkpoint holds a preconditioned network."""
            original = pl_module.on_load_checkpoint

            def on_load_checkpoint(checkpoint: Any, *args: Any, **kwargs: Any) -> Any:
                pl_module.__dict__.pop("on_load_checkpoint", None)
                state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
                if isinstance(state, dict) and any(PREFIX in k for k in state) \
                        and has_net(pl_module) and not done(pl_module):
                    data = self._sample_now(trainer, pl_module, stage)
                    if data is None:
                        raise PrecondError(
                            f"trainer.{stage}(ckpt_path=...) loads a checkpoint of a "
                            f"preconditioned network (it holds precondfx_* constants) into a "
                            f"network that is not preconditioned, and the callback found no "
                            f"batch to precondition it on first: pass sample= (a batch the "
                            f"network takes) to precondition_callback")
                    self._run(trainer, pl_module, data, late=False)
                return original(checkpoint, *args, **kwargs)
            pl_module.on_load_checkpoint = on_load_checkpoint
            self._installed = pl_module

        def teardown(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
            # the hook wrapper of an evaluation stage that loaded no checkpoint
            if getattr(self, "_installed", None) is pl_module:
                pl_module.__dict__.pop("on_load_checkpoint", None)
                self._installed = None

        def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any,
                                 batch_idx: int) -> None:
            if not is_preconditioned(net_of(pl_module)):
                self._run(trainer, pl_module, to_sample(batch, net_of(pl_module)), late=True)

    return PreconditionCallback()
