"""Calibration runs: measure the model on the calibration batch without side effects.

The output scale is fixed in the mode training will use (Sec. 6.4; DESIGN.md): train mode by
default, where normalization layers use batch statistics.  Dropout is switched off so the scale
is deterministic, and every buffer (BatchNorm running statistics, counters) is restored after
the run, so a calibration forward leaves no trace.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import random
import threading
import weakref
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from precondfx.pytorch.capture.common import Sample, main_output
from precondfx.pytorch.checks import is_out_of_memory
from precondfx.core import calibration
from precondfx.pytorch.ops import stochastic_leaf
from precondfx.core.calibration import (SCALE_REFUSE, SCALE_WARN,  # noqa: F401 (re-exported)
                                        scale_warning, solve_output_scale)
from precondfx.errors import PrecondError

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
            nn.FeatureAlphaDropout)


def is_stochastic(m: nn.Module) -> bool:
    """Dropout and its relatives: torch's dropout classes, a parameter-free leaf whose class
    name or attributes say so (timm's DropPath, torchvision's StochasticDepth, DropBlock, a
    module holding ``drop_prob``: ``optable.stochastic_layer`` via ``ops.stochastic_leaf``),
    the dropout between the layers of nn.LSTM/GRU/RNN: random in train mode, identity in
    eval mode.  A module with parameters or children is not, whatever its name (a user's
    ``MLPWithDropout`` or ``ResidualDropoutBlock``: its own forward keeps its mode; the
    dropout layers inside it are found on their own)."""
    return isinstance(m, _DROPOUT) or stochastic_leaf(m) \
        or (isinstance(m, nn.RNNBase) and m.dropout > 0 and m.num_layers > 1)


_DROPOUT_FNS = {f for f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                            F.feature_alpha_dropout, torch.dropout, torch.Tensor.dropout
                            if hasattr(torch.Tensor, "dropout") else F.dropout)}


# Attention ops with their own dropout: position of ``dropout_p`` in their signature.  The mode
# sees only calls made from Python code outside torch functions, so nn.MultiheadAttention's
# call of F.multi_head_attention_forward (which then calls scaled_dot_product_attention) is
# caught at the outer call.
_ATTENTION_DROPOUT = {F.scaled_dot_product_attention: 4, F.multi_head_attention_forward: 10}


class NoDropout(TorchFunctionMode):
    """Turns functional dropout into the identity (transformers call F.dropout with
    ``training=self.training``, which module-level ``eval()`` of Dropout layers cannot reach),
    and sets the attention dropout (``dropout_p`` of scaled_dot_product_attention and of
    nn.MultiheadAttention) to zero, so that a calibration run is deterministic."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUT_FNS:
            return args[0] if args else kwargs["input"]
        pos = _ATTENTION_DROPOUT.get(func)
        if pos is not None:
            if len(args) > pos:
                args = tuple(args[:pos]) + (0.0,) + tuple(args[pos + 1:])
            else:
                kwargs = {**kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)


class SharedPatch:
    """A process-wide patch that several threads may hold at once (two ``precondition`` calls
    in two threads, a measurement beside a training thread): the first to enter applies it,
    the last to leave undoes it.  Entered and left one after the other by two threads, a plain
    save-and-restore context manager put back the other thread's patched value and left it
    installed for the rest of the process (``torch.utils.checkpoint`` no longer recomputing,
    scaled-dot-product attention held on its math kernel)."""

    def __init__(self, make: Any) -> None:
        self._make, self._lock, self._depth, self._held = make, threading.Lock(), 0, None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                held = self._make()
                held.__enter__()
                self._held = held
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    held, self._held = self._held, None
                    held.__exit__(None, None, None)


#: held while precondfx changes state every thread shares (warning filters, sys.stdout and
#: sys.stderr, logger levels) and puts it back: warnings.catch_warnings() and
#: contextlib.redirect_stdout save the state at entry and restore it at exit, so two threads
#: whose spans overlap (A in, B in, A out, B out) left A's silenced state behind (an 'ignore'
#: filter, sys.stdout a StringIO) for the rest of the process
PROCESS_STATE = threading.RLock()

_AS_CALL = threading.local()        # this thread's depth of checkpoint_as_call


