"""The public entry points: ``precondition`` and ``analyze``.

Each checks the user's options (``precondfx.core.options.Options``), resolves them for the PyTorch
back ends (:func:`resolve_torch`: the scheme's overrides, the meta device's and sharded models'
limits), and hands them to the stage list of ``precondfx.pytorch.pipeline`` (capture -> classify -> plan
-> apply -> re-initialize -> calibrate -> report, run by ``precondfx.core.driver.run``).  The user's
model is never mutated unless ``inplace=True``; if any stage fails, nothing is left half-changed.
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple

from torch import nn

from precondfx.pytorch import distributed, pipeline
from precondfx.pytorch.capture import meta
from precondfx.pytorch.checks import guarded
from precondfx.core.options import DEFAULTS as D
from precondfx.core.options import (REFUSE, Options, Resolved, Rule, Support, flag,
                                    option_names, split_keywords)
from precondfx.core.report import Report
import precondfx.schemes  # noqa: F401 (registers the schemes)
from precondfx.core.scheme import Scheme, resolve_options


class Result(NamedTuple):
    """What ``precondition`` returns: the rewritten model and its report."""

    model: nn.Module
    report: Report


_on_meta = meta.on_meta


#: the PyTorch back ends (fx, eager) support every option
TORCH = Support("PyTorch back end")


def _measures_data(scheme: str) -> bool:
    from precondfx.core.scheme import scheme_class
    return getattr(scheme_class(scheme), "calibrate", Scheme.calibrate) is not Scheme.calibrate


#: lr= (precondfx.pytorch.lr_target) measures the rewritten model's curvature on the sample
LR_NEEDS_DATA = ("lr= measures the rewritten model's curvature on the sample, which needs the "
                 "model's values on one process: precondition the materialized, unsharded "
                 "model, or drop lr= and optimizer= (and pick the rate from a short sweep)")


def _no_data_support(name: str, balance: str, input_scale: str, scheme: str) -> Support:
    """A setting where the model cannot be measured on the calibration batch: measured
    balancing (``'auto'``; ``'hessian'`` plans its alpha sites and is measured after
    materializing, ``precondfx.distributed.balance``), ``input_scale='auto'`` and the schemes
    that measure data are refused, each with the given why."""
    return Support(name, (
        Rule("balance", lambda v: v == "auto", REFUSE, balance),
        Rule("input_scale", lambda v: v == "auto", REFUSE, input_scale),
        Rule("scheme", _measures_data, REFUSE, scheme),
        Rule("lr", lambda v: v not in (None, "auto"), REFUSE, LR_NEEDS_DATA),
        Rule("suggest_lr", lambda v: v, REFUSE, LR_NEEDS_DATA.replace("lr= measures",
                                                                      "suggest_lr=True measures")),
    ))


#: a model on the meta device has shapes but no data: only data-free modes apply (the output
#: scale is inserted at 1 and calibrated after materializing, ``precondfx.pytorch.distributed``)
META = _no_data_support(
    "meta device",
    "balance='auto' measures the model on data, but it is on the meta device: pass "
    "balance='analytic' or 'none'; or balance='hessian', which places an alpha on every "
    "weighted layer, and call precondfx.distributed.balance(model, batch) after to_empty, "
    "reinit and calibrate; or materialize the model first (model.to_empty(device='cpu'))",
    "input_scale='auto' needs the input's values; the model is on the meta device: pass a "
    "number or None",
    "this scheme measures the model on data, but it is on the meta device: use "
    "scheme='geometric', or materialize the model first")


#: a sharded model (DTensor parameters, FSDP2): each rank sees its own batch, so only what
#: all-reduces its statistics applies: the output scale (``precondfx.pytorch.distributed.calibrate``)
#: and measured balancing (per-sample statistics summed over the ranks,
#: ``precondfx.pytorch.measure.ranks``)
SHARDED = Support("sharded model", (
    Rule("input_scale", lambda v: v == "auto", REFUSE,
         "input_scale='auto' would differ between ranks (each sees its own batch): pass a "
         "number or None"),
    Rule("lr", lambda v: v not in (None, "auto"), REFUSE, LR_NEEDS_DATA),
    Rule("scheme", _measures_data, REFUSE,
         "this scheme measures the model on each rank's own batch: use scheme='geometric'"),
))


def resolve_torch(user: Options, model: nn.Module) -> Resolved:
    """The user's options resolved for the PyTorch back ends (the meta device and sharded
    models refuse what they cannot do)."""
    extra = []
    if isinstance(model, nn.Module):
        if _on_meta(model):
            extra.append(META)
        if distributed.is_sharded(model):
            extra.append(SHARDED)
    return resolve_options(user, TORCH, *extra)


def _forward_names(model: Any) -> set[str]:
    """The parameter names of the model's forward (none when it cannot be read)."""
    import inspect
    try:
        return set(inspect.signature(getattr(model, "forward")).parameters)
    except (TypeError, ValueError, AttributeError):
        return set()


