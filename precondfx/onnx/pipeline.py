"""The ONNX pipeline: load -> normalize -> capture -> classify -> plan -> apply -> reinit ->
calibrate -> save -> verify -> report, the stages of ``precondfx.api.precondition``.

The classification, the plan and the report are the shared ones (``precondfx.classify``,
``precondfx.plan.make_plan``, ``precondfx.report.Report``); only reading the graph, carrying the
plan out and running the model are ONNX-specific.  Nothing is written until the rewritten model
has been calibrated, saved to a temporary folder next to the output, checked with
``onnx.checker`` (full check) and run again by onnxruntime; then it is moved into place.  On any
error the output path is left as it was.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Mapping

import numpy as np
import onnx
import onnx_ir as ir

from precondfx import calibrate as core_cal
from precondfx.classify import classify
from precondfx.errors import PrecondError
from precondfx.onnx import calibrate as cal
from precondfx.onnx import io
from precondfx.onnx.apply import OnnxApplier
from precondfx.onnx.capture import Captured, infer_shapes, symbolic_values, to_graph
from precondfx.onnx.normalize import NormalizeInfo, normalize
from precondfx.onnx.reinit import reinit
from precondfx.options import DEFAULTS as D
from precondfx.options import REFUSE, Options, Resolved, Rule, Support
from precondfx.plan import Plan, Scale, make_plan
from precondfx.schemes.base import resolve_options
from precondfx.report import Report

STAGES = ("load", "normalize", "capture", "plan", "apply", "reinit", "calibrate", "save",
          "verify")


class _Clock:
    def __init__(self, progress: Callable[[str, float], None] | None) -> None:
        self.t0 = time.perf_counter()
        self.last = self.t0
        self.times: dict[str, float] = {}
        self.progress = progress

    def start(self, stage: str) -> None:
        if self.progress is not None:
            self.progress(stage, time.perf_counter() - self.t0)
        self.last = time.perf_counter()

    def stop(self, stage: str) -> None:
        now = time.perf_counter()
        self.times[stage] = self.times.get(stage, 0.0) + now - self.last
        self.last = now


AUTO_NOTE = ("balance='auto' measures Hessian blocks through the PyTorch model; for an ONNX "
             "file the analytic constants (Sec. 5, App. E) are used instead")

_TORCH_ONLY = ("needs the PyTorch model and is not available for ONNX files; precondition the "
               "PyTorch model instead")
#: what the ONNX back end supports: no measurement through torch, the core scheme only
ONNX = Support("ONNX back end", (
    Rule("balance", lambda v: v == "hessian", REFUSE,
         "balance='hessian' needs Hessian-vector products through the PyTorch model and is not "
         "available for ONNX files; use balance='analytic' or 'none', or precondition the "
         "PyTorch model"),
    Rule("balance", lambda v: v == "auto", "analytic", AUTO_NOTE),
    Rule("scheme", lambda v: v != "geometric", REFUSE, f"scheme= other than 'geometric' "
         f"{_TORCH_ONLY}"),
    Rule("measure", lambda v: v, REFUSE, f"measure=True {_TORCH_ONLY}"),
    Rule("capture", lambda v: v != D.capture, REFUSE, f"capture= (a PyTorch capture method) "
         f"{_TORCH_ONLY}"),
    Rule("calibration", lambda v: v != D.calibration, REFUSE, "calibration= sets the PyTorch "
         "module's train/eval mode; an ONNX graph runs as exported"),
))
#: inspecting runs no data through the model; the plan does not depend on the input scale
INSPECT = Support("ONNX inspect", (
    Rule("input_scale", lambda v: v == "auto", None, "input_scale='auto' is computed from the "
         "calibration data, which inspect does not read (the plan does not depend on it)"),
))


def _options(options: dict[str, Any], *supports: Support) -> Resolved:
    """The user's options (public keyword names) checked, then resolved for the ONNX back end
    (measured balancing needs torch: 'auto' falls back to the analytic constants, 'hessian' is
    refused)."""
    return resolve_options(Options.from_keywords(**options), ONNX, *supports)


def _bindings(model: ir.Model, feeds: io.Feeds | None, dims: Mapping[str, int],
              batch: int | None) -> tuple[dict[str, int], int]:
    b = dict(dims)
    leading = int(batch) if batch is not None else 1
    if feeds is not None:
        b.update(feeds.bindings)
        sizes = [a.shape[0] for a in feeds.arrays.values() if a.ndim > 0]
        if sizes:
            leading = int(sizes[0])
    return b, leading


def capture_model(model: ir.Model, norm: NormalizeInfo, bindings: dict[str, int],
                  leading: int) -> Captured:
    """Shapes with bound dims, the neutral graph, its classification."""
    shapes = infer_shapes(model, bindings, leading)
    symbolic = symbolic_values(model, bindings, leading, shapes)
    cap = to_graph(model, shapes, symbolic, norm)
    classify(cap.graph)
    return cap


def _input_scale(opts: Options, plan: Plan, feeds: io.Feeds | None) -> float | None:
    """Sec. 6.3 input scale: a number, or 'auto' from the first layer's fans and the feed
    (the same rule as ``precondfx.api._input_scale``, applied to the numpy feed)."""
    if opts.input_scale is None:
        return None
    from precondfx.api import _input_scale as core_input_scale
    from precondfx.capture.common import Sample
    import torch
    arrays = [] if feeds is None else [a for a in feeds.arrays.values()
                                       if a.dtype.kind == "f" or a.dtype.kind == "V"]
    tensors = tuple(torch.from_numpy(np.asarray(a, dtype=np.float32)) for a in arrays)
    return core_input_scale(opts, plan, Sample(tensors, {}))


def _notes(model: ir.Model, norm: NormalizeInfo) -> list[str]:
    notes = []
    prod = " ".join(x for x in (model.producer_name, model.producer_version) if x)
    opset = model.opset_imports.get("", None)
    notes.append(f"ONNX file from {prod or 'an unknown producer'}, opset {opset}, IR "
                 f"version {model.ir_version}")
    notes.extend(norm.notes)
    return notes


def inspect_onnx(path: str, *, dims: Mapping[str, int] | None = None, batch: int | None = None,
                 **options: Any) -> Report:
    """Classify and plan an ONNX file without changing anything: the report says what
    ``precondition_onnx`` would do with the same ``options`` (symbolic dims: ``dims``, leading
    dims: ``batch``, default 1)."""
    r = _options(options, INSPECT)
    opts, opt_notes = r.options, r.notes()
    model = io.load(path)
    norm = normalize(model)
    dimmap = io.parse_dims(dims)
    io.check_dims(io.real_inputs(model), dimmap)
    b, leading = _bindings(model, None, dimmap, batch)
    cap = capture_model(model, norm, b, leading)
    cap.graph.notes.extend(_notes(model, norm) + opt_notes)
    plan = make_plan(cap.graph, cap.params, opts)
    plan.notes.extend(opt_notes)
    return Report.from_graph(cap.graph, plan)


def precondition_onnx(in_path: str, out_path: str, *,
                      feeds: Mapping[str, Any] | None = None,
                      calib: str | None = None,
                      calib_inputs: Mapping[str, str] | list[str] | None = None,
                      dims: Mapping[str, int] | None = None,
                      batch: int | None = None, external_data: str = "auto",
                      verify: bool = True,
                      progress: Callable[[str, float], None] | None = None,
                      **options: Any) -> Report:
    """Rewrite the ONNX model at ``in_path`` so that it starts well conditioned and write it to
    ``out_path``; returns the report.

    ``feeds`` maps input names to calibration arrays (``calib``: an .npy file for a single-input
    model or an .npz keyed by input names or arr_0, arr_1...; ``calib_inputs``: ``{name: .npy}``
    or ``['name=file.npy']``); inputs without data get random N(0, 1)
    data of the model's shape (symbolic dims from ``dims``, a leading one from ``batch``,
    default 32), which the report says.  ``options`` are those of ``precondfx.precondition``,
    defined in ``precondfx.options.Options``; the ONNX back end's limits are :data:`ONNX`
    (``balance='hessian'``, ``measure``, other schemes and capture methods need PyTorch and are
    refused; ``'auto'`` uses the analytic constants, with a note).  ``external_data``: 'auto' (as the
    input, or when the weights exceed 1.8 GB), 'always' or 'never'.  The stage timings are in
    ``report.stage_seconds``.
    """
    clock = _Clock(progress)
    r = _options(options)
    opts, opt_notes = r.options, r.notes()
    target_std, input_scale, output_key, seed = (opts.target_std, opts.input_scale,
                                                 opts.output_key, opts.seed)
    io.check_output_name(out_path)
    clock.start("load")
    model = io.load(in_path)
    io.check_paths(in_path, out_path, model)
    had_external = io.has_external_data(model)
    clock.stop("load")

    clock.start("normalize")
    norm = normalize(model)
    inputs = io.real_inputs(model)
    need_data = target_std is not None or input_scale == "auto"
    dimmap = io.parse_dims(dims)
    io.check_dims(inputs, dimmap)
    given = io.load_calibration(inputs, calib, calib_inputs)
    given.update(feeds or {})
    if need_data:
        fe = io.resolve_feeds(inputs, given, dims=dimmap, batch=batch, seed=seed)
    else:
        try:
            fe = io.resolve_feeds(inputs, given, dims=dimmap, batch=batch, seed=seed)
        except PrecondError:
            fe = None
    clock.stop("normalize")

    clock.start("capture")
    b, leading = _bindings(model, fe, dimmap, batch)
    cap = capture_model(model, norm, b, leading)
    g = cap.graph
    g.notes.extend(_notes(model, norm) + opt_notes)
    if fe is not None:
        g.notes.extend(fe.notes)
    if not any(n.status == "weighted" for n in g) and not any(n.kind == "maxpool" for n in g):
        raise PrecondError("the model has no weighted layer (Conv, Gemm, MatMul with a weight "
                           "initializer...): there is nothing to precondition")
    clock.stop("capture")

    clock.start("plan")
    plan = make_plan(g, cap.params, opts)
    plan.notes.extend(opt_notes)
    clock.stop("plan")

    clock.start("apply")
    applier = OnnxApplier(model, cap, seed)
    applier.pools(plan)
    for sc in plan.scales:
        applier.scale(sc)
    in_scale = _input_scale(opts, plan, fe)
    if in_scale is not None:
        applier.input_scale(in_scale)
    out_const = applier.output_scale([output_key] if output_key is not None else []) \
        if target_std is not None else None
    applier.finish()
    clock.stop("apply")

    clock.start("reinit")
    # always: with reinit=False the plan holds 'scale' rules (weights divided by their alpha)
    reinit(model, plan, seed)
    clock.stop("reinit")

    report = Report.from_graph(g, plan)
    report.applied, report.skipped = applier.applied, applier.skipped
    report.input_scale = in_scale
    if in_scale is not None:
        plan.scales.append(Scale("input", "input", "input", 0, in_scale, "input scale (Sec. 6.3)"))

    external = io.save_policy(model, external_data, had_external)
    out_name = applier.output_value.name if applier.output_value is not None else None
    with io.Staging(out_path) as st:
        std = scale = calib_shape = None
        if out_const is not None:
            clock.start("calibrate")
            std, calib_shape = cal.measure_model(model, fe.arrays, out_name)
            scale = core_cal.solve_output_scale(std, target_std)
            applier.set_output_scale(scale)
            clock.stop("calibrate")
        clock.start("save")
        st.save(model, external)
        clock.stop("save")
        if std is not None:
            report.output_std_before, report.target_std, report.output_scale = \
                std, target_std, scale
            warn = core_cal.scale_warning(std, scale)
            if warn:
                warnings.warn(f"precondfx: {warn}", RuntimeWarning, stacklevel=2)
                report.skipped.append(("warning: output scale", warn))
            report.output_std_after = std * scale
            plan.scales.append(Scale("output", "output", "output", 0, scale,
                                     f"output std {std:.4g} -> {target_std}"))
        if verify:
            clock.start("verify")
            check = verify_saved(st.path, inputs, fe, out_name, in_path=in_path,
                                 calib_shape=calib_shape)
            clock.stop("verify")
            report.capture_notes.append(check["note"])
            report.verification = check
        st.commit()
    report.stage_seconds = dict(clock.times)
    report.stage_seconds["total"] = sum(clock.times.values())
    return report


def verify_saved(path: str, inputs: list[io.InputSpec], fe: io.Feeds | None,
                 out_name: str | None, in_path: str | None = None,
                 calib_shape: tuple[int, ...] | None = None) -> dict:
    """``onnx.checker`` full check on the saved path, then an ORT run with the first input's
    symbolic leading dim (the batch, usually) at another size, on a slice of the calibration
    feed.  A checker failure the input model has too is reported, not raised."""
    result: dict[str, Any] = {"checker": "ok"}
    try:
        onnx.checker.check_model(path, full_check=True)
    except Exception as e:
        msg = " ".join(str(e).split())
        try:
            if in_path is None:
                raise ValueError
            onnx.checker.check_model(in_path, full_check=True)
        except Exception as e_in:
            if " ".join(str(e_in).split()) != msg:
                raise PrecondError(f"the rewritten model fails onnx.checker (full check): "
                                   f"{msg[:400]} (this is a precondfx bug: please report it "
                                   f"with the input model)") from None
            result["checker"] = f"fails as the input does: {msg[:200]}"
        else:
            raise PrecondError(f"the rewritten model fails onnx.checker (full check): "
                               f"{msg[:400]} (this is a precondfx bug: please report it with "
                               f"the input model)") from None
    checker = "passed" if result["checker"] == "ok" else \
        f"fails as the input model does ({result['checker'][25:]})"
    if fe is None or not fe.arrays:
        result["note"] = f"verified: onnx.checker full check {checker} (no data to run the " \
                         f"model)"
        return result
    feeds = dict(fe.arrays)
    first = inputs[0] if inputs else None
    sym = first.dims[0] if first is not None and first.dims else 0
    b = k = None
    if first is not None and not isinstance(sym, int) and feeds[first.name].ndim:
        b = int(feeds[first.name].shape[0])
        k = 1 if b > 1 else 2          # another size, and the cheapest run
        for s in inputs:
            if s.dims and not isinstance(s.dims[0], int) and (s.dims[0] == sym or not sym):
                a = feeds[s.name]
                feeds[s.name] = a[:k] if k <= a.shape[0] else np.concatenate([a, a])[:k]
    sess = cal.session(path)
    outs = cal.run(sess, feeds)
    names = [o.name for o in sess.get_outputs()]
    for n, o in zip(names, outs):
        if np.issubdtype(np.asarray(o).dtype, np.floating) and not np.isfinite(o).all():
            raise PrecondError(f"the rewritten model gives NaN/inf in output {n!r} on the "
                               f"verification run")
    result.update(outputs={n: list(np.shape(o)) for n, o in zip(names, outs)})
    if k is not None:
        result["batch"] = k
    if out_name in names:
        main = outs[names.index(out_name)]
        if k is not None and calib_shape and calib_shape[0] == b and main.shape[0] != k:
            raise PrecondError(f"the rewritten model's output {out_name!r} has leading dim "
                               f"{main.shape[0]} when {first.name!r} has {k} (it had {b} at "
                               f"{b}): the dynamic dim was lost")
        if np.size(main) > 1:
            result["std"] = float(np.asarray(main, dtype=np.float64).std())
    std = f", output std {result['std']:.4g}" if "std" in result else ""
    where = f"with {first.name!r} dim 0 = {k} (calibration: {b})" if k is not None else \
        "on the calibration feed"
    result["note"] = f"verified: onnx.checker full check {checker}; onnxruntime ran the saved " \
                     f"model {where}{std}"
    return result
