"""Capture with ``torch.fx.symbolic_trace``: the only method whose result is itself editable.

Leaf modules of ``torch.nn`` (Conv2d, Linear, BatchNorm...) stay ``call_module`` nodes; user
modules are traced through.  Shapes come from running the traced module on the sample
(``ShapeProp``).

A GraphModule keeps only the tensor operations a trace records.  Constructs whose meaning lies
elsewhere are detected while tracing and make the trace fail with :class:`Unkeepable`, so that
the plan is applied to the user's own module instead (the eager back end): a custom
``torch.autograd.Function`` (its backward), a grad-mode change inside forward (``torch.no_grad``
blocks), ``torch.utils.checkpoint`` (recomputation), and any difference between the graphs traced
in train and in eval mode (``if self.training`` branches), changes to the modules' Python
attributes (counters, caches), and reads of a parameter's dtype or device outside the graph (a
``self.dtype`` property, a ``get_dtype()`` method, ``next(self.parameters()).device``: the trace
would freeze float32).

The trace patches functions for the whole process (fx patches ``nn.Module.__call__``; this
module ``random.random``, ``torch.is_autocast_enabled``...): one trace runs at a time, and the
stand-ins act in the tracing thread only.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from precondfx.pytorch import ops
from precondfx.pytorch.calibrate import is_stochastic
from precondfx.pytorch.capture.common import (Act, Const, Param, Sample, build_node,
                                              input_attrs, is_dataclass_output, leaves,
                                              shape_of, target_name)
from precondfx.core import optable
from precondfx.core.graph import Graph, Node


#: the Tensor properties that transpose (``w.T``, ``w.mT``; ``w.H``, ``w.mH`` of a real
#: weight): read as the op table's method
_TRANSPOSE_PROPS = ("T", "mT", "H", "mH")


class Unkeepable(Exception):
    """The forward uses a construct that a traced GraphModule would silently drop."""


class _FrozenMetadata(Unkeepable):
    """The forward reads, outside the traced graph, a parameter's dtype or device."""


#: held while a trace runs: the stand-ins patched in for it (and fx's own patches of
#: ``nn.Module.__call__`` and ``__getattr__``) are then put back in the reverse order they were
#: put in; two threads tracing at once would each put back what the other put in, leaving a
#: stand-in (a refusing ``random.random``, a dead tracer's ``Module.__call__``) for good
_TRACE_LOCK = threading.RLock()
#: the thread tracing now (``depth`` > 0 in it): the stand-ins act only there; every other
#: thread (a server running another model, a data thread drawing random numbers) calls through
#: to the original
_TRACING = threading.local()


def _tracing_here() -> bool:
    """Whether this thread is tracing (the stand-ins refuse only then)."""
    return getattr(_TRACING, "depth", 0) > 0


@contextlib.contextmanager
def _tracing_scope() -> Iterator[None]:
    """This thread traces (one trace at a time in the process, :data:`_TRACE_LOCK`)."""
    with _TRACE_LOCK:
        _TRACING.depth = getattr(_TRACING, "depth", 0) + 1
        try:
            yield
        finally:
            _TRACING.depth -= 1


_CHECKPOINT_CODES = {inspect.unwrap(torch.utils.checkpoint.checkpoint).__code__}
_KEEP = ("the plan is applied to the model's own module instead (hooks and buffers), "
         "which keeps it")


