"""The PyTorch pipeline: the stage list ``precondition`` runs, and its PyTorch-only stages.

    prepare -> capture -> plan -> backend -> apply -> reinit -> scheme -> calibrate
    -> balance -> lr_scale -> lr_target -> measure -> suggest_lr -> verify -> record

``plan``, ``apply``, ``reinit``, ``scheme`` and ``calibrate`` are the shared stages of
``precondfx.core.driver`` (the ONNX pipeline runs them too); the others need the PyTorch model.
``driver.run`` times each stage, prints progress and, when a stage fails with
``inplace=True``, puts the user's module back as it was.
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from precondfx.pytorch import calibrate as cal
from precondfx.pytorch import checks, distributed, flows
from precondfx.core import driver, lr_mode
from precondfx.pytorch.apply.common import PREFIX, output_path
from precondfx.pytorch.apply.eager_apply import EagerApplier, weight_side_forwards
from precondfx.pytorch.apply.fx_apply import FxApplier
from precondfx.pytorch.apply import user_class, weight_side
from precondfx.pytorch.balance import balance_measured, balanceable, held_out, record_factors
from precondfx.pytorch.capture import meta
from precondfx.pytorch.capture.common import (Sample, main_output, main_path_of, make_sample,
                                             mask_arguments, masks_by_use, other_outputs,
                                             others_note)
from precondfx.pytorch.capture.ladder import Captured, capture
from precondfx.pytorch.checks import check_copy, check_model
from precondfx.core.classify import classify
from precondfx.core.driver import Stage, State
from precondfx.errors import PrecondError
from precondfx.pytorch.folding import record
from precondfx.pytorch import lr_transfer
from precondfx.pytorch import lr_target as lr_target_mod
from precondfx.pytorch import first_step as first_step_mod
from precondfx.core.options import fixed_lr, lr_auto
from precondfx.integrations import hf_checkpoints
from precondfx.core.plan import ParamInfo
from precondfx.core.report import Report
from precondfx.pytorch.verify import measure_report, verify_result


@dataclass
class TorchState(State):
    """The PyTorch run: the user's model, the working copy, what a rollback restores."""

    model: Any = None                # the user's model (unwrapped)
    raw_sample: Any = None
    forward_kwargs: dict = field(default_factory=dict)
    inplace: bool = False
    work: nn.Module | None = None    # the module rewritten (a copy unless inplace)
    captured: Captured | None = None
    dtype: torch.dtype | None = None  # a float16/bfloat16 model's dtype (computed in float32)
    modes: dict[str, bool] = field(default_factory=dict)
    param_ids: set[int] = field(default_factory=set)   # the user model's parameters, by id
    notes: list[str] = field(default_factory=list)
    analysis: bool = False           # ``analyze``: plan only, on a copy, refusing nothing more
    not_user_class: str | None = None   # why a GraphModule result is not the user's class
    #: the main output picked on the whole batch (``output_key`` of per-sample measurements)
    main_key: Any = None
    #: the output is shaped as a normalizing flow's ``(z, log_det)`` (``flows.shaped_as_flow``)
    flow_shaped: bool = False
    others_note: str | None = None     # the prepare stage's note on the other outputs


# -- helpers -----------------------------------------------------------------------------------
def unwrap(model: Any) -> tuple[nn.Module, list[str]]:
    """The module to precondition (a ``torch.compile`` wrapper's original), with notes."""
    notes = []
    if not isinstance(model, nn.Module):
        raise PrecondError(f"model must be a torch.nn.Module, got {_what_to_pass(model)}")
    if _compiled(model):
        notes.append("model was wrapped by torch.compile: the original module was preconditioned "
                     "(compile the result again)")
        model = model._orig_mod
    nested = compiled_submodules(model)
    if nested:
        notes.append(f"submodule(s) {', '.join(nested[:4])} wrapped by torch.compile: run "
                     f"uncompiled during the pass, and left compiled in the result (its first "
                     f"training step compiles them)")
    return model, notes


def compiled_submodules(model: nn.Module) -> list[str]:
    """The paths of ``model``'s submodules wrapped by ``torch.compile`` (``model`` itself not
    included)."""
    return [n for n, m in model.named_modules() if n and _compiled(m)]


def _compiled(m: nn.Module) -> bool:
    return isinstance(getattr(m, "_orig_mod", None), nn.Module)


def uncompiled(model: Any) -> contextlib.AbstractContextManager:
    """Run what ``torch.compile`` wrapped eagerly while the pass runs: each calibration and
    measuring forward of a compiled submodule would otherwise recompile it (new hooks, new
    constants), up to dynamo's recompile limit, taking most of the pass's time."""
    if isinstance(model, nn.Module) and any(_compiled(m) for m in model.modules()):
        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def _what_to_pass(obj: Any) -> str:
    """What a non-module ``model`` argument is, and what to pass instead: an instance for a
    module class, the module a wrapper (sklearn-style estimator, pipeline) holds."""
    if isinstance(obj, type):
        if issubclass(obj, nn.Module):
            return (f"the class {obj.__name__} itself: pass an instance "
                    f"({obj.__name__}(...))")
        return f"the class {obj.__name__}: pass an nn.Module instance"
    held = [k for k, v in vars(obj).items() if isinstance(v, nn.Module)] \
        if hasattr(obj, "__dict__") else []
    if held:
        return (f"{type(obj).__name__}, which holds the module(s) "
                f"{', '.join(held[:4])}: pass the module the forward runs "
                f"(e.g. precondition(obj.{held[0]}, sample))")
    return (f"{type(obj).__name__}: wrap the computation in an nn.Module whose parameters are "
            f"its weights")


