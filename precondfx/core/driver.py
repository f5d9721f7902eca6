"""The driver: one runner over a list of stages, and the stages every back end shares.

A pipeline is a list of :class:`Stage` s run in order by :func:`run` over one :class:`State`.
Each stage is a small function with an explicit contract: the state fields it ``requires`` and
those it ``ensures`` (checked by the runner, in the style of onnx-ir's passes), a condition
``when`` it runs, and the progress line it prints.  The runner keeps the stage timings
(``report.stage_seconds``), prints progress (``verbose``; the ``precondfx`` logger always), and on
any failure rolls the back end back and runs the registered undo steps, newest first, so that
nothing is left half-changed.

The stage lists: ``precondfx.pytorch.pipeline`` (PyTorch: prepare, capture, plan, apply, reinit, scheme,
calibrate, balance, measure, verify, record) and ``precondfx.onnx.pipeline`` (load, normalize,
capture, plan, apply, reinit, calibrate, save, verify, commit).  ``plan``, ``apply``, ``reinit``,
``scheme``, ``calibrate`` and ``report`` below are the same code on every back end: they talk to
the back end only through ``precondfx.core.backend.Backend``.
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
import warnings
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from precondfx.core import calibration as cal
from precondfx.core import classify
from precondfx.core import options as options_mod
from precondfx.core import tokens
from precondfx.core.backend import Backend
from precondfx.errors import PrecondError
from precondfx.core.graph import Graph
from precondfx.core.measured import Measured
from precondfx.core.options import Options, Resolved
from precondfx.core.plan import ParamInfo, Plan, make_plan, plan_io
from precondfx.core.report import Report
from precondfx.core.scheme import Scheme, SchemeContext

log = logging.getLogger("precondfx")


@dataclass
class State:
    """What the stages of one run share.  Back ends extend it with their own fields
    (``pipeline.TorchState``, ``onnx.pipeline.OnnxState``)."""

    resolved: Resolved
    verbose: bool = False
    progress: Callable[[str, float], None] | None = None   # (stage, seconds since start)
    sample: Any = None               # what ``backend.run`` takes: a Sample, or ONNX feeds
    input_arrays: list[Any] = field(default_factory=list)  # numpy inputs, input_scale="auto"
    #: whether the model takes a floating-point input (an input scale has one to scale);
    #: None where the back end does not say
    float_inputs: bool | None = None
    #: rms of the floating-point inputs (additive masks left out), for the output scale's
    #: messages; None where the back end does not say
    input_rms: float | None = None
    graph: Graph | None = None
    params: dict[str, ParamInfo] = field(default_factory=dict)
    plan: Plan | None = None
    backend: Backend | None = None
    result: Any = None               # the rewritten model
    report: Report | None = None
    main_path: list = field(default_factory=list)  # where the main output is in the output
    out_const: str | None = None     # the output scale's constant
    moot: list[str] = field(default_factory=list)   # options the user set that do nothing
    constants: dict[str, float] = field(default_factory=dict)   # constant -> planned value
    alpha_buffers: dict[str, list[str]] = field(default_factory=dict)  # weight -> constants
    site_buffers: dict[str, str] = field(default_factory=dict)         # node -> alpha constant
    #: weight -> its call sites' lr_scale multipliers (one per call site placed; ``lr`` scales)
    lr_buffers: dict[str, list[str]] = field(default_factory=dict)
    in_scale: float | None = None
    measured: Measured = field(default_factory=Measured)   # what the stages set after apply
    no_data: str = ""                # why the model cannot run on data (the meta device), or ""
    times: dict[str, float] = field(default_factory=dict)
    random_draws: int = 0            # >0: the forward is random, measured over this many draws
    undo: list[Callable[[], None]] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    #: when the public call began (``time.perf_counter``): the report's time then includes the
    #: start-up before the first stage (checking and resolving the options, first imports)
    started: float | None = None

    @property
    def data(self) -> bool:
        """The model can run on data (stages that measure need it)."""
        return not self.no_data

    @property
    def opts(self) -> Options:
        return self.resolved.options

    @property
    def scheme(self) -> Scheme:
        return self.resolved.scheme

    def say(self, msg: str) -> None:
        """A progress line on the ``precondfx`` logger (INFO); ``verbose=True`` makes it
        reach stderr once (:func:`verbose_logging`)."""
        log.info("[%.2fs] %s", time.perf_counter() - (self.started or self.t0), msg)


@dataclass(frozen=True)
class Stage:
    """One step of a pipeline (see the module docstring)."""

    name: str                                   # its key in ``report.stage_seconds``
    fn: Callable[[Any], None]
    say: str | Callable[[Any], str] | None = None
    when: Callable[[Any], bool] | None = None
    requires: tuple[str, ...] = ()
    ensures: tuple[str, ...] = ()


def _check(st: State, stage: Stage, names: tuple[str, ...], what: str) -> None:
    missing = [n for n in names if getattr(st, n, None) is None]
    if missing:
        raise AssertionError(f"stage {stage.name!r} {what} {missing} (a precondfx bug)")


@contextlib.contextmanager
def verbose_logging(verbose: bool) -> Iterator[None]:
    """With ``verbose``, the ``precondfx`` logger's INFO lines reach stderr exactly once: when
    logging already emits them (a handler and INFO enabled, e.g. ``logging.basicConfig(
    level=logging.INFO)``) nothing is added; otherwise a stderr handler is added for the call
    (and propagation to the root's handlers paused, which would print them a second time)."""
    if not verbose or (log.isEnabledFor(logging.INFO) and log.hasHandlers()):
        yield
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("[precondfx] %(message)s"))
    level, propagate = log.level, log.propagate
    log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(h)
        log.setLevel(level)
        log.propagate = propagate


