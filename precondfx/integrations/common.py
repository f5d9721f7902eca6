"""What the training-framework callbacks share: whether a model is already preconditioned, and
the check that every parameter preconditioning added is held by the optimizers that exist.

Preconditioning can add parameters (the strided convolution that replaces a max-pool).  An
optimizer built before it does not hold them: they get gradients and never move.  The
callbacks precondition before the optimizer is built; where they cannot, this check refuses."""
from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from precondfx.core.backend import PREFIX
from precondfx.errors import PrecondError


def is_preconditioned(model: nn.Module) -> bool:
    """Whether ``model`` already carries precondfx's constants (``precondfx_*`` buffers)."""
    return any(PREFIX in n for n, _ in model.named_buffers())


def parameter_ids(model: nn.Module) -> set[int]:
    """The ids of ``model``'s parameters (to tell, after preconditioning, which are new)."""
    return {id(p) for p in model.parameters()}


def optimizer_parameter_ids(optimizers: Iterable[Any]) -> set[int]:
    """The ids of every parameter held by ``optimizers`` (torch optimizers or wrappers with
    ``param_groups``, such as accelerate's and Lightning's)."""
    return {id(p) for opt in optimizers if opt is not None
            for group in opt.param_groups for p in group["params"]}


def missing_from_optimizers(model: nn.Module, before: set[int],
                            optimizers: Iterable[Any]) -> list[str]:
    """Names of the trainable parameters of ``model`` that preconditioning added (their ids are
    not in ``before``) and that no optimizer in ``optimizers`` holds (none when there is no
    optimizer yet: one built later takes them)."""
    optimizers = [opt for opt in optimizers if opt is not None]
    if not optimizers:
        return []
    held = optimizer_parameter_ids(optimizers)
    return [n for n, p in model.named_parameters()
            if p.requires_grad and id(p) not in before and id(p) not in held]


def refuse_missing(names: list[str], when: str, remedy: str) -> None:
    """Raise the refusal for parameters added by preconditioning that the optimizer lacks
    (nothing when ``names`` is empty)."""
    if not names:
        return
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    raise PrecondError(
        f"preconditioning added parameters ({shown}: e.g. the strided convolution that replaces "
        f"a max-pool) {when}, and the optimizer does not hold them: they would get gradients "
        f"and never move. {remedy} (The model is left preconditioned in place.)")