@guarded
def analyze(model: nn.Module, sample: Any, *, forward_kwargs: dict | None = None,
            **options: Any) -> Report:
    """Capture, classify and plan without changing anything; the report says what
    ``precondition`` would do with the same options (keyword arguments that are not options
    go to the model's forward, as in ``precondition``)."""
    from precondfx.core.options import option_names, split_keywords
    from precondfx.errors import PrecondError
    names = set(option_names())
    given = sorted(k for k in ("inplace", "verbose") if k in options)
    if given and not any(k in _forward_names(model) for k in given):
        raise PrecondError(
            f"analyze() got {', '.join(f'{k}=' for k in given)}: "
            f"{'an argument' if len(given) == 1 else 'arguments'} of precondition(); analyze "
            f"changes nothing and prints nothing (it returns the report of what precondition "
            f"would do); drop {' and '.join(given)}")
    fwd = split_keywords(model, {k: v for k, v in options.items() if k not in names},
                         forward_kwargs, names, "analyze")
    user = Options.from_keywords(**{k: v for k, v in options.items() if k in names})
    return pipeline.analyze(model, sample, resolve_torch(user, model), fwd)


@guarded
def precondition(model: nn.Module, sample: Any, *, init: str = D.init,
                 balance: str = D.balance, balance_threshold: float = D.balance_threshold,
                 maxpool: str = D.maxpool, pool_conv: str = D.pool_conv,
                 residual: str = D.residual,
                 residual_scale: float | str = D.residual_scale,
                 target_std: float | None = D.target_std,
                 input_scale: float | str | None = D.input_scale,
                 output_key: str | int | None = D.output_key, seed: int = D.seed,
                 lr_scale: str | None = D.lr_scale, lr: float | str | None = D.lr,
                 optimizer: str | None = D.optimizer, reinit_weights: bool = D.reinit,
                 inplace: bool = False,
                 capture: Any = D.capture, calibration: str = D.calibration,
                 forward_kwargs: dict | None = None, verbose: bool = False,
                 balance_samples: int = D.balance_samples, measure: bool = D.measure,
                 suggest_lr: bool = D.suggest_lr,
                 scheme: str = D.scheme, scheme_options: dict | None = D.scheme_options,
                 **more_forward_kwargs: Any) -> Result:
    """Rewrite ``model`` so that it starts well conditioned; returns ``(model, report)``.

    ``sample`` is what the model is called with (a tensor, a tuple of positional inputs or a
    dict of keyword inputs) and doubles as the calibration batch.  Keyword arguments for the
    model's forward go in ``forward_kwargs={...}``; an extra keyword that names a parameter of
    the forward goes there too (e.g. ``use_cache=False``), any other is refused with the option
    it resembles (``balnce`` -> ``balance``).  Every option is defined (default, allowed
    values, meaning) in ``precondfx.core.options.Options``; see also docs/reference/options.md.
    """
    started = time.perf_counter()
    user = Options(init=init, maxpool=maxpool, pool_conv=pool_conv, balance=balance,
                   balance_threshold=balance_threshold, residual=residual,
                   residual_scale=residual_scale, target_std=target_std,
                   input_scale=input_scale, output_key=output_key, seed=seed,
                   lr_scale=lr_scale, lr=lr, optimizer=optimizer, reinit=reinit_weights,
                   scheme=scheme,
                   scheme_options=scheme_options,
                   balance_samples=balance_samples, measure=measure, suggest_lr=suggest_lr,
                   calibration=calibration,
                   capture=capture)
    flag("inplace", inplace)
    flag("verbose", verbose)
    fwd = split_keywords(model, more_forward_kwargs, forward_kwargs, option_names() +
                         ["inplace", "verbose", "forward_kwargs"])
    r = resolve_torch(user, model)
    return Result(*pipeline.precondition(
        model, sample, r, inplace=inplace, verbose=verbose, forward_kwargs=fwd,
        started=started))