class _CheckpointAsCall:
    """Stands in for ``torch.utils.checkpoint.CheckpointFunction`` (reentrant checkpointing)
    while :func:`checkpoint_as_call` is active in some thread: in the measuring thread the
    checkpointed function is called directly, in any other thread the real checkpoint runs."""

    real: Any = torch.utils.checkpoint.CheckpointFunction

    @staticmethod
    def apply(function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        if getattr(_AS_CALL, "depth", 0):
            return function(*args)
        return _CheckpointAsCall.real.apply(function, preserve_rng_state, *args)


@contextlib.contextmanager
def _install_checkpoint_as_call() -> Iterator[None]:
    cp = torch.utils.checkpoint
    orig = cp.CheckpointFunction
    _CheckpointAsCall.real = orig
    cp.CheckpointFunction = _CheckpointAsCall
    try:
        yield
    finally:
        cp.CheckpointFunction = orig


_CHECKPOINT_AS_CALL = SharedPatch(_install_checkpoint_as_call)


@contextlib.contextmanager
def checkpoint_as_call() -> Iterator[None]:
    """Run ``torch.utils.checkpoint(..., use_reentrant=True)`` (also its default when
    ``use_reentrant`` is not passed, and transformers' gradient checkpointing) as a plain call
    of the checkpointed function: the same values and gradients, without the recomputation,
    whose backward refuses ``torch.autograd.grad``, which the measurements differentiate with.
    Only for measuring runs, and only in the calling thread: a capture must still see the
    checkpoint (fx refuses it), and another thread's training keeps its recomputation."""
    _AS_CALL.depth = getattr(_AS_CALL, "depth", 0) + 1
    try:
        with _CHECKPOINT_AS_CALL():
            yield
    finally:
        _AS_CALL.depth -= 1


#: scaled-dot-product attention on its math kernel (forward-mode AD has no rule for the fused
#: ones): torch's ``sdpa_kernel`` sets process-wide flags, so held through a SharedPatch
math_attention = SharedPatch(lambda: sdpa_kernel([SDPBackend.MATH]))


_PLAIN = (int, float, bool, complex, str, bytes, type(None))


#: a module's hook tables (``_forward_hooks``, ``_forward_pre_hooks_with_kwargs``,
#: ``_forward_hooks_always_called``, ``_backward_hooks``, ``_state_dict_hooks``...)
_HOOK_DICTS = ("hooks", "hooks_with_kwargs", "hooks_always_called")


def _plain(v: object) -> bool:
    return isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(_plain(x) for x in v))


