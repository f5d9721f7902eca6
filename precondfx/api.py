"""The public entry points: ``precondition`` and ``analyze``.

``precondition`` runs the pipeline: capture -> classify -> plan -> apply -> re-initialize ->
calibrate -> report.  The user's model is never mutated unless ``inplace=True``; if any stage
fails, nothing is left half-changed.
"""
from __future__ import annotations

import copy
import logging
import math
import time
import warnings
from typing import Any, NamedTuple

import torch
from torch import nn

from precondfx import calibrate as cal
from precondfx.apply.common import output_path
from precondfx.apply.eager_apply import EagerApplier
from precondfx.apply.fx_apply import FxApplier
from precondfx.apply.reinit import reinit
from precondfx.capture import meta
from precondfx.capture.ladder import Captured, capture
from precondfx.capture.common import Sample, make_sample
from precondfx.balance import balance_measured, held_out
from precondfx.checks import check_model, guarded
from precondfx.classify import classify
from precondfx import distributed
from precondfx.distributed import record_constants
from precondfx.errors import PrecondError
from precondfx.folding import record
from precondfx.graph import Graph
from precondfx.options import DEFAULTS as D
from precondfx.options import REFUSE, Options, Resolved, Rule, Support, flag
from precondfx.plan import ParamInfo, Plan, make_plan
from precondfx.report import Report
from precondfx.verify import measure_report, verify_result
from precondfx.schemes.base import Scheme, SchemeContext, resolve_options

log = logging.getLogger("precondfx")


class Result(NamedTuple):
    """What ``precondition`` returns: the rewritten model and its report."""

    model: nn.Module
    report: Report


def _unwrap(model: Any) -> tuple[nn.Module, list[str]]:
    notes = []
    if not isinstance(model, nn.Module):
        raise PrecondError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
        notes.append("model was wrapped by torch.compile: the original module was preconditioned "
                     "(compile the result again)")
        model = model._orig_mod
    return model, notes


_on_meta = meta.on_meta


#: the PyTorch back ends (fx, eager) support every option
TORCH = Support("PyTorch back end")


def _measures_data(scheme: str) -> bool:
    from precondfx.schemes.base import scheme_class
    return getattr(scheme_class(scheme), "calibrate", Scheme.calibrate) is not Scheme.calibrate


#: a model on the meta device has shapes but no data: only data-free modes apply (the output
#: scale is inserted at 1 and calibrated after materializing, ``precondfx.distributed``)
META = Support("meta device", (
    Rule("balance", lambda v: v in ("auto", "hessian"), REFUSE,
         "balance='auto'/'hessian' measures the model on data, but it is on the meta device: "
         "pass balance='analytic' or 'none', or materialize the model first "
         "(model.to_empty(device='cpu'))"),
    Rule("input_scale", lambda v: v == "auto", REFUSE,
         "input_scale='auto' needs the input's values; the model is on the meta device: pass a "
         "number or None"),
    Rule("scheme", _measures_data, REFUSE,
         "this scheme measures the model on data, but it is on the meta device: use "
         "scheme='geometric', or materialize the model first"),
))


