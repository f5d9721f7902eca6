"""Re-initialize a PyTorch model's parameters as the plan says, deterministically from a seed.

Draws are made in float32 on the CPU from one ``torch.Generator`` walking the plan in order, then
copied into each parameter, so the result does not depend on the device or dtype of the model.
Shared (tied) parameters are drawn once: the plan has one entry per parameter.  The draw of each
rule (normal draws moment-matched: their empirical second moment is exactly the planned one) is
``precondfx.draw``'s, the same routine the ONNX back end uses.
"""
from __future__ import annotations

import torch
from torch import nn

from precondfx import draw as core
from precondfx.plan import ParamInit, Plan


def draw(pi: ParamInit, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor | None:
    """The new value of one parameter (float32, CPU), or None to keep it (the rule of each
    init, moment matching included, is ``precondfx.draw``'s, shared with the ONNX path)."""
    return core.draw(pi, shape, core.torch_ops(gen))


def moment_matched(t: torch.Tensor, std: float) -> torch.Tensor:
    """Rescale a normal draw so its empirical second moment is exactly ``std**2``."""
    return core.moment_matched(t, std, core.torch_ops(None))


@torch.no_grad()
def reinit(model: nn.Module, plan: Plan, seed: int) -> list[str]:
    """Apply the plan's parameter inits to ``model``; returns the names changed.

    Sharded models (DTensor parameters, FSDP2 ``fully_shard``) get the same full tensors, each
    rank writing its shard (``precondfx.distributed.reinit``).  Constants recorded by
    ``precondition`` are written back into their buffers (a no-op unless the model went
    through ``to_empty``)."""
    from precondfx import distributed
    if distributed.is_sharded(model):
        return distributed.reinit(model, plan, seed)
    if all(p.device.type == "meta" for p in model.parameters()):
        # Shapes only: nothing to write (drawing a 7B model's tensors to discard them took
        # minutes); the draw happens when reinit runs again after model.to_empty(...).
        named = dict(model.named_parameters(remove_duplicate=False))
        return [n for n, pi in plan.inits.items() if n in named and pi.rule != "keep"]
    gen = torch.Generator().manual_seed(int(seed))
    named = dict(model.named_parameters(remove_duplicate=False))
    changed = []
    for name, pi in plan.inits.items():
        p = named.get(name)
        if p is None:
            continue
        if pi.rule == "scale":
            p.mul_(float(pi.std))
            changed.append(name)
            continue
        new = draw(pi, tuple(p.shape), gen)
        if new is None:
            continue
        p.copy_(new.to(dtype=p.dtype, device=p.device))
        changed.append(name)
    distributed.restore_constants(model)
    return changed