def float_dtype(model: nn.Module) -> torch.dtype | None:
    dts = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return dts.pop() if len(dts) == 1 else None


def prepare_sample(model: Any, sample: Any, forward_kwargs: dict | None
                   ) -> tuple[nn.Module, Sample, list[str]]:
    """The unwrapped, checked model and the sample in the dtype and device the pass computes
    in, with notes."""
    model, notes = unwrap(model)
    check_model(model)
    s = make_sample(sample, forward_kwargs)
    cal.check_finite_sample(s)
    dt = float_dtype(model)
    if meta.on_meta(model):     # resolve_torch refused the modes that need data
        meta.check_ties(model)
        s = s.map(lambda t: t.to("meta"))
    if dt is not None:  # float samples in the dtype the pipeline computes in
        work_dt = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
        other = sorted({str(t.dtype).replace("torch.", "") for t in s.tensors()
                        if t.is_floating_point() and t.dtype != dt})
        if other and work_dt == dt:
            notes.append(f"the sample's {', '.join(other)} tensors were cast to the model's "
                         f"{str(dt).replace('torch.', '')} for the pass (your model itself "
                         f"may refuse them: cast your data the same way)")
        s = s.map(lambda t: t.to(work_dt) if t.is_floating_point() else t)
    return model, s, notes


def input_arrays(s: Sample, opts: Any, model: nn.Module | None = None,
                 graph: Any = None) -> list:
    """The sample's floating-point inputs as numpy arrays, for ``input_scale="auto"`` only;
    the inputs named as masks (``attention_mask``), and with the captured ``graph`` those it
    reads as masks by their uses (``capture.common.masks_by_use``), left out: the input scale
    neither reads nor multiplies them (their ones would pull the scale of the data)."""
    if opts.input_scale != "auto":
        return []
    used: Any = ()
    if graph is not None and model is not None:
        try:
            used = masks_by_use(graph, model.forward)
        except PrecondError:
            used = ()           # refused where the scale is applied, with what to do
    pos, kws = mask_arguments(model.forward, len(s.args), s.kwargs, used) \
        if model is not None else ({}, set())
    kept = Sample(tuple(a for i, a in enumerate(s.args) if i not in pos),
                  {k: v for k, v in s.kwargs.items() if k not in kws})
    return [t.detach().float().cpu().numpy() for t in kept.tensors()
            if t.is_floating_point() and t.device.type != "meta"]


def input_rms(s: Sample) -> float | None:
    """The rms of the sample's floating-point inputs, for the output scale's messages; None
    without such an input (or on the meta device).  As ``core.calibration.input_second_moment``
    (the ONNX path's) it leaves out the tensors with -inf, the additive masks (the only
    non-finite inputs ``check_finite_sample`` lets through), computed without copies."""
    ts = [t.detach() for t in s.tensors() if t.is_floating_point() and t.device.type != "meta"
          and t.layout == torch.strided and t.numel() and bool(torch.isfinite(t).all())]
    if not ts:
        return None
    sq = sum(float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2 for t in ts)
    return (sq / sum(t.numel() for t in ts)) ** 0.5


def param_infos(model: nn.Module, user_scale: dict[str, float] | None = None
                ) -> tuple[dict[str, ParamInfo], dict[str, str]]:
    """ParamInfo per canonical parameter name, and the alias -> canonical map for tied ones;
    ``user_scale``: the scale of each weight in the user's model that ``lr_scale`` compares
    the planned scale with (``lr_transfer.user_scales``)."""
    infos: dict[str, ParamInfo] = {}
    canon: dict[str, str] = {}
    first: dict[int, str] = {}
    # all-zero weights matter only next to frozen ones (core.plan: zero-initialized adapters)
    tuning = any(not p.requires_grad for p in model.parameters())
    for name, p in model.named_parameters(remove_duplicate=False):
        c = first.setdefault(id(p), name)
        canon[name] = c
        if c == name:
            infos[name] = ParamInfo(tuple(p.shape), p.requires_grad,
                                    ".parametrizations." in name,
                                    user_scale=(user_scale or {}).get(name),
                                    zero=tuning and p.requires_grad and p.dim() >= 2 and
                                    p.device.type != "meta" and p.numel() > 0 and
                                    not bool(p.detach().any()))
        else:
            infos[c].aliases += (name,)
    return infos, canon


def capture_classify(model: nn.Module, s: Sample, methods: Any, mode: str, notes: list[str],
                     user_scale: dict[str, float] | None = None
                     ) -> tuple[Captured, dict[str, ParamInfo]]:
    """Capture (the ladder of methods), classify, and name tied parameters canonically
    (``user_scale``: see ``param_infos``)."""
    cap = capture(model, s, (methods,) if isinstance(methods, str) else tuple(methods), mode)
    cap.graph.notes.extend(notes)
    classify(cap.graph, {n for n, _ in model.named_parameters(remove_duplicate=False)})
    infos, canon = param_infos(model, user_scale)
    for n in cap.graph:
        n.params = {k: canon.get(v, v) for k, v in n.params.items()}
    return cap, infos