def run(stages: Sequence[Stage], st: State, until: str | None = None) -> State:
    """Run ``stages`` in order over ``st``: timings, progress, contracts, rollback.  With
    ``until``, stop after the stage of that name (``analyze`` and ``inspect`` run the stage
    list up to ``"plan"``)."""
    with verbose_logging(st.verbose):
        return _run(stages, st, until)


def _run(stages: Sequence[Stage], st: State, until: str | None) -> State:
    last = None
    # before the first stage (kept last in the timings, after the stages in their order)
    startup = None if st.started is None else time.perf_counter() - st.started
    try:
        for stage in stages:
            if stage.when is not None and not stage.when(st):
                continue
            _check(st, stage, stage.requires, "requires")
            if st.progress is not None and stage.name != last:
                st.progress(stage.name, time.perf_counter() - st.t0)
            last = stage.name
            if stage.say:
                st.say(stage.say(st) if callable(stage.say) else stage.say)
            t = time.perf_counter()
            stage.fn(st)
            st.times[stage.name] = st.times.get(stage.name, 0.0) + time.perf_counter() - t
            _check(st, stage, stage.ensures, "ensures")
            if stage.name == until:
                break
    except BaseException:
        if st.backend is not None:
            st.backend.rollback()
        for undo in reversed(st.undo):
            undo()
        raise
    if startup is not None:
        st.times["start-up"] = startup
    if st.report is not None:
        st.report.stage_seconds = {**st.times, "total": sum(st.times.values())}
    return st


# -- the shared stages -------------------------------------------------------------------------
def has_work(g: Graph, what: str) -> None:
    """Refuse a graph with nothing to precondition."""
    if not any(n.status == "weighted" for n in g) and not any(n.kind == "maxpool" for n in g):
        derived = classify.derived_weights(g)
        if derived:
            where = "; ".join(n.name + " from " + ", ".join(p) for n, p in derived[:4])
            if any("weight_fake_quant" in q for _, p in derived for q in p):
                raise PrecondError(
                    f"the model was prepared for quantization-aware training: its layers "
                    f"take their weights through weight_fake_quant ({derived[0][0].name} from "
                    f"{derived[0][1][0]}), so precondfx finds no weight it can re-initialize. "
                    f"Precondition the float model first, then call "
                    f"torch.ao.quantization.prepare_qat on the result")
            raise PrecondError(
                f"the model has no weighted layer precondfx can re-initialize: "
                f"{len(derived)} layer(s) take a weight computed in forward from a parameter "
                f"({where}"
                f"{'...' if len(derived) > 4 else ''}), as an equalized learning rate "
                f"(weight * constant) does; precondfx re-initializes only weights passed to "
                f"the layer as parameters (nn.Linear, nn.Conv2d, F.linear(x, self.weight)). "
                f"Train this model as it is, or write the layers as modules")
        raise PrecondError(f"the model has no weighted layer ({what}): there is nothing to "
                           f"precondition. Train this model as it is, or pass the model that "
                           f"holds the layers (its parameters)")