class _Tracer(fx.Tracer):
    """fx's tracer, with stochastic modules (DropPath, StochasticDepth...) kept as leaves: traced
    through, their ``if self.training`` would be frozen into the graph in the trace's mode.
    Every node it records is checked for constructs a GraphModule cannot keep."""

    def __init__(self) -> None:
        # buffers read in forward become graph nodes (get_attr), as parameters do: computed on
        # at trace time instead, their values would be frozen into the graph as constants
        super().__init__()
        self.proxy_buffer_attributes = True
        self._grad = torch.is_grad_enabled()
        self._inference = torch.is_inference_mode_enabled()
        self._autocast = _autocast_state()
        self._thread = threading.get_ident()

    def call_module(self, m: torch.nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        # fx patches nn.Module.__call__ for the whole process while it traces: a module run by
        # another thread meanwhile runs as it is, not recorded into this graph
        if threading.get_ident() != self._thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if threading.get_ident() != self._thread:   # nn.Module.__getattr__, as call_module
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        # a module holding weights is traced through even if its name says 'Dropout' or
        # 'DropPath' (a user's block): its layers must be in the graph
        # a torch.nn module the op table does not know that is built of other modules
        # (nn.TransformerEncoder, nn.Transformer...) is traced through, as the export and eager
        # captures do: kept as one call, its layers would be hidden from the plan
        if next(m.children(), None) is not None and ops.for_module(m) is None:
            return False
        if isinstance(m, _QUANT_STUBS):
            # the identity until torch.ao.quantization's prepare/convert swap them (QuantStub
            # -> Quantize): traced through, their calls left the graph, and a quantized layer
            # of the converted result met a float tensor
            return True
        return (is_stochastic(m) and next(m.parameters(), None) is None) or \
            super().is_leaf_module(m, qualname)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        _refuse_checkpoint()
        if torch.is_grad_enabled() != self._grad or \
                torch.is_inference_mode_enabled() != self._inference:
            raise Unkeepable(f"the forward changes the grad mode (a torch.no_grad / "
                             f"enable_grad / inference_mode block), which a traced graph "
                             f"drops: {_KEEP}")
        if _autocast_state() != self._autocast:
            raise Unkeepable(f"the forward runs under torch.autocast, which a traced graph "
                             f"drops (it would compute in the default dtype): {_KEEP}")
        return super().create_node(*args, **kwargs)


#: eager-mode quantization's markers of where tensors are quantized and dequantized
_QUANT_STUBS = (torch.ao.quantization.QuantStub, torch.ao.quantization.DeQuantStub)


def _refuse_checkpoint() -> None:
    """Raise :class:`Unkeepable` when called (while tracing) from inside
    ``torch.utils.checkpoint``."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code in _CHECKPOINT_CODES:
            raise Unkeepable(f"the forward calls torch.utils.checkpoint, whose recomputation "
                             f"a traced graph drops: {_KEEP}")
        f = f.f_back


@contextlib.contextmanager
def _refuse_dtype_properties(model: torch.nn.Module) -> Iterator[None]:
    """While tracing, reading a property of one of the model's module classes that returns a
    dtype or a device (``self.dtype`` as ``next(self.parameters()).dtype``, transformers'
    ``self.device``) raises :class:`Unkeepable`: the trace would freeze the trace-time value
    (float32) into the graph, which then ignores ``model.to(torch.bfloat16)`` (a dtype error,
    or a silent float32 computation)."""
    saved: list[tuple[type, str, property]] = []
    seen: set[tuple[type, str]] = set()
    try:        # restored also when a class refuses the patch half-way (a metaclass)
        for m in model.modules():
            for cls in type(m).__mro__:
                if cls in (nn.Module, object) or cls.__module__.startswith("torch."):
                    continue
                for name, prop in list(vars(cls).items()):
                    if not isinstance(prop, property) or prop.fget is None or \
                            (cls, name) in seen:
                        continue
                    seen.add((cls, name))
                    wrapped = property(_refusing_get(prop.fget, cls, name), prop.fset,
                                       prop.fdel, prop.__doc__)
                    setattr(cls, name, wrapped)
                    saved.append((cls, name, prop))
        yield
    finally:
        for cls, name, prop in saved:
            setattr(cls, name, prop)


def _refusing_get(get: Any, cls: type, name: str) -> Any:
    """``get`` (a property's getter) raising :class:`Unkeepable` on a dtype or device value."""
    def refuse(value: Any) -> Unkeepable:
        return Unkeepable(f"the forward reads {cls.__name__}.{name}, a property whose value "
                          f"({value}) a traced graph would freeze: after model.to(another "
                          f"dtype or device) the graph would still use {value}: {_KEEP}")

    def fget(obj: Any) -> Any:
        try:
            value = get(obj)
        except _FrozenMetadata as e:    # it read a parameter's dtype (_TraceTimeCompute)
            raise refuse("a parameter's dtype or device") from e
        if isinstance(value, (torch.dtype, torch.device)) and _tracing_here():
            raise refuse(value)
        return value
    return fget


def _autocast_state() -> tuple:
    """Whether autocast is on, and its dtype, for the CPU and CUDA."""
    return tuple((_IS_AUTOCAST(d), _AUTOCAST_DTYPE(d)) for d in ("cpu", "cuda"))


_HOOKS = {"_forward_hooks": "forward hook", "_forward_pre_hooks": "forward pre-hook",
          "_backward_hooks": "backward hook", "_backward_pre_hooks": "backward pre-hook",
          "_state_dict_hooks": "state_dict hook", "_state_dict_pre_hooks": "state_dict hook",
          "_load_state_dict_pre_hooks": "load_state_dict hook",
          "_load_state_dict_post_hooks": "load_state_dict hook"}


def _check_hooks(model: torch.nn.Module, gm: fx.GraphModule) -> None:
    """Raise :class:`Unkeepable` for hooks a GraphModule would drop: those of the root module
    (the GraphModule is a new root) and those of modules the trace went through (their forward
    is inlined: a forward hook would be frozen into the graph as traced, a backward hook lost).
    Modules kept as calls (leaves) keep their hooks: the GraphModule calls the same object."""
    leaves = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    found = []
    for name, m in model.named_modules():
        if name and (name in leaves or any(name.startswith(f"{leaf}.") for leaf in leaves)):
            continue
        kinds = list(dict.fromkeys(what for attr, what in _HOOKS.items()
                                   if getattr(m, attr, None)))
        if kinds:
            found.append(f"{'/'.join(kinds)} on {name or 'the model itself'}")
    if found:
        raise Unkeepable(f"the model has {', '.join(found[:4])}, which a traced graph drops: "
                         f"{_KEEP}")


def _tensor_constants_not_saved(model: torch.nn.Module, gm: fx.GraphModule) -> None:
    """fx registers every tensor the forward reads that is neither a parameter nor a buffer (a
    plain tensor attribute, a tensor in a list, a literal) as a persistent buffer of the
    GraphModule; keep them out of its state_dict, as they are out of the model's."""
    saved = set(model.state_dict())
    for name, _ in list(gm.named_buffers()):
        if name in saved:
            continue
        path, _, leaf = name.rpartition(".")
        owner = gm.get_submodule(path) if path else gm
        owner._non_persistent_buffers_set.add(leaf)


@contextlib.contextmanager
def _refuse_autograd_functions() -> Iterator[None]:
    """While tracing, a custom ``torch.autograd.Function`` called on traced values raises
    :class:`Unkeepable`: fx would record its forward and lose its backward."""
    orig = torch.autograd.Function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if _tracing_here() and any(isinstance(a, fx.Proxy) for a in tree_leaves((args, kwargs))):
            # by name: while another thread measures, the module's attribute is its stand-in
            if (cls.__module__, cls.__qualname__) == ("torch.utils.checkpoint",
                                                      "CheckpointFunction"):
                what = "torch.utils.checkpoint (use_reentrant=True), whose recomputation"
            else:
                what = (f"the custom torch.autograd.Function {cls.__module__}."
                        f"{cls.__qualname__}, whose backward")
            raise Unkeepable(f"the forward calls {what} a traced graph drops: {_KEEP}")
        return orig.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.autograd.Function.apply = orig  # type: ignore[method-assign]


@contextlib.contextmanager
def _refuse_autocast() -> Iterator[None]:
    """While tracing, entering a ``torch.autocast`` region raises :class:`Unkeepable`, also one
    that changes nothing at trace time (``enabled=False`` with autocast already off): a traced
    graph drops the region, so under the user's own autocast (bf16 training) it would compute
    in the low precision where their model computes in float32 (transformers' rotary
    embeddings, EfficientViT's attention)."""
    cls = torch.amp.autocast_mode.autocast
    orig = cls.__dict__["__enter__"]
    reads = {n: getattr(torch, n) for n in _AUTOCAST_READS if hasattr(torch, n)}

    def enter(self: Any) -> Any:
        if not _tracing_here():
            return orig(self)
        _refuse_checkpoint()
        raise Unkeepable(f"the forward enters a torch.autocast region, which a traced graph "
                         f"drops (under your own autocast it would compute in the low "
                         f"precision where your model does not): {_KEEP}")

    def read(*args: Any, _name: str = "", **kwargs: Any) -> Any:
        if not _tracing_here():
            return reads[_name](*args, **kwargs)
        _refuse_checkpoint()        # checkpoint reads the autocast state: name the cause
        raise Unkeepable(f"the forward reads the autocast state (torch.is_autocast_enabled, "
                         f"as transformers' maybe_autocast does), which a traced graph would "
                         f"freeze at its value while tracing: {_KEEP}")

    cls.__enter__ = enter  # type: ignore[method-assign]
    for n in reads:
        setattr(torch, n, functools.partial(read, _name=n))
    try:
        yield
    finally:
        cls.__enter__ = orig  # type: ignore[method-assign]
        for n, f in reads.items():
            setattr(torch, n, f)


#: torch functions that read the autocast state (refused while tracing, see _refuse_autocast);
#: the tracer's own check (_autocast_state) keeps the originals
_AUTOCAST_READS = ("is_autocast_enabled", "get_autocast_dtype", "is_autocast_cpu_enabled",
                   "get_autocast_gpu_dtype", "get_autocast_cpu_dtype")
_IS_AUTOCAST, _AUTOCAST_DTYPE = torch.is_autocast_enabled, torch.get_autocast_dtype


_FUNCTIONAL_DROPOUT = {F.dropout: nn.Dropout, F.dropout1d: nn.Dropout1d,
                       F.dropout2d: nn.Dropout2d, F.dropout3d: nn.Dropout3d,
                       F.alpha_dropout: nn.AlphaDropout}


#: Python-level random draws a trace would freeze (a layer dropped when
#: ``random.random() < p``): the functions of ``random`` and ``numpy.random`` models call
_PY_RANDOM = ("random", "uniform", "randint", "randrange", "choice", "choices", "sample",
              "shuffle", "gauss", "normalvariate", "betavariate", "expovariate", "triangular")
_NP_RANDOM = ("rand", "randn", "random", "random_sample", "uniform", "randint", "choice",
              "binomial", "normal", "permutation", "shuffle", "beta", "bernoulli")


@contextlib.contextmanager
def _refuse_python_random() -> Iterator[None]:
    """While tracing, a draw from Python's ``random`` or ``numpy.random`` raises
    :class:`Unkeepable`: the trace would freeze the value drawn at trace time."""
    import random
    mods: list[tuple[Any, tuple[str, ...]]] = [(random, _PY_RANDOM)]
    try:
        import numpy.random as npr
        mods.append((npr, _NP_RANDOM))
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    saved = []
    for mod, names in mods:
        for name in names:
            f = getattr(mod, name, None)
            if f is None:
                continue

            def refuse(*a: Any, _name: str = f"{mod.__name__}.{name}", _f: Any = f,
                       **k: Any) -> Any:
                if not _tracing_here():
                    return _f(*a, **k)
                raise Unkeepable(f"the forward draws Python-level random numbers ({_name}), "
                                 f"which a traced graph would freeze at the values drawn "
                                 f"while tracing: {_KEEP}")
            saved.append((mod, name, f))
            setattr(mod, name, refuse)
    try:
        yield
    finally:
        for mod, name, f in saved:
            setattr(mod, name, f)


#: Tensor methods and properties that read metadata only (no values): allowed on a
#: parameter or buffer while tracing
_METADATA = frozenset((
    "shape", "size", "dim", "ndim", "ndimension", "dtype", "device", "numel", "nelement",
    "requires_grad", "is_floating_point", "is_complex", "layout", "stride", "is_contiguous",
    "data_ptr", "element_size", "__hash__", "is_leaf", "grad_fn", "names", "is_sparse",
    "is_cuda", "is_meta", "is_quantized", "storage_offset", "untyped_storage", "__len__",
    "__repr__", "__format__", "_version", "grad"))


#: metadata that ``model.to`` changes: read on a parameter or buffer outside the traced graph
#: (``next(self.parameters()).dtype``, a ``get_dtype()`` method), it would be frozen
_FROZEN_METADATA = frozenset(("dtype", "device", "get_device", "is_cuda"))


def _func_name(func: Any) -> str:
    """The name of a torch function, or of the property a ``Tensor.x.__get__`` reads."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class _TraceTimeCompute(TorchFunctionMode):
    """While tracing, an operation on the values of one of the model's parameters or buffers
    that does not involve a traced value raises :class:`Unkeepable`: it runs once, at trace
    time, and its result (a norm, a penalty summed over ``self.parameters()``, a clamped copy)
    would be frozen into the graph as a constant, or its effect (``p.data.clamp_()``) would
    not be in the graph at all.  (Parameters and buffers read as attributes are traced values.)"""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.names = {id(t): n for n, t in list(model.named_parameters(remove_duplicate=False))
                      + list(model.named_buffers(remove_duplicate=False))}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _func_name(func)
        leaves_ = tree_leaves((args, kwargs))
        hit = next((self.names[id(a)] for a in leaves_
                    if isinstance(a, torch.Tensor) and id(a) in self.names), None)
        if name in _FROZEN_METADATA:
            if hit is not None:
                raise _FrozenMetadata(
                    f"the forward reads the {name} of {hit} outside the traced graph (through "
                    f"self.parameters(), self.buffers() or a method returning it: "
                    f"next(self.parameters()).{name}), a value a traced graph would freeze "
                    f"({func(*args, **kwargs)}): after model.to(another dtype or device) the "
                    f"graph would still use it: {_KEEP}")
        if name not in _METADATA and not any(isinstance(a, fx.Proxy) for a in leaves_):
            if hit is not None:
                raise Unkeepable(
                    f"the forward computes on the values of {hit} outside the traced graph "
                    f"({name or func} on a tensor reached through self.parameters(), "
                    f"self.buffers(), .data or a detached copy): a trace would run it once "
                    f"and freeze the result (or drop its in-place effect): {_KEEP}")
        return func(*args, **kwargs)


def _trace_once(model: torch.nn.Module, concrete: dict) -> fx.GraphModule:
    tracer = _Tracer()
    added = {m: set(vars(m)) for m in model.modules()}
    tensors = {m: (dict(m._parameters), dict(m._buffers)) for m in model.modules()}
    try:
        with _tracing_scope(), _refuse_autograd_functions(), _refuse_python_random(), \
                _refuse_autocast(), _refuse_dtype_properties(model), _TraceTimeCompute(model):
            graph = tracer.trace(model, concrete_args=concrete or None)
        name = model.__class__.__name__ if isinstance(model, torch.nn.Module) else "module"
        gm = fx.GraphModule(tracer.root, graph, name)
    finally:
        # fx stores the constants it meets (``_tensor_constant0``...) on the traced module
        # itself; the GraphModule holds its own references: take them off the model
        for m, keys in added.items():
            for k in [k for k in vars(m) if k not in keys and k.startswith("_tensor_constant")]:
                delattr(m, k)
        # a forward that assigns a buffer or parameter (``self.n += 1``, ``self.mu = ...``)
        # stored a traced value in it: put the tensors back
        changed = []
        for m, (ps, bs) in tensors.items():
            for store, old in ((m._parameters, ps), (m._buffers, bs)):
                diff = [k for k in set(store) | set(old) if store.get(k) is not old.get(k)]
                if diff:    # compared by identity: a traced value has no truth value
                    changed += diff
                    store.clear()
                    store.update(old)
    if changed:
        raise Unkeepable(f"the forward assigns to the buffer or parameter {changed[0]} (a "
                         f"counter, a running statistic), which a traced graph drops: {_KEEP}")
    return gm


def _dropout_training(n: fx.Node) -> Any:
    return n.kwargs.get("training", n.args[2] if len(n.args) > 2 else True)


def _mode_following(gm: fx.GraphModule, other: fx.GraphModule) -> set[str]:
    """Compare the graphs traced in train (``gm``) and eval (``other``) mode.  Returns the
    functional dropout nodes whose ``training`` argument follows the mode; raises
    :class:`Unkeepable` when anything else differs (a ``self.training`` branch)."""
    a, b = list(gm.graph.nodes), list(other.graph.nodes)
    follow: set[str] = set()
    why = f"the forward traces differently in train and eval mode (a self.training branch) " \
          f"or with grad on and off, and a traced graph would freeze one of them: {_KEEP}"
    if len(a) != len(b):
        raise Unkeepable(why)
    for x, y in zip(a, b):
        if (x.op, x.target, x.name) != (y.op, y.target, y.name):
            raise Unkeepable(why)
        if repr((x.args, x.kwargs)) == repr((y.args, y.kwargs)):
            continue
        if x.op == "call_function" and x.target in _FUNCTIONAL_DROPOUT and \
                _dropout_training(x) is True and _dropout_training(y) is False:
            follow.add(x.name)
            continue
        raise Unkeepable(why)
    return follow


def _python_state(model: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """A fingerprint of every module's plain Python attributes (not parameters, buffers,
    submodules, hooks or the train flag): values of scalars, identities of other objects and
    of the items of containers."""
    out: dict[tuple[str, str], Any] = {}
    for name, m in model.named_modules():
        for k, v in vars(m).items():
            if k.startswith("_") or k == "training":
                continue
            if isinstance(v, (bool, int, float, str, type(None))):
                out[(name, k)] = ("value", v)
            elif isinstance(v, dict):
                out[(name, k)] = ("dict", id(v), tuple((kk, id(vv)) for kk, vv in v.items()))
            elif isinstance(v, (list, set)):
                out[(name, k)] = (type(v).__name__, id(v), tuple(id(x) for x in v))
            else:
                out[(name, k)] = ("object", id(v))
    return out


def _check_python_state(before: dict, after: dict) -> None:
    changed = sorted({k for k in before.keys() | after.keys() if before.get(k) != after.get(k)})
    if changed:
        where = ", ".join(f"{attr} of {mod or 'the model'}" for mod, attr in changed[:5])
        raise Unkeepable(f"the forward changes Python state ({where}: a counter, a cache, a "
                         f"log...), which a traced graph drops: {_KEEP}")


def opaque_parameter_calls(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """(function, parameter) for each call of a function the op table does not know that is
    passed a parameter: a ``torch.fx.wrap``-ed function (torchvision's Swin attention) is one
    opaque node, and the layers whose weights it takes are hidden from the plan (left as they
    are).  Capture methods that run the function see into it."""
    from precondfx.pytorch import ops
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    out: list[tuple[str, str]] = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or ops.for_function(n.target) is not None:
            continue
        for a in tree_leaves((n.args, n.kwargs)):
            if isinstance(a, fx.Node) and a.op == "get_attr" and a.target in params:
                name = getattr(n.target, "__qualname__", None) or str(n.target)
                out.append((f"{getattr(n.target, '__module__', '') or ''}.{name}".lstrip("."),
                            str(a.target)))
                break
    return out


#: the names a GraphModule uses for its own state and API (``meta``, ``code``, ``graph``,
#: ``recompile``...): a model attribute or method of the same name would be hidden by them
_GM_NAMES = frozenset(
    n for n in (set(dir(fx.GraphModule)) - set(dir(torch.nn.Module))) |
    {"meta", "shape_env", "_code", "_graph", "_tracer_cls", "_tracer_extras", "_lineno_map",
     "_prologue_start", "_in_spec", "_out_spec", "_erased"}
    if not (n.startswith("__") and n.endswith("__")))


def _check_names(model: torch.nn.Module) -> None:
    """Raise :class:`Unkeepable` where the model's own attributes or its class's methods use
    a name the GraphModule result (a subclass of GraphModule and of the model's class) holds
    for itself: ``self.meta = {"classes": ...}`` would read GraphModule's empty ``meta``,
    ``self.code`` the generated code, a method ``graph()`` the fx Graph."""
    taken = sorted(n for n in vars(model) if n in _GM_NAMES)
    for klass in type(model).__mro__:
        if klass is torch.nn.Module or issubclass(torch.nn.Module, klass) or \
                issubclass(klass, fx.GraphModule):
            break
        taken += sorted(n for n in vars(klass) if n in _GM_NAMES and n not in taken)
    if taken:
        raise Unkeepable(f"the model has an attribute or method named {taken[0]!r}, a name a "
                         f"torch.fx.GraphModule uses for its own state or API: the result, a "
                         f"GraphModule of your class, would hide yours; {_KEEP}")


def trace(model: torch.nn.Module, sample: Sample) -> fx.GraphModule:
    """Symbolically trace ``model``; non-tensor keyword inputs become concrete arguments.

    The model is traced in train mode with grad on and in eval mode with grad off (each
    module's own flag is restored after); the two graphs must agree.  Functional dropout calls
    whose ``training`` argument follows the mode (``F.dropout(x, p, training=self.training)``)
    are replaced by dropout modules so that
    the result still switches between train and eval; those with a fixed ``training`` stay as
    written.  Raises :class:`Unkeepable` for constructs a GraphModule cannot keep."""
    if not isinstance(model, fx.GraphModule):
        _check_names(model)
    concrete = {k: v for k, v in sample.kwargs.items() if not isinstance(v, torch.Tensor)}
    flags = {m: m.training for m in model.modules()}
    state = _python_state(model)
    try:
        model.train(True)
        gm = _trace_once(model, concrete)
        model.train(False)
        with torch.no_grad():  # also shows torch.enable_grad() blocks and is_grad_enabled() tests
            follow = _mode_following(gm, _trace_once(model, concrete))
        _check_python_state(state, _python_state(model))
    finally:
        for m, t in flags.items():
            m.training = t
    if not flags[model]:  # the graph returned is the one of the mode the caller set
        model.train(False)
        try:
            gm = _trace_once(model, concrete)
        finally:
            for m, t in flags.items():
                m.training = t
    count = 0
    for n in list(gm.graph.nodes):
        cls = _FUNCTIONAL_DROPOUT.get(n.target) if n.op == "call_function" else None
        if cls is None or n.name not in follow:
            continue
        p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
        # F.dropout(h, p, self.training, True) drops h itself: so does the module (every other
        # use of h sees the dropped values, as in the user's forward)
        inplace = n.kwargs.get("inplace", n.args[3] if len(n.args) > 3 else False)
        if not isinstance(p, (int, float)) or not isinstance(inplace, bool):
            raise Unkeepable(f"functional dropout {n.name} follows the train/eval mode with a "
                             f"traced probability or inplace flag, which a dropout module "
                             f"cannot take: {_KEEP}")
        # under the module that called it, so it follows that module's own train/eval flag
        owner = caller(n)
        path = f"{owner}.precondfx_dropout_{count}" if owner else f"precondfx_dropout_{count}"
        count += 1
        gm.add_submodule(path, cls(float(p), inplace=inplace))
        with gm.graph.inserting_before(n):
            new = gm.graph.call_module(path, (n.args[0] if n.args else n.kwargs["input"],))
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
    if count:
        gm.recompile()
    _check_hooks(model, gm)
    _tensor_constants_not_saved(model, gm)
    return gm


def check_same(gm: fx.GraphModule, model: torch.nn.Module, sample: Sample) -> None:
    """Run the model and the GraphModule on the sample (the same random seed, dropout off, the
    state restored after each run) and raise :class:`Unkeepable` when their outputs differ in
    structure or values: the trace missed a construct none of the checks above names (a
    context manager, a hook, Python-level randomness, a global flag)."""
    from torch.utils._pytree import tree_flatten

    from precondfx.pytorch.calibrate import NoDropout, preserved

    def once(m: torch.nn.Module, s: Sample = sample) -> Any:
        with preserved(m), torch.no_grad(), NoDropout():
            torch.manual_seed(0)
            return tree_flatten(s.call(m))

    (a, spec_a), (b, spec_b) = once(model), once(gm)
    dc = next((x for x in a if is_dataclass_output(x) and not hasattr(x, "__getitem__")), None)
    if dc is not None:
        raise Unkeepable(f"the model returns a dataclass ({type(dc).__name__}), which the traced "
                         f"graph builds by a call whose fields it cannot scale: {_KEEP}")
    why = _difference(a, spec_a, b, spec_b)
    if why is not None:
        raise Unkeepable(f"the traced graph does not compute what the model computes on the "
                         f"sample ({why}): the forward uses a construct the trace does not "
                         f"record (a context manager, a hook, Python-level state or "
                         f"randomness): {_KEEP}")
    for name, without in _optional_inputs_left_out(model, sample):
        try:
            a2, spec2 = once(model, without)
        except Exception:   # the forward itself needs the input: nothing the graph must keep
            continue
        try:
            why = _difference(a2, spec2, *once(gm, without))
        except Exception as e:
            why = f"it fails: {type(e).__name__}"
        # the same structure and values: the graph passes None where the forward does
        # (``attn_mask=mask`` into attention), it may be called without it; other values:
        # it holds the branch written for the input given (``if ctx is not None: h = 2 * h``),
        # which it would run without the input, silently
        if why is not None:
            raise Unkeepable(f"the traced graph fixed the branch the forward takes on its "
                             f"optional input {name!r} (default None) being given: called "
                             f"without it, as your forward allows (inference without "
                             f"{name}=), the graph does not compute what it computes ({why}): "
                             f"{_KEEP}")
        for n in gm.graph.nodes:
            if n.op == "placeholder" and str(n.target) == name:
                n.meta[NONE_OK] = True


def _difference(a: list, spec_a: Any, b: list, spec_b: Any) -> str | None:
    """How the flattened outputs ``b`` differ from ``a`` (None where they are the same in
    structure and values)."""
    if spec_a != spec_b or len(a) != len(b):
        return "its output has another structure"
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return "its output has another structure"
        if not isinstance(x, torch.Tensor):
            if not (x == y or (x != x and y != y)):
                return f"an output differs ({x!r}, {y!r})"
        elif x.shape != y.shape or x.dtype != y.dtype:
            return (f"an output has shape {tuple(y.shape)} {y.dtype} instead of "
                    f"{tuple(x.shape)} {x.dtype}")
        elif not _same_values(x, y):
            return "an output's values differ"
    return None


#: placeholder meta: the graph, run without this optional input (None), computes what the
#: forward computes without it (the result takes None for it)
NONE_OK = "precondfx_none_ok"


def _optional_inputs_left_out(model: torch.nn.Module,
                              sample: Sample) -> list[tuple[str, Sample]]:
    """(name, the sample without it) for each input of the forward whose default is None and
    to which the sample gives a tensor (``labels=None``): a trace takes the branch written for
    the input being given, which the graph must not fix."""
    try:
        sig = inspect.signature(model.forward)
        bound = sig.bind(*sample.args, **sample.kwargs)
    except (TypeError, ValueError):
        return []
    out = []
    for name, value in bound.arguments.items():
        par = sig.parameters[name]
        if par.default is not None or par.kind in (par.VAR_POSITIONAL, par.VAR_KEYWORD) or \
                not isinstance(value, torch.Tensor):
            continue
        rest = sig.bind_partial(**{k: v for k, v in bound.arguments.items() if k != name})
        out.append((name, Sample(tuple(rest.args), dict(rest.kwargs), sample.batched,
                                 sample.batch_dim)))
    return out


def _same_values(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal integer/bool tensors; floating ones equal to float rounding (relative to the
    largest magnitude), NaN where NaN."""
    if x.layout != torch.strided:
        x, y = x.to_dense(), y.to_dense()
    if not (x.is_floating_point() or x.is_complex()):
        return torch.equal(x, y)
    fin = x[torch.isfinite(x)]
    atol = 1e-6 * float(fin.abs().max()) if fin.numel() else 0.0
    return bool(torch.allclose(y, x, rtol=1e-4, atol=atol, equal_nan=True))


def run_shape_prop(gm: fx.GraphModule, sample: Sample) -> None:
    """Record every node's output shape by running ``gm`` on the sample (placeholders in order)."""
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    values: list[Any] = list(sample.args)
    for nm in names[len(values):]:
        nm_clean = nm.lstrip("*")
        if nm_clean in sample.kwargs:
            values.append(sample.kwargs[nm_clean])
        else:
            values.append(_default_of(gm, nm_clean))
    _ScalarProp(gm).propagate(*values)


#: the types of the Python values (not tensors) a traced call can return: shapes and numbers
#: computed from them (``x.size(-1)``, ``math.sqrt(d)``, ``h.shape[-1] ** -0.5``), a dtype, a
#: device.  torch.export and the eager tracer see these as the numbers they are; fx records the
#: arithmetic as nodes, which would otherwise count as activation operands of their users.
_PY_VALUES = (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool, torch.dtype,
              torch.device, torch.Size)


class _ScalarProp(ShapeProp):
    """``ShapeProp`` that also keeps, for each call whose result is a Python value (a size,
    a number computed from sizes), that value: its users take it as a constant operand."""

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.op in ("call_function", "call_method") and isinstance(result, _PY_VALUES):
            n.meta["precondfx_value"] = tuple(result) if isinstance(result, torch.Size) \
                else result
        return result


def _default_of(gm: fx.GraphModule, name: str) -> Any:
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.target == name and n.args:
            return n.args[0]
    return None


def _marker(a: Any, gm: fx.GraphModule) -> Any:
    if isinstance(a, fx.Node):
        if _namedtuple_fields(a) is not None:   # a namedtuple built in forward: its fields
            return tuple(_marker(v, gm) for v in namedtuple_values(a))
        if a.op == "get_attr":
            return Param(str(a.target))
        if "precondfx_value" in a.meta:     # a size, or a number computed from sizes
            return Const(a.meta["precondfx_value"])
        return Act(a.name)
    if isinstance(a, (list, tuple)):
        return type(a)(_marker(x, gm) for x in a)
    if isinstance(a, dict):
        return {k: _marker(v, gm) for k, v in a.items()}
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return Const(a)
    return a


#: attributes of a tensor that say nothing of its values (``x.to(self.fc.weight.dtype)``)
_META_ATTRS = frozenset({"dtype", "device", "shape", "ndim", "layout", "is_cuda", "is_sparse",
                         "is_quantized", "is_meta", "requires_grad"})
#: methods of a tensor that say nothing of its values (``self.fc.weight.size(0)``)
_META_METHODS = frozenset({"size", "dim", "get_device", "is_floating_point", "is_complex",
                           "element_size", "numel", "nelement"})


def _metadata_read(n: fx.Node) -> bool:
    """Whether ``n`` reads only a parameter's metadata: a use that a rescaled or re-drawn
    weight leaves as it is (balancing and lr multipliers need not leave the layer out)."""
    if n.op == "call_function" and n.target is getattr and len(n.args) >= 2:
        return n.args[1] in _META_ATTRS
    return n.op == "call_method" and n.target in _META_METHODS


def to_graph(gm: fx.GraphModule) -> Graph:
    """Convert a traced (and shape-propagated) GraphModule into the neutral graph."""
    nodes: list[Node] = []
    module_calls: dict[str, int] = {}
    outputs: list[str] = []
    containers = _containers(gm)
    for n in gm.graph.nodes:
        if n in containers:     # ``Out(logits, hidden)``: a tuple of its fields
            continue
        meta = n.meta.get("tensor_meta")
        out_shape = shape_of(meta) if hasattr(meta, "shape") else None
        # a call by keyword alone (``self.conv(input=h)``): its operands' shapes, in order
        in_shapes = [shape_of(a.meta.get("tensor_meta")) if isinstance(a, fx.Node) else None
                     for a in (n.args or [v for v in n.kwargs.values()
                                          if isinstance(v, fx.Node)])]
        args = [_marker(a, gm) for a in n.args]
        kwargs = {k: _marker(v, gm) for k, v in n.kwargs.items()}
        if _metadata_read(n):       # the parameter's dtype, device or shape, not its values:
            args = [None if isinstance(a, Param) else a for a in args]  # not a reader of it
        if n.op == "placeholder":
            nodes.append(Node(n.name, "input", f"input {n.target}", out_shape=out_shape,
                              attrs=input_attrs(meta)))
        elif n.op == "get_attr":
            continue  # parameters appear as Param operands of their users
        elif n.op == "output":
            outs: list = []
            _flatten_nodes(n.args, outs, containers)
            outputs = [o.name for o in outs if o.op != "get_attr"]
            nodes.append(Node(n.name, "output", "output", inputs=outputs))
        elif n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            idx = module_calls.get(str(n.target), 0)
            module_calls[str(n.target)] = idx + 1
            spec = ops.for_module(mod)
            nodes.append(build_node(n.name, spec, f"{type(mod).__module__}.{type(mod).__name__}",
                                    args, kwargs, module=str(n.target), module_obj=mod,
                                    call_index=idx, out_shape=out_shape, in_shapes=in_shapes))
        elif "precondfx_value" in n.meta:
            # shape arithmetic (math.sqrt(x.size(-1))): a constant, whatever function computed it
            nodes.append(build_node(n.name, optable.BY_KIND["constant"], target_name(n.target),
                                    args, kwargs, out_shape=None, in_shapes=in_shapes))
        elif n.op == "call_function":
            spec = ops.for_function(n.target)
            name = target_name(n.target)
            if n.target is getattr and len(n.args) == 2 and n.args[1] in _TRANSPOSE_PROPS:
                # ``self.weight.T``: the transpose it is, as export (numpy_T) and eager read it
                spec, name = ops.for_method(n.args[1]), f"Tensor.{n.args[1]}"
                args = args[:1]
            elif n.target is getattr and out_shape is not None:
                # ``h.max(dim=1).values``, ``torch.topk(h, k).indices``: a field of the tuple a
                # call returned, read as export reads it (getitem): the values flow through
                spec = optable.BY_KIND["select"]
            nodes.append(build_node(n.name, spec, name, args, kwargs,
                                    out_shape=out_shape, in_shapes=in_shapes))
            if nodes[-1].kind == "maxpool" and any("precondfx_value" in a.meta
                                                   for a in n.all_input_nodes):
                # F.max_pool2d(h, h.size(-1) // 4): a replacement would fix the geometry at the
                # sample's size, where the model's pool follows the input's
                nodes[-1].attrs["keep_reason"] = (
                    "its kernel, stride or padding is computed from the input's shape, "
                    "so a replacement of fixed geometry would differ at other input sizes")
            if nodes[-1].kind == "maxpool" and caller(n):
                # a replacement convolution goes under the module whose forward calls it, so
                # that its parameters are named within that module (``backbone.*``)
                nodes[-1].attrs["owner"] = caller(n)
        elif n.op == "call_method":
            spec = ops.for_method(str(n.target))
            nodes.append(build_node(n.name, spec, f"Tensor.{n.target}", args, kwargs,
                                    out_shape=out_shape, in_shapes=in_shapes))
    return Graph(nodes, "fx", outputs=outputs)


def caller(n: fx.Node) -> str:
    """The path of the module whose forward made the call ``n`` ('' for the root)."""
    stack = n.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _namedtuple_fields(n: fx.Node) -> tuple | None:
    """The fields of the namedtuple class ``n`` constructs (fx records ``Out(logits, hidden)``
    returned by forward as a call of ``Out``), None if ``n`` is not such a call."""
    cls = n.target if n.op == "call_function" else None
    if isinstance(cls, type) and issubclass(cls, tuple):
        return getattr(cls, "_fields", None)
    return None


def namedtuple_values(n: fx.Node) -> list:
    """The field values of the namedtuple ``n`` constructs, in field order."""
    fields = _namedtuple_fields(n) or ()
    return list(n.args) + [n.kwargs.get(f) for f in fields[len(n.args):]]


def _containers(gm: fx.GraphModule) -> set[fx.Node]:
    """The namedtuple constructions: containers of their fields (as a tuple is), not operations
    of the graph, whether returned (``return Out(logits, hidden)``) or passed to an operation
    (``torch.cat(Pair(a, b))``, where fx records the construction as a call of ``Pair``)."""
    return {n for n in gm.graph.nodes if _namedtuple_fields(n) is not None}


def _flatten_nodes(a: Any, out: list, containers: set[fx.Node] = frozenset()) -> None:
    for x in leaves(a):
        if isinstance(x, fx.Node) and x in containers:  # its fields, as a returned tuple
            _flatten_nodes(namedtuple_values(x), out, containers)
        elif isinstance(x, fx.Node):
            out.append(x)


def forward_signature(model: torch.nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
