"""Large models: constants that survive materialization, sharded re-initialization, and the
output scale calibrated with a distributed forward (FSDP2 ``fully_shard``, DTensor).

Recipe (docs/guides/large-models.md, ``examples/fsdp_torchrun.py``): plan and apply on the
meta device, shard with ``fully_shard``, ``model.to_empty(device=...)``, then :func:`reinit`
(each rank writes only its shard), :func:`calibrate` (the output statistics are all-reduced,
so every rank ends with the same constant) and, for measured balancing, :func:`balance` (the
per-sample Hessian-block statistics are summed over the ranks, so every rank sets the same
alphas).

Two random streams give the full tensors:

- ``rng="stream"`` (what ``precondfx.reinit`` uses): the single-process draw, one
  ``torch.Generator`` walking the plan in order.  Each rank generates every parameter (one at a
  time, on the CPU) and keeps its shard, so the result is bit-identical to ``precondition`` and
  to ``reinit`` on the unsharded model; the cost per rank is that of the whole model.
- ``rng="counter"``: a counter-based generator (Philox4x64-10, numpy) keyed by the seed and the
  parameter's name, indexed by the element's position in the full tensor.  Each rank draws only
  its shard; the full tensor does not depend on the number of ranks or the sharding, and equals
  ``reinit(..., rng="counter")`` in one process.  Moment matching uses the full tensor's second
  moment, all-reduced from the shards' sums of squares.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from precondfx.pytorch.apply.common import PREFIX
from precondfx.pytorch.apply.shards import (ALIASES, BALANCEABLE, CONSTANTS, RNGS,  # noqa: F401
                                    counter_normal, is_sharded, record_aliases,
                                    record_balanceable, record_constants, restore_constants,
                                    untied)
from precondfx.pytorch.apply.shards import local as shards_local
from precondfx.pytorch.capture.common import main_output, make_sample
from precondfx.errors import PrecondError
from precondfx.core.plan import Plan
from precondfx.pytorch.calibrate import global_masked_std as _global_std
from precondfx.pytorch.calibrate import global_std  # noqa: F401 (public here too)

__all__ = ["CONSTANTS", "RNGS", "balance", "calibrate", "counter_normal", "is_sharded",
           "record_constants", "reinit", "restore_constants", "settle_checkpoints",
           "shard_units"]


# -- sharding units ---------------------------------------------------------------------------
def shard_units(model: nn.Module, plan: Plan | None = None) -> list[list[nn.Module]]:
    """The modules to pass to FSDP2's ``fully_shard`` one call each (the root last, by the
    caller): every module holding parameters of its own, with the modules sharing a tied
    parameter in one unit (``fully_shard([wte, lm_head])``: FSDP2 refuses a parameter managed
    by two units).  Ties come from the plan's ``aliases`` and from the model itself."""
    owner: dict[int, int] = {}          # parameter id -> unit index
    units: list[list[nn.Module]] = []
    names = {n: m for n, m in model.named_modules()}
    alias_of = dict(plan.aliases) if plan is not None else {}
    for name, m in model.named_modules():
        if m is model:
            continue
        own = [p for p in m._parameters.values() if p is not None]
        if not own:
            continue
        keys = {id(p) for p in own}
        for leaf, p in m._parameters.items():   # planned ties the model lost (to_empty)
            c = alias_of.get(f"{name}.{leaf}" if name else leaf)
            if p is not None and c is not None:
                path, _, cleaf = c.rpartition(".")
                other = names.get(path)
                q = other._parameters.get(cleaf) if other is not None else None
                if q is not None:
                    keys.add(id(q))
        hit = sorted({owner[k] for k in keys if k in owner})
        if hit:
            into = hit[0]
            for j in reversed(hit[1:]):           # merge units that this module joins
                units[into].extend(units[j])
                units[j] = []
            units[into].append(m)
        else:
            into = len(units)
            units.append([m])
        for k in keys:
            owner[k] = into
        for mm in units[into]:
            for p in mm._parameters.values():
                if p is not None:
                    owner[id(p)] = into
    return [u for u in units if u]