def plan(st: State) -> None:
    """The whole plan, before anything is applied: ``make_plan`` on the classified graph, the
    scheme's changes, the input and output scales (``plan_io``)."""
    p = make_plan(st.graph, st.params, st.opts, alpha_sites=st.scheme.needs_alpha_sites)
    p.notes.extend(st.resolved.notes())
    moot = options_mod.moot(st.resolved.user, st.opts) + moot_in_model(st.resolved.user,
                                                                       st.opts, p)
    p.notes.extend(moot)
    before = len(p.notes)
    st.scheme.plan(st.graph, p, st.params, st.opts)
    # the scheme's own 'scheme_options X has no effect' notes are listed with the others
    moot += [n for n in p.notes[before:] if " has no effect" in n]
    late = moot_init(st.resolved.user, st.opts, p)
    st.in_scale = input_scale(st.opts, p, st.input_arrays)
    if st.in_scale is not None and st.float_inputs is False:
        late.append(f"input_scale={st.resolved.user.input_scale!r} has no effect: the model "
                    f"takes no floating-point input (token ids and other integer inputs are "
                    f"not scaled)")
        st.in_scale = None
    p.notes.extend(late)
    st.moot = moot + late       # the report lists them with what was not applied
    plan_io(p, st.opts, st.in_scale)
    if not (p.scales or p.pools or p.residuals or p.lr_mode or p.reasons
            or st.opts.scheme != options_mod.DEFAULTS.scheme
            or any(pi.rule != "keep" for pi in p.inits.values())):
        p.notes.append(
            "these options change nothing: every weight is kept and no constant is placed "
            f"(reinit_weights={st.opts.reinit}, init={st.opts.init!r}, "
            f"balance={st.opts.balance!r}, target_std={st.opts.target_std!r}, "
            f"input_scale={st.opts.input_scale!r}); the result computes exactly as your model")
    st.plan = p


def moot_in_model(user: Options, opts: Options, p: Plan) -> list[str]:
    """A note for each option the user set (not the default) that this model leaves without
    effect: the pool options without a max-pool replaced, the residual options without a
    residual join."""
    D, out = options_mod.DEFAULTS, []
    if not p.pools:
        out += [f"{k}={getattr(user, k)!r} has no effect: the model has no max-pool"
                for k in ("maxpool", "pool_conv") if getattr(user, k) != getattr(D, k)
                and not (k == "pool_conv" and opts.maxpool in ("keep", "avgpool"))]
    elif user.pool_conv != D.pool_conv and opts.maxpool in ("stride", "conv") and \
            not any(pc.action == "conv" for pc in p.pools):
        out.append(f"pool_conv={user.pool_conv!r} has no effect: no max-pool is replaced by a "
                   f"convolution (" + ", ".join(f"{pc.node}: {pc.action}" for pc in p.pools)
                   + ")")
    if not p.residuals:
        out += [f"{k}={getattr(user, k)!r} has no effect: the model has no residual join"
                for k in ("residual", "residual_scale") if getattr(user, k) != getattr(D, k)
                and not (k == "residual_scale" and opts.residual == "none")]
    elif user.residual_scale != D.residual_scale and opts.residual != "none" and \
            all(r.s is None for r in p.residuals):
        out.append(f"residual_scale={user.residual_scale!r} has no effect: no residual join gets "
                   f"a branch scale ({p.residuals[0].node}: {p.residuals[0].reason})")
    return out


def moot_init(user: Options, opts: Options, p: Plan) -> list[str]:
    """A note when ``init=`` (set by the user) draws no weight of the finished plan (the
    scheme's own draws included): ``reinit_weights=False`` or a scheme with its own draws."""
    if opts.init in (options_mod.DEFAULTS.init, "keep") or \
            any(pi.rule == opts.init for pi in p.inits.values()):
        return []
    by = ("reinit_weights=False keeps the weights (only a new layer, the convolution that "
          "replaces a max-pool, is drawn)" if not opts.reinit else
          f"scheme={opts.scheme!r} draws every weight its own way" if opts.scheme != "geometric"
          else "no weight of this model is drawn by the init rule")
    return [f"init={user.init!r} has no effect: {by}"]