def _renormed(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters a forward pass rewrites in place: the weights of embeddings with
    ``max_norm`` (renormalized rows)."""
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
            out[f"{path}.weight" if path else "weight"] = m.weight
    return out


@contextlib.contextmanager
def preserved(model: nn.Module) -> Iterator[None]:
    """Restore, on exit and whatever runs inside, every module's train/eval flag, every buffer
    (BatchNorm running statistics, counters), every plain Python attribute of a module (numbers,
    strings, flags: a ``self.calls += 1`` in forward; the content of the module's own lists,
    dicts and sets: a ``self.cache.append(y)``), its hooks (one a forward registers is
    removed), the weights a forward renormalizes
    (``nn.Embedding(max_norm=...)``) and the global random generators (a forward that draws
    noise): a measurement or calibration run leaves no trace."""
    mods = list(model.modules())
    modes = {m: m.training for m in mods}
    attrs = {m: {k: v for k, v in vars(m).items() if _plain(v)} for m in mods}
    # the user's own containers (not torch's ``_parameters``, hooks...): a forward that
    # appends to ``self.cache`` gets its list back as it was, in place
    boxes = [(v, type(v)(v)) for m in mods for k, v in vars(m).items()
             if not k.startswith("_") and type(v) in (list, dict, set)]
    # hooks a run registers go with the flag it sets (transformers' output-capturing hooks,
    # installed once per model under ``_output_capturing_hooks_installed``): without the
    # flag the next forward would install them again, each recording the hidden states
    hooks = [(v, set(v)) for m in mods for k, v in vars(m).items()
             if k.startswith("_") and k.endswith(_HOOK_DICTS) and isinstance(v, dict)]
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    params = {name: p.detach().clone() for name, p in _renormed(model).items()}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    py_rng, np_rng = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(py_rng)   # Python-level draws (a layer dropped at random) too
        np.random.set_state(np_rng)
        torch.set_rng_state(rng)  # a forward that draws random numbers leaves the user's
        if cuda_rng is not None:  # generator where it was
            torch.cuda.set_rng_state_all(cuda_rng)
        for m, t in modes.items():
            m.training = t
        for m, old in attrs.items():
            d = vars(m)
            for k in [k for k, v in d.items() if k not in old and _plain(v)]:
                del d[k]  # a plain attribute the run added
            d.update(old)
        for table, keys in hooks:
            for k in [k for k in table if k not in keys]:
                del table[k]
        for box, content in boxes:  # no == (tensors inside would compare elementwise)
            box.clear()
            box.update(content) if isinstance(box, (dict, set)) else box.extend(content)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in saved and saved[name].shape == b.shape:
                    b.copy_(saved[name])
            for name, v in params.items():
                p = model.get_parameter(name)
                if p.shape == v.shape:
                    p.copy_(v)


#: the mode that keeps every module's own train/eval flag (dropout still off): the mode a
#: training forward of the model as it is runs in (``lr='auto'``'s first step)
OWN = "own"


def set_mode(model: nn.Module, mode: str) -> None:
    """Put ``model`` in the calibration mode: 'eval' everywhere, or 'train' where a model
    already in train mode keeps each module's own flag (a frozen BatchNorm stays in eval);
    :data:`OWN`: every module's flag as it is."""
    if mode == OWN:
        return
    if mode == "eval" or not model.training:
        model.train(mode == "train")


@contextlib.contextmanager
def quiet_run(model: nn.Module, mode: str = "train") -> Iterator[None]:
    """Run in ``mode`` ('train', 'eval' or :data:`OWN`) with dropout off; restore modes and
    buffers after.

    In 'train' mode a model that is already in train mode keeps each module's own flag: a
    module the user put in eval (a frozen BatchNorm) is calibrated as it will train."""
    if mode not in ("train", "eval", OWN):
        raise PrecondError(f"calibration mode must be 'train' or 'eval', got {mode!r}")
    with preserved(model):
        set_mode(model, mode)
        for m in model.modules():
            if is_stochastic(m):    # dropout layers only: a user's block whose name says
                m.training = False  # 'Dropout' keeps its own mode and its BatchNorms'
        yield


#: what autograd says when a forward differentiates inside itself (``torch.autograd.grad``
#: of its output with respect to its input: physics-informed nets, energy models) under no_grad
_NEEDS_GRAD = ("does not require grad and does not have a grad_fn",)


def needs_grad(e: BaseException) -> bool:
    """Whether ``e`` is autograd's error for a forward that differentiates inside itself,
    run under ``torch.no_grad()``."""
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _NEEDS_GRAD)


#: model classes whose forward differentiates itself: their calibration runs keep grad on
_DIFFERENTIATES: "weakref.WeakSet[type]" = weakref.WeakSet()


def no_grad_for(model: nn.Module) -> contextlib.AbstractContextManager:
    """``torch.no_grad()``, or grad on for a model whose forward differentiates itself (found
    by :func:`forward`): the context a measuring forward of ``model`` runs in."""
    return torch.enable_grad() if type(model) in _DIFFERENTIATES else torch.no_grad()


class Draws:
    """What :func:`seeded` saw: whether a forward under it drew random numbers."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.random = False


_DRAWS: contextvars.ContextVar[Draws | None] = contextvars.ContextVar("precondfx_draws",
                                                                      default=None)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[Draws]:
    """Forwards run by :func:`forward` inside draw their random numbers (stochastic depth,
    noise, Python's ``random``) from generators seeded with ``seed``, whatever the global
    random state; the user's generators are restored after each run (:func:`preserved`).  The
    record says whether any of them drew."""
    rec = Draws(int(seed))
    token = _DRAWS.set(rec)
    try:
        yield rec
    finally:
        _DRAWS.reset(token)


def _seed_all(seed: int) -> tuple:
    """Seed torch's, Python's and numpy's global generators; their states after seeding."""
    # not torch.manual_seed: with CUDA not yet initialized it queues a seeding of the CUDA
    # generators for later, which :func:`preserved` could not undo
    torch.default_generator.manual_seed(seed)
    cuda = torch.cuda.is_initialized()
    if cuda:
        torch.cuda.manual_seed_all(seed)
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    return (torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None,
            random.getstate(), np.random.get_state()[1].copy())


def _drew(states: tuple) -> bool:
    """Whether a generator moved since ``states`` (:func:`_seed_all`)."""
    t, c, p, n = states
    cuda_moved = c is not None and any(
        not torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), c))
    return cuda_moved or not (torch.equal(torch.get_rng_state(), t) and random.getstate() == p
                              and np.array_equal(np.random.get_state()[1], n))


