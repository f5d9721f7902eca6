"""``lr='auto'`` (the default): a ceiling on the SGD rate, set at the optimizer's first step.

precondfx changes the weights' stored scale, and under SGD the best learning rate moves with it
(``c^2`` for a factor ``c`` on a layer's stored weight): at the SGD rate tuned for the
framework's init the rewritten BERT and tiny ViT of the suite diverged
(docs/results/heldout_cpu.md, seventh round).  What predicts the rate the result tolerates is
its curvature: the suggested SGD rate ``1 / lambda``
(:mod:`precondfx.pytorch.measure.suggest`).  The default reads your rate from the optimizer:

* at precondition, every re-drawn layer gets an ``lr`` multiplier (1) and a copy of the
  calibration batch is kept with the result;
* at the first ``step()`` of a ``torch.optim.SGD`` holding the result's layers, before the
  update, the suggested SGD rate of the parameters it steps is measured on that batch.  When
  the optimizer's peak rate (the largest of a ``OneCycleLR``'s or ``CyclicLR``'s ``max_lr``,
  ``initial_lr`` where a scheduler set one, and ``lr``; each layer's own parameter group:
  groups at different rates are set one by one, each by the curvature of the parameters it
  steps, the report's ``groups``; biases in a group at a higher rate than their weights' raise
  it by as much as their own curvature does not take) is above the ceiling, the layers' stored
  weights and biases are divided by one factor ``c < 1`` and the multipliers multiplied by it
  (the same function), as ``lr=`` does (:mod:`precondfx.pytorch.lr_target`), so that the
  layers' effective rate is the ceiling; the gradients already computed are multiplied by
  ``c`` too (the gradient of the new storage), so this and every later step is the step that
  storage takes.  The ceiling is half the largest rate the optimizer's own iteration
  tolerates on a quadratic of that curvature (:func:`headroom`): the suggested rate itself
  for plain SGD (its limit is ``2 / lambda``), 1.9 times it under momentum 0.9 (heavy ball's
  limit ``2 (1 + beta) / lambda``: at the suggested rate the ceiling held a width-512 MLP
  under momentum 0.9 about two octaves below its best rate, 0.071 against 0.054 without a
  ceiling; at 1.9x it gave 0.059, docs/results/heldout_cpu.md, nineteenth round).  At or
  below the ceiling nothing changes: the default only lowers a rate the model cannot take,
  and your rate keeps its meaning below that ceiling (a sweep still sweeps).  An optimizer
  holding some of the trainable layers acts on those: the first step of the one holding the
  others acts on theirs (two optimizers, in either order, or stepped k:1 as a GAN's); where
  no optimizer's parameter group holds them by that optimizer's second step (trainable
  layers nobody steps) their storage is kept, the report says so (``unheld``) and the kept
  batch is released.  The measurement runs with each module in its own mode at that step,
  dropout off, whatever the calibration mode (``model.eval()`` before the loop: fine-tuning
  with frozen BatchNorm statistics trains that function; a part put back in ``train()``
  under it trains with its batch statistics; ``calibration='eval'`` then a loop in train
  mode trains the train-mode function), with autocast off (a
  step inside a bfloat16 ``torch.autocast`` region measures the float32 function the
  storage holds), on the kept batch in the model's dtype, or in its first layer's where
  parts were cast apart (a bfloat16 body under a float32 head).  A rate raised by hand
  after the first step past both the rate the ceiling was decided at and the suggested one
  (a warm-up written in the loop, an LR finder) is said once, in a warning and the report
  (``raised``): call :func:`settle_rate` with the peak rate before the first step there;
  so is a later ``torch.optim.SGD`` over the same layers at a rate above it (a second phase
  of training with a new optimizer), while the result lives.
  Two things differ from ``lr=``:
  a gradient clipped before that step (``clip_grad_norm_``) was clipped at the old storage,
  so the first step is ``c`` times the clipped one where ``lr=`` clips ``c`` times the
  gradient (the later steps are ``lr=``'s); and the measurement runs the model's forward
  about 40 times per round, with the module hooks it holds (a hook that logs or accumulates
  sees those calls, as it sees precondition's own: a hook is part of the function, never
  skipped);
* an optimizer of another family (Adam, AdamW: precondfx's storage already keeps the rate
  tuned for the framework's init there, heldout_cpu.md), resumed optimizer state, weights
  changed since precondition (a checkpoint loaded), several processes (each would measure its
  own factor) or a failed measurement keep the storage, and the report says which;
* deep copies of the stepped model made before that step (an EMA or ``AveragedModel``
  copy), and copies the stepping optimizer holds, share the pending step: they get the same
  factor at the same time, so that copies and the model keep one storage, and their gradients
  already computed are rescaled with them.  The model a run was copied from and its other
  copies (a template copied per run: ``run = copy.deepcopy(template)``) keep a pending step
  of their own: each run's first step sets its storage for its own rate, as a fresh result's
  would (a sweep over copies sweeps; before, the first run's rate decided every later run's
  storage).  The report's ``lr_target`` section is the result's own first step's (and
  its copies' that follow it), or the first copy's until the result steps; each copy
  trained apart has its own section, listed in ``conditioning['lr_target_copies']`` in
  the order of their first steps (its changes stay out of the result's
  ``report.plan``).  A pickled copy
  (``torch.save(model)``) holds none, and pickling says so;
* gradient accumulation: the rate read is the optimizer's ``lr``, never ``k * lr``.  A loop
  summing ``k`` micro-batches' gradients before each step without dividing the loss by ``k``
  steps ``k`` times the mean gradient: the ceiling leaves the optimizer at ``min(lr, s)``
  (``s`` the suggested rate) and the loop trains at ``k * min(lr, s)``, up to ``k`` times the
  suggested rate: divide the loss by ``k`` (the usual form, the rate keeps its meaning), or
  call :func:`settle_rate` with ``k * lr`` before the first step.  The report says it
  (``rate_read``): the optimizer cannot show how many micro-batches a step sums.

A training loop that does not step a ``torch.optim`` optimizer calls :func:`settle_rate`
(``precondfx.settle_rate``) with its rate instead.  The kept batch is released at that first
step.  ``lr=None`` turns it off: the storage is then the one ``lr_scale`` chose, whatever the
optimizer.
"""
from __future__ import annotations

import contextlib
import copy
import gc
import logging
import math
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from precondfx.errors import PrecondError
from precondfx.pytorch import lr_target, lr_transfer
from precondfx.pytorch.calibrate import OWN

log = logging.getLogger("precondfx")

#: the attribute of the result (and of its deep copies) holding what is pending
ATTR = "_precondfx_first_step"
#: relative change of a weight's rms taken as "changed since precondition" (a checkpoint
#: loaded): above a cast to float16's rounding, far below any factor lr= applies; the
#: weight's dtype's eps where larger (bfloat16: a layer of 6 weights moved by 1.2e-3)
CHANGED = 1e-3