#: the scales the back ends place with ``input_scale`` / ``output_scale``
IO_TAGS = ("input", "output")


def apply(st: State) -> None:
    """Carry the plan out on the back end: pools, the scheme's replacements, every scale, the
    input and output scales; then ``finish``.  A pool left as it was is recorded in
    ``st.measured`` (the plan stays as planned)."""
    be, p, g = st.backend, st.plan, st.graph
    be.pools(p)
    for node, why in be.pool_notes.items():
        st.measured.add("apply", "pool", node, "keep", note=why)
    st.scheme.model = st.result
    for node, mod, path in st.scheme.replacements(g, p):
        if be.replace(node, mod, path, all_calls=True):
            be.applied.append(f"{st.scheme.name}: {node} replaced by {mod}")
    weight_of = {lay.node: lay.weight for lay in p.layers}
    # a max-pool the back end kept as it was (a pool module called twice on the eager back
    # end): the convolution planned to replace it does not exist, so neither do its constants
    # (an alpha there would scale the pool's output, and measured balancing would look for
    # the missing convolution's weight)
    kept = {pc.node: pc.new_param for pc in p.pools
            if pc.node in be.pool_notes and pc.new_param}
    for sc in p.scales:
        if sc.tag in IO_TAGS:
            continue
        if sc.node in kept and weight_of.get(sc.node) == kept[sc.node]:
            be.skipped.append((f"{sc.tag} {sc.node}", f"not placed: max-pool {sc.node} was "
                               f"kept ({be.pool_notes[sc.node]}), so the convolution this "
                               f"constant scales ({kept[sc.node]}) was not created"))
            continue
        name = be.scale(sc)
        if name is None:
            continue
        st.constants[name] = sc.value
        if sc.tag == "alpha" and weight_of.get(sc.node):
            st.alpha_buffers.setdefault(weight_of[sc.node], []).append(name)
            st.site_buffers[sc.node] = name
        elif sc.tag == "lr" and weight_of.get(sc.node):
            st.lr_buffers.setdefault(weight_of[sc.node], []).append(name)
    inp = p.scale("input")
    if inp is not None:
        st.constants.update({b: inp.value for b in be.input_scale(inp.value) or []})
        normed = normalized_before_first_layer(g, p)
        if normed:
            be.skipped.append(("input scale", f"normalization {normed} sits between the input "
                               f"and the first weighted layer and undoes the input scale "
                               f"(Sec. 6.3 has no effect here)"))
    if p.scale("output") is not None:
        st.out_const = be.output_scale(st.main_path)
        if st.out_const is not None:
            st.constants[st.out_const] = 1.0
    be.finish()


def reinitialize(st: State) -> None:
    """Re-initialize from the plan (always: with ``reinit=False`` the plan holds 'scale'
    rules, weights divided by their alpha); the report starts here."""
    st.backend.reinit(st.plan, st.opts.seed)
    st.report = Report.from_graph(st.graph, st.plan)
    st.report.applied, st.report.skipped = st.backend.applied, st.backend.skipped
    st.report.skipped += [("option", why) for why in st.moot]
    st.report.input_scale = st.in_scale


def has_matches(st: State) -> bool:
    return any(pi.rule == "match" for pi in st.plan.inits.values())


def match_tokens(st: State) -> None:
    """Free token and position parameters (``core.tokens``): each drawn at the rms of its
    partner layer's output on the sample, measured now that the weights are re-drawn (the
    back end's ``reinit`` on these parameters alone: their own seeded stream).  Without data,
    or where the partner's output cannot be probed, the parameter is left as is, with why."""
    pis = {k: pi for k, pi in st.plan.inits.items() if pi.rule == "match"}
    rep = st.report
    if not st.data:
        for k in pis:
            rep.skipped.append((f"init {k}", f"left as is: {st.no_data} (a token's std is "
                                             f"measured on data: distributed.calibrate draws "
                                             f"it once the model holds data, after reinit)"))
        return
    got = st.backend.probe_sample(st.sample, sorted({str(pi.match) for pi in pis.values()}),
                                  st.opts.calibration)
    sub = Plan(options=st.plan.options, aliases=dict(st.plan.aliases))
    for k, pi in pis.items():
        r = tokens.rms(got.get(str(pi.match)))
        if r is None or not math.isfinite(r) or r <= 0:
            rep.skipped.append((f"init {k}", f"left as is: the output of {pi.match} could not "
                                             f"be measured on this back end "
                                             f"({'no value' if r is None else f'rms {r}'})"))
            continue
        gain = st.graph.gains.get(k, 1.0) if st.graph is not None else 1.0
        sub.inits[k] = dataclasses.replace(pi, std=r / abs(gain))      # core.plan.divide_gains
        st.measured.add("match", "std", k, r,
                        reason=f"rms of {pi.match}'s output on the calibration batch")
    if sub.inits:
        st.backend.reinit(sub, st.opts.seed)


