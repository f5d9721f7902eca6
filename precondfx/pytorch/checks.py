"""Model constructs precondfx refuses up front, and Python-level failures it turns into errors.

Each refusal is a :class:`~precondfx.errors.PrecondError` that names the modules and says what to
do, instead of a ``RuntimeError`` from deep inside ``copy.deepcopy`` or a ``ZeroDivisionError``
from the planner.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn

from precondfx.core.calibration import refuse_empty  # noqa: F401 (re-exported)
from precondfx.errors import PrecondError

F = TypeVar("F", bound=Callable[..., Any])


def _hook_kinds(m: nn.Module) -> list[str]:
    """'weight_norm' / 'spectral_norm' / 'prune' (with the tensor's name) for the old-style
    reparametrizations hooked onto ``m``."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm
    try:
        from torch.nn.utils.prune import BasePruningMethod
    except ImportError:  # pragma: no cover - always present in supported torch versions
        BasePruningMethod = ()  # type: ignore[assignment]
    kinds = []
    for h in m._forward_pre_hooks.values():
        if isinstance(h, WeightNorm):
            kinds.append(f"weight_norm:{h.name}")
        elif isinstance(h, SpectralNorm):
            kinds.append(f"spectral_norm:{h.name}")
        elif BasePruningMethod and isinstance(h, BasePruningMethod):
            kinds.append(f"prune:{getattr(h, '_tensor_name', 'weight')}")
    return kinds


def _offloaded(hook: object) -> bool:
    """Whether an accelerate hook keeps the module's weights elsewhere (``AlignDevicesHook``
    with ``offload=True``; a ``SequentialHook`` holding one)."""
    if hook is None:
        return False
    if getattr(hook, "offload", False) is True:
        return True
    return any(_offloaded(h) for h in getattr(hook, "hooks", ()) or ())


def check_model(model: nn.Module) -> None:
    """Refuse what the pipeline cannot handle correctly, with what to do:

    * old-style ``torch.nn.utils.weight_norm`` (``weight_g``/``weight_v`` and a hook that
      recomputes ``weight``): use ``torch.nn.utils.parametrizations.weight_norm``, which
      precondfx keeps, or ``remove_weight_norm``; the same for old-style ``spectral_norm``;
    * ``torch.nn.utils.prune`` (``weight_orig``/``weight_mask``): re-initializing
      ``weight_orig`` ignores the mask's effect on the fans; make the pruning permanent with
      ``prune.remove`` or prune after preconditioning;
    * other tensors computed from parameters and kept as module attributes (they cannot be
      copied, and are recomputed behind the graph's back);
    * parameters with no elements (``nn.Linear(0, 4)``): nothing to initialize or scale, and
      every fan-based rule divides by zero;
    * TorchScript modules (no hooks, no faithful deep copy): script the result instead;
    * weights offloaded by accelerate (the parameters are meta placeholders, the values sit in
      the hook's weights map): precondition before dispatching;
    * parameters made under ``torch.inference_mode()`` (inference tensors): they cannot be
      trained or measured; build the model outside it.
    """
    frozen = [n for n, p in model.named_parameters()
              if not isinstance(p, nn.parameter.UninitializedParameter) and p.is_inference()]
    if frozen:
        raise PrecondError(
            f"{len(frozen)} parameter(s) of the model, e.g. {frozen[0]}, are inference tensors "
            f"(the model was built or loaded inside torch.inference_mode()): they can be neither "
            f"trained nor measured. Build or load the model outside torch.inference_mode() "
            f"(torch.no_grad() is fine), or clone its parameters there")
    offloaded = [path or "the model itself" for path, m in model.named_modules()
                 if _offloaded(getattr(m, "_hf_hook", None))]
    if offloaded:
        raise PrecondError(
            f"accelerate offloads the weights of {offloaded[:3]} (cpu_offload, disk_offload, or "
            f"a device_map with offload): the parameters are meta placeholders and the values "
            f"live in the hook's weights map, which precondfx does not write. Precondition the "
            f"model before dispatching it, then offload the result with its own tensors: "
            f"accelerate.cpu_offload(result, device, state_dict=dict(result.named_parameters("
            f"remove_duplicate=False))) (a transformers result's state_dict() folds the "
            f"constants into the weights, for checkpoints); or build it on the meta device and "
            f"follow the large-model recipe (docs/guides/large-models.md: to_empty, "
            f"precondfx.reinit)")
    scripted = [path or "the model itself" for path, m in model.named_modules()
                if isinstance(m, torch.jit.ScriptModule)]
    if scripted:
        raise PrecondError(
            f"TorchScript modules {scripted[:5]}: precondfx needs the Python module (it copies "
            f"it, traces it and hooks its layers, which TorchScript does not allow). "
            f"Precondition the plain module and call torch.jit.script on the result")
    wn, sn, pr, computed, empty = [], [], [], [], []
    for path, m in model.named_modules():
        where = path or type(m).__name__
        for k in _hook_kinds(m):
            kind, _, name = k.partition(":")
            {"weight_norm": wn, "spectral_norm": sn, "prune": pr}[kind].append(
                f"{where}.{name}")
        for k, v in vars(m).items():
            if isinstance(v, torch.Tensor) and v.grad_fn is not None and \
                    not any(x.endswith(f"{where}.{k}") for x in wn + sn + pr):
                computed.append(f"{where}.{k}")
        for k, p in m.named_parameters(recurse=False):
            if isinstance(p, nn.parameter.UninitializedParameter):
                continue  # a lazy module: materialized by the first forward (on the copy)
            if p.numel() == 0:
                empty.append(f"{where}.{k} {tuple(p.shape)} of {type(m).__name__}")
    if wn:
        raise PrecondError(
            f"old-style torch.nn.utils.weight_norm on {wn}: its hook recomputes the weight from "
            f"weight_g and weight_v in every forward, which precondfx cannot re-initialize or "
            f"copy. Use torch.nn.utils.parametrizations.weight_norm (supported: the weight is "
            f"kept as parametrized), or call torch.nn.utils.remove_weight_norm on those modules "
            f"first")
    if sn:
        raise PrecondError(
            f"old-style torch.nn.utils.spectral_norm on {sn}: its hook recomputes the weight as "
            f"weight_orig / sigma in every forward (and updates weight_u/weight_v), so an init "
            f"scale or alpha on weight_orig has no effect. Use "
            f"torch.nn.utils.parametrizations.spectral_norm (supported: the weight is kept as "
            f"parametrized), or call torch.nn.utils.remove_spectral_norm first")
    if pr:
        raise PrecondError(
            f"torch.nn.utils.prune is active on {pr}: the weight is weight_orig * weight_mask, "
            f"recomputed by a hook in every forward, and re-initializing weight_orig would "
            f"ignore what the mask removes from each layer's fans. Make the pruning permanent "
            f"with torch.nn.utils.prune.remove(module, 'weight') before preconditioning, or "
            f"prune the preconditioned model")
    if computed:
        raise PrecondError(
            f"module attributes {computed[:5]} are tensors computed from parameters (they "
            f"carry autograd history), kept outside the module's parameters and buffers: "
            f"precondfx cannot copy or re-initialize what they are computed from. Compute them "
            f"inside forward, or register them with torch.nn.utils.parametrize")
    refuse_empty(empty)


def check_copy(model: nn.Module, copied: nn.Module) -> None:
    """Refuse a deep copy whose parameters are no longer leaves where the model's are (a
    TorchScript submodule: PyTorch copies its parameters with ``clone()``, which records
    autograd history, so no optimizer could train them)."""
    bad = [name for (name, p), (_, q) in zip(model.named_parameters(),
                                             copied.named_parameters())
           if p.is_leaf and not q.is_leaf]
    if bad:
        raise PrecondError(
            f"deep-copying the model gives parameters {bad[:5]} that are not leaves (PyTorch "
            f"copies TorchScript modules this way), so the copy precondfx rewrites could not "
            f"be trained. Precondition the plain (unscripted) module and call "
            f"torch.jit.script on the result, or pass inplace=True to rewrite this module "
            f"itself")


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation failure: ``MemoryError``, ``torch.OutOfMemoryError`` on accelerators, or
    the RuntimeError of torch's CPU allocator."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in msg or
                                            "out of memory" in msg.lower())