#: a sharded model (DTensor parameters, FSDP2): each rank sees its own batch, so only what
#: all-reduces its statistics applies (the output scale, ``precondfx.distributed.calibrate``)
SHARDED = Support("sharded model", (
    Rule("balance", lambda v: v in ("auto", "hessian"), REFUSE,
         "measured balancing is not distributed (each rank would set alphas from its own "
         "batch): pass balance='analytic' or 'none'"),
    Rule("input_scale", lambda v: v == "auto", REFUSE,
         "input_scale='auto' would differ between ranks (each sees its own batch): pass a "
         "number or None"),
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


def _run(model: nn.Module, s: Sample, mode: str) -> Any:
    """The check forward: a real run, or a fake-tensor run for a model on the meta device."""
    if meta.on_meta(model):
        return meta.forward(model, lambda m: cal.forward(m, s, mode), "checking the model")
    return cal.forward(model, s, mode)


def _float_dtype(model: nn.Module) -> torch.dtype | None:
    dts = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return dts.pop() if len(dts) == 1 else None


def param_infos(model: nn.Module) -> tuple[dict[str, ParamInfo], dict[str, str]]:
    """ParamInfo per canonical parameter name, and the alias -> canonical map for tied ones."""
    infos: dict[str, ParamInfo] = {}
    canon: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        c = first.setdefault(id(p), name)
        canon[name] = c
        if c == name:
            infos[name] = ParamInfo(tuple(p.shape), p.requires_grad,
                                    ".parametrizations." in name)
    return infos, canon


def _canonicalize(graph: Graph, canon: dict[str, str]) -> None:
    for n in graph:
        n.params = {k: canon.get(v, v) for k, v in n.params.items()}


def _prepare(model: Any, sample: Any, forward_kwargs: dict | None, opts: Options,
             methods: Any, mode: str) -> tuple[nn.Module, Sample, list[str]]:
    """The unwrapped model, the sample in the dtype and device the pass computes in, notes
    (``opts`` are resolved options; ``methods`` and ``mode`` are kept for older callers)."""
    model, notes = _unwrap(model)
    check_model(model)
    s = make_sample(sample, forward_kwargs)
    cal.check_finite_sample(s)
    dt = _float_dtype(model)
    if _on_meta(model):     # resolve_torch refused the modes that need data
        s = s.map(lambda t: t.to("meta"))
    if dt is not None:  # float samples in the dtype the pipeline computes in
        work_dt = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
        s = s.map(lambda t: t.to(work_dt) if t.is_floating_point() else t)
    return model, s, notes


def _methods(methods: Any) -> tuple[str, ...]:
    return (methods,) if isinstance(methods, str) else tuple(methods)


def _capture_classify(model: nn.Module, s: Sample, methods: Any, mode: str, notes: list[str]
                      ) -> tuple[Captured, dict[str, ParamInfo]]:
    cap = capture(model, s, _methods(methods), mode)
    cap.graph.notes.extend(notes)
    classify(cap.graph)
    infos, canon = param_infos(model)
    _canonicalize(cap.graph, canon)
    return cap, infos


@guarded
def analyze(model: nn.Module, sample: Any, *, forward_kwargs: dict | None = None,
            **options: Any) -> Report:
    """Capture, classify and plan without changing anything; the report says what
    ``precondition`` would do with the same options (keyword arguments that are not options
    go to the model's forward, as in ``precondition``)."""
    from precondfx.options import keyword_of
    from dataclasses import fields
    names = {keyword_of(f) for f in fields(Options)}
    fwd = {**(forward_kwargs or {}), **{k: v for k, v in options.items() if k not in names}}
    user = Options.from_keywords(**{k: v for k, v in options.items() if k in names})
    r = resolve_torch(user, model)
    opts, sch = r.options, r.scheme
    model, s, notes = _prepare(model, sample, fwd, opts, opts.capture, opts.calibration)
    notes.extend(r.notes())
    work = _private_copy(model)
    if _float_dtype(work) in (torch.float16, torch.bfloat16):
        work = work.float()
    with cal.preserved(work):
        _run(work, s, opts.calibration)
        cap, infos = _capture_classify(work, s, opts.capture, opts.calibration, notes)
    plan = make_plan(cap.graph, infos, opts, alpha_sites=sch.needs_alpha_sites)
    plan.notes.extend(r.notes())
    sch.plan(cap.graph, plan, infos, opts)
    return Report.from_graph(cap.graph, plan)


def _copy_model(model: nn.Module) -> nn.Module:
    """The copy ``precondition`` rewrites; a model that cannot be deep-copied is an error that
    says to pass ``inplace=True``."""
    try:
        return copy.deepcopy(model)
    except RecursionError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. a module holding a lock or an open file
        raise PrecondError(
            f"the model cannot be deep-copied ({type(e).__name__}: {str(e)[:120]}); precondfx "
            f"rewrites a copy so that your model stays unchanged. Pass inplace=True to rewrite "
            f"this module itself (hooks and buffers), or make it copyable (define __deepcopy__ "
            f"or keep the offending attribute outside the module)") from e


def _private_copy(model: nn.Module) -> nn.Module:
    """A deep copy for ``analyze`` to run and trace, so that nothing the model does to itself
    in forward (in-place parameter updates, Python state) reaches the user's model; a model
    that cannot be deep-copied is used as it is, under ``calibrate.preserved``."""
    try:
        return copy.deepcopy(model)
    except Exception:  # noqa: BLE001 - e.g. a module holding a non-copyable handle
        return model


@guarded
def precondition(model: nn.Module, sample: Any, *, init: str = D.init,
                 balance: str = D.balance, balance_threshold: float = D.balance_threshold,
                 maxpool: str = D.maxpool, residual: str = D.residual,
                 residual_scale: float | str = D.residual_scale,
                 target_std: float | None = D.target_std,
                 input_scale: float | str | None = D.input_scale,
                 output_key: str | int | None = D.output_key, seed: int = D.seed,
                 reinit_weights: bool = D.reinit, inplace: bool = False,
                 capture: Any = D.capture, calibration: str = D.calibration,
                 forward_kwargs: dict | None = None, verbose: bool = False,
                 balance_samples: int = D.balance_samples, measure: bool = D.measure,
                 scheme: str = D.scheme, scheme_options: dict | None = D.scheme_options,
                 **more_forward_kwargs: Any) -> Result:
    """Rewrite ``model`` so that it starts well conditioned; returns ``(model, report)``.

    ``sample`` is what the model is called with (a tensor, a tuple of positional inputs or a
    dict of keyword inputs) and doubles as the calibration batch.  Extra keyword arguments go to
    the model's forward (e.g. ``use_cache=False``).  Every option is defined (default, allowed
    values, meaning) in ``precondfx.options.Options``; see also the README.
    """
    user = Options(init=init, maxpool=maxpool, balance=balance,
                   balance_threshold=balance_threshold, residual=residual,
                   residual_scale=residual_scale, target_std=target_std,
                   input_scale=input_scale, output_key=output_key, seed=seed,
                   reinit=reinit_weights, scheme=scheme, scheme_options=scheme_options,
                   balance_samples=balance_samples, measure=measure, calibration=calibration,
                   capture=capture)
    flag("inplace", inplace)
    flag("verbose", verbose)
    r = resolve_torch(user, model)
    return _precondition(model, sample, r, inplace=inplace, verbose=verbose,
                         forward_kwargs={**(forward_kwargs or {}), **more_forward_kwargs})


def _precondition(model: nn.Module, sample: Any, r: Resolved, *, inplace: bool, verbose: bool,
                  forward_kwargs: dict) -> Result:
    """The pipeline over resolved options ``r`` (see ``precondition``)."""
    opts, sch = r.options, r.scheme
    seed, output_key, target_std = opts.seed, opts.output_key, opts.target_std
    calibration, capture = opts.calibration, opts.capture
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        log.info(msg)
        if verbose:
            print(f"[precondfx {time.perf_counter() - t0:6.2f}s] {msg}", flush=True)

    times: dict[str, float] = {}
    current = ["prepare", t0]

    def stage(name: str) -> None:
        """Close the running stage's timer and start ``name`` (report.stage_seconds)."""
        now = time.perf_counter()
        times[current[0]] = times.get(current[0], 0.0) + now - current[1]
        current[0], current[1] = name, now

    model, s, notes = _prepare(model, sample, forward_kwargs, opts, capture, calibration)
    notes.extend(r.notes())
    on_meta = _on_meta(model)
    if _already_preconditioned(model):
        cap, _ = _capture_classify(model, s, capture, calibration, notes)
        rep = Report.from_graph(cap.graph)
        rep.capture_notes.append("the model is already preconditioned (it holds precondfx_* "
                                 "buffers): nothing was done; pass the original model to re-plan")
        return Result(model if inplace else _copy_model(model), rep)
    dt = _float_dtype(model)
    low = dt in (torch.float16, torch.bfloat16)
    if low and inplace:
        raise PrecondError(f"inplace=True is not supported for {dt} models (the pass computes in "
                           f"float32 on a copy): drop inplace=True and use the returned model")
    modes = {name: m.training for name, m in model.named_modules()}
    work = model if inplace else _copy_model(model)
    if low:
        work = work.float()
        notes.append(f"model in {dt}: preconditioned and calibrated in float32, result cast "
                     f"back to {dt}")
    say("checking that the model runs on the sample")
    out0 = _run(work, s, calibration)
    path = output_path(out0, output_key) if target_std is not None else []
    snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()} if inplace else None
    applier: FxApplier | EagerApplier | None = None
    try:
        stage("capture")
        say("capturing the graph")
        cap, infos = _capture_classify(work, s, capture, calibration, notes)
        g = cap.graph
        if not any(n.status == "weighted" for n in g) and not any(n.kind == "maxpool" for n in g):
            raise PrecondError("the model has no weighted layer (convolution, linear, embedding, "
                               "matmul with a parameter...) in the captured graph: there is "
                               "nothing to precondition")
        say(f"captured with {g.method}: {len(g)} nodes; planning")
        stage("plan")
        plan = make_plan(g, infos, opts, alpha_sites=sch.needs_alpha_sites)
        plan.notes.extend(r.notes())
        sch.plan(g, plan, infos, opts)
        if cap.gm is not None and not inplace:
            _restore_unused(cap.gm, work)
            applier = FxApplier(cap.gm, g)
            result: nn.Module = cap.gm
        else:
            applier = EagerApplier(work, g)
            result = work
        stage("apply")
        say("applying the plan")
        applier.pools(plan)
        sch.model = result
        for node, mod, mod_path in sch.replacements(g, plan):
            if applier.replace(node, mod, mod_path, all_calls=True):
                applier.applied.append(f"{sch.name}: {node} replaced by {mod}")
        weight_of = {lay.node: lay.weight for lay in plan.layers}
        alpha_buffers: dict[str, list[str]] = {}
        site_buffers: dict[str, str] = {}
        planned: dict[str, float] = {}    # constant buffer -> value, kept for materializing
        for sc in plan.scales:
            buf = applier.scale(sc)
            if buf is not None:
                planned[buf] = sc.value
            if sc.tag == "alpha" and buf is not None and weight_of.get(sc.node):
                alpha_buffers.setdefault(weight_of[sc.node], []).append(buf)
                site_buffers[sc.node] = buf
        in_scale = _input_scale(opts, plan, s)
        if in_scale is not None:
            planned.update({b: in_scale for b in applier.input_scale(in_scale) or []})
            normed = _normalized_before_first_layer(g, plan)
            if normed:
                applier.skipped.append(("input scale", f"normalization {normed} sits between the "
                                        f"input and the first weighted layer and undoes the "
                                        f"input scale (Sec. 6.3 has no effect here)"))
        out_buf = None
        if target_std is not None:
            out_buf = applier.output_scale(path) if isinstance(applier, FxApplier) else \
                applier.output_scale(path, run=lambda m: _run(m, s, "eval"))
        if out_buf is not None:
            planned[out_buf] = 1.0
        applier.finish()
        stage("reinit")
        say("re-initializing parameters" if opts.reinit else "rescaling weights for alpha")
        reinit(result, plan, seed)
        report = Report.from_graph(g, plan)
        report.applied, report.skipped = applier.applied, applier.skipped
        report.input_scale = in_scale
        if type(sch).calibrate is not Scheme.calibrate:
            stage(sch.name)
            say(f"scheme {sch.name}: data-driven step")
            ctx = SchemeContext(result, s, g, plan, applier, opts, calibration, site_buffers,
                                say)
            report.conditioning[sch.name] = sch.calibrate(ctx)
        if in_scale is not None:
            plan.scales.append(_scale("input", in_scale, "input scale (Sec. 6.3)"))
        if target_std is not None and out_buf is not None and on_meta:
            report.skipped.append(("output scale", "the model is on the meta device (no data): "
                                   "the output scale is 1 until precondfx.distributed.calibrate("
                                   "model, batch) runs on the materialized model"))
        elif target_std is not None and out_buf is not None and distributed.is_sharded(result):
            say("calibrating the output scale (statistics all-reduced over the ranks)")
            st = distributed.calibrate(result, s, target_std, output_key=output_key,
                                       mode=calibration)
            report.output_std_before, report.output_std_after = st["std_before"], st["std_after"]
            report.target_std, report.output_scale = target_std, st["scale"]
            plan.scales.append(_scale("output", st["scale"], f"output std {st['std_before']:.4g} "
                                      f"-> {target_std} (all ranks' batches)"))
        elif target_std is not None and out_buf is not None:
            stage("calibrate")
            say("calibrating the output scale")
            std = cal.output_std(cal.forward(result, s, calibration), output_key)
            scale = cal.solve_output_scale(std, target_std)
            warn = cal.scale_warning(std, scale)
            if warn:
                warnings.warn(f"precondfx: {warn}", RuntimeWarning, stacklevel=2)
                report.skipped.append(("warning: output scale", warn))
            with torch.no_grad():
                result.get_buffer(out_buf).fill_(scale)
            after = cal.output_std(cal.forward(result, s, calibration), output_key)
            report.output_std_before, report.output_std_after = std, after
            report.target_std, report.output_scale = target_std, scale
            plan.scales.append(_scale("output", scale, f"output std {std:.4g} -> {target_std}"))
        if opts.balance in ("hessian", "auto"):
            stage("balance")
            say(f"measured balancing ({opts.balance})")
            try:
                report.conditioning["hessian"] = h = balance_measured(
                    result, s, plan, alpha_buffers, verbose=verbose,
                    seed=seed, output_key=output_key, mode=calibration, log=say,
                    n_samples=opts.balance_samples, balance=opts.balance,
                    threshold=opts.balance_threshold)
                report.skipped += [(f"balance {w}", why) for w, why in h["left_out"].items()]
                if h.get("output_std") is not None and report.output_std_after is not None:
                    report.output_std_after = h["output_std"]
            except PrecondError as e:
                if opts.balance == "hessian":
                    raise
                report.conditioning["hessian"] = {"applied": False,
                                                  "decision": f"not measured: {e}"}
                report.skipped.append(("balance='auto'", f"measurement failed, alphas left "
                                       f"as planned: {e}"))
        if opts.measure:
            stage("measure")
            report.conditioning["measure"] = mr = measure_report(
                model, result, s, plan, output_key=output_key, mode=calibration, seed=seed,
                n_samples=opts.balance_samples, say=say, verbose=verbose)
            held_out(report.conditioning.get("hessian"), mr)
        if not on_meta:
            stage("verify")
            report.verification = verify_result(result, s, output_key=output_key,
                                                mode=calibration, target_std=target_std
                                                if out_buf is not None else None)
        record_constants(result, planned, read=not on_meta)
        _restore_modes(result, modes)
        say("recording how to fold the constants back into the weights")
        record(result, work, applier, g, lambda m: _run(m, s, "eval"), report)
        if low:
            result = result.to(dt)
    except BaseException:
        if inplace:
            if isinstance(applier, EagerApplier):
                applier.rollback()
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    if k in snapshot:
                        v.copy_(snapshot[k])
        raise
    stage("done")
    report.stage_seconds = {**times, "total": sum(times.values())}
    say("done")
    return Result(result, report)


def _restore_modes(result: nn.Module, modes: dict[str, bool]) -> None:
    """Give every module of the result the train/eval flag its namesake has in the user's
    model (a BatchNorm the user froze in eval stays in eval); modules the plan added follow
    their parent."""
    flags: dict[str, bool] = {}
    for name, m in result.named_modules():
        parent = name.rpartition(".")[0]
        flags[name] = modes.get(name, flags.get(parent, modes[""]))
        m.training = flags[name]


def _normalized_before_first_layer(g: Graph, plan: Plan) -> str | None:
    """A normalization node on the path from the inputs to the first weighted layer, if any."""
    first = next((lay for lay in plan.layers if lay.kind != "embedding"), None)
    if first is None:
        return None
    anc = g.ancestors().get(first.node, frozenset())
    return next((a for a in anc if g[a].kind == "normalization"), None)


def _already_preconditioned(model: nn.Module) -> bool:
    return any("precondfx_" in name for name, _ in model.named_buffers())


def _restore_unused(gm: nn.Module, work: nn.Module) -> None:
    """fx keeps only what the traced forward reads; put the other parameters and buffers back
    at their own names so the result keeps every state_dict key of the original."""
    have = set(gm.state_dict())
    for name, t in list(work.named_parameters()) + list(work.named_buffers()):
        if name in have:
            continue
        path, _, leaf = name.rpartition(".")
        try:
            owner = gm.get_submodule(path) if path else gm
        except AttributeError:
            gm.add_submodule(path, work.get_submodule(path))
            have |= {f"{path}.{k}" for k in work.get_submodule(path).state_dict()}
            continue
        if isinstance(t, nn.Parameter):
            owner.register_parameter(leaf, t)
        elif leaf not in getattr(owner, "_non_persistent_buffers_set", set()):
            owner.register_buffer(leaf, t)
        have.add(name)


def _scale(tag: str, value: float, reason: str):
    from precondfx.plan import Scale
    return Scale(tag, tag, tag, 0, value, reason)


def _input_scale(opts: Options, plan: Plan, s: Sample) -> float | None:
    """Sec. 6.3: scale inputs so E[x0^2] = 1/sqrt(n_in k^2) of the first layer ('auto')."""
    if opts.input_scale is None:
        return None
    if opts.input_scale != "auto":
        return float(opts.input_scale)
    first = next((lay for lay in plan.layers if lay.kind != "embedding"), None)
    floats = [t for t in s.tensors() if t.is_floating_point() and
              (bool(torch.isfinite(t).all()) or not cal.is_additive_mask(t))]
    if first is None or not floats:
        raise PrecondError("input_scale='auto' needs a floating-point input and a weighted layer "
                           "reading it; pass a number instead")
    target = 1.0 / math.sqrt(first.n_in * first.k2)
    m2 = float(torch.cat([t.detach().flatten().double() for t in floats]).pow(2).mean())
    if m2 <= 0:
        raise PrecondError("input_scale='auto': the inputs are all zero")
    return math.sqrt(target / m2)
