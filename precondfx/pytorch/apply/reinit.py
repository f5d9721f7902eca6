"""Re-initialize a PyTorch model's parameters as the plan says, deterministically from a seed.

Draws are made in float32 on the CPU from one ``torch.Generator`` walking the plan in order, then
copied into each parameter, so the result does not depend on the device or dtype of the model.
Shared (tied) parameters are drawn once: the plan has one entry per parameter.  The draw of each
rule (normal draws moment-matched: their empirical second moment is exactly the planned one) is
``precondfx.core.draw``'s, the same routine the ONNX back end uses.
"""
from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from precondfx.core import draw as core
from precondfx.pytorch.draws import torch_ops
from precondfx.pytorch.apply import shards
from precondfx.errors import PrecondError
from precondfx.core.plan import ParamInit, Plan

log = logging.getLogger("precondfx")


def draw(pi: ParamInit, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor | None:
    """The new value of one parameter (float32, CPU), or None to keep it (the rule of each
    init, moment matching included, is ``precondfx.core.draw``'s, shared with the ONNX path)."""
    return core.draw(pi, shape, torch_ops(gen))


def moment_matched(t: torch.Tensor, std: float) -> torch.Tensor:
    """Rescale a normal draw so its empirical second moment is exactly ``std**2``."""
    return core.moment_matched(t, std, torch_ops(None))


@torch.no_grad()
def reinit(model: nn.Module, plan: Plan, seed: int | None = None, rng: str = "stream"
           ) -> list[str]:
    """Apply the plan's parameter inits to ``model``; returns the names changed (``seed``:
    the plan's own, ``plan.options['seed']``, when None).  A plan made for a model of another
    shape is refused (``check_shapes``).

    Sharded models (DTensor parameters, FSDP2 ``fully_shard``) get the same full tensors, each
    rank writing its shard; ``rng="counter"`` draws each shard alone (see
    :mod:`precondfx.pytorch.distributed`).  Constants recorded by ``precondition`` are written back into
    their buffers (a no-op unless the model went through ``to_empty``)."""
    if rng not in shards.RNGS:
        raise PrecondError(f"rng={rng!r} is not one of {shards.RNGS}")
    if not isinstance(model, nn.Module):
        raise PrecondError(f"reinit takes the model (a torch.nn.Module) first, got "
                           f"{type(model).__name__}")
    if isinstance(plan, dict):     # the plan of a saved report (report.to_json()['plan'])
        plan = Plan.from_dict(plan)
    if not isinstance(plan, Plan):
        hint = " (pass report.plan)" if hasattr(plan, "plan") else ""
        raise PrecondError(f"reinit takes a plan (report.plan of precondition or analyze), got "
                           f"{type(plan).__name__}{hint}")
    if seed is None:
        seed = int(plan.options.get("seed", 0))
    else:       # the check precondition's seed= gets: 1.5, '3', -1 or True are refused
        from precondfx.core.options import SEED_MAX, integer
        seed = integer(0, SEED_MAX)("seed", seed)
    sharded = shards.is_sharded(model)
    named = dict(model.named_parameters(remove_duplicate=False))
    check_shapes(named, plan)
    _record_pending_matches(model, plan, seed, named)
    if not sharded and all(p.device.type == "meta" for p in model.parameters()):
        # Shapes only: nothing to write (drawing a 7B model's tensors to discard them took
        # minutes); the draw happens when reinit runs again after model.to_empty(...).
        return [n for n, pi in plan.inits.items() if n in named and pi.rule != "keep"]
    untied = retie(model, plan, sharded)
    named = dict(model.named_parameters(remove_duplicate=False))
    gen = torch.Generator().manual_seed(core.weight_seed(seed))
    match_gen = torch.Generator().manual_seed(int(seed) + core.MATCH_STREAM)
    changed = []
    others, matches = core.split_match(plan.inits)
    for name, pi in others + matches:
        p = named.get(name)
        if p is None:
            continue
        if pi.rule == "match":        # its own stream, after the others (core.draw)
            new = draw(pi, tuple(p.shape), match_gen)
            if new is not None:
                for q in [p, *[named[a] for a in untied.get(name, ())]]:
                    shards.write(q, new)
                changed.append(name)
            continue
        copies = [named[a] for a in untied.get(name, ())]
        if pi.rule == "scale":
            for q in [p, *copies]:
                shards.local(q).mul_(float(pi.std))
            changed.append(name)
            continue
        if rng == "counter" and pi.rule in shards.COUNTER_RULES:
            for q in [p, *copies]:
                shards.counter_param(q, pi, seed, name)
            changed.append(name)
            continue
        new = draw(pi, tuple(p.shape), gen)
        if new is None:
            continue
        if p.is_complex():
            new = _complex(pi, new, draw(pi, tuple(p.shape), gen))
        keep = _padding_rows(model, name, p)
        if keep is not None:  # the padding row keeps its value (zero), as PyTorch's init does
            # (a shard's row, or any row of a model planned on the meta device, holds no value
            # after to_empty: PyTorch's zero)
            fresh = sharded or getattr(model, shards.NO_DATA, False)
            row = torch.zeros(new[keep].shape) if fresh else p.detach()[keep].cpu()
            new = _keep_row(pi, new, keep, row.to(new.dtype))
        for q in [p, *copies]:
            shards.write(q, new)
        changed.append(name)
    shards.restore_constants(model)
    return changed


def _record_pending_matches(model: nn.Module, plan: Plan, seed: int,
                            named: dict[str, torch.Tensor]) -> None:
    """On a model planned on the meta device that now holds data (``to_empty``, then this
    ``reinit``), keep the token and position parameters whose std the plan measures on data
    (rule ``match`` without a std) with the module whose output is measured, so that
    ``distributed.calibrate`` draws them (``to_empty`` left them uninitialized memory).  Only
    here: a user who loads values after ``to_empty`` without ``reinit`` keeps them."""
    if not getattr(model, shards.NO_DATA, False) or \
            any(p.device.type == "meta" for p in model.parameters()):
        return
    modules = {lay.node: lay.module for lay in plan.layers}
    pending = {n: (pi, modules.get(str(pi.match))) for n, pi in plan.inits.items()
               if pi.rule == "match" and pi.std is None and n in named}
    if pending:
        model.__dict__[shards.PENDING_MATCHES] = {"seed": int(seed), "inits": pending}
    else:
        model.__dict__.pop(shards.PENDING_MATCHES, None)


def check_shapes(named: dict[str, torch.Tensor], plan: Plan) -> None:
    """Refuse a plan made for another model: the first parameter whose shape differs from the
    one the plan recorded (a plan of another width would write that width's inits)."""
    drawn = [n for n, pi in plan.inits.items() if pi.rule != "keep"]
    if drawn and not any(n in named for n in drawn):
        raise PrecondError(
            f"the plan was made for another model: none of the {len(drawn)} parameters it "
            f"re-initializes ({', '.join(drawn[:3])}{', ...' if len(drawn) > 3 else ''}) is a "
            f"parameter of this model, so reinit would change nothing; re-initialize with the "
            f"plan of this model (the one precondfx.precondition returned with it: report.plan)")
    for name, pi in plan.inits.items():
        p = named.get(name)
        if p is None or not pi.shape and p.dim() > 0:   # no shape recorded: nothing to check
            continue
        if tuple(pi.shape) != tuple(p.shape):
            raise PrecondError(
                f"the plan was made for another model: it records {name} with shape "
                f"{tuple(pi.shape)}, but this model's {name} has shape {tuple(p.shape)}; "
                f"re-initialize with the plan of this model (precondfx.precondition or "
                f"analyze on it: report.plan)")


def retie(model: nn.Module, plan: Plan, sharded: bool) -> dict[str, list[str]]:
    """Tie again the parameters the plan records as one (``plan.aliases``): ``model.to_empty``
    gives each module its own new tensor, so GPT-2's ``lm_head.weight`` stops being
    ``transformer.wte.weight`` and would keep uninitialized memory.  A plain model gets the
    planned parameter back under every alias (as ``model.tie_weights()`` does).  A sharded
    model's parameters belong to their FSDP units and cannot be swapped: each copy is written
    with the same values (returned, canonical name -> untied aliases) and a warning says that
    they will train apart.  A name or shape that no longer matches is a PrecondError."""
    named = dict(model.named_parameters(remove_duplicate=False))
    left: dict[str, list[str]] = {}
    for alias, canon in plan.aliases.items():
        a, c = named.get(alias), named.get(canon)
        if a is None or c is None or a is c:
            continue
        if a.shape != c.shape:
            raise PrecondError(
                f"the plan ties {alias} to {canon}, but the model's {alias} has shape "
                f"{tuple(a.shape)} and {canon} {tuple(c.shape)}: re-initialize with the plan of "
                f"this model (precondfx.precondition or analyze on it)")
        if sharded:
            left.setdefault(canon, []).append(alias)
            continue
        path, _, leaf = alias.rpartition(".")
        owner = model.get_submodule(path) if path else model
        if leaf not in owner._parameters:
            raise PrecondError(f"cannot tie {alias} to {canon} again: {alias} is not a plain "
                               f"parameter of its module; tie them yourself "
                               f"(model.tie_weights()) before precondfx.reinit")
        owner._parameters[leaf] = c
        log.info("precondfx: %s tied to %s again (model.to_empty unties tied weights)",
                 alias, canon)
    if left:
        pairs = ", ".join(f"{a} = {c}" for c, al in left.items() for a in al)
        warnings.warn(f"precondfx: tied parameters are separate tensors in this sharded model "
                      f"({pairs}; model.to_empty or fully_shard untied them): each copy got the "
                      f"same values, but they will train apart. Keep them tied: shard the "
                      f"modules sharing them in one unit (precondfx.pytorch.distributed.shard_units), "
                      f"and tie them (model.tie_weights()) before fully_shard", RuntimeWarning,
                      stacklevel=3)
    return left



_RANDOM = ("keep", "zeros", "ones", "constant", "scale")


def _complex(pi: ParamInit, re: torch.Tensor, im: torch.Tensor) -> torch.Tensor:
    """A complex parameter gets random real and imaginary parts with E[|w|^2] = std^2 (a second
    draw for the imaginary part); deterministic rules keep their real value."""
    if pi.rule in _RANDOM:
        return re.to(torch.complex64)
    z = torch.complex(re, im)
    m2 = float(z.abs().double().pow(2).mean())
    target = float(re.double().pow(2).mean())
    return z * (target / m2) ** 0.5 if m2 > 0 else z


def _keep_row(pi: ParamInit, new: torch.Tensor, row: int, value: torch.Tensor) -> torch.Tensor:
    """``new`` with row ``row`` set to ``value``; a random draw's other rows are rescaled so
    that their second moment is still the planned one."""
    m2 = float(new.abs().double().pow(2).mean())
    new[row] = value
    if pi.rule not in _RANDOM and new.shape[0] > 1:
        rest = torch.ones(new.shape[0], dtype=torch.bool)
        rest[row] = False
        got = float(new[rest].abs().double().pow(2).mean())
        if got > 0:
            new[rest] = new[rest] * (m2 / got) ** 0.5
    return new


def _padding_rows(model: nn.Module, name: str, p: torch.Tensor) -> int | None:
    """The padding row of an embedding weight (``padding_idx``), which must stay as it is."""
    path, _, leaf = name.rpartition(".")
    try:
        mod = model.get_submodule(path) if path else model
    except AttributeError:
        return None
    idx = getattr(mod, "padding_idx", None)
    if leaf != "weight" or not isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) or idx is None:
        return None
    return int(idx) % p.shape[0]
