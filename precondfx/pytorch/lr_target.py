"""``lr=`` with ``optimizer=``: the rewritten model's suggested learning rate put on the rate
your training already uses.

precondfx changes the weights' stored scale, so the best learning rate of the result is not
the one a pipeline tuned for the framework's init uses: under SGD it moved 2-4 octaves either
way on the suite's transformers (up on GPT-2, down on BERT and a ViT), and ``lr_scale='auto'``,
which moves Adam's rate back from the declared init, moves SGD's by ``c^2`` the wrong way on
two of them (docs/results/heldout_cpu.md).  What does predict the result's best rate is its
curvature: ``report.suggested_lr`` (``1 / lambda``, :mod:`precondfx.pytorch.measure.suggest`)
came within 10% of the chosen rate's test loss on most suite tasks.  So, told the rate and the
optimizer, the pass moves the result's suggested rate onto it with the one function-preserving
knob it has: every re-drawn layer ``y = W x + b`` becomes ``y = c ((W / c) x + b / c)`` with one
factor ``c`` (the ``lr`` multipliers of :mod:`precondfx.pytorch.lr_transfer`, multiplied onto
what ``lr_scale`` set).  The stored weights' Gauss-Newton curvature scales by ``c^2`` and Adam's
preconditioned curvature by ``c``, so

* SGD: ``c = sqrt(suggested / lr)``;
* Adam: ``c = suggested / lr``, except where ``lr_scale`` already stored the weights for the
  init the model declares (``lr_scale='auto'`` on a transformers model): that storage put the
  best AdamW rate within an octave of the framework init's on all four of the suite's
  transformers, while the Adam curvature suggested rates 1.5-2 octaves below the best there;
  moved onto the user's rate instead, the 4-layer GPT-2 lost to the transformers init at all
  three rates tried (docs/results/keep_rate_check_curv.md; :func:`kept_for_adam`).

Parameters outside the layers (normalization gains, tokens) keep their scale, so the suggested
rate moves a little less than that; the factor is re-measured and corrected up to
:data:`ROUNDS` times, until the suggested rate is within :data:`TOLERANCE` octaves of ``lr``,
and kept within ``2^-FAR..2^FAR``.
Measured on the sample, so a model on the meta device or a sharded one is refused
(``precondfx.api.LR_NEEDS_DATA``).
"""
from __future__ import annotations

import math
from typing import Any, Callable

from torch import nn

from precondfx.pytorch import lr_transfer

#: measure-and-correct rounds at most (the first usually lands within TOLERANCE)
ROUNDS = 3
#: stop once the suggested rate is within this many octaves of lr=
TOLERANCE = 0.25
#: the factor stays within 2^-FAR..2^FAR (stored weights at most 256x off precondfx's scale,
#: safe in half precision); reaching it is reported as a likely mistaken rate or optimizer
FAR = 8.0


def family(optimizer: str) -> str:
    """'sgd' or 'adam' (AdamW's rate is Adam's)."""
    return "sgd" if optimizer == "sgd" else "adam"


def factor(suggested: float, lr: float, fam: str) -> float:
    """The ``c`` that moves a suggested rate ``suggested`` onto ``lr`` (see the module
    docstring): the effective rate moves by ``c^2`` under SGD, ``c`` under Adam."""
    r = suggested / lr
    return math.sqrt(r) if fam == "sgd" else r