def run_on(model: nn.Module, s: Sample, mode: str) -> Any:
    """The check forward: a real run, or a fake-tensor run for a model on the meta device."""
    if meta.on_meta(model):
        return meta.forward(model, lambda m: cal.forward(m, s, mode), "checking the model")
    return cal.forward(model, s, mode)


def _uninitialized_buffers(model: nn.Module) -> dict[int, Any]:
    """A deepcopy memo holding a fresh twin of every uninitialized buffer (a LazyBatchNorm's
    running statistics before its first forward): torch's ``UninitializedBuffer`` defines no
    ``__deepcopy__`` (its ``UninitializedParameter`` twin does), so a lazy model could not be
    copied."""
    from torch.nn.parameter import UninitializedBuffer
    return {id(b): UninitializedBuffer(requires_grad=b.requires_grad, device=b.device,
                                       dtype=b.dtype)
            for b in model.buffers() if isinstance(b, UninitializedBuffer)}


def copy_model(model: nn.Module, lenient: bool = False) -> nn.Module:
    """The copy ``precondition`` rewrites; a model that cannot be deep-copied is an error that
    says to pass ``inplace=True`` (``lenient``: the model itself, for ``analyze``, which runs
    it with its state preserved)."""
    try:
        work = copy.deepcopy(model, _uninitialized_buffers(model))
    except RecursionError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. a module holding a lock or an open file
        if lenient:
            return model
        raise PrecondError(
            f"the model cannot be deep-copied ({type(e).__name__}: {str(e)[:120]}); precondfx "
            f"rewrites a copy so that your model stays unchanged. Pass inplace=True to rewrite "
            f"this module itself (hooks and buffers), or make it copyable (define __deepcopy__ "
            f"or keep the offending attribute outside the module)") from e
    check_copy(model, work)
    return work


def already_preconditioned(model: nn.Module) -> bool:
    """Whether the model holds constants a previous pass placed (the ONNX path's twin:
    ``onnx.pipeline.already_preconditioned``)."""
    return any(PREFIX in name for name, _ in model.named_buffers())


def restore_modes(result: nn.Module, modes: dict[str, bool]) -> None:
    """Give every module of the result the train/eval flag its namesake has in the user's
    model (a BatchNorm the user froze in eval stays in eval); modules the plan added follow
    their parent."""
    flags: dict[str, bool] = {}
    for name, m in result.named_modules():
        parent = name.rpartition(".")[0]
        flags[name] = modes.get(name, flags.get(parent, modes[""]))
        m.training = flags[name]


def restore_unused(gm: nn.Module, work: nn.Module) -> None:
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


# -- the PyTorch-only stages -------------------------------------------------------------------
#: why a model on the meta device gets no output scale yet (``State.no_data``)
NO_DATA = ("the model is on the meta device (no data): the output scale is 1 until "
           "precondfx.distributed.calibrate(model, batch) runs on the materialized model")


def prepare(st: TorchState) -> None:
    """Check the model and the sample, refuse a model that is already preconditioned,
    make the working copy (float32 for a half-precision model), run it once on the sample,
    and keep what a rollback needs (``inplace=True``)."""
    model, s, notes = prepare_sample(st.model, st.raw_sample, st.forward_kwargs)
    st.model, st.sample, st.notes = model, s, notes + st.resolved.notes()
    st.no_data = NO_DATA if meta.on_meta(model) else ""
    if already_preconditioned(model) and not st.analysis:
        held = [n for n, _ in model.named_buffers() if PREFIX in n]
        raise PrecondError(
            f"the model is already preconditioned (it holds {len(held)} precondfx_* "
            f"constant(s), e.g. {held[0]}): a second pass would stack new constants on the "
            f"first ones.  Use it as it is, or precondition the original model (rebuild it, or "
            f"keep a copy before the first call) with the options you want, or fold the "
            f"constants into the weights first (precondfx.fold(model) returns a plain model "
            f"that can be preconditioned again); precondfx.analyze(model, sample) shows what "
            f"it holds")
    if already_preconditioned(model):       # analyze: say what it holds, first
        held = [(n, b) for n, b in model.named_buffers() if PREFIX in n]
        vals = ", ".join(f"{n}={float(b):.4g}" if b.numel() == 1 and b.device.type != "meta"
                         else n for n, b in held[:8])
        st.notes.insert(0, (
            f"the model is already preconditioned: it holds {len(held)} precondfx constant(s) "
            f"({vals}{', ...' if len(held) > 8 else ''}); the table classifies the rewritten "
            f"model, precondfx's own products included, and precondition "
            f"refuses it (precondfx.fold(model) gives the plain model with the constants in "
            f"its weights)"))
    dt = float_dtype(model)
    if dt in (torch.float16, torch.bfloat16):
        if st.inplace:
            raise PrecondError(f"inplace=True is not supported for {dt} models (the pass "
                               f"computes in float32 on a copy): drop inplace=True and use the "
                               f"returned model")
        st.dtype = dt
    st.modes = {name: m.training for name, m in model.named_modules()}
    st.work = model if st.inplace else copy_model(model, lenient=st.analysis)
    if st.analysis and weight_side.sites(st.work):
        # analyze on an fx result: its layers as module calls (the form fold reads), so that
        # the capture sees each layer and its weight, not precondfx's fused layer() calls
        st.work = weight_side.module_call_view(st.work)
    if st.dtype is not None:
        st.work = st.work.float()
        st.notes.append(f"model in {dt}: preconditioned and calibrated in float32, result cast "
                        f"back to {dt}")
    if materialize_lazy(st.work, s):
        st.notes.append("lazy modules (LazyLinear, LazyConv, LazyBatchNorm...) initialized on "
                        "the sample: their shapes come from it"
                        + ("" if st.inplace else "; your model keeps its uninitialized ones"))
    st.say("checking that the model runs on the sample")
    with checks.at_user_limit():     # at the recursion limit the user's training runs with
        out0 = run_on(st.work, s, st.opts.calibration)
    st.main_path = output_path(out0, st.opts.output_key) if st.opts.target_std is not None \
        else []
    try:     # per-sample passes read the output picked here, not the rule at batch size 1
        st.main_key = main_path_of(out0, st.opts.output_key)
    except PrecondError:
        st.main_key = st.opts.output_key
    if st.opts.target_std is not None:
        cal.check_scalable(main_output(out0, st.opts.output_key), st.opts.output_key)
        note = others_note(out0, st.main_path) if st.opts.output_key is None else None
        if note:
            st.notes.append(note)
            st.others_note = note     # said again by verify, with the outputs that see it
    st.flow_shaped = flows.shaped_as_flow(out0, s, st.opts.output_key)
    if st.opts.target_std is not None and not st.data:   # on data, calibration checks it
        cal.check_calibratable(main_output(out0, st.opts.output_key))
    st.float_inputs = any(t.is_floating_point() for t in s.tensors())
    st.param_ids = {id(p) for p in model.parameters()}
    st.input_rms = input_rms(s)
    if st.inplace:
        snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
        st.undo.append(lambda: _restore_state(model, snapshot))