def has_scheme_step(st: State) -> bool:
    return type(st.scheme).calibrate is not Scheme.calibrate


def scheme_step(st: State) -> None:
    """The scheme's data-driven step (LSUV's layer-sequential scaling, TAT's checks)."""
    sch = st.scheme
    ctx = SchemeContext(st.result, st.sample, st.graph, st.plan, st.backend, st.opts,
                        st.opts.calibration, st.site_buffers, st.say, measured=st.measured)
    st.report.conditioning[sch.name] = sch.calibrate(ctx)


def calibrates(st: State) -> bool:
    """The plan has an output scale and the back end placed its constant."""
    return st.opts.target_std is not None and st.out_const is not None


#: draws a random forward's output std is averaged over (``calibrate``)
RANDOM_DRAWS = 8


def output_std(st: State) -> tuple[float, list[float]]:
    """The main output's std on the sample, random ops seeded from ``seed``.  A forward that
    draws random numbers (inline stochastic depth, noise) is measured over
    :data:`RANDOM_DRAWS` seeded draws: the root mean square of their stds, and each draw's
    (an empty list for a deterministic forward)."""
    be, opts = st.backend, st.opts
    std, random = be.seeded_output_std(st.sample, opts.calibration, opts.output_key, opts.seed)
    if not random:
        return std, []
    stds = [std]
    for i in range(1, RANDOM_DRAWS):
        stds.append(be.seeded_output_std(st.sample, opts.calibration, opts.output_key,
                                         (opts.seed + i) % (2 ** 63))[0])
    return math.sqrt(sum(x * x for x in stds) / len(stds)), stds


#: extra measure-and-rescale rounds when the main output is not linear in its scale
REFINE_ROUNDS = 3


def _off_target(after: float, opts: Any) -> bool:
    """The measured std after scaling misses the target by more than 1e-3 (relative), and
    is a usable number."""
    return math.isfinite(after) and after > 0 and \
        abs(after - opts.target_std) > 1e-3 * opts.target_std