# -- sharded re-initialization (one loop: precondfx.pytorch.apply.reinit) -----------------------------
def reinit(model: nn.Module, plan: Plan, seed: int, rng: str = "stream") -> list[str]:
    """Apply the plan's parameter inits to a model whose parameters may be DTensors (FSDP2,
    tensor parallel) or plain tensors; each rank writes only its shard.  ``rng``: see the
    module docstring.  The recorded constants (scales) are written back too, so this is the
    one call after ``model.to_empty(device=...)``.  Returns the names changed."""
    from precondfx.pytorch.apply.reinit import reinit as _reinit
    return _reinit(model, plan, seed, rng=rng)



def settle_checkpoints(model: nn.Module, sample: Any, *,
                       forward_kwargs: dict | None = None) -> bool:
    """For a model planned on the meta device, once it holds data (``to_empty``,
    ``reinit``): check by running on ``sample`` where a tied weight's factor can go
    (``folding.confirm_upstream``), then set up a transformers model's checkpoint folding with
    that knowledge (``hf_checkpoints.prepare``).  :func:`calibrate` does it; call it yourself
    when the model has no output scale (``target_std=None``).  Returns whether there was
    anything to settle."""
    from precondfx.pytorch import calibrate as cal
    s = make_sample(sample, forward_kwargs)
    return _settle(model, lambda m: cal.forward(m, s, "eval"))


def _settle(model: nn.Module, run: Any) -> bool:
    from precondfx.pytorch.folding import confirm_upstream, recipe_of
    from precondfx.integrations import hf_checkpoints
    from precondfx.pytorch.apply.eager_output import OUTPUT_CANDIDATES, OUTPUT_LOG_UNCHECKED, \
        settle_output_scale
    rec = recipe_of(model)
    entry = getattr(getattr(model, "config", None), hf_checkpoints.CONFIG_KEY, None)
    waiting = isinstance(entry, dict) and entry.get("checkpoints") == "pending"
    moving = OUTPUT_CANDIDATES in model.__dict__ or OUTPUT_LOG_UNCHECKED in model.__dict__
    if (rec is None or not rec.pending) and not waiting and not moving:
        return False
    settle_output_scale(model, run)     # before confirm_upstream: a head's factor moves on
    confirm_upstream(model, run)
    if hf_checkpoints.is_transformers_model(model):
        hf_checkpoints.prepare(model)
    return True


# -- token and position parameters measured on data --------------------------------------
@torch.no_grad()
def draw_pending_matches(model: nn.Module, sample: Any, mode: str = "train",
                         group: Any = None) -> list[str]:
    """Draw the token and position parameters (rule ``match``: class tokens, position
    embeddings) that a plan made on the meta device could not measure: each at the rms of its
    partner module's output on ``sample`` (sums of squares all-reduced over ``group``), from
    the seeded stream ``precondition`` draws them from with data, so that the result equals
    the one planned with data on the same batch.  :func:`calibrate` calls it first.  Returns
    the names drawn (none unless ``precondfx.reinit`` recorded some after ``to_empty``)."""
    from precondfx.pytorch import calibrate as cal
    from precondfx.pytorch.apply.reinit import reinit as _reinit
    from precondfx.pytorch.apply.shards import PENDING_MATCHES, write
    rec = model.__dict__.get(PENDING_MATCHES)
    if not rec:
        return []
    named = dict(model.named_parameters())
    inits = {n: v for n, v in rec["inits"].items() if n in named}
    if any(named[n].device.type == "meta" for n in inits):
        return []
    modules = dict(model.named_modules())
    lost = sorted(n for n, (_, m) in inits.items() if m is None or m not in modules)
    if lost:
        raise PrecondError(
            f"{', '.join(lost)}: the plan draws these token/position parameters at the rms of "
            f"a layer's output measured on data, and that layer is not a module of the model, "
            f"so it cannot be measured here; after model.to_empty they hold uninitialized "
            f"memory. Give them your usual init (e.g. a normal draw of std 0.02) before "
            f"calibrating, or precondition the model with data")
    sums: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Any:
        def run(mod: nn.Module, args: Any, out: Any) -> None:
            t = out if isinstance(out, torch.Tensor) else None
            if t is not None:
                t = shards_local(t).detach().to(torch.float64)
                sums[name] = torch.stack([t.pow(2).sum(), torch.tensor(
                    float(t.numel()), dtype=torch.float64, device=t.device)])
        return run

    for n, _ in inits.items():      # zeros, not leftover memory, while the partner runs
        write(named[n], torch.zeros(tuple(named[n].shape)))
    paths = sorted({m for _, m in inits.values()})
    handles = [modules[m].register_forward_hook(hook(m)) for m in paths]
    try:
        cal.forward(model, sample, mode)
    finally:
        for h in handles:
            h.remove()
    sub = Plan(options={"seed": rec["seed"]})
    for n, (pi, m) in inits.items():
        st = sums.get(m)
        if st is not None and dist.is_available() and dist.is_initialized():
            dist.all_reduce(st, group=group)
        s2, cnt = (float(v) for v in st.cpu()) if st is not None else (0.0, 0.0)
        r = math.sqrt(s2 / cnt) if cnt else float("nan")
        if not (math.isfinite(r) and r > 0):
            raise PrecondError(
                f"{n}: the plan draws it at the rms of {m}'s output on the calibration batch, "
                f"which is {'not a tensor' if st is None else r}: give it your usual init "
                f"before calibrating, or precondition the model with data")
        sub.inits[n] = replace(pi, std=r)
    model.__dict__.pop(PENDING_MATCHES, None)
    return _reinit(model, sub, rec["seed"])