def materialize_lazy(model: nn.Module, s: Sample) -> bool:
    """Run ``model`` once on the sample (eval mode, no grad, the global RNG left as it was) if
    it holds uninitialized lazy parameters or buffers, so that they get their shapes, as the
    first forward of training would; True if it did.  The pass reads every weight's shape."""
    from torch.nn.parameter import is_lazy
    if not any(is_lazy(t) for t in [*model.parameters(), *model.buffers()]):
        return False
    if meta.on_meta(model):
        raise PrecondError("the model has uninitialized lazy modules (LazyLinear, LazyConv...) "
                           "on the meta device: run it once on a batch (or build it with "
                           "explicit sizes) before planning on meta")
    modes = {m: m.training for m in model.modules()}
    cuda = sorted({t.device.index or 0 for t in [*model.parameters(), *model.buffers()]
                   if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            model.eval()
            s.call(model)
    except PrecondError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's forward (run to size its lazy modules)
        if checks.is_out_of_memory(e):
            raise
        raise cal.model_raised(model, s, e) from e
    finally:
        for m, training in modes.items():
            m.train(training)
    return True


def _restore_state(model: nn.Module, snapshot: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if k in snapshot:
                v.copy_(snapshot[k])


def capture_stage(st: TorchState) -> None:
    """Capture and classify the working model; refuse one with nothing to precondition."""
    st.captured, st.params = capture_classify(st.work, st.sample, st.opts.capture,
                                              st.opts.calibration, st.notes,
                                              lr_transfer.user_scales(st.work, st.opts.lr_scale))
    st.graph = st.captured.graph
    # after the capture: the masks found by their uses leave the input scale's rms too
    st.input_arrays = input_arrays(st.sample, st.opts, st.work, st.graph)
    if not st.analysis:
        driver.has_work(st.graph, "convolution, linear, embedding, matmul with a parameter... "
                                  "in the captured graph")
    st.say(f"captured with {st.graph.method}: {len(st.graph)} nodes; planning")


def backend(st: TorchState) -> None:
    """The fx back end on the traced GraphModule, else the eager one on the module itself
    (``inplace=True``, or a forward fx cannot keep).  Either way the result is of the user's
    class: the GraphModule is rebuilt on the working copy's own module tree as
    ``Preconditioned<YourClass>`` (``apply.user_class.adopt``)."""
    gm = st.captured.gm
    if gm is not None and not st.inplace:
        restore_unused(gm, st.work)
        # the graph on the user's own module tree, as a GraphModule of the user's class
        gm, st.not_user_class = user_class.adopt(gm, st.work)
        st.backend, st.result = FxApplier(gm, st.graph), gm
        # a new GraphModule is in train mode: give it the user's flags before any calibration
        # run, so that a model the user left in eval is calibrated as it will train
        restore_modes(gm, st.modes)
    else:
        st.backend = EagerApplier(st.work, st.graph,
                                  run=lambda m: run_on(m, st.sample, "eval"),
                                  run_train=lambda m: run_on(m, st.sample, "train"))
        st.result = st.work


def balance(st: TorchState) -> None:
    """Measured balancing (``balance='auto'``/``'hessian'``); on the meta device, the alpha
    sites are planned and the measurement is left to ``precondfx.distributed.balance``."""
    o, rep = st.opts, st.report
    if not st.data:
        why = ("the model is on the meta device: an alpha (1) sits on every weighted layer; "
               "balance it after to_empty, precondfx.reinit and distributed.calibrate with "
               "precondfx.distributed.balance(model, batch)")
        rep.conditioning["hessian"] = {"applied": False, "decision": f"deferred: {why}"}
        rep.skipped.append((f"balance={o.balance!r}", f"not measured yet: {why}"))
        return
    try:
        rep.conditioning["hessian"] = h = balance_measured(
            st.result, st.sample, st.plan, st.alpha_buffers, verbose=st.verbose, seed=o.seed,
            output_key=st.main_key, mode=o.calibration, log=st.say,
            n_samples=o.balance_samples, balance=o.balance, threshold=o.balance_threshold,
            graph=st.graph, distributed=distributed.is_sharded(st.result))
        rep.skipped += [(f"balance {w}", why) for w, why in h["left_out"].items()]
        if h.get("applied"):
            record_factors(st.measured, st.plan, h["factors"])
    except PrecondError as e:
        if o.balance == "hessian":
            raise
        rep.conditioning["hessian"] = {"applied": False, "decision": f"not measured: {e}"}
        rep.skipped.append(("balance='auto'", f"measurement failed, alphas left as planned: "
                            f"{e}"))


@contextlib.contextmanager
def _plan_edit(st: TorchState, stage: str) -> Iterator[Any]:
    """A copy of the plan as the model holds it now, for a stage that changes constants after
    calibration; what the stage changed in it is recorded in ``report.measured`` (the plan
    stays as planned)."""
    now = st.measured.final(st.plan)        # what the model holds (after balancing)
    edited = copy.deepcopy(now)
    yield edited
    st.measured.record_diff(stage, now, edited)


def _suggested(st: TorchState, families: tuple[str, ...] = ("sgd", "adam")) -> dict[str, Any]:
    """``suggest_lr`` on the returned model as it is now, in the calibration mode."""
    from precondfx.pytorch.measure.suggest import suggest_lr
    o = st.opts
    return suggest_lr(st.result, st.sample, mode=o.calibration, key=o.output_key, seed=o.seed,
                      families=families, graph=st.graph)


def lr_scale(st: TorchState) -> None:
    """``lr_scale=``: per-layer scales for learning-rate transfer (``precondfx.pytorch.lr_transfer``),
    after balancing, which would undo them."""
    with _plan_edit(st, "lr_scale") as edited:
        st.report.conditioning["lr_scale"] = lr_transfer.apply(
            st.result, st.graph, edited, st.lr_buffers, st.plan.lr_mode, st.constants,
            st.backend.set_constant,
            user_rms={n: i.user_scale for n, i in st.params.items() if i.user_scale is not None},
            from_plan=st.opts.lr_scale == "auto",
            declared=st.opts.lr_scale == "adam" and lr_mode.declared_base(
                st.plan, st.params, st.opts))
    if st.plan.lr_mode_reason:
        st.report.conditioning["lr_scale"]["decision"] = st.plan.lr_mode_reason


def lr_target(st: TorchState) -> None:
    """``lr=`` with ``optimizer=``: one factor on every re-drawn layer puts the result's
    suggested rate on the user's (:mod:`precondfx.pytorch.lr_target`)."""
    o = st.opts
    with _plan_edit(st, "lr_target") as edited:
        st.report.conditioning["lr_target"] = sec = lr_target_mod.keep_rate(
            st.result, st.graph, edited, st.lr_buffers, o.lr, o.optimizer,
            lambda fam: _suggested(st, (fam,))[fam], st.constants, st.backend.set_constant,
            say=st.say)
    if sec.get("warning"):
        warnings.warn(f"precondfx: {sec['warning']}", RuntimeWarning, stacklevel=2)
        st.report.skipped.append(("warning: lr=", sec["warning"]))


def first_step(st: TorchState) -> None:
    """``lr='auto'``: the storage for the optimizer's rate is set at its first step
    (:mod:`precondfx.pytorch.first_step`); the report says it is pending.  Without data (the
    meta device, a sharded model) the multipliers are planned all the same, so that every
    route plans one model, and stay 1."""
    why = st.no_data or ("the model is sharded: each rank would measure its own factor"
                         if distributed.is_sharded(st.result) else "")
    if why:
        st.report.conditioning["lr_target"] = {
            "lr": "auto", "pending": False, "factor": 1.0, "layers": 0,
            "summary": f"lr='auto': not armed ({why}): the lr multipliers stay 1, the "
                       f"storage lr_scale chose; pass lr= and optimizer= when preconditioning "
                       f"the materialized, unsharded model to set it for your rate"}
        return
    theirs = {n for n, _ in st.model.named_parameters(remove_duplicate=False)}
    added = tuple(n for n, _ in st.result.named_parameters() if n not in theirs)
    pend = first_step_mod.arm(st.result, st.graph, st.plan, st.report, st.lr_buffers, st.sample,
                              st.opts.output_key, st.opts.seed, added)
    if pend is None:
        scale = st.report.output_scale
        if scale not in (None, 1.0) and any(p.requires_grad for p in st.result.parameters()):
            # every trainable weight kept (parametrized: spectral or weight norm; computed in
            # forward): the output scale alone changes the SGD step, and no layer can carry
            # the factor that would lower it
            why = (f"not armed: no re-drawn layer carries an lr multiplier (the trainable "
                   f"weights are kept as they are), so nothing lowers your SGD rate; the "
                   f"output scale {scale:.4g} multiplies the gradients of those weights by "
                   f"{scale:.4g} and the loss curvature by {scale * scale:.4g}: scale your "
                   f"learning rate by {1 / (scale * scale):.3g}, or pass target_std=None to "
                   f"keep your model's output scale")
            st.report.conditioning["lr_target"] = {
                "lr": "auto", "pending": False, "factor": 1.0, "layers": 0,
                "summary": "lr='auto': not armed (see NOT APPLIED)", "kept": why}
            st.report.skipped.append(("lr='auto'", why))
        return
    st.report.conditioning["lr_target"] = {
        "lr": "auto", "pending": True, "layers": len(pend.lr_buffers),
        "summary": f"lr='auto': at your optimizer's first step, if it is torch.optim.SGD "
                   f"and its rate is above the suggested SGD rate, {len(pend.lr_buffers)} "
                   f"layers' storage is set to lower it there (lr='s factor for that rate; the "
                   f"same function); otherwise, and for Adam-family optimizers, this storage "
                   f"is kept (lr=None: off)"}


def measure(st: TorchState) -> None:
    """``measure=True``: Hessian statistics of the original and the rewritten model."""
    o = st.opts
    st.report.conditioning["measure"] = mr = measure_report(
        st.model, st.result, st.sample, st.plan, output_key=st.main_key, mode=o.calibration,
        seed=o.seed, n_samples=o.balance_samples, say=st.say, verbose=st.verbose)
    held_out(st.report.conditioning.get("hessian"), mr)


def suggest(st: TorchState) -> None:
    """``suggest_lr=True``: SGD and Adam rates from the returned model's curvature
    (``report.suggested_lr``; :mod:`precondfx.pytorch.measure.suggest`)."""
    st.report.conditioning["suggested_lr"] = _suggested(st)


def verify(st: TorchState) -> None:
    """Run the finished model in both modes: finite outputs, the output std at its target."""
    st.report.verification = v = verify_result(
        st.result, st.sample, output_key=st.main_key, mode=st.opts.calibration,
        target_std=st.opts.target_std if st.out_const is not None else None,
        seed=st.opts.seed, draws=max(st.random_draws, driver.RANDOM_DRAWS))
    if v.get("relative_error", 0.0) > 1e-3:   # never silently off target
        why = (f"the output std is {v['std']:.4g} after calibration, not the target "
               f"{v['target_std']:g}: the output scale does not act on the main output as "
               f"measured (please report this model)")
        warnings.warn(f"precondfx: {why}", RuntimeWarning, stacklevel=2)
        st.report.skipped.append(("warning: output scale", why))
    if st.others_note and st.out_const is not None:
        _others_measured(st)
    flow = flows.log_det_offset(st.result, st.sample, st.main_key, st.opts.calibration,
                                st.report.output_scale) if st.out_const is not None and \
        st.data and st.flow_shaped else None
    if flow is not None:
        st.report.conditioning["flow"] = flow
        warnings.warn(f"precondfx: {flow['summary']}", RuntimeWarning, stacklevel=2)
        st.report.skipped.append(("warning: flow log-determinant", flow["summary"]))


def _others_measured(st: TorchState) -> None:
    """The note on the outputs beside the main one, with those the model computes from the
    scaled value (``(logits, softmax(logits))``: the probabilities see the scale too, as the
    ONNX back end says) told apart by measurement: the outputs with the output scale doubled
    against as calibrated (before, every other output was said to be "not" under the scale)."""
    be, name = st.backend, st.out_const
    value = float(st.result.get_buffer(name).reshape(-1)[0])
    try:
        a = cal.forward(st.result, st.sample, st.opts.calibration)
        be.set_constant(name, 2.0 * value)
        b = cal.forward(st.result, st.sample, st.opts.calibration)
    finally:
        be.set_constant(name, value)
    xs, ys = other_outputs(a, st.main_path), other_outputs(b, st.main_path)
    through = [k for k, v in xs.items() if k in ys and v.shape == ys[k].shape and
               not torch.allclose(v, ys[k], rtol=1e-5, atol=1e-7, equal_nan=True)]
    note = others_note(a, st.main_path, through)
    notes = st.report.capture_notes
    if note and st.others_note in notes:
        notes[notes.index(st.others_note)] = note


def finish(st: TorchState) -> None:
    """Constants recorded for materializing, train/eval flags as the user's, what ``fold``
    needs (for a transformers model also its config entry and checkpoint folding), the
    original dtype back."""
    distributed.record_constants(st.result, st.constants, read=st.data)
    distributed.record_aliases(st.result, st.plan.aliases)
    distributed.record_balanceable(st.result, *balanceable(st.alpha_buffers, st.plan, st.graph))
    restore_modes(st.result, st.modes)
    result_record(st)
    if st.inplace:
        added = [n for n, p in st.result.named_parameters() if id(p) not in st.param_ids]
        if added:
            st.report.skipped.append((
                "inplace=True", f"{len(added)} new parameter(s) ({', '.join(added[:4])}"
                f"{', ...' if len(added) > 4 else ''}: the convolutions that replace max-pools) "
                f"are in your model now: an optimizer built before this call does not hold "
                f"them, so build it after precondition"))
            # and one that holds the rest of the model is refused at its first step
            user_class.guard_added(st.result, added)
    st.say("recording how to fold the constants back into the weights")
    record(st.result, st.work, st.backend, st.graph, lambda m: run_on(m, st.sample, "eval"))
    if hf_checkpoints.is_transformers_model(st.result):   # config entry, checkpoint folding
        hf_checkpoints.prepare(st.result, st.report)
    # a checkpoint of the model before precondition, loaded into the result, is refused
    user_class.guard_checkpoints(st.result)
    # an optimizer built on the model given (a copy was rewritten) is refused at its first step
    user_class.guard_optimizers(st.model, st.result)
    # the parameters it added (a max-pool's convolution), left out of every optimizer's
    # parameter groups, are said at a step (lr='auto''s first step says them itself)
    theirs = {n for n, _ in st.model.named_parameters(remove_duplicate=False)}
    user_class.guard_new(st.result, [
        n for n, p in st.result.named_parameters()
        if (id(p) not in st.param_ids if st.inplace else n not in theirs)])
    if st.dtype is not None:
        st.result = st.result.to(st.dtype)
    if isinstance(st.result, torch.fx.GraphModule):
        # last: every stage above (and the mirror hooks, fold's record) reads the constants as
        # products on activations; training runs them on the weights (same function and
        # gradients, no pass over the activations)
        weight_side.to_weight_side(st.result)
    else:       # the eager back end: the same, by a forward of their own on the layers
        weight_side_forwards(st.result)


def reset_stale_statistics(st: TorchState) -> None:
    """BatchNorm running statistics that describe the weights before re-initialization are
    reset (mean 0, variance 1, no batches counted: those of a freshly built model).  A
    normalization layer downstream of a re-drawn weight that had tracked batches (a trained
    model) would otherwise normalize in eval mode with the old weights' statistics (PointNet:
    eval output std 24 against 0.41 before precondition); its statistics upstream of every
    re-drawn weight still hold and are kept.  Said in the report's notes."""
    drawn = {n for n, pi in st.plan.inits.items() if pi.rule not in ("keep", "scale")}
    if not drawn:
        return
    tainted: set[str] = set()
    stale: list[str] = []
    modules = dict(st.result.named_modules())
    for n in st.graph:
        if any(p in drawn for p in n.params.values()) or any(i in tainted for i in n.inputs):
            tainted.add(n.name)
        m = modules.get(n.module or "")
        if isinstance(m, nn.modules.batchnorm._NormBase) and \
                any(i in tainted for i in n.inputs) and m.running_mean is not None and \
                m.num_batches_tracked is not None and \
                m.num_batches_tracked.device.type != "meta" and \
                int(m.num_batches_tracked) > 0 and \
                n.module not in stale:
            m.reset_running_stats()
            stale.append(n.module)
    if stale:
        st.plan.notes.append(
            f"running statistics of {len(stale)} normalization layer(s) after re-drawn weights "
            f"reset to a new model's (they described the weights before): {', '.join(stale)}; "
            f"training updates them (eval mode before that uses mean 0, variance 1)")


def _warn_methods(cls: type, methods: list[str], only: list[str], where: str = "",
                  partly: list[str] | None = None) -> None:
    """Warn that ``methods`` of the user's class (an ``inverse``, an ``encode``) run the user's
    code on the layers and compute without the constants ``only`` lists, with what to do.
    ``where``: the module whose call applies them (a submodule's class); ``partly``: the
    methods that call ``self(...)`` too (the rest of their computation is outside it)."""
    fixes = []
    if any("output_scale" in c for c in only):
        fixes.append("target_std=None (no output scale)")
    if any("residual" in c for c in only):
        fixes.append("residual='none' (no residual scales)")
    if any("input_scale" in c for c in only):
        fixes.append("input_scale=None (no input scale)")
    if any("max_pool" in c and "replaced" in c for c in only):
        fixes.append("maxpool='keep' (max-pooling kept)")
    todo = (f"precondition with {' and '.join(fixes)} so that they compute the same function "
            f"as forward" if fixes else "call them only through forward, or fold the model")
    also = (f" ({', '.join(partly)} call(s) self(...) too, but run(s) the layers outside it "
            f"as well)" if partly else "")
    site = (f"outside the call of {where} (the hooks of its call apply the constants): only "
            f"that call applies" if where else "not the rewritten forward: only forward applies")
    warnings.warn(
        f"precondfx: {cls.__name__}.{', .'.join(methods)} run(s) your code on the layers, "
        f"{site} {'; '.join(only[:4])}{' ...' if len(only) > 4 else ''}{also}, so these "
        f"methods{' and the methods calling them' if where else ''} compute a different "
        f"function (e.g. an inverse no longer inverts forward); {todo} "
        f"(report.result['forward_only'])", RuntimeWarning, stacklevel=2)


def result_record(st: TorchState) -> None:
    """What the result is (``report.result``): the user's class or not, and what only its
    ``forward`` sees.  On a GraphModule of the user's class, the constants at module sites get
    mirror hooks for the other methods (``apply.user_class.mirror``)."""
    res, rep = st.result, st.report
    cls = user_class.own_class(type(st.model))      # a GraphModule's: past fx's per-instance one
    graph = isinstance(res, torch.fx.GraphModule)
    only: list[str] = []
    carriers: set[str] = set()      # the modules whose call carries constants
    if user_class.is_user_graph(res):
        _, consts = user_class.mirror(res, {n.name: n.kind for n in st.graph},
                                      getattr(st.backend, "sides", None))
        unchecked: list[str] = []
        res.__dict__[user_class.READS] = user_class.traced_reads(res, unchecked)
        res.__dict__[user_class.THROUGH] = user_class.traced_through(res)
        for name in unchecked:      # never silently: what the result does not check is said
            rep.skipped.append((
                f"attribute {name}", f"the traced forward read it, but it holds more than "
                f"{user_class.CONTAINER_LEAVES} values, too many to compare at every call: "
                f"changed afterwards, the result computes with the traced value (no error). "
                f"Keep it unchanged, hold it in a tensor buffer, or precondition with "
                f"capture='export'"))
        only = [f"constant {c}" for c in dict.fromkeys(consts)] + \
            list(st.backend.graph_only)
        carriers = {site[0] for site in res.__dict__.get(user_class.MIRRORS, ())}
    elif not graph:         # the eager back end: constants on the root act on forward only
        only = [f"constant {c}" for c in st.constants if "." not in c] + \
            [f"module {k.partition(':')[2]} at the input"
             for k, o in st.backend.outcomes.items() if k.startswith("module:") and o.done]
        carriers = {path for path, m in res.named_modules()
                    if any(k.startswith(PREFIX) for k in m._buffers)}
    only += user_class.direct_reads(cls, carriers)
    mine = isinstance(res, cls)
    methods = user_class.own_code_methods(cls, {n for n, _ in res.named_children()}) \
        if mine and only else []
    if methods:         # never silently: an inverse that no longer inverts forward
        _warn_methods(cls, methods, only, partly=user_class.also_forward(cls))
    if not graph:       # a submodule's own methods skip the hooks of its call (eager, export)
        for path, ms, consts in user_class.carrier_methods(res, carriers):
            said = [f"constant {n}={v:.4g}" for n, v in consts.items()]
            _warn_methods(type(res.get_submodule(path)), ms, said, where=path)
            only += [f"method {type(res.get_submodule(path)).__name__}.{m} (the class of "
                     f"{path}) runs its layers outside its call: without {', '.join(said)}"
                     for m in ms]
    if not mine:        # never silently: the report's result line says it too
        warnings.warn(f"precondfx: the result is a torch.fx.GraphModule, not your class "
                      f"{cls.__name__} ({st.not_user_class}): its methods other than forward "
                      f"are not available; precondition with capture='eager' to keep your "
                      f"class", RuntimeWarning, stacklevel=2)
    rep.graph_module = res if graph else None
    rep.result = {
        "class": f"{cls.__module__}.{cls.__qualname__}", "is_user_class": mine,
        "graph_module": graph, "forward_only": only,
        "note": st.not_user_class if not mine else None,
    }


#: what ``precondition`` runs (``driver.run``)
STAGES = (
    Stage("prepare", prepare, ensures=("sample",)),
    Stage("capture", capture_stage, "capturing the graph", ensures=("graph",)),
    driver.PLAN,
    Stage("apply", backend, ensures=("backend", "result")),
    driver.APPLY,
    driver.REINIT,
    Stage("statistics", reset_stale_statistics, when=lambda st: st.opts.reinit,
          requires=("plan", "graph", "result")),
    driver.MATCH,
    driver.SCHEME,
    driver.CALIBRATE,
    Stage("balance", balance, lambda st: f"measured balancing ({st.opts.balance})",
          when=lambda st: st.opts.balance in ("hessian", "auto")),
    Stage("lr_scale", lr_scale, lambda st: f"lr_scale={st.plan.lr_mode!r}",
          when=lambda st: st.plan.lr_mode is not None),
    Stage("lr_target", lr_target, lambda st: f"putting the suggested {st.opts.optimizer} "
          f"rate on lr={st.opts.lr:g}", when=lambda st: fixed_lr(st.opts) is not None and
          st.data),
    Stage("measure", measure, when=lambda st: st.opts.measure),
    Stage("suggest_lr", suggest, "suggesting learning rates from the curvature",
          when=lambda st: st.opts.suggest_lr and st.data),
    Stage("verify", verify, when=lambda st: st.data),
    driver.RECORD,
    Stage("record", finish),
    Stage("first_step", first_step, when=lambda st: lr_auto(st.opts)),
)


def precondition(model: nn.Module, sample: Any, resolved: Any, *, inplace: bool,
                 verbose: bool, forward_kwargs: dict, started: float | None = None
                 ) -> tuple[nn.Module, Report]:
    """Run :data:`STAGES` over resolved options; the rewritten model and its report
    (``started``: when the public call began, for the report's time)."""
    with driver.verbose_logging(verbose), uncompiled(model):
        st = driver.run(STAGES, TorchState(resolved, verbose=verbose, model=model,
                                           raw_sample=sample, forward_kwargs=forward_kwargs,
                                           inplace=inplace, started=started))
        st.say("done")
    return st.result, st.report


def analyze(model: nn.Module, sample: Any, resolved: Any, forward_kwargs: dict) -> Report:
    """:data:`STAGES` up to the plan, on a private copy (the model itself, with its state
    preserved, where it cannot be copied); the report of what ``precondition`` would do."""
    st = TorchState(resolved, model=model, raw_sample=sample, forward_kwargs=forward_kwargs,
                    analysis=True)
    with cal.preserved(unwrap(model)[0]), uncompiled(model):
        driver.run(STAGES, st, until="plan")
    rep = Report.from_graph(st.graph, st.plan)
    rep.planned = st.plan
    o = st.opts
    for name, on in (("measure", o.measure), ("suggest_lr", o.suggest_lr)):
        if on:   # measurements of the rewritten model, which analyze does not build
            rep.skipped.append((f"{name}=True", f"analyze rewrites nothing, so nothing is "
                                f"measured: precondition(..., {name}=True) measures the "
                                f"rewritten model"))
    return rep
