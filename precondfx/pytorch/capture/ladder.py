"""Capture: turn a model and a sample into the neutral graph, trying methods in order.

The ladder is ``fx`` (symbolic trace; the only one whose result is itself editable), ``export``
(torch.export, non-strict), ``draft_export`` (specializes data-dependent branches on the sample)
and ``eager`` (records one real run; works on any model that runs).  The first that succeeds is
used; the report says which, and why the earlier ones failed.
"""
from __future__ import annotations

import contextlib
import io
import logging
import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

from precondfx.pytorch.calibrate import PROCESS_STATE, quiet_run
from precondfx.pytorch.capture import eager_capture, export_capture, fx_capture, meta
from precondfx.pytorch.capture.common import Sample
from precondfx.pytorch.checks import is_out_of_memory
from precondfx.errors import PrecondError
from precondfx.core.graph import Graph
from precondfx.core import nodes

METHODS = ("fx", "export", "draft_export", "eager")


@dataclass
class Captured:
    """The captured graph, the GraphModule when fx succeeded, and the failed attempts."""

    graph: Graph
    gm: fx.GraphModule | None = None
    attempts: list[tuple[str, str]] = field(default_factory=list)


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200] if msg else ''}"


@contextlib.contextmanager
def _silenced():
    """Keep torch.export's warnings and logs off the user's console during attempts (one
    thread at a time: the state it changes is the process's, ``PROCESS_STATE``)."""
    with PROCESS_STATE:
        with _silenced_here():
            yield


@contextlib.contextmanager
def _silenced_here():
    """:func:`_silenced`'s work, under its lock."""
    loggers = [logging.getLogger(n) for n in ("torch._export", "torch.export", "torch._dynamo",
                                             "torch.fx.experimental.symbolic_shapes",
                                             "torch._subclasses", "torch._functorch")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def unseen_parameters(model: torch.nn.Module, graph: Graph) -> list[str]:
    """Parameters (by every name they go by) that no captured node reads."""
    read = {p for n in graph for p in n.params.values()}
    ids = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if name in read}
    return [name for name, p in model.named_parameters() if id(p) not in ids]


def _check_path(model: torch.nn.Module, sample: Sample, graph: Graph) -> None:
    """Refuse a draft_export graph whose parameters are not those of the modules the sample's
    own forward calls: its data-dependent branches were specialized on hints, not on the
    sample (an MoE whose sample routes to experts 0 and 1 came out reading experts 0 and 7,
    or 0, 1, 2 and 5).  The eager capture, next, follows the sample."""
    called: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: called.append(name))
             for name, m in model.named_modules() if name]
    try:
        with torch.no_grad():
            model(*sample.copy().args, **sample.copy().kwargs)
    finally:
        for h in hooks:
            h.remove()
    mods = dict(model.named_modules())
    used = {id(p): f"{n}.{k}" for n in dict.fromkeys(called)
            for k, p in mods[n].named_parameters(recurse=False)}
    root = {id(p) for p in model.parameters(recurse=False)}
    read = {p for n in graph for p in n.params.values()}
    seen = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)
            if name in read}
    missed = [name for i, name in used.items() if i not in seen]
    extra = [name for i, name in seen.items() if i not in used and i not in root]
    if missed or extra:
        said = ([f"never reads {', '.join(missed[:2])} ({len(missed)} in all), which the "
                 f"sample's forward uses"] if missed else []) + \
            ([f"reads {', '.join(extra[:2])} ({len(extra)} in all), which it does not"]
             if extra else [])
        raise RuntimeError(f"draft_export took other data-dependent branches than the "
                           f"sample: its graph {'; it '.join(said)}")


