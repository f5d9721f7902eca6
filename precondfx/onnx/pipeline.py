"""The ONNX pipeline: the stage list ``precondition_onnx`` runs, and its ONNX-only stages.

    load -> normalize -> capture -> plan -> apply -> reinit -> calibrate -> save -> verify
    -> commit

``plan``, ``apply``, ``reinit`` and ``calibrate`` are the shared stages of ``precondfx.core.driver``
(the PyTorch pipeline runs them too, over ``precondfx.core.backend.Backend``; here the back
end is ``precondfx.onnx.apply.OnnxApplier``); the classification, the plan and the report are
the shared ones.  Only reading the graph, the calibration data, saving and checking the file
are ONNX-specific.  Nothing is written until the rewritten model has been calibrated, saved to
a temporary folder next to the output, checked with ``onnx.checker`` (full check) and run again
by onnxruntime; then it is moved into place.  On any error the output path is left as it was.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import onnx
import onnx_ir as ir

from precondfx.core import driver
from precondfx.core.backend import PREFIX
from precondfx.core import calibration
from precondfx.core.calibration import input_second_moment, mask_named, refuse_empty
from precondfx.core.classify import classify
from precondfx.core.driver import Stage, State
from precondfx.errors import PrecondError
from precondfx.onnx import calibrate as cal
from precondfx.onnx import io
from precondfx.onnx.apply import OnnxApplier
from precondfx.onnx.capture import Captured, infer_shapes, symbolic_values, to_graph
from precondfx.onnx.normalize import NormalizeInfo, normalize, value_ties
from precondfx.core.options import DEFAULTS as D
from precondfx.core.options import REFUSE, Options, Resolved, Rule, Support, flag
import precondfx.schemes  # noqa: F401 (registers the schemes)
from precondfx.core.scheme import resolve_options
from precondfx.core.report import Report


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
    # "auto" (the default) stays: an ONNX file declares no init std, so the plan leaves it off
    Rule("lr_scale", lambda v: v not in (None, "auto"), REFUSE, f"lr_scale= {_TORCH_ONLY}"),
    Rule("lr", lambda v: v not in (None, "auto"), REFUSE, f"lr= (it measures curvature "
         f"through torch) {_TORCH_ONLY}"),
    Rule("lr", lambda v: v == "auto", None, ""),   # no optimizer step to read a rate from
    Rule("optimizer", lambda v: v is not None, REFUSE, f"optimizer= (the family lr= is a rate "
         f"of) {_TORCH_ONLY}"),
    Rule("suggest_lr", lambda v: v, REFUSE, f"suggest_lr=True {_TORCH_ONLY}"),
    Rule("capture", lambda v: v != D.capture, REFUSE, f"capture= (a PyTorch capture method) "
         f"{_TORCH_ONLY}"),
    Rule("calibration", lambda v: v != D.calibration, REFUSE, "calibration= sets the PyTorch "
         "module's train/eval mode; an ONNX graph runs as exported"),
    Rule("balance_samples", lambda v: v != D.balance_samples, REFUSE, f"balance_samples= sets "
         f"measured balancing, which {_TORCH_ONLY} (ONNX files get the analytic constants)"),
    Rule("balance_threshold", lambda v: v != D.balance_threshold, REFUSE, f"balance_threshold= "
         f"sets measured balancing, which {_TORCH_ONLY} (ONNX files get the analytic "
         f"constants)"),
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
    refuse_empty([f"{k} {tuple(p.shape)}" for k, p in cap.params.items()
                  if 0 in tuple(p.shape)])
    classify(cap.graph)
    return cap


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
    """Classify and plan an ONNX file without changing anything: :data:`PIPELINE` up to the
    plan, so the report says what ``precondition_onnx`` would do with the same ``options``
    (symbolic dims: ``dims``, leading dims: ``batch``, default 1)."""
    r = _options(options, INSPECT)
    io.check_batch(batch)
    st = OnnxState(r, in_path=path, dims=dims, batch=batch, analysis=True)
    driver.run(PIPELINE, st, until="plan")
    rep = Report.from_graph(st.graph, st.plan)
    rep.planned = st.plan
    return rep


@dataclass
class OnnxState(State):
    """The ONNX run: the paths, the calibration data, the in-memory model, the staged file."""

    in_path: str = ""
    out_path: str = ""
    given: Any = None                                # feeds given as arrays
    calib: str | None = None
    calib_inputs: Any = None
    dims: Any = None
    batch: int | None = None
    external_data: str = "auto"
    check: bool = True                               # verify the saved file
    model: ir.Model | None = None
    had_external: bool = False
    norm: NormalizeInfo | None = None
    specs: list = field(default_factory=list)        # the real graph inputs
    feeds: io.Feeds | None = None
    captured: Captured | None = None
    staging: io.Staging | None = None
    input_files: list = field(default_factory=list)  # the input model and its data files
    analysis: bool = False                           # ``inspect``: plan only, no data, no file


def load(st: OnnxState) -> None:
    st.model = io.load(st.in_path)
    if not st.analysis:
        io.check_paths(st.in_path, st.out_path, st.model)
        st.input_files = io.input_files(st.model, st.in_path)
    st.had_external = io.has_external_data(st.model)
    already_preconditioned(st.model, st.in_path)
    fed = weights_as_inputs(st.model)
    if fed:
        raise PrecondError(
            f"{st.in_path}: the layers read their weights from graph inputs "
            f"({', '.join(fed[:4])}{'...' if len(fed) > 4 else ''}) and the file holds no "
            f"initializers: the weights were exported as inputs (torch.onnx.export(..., "
            f"export_params=False)), so there are no weights to re-initialize; export with "
            f"export_params=True (the default) and precondition that file")


def already_preconditioned(model: ir.Model, path: str) -> None:
    """Refuse a file precondfx wrote (it holds ``precondfx_*`` constants): a second pass would
    stack a second output scale on the first and re-plan constants that are already in the
    graph.  The PyTorch path stops early on such a model for the same reason."""
    held = sorted(n for n in model.graph.initializers if n.startswith(PREFIX))
    if held:
        raise PrecondError(f"{path} is already preconditioned (it holds {', '.join(held[:3])}"
                           f"{'...' if len(held) > 3 else ''}): run precondfx on the original "
                           f"export instead")


def normalize_stage(st: OnnxState) -> None:
    """Normalize the graph; the calibration feeds (random N(0, 1) for inputs without data)."""
    st.norm = normalize(st.model)
    st.specs = io.real_inputs(st.model)
    if st.analysis:                 # no feeds: shapes from ``dims`` and ``batch`` alone
        io.check_dims(st.specs, io.parse_dims(st.dims))
        return
    if st.check or st.opts.target_std is not None:
        _refuse_bfloat16_io(st.model, st.specs)
        _refuse_old_opset(st.model)
    dimmap = io.parse_dims(st.dims)
    io.check_dims(st.specs, dimmap)
    given = io.load_calibration(st.specs, st.calib, st.calib_inputs)
    given.update(io.feeds_by_name(st.specs, st.given))
    masks = mask_inputs(st.model)
    try:
        st.feeds = io.resolve_feeds(st.specs, given, dims=dimmap, batch=st.batch,
                                    seed=st.opts.seed, weights=weight_inputs(st.model),
                                    masks=masks)
    except PrecondError:
        if st.opts.target_std is not None or st.opts.input_scale == "auto":
            raise
    st.sample = st.feeds.arrays if st.feeds is not None else None
    data = {} if st.feeds is None else {n: a for n, a in st.feeds.arrays.items()
                                        if n not in not_data(st.model, masks)}
    if st.feeds is not None:        # the data inputs: masks and fed weights are not scaled
        m2 = input_second_moment([a for a in data.values() if a.dtype.kind == "f"])
        st.input_rms = None if m2 is None else m2 ** 0.5
    if st.feeds is not None and st.opts.input_scale == "auto":
        st.input_arrays = [np.asarray(a, dtype=np.float32) for a in data.values()
                           if a.dtype.kind in "fV"]


#: the oldest default-domain opset onnxruntime runs
ORT_MIN_OPSET = 7


def _refuse_old_opset(model: ir.Model) -> None:
    """onnxruntime, which calibrates and checks the file, runs opset 7 and newer only."""
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    if opset is not None and opset < ORT_MIN_OPSET:
        raise PrecondError(f"the model uses opset {opset}; onnxruntime, which precondfx "
                           f"calibrates and checks ONNX files with, runs opset "
                           f"{ORT_MIN_OPSET} and newer: convert it first (onnx.version_converter"
                           f".convert_version(model, 13)) or re-export it")


def _refuse_bfloat16_io(model: ir.Model, specs: list[io.InputSpec]) -> None:
    """bfloat16 graph inputs or outputs cannot go through onnxruntime's numpy interface, which
    calibration and the check of the saved file use."""
    bf16 = [s.name for s in specs if s.dtype == ir.DataType.BFLOAT16] + \
        [o.name for o in model.graph.outputs if isinstance(o.type, ir.TensorType)
         and o.dtype == ir.DataType.BFLOAT16]
    if bf16:
        raise PrecondError(f"graph inputs/outputs {bf16} are bfloat16, which onnxruntime's "
                           f"Python interface cannot pass as numpy arrays, so precondfx can "
                           f"neither calibrate nor check this file: export it with float32 (or "
                           f"float16) inputs and outputs (bfloat16 weights behind Cast nodes "
                           f"are fine), or from Python: precondition_onnx(..., target_std=None, "
                           f"verify=False) (command line: --target-std none --no-verify)")


def capture_stage(st: OnnxState) -> None:
    b, leading = _bindings(st.model, st.feeds, io.parse_dims(st.dims), st.batch)
    st.captured = capture_model(st.model, st.norm, b, leading)
    st.graph, st.params = st.captured.graph, st.captured.params
    st.graph.notes.extend(_notes(st.model, st.norm) + st.resolved.notes())
    if st.feeds is not None:
        st.graph.notes.extend(st.feeds.notes)
    if not st.analysis:
        driver.has_work(st.graph, "Conv, Gemm, MatMul with a weight initializer...")


def weights_as_inputs(model: ir.Model) -> list[str]:
    """In a file without float initializers, the graph inputs that a Conv, ConvTranspose, Gemm
    or MatMul reads as its weight (second input): the weights of a file exported with
    ``export_params=False``, which precondfx would calibrate with random data in their place
    and leave as they are."""
    inits = model.graph.initializers
    if any(v.dtype in io.FLOAT_TYPES and v.const_value is not None and v.const_value.size > 1
           for v in inits.values()):
        return []       # the file holds weights: a layer reading an input is the model's own
    fed: list[str] = []
    for node in model.graph:
        if node.op_type not in ("Conv", "ConvTranspose", "Gemm", "MatMul") or \
                len(node.inputs) < 2:
            continue
        w = node.inputs[1]
        if w is None or not w.is_graph_input() or w.name in inits or w.name in fed:
            continue
        fed.append(w.name)
    return fed


#: op type -> the input slots it reads a weight from
WEIGHT_SLOTS = {"Conv": (1,), "ConvTranspose": (1,), "Gemm": (1,), "MatMul": (1,)}


def weight_inputs(model: ir.Model) -> dict[str, str]:
    """The real graph inputs a layer reads directly as its weight (input name -> the node),
    every dim fixed: a Conv or ConvTranspose weight, a Gemm's B, a MatMul's right operand of
    rank 2 (a weight table fed by the caller; an operand with a symbolic dim, or a batched
    one, is an activation)."""
    inits = model.graph.initializers
    out: dict[str, str] = {}
    for node in model.graph:
        for slot in WEIGHT_SLOTS.get(node.op_type, ()):
            w = node.inputs[slot] if len(node.inputs) > slot else None
            if w is None or not w.is_graph_input() or w.name in inits or w.name in out:
                continue
            if w.shape is None or not all(isinstance(d, int) and d > 0 for d in w.shape) or \
                    (node.op_type == "MatMul" and len(w.shape) != 2):
                continue        # a batched operand: an activation the caller feeds
            out[w.name] = f"{node.op_type} node {node.name or '(unnamed)'!r}"
    return out


#: ops that carry a mask's values to where it is used (a broadcast, a dtype cast)
MASK_CARRIERS = ("Cast", "Unsqueeze", "Reshape", "Expand", "Squeeze", "Identity", "Slice",
                 "Flatten")


#: ops a mask may end in besides ``Mul``: the count of kept positions (``mask.sum(1)``, the
#: divisor of a masked mean)
MASK_COUNTS = ("ReduceSum", "ReduceMean", "Sum")
#: comparisons that turn a float mask into a condition (``m < 0.5``, ``m == 0``)
MASK_TESTS = ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual")


def _is_constant(v: ir.Value | None) -> bool:
    return v is not None and (v.const_value is not None or (
        v.producer() is not None and v.producer().op_type == "Constant"))


def _condition(node: ir.Node, idx: int) -> str | None:
    """Why ``node`` reads its input ``idx`` as a condition (a ``Where`` condition, by
    ``Not``, cast to BOOL, subtracted from a constant: ``1 - mask``), or None."""
    op, name = node.op_type, node.name or "(unnamed)"
    to = node.attributes.get("to")
    if op == "Where" and idx == 0 or op == "Not" or \
            op == "Cast" and to is not None and to.value == ir.DataType.BOOL:
        return f"{op} node {name!r} reads it as a condition"
    if op == "Sub" and idx == 1 and node.inputs[0] is not None and \
            node.inputs[0].const_value is not None:
        return f"Sub node {name!r} computes constant - it (1 - mask)"
    return None


def _mask_reading(v: ir.Value) -> str | None:
    """Why graph input ``v`` reads as a mask by its uses (``core.calibration.mask_by_use``,
    the rule the PyTorch back end applies too), or None: one use reads it as a condition
    (:func:`_condition`), through broadcasts and casts (:data:`MASK_CARRIERS`); or every use
    multiplies it into a value a node computes from other inputs (``scores * m``,
    ``h * m.unsqueeze(-1)``), compares it with a constant (``m < 0.5``, ``m == 0``) or sums
    it (the count of a masked mean).  An input a layer reads (an embedding's ids), one
    multiplied by a constant (a scale) or by another graph input (``net(a * b)``: data) is
    not."""
    why = calibration.mask_by_use(v, lambda x: (_mask_role(v, u) for u in x.uses()))
    if why and why.startswith("read as a mask by all its uses"):
        why += "; ones keep everything, where N(0,1) data would mask or flip values at random"
    return why


def _mask_role(v: ir.Value, use: Any) -> tuple[int, str, str, list[ir.Value]]:
    """How ``use`` (of ``v`` or of a value carried from it) reads it, for
    ``core.calibration.mask_by_use``."""
    node = use.node
    name = f"{node.op_type} node {node.name or '(unnamed)'!r}"
    why = _condition(node, use.idx)
    if why:
        return id(node), calibration.CONDITION, why, []
    op = node.op_type
    if op in MASK_CARRIERS and use.idx == 0:
        return id(node), calibration.CARRY, "", list(node.outputs)
    if op in MASK_COUNTS:
        return id(node), calibration.COUNT, "", []
    other = node.inputs[1 - use.idx] if op in ("Mul",) + MASK_TESTS and \
        len(node.inputs) == 2 else None
    if op in MASK_TESTS and _is_constant(other):
        return id(node), calibration.TEST, f"{name} compares it with a constant", []
    srcs = _inputs_of(other) if op == "Mul" and other is not None and \
        other.producer() is not None and not _is_constant(other) else None
    if not srcs or id(v) in srcs:       # a scale (no input behind it), or its own gate: data
        return id(node), calibration.DATA, "", []
    return id(node), calibration.GATE, f"{name} multiplies it into a computed value", []


def _inputs_of(v: ir.Value) -> set[int]:
    """The ids of the graph inputs ``v`` is computed from (through the main graph)."""
    out: set[int] = set()
    todo, seen = [v], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if x.is_graph_input():
            out.add(id(x))
        node = x.producer()
        if node is not None:
            todo.extend(node.inputs)
    return out


def mask_inputs(model: ir.Model) -> dict[str, str]:
    """The floating-point or integer graph inputs that are masks (input name -> why): named
    so (``attention_mask``, also int64 as transformers exports it) or used as one
    (:func:`_mask_reading`; an int64 ``m`` compared with 0 or cast and multiplied into the
    scores as much as a float one).  Calibration fills them with ones (nothing masked) when no data
    is given: N(0, 1) data would mask at random.  A BOOL mask is not filled (``True`` means
    masked in torch's ``key_padding_mask``, kept in others)."""
    out: dict[str, str] = {}
    inits = model.graph.initializers
    floats = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16)
    ints = (ir.DataType.INT64, ir.DataType.INT32)
    for v in model.graph.inputs:
        if v.name in inits or v.dtype not in floats + ints:
            continue
        if mask_named(v.name):              # not 'masked_image'
            out[v.name] = "its name says so"
            continue
        why = _mask_reading(v)
        if why:
            out[v.name] = why
    return out


def not_data(model: ir.Model, masks: Mapping[str, str] | None = None) -> dict[str, str]:
    """The graph inputs that are not data (name -> why), which the input scale (Sec. 6.3)
    neither reads nor multiplies: masks (a mask times the input scale masks other entries:
    ``keep * 0.1 < 0.5`` masks everything) and the weights a caller feeds."""
    masks = mask_inputs(model) if masks is None else masks
    out = {n: f"a mask ({why}), whose values mean masked or kept"
           for n, why in masks.items()}
    out.update({n: f"read as the weight of {where}" for n, where in
                weight_inputs(model).items()})
    return out


def backend(st: OnnxState) -> None:
    st.backend = OnnxApplier(st.model, st.captured, st.opts.seed)
    if st.opts.input_scale is not None:
        st.backend.not_data = not_data(st.model)
    if st.feeds is not None:
        st.backend.random_inputs = list(st.feeds.random)
        st.backend.ones_inputs = list(st.feeds.ones)
    st.result = st.model
    key = st.opts.output_key
    st.main_path = [key] if key is not None else []
    # the note on the outputs beside the main one comes with the output scale, which knows
    # the outputs computed from the scaled value (OnnxApplier.output_scale)
    st.graph.notes.extend(_split_ties(value_ties(st.model), st.plan))
    st.graph.notes.extend(_shared_weights(st.plan))
    note = _feedable_note(st.model, st.plan)
    if note:
        st.graph.notes.append(note)


def _feedable_note(model: ir.Model, plan: Any) -> str | None:
    """What the report says of initializers that are also graph inputs (IR version < 4, or
    ``keep_initializers_as_inputs=True``): a caller may feed them (onnxruntime lets it from IR
    version 4 on), and a value fed replaces the one the file holds, re-drawn weights
    included."""
    g = model.graph
    names = [v.name for v in g.inputs if v.name in g.initializers]
    if not names:
        return None
    drawn = [n for n in names if n in plan.inits and plan.inits[n].rule != "keep"]
    real = [v.name for v in g.inputs if v.name not in g.initializers]
    head = f"{len(names)} initializer(s) are also graph inputs"
    listed = f"{', '.join(names[:4])}{'...' if len(names) > 4 else ''} ({len(drawn)} of them " \
             f"re-initialized)"
    if model.ir_version is not None and model.ir_version < 4:
        return (f"{head} (IR version < 4 requires it, and the constants precondfx adds are "
                f"graph inputs too): {listed}. The ONNX spec lets a caller feed them, replacing "
                f"the file's values at run time (onnxruntime does not for IR < 4, other "
                f"runtimes may): feed only the real inputs ({', '.join(real)}), or convert the "
                f"model to IR version 4 or later")
    return (f"{head} (exported with keep_initializers_as_inputs=True): {listed}. The file "
            f"holds the new values, but a caller may feed these inputs (onnxruntime lets it), "
            f"and a value fed replaces the file's at run time (feeding the original weights "
            f"undoes the re-initialization): feed only the real inputs ({', '.join(real)}), or "
            f"export with keep_initializers_as_inputs=False")


def _split_ties(ties: list[tuple[str, str]], plan: Any) -> list[str]:
    """What the report says of initializers that held one tied weight (``normalize.value_ties``)
    and that the plan re-draws separately: they no longer hold the same values."""
    notes = []
    for a, b in ties:
        pa, pb = plan.inits.get(a), plan.inits.get(b)
        if not any(pi is not None and pi.rule != "keep" for pi in (pa, pb)):
            continue
        notes.append(
            f"initializers {a!r} and {b!r} held the same values ({b} = {a} transposed): a "
            f"weight tied in your model, stored twice "
            f"by the exporter's constant folding. This file has two weights, re-initialized "
            f"separately, so they are no longer tied (the PyTorch model gets one draw). To keep "
            f"them tied, export with torch.onnx.export(..., optimize=False) (dynamo=True) or "
            f"do_constant_folding=False (dynamo=False): the tie is then one initializer; or "
            f"precondition the PyTorch model")
    return notes


def _shared_weights(plan: Any) -> list[str]:
    """What the report says of an initializer that several layers read as their weight: one
    weight, drawn once, so those layers start (and, trained from this file, stay) equal.  A
    tie the user meant looks the same as layers that held equal values when exported:
    ``torch.onnx.export(dynamo=True)`` stores equal initializers once (the clones of
    ``nn.TransformerEncoder``'s layers, ``copy.deepcopy``), which the PyTorch model trains
    apart."""
    readers: dict[str, list[str]] = {}
    for layer in plan.layers:
        if layer.weight is not None:
            readers.setdefault(layer.weight, []).append(layer.node)
    shared = [f"{name!r} ({len(nodes)} layers: {', '.join(nodes[:3])}"
              f"{'...' if len(nodes) > 3 else ''})" for name, nodes in readers.items()
              if len(nodes) > 1 and name in plan.inits and plan.inits[name].rule != "keep"]
    if not shared:
        return []
    return [f"{len(shared)} initializer(s) are each the weight of several layers: "
            f"{'; '.join(shared[:4])}{'...' if len(shared) > 4 else ''}. Each is one weight, "
            f"drawn once, so its layers are tied in this file. If your model has separate "
            f"layers there (copies of one layer with equal values, e.g. nn.TransformerEncoder's, "
            f"which torch.onnx.export(dynamo=True) stores once), export with optimize=False (or "
            f"dynamo=False) and precondition that file: each layer then gets its own draw"]


def record_gains(st: OnnxState) -> None:
    """What applies each gain the plan divided (``core.plan.divide_gains``: a Gemm's
    ``alpha``, a constant factor ``MatMul(x, Mul(W, 3))``), in the file's words."""
    for name, gain in st.graph.gains.items():
        pi = st.plan.inits.get(name)
        if pi is None or pi.rule in ("zeros", "keep", "scale"):
            continue
        why = st.captured.gain_why.get(name, f"a factor {gain:.4g}")
        # ones behind a factor: the value the layer applies (stored x gain) is one
        ones = pi.rule == "constant" and math.isclose(float(pi.std or 0.0) * gain, 1.0)
        st.report.capture_notes.append(
            f"{name}: set to 1/{gain:.4g} rather than ones ({why}): the scale the layer "
            f"applies is ones, as planned" if ones else
            f"{name}: set to {pi.std:.4g} ({why}): the value the layer applies is the planned "
            f"one" if pi.rule == "constant" else
            f"{name}: drawn divided by {abs(gain):.4g} ({why}): the weight the layer applies "
            f"has the planned std")


def save(st: OnnxState) -> None:
    """Save into a temporary folder next to the output (removed again on failure)."""
    st.staging = io.Staging(st.out_path, protected=st.input_files)
    st.undo.append(st.staging.cleanup)
    st.staging.save(st.model, io.save_policy(st.model, st.external_data, st.had_external))


def verify(st: OnnxState) -> None:
    """``onnx.checker`` and an onnxruntime run of the saved file."""
    be = st.backend
    out_name = be.output_value.name if be.output_value is not None else None
    check = verify_saved(st.staging.path, st.specs, st.feeds, out_name, in_path=st.in_path,
                         calib_shape=be.calib_shape)
    st.report.capture_notes.append(check["note"])
    st.report.verification = check


def commit(st: OnnxState) -> None:
    """Move the checked file into place."""
    st.staging.commit()
    st.staging.cleanup()


#: what ``precondition_onnx`` runs (``driver.run``)
PIPELINE = (
    Stage("load", load, ensures=("model",)),
    Stage("normalize", normalize_stage),
    Stage("capture", capture_stage, ensures=("graph",)),
    driver.PLAN,
    Stage("apply", backend, ensures=("backend",)),
    driver.APPLY,
    driver.REINIT,
    driver.MATCH,
    Stage("reinit", record_gains, when=lambda st: bool(st.graph.gains)),
    driver.CALIBRATE,
    driver.RECORD,
    Stage("save", save),
    Stage("verify", verify, when=lambda st: st.check),
    Stage("commit", commit),
)
#: the stage names, in order (``report.stage_seconds``)
STAGES = tuple(dict.fromkeys(s.name for s in PIPELINE))


def precondition_onnx(in_path: str, out_path: str, *,
                      feeds: Mapping[str, Any] | None = None,
                      calib: str | None = None,
                      calib_inputs: Mapping[str, str] | list[str] | None = None,
                      dims: Mapping[str, int] | None = None,
                      batch: int | None = None, external_data: str = "auto",
                      verify: bool = True,
                      progress: Callable[[str, float], None] | None = None,
                      verbose: bool = False, **options: Any) -> Report:
    """Rewrite the ONNX model at ``in_path`` so that it starts well conditioned and write it to
    ``out_path``; returns the report.

    ``feeds`` maps input names to calibration arrays (or is one array, for a single-input model,
    or a list of arrays in input order; ``calib``: an .npy file for a single-input
    model or an .npz keyed by input names or arr_0, arr_1...; ``calib_inputs``: ``{name: .npy}``
    or ``['name=file.npy']``); inputs without data get random N(0, 1)
    data of the model's shape (symbolic dims from ``dims``, a leading one from ``batch``,
    default 32), which the report says.  ``options`` are those of ``precondfx.precondition``,
    defined in ``precondfx.core.options.Options``; the ONNX back end's limits are :data:`ONNX`
    (``balance='hessian'``, ``measure``, other schemes and capture methods need PyTorch and are
    refused; ``'auto'`` uses the analytic constants, with a note).  ``external_data``: 'auto' (as the
    input, or when the weights exceed 1.8 GB), 'always' or 'never'.  The stage timings are in
    ``report.stage_seconds``; ``progress(stage, seconds)`` is called as each stage starts, and
    ``verbose`` prints the progress lines.
    """
    started = time.perf_counter()
    flag("verify", verify)
    flag("verbose", verbose)
    r = _options(options)
    io.check_output_name(out_path)
    io.check_batch(batch)
    st = OnnxState(r, verbose=verbose, progress=progress, in_path=in_path, out_path=out_path,
                   given=feeds, calib=calib, calib_inputs=calib_inputs, dims=dims,
                   batch=batch, external_data=external_data, check=verify, started=started)
    return driver.run(PIPELINE, st).report


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
    fixed = None
    try:
        outs = cal.run(sess, feeds)
    except PrecondError:
        if k is None or in_path is None or _runs(in_path, feeds):
            raise
        # the input fails at that size too: its symbolic dim is not free (a reshape to the
        # exported batch size); check the rewritten model at the calibration size instead
        fixed = f"like the input model, it runs only with {first.name!r} dim 0 = {b} (its " \
                f"symbolic dim is fixed inside the graph)"
        feeds, k = dict(fe.arrays), None
        outs = cal.run(sess, feeds)
    names = [o.name for o in sess.get_outputs()]
    bad = [n for n, o in zip(names, outs)
           if np.issubdtype(np.asarray(o).dtype, np.floating) and not np.isfinite(o).all()]
    ref = _outputs(in_path, feeds, bad) if bad else {}
    for n in bad:
        o = outs[names.index(n)]
        if not _same_nonfinite(ref.get(n), o):
            raise PrecondError(f"the rewritten model gives NaN/inf in output {n!r} on the "
                               f"verification run")
        # the input model gives the same NaN/inf there (logits plus an additive -inf mask)
        result.setdefault("nonfinite", {})[n] = int((~np.isfinite(o)).sum())
    result.update(outputs={n: list(np.shape(o)) for n, o in zip(names, outs)})
    if k is not None:
        result["batch"] = k
    if out_name in names:
        main = outs[names.index(out_name)]
        if k is not None and calib_shape and calib_shape[0] == b and main.shape[0] != k \
                and not _same_leading(in_path, feeds, out_name, main.shape[0]):
            raise PrecondError(f"the rewritten model's output {out_name!r} has leading dim "
                               f"{main.shape[0]} when {first.name!r} has {k} (it had {b} at "
                               f"{b}): the dynamic dim was lost")
        if np.size(main) > 1 and out_name not in result.get("nonfinite", {}):
            result["std"] = float(np.asarray(main, dtype=np.float64).std())
    std = f", output std {result['std']:.4g}" if "std" in result else ""
    std += "".join(f"; output {n!r} holds NaN/inf in {c} element(s), where the input model's "
                   f"does too" for n, c in result.get("nonfinite", {}).items())
    where = f"with {first.name!r} dim 0 = {k} (calibration: {b})" if k is not None else \
        "on the calibration feed"
    result["note"] = f"verified: onnx.checker full check {checker}; onnxruntime ran the saved " \
                     f"model {where}{std}" + (f"; {fixed}" if fixed else "")
    return result


def _same_leading(in_path: str | None, feeds: Mapping[str, np.ndarray], name: str,
                  lead: int) -> bool:
    """Whether the input model's output ``name`` has leading dim ``lead`` on ``feeds`` too (a
    sequence-first input whose length equals the batch: the output's leading dim is not the
    input's)."""
    if in_path is None:
        return False
    try:
        sess = cal.session(in_path)
        return int(np.shape(cal.run(sess, feeds, [name])[0])[0]) == lead
    except (PrecondError, IndexError):
        return False


def _outputs(in_path: str | None, feeds: Mapping[str, np.ndarray], names: list[str]
             ) -> dict[str, np.ndarray]:
    """The input model's outputs ``names`` on ``feeds`` (none when it cannot run there)."""
    if in_path is None:
        return {}
    try:
        return dict(zip(names, cal.run(cal.session(in_path), feeds, names)))
    except PrecondError:
        return {}


def _same_nonfinite(ref: np.ndarray | None, out: np.ndarray) -> bool:
    """Whether ``out`` is NaN, +inf and -inf exactly where ``ref`` (the input model's output on
    the same feed) is."""
    if ref is None or np.shape(ref) != np.shape(out) \
            or not np.issubdtype(np.asarray(ref).dtype, np.floating):
        return False
    return all(np.array_equal(f(ref), f(out)) for f in (np.isnan, np.isposinf, np.isneginf))


def _runs(path: str, feeds: Mapping[str, np.ndarray]) -> bool:
    """Whether onnxruntime runs the model at ``path`` on ``feeds``."""
    try:
        cal.run(cal.session(path), feeds)
    except PrecondError:
        return False
    return True