def _call(model: nn.Module, sample: Sample) -> object:
    """``sample.call(model)`` with the global generators seeded from the enclosing
    :func:`seeded` (seed 0 outside one); marks the record when the forward drew."""
    rec = _DRAWS.get()
    states = _seed_all(rec.seed if rec is not None else 0)
    out = sample.call(model)
    if rec is not None and _drew(states):
        rec.random = True
    return out


def forward(model: nn.Module, sample: Sample, mode: str = "train") -> object:
    """One side-effect-free forward pass (no grad; with grad for a forward that calls
    ``torch.autograd.grad`` itself: found on its first run, whose failed attempt is undone,
    and remembered for its class so that later runs go once), with a clear error if the
    model raises.  Random ops inside draw from generators seeded by :func:`seeded` (seed 0
    outside it), and the user's global random state is left as it was."""
    with quiet_run(model, mode), torch.no_grad(), NoDropout():
        try:
            if type(model) not in _DIFFERENTIATES:
                try:
                    with preserved(model):
                        return _call(model, sample)
                except RuntimeError as e:
                    if not needs_grad(e):
                        raise
                _DIFFERENTIATES.add(type(model))
            with torch.enable_grad():
                # outputs not detached: a caller may look for the modules that produced them
                return _call(model, sample)
        except (PrecondError, RecursionError):  # RecursionError: see checks.guarded
            raise
        except Exception as e:  # the user's model raised: say so, keep the cause
            if is_out_of_memory(e):  # checks.guarded says what to do
                raise
            raise model_raised(model, sample, e) from e


def model_raised(model: nn.Module, sample: Sample, e: BaseException) -> PrecondError:
    """The PrecondError for a forward of the user's model on the sample that raised ``e``:
    what it raised, with the shapes, and a hint where the inputs' device or dtype explains it."""
    shapes = [tuple(t.shape) for t in sample.tensors()]
    if "more than 1 value per channel" in str(e):
        return PrecondError(
            f"the model's normalization layer needs more than one sample per channel in "
            f"train mode, and the calibration batch has shapes {shapes}: pass a batch of "
            f"at least two samples, or calibration='eval'")
    return PrecondError(
        f"the model raised {type(e).__name__} when called with the sample (tensor shapes "
        f"{shapes}): {e}. {_input_hint(model, sample, e)}Check that the sample is what "
        f"the model's forward expects (a tensor, a tuple of positional inputs or a dict "
        f"of keyword inputs)")


def _input_hint(model: nn.Module, sample: Sample, e: BaseException) -> str:
    """'The sample is on X, the model on Y: move it' when the devices differ; 'convert it'
    when the model raised about a type, computes in floating point and the sample holds only
    integer or bool tensors (uint8 images); '' otherwise."""
    extra = _extra_positional(model, sample)
    if extra:
        return extra
    have = {t.device for t in sample.tensors()}
    want = {p.device for p in model.parameters()}
    if len(want) == 1 and have and have != want:
        dev = next(iter(want))
        return (f"The sample has tensors on {sorted(str(d) for d in have)} and the model's "
                f"parameters are on {dev}: move the sample there (x.to('{dev}')). ")
    dts = {t.dtype for t in sample.tensors()}
    pdt = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dts and len(pdt) == 1 and "type" in str(e).lower() and \
            not any(d.is_floating_point or d.is_complex for d in dts):
        names = sorted(str(d).replace("torch.", "") for d in dts)
        return (f"The sample holds only {'/'.join(names)} tensors and the model computes in "
                f"{str(next(iter(pdt))).replace('torch.', '')}: if they are data rather than "
                f"ids, convert them (x.float(); uint8 images: x.float() / 255). ")
    return ""


def _extra_positional(model: nn.Module, sample: Sample) -> str:
    """'The sample is a tuple of 2 positional inputs ... an (inputs, labels) batch?' when the
    sample has more positional inputs than the model's forward takes; '' otherwise (or when
    the forward's signature cannot be read, or takes ``*args``)."""
    import inspect
    try:
        sig = inspect.signature(getattr(model, "_orig_mod", model).forward)
    except (TypeError, ValueError):
        return ""
    ps = sig.parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in ps):
        return ""
    n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in ps)
    if len(sample.args) <= n:
        return ""
    last = sample.args[-1]
    labels = isinstance(last, torch.Tensor) and not last.is_floating_point()
    return (f"The sample is a tuple of {len(sample.args)} positional inputs and "
            f"{type(model).__name__}.forward{sig} takes {n}"
            + (" (its last one holds integers: labels?)" if labels else "")
            + ": an (inputs, labels) batch from a DataLoader is not what the model is called "
            "with; pass the inputs only, precondition(model, batch[0]) or, for several "
            "inputs, a tuple of those the forward takes. ")