# -- distributed calibration ------------------------------------------------------------------
def _output_buffers(model: nn.Module) -> list[str]:
    """The output scale's buffers: one, or one per head the main output sums (DeiT's)."""
    names = [n for n, _ in model.named_buffers() if n.rpartition(".")[2] == PREFIX + "output_scale"]
    if not names:
        raise PrecondError("the model has no output scale (precondfx_output_scale buffer): "
                           "precondition it with target_std set (the default) first")
    return names


@torch.no_grad()
def calibrate(model: nn.Module, sample: Any, target_std: float | None = None, *,
              output_key: str | int | None = None, mode: str = "train", group: Any = None,
              forward_kwargs: dict | None = None) -> dict[str, float]:
    """Set the output scale from a distributed forward: every rank runs its own calibration
    batch, the output's sum, sum of squares and count are all-reduced, so the std is that of
    the global batch and every rank sets the same constant.  Works without a process group
    (one process).  ``target_std=None`` takes precondition's default.  Returns the stds
    before and after and the scale."""
    from precondfx.pytorch import calibrate as cal
    from precondfx.pytorch.apply.eager_output import settle_output_scale
    if target_std is None:
        from precondfx.core.options import Options
        target_std = Options().target_std
    if not (target_std and target_std > 0 and math.isfinite(target_std)):
        raise PrecondError(f"target_std={target_std!r} must be a positive number")
    s = make_sample(sample, forward_kwargs)
    cal.check_finite_sample(s)
    loose = untied(model)
    if loose:
        pairs = ", ".join(f"{a} and {c}" for a, c in loose)
        raise PrecondError(
            f"tied parameters are no longer the same tensor ({pairs}; model.to_empty unties "
            f"them, leaving the copy uninitialized): call precondfx.reinit(model, report.plan, "
            f"seed) after to_empty (it ties them again), or model.tie_weights() and then "
            f"reinit, before calibrating")
    draw_pending_matches(model, s, mode, group)
    # a scale planned on the meta device on the returned value goes onto the module(s) that
    # can carry it (checked by running), before a forward whose own loss must see it
    settle_output_scale(model, lambda m: cal.forward(m, s, "eval"))
    buf_names = _output_buffers(model)
    bufs = [model.get_buffer(n) for n in buf_names]
    current = float(bufs[0].float().cpu())
    if not (math.isfinite(current) and current != 0.0):  # uninitialized after to_empty
        current = 1.0
    for buf in bufs:
        buf.fill_(current)
    before, _, masked = _global_std(main_output(cal.forward(model, s, mode), output_key),
                                    group)
    if not math.isfinite(before):
        bad = [n for n, p in model.named_parameters()
               if p.is_floating_point() and not bool(torch.isfinite(shards_local(p)).all())]
        raise PrecondError(
            f"the output on the calibration batch has NaN/+inf values (-inf alone, a mask, "
            f"is measured over the finite entries)"
            f"{' and these parameters hold NaN/inf: ' + ', '.join(bad[:5]) if bad else ''}. "
            f"After model.to_empty every tensor is uninitialized memory: call precondfx.reinit("
            f"model, report.plan, seed) and give the parameters and buffers the plan keeps "
            f"(rule 'keep' in report.plan.inits; rotary frequencies) your usual init first")
    scale = current * cal.solve_output_scale(before, target_std)
    rec = getattr(model, CONSTANTS, None)
    for name, buf in zip(buf_names, bufs):
        buf.fill_(scale)
        if isinstance(rec, dict):
            rec[name] = scale
    after, local, _ = _global_std(main_output(cal.forward(model, s, mode), output_key),
                                  group)
    _settle(model, lambda m: cal.forward(m, s, "eval"))
    return {"std_before": before / current, "scale": scale, "std_after": after,
            "target_std": target_std, "local_std_after": local, "masked_entries": masked}