_PENDING: "weakref.WeakSet[Pending]" = weakref.WeakSet()
_NOT_MINE: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
#: results whose first step decided the ceiling (while they live, a later SGD over their
#: layers at a rate above it is said: :func:`_check_later`), and the optimizers checked
_DECIDED: "weakref.WeakSet[Pending]" = weakref.WeakSet()
_SEEN: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_HANDLE: Any = None


def _disarmed() -> None:
    """What a pickled result holds in place of its pending step (a loaded copy has none)."""
    return None


class Pending:
    """The first-step factor of one result and its deep copies (shared by all of them)."""

    def __init__(self, model: nn.Module, graph: Any, report: Any,
                 lr_buffers: dict[str, list[str]], sample: Any, key: Any, seed: int,
                 added: tuple[str, ...] = ()) -> None:
        self.models = [weakref.ref(model)]
        self.parents: list[int | None] = [None]     # the index of the model each was copied from
        self.graph, self.report = graph, report
        #: the result ``precondition`` returned, and its report: the report's own section is
        #: the result's (and its copies' that follow it); copies trained apart (one per run)
        #: each get a report of their own, their sections listed in ``lr_target_copies``
        self.result, self.main = weakref.ref(model), report
        self.slot: int | None = None
        self.last: dict[str, Any] | None = None     # the section it recorded last
        self.lr_buffers = lr_buffers
        self.sample, self.key, self.seed = sample, key, seed
        self.rms = {w: lr_transfer.stored_rms(model.get_parameter(w)) for w in lr_buffers}
        self.earlier: list[str] = []    # what the first steps of optimizers over parts did
        #: the parameters precondition added (a max-pool's replacement convolution)
        self.added = tuple(added)
        #: optimizers whose first step acted on some of the layers, the others left pending
        self.fired: "weakref.WeakSet[Any]" = weakref.WeakSet()
        #: the rate up to which the decided storage holds, and the optimizers that decided it
        self.limit: float | None = None
        self.deciders: "weakref.WeakSet[Any]" = weakref.WeakSet()

    # -- copies share it; a pickled or saved copy holds nothing pending --------------------
    def __deepcopy__(self, memo: dict) -> "Pending":
        for i, r in enumerate(list(self.models)):
            m = r()
            if m is not None and id(m) in memo:
                self.models.append(weakref.ref(memo[id(m)]))
                self.parents.append(i)
        return self

    def split(self, model: nn.Module, held: set[int]) -> None:
        """Before ``model``'s first step: the models this one was copied from and their other
        copies (a template copied per run, runs copied up front), which the stepping optimizer
        does not hold, get a pending step of their own (their own optimizer's first step sets
        their storage for its rate); ``model``, its own copies (an EMA, an AveragedModel) and
        the models the optimizer holds follow this step."""
        idx = next((i for i, r in enumerate(self.models) if r() is model), None)
        if idx is None:
            return
        keep = {idx}
        for i, par in enumerate(self.parents):      # copies come after what they copy
            if par in keep:
                keep.add(i)
        out = [i for i, r in enumerate(self.models) if i not in keep for m in [r()]
               if m is not None and not any(id(_param(m, w)) in held for w in self.lr_buffers)]
        if not out:
            return
        other = Pending.__new__(Pending)
        other.__dict__.update(self.__dict__)
        first = self.models[out[0]]()
        other.models = [self.models[i] for i in out]
        other.parents = [out.index(self.parents[i]) if self.parents[i] in out else None
                         for i in out]
        other.lr_buffers = dict(self.lr_buffers)
        other.rms = {w: lr_transfer.stored_rms(first.get_parameter(w)) for w in other.lr_buffers}
        other.earlier, other.fired = [], weakref.WeakSet()
        other.limit, other.deciders = None, weakref.WeakSet()
        for i in out:
            m = self.models[i]()
            if m is not None and m.__dict__.get(ATTR) is self:
                m.__dict__[ATTR] = other
        left = [i for i in range(len(self.models)) if i not in out]
        self.parents = [left.index(self.parents[i]) if self.parents[i] in left else None
                        for i in left]
        self.models = [self.models[i] for i in left]
        # the side holding the result keeps its report; each other side gets its own
        if other._holds_result():
            other.report, other.slot, other.last = other.main, None, None
            if self.report is self.main:
                self._own_report()
        else:
            other._own_report()
        _PENDING.add(other)
        _NOT_MINE.clear()

    def _holds_result(self) -> bool:
        res = self.result()
        return res is not None and any(r() is res for r in self.models)

    def _own_report(self) -> None:
        """A report of its own for the models this pending step holds apart from the result
        (runs copied from it): their first step's changes are theirs, not the result's (before:
        one run's factor went into the result's report.plan, and the latest run's section
        replaced the result's)."""
        own = copy.copy(self.main)
        own.measured = copy.deepcopy(self.main.measured)
        own.conditioning = dict(self.main.conditioning)
        self.report, self.slot, self.last = own, None, None

    def record(self, sec: dict[str, Any]) -> None:
        """``sec`` as this pending step's report section: the result's report's
        ``lr_target``; for copies trained apart (one per run) their own entry of its
        ``lr_target_copies`` (in the order of their first steps), and its ``lr_target`` until
        the result itself steps (an ensemble of copies, the result never trained)."""
        prev, self.last = self.last, sec
        self.report.conditioning["lr_target"] = sec
        if self.report is self.main:
            return
        entries = self.main.conditioning.setdefault("lr_target_copies", [])
        if self.slot is None:
            self.slot = len(entries)
            entries.append(sec)
        else:
            entries[self.slot] = sec
        sec["copy"] = self.slot + 1
        cur = self.main.conditioning.get("lr_target")
        if not isinstance(cur, dict) or cur.get("pending") or cur is prev:
            self.main.conditioning["lr_target"] = sec

    def __copy__(self) -> "Pending":
        return self

    def __reduce__(self) -> tuple:
        if self in _PENDING:        # the loaded copy keeps this storage at any rate: said
            warnings.warn("precondfx: a result whose lr='auto' first step is pending is "
                          "pickled (torch.save(model), a worker process): the copy loaded "
                          "from it holds no pending step and keeps this storage at any SGD "
                          "rate; call precondfx.settle_rate(model, lr) before saving, or pass "
                          "lr= and optimizer='sgd' to precondition (state_dict() saves "
                          "without this: load it into the same rewrite)",
                          RuntimeWarning, stacklevel=2)
        return (_disarmed, ())

    # -- the optimizer's first step --------------------------------------------------------
    def held_by(self, ids: set[int]) -> nn.Module | None:
        """The model (the result or a copy) whose layer weights ``ids`` holds, if any."""
        for r in self.models:
            m = r()
            if m is not None and any(id(_param(m, w)) in ids for w in self.lr_buffers):
                return m
        return None

    def consume(self) -> None:
        """Nothing is pending any more: the hook stops looking, the kept batch is released."""
        _PENDING.discard(self)
        self.sample = None

    def fire(self, opt: torch.optim.Optimizer, model: nn.Module, held: set[int]) -> None:
        """Set the storage for ``opt``'s rate (see the module docstring), once; ``held``: the
        ids of the parameters ``opt`` holds."""
        rest: dict[str, list[str]] = {}
        self.split(model, held)
        try:
            sec = self._fire(opt, model, held)
            if "rest" in sec:           # the other layers wait for their own optimizer
                rest = sec.pop("rest")
        except Exception as e:          # never break the user's step: say it, keep the storage
            sec = self._kept(opt, f"the measurement failed ({type(e).__name__}: {e}); the "
                                  f"storage stays as precondition left it: pass lr= (your "
                                  f"rate) and optimizer='sgd' to precondition to set it "
                                  f"there{_dtypes_said(model, self.graph)}",
                             warn=True)
        finally:
            if rest:
                self.lr_buffers = rest
            else:
                self.consume()
        if self.earlier:
            sec["earlier"] = list(self.earlier)
        _unstepped(self, model, held, sec)
        if rest:
            self.earlier.append(sec["summary"])
            self.fired.add(opt)
        self.record(sec)

    def unheld(self, opt: torch.optim.Optimizer) -> None:
        """``opt``, whose first step left the other layers pending, steps again before any
        optimizer stepped those.  Where no optimizer's parameter group holds them (trainable
        layers nobody steps, or an optimizer yet to be created) their storage is kept, said in
        the report, and the kept batch released (it would otherwise live as long as the
        model); where one does (stepped less often), they stay pending."""
        self.fired.discard(opt)     # asked once per optimizer
        left = list(self.lr_buffers)
        if _in_a_param_group([_param(m, w) for r in self.models for m in [r()] if m is not None
                              for w in left]):
            return      # an optimizer holds them, yet to step (a GAN's, stepped k:1): pending
        why = (f"{len(left)} trainable layers (e.g. {left[0]}) were stepped by no optimizer "
               f"before {type(opt).__name__} stepped again: their storage is kept and the "
               f"kept calibration batch released (an optimizer created for them later "
               f"trains this storage: pass lr= and optimizer='sgd' to precondition to set it "
               f"for its rate)")
        log.info("precondfx: lr='auto': %s", why)
        self.consume()
        sec = self.report.conditioning.get("lr_target")
        if isinstance(sec, dict):
            sec["unheld"] = why
            sec["summary"] = f"{sec['summary']}; {why}"

    def _fire(self, opt: torch.optim.Optimizer, model: nn.Module, held: set[int]
              ) -> dict[str, Any]:
        weights = [w for w in self.lr_buffers if id(_param(model, w)) in held]
        name = type(opt).__name__
        if not isinstance(opt, torch.optim.SGD):
            sec = self._kept(opt, _not_sgd(opt))
            return self._rest(model, weights, sec)
        if torch.distributed.is_available() and torch.distributed.is_initialized() and \
                torch.distributed.get_world_size() > 1:
            return self._kept(opt, "several processes train this model and each would measure "
                                   "its own factor: pass lr= and optimizer='sgd' to "
                                   "precondition (the same factor on every rank)", warn=True)
        if any(opt.state.get(_param(model, w)) for w in weights):
            return self._kept(opt, "the optimizer has state already (resumed): the storage "
                                   "the checkpoint holds is kept")
        moved = [w for w in weights if _changed(self.rms[w], _param(model, w))]
        if moved:
            return self._kept(opt, f"{len(moved)} weights changed since precondition (e.g. "
                                   f"{moved[0]}: a checkpoint loaded?): their storage is kept")
        missing = [b for w in weights for b in self.lr_buffers[w] if not _has_buffer(model, b)]
        if missing:
            return self._kept(opt, f"the model no longer holds its lr multipliers ({missing[0]}"
                                   f"; folded?): the storage is kept")
        parts = _by_group(opt, model, weights)
        # a layer's bias in a group of its own at a higher rate (Caffe's 2x, no decay at a
        # rate of its own) trains at that rate under the layer's one factor: the peak of both
        bias_of = {lay.weight: lay.bias for lay in self.report.measured.final(
            self.report.planned).layers if lay.weight and lay.bias}
        rates = [self._with_biases(opt, model, g, ws, bias_of) for g, ws in parts]
        # a group at rate 0 beside groups at positive rates (layers frozen by their rate):
        # its layers do not move, their storage is kept, said in the report
        still = [ws for (_, ws), r in zip(parts, rates) if r == 0] \
            if any(r > 0 for r in rates) else []
        parts, rates = zip(*[(p, r) for p, r in zip(parts, rates) if r != 0 or not still])
        bad = [r for r in rates if not (r > 0 and math.isfinite(r))]
        if bad:
            return self._kept(opt, f"its rate {bad[0]!r} is not a positive number (a warm-up "
                                   f"set by hand?): the rate you train at is not known here: "
                                   f"call precondfx.settle_rate(model, peak_lr) before the "
                                   f"first step, let a torch.optim.lr_scheduler do the warm-up "
                                   f"(its initial_lr is read), or pass lr= and "
                                   f"optimizer='sgd' to precondition", warn=True)
        if len(set(rates)) == 1:        # one rate: the curvature of all it steps bounds it
            ids = {id(p) for g, _ in parts for p in g["params"]} if still else held
            steps = {n for n, p in model.named_parameters() if id(p) in ids}
            room = min(headroom(g) for g, _ in parts)
            sec = self.set(model, [w for _, ws in parts for w in ws], rates[0], name, steps,
                           room)
            _watch(opt, self, parts[0][0], rates[0], sec)
            return self._rest(model, weights, _still(sec, still))
        # groups at different rates (a head at a higher rate than the body): each group's
        # layers are set for that group's rate, by the curvature of the parameters it steps
        # (the function is unchanged by one group's factor, so the order does not matter)
        secs = []
        for (group, ws), lr in sorted(zip(parts, rates), key=lambda t: -t[1]):
            ids = {id(p) for p in group["params"]} | {id(_param(model, bias_of[w]))
                                                      for w in ws if bias_of.get(w)}
            steps = {n for n, p in model.named_parameters() if id(p) in ids}
            one = self.set(model, ws, lr, name, steps, headroom(group))
            _watch(opt, self, group, lr, one)
            one["group"] = opt.param_groups.index(group)
            secs.append(one)
        sec = _joined(secs)
        return self._rest(model, weights, _still(sec, still))

    def _with_biases(self, opt: torch.optim.Optimizer, model: nn.Module, group: dict,
                     ws: list[str], bias_of: dict[str, str]) -> float:
        """The peak rate of ``group`` (holding the layers ``ws``), raised where their biases
        sit in a group at a higher rate (Caffe's 2x, a no-decay group at a rate of its own):
        the layer's one factor moves the biases' effective rate with the weights', so the
        ceiling holds for both.  The biases' own curvature takes a higher rate than the
        layers' (suggested rates ``s_b``, ``s``): the rate the ceiling is set for is
        ``max(rate, bias rate * s / s_b)``, both measured on the kept batch."""
        rate = max(_peak(group), _cyclic_peak(opt, group))
        biases = [bias_of[w] for w in ws if bias_of.get(w)]
        top = max(_bias_rates(opt, model, biases, group), default=0.0)
        if not (rate >= 0 and math.isfinite(rate)) or top <= rate:
            return rate
        mine = {id(p) for p in group["params"]}
        names = {n for n, p in model.named_parameters() if id(p) in mine} | set(biases)
        s, s_b = self._suggested(model, names), self._suggested(model, set(biases))
        if not (s and s_b and math.isfinite(s) and math.isfinite(s_b)):
            return max(rate, top)       # not measured: the biases' rate, as it is
        return max(rate, top * s / s_b)

    def _suggested(self, model: nn.Module, only: set[str]) -> float | None:
        """The suggested SGD rate of ``model`` over the parameters ``only`` on the kept
        batch (each module in its own mode, autocast off, the user's random stream kept)."""
        from precondfx.pytorch.measure.suggest import suggest_lr
        sample = _on_device(self.sample, model, self.graph)
        devices = sorted({p.device.index or 0 for p in model.parameters()
                          if p.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices), torch.inference_mode(False), \
                _no_autocast(model):
            try:
                return suggest_lr(model, sample, mode=OWN, key=self.key, seed=self.seed,
                                  families=("sgd",), only=only, graph=self.graph).get("sgd")
            except ValueError:
                return None

    def _rest(self, model: nn.Module, weights: list[str], sec: dict[str, Any]
              ) -> dict[str, Any]:
        """``sec``, with the trainable layers the optimizer does not hold left pending
        (``rest``): the first step of the optimizer holding them sets theirs, so that two
        optimizers over parts of the model get the same storage in either order."""
        rest = {w: b for w, b in self.lr_buffers.items() if w not in weights and
                getattr(_param(model, w), "requires_grad", False)}
        if rest:
            sec["rest"] = rest
            sec["summary"] += (f" ({len(weights)} of the layers; the first step of an "
                               f"optimizer holding the other {len(rest)} sets theirs)")
        frozen = [w for w in self.lr_buffers if w not in weights and w not in rest]
        if frozen:          # frozen after precondition: unfrozen later, nothing lowers them
            sec["frozen"] = frozen
            sec["summary"] += (f"; {len(frozen)} layers frozen at this step (requires_grad="
                               f"False, e.g. {frozen[0]}) keep their storage: unfrozen later, "
                               f"they train it at your rate without the ceiling (call "
                               f"precondfx.settle_rate(model, lr) before freezing them, or "
                               f"pass lr= and optimizer='sgd' to precondition)")
        return sec

    def set(self, model: nn.Module, weights: list[str], lr: float, name: str = "SGD",
            steps: Any = None, room: float = 1.0) -> dict[str, Any]:
        """The ceiling for the SGD rate ``lr`` on ``weights`` of ``model`` (and its copies),
        the gradients already computed rescaled with them; the report section.  ``steps``:
        the names of the parameters the optimizer steps, whose curvature bounds its rate (a
        head fine-tuned alone, a second optimizer over the rest); None: all.  ``room``: the
        ceiling over the suggested rate (:func:`headroom` of the optimizer's momentum)."""
        from precondfx.pytorch.measure.suggest import suggest_lr
        sample = _on_device(self.sample, model, self.graph)
        # each module in the mode the loop trains it in (its flag now, dropout off), whatever
        # the calibration mode: a model the user put in eval() before the loop (fine-tuning
        # with frozen BatchNorm statistics) trains its eval-mode function, parts put back in
        # train() under it (a head's BatchNorm) their batch statistics, and a model
        # calibrated with calibration='eval' (a batch too small for batch statistics) but
        # trained in train mode its train-mode function
        mode = OWN
        bufs = {w: self.lr_buffers[w] for w in weights}
        now = self.report.measured.final(self.report.planned)
        edited = copy.deepcopy(now)
        devices = sorted({p.device.index or 0 for p in model.parameters()
                          if p.device.type == "cuda"})
        log.info("precondfx: lr='auto': measuring the suggested SGD rate on the kept batch at "
                 "the first step of %s (once; 50-190 training steps of the model on the CPU "
                 "benchmark, bench/first_step_cost.py; lr=None skips it)", name)
        # the user's random stream untouched; a step taken under inference_mode measured too,
        # one inside an autocast region in the model's own dtypes (the curvature of the
        # function the storage holds, not of its bfloat16 rounding)
        used: list[str] = []

        def measure(fam: str) -> float | None:
            def run(m: str) -> float | None:
                return suggest_lr(model, sample, mode=m, key=self.key, seed=self.seed,
                                  families=(fam,), only=steps, graph=self.graph).get(fam)
            if used:
                return run(used[0])
            try:
                return run(mode)
            except ValueError as e:     # a train-mode BatchNorm on a kept batch of one
                if not _one_sample(e):
                    raise
                used.append("eval")
                return run("eval")

        with torch.random.fork_rng(devices=devices), torch.inference_mode(False), \
                _no_autocast(model):
            sec = lr_target.keep_rate(model, self.graph, edited, bufs, lr, "sgd", measure,
                                      ceiling=True, headroom=room)
        if used:    # not the function the loop trains: said, with what measures that one
            sec["eval_mode"] = (f"the kept calibration batch holds one sample, on which a "
                                f"train-mode normalization layer cannot run: the suggested "
                                f"rate was measured in eval mode (running statistics) on "
                                f"that sample, not on the train-mode function (batch "
                                f"statistics) your loop trains, whose rate can be far from it "
                                f"(16x higher on a small BatchNorm MLP): for the ceiling of "
                                f"the function you train, precondition with a calibration "
                                f"batch of at least two samples (calibration='train'); "
                                f"lr=None keeps precondition's storage at your rate")
            sec["summary"] += f"; {sec['eval_mode']}"
            sec["warning"] = f"{sec['warning']}; " if sec.get("warning") else "lr=: "
            sec["warning"] += sec["eval_mode"]
        if sec.get("warning") and sec.get("rounds") == [] and not sec.get("suggested_before"):
            sec["warning"] += _dtypes_said(model, self.graph)   # not measured: what to do
        c = float(sec.get("factor", 1.0))
        ok, _ = lr_transfer.carried(bufs, edited, self.graph)
        if c != 1.0:
            bias_of = {lay.weight: lay.bias for lay in edited.layers if lay.weight and lay.bias}
            for r in self.models:           # copies keep the model's storage
                other = r()
                if other is not None and other is not model and \
                        all(_has_buffer(other, b) for w in ok for b in bufs[w]):
                    lr_transfer.store(other, copy.deepcopy(edited), ok, {w: c for w in ok},
                                      "lr='auto' (a copy)")
                    _scale_grads(other, ok, bias_of, c)   # a copy trained in the same loop
            _scale_grads(model, ok, bias_of, c)
        self.report.measured.record_diff("lr_target", now, edited)
        self.report.plan = self.report.measured.final(self.report.planned)
        sec["when"] = f"lr='auto': at the first step of {name} (peak rate {lr:.4g})"
        sec["rate_read"] = (f"the ceiling is for the rate the optimizer holds, {lr:.4g}, on "
                            f"the gradient a step sees: a loop summing k micro-batches' "
                            f"gradients without dividing the loss by k trains at k times the "
                            f"rate left here (divide the loss by k, or call "
                            f"precondfx.settle_rate(model, k * lr) before the first step)")
        sec["summary"] = f"{sec['when']}: {sec['summary']}; {sec['rate_read']}"
        log.info("precondfx: %s", sec["summary"])
        if sec.get("warning"):      # said as lr='auto''s, not as an lr= the user never passed
            sec["warning"] = sec["warning"].replace(
                "lr=: ", f"lr='auto' at the first step of {name} (rate {lr:.4g}): ", 1)
            warnings.warn(f"precondfx: {sec['warning']}", RuntimeWarning, stacklevel=4)
        return sec

    def _kept(self, opt: torch.optim.Optimizer, why: str, warn: bool = False
              ) -> dict[str, Any]:
        return self._kept_named(type(opt).__name__, why, warn)

    def _kept_named(self, name: str, why: str, warn: bool = False) -> dict[str, Any]:
        text = f"lr='auto': at the first step of {name} the storage was kept: {why}"
        log.info("precondfx: %s", text)
        if warn:
            warnings.warn(f"precondfx: {text}", RuntimeWarning, stacklevel=4)
        return {"lr": "auto", "optimizer": name, "factor": 1.0, "layers": 0,
                "rounds": [], "kept": why, "summary": text}


def _not_sgd(opt: torch.optim.Optimizer) -> str:
    """Why the first step of ``opt``, not an SGD, keeps the storage: an Adam-family one keeps
    the rate tuned for the framework's init (NAdam, RAdam, Adamax: a step that does not scale
    with the gradient either); another (LBFGS, RMSprop, Adagrad) has a rate that moves in its
    own way with the stored scale, and ``optimizer=`` refuses it."""
    from precondfx.core.options import optimizer_family
    name = type(opt).__name__
    try:
        optimizer_family("optimizer", opt)
    except ValueError:
        if "adam" in name.lower():      # NAdam, RAdam, Adamax: Adam's scale-free step
            return (f"{name} is not SGD: like Adam's, its step does not scale with the "
                    f"gradient, and the storage precondition chose is kept")
        return (f"{name} is neither SGD nor Adam-family: its rate moves in its own way with "
                f"the stored weight scale, so no ceiling is set for it (lr= and optimizer= "
                f"know SGD and Adam only): the storage precondition chose is kept")
    return (f"{name} is not SGD: under Adam-family optimizers the storage precondition chose "
            f"keeps the rate tuned for the framework's init (docs/results/heldout_cpu.md)")


def _unstepped(pend: Pending, model: nn.Module, held: set[int], sec: dict[str, Any]) -> None:
    """Say (a warning and ``sec['unstepped']``) the trainable parameters precondition added
    (the strided convolution replacing a max-pool called twice or through ``F.max_pool2d``:
    ``precondfx_*`` names) that neither the stepping optimizer nor any other parameter group
    holds: parameter groups built by name (``n.startswith("backbone.")``) leave them out, and
    they would never move from their initial values, silently."""
    ps = {n: p for n in pend.added for p in [_param(model, n)]
          if p is not None and p.requires_grad and id(p) not in held}
    if not ps or _in_a_param_group(list(ps.values())):
        return
    names = list(ps)
    text = (f"precondition added {len(names)} trainable parameters ({', '.join(names[:4])}"
            f"{' ...' if len(names) > 4 else ''}: e.g. the strided convolution replacing a "
            f"max-pool) that no optimizer's parameter group holds (groups built from parameter "
            f"names leave them out): they get gradients and never move. Add them (by these "
            f"names) to a group, build the optimizer from model.parameters(), "
            f"or precondition with maxpool='keep'")
    warnings.warn(f"precondfx: {text}", RuntimeWarning, stacklevel=4)
    sec["unstepped"] = text
    sec["summary"] = f"{sec['summary']}; {text}"


def _param(model: nn.Module, name: str) -> Any:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return None


def _one_sample(e: BaseException) -> bool:
    """Whether ``e`` is a train-mode normalization layer's refusal of a batch of one."""
    return "more than 1 value per channel" in str(e)


def _scale_grads(model: nn.Module, weights: Any, bias_of: dict[str, str], c: float) -> None:
    """The gradients already computed, of the weights and their biases: the gradient of the
    storage divided by ``c`` is ``c`` times the gradient of the old storage."""
    with torch.no_grad():
        for w in weights:
            for n in (w, bias_of.get(w)):
                p = _param(model, n) if n else None
                if p is not None and p.grad is not None:
                    p.grad.mul_(c)


def _in_a_param_group(params: list[Any]) -> bool:
    """Whether a parameter group (a dict whose ``params`` list holds one of ``params``: an
    optimizer's) exists: found among the referrers, as ``_cyclic_peak`` finds a scheduler
    (torch keeps no registry of optimizers); two passes over the heap, once per optimizer
    over part of a model."""
    ps = [p for p in params if p is not None]
    lists = [r for r in gc.get_referrers(*ps) if isinstance(r, list)] if ps else []
    if not lists:
        return False
    ids = {id(lst) for lst in lists}
    return any(isinstance(d, dict) and id(d.get("params")) in ids
               for d in gc.get_referrers(*lists))


def _has_buffer(model: nn.Module, name: str) -> bool:
    try:
        model.get_buffer(name)
        return True
    except AttributeError:
        return False


def _changed(rms: float, p: Any) -> bool:
    if p is None:
        return True
    now = lr_transfer.stored_rms(p)     # a cast's rounding moves a few weights' rms by up to
    tol = max(CHANGED, torch.finfo(p.dtype).eps) if p.is_floating_point() else CHANGED  # eps/2
    return abs(now - rms) > tol * max(rms, 1e-30)


def _bias_rates(opt: torch.optim.Optimizer, model: nn.Module, biases: list[Any],
                own: dict[str, Any]) -> list[float]:
    """The positive, finite peak rates of the parameter groups of ``opt`` other than ``own``
    (the weights' group) holding ``biases`` (names; None for a layer without one)."""
    ids = {id(p) for b in biases if b for p in [_param(model, b)] if p is not None}
    out = []
    for g in opt.param_groups if ids else ():
        if g is not own and any(id(p) in ids for p in g["params"]):
            r = max(_peak(g), _cyclic_peak(opt, g))
            if r > 0 and math.isfinite(r):
                out.append(r)
    return out


def _by_group(opt: torch.optim.Optimizer, model: nn.Module, weights: list[str]
              ) -> list[tuple[dict[str, Any], list[str]]]:
    """The parameter groups of ``opt`` holding some of ``weights``, each with those it holds
    (a layer's rate is its own group's), in the optimizer's order."""
    out = []
    for g in opt.param_groups:
        ids = {id(p) for p in g["params"]}
        ws = [w for w in weights if id(_param(model, w)) in ids]
        if ws:
            out.append((g, ws))
    return out


def _still(sec: dict[str, Any], still: list[list[str]]) -> dict[str, Any]:
    """``sec`` with the layers of parameter groups at rate 0 said (their storage kept)."""
    ws = [w for part in still for w in part]
    if ws:
        sec["still"] = ws
        sec["summary"] += (f"; {len(ws)} layers in parameter groups at rate 0 (e.g. {ws[0]}) "
                           f"keep their storage: given a rate later, they train it without "
                           f"the ceiling (call precondfx.settle_rate(model, lr) first there)")
    return sec


def _joined(secs: list[dict[str, Any]]) -> dict[str, Any]:
    """One report section for the first step of an optimizer whose parameter groups hold
    layers at different rates: each group's section under ``groups``, the highest rate's
    keys at the top, ``factor`` the smallest of the groups' factors."""
    sec = dict(secs[0])
    sec["groups"] = secs
    sec["factor"] = min(float(s.get("factor", 1.0)) for s in secs)
    sec["layers"] = sum(int(s.get("layers", 0)) for s in secs)
    sec["summary"] = "; ".join(f"group {s['group']} ({s['layers']} layers): {s['summary']}"
                               for s in secs)
    warned = [s["warning"] for s in secs if s.get("warning")]
    if warned:
        sec["warning"] = "; ".join(warned)
    else:
        sec.pop("warning", None)
    return sec


def _number(v: Any) -> float | None:
    """A parameter group's setting as a float (a Python number or a one-element tensor, the
    form a scheduler may store); None for anything else (a bool, a list, a string)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) or \
            isinstance(v, torch.Tensor) and v.numel() == 1:
        return float(v)
    return None


def headroom(group: dict[str, Any]) -> float:
    """How far above the suggested rate ``1 / lambda`` the ceiling sits for an SGD parameter
    group: half the largest rate that keeps its momentum iteration stable on a quadratic of
    curvature ``lambda`` (heavy ball ``2 (1 + beta) / lambda``, Nesterov
    ``2 (1 + beta) / ((1 + 2 beta) lambda)``; dampening ``d`` takes ``1 - d`` of each gradient,
    so the rate may be ``1 / (1 - d)`` higher), never below 1: plain SGD keeps its ceiling at
    ``1 / lambda``, half its own limit ``2 / lambda``; momentum 0.9 puts it 1.9x higher.  A
    ``OneCycleLR`` cycling the momentum reaches its peak rate at ``base_momentum``, the
    lowest.  A momentum that is not a number in [0, 1) gives 1."""
    beta = _number(group.get("momentum", 0.0))
    low = _number(group.get("base_momentum"))
    if beta is not None and low is not None:
        beta = min(beta, low)
    damp = _number(group.get("dampening", 0.0)) or 0.0
    if beta is None or not 0.0 <= beta < 1.0 or not 0.0 <= damp < 1.0:
        return 1.0
    if beta == 0.0:
        return 1.0                  # plain SGD: the gradient as it is, dampening unused
    room = (1.0 + beta) / (1.0 + 2.0 * beta) if group.get("nesterov") else 1.0 + beta
    return max(1.0, room / (1.0 - damp))


def _peak(group: dict[str, Any]) -> float:
    """The rate the user tuned: the largest of a scheduler's peak (OneCycleLR's ``max_lr``),
    its starting rate (``initial_lr``, before a warm-up lowered ``lr``) and ``lr`` (a rate set
    by hand above a scheduler's ``initial_lr`` before the first step is the rate that step
    takes: read as ``initial_lr`` alone, its ceiling was decided for 0.1 at lr=4 and the loss
    rose 0.94 -> 2.36); a value that is not finite first (said as not a positive number)."""
    rates = [r for r in (_number(group.get(k)) for k in ("max_lr", "initial_lr", "lr"))
             if r is not None]
    bad = [r for r in rates if not math.isfinite(r)]
    return bad[0] if bad else max(rates, default=float("nan"))


def _cyclic_peak(opt: torch.optim.Optimizer, group: dict[str, Any]) -> float:
    """The peak of a ``CyclicLR`` stepping ``opt``: it keeps ``max_lr`` on itself, not in the
    group (whose ``lr`` and ``initial_lr`` hold ``base_lr``), and the optimizer holds no
    reference to it: found among the optimizer's referrers (once, at the first step).  A
    scheduler whose ``__dict__`` was materialized (``state_dict()``) is referred to by that
    dict.  0 where none is found."""
    idx = next((i for i, g in enumerate(opt.param_groups) if g is group), None)
    peaks = []
    for r in gc.get_referrers(opt):
        d = r.__dict__ if isinstance(r, torch.optim.lr_scheduler.CyclicLR) else r
        if isinstance(d, dict) and d.get("optimizer") is opt and idx is not None and \
                "step_ratio" in d and isinstance(d.get("max_lrs"), (list, tuple)) and \
                len(d["max_lrs"]) > idx:
            peaks.append(_peak({"lr": d["max_lrs"][idx]}))
    return max([p for p in peaks if math.isfinite(p)], default=0.0)


@contextlib.contextmanager
def _no_autocast(model: nn.Module) -> Any:
    """Autocast off on the CPU and on the devices of ``model``'s parameters, where it is on
    (a first step taken inside the user's ``torch.autocast`` region)."""
    kinds = {"cpu"} | {p.device.type for p in model.parameters()}
    with contextlib.ExitStack() as stack:
        for k in sorted(kinds):
            if _autocast_on(k):
                stack.enter_context(torch.autocast(k, enabled=False))
        yield


def _autocast_on(kind: str) -> bool:
    try:
        return torch.is_autocast_enabled(kind)
    except (RuntimeError, TypeError, ValueError):     # a device type autocast does not know
        return False


def _on_device(sample: Any, model: nn.Module, graph: Any = None) -> Any:
    """The kept batch on the device of the model's parameters, its floating-point tensors in
    their dtype where all of them share one (the model was moved or cast after precondition:
    ``.cuda()``, ``.double()``, ``.half()``), else in the dtype of the first layer the inputs
    reach in ``graph`` (a bfloat16 body under a float32 head: ``_first_dtype``).  A tensor
    whose finite values the cast would make infinite stays in its dtype: an additive
    attention mask's -1e9 is -inf in float16 (NaN on rows masked whole, the rate not
    measured), and a forward that takes your float32 mask adds it in float32 (a softmax
    computed in float32)."""
    from precondfx.pytorch.pipeline import float_dtype     # pipeline imports this module
    params = list(model.parameters())
    if not params:
        return sample
    dev = params[0].device
    dt = float_dtype(model) or _first_dtype(model, graph)

    def keeps_dtype(t: torch.Tensor) -> bool:
        return dt is None or not t.is_floating_point() or t.dtype == dt or _overflows(t, dt)

    if all(t.device == dev and keeps_dtype(t) for t in sample.tensors()):
        return sample
    return sample.map(lambda t: t.to(dev) if keeps_dtype(t) else t.to(dev, dtype=dt))


def _overflows(t: torch.Tensor, dt: torch.dtype) -> bool:
    """Whether casting the floating-point ``t`` to ``dt`` turns a finite value infinite."""
    if t.is_complex() or not dt.is_floating_point or dt.is_complex or \
            torch.finfo(dt).max >= torch.finfo(t.dtype).max:
        return False
    finite = t[torch.isfinite(t)]
    return finite.numel() > 0 and bool(finite.abs().max() > torch.finfo(dt).max)


def _first_dtype(model: nn.Module, graph: Any) -> torch.dtype | None:
    """The dtype of the first floating-point parameter read by a node that the model's inputs
    reach, in ``graph``'s order; None where there is none (or no graph)."""
    if graph is None:
        return None
    reached: set[str] = set()
    for n in graph:
        if n.kind == "input":
            reached.add(n.name)
            continue
        if not any(i in reached for i in n.inputs):
            continue
        reached.add(n.name)
        for name in n.params.values():
            p = _param(model, name)
            if p is not None and p.is_floating_point():
                return p.dtype
    return None


def _dtypes_said(model: nn.Module, graph: Any) -> str:
    """What a failed measurement's message adds on a model whose parameters hold several
    floating-point dtypes (parts cast after precondition): the dtypes, the batch's."""
    dts = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()
                  if p.is_floating_point()})
    if len(dts) < 2:
        return ""
    first = _first_dtype(model, graph)
    given = (f"was cast to {str(first).replace('torch.', '')}, the dtype of the first layer "
             f"it reaches" if first is not None else "was left in its dtype")
    return (f"; the model's parameters hold {len(dts)} dtypes ({', '.join(dts)}) and the kept "
            f"calibration batch {given}: call precondfx.settle_rate(model, lr) before casting "
            f"parts of the model, or pass lr= and optimizer='sgd' to precondition")