def output_std(out: object, key: str | int | None = None) -> float:
    """Population std (correction 0) over all elements of the main output, in float64 (a
    complex output in complex128: the std of its values, sqrt E|z - mean|^2, not of their real
    parts, which a cast to float64 would keep)."""
    return masked_output_std(out, key)[0]


def masked_output_std(out: object, key: str | int | None = None) -> tuple[float, int]:
    """``output_std`` and how many masked (-inf) entries it left out: a real output whose only
    non-finite values are -inf is measured over its finite entries
    (``core.calibration.masked_std``, the rule every back end applies)."""
    t = main_output(out, key).detach()
    check_calibratable(t)
    if not t.is_complex() and not bool(torch.isfinite(t).all()):
        return calibration.masked_std(t.to(device="cpu", dtype=torch.float64).numpy())
    return float(t.to(torch.complex128 if t.is_complex() else torch.float64).std(correction=0)), 0


#: rounding's share of an output's magnitude, and its cap (``core.calibration``'s, one rule)
ROUNDING_EPS = calibration.ROUNDING_EPS
MAX_ROUNDING = calibration.MAX_ROUNDING


def constancy(out: object, key: str | int | None = None) -> tuple[float, bool]:
    """How constant the main output is on the sample (``core.calibration.constancy``, the rule
    the ONNX back end applies too): the std rounding alone gives it, and whether every sample
    (rows along dim 0, two or more) holds the same values to that precision (an output that
    does not depend on the inputs)."""
    t = main_output(out, key).detach()
    if not isinstance(t, torch.Tensor) or _not_real(t) or t.numel() < 2:
        return 0.0, False
    eps = torch.finfo(t.real.dtype if t.is_complex() else t.dtype).eps
    wide = torch.complex128 if t.is_complex() else torch.float64
    return calibration.constancy(t.to(device="cpu", dtype=wide).numpy(), eps)


def _not_real(t: Any) -> bool:
    """A tensor that holds no real-valued prediction: integers or booleans (class indices,
    token ids, a mask), which neither take an output scale nor have a gradient."""
    return isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex())


def check_scalable(t: Any, key: str | int | None = None) -> None:
    """Refuse a main output that is not a floating-point (or complex) tensor: class indices
    (``argmax``), a boolean mask or token ids.  An output scale there would change the values
    the user's model returns, and their dtype (``int64 * float`` is a float tensor)."""
    if _not_real(t):
        what = f"output_key={key!r} selects" if key is not None else "the model returns"
        raise PrecondError(
            f"{what} a tensor of dtype {str(t.dtype).replace('torch.', '')} and shape "
            f"{tuple(t.shape)} "
            f"(indices, ids or a mask?), which an output scale would turn into other numbers: "
            f"the output scale acts on the model's floating-point predictions. Return the "
            f"logits too (a tuple or a dict under 'logits'), name a floating-point output "
            f"with output_key=, or pass target_std=None to skip output scaling")


def _in_func_transform() -> bool:
    """Whether a torch.func transform (jvp, vjp, vmap) is running: there ``requires_grad``
    does not tell whether the output depends on the weights."""
    try:
        return torch._C._functorch.peek_interpreter_stack() is not None
    except AttributeError:      # pragma: no cover - a torch without functorch's C API
        return True


def check_differentiable(y: Any, what: str, instead: str) -> None:
    """Refuse a main output with no gradient (an integer or boolean tensor: class indices, a
    mask) where ``what`` differentiates it: a ``PrecondError`` that says what to pass
    (``instead``: the option that avoids the measurement), not autograd's "does not require
    grad" from deep inside."""
    if _not_real(y):
        raise PrecondError(
            f"{what} differentiates the model's main output, which is a tensor of dtype "
            f"{str(y.dtype).replace('torch.', '')} (indices, ids or a mask?) with no gradient: "
            f"return the logits (or name a floating-point output with output_key=), or "
            f"{instead}")
    if isinstance(y, torch.Tensor) and torch.is_grad_enabled() and not y.requires_grad and \
            not _in_func_transform():       # under torch.func.jvp no tensor requires grad
        raise PrecondError(
            f"{what} differentiates the model's main output, which carries no gradient: the "
            f"forward runs under torch.no_grad() or torch.inference_mode(), or detaches the "
            f"output, so no gradient reaches the weights (training it would not move them "
            f"either). Remove that from forward (wrap the calls that should not train "
            f"instead), or {instead}")