def out_of_memory(e: BaseException) -> PrecondError:
    """The PrecondError for an allocation failure, saying what to do (raise it ``from e``)."""
    detail = " ".join(str(e).split())
    if "can't allocate" in detail:
        detail = detail[detail.find("can't allocate"):]
    detail = f" ({type(e).__name__}: {detail[:120]})" if detail else f" ({type(e).__name__})"
    return PrecondError(
        f"out of memory while preconditioning{detail}: precondfx runs the model on the sample "
        f"(forward and backward passes, calibration and measurements). Pass a smaller sample "
        f"batch (a few examples are enough to calibrate), use balance='analytic' (no "
        f"measurement), or plan on the meta device (build the model under "
        f"torch.device('meta'), balance='analytic') and materialize it afterwards")


def nesting(model: torch.nn.Module) -> int:
    """How deeply the model's modules are nested (the root alone: 0), without recursion."""
    deepest, todo, seen = 0, [(model, 0)], set()
    while todo:
        m, d = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        deepest = max(deepest, d)
        todo.extend((c, d + 1) for c in m._modules.values() if c is not None)
    return deepest


#: Python frames per level of module nesting that copying (``copy.deepcopy``), fx tracing and
#: calling a model need: a chain of 300 nested modules traced with fx at a limit of 2000 and
#: plain ``deepcopy`` failed at 200 under the default 1000; 20 leaves room
FRAMES_PER_LEVEL = 20