def keep_rate(model: nn.Module, graph: Any, plan: Any, lr_buffers: dict[str, list[str]],
              lr: float, optimizer: str, measure: Callable[[str], float | None],
              planned: dict[str, float] | None = None, set_constant: Any = None,
              say: Callable[[str], None] = lambda s: None, ceiling: bool = False,
              headroom: float = 1.0) -> dict[str, Any]:
    """Scale every re-drawn layer by one factor until ``measure(family)`` (the suggested rate of
    ``model`` as it now is) is within :data:`TOLERANCE` octaves of ``lr`` (an Adam rate on a
    plan whose ``lr_mode`` is ``"user"``: nothing, :func:`kept_for_adam`).  ``ceiling``: only
    ever lower the effective rate (the total factor stays <= 1): a suggested rate at or above
    ``lr`` is left as it is (``lr='auto'``, :mod:`precondfx.pytorch.first_step`).
    ``headroom``: the ceiling sits at that many times the suggested rate (SGD's momentum
    raises the rate a quadratic tolerates, :func:`precondfx.pytorch.first_step.headroom`).
    Returns the report section (``conditioning["lr_target"]``)."""
    fam = family(optimizer)
    if fam == "adam" and plan.lr_mode == "user":
        out = kept_for_adam(lr, optimizer)
        plan.notes.append(out["summary"])
        return out
    ok, left = lr_transfer.carried(lr_buffers, plan, graph)
    first = rate = measure(fam)
    total, rounds, lim = 1.0, [], 2.0 ** FAR
    why = f"lr={lr:.4g} ({optimizer})"
    room = headroom if ceiling else 1.0
    for _ in range(ROUNDS):
        if not ok or not rate or not math.isfinite(rate) or \
                abs(math.log2(rate * room / lr)) <= TOLERANCE:
            break
        c = min(max(factor(rate * room, lr, fam), 1.0 / (lim * total)), lim / total)
        if ceiling:
            c = min(c, 1.0 / total)
        if abs(math.log2(c)) < 1e-9:
            break           # at the limit already (or, with the ceiling, at or below it)
        lr_transfer.store(model, plan, ok, {w: c for w in ok}, why, planned, set_constant)
        total *= c
        before, rate = rate, measure(fam)
        rounds.append({"factor": c, "suggested": rate})
        say(f"lr={lr:.4g}: stored weights / {c:.4g}; suggested {fam} rate {before:.4g} -> "
            f"{rate:.4g}")
        if rate and before and abs(math.log2(rate / before)) < 0.25 * abs(math.log2(c)):
            break           # the curvature sits where the factor does not reach
    out: dict[str, Any] = {"lr": lr, "optimizer": optimizer, "factor": total,
                           "suggested_before": first, "suggested_after": rate,
                           "layers": len(ok), "rounds": rounds, "left_out": dict(left)}
    if ceiling:
        out["headroom"] = room
        out["ceiling"] = rate * room if rate else rate
    out["summary"] = _summary(out, fam)
    if ceiling and room != 1.0 and rate:
        out["summary"] += (f"; the ceiling {rate * room:.4g} is {room:.3g}x the suggested rate "
                           f"(half the rate a quadratic of that curvature tolerates under the "
                           f"optimizer's momentum)")
    if ceiling and total == 1.0 and rate and rate * room >= lr:
        top = f"the suggested {fam} rate {rate:.4g}" if room == 1.0 else \
            f"the ceiling {rate * room:.4g} ({room:.3g}x the suggested {fam} rate {rate:.4g})"
        out["summary"] = (f"lr={lr:.4g} ({optimizer}) is at or below {top}: storage kept (the "
                          f"ceiling only lowers a rate above it)")
    if not ok:
        out["warning"] = "lr=: no layer carries an lr multiplier; nothing was scaled"
    elif not first or not math.isfinite(first):
        out["warning"] = (f"lr=: the suggested {fam} rate was not measurable on the "
                          f"calibration batch (the curvature came out zero or not finite: "
                          f"NaN or inf in the model's output or its derivatives there); "
                          f"nothing was scaled, so {lr:.4g} was not checked against it")
    elif abs(math.log2(total)) >= FAR - 1e-9:
        out["warning"] = (f"lr=: the factor reached its limit {total:.3g} (2^{FAR:g} either "
                          f"way) and the suggested {fam} rate went {first:.3g} -> {rate:.3g}, "
                          f"not {lr:.4g}: check that optimizer={optimizer!r} is the optimizer "
                          f"you train with and lr= its rate; if so, the model as preconditioned "
                          f"wants a rate that far from yours (the function is unchanged)")
    elif rate and abs(math.log2(rate * room / lr)) > 1.0 and not (ceiling and
                                                                   rate * room >= lr):
        out["warning"] = (f"lr=: the suggested {fam} rate reached {rate:.4g}, not {lr:.4g}: the "
                          f"curvature sits on parameters outside the scaled layers"
                          + _unscaled(model, plan, ok))
    plan.notes.append(out["summary"])
    return out


def _unscaled(model: nn.Module, plan: Any, ok: dict[str, list[str]], most: int = 4) -> str:
    """The modules holding trainable parameters the factor does not scale (a recurrent cell,
    a normalization, a layer left out), named in the warning with what to do; "" if none."""
    scaled = set(ok) | {lay.bias for lay in plan.layers if lay.weight in ok and lay.bias}
    mods: list[str] = []
    for name, p in model.named_parameters():
        mod = name.rpartition(".")[0] or name
        if p.requires_grad and name not in scaled and mod not in mods:
            mods.append(mod)
    if not mods:
        return ""
    more = f" and {len(mods) - most} more" if len(mods) > most else ""
    rnn = [m for m in mods if isinstance(_module(model, m), nn.RNNBase)]
    why = (f"; {', '.join(rnn[:most])}: a recurrent module's gates read its weight_ih, "
           f"weight_hh and biases inside the cell (W_ih x + W_hh h + b, then the gate's "
           f"nonlinearity, at every time step), where no multiplier outside it preserves its "
           f"function, so no factor is put on them" if rnn else "")
    return (f" ({', '.join(mods[:most])}{more}: the factor does not reach them, so they train "
            f"at your rate, above what their curvature takes; give them a lower rate in a "
            f"parameter group of their own{why})")


def _module(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def kept_for_adam(lr: float, optimizer: str) -> dict[str, Any]:
    """The report section when ``lr_scale`` already stored each weight for the init the model
    declares (``plan.lr_mode == "user"``) and the rate is an Adam rate: that storage is kept
    (see the module docstring; docs/results/keep_rate_check_curv.md)."""
    return {"lr": lr, "optimizer": optimizer, "factor": 1.0, "layers": 0, "rounds": [],
            "summary": f"lr={lr:.4g} ({optimizer}): kept the storage lr_scale chose from your "
                       f"model's declared init (under Adam it lands the best rate near a rate "
                       f"tuned for that init; the curvature's suggestion is lower on "
                       f"transformers)"}


def _summary(out: dict[str, Any], fam: str) -> str:
    b, a = out["suggested_before"], out["suggested_after"]
    rates = f"{b:.4g} -> {a:.4g}" if b and a else "not measurable"
    return (f"lr={out['lr']:.4g} ({out['optimizer']}): {out['layers']} layers' stored weights "
            f"and biases / {out['factor']:.4g}, outputs x {out['factor']:.4g} (the same "
            f"function); suggested {fam} rate {rates}")


__all__ = ["ROUNDS", "TOLERANCE", "FAR", "family", "factor", "keep_rate", "kept_for_adam"]