def capture(model: torch.nn.Module, sample: Sample, methods: tuple[str, ...] | list[str] = METHODS,
            mode: str = "train") -> Captured:
    """Try each capture method in turn; raise PrecondError if none works."""
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise PrecondError(f"unknown capture method(s) {bad}: choose from {METHODS}")
    attempts: list[tuple[str, str]] = []
    on_meta = meta.on_meta(model)
    # Forwards the capture runs itself (fx shape propagation, the eager recorder) use fake
    # tensors on a meta model; torch.export makes its own.
    fake = meta.fake_mode if on_meta else contextlib.nullcontext
    value_error: BaseException | None = None
    fallback: Captured | None = None   # an fx graph with layers hidden in opaque calls
    for method in methods:
        sample = sample.copy()  # a forward that changes its inputs in place changes a copy
        try:
            with quiet_run(model, mode), _silenced():
                if method == "fx":
                    gm = fx_capture.trace(model, sample)
                    with fake():
                        fx_capture.run_shape_prop(gm, sample)
                    if not on_meta:
                        fx_capture.check_same(gm, model, sample)
                    graph = fx_capture.to_graph(gm)
                    result = Captured(graph, gm)
                    hidden = fx_capture.opaque_parameter_calls(gm)
                    if hidden and method != methods[-1]:
                        fallback = result
                        fn, par = hidden[0]
                        attempts.append((method, (
                            f"not used: the trace records {fn} as one call and it takes "
                            f"{par} ({len(hidden)} such call(s)): the layers inside would be "
                            f"hidden from the plan; a method that runs it sees into it")))
                        continue
                elif method in ("export", "draft_export"):
                    with meta.default_meta() if on_meta else contextlib.nullcontext():
                        ep = export_capture.export(model, sample,
                                                   draft=method == "draft_export")
                    result = Captured(export_capture.to_graph(ep, model, method))
                    if method == "draft_export" and not on_meta:
                        _check_path(model, sample, result.graph)
                else:
                    with fake():
                        graph, _ = eager_capture.capture(model, sample)
                    result = Captured(graph)
        except PrecondError:
            raise
        except fx_capture.Unkeepable as e:  # traced fine, but the graph would lose a construct
            attempts.append((method, f"not used: {e}"))
            continue
        except Exception as e:  # a capture method failed: record why and try the next
            if is_out_of_memory(e):  # the next method would run out too (checks.guarded)
                raise
            attempts.append((method, f"failed: {_first_line(e)}"))
            if on_meta and method == "eager" and meta.data_dependent(e):
                value_error = e
            continue
        result.attempts = attempts
        result.graph = nodes.weight_gains(nodes.weight_transposes(result.graph),
                                          {} if on_meta else scalar_buffers(model))
        result.graph.notes[:0] = [f"{m} {why}" for m, why in attempts]
        unseen = unseen_parameters(model, result.graph)
        if unseen:
            shown = ", ".join(unseen[:8]) + (f" and {len(unseen) - 8} more" if len(unseen) > 8
                                              else "")
            result.graph.notes.append(
                f"{len(unseen)} parameter(s) never used on the sample's path through the model "
                f"(a branch the sample did not take, or a module not called): {shown}; they "
                f"keep their current values (not re-initialized, not scaled)")
        return result
    if fallback is not None:     # nothing saw more: the fx graph, with what it hides said
        fallback.attempts = attempts
        fallback.graph.notes[:0] = [f"{m} {why}" for m, why in attempts] + [
            "fx used after all: the later methods failed; the layers inside the opaque calls "
            "keep their weights (see the parameters left as they are)"]
        return fallback
    if value_error is not None:
        raise meta.explain(value_error, "no capture method worked (" + "; ".join(
            f"{m}: {why}" for m, why in attempts) + ")") from value_error
    untried = [m for m in METHODS if m not in methods]
    hint = (f" capture={tuple(methods)!r} tried only {', '.join(methods)}: the other methods "
            f"({', '.join(untried)}) may capture it; drop capture= to try every method in turn "
            f"({', '.join(METHODS)}), or pass capture={untried[0]!r}. Else check that the model "
            f"runs on the sample." if untried else " Check that the model runs on the sample.")
    raise PrecondError("no capture method worked on this model: " +
                       "; ".join(f"{m}: {why}" for m, why in attempts) + "." + hint)


def scalar_buffers(model: nn.Module) -> dict[str, float]:
    """The values of ``model``'s one-element floating-point buffers, by every name they have
    (a fixed gain held as a buffer: ``nodes.weight_gains``); zero, non-finite and meta
    buffers are left out."""
    out: dict[str, float] = {}
    for name, b in model.named_buffers(remove_duplicate=False):
        if b is None or b.numel() != 1 or not b.is_floating_point() or b.is_meta:
            continue
        try:
            v = float(b.detach().reshape(()).item())
        except (RuntimeError, TypeError, ValueError):   # a tensor subclass without a value
            continue
        if math.isfinite(v) and v != 0.0:
            out[name] = v
    return out