def check_calibratable(t: torch.Tensor) -> None:
    """Refuse a main output whose std cannot be calibrated (a single number, fewer than two
    elements); shapes only, so it also runs on the meta device, before materializing."""
    if t.numel() == 1 and t.dim() == 0:
        raise PrecondError("the model returns a single number (a loss?), which has no std to "
                           "calibrate: the output scale acts on the model's predictions. Return "
                           "them too (loss, logits) or in a dict under 'logits', name them with "
                           "output_key=, or pass target_std=None to skip output scaling")
    if t.numel() < 2:
        raise PrecondError(f"the main output has {t.numel()} element(s): its std is undefined; "
                           f"use a calibration batch with more samples or pass target_std=None")


def check_finite_sample(sample: Sample) -> None:
    """Refuse empty batches and NaN/inf in floating-point inputs."""
    ts = sample.tensors()
    if not ts:
        raise PrecondError("the sample contains no tensor: pass the batch the model is called "
                           "with (a tensor, a tuple of positional inputs or a dict of keyword "
                           "inputs)")
    for t in ts:
        if t.numel() == 0:
            raise PrecondError(f"the sample has an empty tensor of shape {tuple(t.shape)}: pass "
                               f"a batch with at least one example (several are better for "
                               f"calibration)")
        if t.layout != torch.strided:  # sparse: its stored values are what can be bad
            t = t.coalesce().values() if t.layout == torch.sparse_coo else t.values()
        if t.is_floating_point() and t.device.type != "meta" and \
                not bool(torch.isfinite(t).all()) and not is_additive_mask(t):
            bad = int((~torch.isfinite(t)).sum())
            raise PrecondError(f"the sample has {bad} NaN/inf value(s) in a tensor of shape "
                               f"{tuple(t.shape)}: clean the calibration batch first (-inf is "
                               f"accepted only in an additive mask: -inf where masked, 0 or "
                               f"negative finite values elsewhere)")


def is_additive_mask(t: torch.Tensor) -> bool:
    """:func:`precondfx.core.calibration.is_additive_mask` on a tensor."""
    if not t.is_floating_point() or t.device.type == "meta":
        return False
    return calibration.is_additive_mask(t.detach().float().cpu().numpy())


# -- statistics over every rank (sharded models) ------------------------------------------------
def global_std_local(t: torch.Tensor, group: object = None) -> tuple[float, float]:
    """(std over every rank's batch, this rank's std); population std, float64, by the -inf
    rule every back end applies (``core.calibration.masked_std``): over the finite entries
    when the only non-finite ones are -inf (masked logits), NaN for NaN/+inf on any rank."""
    return global_masked_std(t, group)[:2]


def global_masked_std(t: torch.Tensor, group: object = None) -> tuple[float, float, int]:
    """``global_std_local`` and the number of masked (-inf) entries it left out over every
    rank: the finite entries' sum, sum of squares and count, the masked count and a NaN/+inf
    count are all-reduced, so every rank reads the same std (that of one process
    calibrating on the global batch)."""
    t = t.detach().to(torch.float64).flatten()
    fin = torch.isfinite(t)
    neg = torch.isneginf(t)
    kept = t[fin]
    one = functools.partial(torch.tensor, dtype=torch.float64, device=t.device)
    stats = torch.stack([kept.sum(), kept.pow(2).sum(), one(float(kept.numel())),
                         one(float(neg.sum())), one(float((~fin & ~neg).sum()))])
    local = calibration.masked_std(t.cpu().numpy())[0] if t.numel() > 1 else float("nan")
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats, group=group)
    s, s2, n, masked, bad = (float(v) for v in stats.cpu())
    if bad > 0:
        return float("nan"), local, 0
    if n < 2:
        if masked > 0:
            return float("nan"), local, 0
        raise PrecondError("the calibration batch has fewer than 2 output elements over all ranks")
    mean = s / n
    return math.sqrt(max(s2 / n - mean * mean, 0.0)), local, int(masked)


def global_std(t: torch.Tensor, group: object = None) -> float:
    """The population std of ``t`` over every rank's values (float64; one process: its own)."""
    return global_std_local(t, group)[0]