# -- distributed measured balancing -----------------------------------------------------------
def balance(model: nn.Module, sample: Any, balance: str = "hessian", *, seed: int | None = None,
            output_key: str | int | None = None, mode: str | None = None,
            balance_samples: int | None = None, balance_threshold: float | None = None,
            group: Any = None, forward_kwargs: dict | None = None,
            verbose: bool | None = False) -> dict[str, Any]:
    """Measured balancing (``balance='hessian'`` or ``'auto'``) of a preconditioned model
    that is materialized (after ``to_empty``, :func:`reinit` and :func:`calibrate`): every rank
    calls it with its own batch; each measures the first half of its batch, the per-sample
    statistics are summed over the ranks of ``group`` (any initialized process group; without
    one, this process alone), so every rank sets the same factors: those of one process
    balancing on the global batch whose rank-r part is ``x[r::world]`` (every rank holding the
    same even number of samples).  Sharded (FSDP2) parameters are gathered whole for the
    measurement (the unsharded model's memory on each rank meanwhile), then rescaled shard by
    shard.  The other options default to ``precondition``'s.  Returns the report section
    (``factors``: each rebalanced weight's factor; ``summary``)."""
    from precondfx.core.options import Options
    from precondfx.pytorch import calibrate as cal
    from precondfx.pytorch.balance import balance_measured
    if balance not in ("hessian", "auto"):
        raise PrecondError(f"balance={balance!r}: distributed.balance measures, so it is "
                           f"'hessian' or 'auto' (the analytic alphas were set when planning)")
    split = getattr(model, BALANCEABLE, None)
    if split is None:
        raise PrecondError("the model carries no record of its alpha constants: pass the "
                           "model precondfx.precondition returned (planned on the meta device "
                           "and materialized, or sharded after preconditioning)")
    loose = untied(model)
    if loose:
        raise PrecondError(f"tied parameters are no longer the same tensor "
                           f"({', '.join(f'{a} and {c}' for a, c in loose)}): call "
                           f"precondfx.reinit(model, report.plan, seed) after to_empty, then "
                           f"calibrate, before balancing")
    o = Options()
    s = make_sample(sample, forward_kwargs)
    cal.check_finite_sample(s)
    h = balance_measured(
        model, s, None, {}, balance=balance, split=split,
        seed=o.seed if seed is None else seed,
        output_key=o.output_key if output_key is None else output_key,
        mode=o.calibration if mode is None else mode,
        n_samples=o.balance_samples if balance_samples is None else balance_samples,
        threshold=o.balance_threshold if balance_threshold is None else balance_threshold,
        verbose=verbose, distributed=True, group=group)
    rec = getattr(model, CONSTANTS, None)
    if h.get("applied") and isinstance(rec, dict):   # what restore_constants writes back
        for w in h["factors"]:
            for b in split[0][w]:
                rec[b] = float(model.get_buffer(b).detach().float().cpu())
    return h