@contextlib.contextmanager
def deep_enough(model: torch.nn.Module | None) -> Iterator[None]:
    """Raise Python's recursion limit, for the call only, to what the model's nesting needs
    (``2000 + FRAMES_PER_LEVEL * depth``; never lowered): a model whose forward runs must not be
    refused because precondfx copies and traces it with deeper stacks than the forward."""
    old = sys.getrecursionlimit()
    need = 2000 + FRAMES_PER_LEVEL * nesting(model) if model is not None else old
    if need > old:
        sys.setrecursionlimit(need)
    _USER_LIMIT.append(old)
    try:
        yield
    finally:
        _USER_LIMIT.pop()
        if need > old:
            sys.setrecursionlimit(old)


_USER_LIMIT: list[int] = []


@contextlib.contextmanager
def at_user_limit() -> Iterator[None]:
    """The user's own recursion limit back, for the forward that checks the model runs: a
    model whose forward needs more than the user's limit is refused (it would fail in the
    user's training loop), as before :func:`deep_enough` raised it."""
    if not _USER_LIMIT:
        yield
        return
    cur = sys.getrecursionlimit()
    sys.setrecursionlimit(_USER_LIMIT[-1])
    try:
        yield
    finally:
        sys.setrecursionlimit(cur)


def guarded(fn: F) -> F:
    """Turn Python's recursion limit into a PrecondError saying how to raise it (deeply nested
    modules: a chain of 300 ``nn.Sequential`` already exceeds the default limit), and running
    out of memory into one saying what to do (the original error is its ``__cause__``).
    A call inside ``torch.inference_mode()`` runs as one outside it: tensors made in that mode
    cannot be trained (the result's re-drawn weights would be inference tensors) and measured
    balancing needs autograd."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        model = next((a for a in args if isinstance(a, torch.nn.Module)), None)
        try:
            with deep_enough(model), torch.inference_mode(False):
                return fn(*args, **kwargs)
        except RecursionError as e:
            lim = sys.getrecursionlimit()
            raise PrecondError(
                f"Python's recursion limit ({lim}) was reached ({str(e)[:80]}): the model's "
                f"modules are nested too deeply for copying, tracing or calling it at this "
                f"limit. Raise it before calling precondfx, e.g. sys.setrecursionlimit("
                f"{max(10 * lim, 10000)}), or flatten the nesting") from None
        except (MemoryError, RuntimeError) as e:  # after RecursionError, a RuntimeError
            if not is_out_of_memory(e):
                raise
            raise out_of_memory(e) from e
    return wrapper  # type: ignore[return-value]