def calibrate(st: State) -> None:
    """The output scale: the main output's std on the sample brought to ``target_std`` (for a
    random forward, its root-mean-square std over seeded draws, :func:`output_std`).  The back
    end measures the std (over every rank's batch on a sharded model); a model that cannot run
    on data (``st.no_data``: the meta device) keeps the scale 1, with why."""
    be, opts, rep = st.backend, st.opts, st.report
    if not st.data:
        rep.skipped.append(("output scale", st.no_data))
        return
    std, draws = output_std(st)
    rms = st.input_rms * st.in_scale if st.input_rms is not None and st.in_scale else \
        st.input_rms       # the inputs as the model sees them (after the input scale)
    scale = cal.solve_output_scale(std, opts.target_std, reinit=opts.reinit, input_rms=rms,
                                   floor=getattr(be, "output_floor", 0.0))
    if getattr(be, "same_rows", False):
        same = ("the main output is the same for every sample of the calibration batch (to "
                "rounding): it does not depend on the inputs, or the batch repeats one input; "
                "the output scale is set from the spread of its entries alone. Check that "
                "forward reads its inputs, and calibrate on varied inputs")
        rep.skipped.append(("note: constant output", same))
    warn = cal.scale_warning(std, scale, rms, opts.target_std)
    if warn:
        warnings.warn(f"precondfx: {warn}", RuntimeWarning, stacklevel=2)
        rep.skipped.append(("warning: output scale", warn))
    be.set_constant(st.out_const, scale)
    after = output_std(st)[0] if be.rerun_after_scale else std * scale
    rounds = 0
    while be.rerun_after_scale and rounds < REFINE_ROUNDS and _off_target(after, opts):
        # the main output is not linear in the scale (a Categorical normalizes its logits):
        # a secant step on the measured std, kept only if it comes closer
        trial = scale * opts.target_std / after
        be.set_constant(st.out_const, trial)
        got = output_std(st)[0]
        rounds += 1
        if not abs(got - opts.target_std) < abs(after - opts.target_std):
            be.set_constant(st.out_const, scale)
            break
        scale, after = trial, got
    masked = getattr(be, "masked_entries", 0)
    if masked:
        rep.skipped.append(("note: masked output",
                            cal.masked_note(masked, getattr(be, "output_size", None))))
    rep.output_std_before, rep.output_std_after = std, after
    rep.target_std, rep.output_scale = opts.target_std, scale
    why = f"output std {std:.4g} -> {opts.target_std}"
    if rounds:
        why += (f" (refined in {rounds} more measurement(s): the main output is not linear "
                f"in the scale, e.g. a distribution's normalized logits)")
    if draws:
        st.random_draws = len(draws)
        why += (f" (the forward draws random numbers: root mean square over {len(draws)} "
                f"draws seeded from seed={opts.seed}, per draw {min(draws):.4g}.."
                f"{max(draws):.4g})")
        rep.skipped.append(("note: random forward", why))
    st.measured.add("calibrate", "scale", OUTPUT, scale, reason=why)


def record(st: State) -> None:
    """The report's plans: ``planned`` (the intent), ``measured`` (what the stages set after
    applying it) and ``plan``, the two together: the values the model holds."""
    st.report.planned, st.report.measured = st.plan, st.measured
    st.report.plan = st.measured.final(st.plan)


#: the key of the planned output scale (``backend.key_of``)
OUTPUT = "output:output:output:0"


# -- rules the stages use ----------------------------------------------------------------------
def normalized_before_first_layer(g: Graph, plan: Plan) -> str | None:
    """A normalization node on the path from the inputs to the first weighted layer, if any."""
    first = next((lay for lay in plan.layers if lay.kind != "embedding"), None)
    if first is None:
        return None
    anc = g.upstream_of(first.node)
    return next((a for a in anc if g[a].kind == "normalization"), None)


def input_scale(opts: Options, plan: Plan, inputs: list[Any]) -> float | None:
    """Sec. 6.3: scale inputs so E[x0^2] = 1/sqrt(n_in k^2) of the first layer ('auto'), from
    the floating-point inputs (numpy arrays; additive masks left out)."""
    if opts.input_scale is None:
        return None
    if opts.input_scale != "auto":
        return float(opts.input_scale)
    first = next((lay for lay in plan.layers if lay.kind != "embedding"), None)
    m2 = cal.input_second_moment(inputs)
    if first is None or m2 is None:
        raise PrecondError("input_scale='auto' needs a floating-point input and a weighted layer "
                           "reading it; pass a number instead")
    target = 1.0 / math.sqrt(first.n_in * first.k2)
    if m2 <= 0:
        raise PrecondError("input_scale='auto': the inputs are all zero")
    return math.sqrt(target / m2)


#: the stages every back end runs, in order, between its own (see the module docstring)
PLAN = Stage("plan", plan, requires=("graph",), ensures=("plan",))
APPLY = Stage("apply", apply, "applying the plan", requires=("plan", "backend"))
REINIT = Stage("reinit", reinitialize, lambda st: "re-initializing parameters" if st.opts.reinit
               else "rescaling weights for alpha", requires=("plan", "backend"),
               ensures=("report",))
MATCH = Stage("match", match_tokens, "drawing token and position parameters at their "
              "partner's scale", when=has_matches, requires=("report", "plan"))
SCHEME = Stage("scheme", scheme_step, lambda st: f"scheme {st.scheme.name}: data-driven step",
               when=has_scheme_step, requires=("report",))
CALIBRATE = Stage("calibrate", calibrate, lambda st: "calibrating the output scale" if st.data
                  else "output scale left at 1 (no data)", when=calibrates,
                  requires=("report", "out_const"))
RECORD = Stage("record", record, requires=("report", "plan"))