def _pre_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The global step pre-hook: fire what the stepping optimizer holds; cheap for the others
    (an optimizer found holding nothing pending is remembered until its parameters change)."""
    if _PENDING:
        _fire_pending(opt)
    if _DECIDED:
        _check_later(opt)
    if not _PENDING and not _DECIDED:   # every result fired and was collected
        _release_after(opt)
    return None


def _fire_pending(opt: torch.optim.Optimizer) -> None:
    """Fire what ``opt`` holds of the pending results (:func:`_pre_step`)."""
    for pend in list(_PENDING):     # a second step of an optimizer that left layers pending
        if opt in pend.fired:
            pend.unheld(opt)
    count = sum(len(g["params"]) for g in opt.param_groups)
    if _NOT_MINE.get(opt) == count:
        return
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    hit = False
    for pend in list(_PENDING):
        m = pend.held_by(ids)
        if m is not None:
            hit = True
            pend.fire(opt, m, ids)
    if not hit:
        _NOT_MINE[opt] = count


def _watch(opt: torch.optim.Optimizer, pend: Pending, group: dict[str, Any], lr: float,
           sec: dict[str, Any]) -> None:
    """Watch ``opt``'s rate after its first step decided the ceiling at ``lr`` (a step
    pre-hook of ``opt`` alone, :class:`_RateWatch`): the decision holds up to the larger of
    ``lr`` and the suggested rate it left (within ``lr_target``'s tolerance)."""
    after = sec.get("ceiling", sec.get("suggested_after"))
    idx = next((i for i, g in enumerate(opt.param_groups) if g is group), None)
    if idx is None or not isinstance(after, float) or not math.isfinite(after):
        return
    watch = _RateWatch(pend, idx, lr, after, max(lr, after) * 2.0 ** lr_target.TOLERANCE)
    watch.handle = opt.register_step_pre_hook(watch)
    _decided(pend, watch.limit, opt)


def _decided(pend: Pending, limit: float, opt: Any = None) -> None:
    """Record that ``pend``'s storage was decided for rates up to ``limit`` (by ``opt``'s first
    step, or settle_rate): a later SGD over its layers above it is said (:func:`_check_later`)."""
    pend.limit = max(pend.limit or 0.0, limit)
    if opt is not None:
        pend.deciders.add(opt)
    _DECIDED.add(pend)
    _SEEN.clear()


def _check_later(opt: torch.optim.Optimizer) -> None:
    """A later ``torch.optim.SGD`` (not the one whose first step decided the ceiling: that one
    has its :class:`_RateWatch`) over the layers of a result whose storage was decided, at a
    rate above where it was decided: said once, in a warning and the report (a second phase of
    training with a new optimizer at a higher rate trained silently without the ceiling: the
    loss went 2.68 -> 3.68 at lr=4 after a first optimizer at 0.01, where one at 4 from the
    start falls steadily).  Each optimizer is checked once while its parameters stay."""
    count = sum(len(g["params"]) for g in opt.param_groups)
    if _SEEN.get(opt) == count:
        return
    _SEEN[opt] = count
    if not isinstance(opt, torch.optim.SGD):
        return
    for pend in list(_DECIDED):
        if pend in _PENDING or opt in pend.deciders or pend.limit is None:
            continue
        hit = [g for g in opt.param_groups for ids in [{id(p) for p in g["params"]}]
               if pend.held_by(ids) is not None]
        now = max([r for r in map(_peak, hit) if math.isfinite(r)], default=0.0)
        if now <= pend.limit:
            continue
        _DECIDED.discard(pend)      # said once
        text = (f"lr='auto': the ceiling was decided for rates up to {pend.limit:.4g} at the "
                f"first step of an earlier optimizer (or settle_rate); {type(opt).__name__}, a "
                f"later optimizer over the same layers, steps at {now:.4g}, above it, and the "
                f"storage is not lowered for it: pass lr= (the highest rate you train at) and "
                f"optimizer='sgd' to precondition, or call precondfx.settle_rate(model, "
                f"peak_lr) before the first optimizer's first step")
        _say_raised(pend, text, 5)


def _say_raised(pend: Pending, text: str, stacklevel: int) -> None:
    """A rate raised past the one the ceiling was decided for, said once: logged, warned
    (at the user's line: ``stacklevel`` counts this function) and recorded in the report's
    ``lr_target`` section as ``raised``."""
    log.info("precondfx: %s", text)
    warnings.warn(f"precondfx: {text}", RuntimeWarning, stacklevel=stacklevel)
    sec = pend.report.conditioning.get("lr_target")
    if isinstance(sec, dict):
        sec["raised"] = text
        sec["summary"] = f"{sec['summary']}; later: {text}"


def _unwatched() -> Any:
    """What a pickled or deep-copied optimizer holds in place of a :class:`_RateWatch`."""
    return _no_watch


def _no_watch(opt: Any, args: Any, kwargs: Any) -> None:
    return None


class _RateWatch:
    """A rate raised by hand past where the first step's ceiling was decided (a warm-up
    written in the loop from a small rate, an LR finder): said once, in a warning and the
    report; the hook then goes."""

    def __init__(self, pend: Pending, idx: int, decided: float, suggested: float,
                 limit: float) -> None:
        self.pend = weakref.ref(pend)
        self.idx, self.decided, self.suggested, self.limit = idx, decided, suggested, limit
        self.handle: Any = None

    def __reduce__(self) -> tuple:
        return (_unwatched, ())

    def __call__(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        pend = self.pend()
        if pend is None or self.idx >= len(opt.param_groups):
            self.handle.remove()
            return None
        g = opt.param_groups[self.idx]
        now = max(_peak(g), _peak({"lr": g.get("lr")}))
        if not (math.isfinite(now) and now > self.limit):
            return None
        self.handle.remove()
        text = (f"lr='auto': the ceiling was decided at the first step of "
                f"{type(opt).__name__}, at its rate {self.decided:.4g} (the suggested SGD rate "
                f"then {self.suggested:.4g}); its rate is now {now:.4g}, above both, and the "
                f"storage is not lowered for it (a warm-up or an LR finder that sets the rate "
                f"by hand?): call precondfx.settle_rate(model, peak_lr) before the first "
                f"step, let a torch.optim.lr_scheduler do the warm-up (its initial_lr is "
                f"read), or pass lr= and optimizer='sgd' to precondition")
        _say_raised(pend, text, 4)
        return None


def _release() -> None:
    global _HANDLE
    if _HANDLE is not None:
        _HANDLE.remove()
        _HANDLE = None


def _release_after(opt: torch.optim.Optimizer) -> None:
    """Remove the global hook once this step of ``opt`` is over: removing it in
    :func:`_pre_step`, inside torch's loop over the global step pre-hooks, breaks that loop
    ("OrderedDict mutated during iteration") when a hook was registered after it.  A step
    post-hook of ``opt``, the last it holds, does it and removes itself."""
    handle: list[Any] = []

    def post(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        handle.pop().remove()
        if not _PENDING and not _DECIDED:
            _release()
    handle.append(opt.register_step_post_hook(post))


def arm(model: nn.Module, graph: Any, plan: Any, report: Any, lr_buffers: dict[str, list[str]],
        sample: Any, key: Any, seed: int, added: tuple[str, ...] = ()) -> Pending | None:
    """Keep what the first step needs on ``model`` (and register the global hook); None when
    no trainable layer carries an lr multiplier.  ``added``: the names of the parameters
    precondition added (said at the first step where no optimizer holds them)."""
    global _HANDLE
    ok, _ = lr_transfer.carried(lr_buffers, plan, graph)
    bufs = {w: lr_buffers[w] for w in ok}
    if not bufs:
        return None
    pend = Pending(model, graph, report, bufs, sample.copy(), key, seed, added)
    model.__dict__[ATTR] = pend       # not a submodule, parameter or buffer: no state_dict key
    _PENDING.add(pend)
    _NOT_MINE.clear()
    if _HANDLE is None:
        _HANDLE = register_optimizer_step_pre_hook(_pre_step)
    return pend


def is_pending(model: nn.Module) -> bool:
    """Whether ``model``'s ``lr='auto'`` first step has not happened yet."""
    pend = model.__dict__.get(ATTR)
    return isinstance(pend, Pending) and pend in _PENDING


def settle_rate(model: nn.Module, lr: float, optimizer: Any = "sgd", *,
                momentum: float = 0.0, nesterov: bool = False) -> dict[str, Any]:
    """What the first step of ``optimizer`` at rate ``lr`` does to ``model`` (a result of
    ``precondition`` with ``lr='auto'``), done now: for a training loop that does not step a
    ``torch.optim`` optimizer (a functional or batched trainer).  ``optimizer``: ``'sgd'``,
    ``'adam'``/``'adamw'`` or the class.  ``momentum``, ``nesterov``: the SGD loop's, which
    set the ceiling's :func:`headroom` (0: the ceiling at the suggested rate).  ``model`` may
    hold the result (a wrapper, a parent module).  Returns the report section it sets."""
    from precondfx.core.options import number, optimizer_family
    found = {}
    for m in model.modules():       # the result itself, or the one a wrapper holds
        p = m.__dict__.get(ATTR)
        if p is not None and p in _PENDING and id(p) not in found:
            found[id(p)] = (m, p)
    if len(found) > 1:
        raise PrecondError(f"settle_rate: this model holds {len(found)} preconditioned "
                           f"results with a pending first step: call settle_rate on each")
    if not found:
        raise PrecondError("settle_rate: this model has no pending first step (it was "
                           "preconditioned with lr=None, a number, another scheme or "
                           "reinit_weights=False, or it was already trained or settled, or "
                           "loaded from a file)")
    model, pend = next(iter(found.values()))
    fam = optimizer_family("optimizer", optimizer)
    lr = number("a positive learning rate", lambda x: x > 0)("lr", lr)    # lr='s own check
    momentum = number("a momentum in [0, 1)", lambda x: 0 <= x < 1)("momentum", momentum)
    if fam != "sgd":
        pend.consume()
        sec = pend._kept_named(str(optimizer), "under Adam-family optimizers the storage "
                                               "precondition chose is kept")
    else:
        try:
            sec = pend.set(model, list(pend.lr_buffers), lr, "SGD (settle_rate)",
                           room=headroom({"momentum": momentum, "nesterov": nesterov}))
            after = sec.get("ceiling", sec.get("suggested_after"))
            if isinstance(after, float) and math.isfinite(after):
                _decided(pend, max(lr, after) * 2.0 ** lr_target.TOLERANCE)
        finally:
            pend.consume()
    pend.record(sec)
    return sec


__all__ = ["ATTR", "Pending", "arm", "headroom", "settle_rate"]
