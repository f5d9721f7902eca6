"""The fx back end's result is the user's model: a GraphModule that is also the user's class.

``precondition`` plans on the traced graph and edits it (``apply.fx_apply``); the GraphModule it
returns is built here so that it is *also* an instance of the user's class:

* its class is ``Preconditioned<YourClass>``, a subclass of both ``torch.fx.GraphModule`` and
  the user's class (made once per class), so ``isinstance(result, YourClass)`` holds and every
  method of the class (``forward_features``, ``reset_classifier``, ``generate``...) is there;
* its submodules are the user's own module tree (a copy: the blocks keep their classes, so a
  method calling ``self.layer1(x)`` runs the block's own forward), and the root keeps the
  user's plain attributes (``pretrained_cfg``, ``num_classes``, ``config``) and hooks; its
  ``state_dict`` keys are the user model's keys plus the constants';
* ``forward`` is the rewritten graph.  The other methods of the user's class run the user's
  code on the same modules; each constant the graph multiplies in where one module call
  produces (or consumes) the value is also applied by a hook on that module (:func:`mirror`
  records where), installed only while one of those methods runs (and off inside a ``self(x)``
  it makes; acting only in the thread running the method: another thread's ``forward`` meanwhile
  is the graph alone), so that every method computes with the constants, the graph never sees
  them twice, and training through ``forward`` runs no hook at all.  A
  submodule called directly (``model.layer1(x)``), ``fx.Interpreter`` and other fx tools see
  the modules as the graph does (no mirror).  Constants and edits at functional sites no module owns (an ``F.relu``
  before a residual add, an ``F.max_pool2d`` turned into a strided convolution) only the graph's
  forward sees: :func:`mirror` lists them and the report says so (``report.result``).

It deep-copies, pickles (``torch.save`` of the whole model) and re-traces like a GraphModule,
keeping its class.
"""
from __future__ import annotations

import ast
import collections
import contextlib
import copy
import dataclasses
import enum
import functools
import inspect
import operator
import textwrap
import threading
import types
import weakref
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from precondfx.core.backend import PREFIX
from precondfx.pytorch.apply.common import times_first
# placeholder meta: the graph computes the forward's function with None for this optional input
from precondfx.pytorch.capture.fx_capture import NONE_OK

#: the attribute counting the user's methods running on a model, in every thread (its mirror
#: hooks are installed then)
METHODS = "_precondfx_methods"
#: installs and removals of the mirror hooks, and ``METHODS``, change under this lock
_LOCK = threading.Lock()
#: id(model) -> the handles of its mirror hooks, while one of its user methods runs
_HANDLES: dict[int, list] = {}
#: per thread, id(model) -> [user methods running, graph forwards running inside them]: a
#: mirror hook acts in a thread running one of the model's methods (not inside its graph
#: forward), never in another thread (one calling the model's forward, whose graph holds the
#: constants already)
_HERE = threading.local()
#: the attribute recording the plain values (numbers, flags, strings, containers of them) the
#: traced forwards read from the model's attributes, baked into the graph:
#: ((module, path, name, value or a copy of the container), ...)
READS = "_precondfx_traced_reads"
#: the attribute recording the modules the graph runs through without calling them (a
#: ``layer1`` container, a block): ((path, module), ...); a hook on one of them does not run
THROUGH = "_precondfx_traced_through"
#: the attribute recording the mirror hooks: ((module path, 'out' or 'in', constant), ...)
MIRRORS = "_precondfx_mirrors"
#: ops through which a positive scale on a module's output is a scale on the value (the eager
#: back end's ``_PASS_THROUGH``)
PASS_THROUGH = ("relu", "leaky_relu", "prelu", "dropout", "avgpool", "mean", "neg", "reshape",
                "select", "pad", "cast")
#: the attribute recording the graph's inputs that the sample gave as tensors and the graph
#: reads: ((position, name), ...); None in their place cannot run the graph (:func:`_check_args`)
NEEDED = "_precondfx_tensor_inputs"
#: GraphModule's own state in ``__dict__`` (never taken from the user's model)
_GM_KEYS = {"_graph", "_code", "_lineno_map", "_prologue_start", "_tracer_cls",
            "_tracer_extras", "meta", "_in_spec", "_out_spec", "_erased", "training",
            "_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"}


# -- the class -----------------------------------------------------------------------------------
def _counts(root: nn.Module, create: bool = False) -> list[int] | None:
    """This thread's [methods, graph forwards] running on ``root`` (:data:`_HERE`)."""
    per = _HERE.__dict__.setdefault("counts", {})
    return per.setdefault(id(root), [0, 0]) if create else per.get(id(root))


def _release(root: nn.Module, c: list[int]) -> None:
    if c == [0, 0]:
        _HERE.__dict__["counts"].pop(id(root), None)


def _mirroring(root: nn.Module) -> bool:
    """Whether a mirror hook of ``root`` acts here: this thread runs one of its methods, not
    inside its graph forward."""
    c = _counts(root)
    return c is not None and c[0] > 0 and c[1] == 0


def _gated(fn: Any) -> Any:
    """The graph's forward, counted while it runs inside one of the user's methods in this
    thread (the mirror hooks, installed then, stay off)."""
    @functools.wraps(fn)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        reads = self.__dict__.get(READS)
        if reads:
            _check_reads(self, reads)
        through = self.__dict__.get(THROUGH)
        if through:
            _check_hooks(through)
        needed = self.__dict__.get(NEEDED)
        if needed:
            _check_args(self, needed, args, kwargs)
        c = _counts(self)
        if c is None or not c[0]:   # training: no method of this thread's, nothing to do
            return fn(self, *args, **kwargs)
        c[1] += 1
        try:
            return fn(self, *args, **kwargs)
        finally:
            c[1] -= 1
    forward._precondfx_gated = True  # type: ignore[attr-defined]
    return forward


def _needed_inputs(gm: fx.GraphModule) -> tuple[tuple[int, str], ...]:
    """The graph's inputs (position, name) that the sample gave as tensors and the graph reads
    (a placeholder's ``meta['type']``, recorded by the trace)."""
    out = []
    for i, n in enumerate(gm.graph.nodes):
        if n.op != "placeholder":
            break
        t = n.meta.get("type")
        if n.users and isinstance(t, type) and issubclass(t, torch.Tensor) and \
                not str(n.target).startswith("*") and not n.meta.get(NONE_OK):
            out.append((i, str(n.target)))
    return tuple(out)


def _check_args(self: nn.Module, needed: tuple, args: tuple, kwargs: dict) -> None:
    """Refuse None (or nothing) for an input the traced graph computes with: the graph followed
    the branch of the user's forward that the sample's tensor took, and would fail inside it
    (``Tensor * NoneType``) or compute the wrong branch."""
    for i, name in needed:
        v = args[i] if i < len(args) else kwargs.get(name)
        if v is None:
            from precondfx.errors import PrecondError
            raise PrecondError(
                f"{self._get_name()}.forward was called without {name!r} (None), but "
                f"precondition traced it from a sample that gave {name!r} as a tensor: the "
                f"graph holds the path your forward takes with {name!r} and cannot take the "
                f"other one. Pass {name!r} on every call, or precondition with a sample that "
                f"leaves {name!r} out (the model then keeps your forward, whose branches both "
                f"run with the constants), or precondition one model per call pattern")


_PLAIN = (bool, int, float, str, type(None))


def _source_tree(fn: Any) -> ast.AST | None:
    """The parsed source of a function or method of a class (static and class methods
    unwrapped, decorators followed); None for anything else or where no source is found."""
    fn = getattr(fn, "__func__", fn)
    if not inspect.isfunction(fn):
        return None
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None


def _self_name(tree: ast.AST | None) -> str:
    """The name a method's source gives its instance (its first parameter: ``self`` by
    convention, ``this`` or ``m`` in some code); ``self`` where there is none."""
    for n in ast.walk(tree) if tree is not None else ():
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = n.args.posonlyargs + n.args.args
            return a[0].arg if a else "self"
    return "self"


#: the most plain leaves a container the traced forward read may hold to be checked (copied at
#: the trace, compared by value at every call; a bigger one is not checked)
CONTAINER_LEAVES = 256


def _by_value(v: Any, budget: list[int] | None = None) -> bool:
    """Whether ``v`` is a plain value ``==`` compares by value: numbers, flags, strings, enums,
    and lists, tuples, sets and dicts of them, and dataclass instances (a config; compared
    field by field) of them, nested, with at most ``CONTAINER_LEAVES`` leaves."""
    budget = [CONTAINER_LEAVES] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        return False
    if isinstance(v, _PLAIN) or isinstance(v, enum.Enum) or _numpy_scalar(v):
        return True
    if isinstance(v, (list, tuple, set, frozenset)):
        return all(_by_value(e, budget) for e in v)
    if isinstance(v, dict):
        return all(_by_value(k, budget) and _by_value(e, budget) for k, e in v.items())
    if dataclasses.is_dataclass(v) and not isinstance(v, type) and \
            getattr(v, "__dataclass_params__", None) is not None and v.__dataclass_params__.eq:
        return all(_by_value(getattr(v, f.name, None), budget) for f in dataclasses.fields(v))
    return False


def _numpy_scalar(v: Any) -> bool:
    """A numpy number, flag or string (``np.float32(2.0)``, ``np.bool_(True)``, a value read
    from a numpy config): compared by value like a Python one."""
    if type(v).__module__ != "numpy":
        return False
    import numpy as np
    return isinstance(v, (np.number, np.bool_, np.str_, np.bytes_))


def _too_big(v: Any) -> bool:
    """A container of plain values that :func:`_by_value` leaves unchecked for its size."""
    return not _by_value(v) and _by_value(v, [1 << 20])


def _check_reads(root: nn.Module, reads: tuple) -> None:
    """Refuse to run the graph when an attribute its trace read has changed since (the graph
    holds the value, or the branch, it had then: the user's forward would compute otherwise)."""
    for m, path, name, old in reads:
        now: Any = root if m is None else m     # the root: not held in its own __dict__
        for part in name.split("."):
            now = _static(now, part)
        if now is _MISSING:
            continue
        # a container was copied at the trace: compared by value (changed in place too)
        if now is not old and now != old:
            from precondfx.errors import PrecondError
            where = f"{path}.{name}" if path else name
            raise PrecondError(
                f"the model's attribute {where} is {now!r}, but the traced forward read "
                f"{old!r}: the graph the result runs holds that value (and the branches it "
                f"took), so it would not compute what your forward computes. Set it back to "
                f"{old!r}, or precondition with capture='export' (or 'eager') to keep your "
                f"forward reading it at every call, or precondition after setting it")


_MISSING = object()

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _users_hooks(m: nn.Module) -> bool:
    """Whether ``m`` holds a forward or backward hook that is not precondfx's own."""
    for attr in _HOOK_DICTS:
        hooks = m.__dict__.get(attr)
        if hooks and any(not str(getattr(getattr(h, "hook", h), "__module__", "") or "")
                         .startswith("precondfx") for h in hooks.values()):
            return True
    return False


def _check_hooks(through: tuple) -> None:
    """Say (a ``RuntimeWarning``) that a hook registered on a module the graph runs through
    without calling it does not run: the graph calls the layers inside it."""
    hooked = [path for path, m in through if (m._forward_hooks or m._forward_pre_hooks or
                                              m._backward_hooks or m._backward_pre_hooks)
              and _users_hooks(m)]
    if hooked:
        import warnings
        warnings.warn(
            f"precondfx: the result's forward (the fx graph) does not call "
            f"{', '.join(hooked[:4])}{', ...' if len(hooked) > 4 else ''} as a module (it runs "
            f"the layers inside), so the hooks registered on it do not run in forward. Register "
            f"them on a layer the graph calls, run them through one of your class's methods "
            f"(your code, which calls the module), or precondition with capture='export' or "
            f"'eager' (your forward, every module called)", RuntimeWarning, stacklevel=3)


def traced_through(res: fx.GraphModule) -> tuple:
    """The modules of ``res`` (path, module) that its graph runs through without calling them
    as modules: the containers above the modules and attributes the graph reads."""
    targets = {str(n.target) for n in res.graph.nodes if n.op in ("call_module", "get_attr")}
    out: dict[str, nn.Module] = {}
    for t in targets:
        parts = t.split(".")
        for i in range(1, len(parts)):
            path = ".".join(parts[:i])
            if path in targets or path in out:
                continue
            try:
                out[path] = res.get_submodule(path)
            except AttributeError:
                continue
    return tuple(sorted(out.items()))


def _static(obj: Any, name: str) -> Any:
    """``obj.name`` from the instance's ``__dict__``, else a class attribute, without
    evaluating a property or other descriptor (it is returned as itself, never plain)."""
    if obj is _MISSING:
        return obj
    d = getattr(obj, "__dict__", None)
    v = d.get(name, _MISSING) if isinstance(d, dict) else _MISSING
    return inspect.getattr_static(obj, name, _MISSING) if v is _MISSING else v


def traced_reads(res: fx.GraphModule, unchecked: list[str] | None = None) -> tuple:
    """The plain values (numbers, flags, strings, enums; lists, tuples, sets and dicts of them
    and dataclass configs, copied: :func:`_by_value`) that the forwards the trace went through
    (the root's and those of the user's modules not called as graph modules) read from
    ``self`` (and from the methods and property getters of ``self`` they call), as the trace
    saw them (recorded right after it): ((module, path, name, value), ...).  A container of
    them too big to compare at every call is appended to ``unchecked`` (for the report)."""
    called = {str(n.target) for n in res.graph.nodes if n.op == "call_module"}
    out: list[tuple[nn.Module | None, str, str, Any]] = []
    for path, m in res.named_modules():
        if path in called:
            continue
        cls = res._precondfx_user_class if not path else type(m)
        if (cls.__module__ or "").startswith("torch."):
            continue
        names: set[str] = set()
        todo, seen = ["forward"], set()
        while todo:
            meth = todo.pop()
            seen.add(meth)
            fn = inspect.getattr_static(cls, meth, None)
            # a property's getter is read like a method (``self.temperature`` returning
            # ``self._temp``: the attribute it reads is checked), never evaluated
            tree = _source_tree(fn.fget if isinstance(fn, property) else getattr(cls, meth, None))
            if tree is None:
                continue
            me = _self_name(tree)
            for n in ast.walk(tree):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and \
                        isinstance(n.value.value, ast.Name) and n.value.value.id == me:
                    names.add(f"{n.value.attr}.{n.attr}")    # self.config.return_dict
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and \
                        n.value.id == me and isinstance(n.ctx, ast.Load):
                    names.add(n.attr)
                    if isinstance(getattr(cls, n.attr, None), (types.FunctionType, property)) \
                            and n.attr not in seen:
                        todo.append(n.attr)
                # getattr(self, "use_gate", False), getattr(self.config, "scale", 1.0)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and \
                        n.func.id == "getattr" and len(n.args) >= 2 and \
                        isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str):
                    obj = n.args[0]
                    if isinstance(obj, ast.Name) and obj.id == me:
                        names.add(n.args[1].value)
                    elif isinstance(obj, ast.Attribute) and isinstance(obj.value, ast.Name) \
                            and obj.value.id == me:
                        names.add(f"{obj.attr}.{n.args[1].value}")
        # a field (self.config.return_dict) before the object holding it: its message is
        # the more precise
        for name in sorted(names - {"training"}, key=lambda n: (-n.count("."), n)):
            head = name.partition(".")[0]
            if head in m._modules or head in m._parameters or head in m._buffers:
                continue
            # the instance's own value, or a plain class attribute (of the module, or of a
            # plain object it holds: a config); never a property or other descriptor
            # (evaluating one may fail or act: Lightning's ``self.trainer``)
            v: Any = m
            for part in name.split("."):
                if v is not m and isinstance(v, (nn.Module, torch.Tensor)):
                    v = _MISSING
                v = _static(v, part)
            if v is not _MISSING and _by_value(v):
                # a container copied: one changed in place afterwards compares unequal
                out.append((m if path else None, path, name,
                            v if isinstance(v, _PLAIN) else copy.deepcopy(v)))
            elif v is not _MISSING and unchecked is not None and _too_big(v):
                unchecked.append(f"{path}.{name}" if path else name)
    return tuple(out)


def _recompile(self: fx.GraphModule) -> Any:
    code = fx.GraphModule.recompile(self)
    self.__dict__[NEEDED] = _needed_inputs(self)
    cls = type(self)
    cls.forward = _gated(cls.forward)
    return code


def _users(cls: type, name: str) -> Any:
    """``name`` (``__getstate__``, ``__setstate__``) as the user's class defines it (or a base
    of it below ``nn.Module``), else None."""
    user_cls = getattr(cls, "_precondfx_user_class", None)
    for klass in (user_cls.__mro__ if user_cls is not None else ()):
        if klass is nn.Module or klass is fx.GraphModule or issubclass(nn.Module, klass):
            break
        if name in vars(klass):
            return vars(klass)[name]
    return None


def _state(self: fx.GraphModule) -> dict:
    """What the result pickles and deep-copies: its ``__dict__`` without the Graph, through the
    user's ``__getstate__`` where the class defines one (dropping a lock, a file handle...)."""
    get = _users(type(self), "__getstate__")
    state = get(self) if get is not None else self.__dict__
    if not isinstance(state, dict):     # not a plain dict state: the result's own
        state = self.__dict__
    return {k: v for k, v in state.items() if k != "_graph"}


def _restored(self: fx.GraphModule) -> None:
    """The user's ``__setstate__`` (where the class defines one) run on the restored result:
    it puts back what its ``__getstate__`` dropped."""
    put = _users(type(self), "__setstate__")
    if put is not None:
        put(self, dict(self.__dict__))


def _deepcopy(self: fx.GraphModule, memo: dict) -> fx.GraphModule:
    res = type(self).__new__(type(self))
    memo[id(self)] = res
    res.__dict__.update(copy.deepcopy(_state(self), memo))
    res.__dict__[METHODS] = 0
    res.graph = copy.deepcopy(self._graph)
    _restored(res)
    return res


def _copy(self: fx.GraphModule) -> fx.GraphModule:
    res = type(self).__new__(type(self))
    res.__dict__.update(self.__dict__)
    for k in ("_modules", "_parameters", "_buffers"):
        res.__dict__[k] = collections.OrderedDict(self.__dict__[k])
    res.graph = copy.deepcopy(self._graph)
    return res


def _reduce(self: fx.GraphModule) -> tuple:
    """Pickle as the user's class: the generated code, not the Graph (as GraphModule does), and
    the state (modules, constants, the user's attributes) restored by ``__setstate__``."""
    from torch.fx.graph_module import _format_import_block
    from torch.package import sys_importer
    code = self.recompile()
    state = _state(self)
    return (_empty, (self._precondfx_user_class,),
            {"precondfx_state": state,
             "import_block": _format_import_block(code.globals, sys_importer)})


def _setstate(self: fx.GraphModule, state: dict) -> None:
    if "precondfx_state" not in state:     # a plain module state: the user's class's way
        mine = next(c for c in type(self).__mro__ if "_precondfx_user_class" in vars(c))
        super(mine, self).__setstate__(state)
        return
    from torch.fx.graph_module import _deserialize_graph_module, _forward_from_src
    body = state["precondfx_state"]
    forward = _forward_from_src(state["import_block"] + body["_code"], {})
    plain = _deserialize_graph_module(forward, dict(body))   # re-traces the code
    self.__dict__.update(body)
    self.__dict__[METHODS] = 0
    self.graph = plain.graph
    _restored(self)


def _scriptable(self: fx.GraphModule) -> fx.GraphModule:
    """What ``torch.jit.script(result)`` compiles: the graph with each constant-on-weight call
    (``weight_side.layer``, which takes a module and TorchScript cannot compile) back in its
    module-call form, the same function, on the same modules, parameters and constants."""
    from precondfx.pytorch.apply.weight_side import module_call_view
    return module_call_view(self)


def _empty(user_cls: type) -> fx.GraphModule:
    cls = graph_class(user_cls)
    return cls.__new__(cls)


@contextlib.contextmanager
def _running(self: nn.Module) -> Any:
    """One of the user's methods running on ``self`` in this thread: the mirror hooks are
    installed by the first running in any thread and removed by the last (counted in
    ``METHODS``), and this thread's count (:func:`_counts`) lets them act here."""
    with _LOCK:
        n = getattr(self, METHODS)
        if n == 0:
            _HANDLES[id(self)] = _install(self)
        setattr(self, METHODS, n + 1)
    c = _counts(self, create=True)
    c[0] += 1
    try:
        yield
    finally:
        c[0] -= 1
        _release(self, c)
        with _LOCK:
            n = getattr(self, METHODS) - 1
            setattr(self, METHODS, n)
            for h in _HANDLES.pop(id(self), []) if n == 0 else []:
                h.remove()


#: calls that run no module: builtins (by name), the introspection methods of ``nn.Module``
#: (on ``self`` or anything), and methods of tensors, dicts and strings on a value not read
#: from ``self`` (``self.values(h)`` may be a submodule named so)
_NO_MODULE_NAMES = {
    "len", "next", "iter", "isinstance", "issubclass", "hasattr", "getattr", "type", "int",
    "float", "bool", "str", "tuple", "list", "dict", "set", "frozenset", "sorted", "reversed",
    "enumerate", "zip", "range", "min", "max", "sum", "any", "all", "abs", "round", "repr"}
_MODULE_INTROSPECTION = {
    "parameters", "named_parameters", "buffers", "named_buffers", "children",
    "named_children", "modules", "named_modules", "get_submodule", "get_parameter",
    "get_buffer"}
_VALUE_METHODS = {"numel", "size", "dim", "nelement", "element_size", "keys", "values",
                  "items", "get", "format", "join", "startswith", "endswith"}


def _calls_no_module(fn: Any) -> bool:
    """Whether the function's source makes no call but those named above: a getter such as
    ``device`` (``next(self.parameters()).device``) or ``num_blocks`` (``len(self.blocks)``)
    computes nothing through a module, so it runs without installing the mirror hooks (about
    1.5 ms for 27 of them at every access: 100x the getter).  A property or method of the
    class it reads is wrapped on its own; a function without source, or decorated otherwise
    than as a property, counts as calling one."""
    tree = _source_tree(fn)
    if tree is None:
        return False
    body = tree.body[0] if isinstance(tree, ast.Module) and tree.body else tree
    me = _self_name(tree)
    for n in ast.walk(body):
        if n is not body and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                            ast.Lambda, ast.Yield, ast.YieldFrom, ast.Await)):
            return False
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        if isinstance(f, ast.Name):
            if f.id not in _NO_MODULE_NAMES:
                return False
        elif not isinstance(f, ast.Attribute):
            return False
        elif f.attr not in _MODULE_INTROSPECTION and (
                f.attr not in _VALUE_METHODS or _self_path(f.value, me) is not None or
                (isinstance(f.value, ast.Name) and f.value.id == me)):
            return False
    # a decorator other than the property's own may wrap it in anything
    return not any(ast.unparse(d) != "property" and not (
        isinstance(d, ast.Attribute) and d.attr in ("getter", "setter", "deleter"))
        for d in getattr(body, "decorator_list", ()))


def _in_method(fn: Any) -> Any:
    """A method of the user's class, run with the mirror hooks installed (:func:`_running`):
    outside the user's methods the modules carry no hook, and a hook acts only in a thread
    running a method."""
    @functools.wraps(fn)
    def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with _running(self):
            return fn(self, *args, **kwargs)
    return method


def _in_generator(fn: Any) -> Any:
    """A generator method of the user's class (``iter_features`` yielding each block's output,
    a streaming ``generate``), its body run with the mirror hooks installed at each resumption
    (:func:`_in_method` returns as soon as the generator is made, before its body runs), and
    none while the caller holds a yielded value."""
    def resume(self: nn.Module, call: Any, *args: Any) -> Any:
        with _running(self):
            return call(*args)

    @functools.wraps(fn)
    def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        gen = fn(self, *args, **kwargs)
        try:
            value = resume(self, gen.send, None)
            while True:
                try:
                    sent = yield value
                except GeneratorExit:
                    resume(self, gen.close)
                    raise
                except BaseException as e:     # thrown in: passed on to the user's generator
                    value = resume(self, gen.throw, e)
                else:
                    value = resume(self, gen.send, sent)
        except StopIteration as stop:
            return stop.value
    return method


def _user_methods(user_cls: type) -> dict[str, Any]:
    """The plain functions the user's class and its bases (up to ``nn.Module``) define, other
    than ``forward`` and special methods, each wrapped by :func:`_in_method`; the getters of its
    properties and ``functools.cached_property`` too (``self.embeddings`` computed by calling
    ``self.encoder``), as the first class in the MRO defines each name."""
    out: dict[str, Any] = {}
    seen: set[str] = set()
    for klass in user_cls.__mro__:
        if klass in (nn.Module, object) or issubclass(nn.Module, klass):
            continue
        for name, v in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            if name == "forward" or name.startswith("__") or hasattr(fx.GraphModule, name):
                continue
            if inspect.isfunction(v):
                out[name] = (_in_generator(v) if inspect.isgeneratorfunction(v)
                             else _in_method(v))
            elif isinstance(v, property) and (v.fget or v.fset or v.fdel) is not None:
                # its setter and deleter too (``model.temperature = t`` recomputing a cached
                # code by calling ``self.encoder``): each runs like a method; one calling no
                # module (``device``, ``num_blocks``) as it is
                def wrap(f: Any) -> Any:
                    return f if _calls_no_module(f) else _in_method(f)
                w = v.getter(wrap(v.fget)) if v.fget is not None else v
                w = w.setter(wrap(v.fset)) if v.fset is not None else w
                out[name] = w.deleter(wrap(v.fdel)) if v.fdel is not None else w
            elif isinstance(v, functools.cached_property):
                out[name] = functools.cached_property(_in_method(v.func))
    return out


def _self_path(node: ast.AST, me: str = "self") -> str | None:
    """``self.a.b[0]`` -> ``"a.b.0"`` (attribute and constant-index chains from ``self``, by
    the name ``me`` the method gives it)."""
    parts: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and \
                isinstance(node.slice.value, (int, str)):
            parts.append(str(node.slice.value))
            node = node.value
        elif isinstance(node, ast.Name) and node.id == me and parts:
            return ".".join(reversed(parts))
        else:
            return None


#: uses of a parameter that compute nothing with it (initialization, inspection, in place)
_NOT_COMPUTING = {"data", "grad", "shape", "size", "dtype", "device", "numel", "dim", "ndim",
                  "requires_grad", "is_leaf", "nelement", "element_size",
                  # torch layers' configuration (``self.fc.out_features``): numbers, not calls
                  "in_features", "out_features", "in_channels", "out_channels", "kernel_size",
                  "stride", "padding", "dilation", "groups", "num_embeddings", "embedding_dim",
                  "normalized_shape", "num_features", "eps", "embed_dim", "num_heads",
                  "hidden_size", "input_size", "num_layers", "training"}


def _computes(n: ast.AST, parent: dict) -> bool:
    """Whether the read ``n`` (``self.head.weight``) computes with the value: not an in-place
    method or attribute of it (``.data``, ``.zero_()``, ``.shape``), nor an argument of an
    ``init`` function (``nn.init.zeros_(self.head.bias)``), nor the value of an attribute
    assignment (``self.decoder.weight = self.encoder.weight`` ties the two, computes nothing)."""
    up = parent.get(n)
    if isinstance(up, ast.Assign) and up.value is n and \
            all(isinstance(t, ast.Attribute) for t in up.targets):
        return False        # weight tying: self.decoder.weight = self.encoder.weight
    if isinstance(up, ast.Attribute) and up.value is n:
        return not (up.attr in _NOT_COMPUTING or up.attr.endswith("_"))
    if isinstance(up, ast.Call) and n in up.args:
        func = ast.unparse(up.func)
        return not ("init." in func or func.rpartition(".")[2].endswith("_"))
    return True


def direct_reads(user_cls: type, paths: set[str]) -> list[str]:
    """The user's methods (other than ``forward``, which the trace sees) that read the weight or
    bias of a module in ``paths`` (the modules whose call carries constants) outside a call of
    it (``F.linear(h, self.head.weight, self.head.bias)``), or call its ``forward`` directly
    (``self.head.forward(h)``, which runs no hook): a call of the module sees its constants,
    such a read sees the bare parameter, so the method computes without them.  One line each,
    for the report (from the methods' source; a method without source is not read)."""
    out: list[str] = []
    for klass in user_cls.__mro__:
        if klass in (nn.Module, object) or issubclass(nn.Module, klass):
            continue
        for name, fn in vars(klass).items():
            # forward: the trace sees it; __init__ and other special methods do not compute
            # on the result (``self.out.weight = self.emb.weight`` ties, it reads nothing)
            skip = name == "forward" or (name.startswith("__") and name.endswith("__"))
            # a property's getter computes on the result like a method (its mirror hooks)
            fn = fn.fget if isinstance(fn, property) else \
                fn.func if isinstance(fn, functools.cached_property) else fn
            tree = _source_tree(fn) if not skip else None
            if tree is None:
                continue
            me = _self_name(tree)
            parent = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
            reads: dict[str, set[str]] = {}
            forwards: set[str] = set()
            for n in ast.walk(tree):
                if isinstance(n, ast.Attribute) and n.attr in ("weight", "bias") and \
                        isinstance(n.ctx, ast.Load) and _computes(n, parent) and \
                        (p := _self_path(n.value, me)) in paths:
                    reads.setdefault(p, set()).add(n.attr)
                # self.head.forward(h): the module's hooks (the constants' mirror) do not run
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                        n.func.attr == "forward" and (p := _self_path(n.func.value, me)) in paths:
                    forwards.add(p)
            lines = [f"method {name} reads "
                     f"{' and '.join(f'self.{p}.{a}' for a in sorted(reads[p], reverse=True))} "
                     f"outside a call of self.{p}: it computes without the constants there "
                     f"(call the module, or fold the model)" for p in sorted(reads)]
            lines += [f"method {name} calls self.{p}.forward(...), which runs no hook: it "
                      f"computes without the constants there (call the module, self.{p}(...), "
                      f"or fold the model)" for p in sorted(forwards)]
            out += [line for line in lines if line not in out]
    return out


def _library_class(klass: type) -> bool:
    """Whether ``klass`` comes from an installed package (``site-packages``), not the user's
    own code (its methods are not the user's to check)."""
    try:
        path = inspect.getsourcefile(klass) or ""
    except (TypeError, OSError):
        return True
    return "site-packages" in path or "dist-packages" in path


def _runs(n: ast.AST, parent: dict) -> bool:
    """Whether the read ``self.<child>`` runs the child: called (``self.enc(x)``), passed to a
    call (``reversed(self.layers)``), iterated, indexed (``self.layers[0](x)``) or read further
    (``self.head.weight @ h``; not ``.data``, ``.shape``, an in-place method); not returned,
    stored or assigned (``get_classifier``, ``reset_classifier``)."""
    up = parent.get(n)
    if isinstance(up, ast.Call):
        return True
    if isinstance(up, ast.For):
        return up.iter is n
    if isinstance(up, ast.Subscript):
        return up.value is n
    if isinstance(up, ast.Attribute):
        return not (up.attr in _NOT_COMPUTING or up.attr.endswith("_"))
    return False


def own_code_methods(user_cls: type, children: set[str]) -> list[str]:
    """The methods of the user's own classes (not an installed library's) other than
    ``forward`` that run the user's code on the submodules (they read ``self.<child>`` for a
    child in ``children``, or call such a method: ``sample`` calling ``self.inverse``): an
    ``inverse`` or ``encode`` calling the layers itself.  Such a method computes without the
    constants only the graph's forward applies, also where it calls ``self(...)`` or
    ``self.forward(...)`` besides (a test-time augmentation averaging ``self(x)`` with
    ``self.head(self.body(x.flip(-1)))``: that part runs without them); one that only calls
    ``self(...)`` runs the rewritten graph (see :func:`also_forward`).  The library's methods
    they call are read for what they run (``self._ff_block(x)``), not named themselves."""
    found: dict[str, tuple[bool, bool, set[str], bool]] = {}  # name -> graph, reads, calls,
    #                                                              returns a child
    for klass in user_cls.__mro__:
        if klass in (nn.Module, object) or issubclass(nn.Module, klass):
            continue
        for name, fn in vars(klass).items():
            if name in found or name == "forward" or name.startswith("__") or \
                    _library_class(klass):
                continue
            got = _scan(fn, children)
            if got is not None:
                found[name] = got
    # an installed library's method one of them calls (``self._ff_block(x)`` of a subclass of
    # nn.TransformerEncoderLayer) runs the layers for it: read where called, not said itself
    lib: dict[str, tuple[bool, bool, set[str], bool]] = {}
    todo = {c for _, _, cs, _ in found.values() for c in cs} - set(found)
    while todo:
        name = todo.pop()
        if name in lib or name in found or name == "forward" or name.startswith("__"):
            continue
        owner = next((k for k in user_cls.__mro__ if name in vars(k)), None)
        if owner is None or owner in (nn.Module, object) or issubclass(nn.Module, owner):
            continue
        got = _scan(vars(owner)[name], children)
        if got is not None:
            lib[name] = got
            todo |= got[2] - set(found) - set(lib)
    every = {**lib, **found}
    # a method running a submodule another method returns (self.get_input_embeddings()(ids))
    given = {f"{k}()" for k, (_, _, _, ret) in every.items() if ret}
    out = {k for k, (_, r, c, _) in every.items() if r or c & given}
    while True:         # a method calling one of them (sample -> inverse) computes the same
        more = {k for k, (_, _, c, _) in every.items() if c & out} - out
        if not more:
            _ALSO_FORWARD[user_cls] = [k for k in found if k in out and found[k][0]]
            return [k for k in found if k in out]
        out |= more


def _scan(fn: Any, children: set[str]) -> tuple[bool, bool, set[str], bool] | None:
    """For :func:`own_code_methods`: whether the method ``fn`` (a property's getter, a cached
    property's function) calls ``self(...)``/``self.forward(...)``, whether it runs a child in
    ``children``, the names it reads from ``self`` (``m()`` for a ``self.m()`` whose result it
    runs), and whether it returns a child itself (``return self.embed``: a
    ``get_input_embeddings``, which a caller then runs); None where no source is found."""
    fn = fn.fget if isinstance(fn, property) else \
        fn.func if isinstance(fn, functools.cached_property) else fn
    tree = _source_tree(fn)
    if tree is None:
        return None
    me = _self_name(tree)
    parent = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    graph = reads = returns = False
    calls: set[str] = set()
    for n in ast.walk(tree):
        own = isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and \
            n.value.id == me
        if isinstance(n, ast.Call) and (isinstance(n.func, ast.Name) and
                                        n.func.id == me or _self_forward(n.func, me)):
            graph = True        # self(x) / self.forward(x): the graph, constants in
        reads = reads or (own and n.attr in children and _runs(n, parent))
        if own:
            calls.add(n.attr)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                isinstance(n.func.value, ast.Name) and n.func.value.id == me and \
                _runs(n, parent):   # self.get_input_embeddings()(ids), for b in self.blocks()
            calls.add(n.func.attr + "()")       # runs what that method returns
        returns = returns or (own and n.attr in children and
                              isinstance(parent.get(n), ast.Return))
    return graph, reads, calls, returns


#: the methods :func:`own_code_methods` found last for a class that also call ``self(...)``
_ALSO_FORWARD: "weakref.WeakKeyDictionary[type, list[str]]" = weakref.WeakKeyDictionary()


def also_forward(user_cls: type) -> list[str]:
    """Of the methods :func:`own_code_methods` returned for ``user_cls``, those that call
    ``self(...)`` or ``self.forward(...)`` too (partly through the rewritten graph)."""
    return list(_ALSO_FORWARD.get(user_cls, []))


def carrier_methods(model: nn.Module, carriers: set[str]) -> list[tuple[str, list[str], dict]]:
    """For each module at a path in ``carriers`` (not the root) of the user's own class (not
    torch's or an installed library's) that holds constants other than 1 (an eager or export
    result: applied by hooks on its call), the methods of its class other than ``forward``
    that run its submodules (:func:`own_code_methods`: a coupling layer's ``inverse``): they
    run none of those hooks, so they compute without the constants.  ``(path, methods,
    {constant: value})`` each (one entry per class: its first such module)."""
    out: list[tuple[str, list[str], dict]] = []
    seen: set[type] = set()
    for path in sorted(carriers):
        m = model.get_submodule(path) if path else None
        if m is None or type(m) in seen or _library_class(type(m)):
            continue
        consts = {n: float(b.reshape(-1)[0]) for n, b in m._buffers.items()
                  if n.startswith(PREFIX) and b is not None and b.numel() and
                  not b.is_meta and not bool((b == 1).all())}
        if not consts:
            continue
        methods = own_code_methods(type(m), {n for n, _ in m.named_children()})
        if methods:
            seen.add(type(m))
            out.append((path, methods, consts))
    return out


def _self_forward(func: ast.AST, me: str) -> bool:
    """Whether ``func`` is ``self.forward`` (by the name ``me`` the method gives ``self``)."""
    return isinstance(func, ast.Attribute) and func.attr == "forward" and \
        isinstance(func.value, ast.Name) and func.value.id == me


def _no_slices(getitem: Any) -> Any:
    """``result[a:b]`` of an ``nn.Sequential`` or ``nn.ModuleList`` result: torch builds the
    slice as ``self.__class__(...)``, the GraphModule class, which failed deep in torch
    (``'GraphModuleImpl' object has no attribute '_backward_hooks'``); and the modules alone
    compute without the constants the graph applies.  Refused with what to do; an index
    (``result[0]``) returns the module as before."""
    def __getitem__(self: Any, idx: Any) -> Any:
        if isinstance(idx, slice):
            from precondfx.errors import PrecondError
            raise PrecondError(
                f"a slice of the rewritten {self._precondfx_user_class.__name__} (fx "
                f"capture) holds its modules without the constants its graph applies around "
                f"them (alphas, lr multipliers, the output scale), so it would compute "
                f"another function: slice "
                f"precondfx.fold(result) (the constants multiplied into the weights), or "
                f"precondition with capture='eager' (the constants ride on the modules)")
        return getitem(self, idx)
    return __getitem__


def own_class(cls: type) -> type:
    """``cls``, or for torch.fx's per-instance ``GraphModuleImpl`` (every GraphModule's type) the
    class it was made for (``fx.GraphModule``, or the user's subclass of it)."""
    return next(t for t in cls.__mro__ if t.__qualname__.rpartition(".")[2] != "GraphModuleImpl")


@functools.lru_cache(maxsize=None)
def graph_class(user_cls: type) -> type | None:
    """``Preconditioned<user_cls>``: a GraphModule subclass that is also ``user_cls`` (None
    where the two classes cannot be combined).  For a GraphModule (``fx.symbolic_trace``'s, or a
    subclass of it), the class it is an instance of past torch.fx's per-instance
    ``GraphModuleImpl``: ``PreconditionedGraphModule`` is the fallback result's class."""
    if not issubclass(user_cls, nn.Module):
        return None
    bases: tuple[type, ...] = (fx.GraphModule, user_cls)
    if issubclass(user_cls, fx.GraphModule):
        if "_precondfx_user_class" in vars(user_cls):
            return user_cls
        base = own_class(user_cls)
        if base is not user_cls:
            return graph_class(base)
        bases = (user_cls,)
    ns = {"__module__": __name__, "__doc__": user_cls.__doc__,
          "recompile": _recompile, "__deepcopy__": _deepcopy, "__copy__": _copy,
          "__reduce__": _reduce, "__setstate__": _setstate, METHODS: 0,
          "__prepare_scriptable__": _scriptable,
          "_precondfx_user_class": user_cls,
          # repr() names the user's class, not torch.fx's per-instance "GraphModuleImpl"
          "_get_name": lambda self: user_cls.__name__, **_user_methods(user_cls)}
    if issubclass(user_cls, (nn.Sequential, nn.ModuleList)):
        ns["__getitem__"] = _no_slices(user_cls.__getitem__)
    try:
        return type(f"Preconditioned{user_cls.__name__}", bases, ns)
    except TypeError:       # a metaclass or layout conflict
        return None


# -- building it ---------------------------------------------------------------------------------
def _resolves(root: nn.Module, target: str) -> bool:
    obj: Any = root
    for part in target.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def adopt(gm: fx.GraphModule, work: nn.Module) -> tuple[fx.GraphModule, str | None]:
    """``gm``'s graph on ``work``'s own module tree, as ``Preconditioned<type(work)>``; with why
    not (``gm`` as ``PreconditionedGraphModule``, :func:`plain_result`, is returned) where the
    class cannot be combined or the tree does not hold what the graph reads."""
    cls = graph_class(type(work))
    if cls is None:
        return plain_result(gm), (f"the class {type(work).__name__} cannot be combined with "
                                  f"GraphModule")
    d = dict(gm.__dict__)
    d.update({k: v for k, v in vars(work).items() if k not in _GM_KEYS})
    for k, v in vars(work).items():     # its own hook dicts (the same hooks): one registered
        if k.startswith("_") and "hooks" in k and isinstance(v, dict):    # on it stays its own
            d[k] = type(v)(v)
    d["_modules"] = collections.OrderedDict(work._modules)
    d["_parameters"] = collections.OrderedDict(work._parameters)
    d["_buffers"] = collections.OrderedDict(work._buffers)
    d["_non_persistent_buffers_set"] = set(work._non_persistent_buffers_set)
    d[METHODS] = 0
    res = cls.__new__(cls)
    res.__dict__.update(d)
    # what fx added: dropout modules for functional dropout, tensor constants as buffers
    for path, m in gm.named_modules():
        if path and not _resolves(res, path):
            parent, _, leaf = path.rpartition(".")
            if parent and not _resolves(res, parent):
                return plain_result(gm), (f"the traced graph calls {path}, which the model "
                                          f"does not hold")
            (res.get_submodule(parent) if parent else res).add_module(leaf, m)
    for name, t in gm.named_buffers():
        if _resolves(res, name):
            continue
        path, _, leaf = name.rpartition(".")
        src = gm.get_submodule(path) if path else gm
        (res.get_submodule(path) if path else res).register_buffer(
            leaf, t, persistent=leaf not in src._non_persistent_buffers_set)
    missing = [str(n.target) for n in gm.graph.nodes if n.op in ("get_attr", "call_module")
               and not _resolves(res, str(n.target))]
    if missing:
        return plain_result(gm), (f"the traced graph reads {missing[0]}, which the model "
                                  f"does not hold")
    res.graph = gm.graph        # owning module and generated code (gated forward)
    return res, None


def plain_result(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as ``PreconditionedGraphModule`` (of its own GraphModule class), where the result
    cannot be of the user's class: what the user-class result has that a GraphModule lacks
    (``torch.jit.script`` of the constants-on-weights calls, the traced-attribute check, the
    pickling and copying that keep it) on the GraphModule."""
    cls = graph_class(type(gm))
    if cls is None:
        return gm
    res = cls.__new__(cls)
    res.__dict__.update(gm.__dict__)
    res.__dict__[METHODS] = 0
    res.graph = gm.graph
    return res


def is_user_graph(model: nn.Module) -> bool:
    return isinstance(model, fx.GraphModule) and hasattr(type(model), "_precondfx_user_class")


# -- the mirror hooks ----------------------------------------------------------------------------
def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal constants; on the meta device (no values yet: the plan sets them equal) True."""
    return a.is_meta or b.is_meta or torch.equal(a, b)


def _mirrored(root: nn.Module, names: tuple[str, ...], path: str) -> torch.Tensor:
    """The constant a mirror hook applies: ``names`` holds the one the graph applies at each
    call of the module (a module forward calls more than once: a shared tower, a block applied
    twice); they are equal by the plan (one weight, one alpha), and a method cannot tell
    which call it makes, so unequal ones are refused rather than one picked."""
    c = getattr(root, names[0])
    for n in names[1:]:
        if not _same(getattr(root, n), c):
            from precondfx.errors import PrecondError
            raise PrecondError(
                f"{path} is called {len(names)} times by forward, with different constants "
                f"({names[0]}={float(c):.6g}, {n}={float(getattr(root, n)):.6g}): a method of "
                f"your class calling it cannot apply the right one. Call the model's forward, "
                f"or precondition with capture='eager' (constants on the modules themselves)")
    return c


class _Inert:
    """What a mirror hook becomes in a copy or a pickle of its module (``copy.deepcopy(
    self.encoder)`` or ``torch.save(self, path)`` in one of your methods, while the hooks are
    installed): nothing, as in a copy made outside a method (the copy is a plain module; the
    result installs hooks on its own modules at each method call).  It removes itself at its
    first call, so that the copy runs as a module without hooks (``weight_side.layer`` takes
    the constants-on-weights path only there)."""

    def __call__(self, m: nn.Module, *args: Any) -> None:
        for attr in ("_forward_hooks", "_forward_pre_hooks"):
            hooks = m.__dict__.get(attr) or {}
            for key in [k for k, h in hooks.items() if h is self]:
                del hooks[key]
                for aux in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                            "_forward_pre_hooks_with_kwargs"):
                    (m.__dict__.get(aux) or {}).pop(key, None)
        return None

    def __reduce__(self) -> tuple:
        return (_Inert, ())


class _Mirror:
    """A mirror hook: applies ``root``'s constant ``names`` on the output (``where='out'``) or
    the first input ('in') of the module at ``path``, in a thread running one of ``root``'s
    methods.  Its copies and pickles are :class:`_Inert` (before, a copy made in a method kept
    the hook, acting on ``root``'s constants at its later calls, and ``torch.save`` of it
    failed: a local function cannot be pickled)."""

    def __init__(self, root: nn.Module, names: tuple[str, ...], path: str, where: str) -> None:
        self.root, self.names, self.path, self.where = root, names, path, where

    def __call__(self, m: nn.Module, args: tuple, *out: Any) -> Any:
        if not _mirroring(self.root):
            return None
        if self.where == "out":
            return times_first(out[0], _mirrored(self.root, self.names, self.path))
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        return (args[0] * _mirrored(self.root, self.names, self.path),) + tuple(args[1:])

    def __deepcopy__(self, memo: dict) -> _Inert:
        return _Inert()

    def __reduce__(self) -> tuple:
        return (_Inert, ())


def _install(root: nn.Module) -> list[Any]:
    """Register the mirror hooks ``root`` records (``MIRRORS``: (module path, 'out' or 'in',
    the constant at each of the module's calls in the graph)); returns their handles.  Each
    reads the constant from ``root`` when it runs and acts only in a thread running one of
    ``root``'s methods, not inside its graph forward (:func:`_mirroring`)."""
    handles = []
    for path, where, names in root.__dict__.get(MIRRORS, ()):
        names = (names,) if isinstance(names, str) else tuple(names)
        mod: Any = root     # get_submodule's walk, without its checks (3x the install)
        for part in path.split(".") if path else ():
            mod = mod.__dict__["_modules"].get(part) if isinstance(mod, nn.Module) else None
        if not isinstance(mod, nn.Module):  # removed by the user: nothing to mirror
            continue
        hook = _Mirror(root, names, path, where)
        handles.append(mod.register_forward_hook(hook) if where == "out"
                       else mod.register_forward_pre_hook(hook))
    return handles


def _const_of(n: fx.Node, consts: set[str]) -> tuple[fx.Node, str] | None:
    """``(x, c)`` for a node ``x * c`` with ``c`` one of the root's constants."""
    if n.op != "call_function" or n.target is not operator.mul or len(n.args) != 2 or n.kwargs:
        return None
    a, b = n.args
    for x, c in ((a, b), (b, a)):
        if isinstance(c, fx.Node) and c.op == "get_attr" and c.target in consts and \
                isinstance(x, fx.Node):
            return x, str(c.target)
    return None


def _tensor_inputs(n: fx.Node) -> list[fx.Node]:
    return [a for a in n.all_input_nodes if a.op != "get_attr"]


def mirror(res: fx.GraphModule, kinds: dict[str, str], placed: dict[str, str] | None = None
           ) -> tuple[list[str], list[str]]:
    """Record (``MIRRORS``) the hooks that apply, while a user's method runs (not in the
    graph's forward), each constant the graph multiplies in at a
    module's output (up through ops that commute with a positive scale) or at its first input;
    returns the constants mirrored and those only the forward applies (``kinds``: node name ->
    kind, from the captured graph; ``placed``: constant -> 'in' or 'out', the side of the node
    the plan put it on, tried first: an alpha on a layer's input is mirrored on that layer,
    not on the output of the module before it, so a method returning that module's output
    (``encode`` before a decoder) returns it without the next layer's alpha)."""
    consts = {n for n in res._buffers if n.startswith(PREFIX)}
    nodes = list(res.graph.nodes)
    calls = collections.Counter(str(n.target) for n in nodes if n.op == "call_module")
    owners = collections.Counter(id(m) for _, m in res.named_modules(remove_duplicate=False))

    def module_of(n: fx.Node, shared: bool) -> fx.Node | None:
        """``n`` if it calls a module held at one path and called once (or more: ``shared``)."""
        if n.op != "call_module" or (calls[str(n.target)] != 1 and not shared):
            return None
        return n if owners[id(res.get_submodule(str(n.target)))] == 1 else None

    def output_site(x: fx.Node, c: fx.Node, through: bool, shared: bool) -> fx.Node | None:
        cur, user = x, c
        while True:
            if set(cur.users) != {user}:
                return None
            call = module_of(cur, shared)
            if call is not None:
                return call
            inner = _const_of(cur, consts)
            ins = _tensor_inputs(cur)
            if inner is not None:
                cur, user = inner[0], cur
            elif through and kinds.get(cur.name) in PASS_THROUGH and len(ins) == 1:
                cur, user = ins[0], cur
            else:
                return None

    def input_site(m: fx.Node, shared: bool) -> fx.Node | None:
        cur = m
        while len(cur.users) == 1:
            (u,) = cur.users
            if _const_of(u, consts) is not None:
                cur = u
                continue
            call = module_of(u, shared)
            return call if call is not None and u.args and u.args[0] is cur else None
        return None

    only: list[str] = []
    # (module path, 'out' or 'in') -> call node -> the constants there, in graph order
    found: dict[tuple[str, str], dict[fx.Node, list[str]]] = {}
    for n in nodes:
        got = _const_of(n, consts)
        if got is None:
            continue
        x, name = got
        # where the value is scaled exactly as the graph scales it: the producing module's
        # output, else the consuming module's input, else (through ops commuting with a
        # positive scale) an upstream module's output, whose intermediates then differ from
        # the graph's by the factor (a value returned between them would show it)
        # (a module called more than once, only where no module called once is found)
        first_in = (placed or {}).get(name) == "in"
        # an alpha on a layer's input belongs to that layer, also one forward calls more than
        # once (a block applied in a loop): taken upstream (through a relu, the previous
        # layer's output), only the first call's would be mirrored, the others' left out
        inp = (input_site(n, False) or input_site(n, True)) if first_in else None
        for shared in (False, True):
            if inp is not None:
                out = up = None
                break
            inp = input_site(n, shared) if first_in else None
            out = output_site(x, n, through=False, shared=shared) if inp is None else None
            inp = input_site(n, shared) if out is None and not first_in else inp
            up = output_site(x, n, through=True, shared=shared) \
                if out is None and inp is None and not shared else None
            if out or up or inp:
                break
        if out or up or inp:
            call, where = (out or up, "out") if out or up else (inp, "in")
            found.setdefault((str(call.target), where), {}).setdefault(call, []).append(name)
        else:
            only.append(name)
    # a module the graph calls k times is mirrored where each of its calls carries the same
    # number of constants there, of equal values: the i-th of each call, together (one hook,
    # :func:`_mirrored`: a method's call of the module gets the value every call has)
    done: list[str] = []
    sites: list[tuple[str, str, tuple[str, ...]]] = []
    for (path, where), per_call in found.items():
        lists = list(per_call.values())
        groups = list(zip(*lists))
        if len(per_call) != calls[path] or len({len(v) for v in lists}) != 1 or \
                any(not all(_same(res.get_buffer(c), res.get_buffer(g[0])) for c in g)
                    for g in groups):
            only += [c for v in lists for c in v]
            continue
        for group in groups:
            sites.append((path, where, tuple(group)))
            done += list(group)
    res.__dict__[MIRRORS] = tuple(sites)
    return done, only


# -- checkpoints ---------------------------------------------------------------------------------
def _constant_keys(module: nn.Module, prefix: str) -> tuple[list[str], list[str]]:
    """The state-dict keys of ``module`` (under ``prefix``): its persistent precondfx constants,
    and its parameters (which a checkpoint of the model before precondition also holds)."""
    consts: list[str] = []
    params: list[str] = []
    for path, m in module.named_modules(prefix=prefix.rstrip(".")):
        dot = f"{path}." if path else ""
        consts += [dot + n for n, b in m._buffers.items() if b is not None and
                   n.startswith(PREFIX) and n not in m._non_persistent_buffers_set]
        params += [dot + n for n, p in m._parameters.items() if p is not None]
    return consts, params


def _refuse_plain_checkpoint(module: nn.Module, state_dict: dict, prefix: str, meta: Any,
                             strict: bool, missing: list, unexpected: list,
                             errors: list) -> None:
    """``load_state_dict`` pre-hook of a result: refuse a state dict that holds the model's
    weights but none of its persistent constants (a checkpoint saved before precondition, or
    of the folded model).  Loaded, with ``strict=False``, its weights would come back at the
    scale of the model it was saved from while the constants stay: the result would compute
    another function, silently."""
    consts, params = _constant_keys(module, prefix)
    if not consts or any(k in state_dict for k in consts):
        return
    held = [k for k in params if k in state_dict]
    if not held:
        return
    from precondfx.errors import PrecondError
    theirs = [k for k in state_dict if k.startswith(prefix) and PREFIX in k]
    if theirs:
        raise PrecondError(
            f"this state dict holds the preconditioned model's weights (e.g. {held[0]}) with "
            f"precondfx constants named otherwise ({theirs[0]}; this model has {consts[0]}): it "
            f"was saved from a result preconditioned another way (another capture: fx keeps the "
            f"constants on the model, export and eager on each layer). Load it into a model "
            f"preconditioned with the same options, or fold that one (precondfx.fold) and "
            f"load the plain state dict into your original model")
    raise PrecondError(
        f"this state dict holds {len(held)} of the preconditioned model's weights (e.g. "
        f"{held[0]}) but none of its {len(consts)} precondfx constants (e.g. {consts[0]}): it "
        f"was saved before precondition (or from precondfx.fold's plain model). Loaded into the "
        f"result, its weights would multiply the result's constants, a different function "
        f"(strict=False would do it silently). Write its weights as the result's storage with "
        f"load_state_dict(precondfx.unfold(result, state_dict)), load it into your original "
        f"model instead and precondition that (reinit_weights=False keeps the loaded weights), "
        f"or load a state dict saved from a preconditioned model (it holds the precondfx_* "
        f"entries)")


#: the ``state_dict`` metadata entry a module of a result writes (:class:`_Mark`)
SAVED = "precondfx_storage"


class _Mark:
    """``state_dict`` post-hook on the module at ``path`` of a result: its entry in the state
    dict's metadata says the weights are the result's storage (``torch.save``/``load`` keep
    it); not in a state dict of the root where the root folds the constants into the weights
    (a transformers result's: those weights are plain)."""

    def __init__(self, path: str, root_folds: bool) -> None:
        self.path, self.root_folds = path, root_folds

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str,
                 local_metadata: dict) -> None:
        if not (self.root_folds and prefix.endswith(f"{self.path}.")):
            local_metadata[SAVED] = True
            for n, p in module._parameters.items():     # a copy of the dict keeps these
                t = state_dict.get(prefix + n)
                if p is not None and isinstance(t, torch.Tensor):
                    _stored(t)


#: id of a tensor a result's part put into a state dict -> a weak reference to it: a state
#: dict copied into a new dict (``dict(sd)``, a comprehension) holds the same tensors, though
#: not the metadata :class:`_Mark` writes
_STORED: dict[int, Any] = {}


def _stored(t: torch.Tensor) -> None:
    """Remember ``t`` as the result's storage (until it is collected)."""
    key = id(t)
    _STORED[key] = weakref.ref(t, lambda _r, key=key: _STORED.pop(key, None))


def _is_stored(t: Any) -> bool:
    """Whether ``t`` is a tensor a result's state dict holds (:func:`_stored`)."""
    r = _STORED.get(id(t))
    return r is not None and r() is t


#: the attribute of a result holding the load into a part in progress (:class:`_SubLoaded`)
LOADING = "_precondfx_loading"


class _SubCheckpoint:
    """``load_state_dict`` pre-hook on the module at ``path`` of a result whose state dicts of
    a part hold no constants (a GraphModule result: they sit on the root; a transformers result:
    they are not saved): a state dict loaded into the module itself or a module above it other
    than the root (``result.encoder.load_state_dict(torch.load("encoder.pt"))``) without
    :class:`_Mark`'s entry (saved from your model before precondition) is said with a
    ``RuntimeWarning`` where the module's call carries a constant other than 1: its weights
    would run under the result's constants, another function, silently (before: accepted
    without a word).  A load through the root (or a model holding it) is the root's."""

    def __init__(self, root: nn.Module, path: str) -> None:
        self.root, self.path = weakref.ref(root), path

    def __deepcopy__(self, memo: dict) -> "_SubCheckpoint":
        root = self.root()      # the copy of the root, where the root is copied with it
        return _SubCheckpoint(memo.get(id(root), root), self.path) if root is not None \
            else self

    def __reduce__(self) -> tuple:
        return (_SubCheckpoint, (self.root(), self.path))

    def _constants(self, root: nn.Module, module: nn.Module) -> dict[str, torch.Tensor]:
        if is_user_graph(root):
            return {n: getattr(root, n) for path, _, group in root.__dict__.get(MIRRORS, ())
                    if path == self.path
                    for n in ((group,) if isinstance(group, str) else group)}
        return {f"{self.path}.{n}": b for n, b in module._buffers.items()
                if n.startswith(PREFIX) and b is not None}

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, meta: Any,
                 strict: bool = True, missing: Any = None, *rest: Any) -> None:
        root = self.root()
        if root is None or prefix.endswith(f"{self.path}.") or (meta or {}).get(SAVED):
            return
        # the result's own tensors, copied into a new dict (no metadata): its storage
        held = [prefix + n for n, p in module._parameters.items()
                if p is not None and prefix + n in state_dict and
                not _is_stored(state_dict[prefix + n])]
        off = {n: c for n, c in self._constants(root, module).items()
               if not c.is_meta and not bool((c == 1).all())}
        if not held or not off:
            return
        # a copy of the storage (an EMA): near it, unless plain weights were loaded here before
        plain = root.__dict__.setdefault(PLAIN, set())
        if self.path not in plain and _near_storage(module, state_dict, prefix, off):
            return
        plain.add(self.path)
        # said once per load, by the module loaded (:class:`_SubLoaded`), for every layer
        top = self.path[:len(self.path) - len(prefix)].rstrip(".") if prefix else self.path
        rec = root.__dict__.get(LOADING)
        if rec is None or rec["keys"] is not missing or missing is None:
            rec = root.__dict__[LOADING] = {"keys": missing, "top": top, "held": [],
                                            "paths": [], "off": {}}
        rec["held"] += held
        rec["paths"].append(self.path)
        rec["off"].update(off)
        if missing is None:         # called outside load_state_dict: said here
            _say_plain_load(root, root.__dict__.pop(LOADING), 5)


#: the attribute of a result holding the paths of its parts plain weights were loaded into
#: (:class:`_SubCheckpoint`: their storage is no longer the result's)
PLAIN = "_precondfx_plain_loaded"
#: a state dict's weights within this share of the way from the result's storage to the plain
#: weights of the same function (the storage times the module's constants) are the storage, a
#: copy of it (an EMA, ``{k: v.clone()}``): at most this share of the result's own norm too
NEAR = 0.25


def _near_storage(module: nn.Module, state_dict: dict, prefix: str,
                  off: dict[str, torch.Tensor]) -> bool:
    """Whether the weights ``state_dict`` holds for ``module`` are the result's own storage
    (copied: a clone, an EMA of it): nearer its parameters now than :data:`NEAR` of the way
    to the plain weights of the same function (the parameters times the product ``c`` of the
    module's constants, as folded), and than ``NEAR`` of their norm.  Plain weights (folded,
    or of the model before precondition) lie ``|c - 1|`` of the norm away or further."""
    c = 1.0
    for t in off.values():
        if t.numel() != 1:
            return False
        c *= float(t)
    diff = norm = 0.0
    with torch.no_grad():
        for n, p in module._parameters.items():
            t = state_dict.get(prefix + n)
            if p is None or p.is_meta or not isinstance(t, torch.Tensor):
                continue
            if t.shape != p.shape or not p.is_floating_point():
                return False
            diff += float((t.detach().to(p.device, torch.float64) - p.double()).square().sum())
            norm += float(p.double().square().sum())
    return norm > 0 and diff ** 0.5 < NEAR * min(abs(c - 1.0), 1.0) * norm ** 0.5


def _say_plain_load(root: nn.Module, rec: dict[str, Any], level: int) -> None:
    """The one warning of a load of plain weights into a part of a result (:class:`_SubCheckpoint`
    gathered what ``rec`` holds: the keys, the layers, their constants other than 1)."""
    import warnings
    held, paths, off = rec["held"], rec["paths"], rec["off"]
    shown = ", ".join(f"{n}={float(c):.4g}" if c.numel() == 1 else n
                      for n, c in list(off.items())[:3])
    warnings.warn(
        f"precondfx: load_state_dict into a part of the preconditioned "
        f"{root._get_name()} puts plain weights ({held[0]}"
        f"{f' and {len(held) - 1} more' if len(held) > 1 else ''}, not saved from a "
        f"preconditioned model: no precondfx entry in the state dict's metadata) into "
        f"{', '.join(paths[:4])}{' ...' if len(paths) > 4 else ''} ({len(paths)} layer(s)), "
        f"whose calls multiply the result's constants ({shown}"
        f"{' ...' if len(off) > 3 else ''}): it will compute another function than the model "
        f"they were saved from. Write them as the result's storage with "
        f"result.get_submodule({rec['top']!r}).load_state_dict(precondfx.unfold(result, sd, "
        f"prefix={rec['top'] + '.'!r})), load them into your original model and precondition "
        f"that (reinit_weights=False keeps them), or load a state dict saved from the result (its "
        f"state_dict(), or result.get_submodule({rec['top']!r}).state_dict(), copied or not: "
        f"those carry the mark). Weights saved from this result, copied into a new dict and "
        f"then written to a file (which keeps neither the metadata nor the tensors) load as "
        f"they are: ignore this warning then", RuntimeWarning, stacklevel=level)


class _SubLoaded:
    """``load_state_dict`` post-hook on each module of a result that :class:`_SubCheckpoint`
    watches, or holds one that it watches: at the end of a load into this module, the one
    warning of the plain weights found in it (before: one warning per layer)."""

    def __init__(self, root: nn.Module, path: str) -> None:
        self.root, self.path = weakref.ref(root), path

    def __deepcopy__(self, memo: dict) -> "_SubLoaded":
        root = self.root()
        return _SubLoaded(memo.get(id(root), root), self.path) if root is not None else self

    def __reduce__(self) -> tuple:
        return (_SubLoaded, (self.root(), self.path))

    def __call__(self, module: nn.Module, incompatible: Any) -> None:
        root = self.root()
        rec = root.__dict__.get(LOADING) if root is not None else None
        if rec is None or rec["top"] != self.path or \
                rec["keys"] is not getattr(incompatible, "missing_keys", None):
            return
        del root.__dict__[LOADING]
        _say_plain_load(root, rec, 5)


def guard_checkpoints(model: nn.Module) -> None:
    """Register :func:`_refuse_plain_checkpoint` on a result, and on each of its modules
    holding persistent constants (``result.encoder.load_state_dict`` of an eager or export
    result); on each module with parameters of a result whose parts' state dicts hold no
    constants (GraphModule, transformers), :class:`_SubCheckpoint` and :class:`_Mark` (once;
    ``fold`` removes them with precondfx's other hooks)."""
    hooks = getattr(model, "_load_state_dict_pre_hooks", {})
    if any(getattr(h, "hook", h) is _refuse_plain_checkpoint for h in hooks.values()):
        return
    model.register_load_state_dict_pre_hook(_refuse_plain_checkpoint)
    graph = is_user_graph(model)
    folds = any(getattr(h, "__name__", "") == "_fold_state_dict" and
                str(getattr(h, "__module__", "")).startswith("precondfx")
                for h in model._state_dict_hooks.values())
    watched: list[str] = []
    for path, m in model.named_modules():
        if not path:
            continue
        consts = [n for n, b in m._buffers.items() if n.startswith(PREFIX) and b is not None]
        if any(n not in m._non_persistent_buffers_set for n in consts):
            m.register_load_state_dict_pre_hook(_refuse_plain_checkpoint)
        elif (graph or consts) and any(p is not None for p in m._parameters.values()):
            m.register_load_state_dict_pre_hook(_SubCheckpoint(model, path))
            m.register_state_dict_post_hook(_Mark(path, folds))
            watched.append(path)
    tops = {path for w in watched for path in _and_above(w)}
    for path, m in model.named_modules():
        if path in tops:
            m.register_load_state_dict_post_hook(_SubLoaded(model, path))


def _and_above(path: str) -> list[str]:
    """``path`` and the paths of the modules holding it, the root's excepted."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


# -- optimizers built on the model before precondition -------------------------------------------
#: id of a parameter of a model given to ``precondition`` (which rewrote a copy) -> (a weak
#: reference to it, weak references to the parameters at its name in the results made from it)
_SOURCES: dict[int, tuple[Any, list[Any]]] = {}
#: the optimizers already looked at (their first step)
_CHECKED: "weakref.WeakSet[Any]" = weakref.WeakSet()
_STEP_HOOK: Any = None


def _forget(ref: Any, key: int) -> None:
    entry = _SOURCES.get(key)
    if entry is not None and entry[0] is ref:
        del _SOURCES[key]


def _stale_optimizer(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook: at an optimizer's first step, refuse one that holds the parameters
    of the model given to ``precondition`` (a copy was rewritten: those have no gradient) while
    the result's parameters at the same names have one: every step would update the model you
    do not train, and the result would never move, silently."""
    if not _SOURCES or opt in _CHECKED:
        return
    held = [p for g in opt.param_groups for p in g["params"]]
    src: list[torch.Tensor] = []
    for p in held:
        entry = _SOURCES.get(id(p))
        if entry is not None and entry[0]() is p:
            src.append(p)
    if not src or len(src) < len(held) or any(p.grad is not None for p in src):
        _CHECKED.add(opt)       # decided: not (only) the given model's, or trained
        return
    if not any(r() is not None and r().grad is not None
               for p in src for r in _SOURCES[id(p)][1]):
        return                  # no gradient anywhere yet: looked at again at the next step
    from precondfx.errors import PrecondError
    raise PrecondError(
        f"this {type(opt).__name__} holds the parameters of the model you passed to "
        f"precondfx.precondition, not those of the result it returned: precondition rewrites a "
        f"copy (your model is unchanged), so the gradients are on the result's parameters and "
        f"this step would update none of them. Build the optimizer from the result "
        f"(model, report = precondfx.precondition(model, sample); "
        f"opt = {type(opt).__name__}(model.parameters(), ...)), or pass inplace=True")


def guard_optimizers(source: nn.Module, result: nn.Module) -> None:
    """Remember ``source``'s parameters (the model given to ``precondition``) against the
    result's at the same names, for :func:`_stale_optimizer` (registered once, globally)."""
    mine = dict(result.named_parameters(remove_duplicate=False))
    for name, p in source.named_parameters(remove_duplicate=False):
        q = mine.get(name)
        if q is None or q is p:
            continue
        entry = _SOURCES.get(id(p))
        if entry is None or entry[0]() is not p:
            ref = weakref.ref(p, functools.partial(_forget, key=id(p)))
            entry = _SOURCES[id(p)] = (ref, [])
        entry[1][:] = [r for r in entry[1] if r() is not None] + [weakref.ref(q)]
    global _STEP_HOOK
    if _STEP_HOOK is None and _SOURCES:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _STEP_HOOK = register_optimizer_step_pre_hook(_stale_optimizer)


#: model rewritten in place -> names of the parameters precondition added to it (a max-pool's
#: replacement convolution), for :func:`_missing_new`
_ADDED: "weakref.WeakKeyDictionary[nn.Module, tuple[str, ...]]" = weakref.WeakKeyDictionary()
_CHECKED_ADDED: "weakref.WeakSet[Any]" = weakref.WeakSet()
_ADDED_HOOK: Any = None


def _missing_new(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook: refuse an optimizer that holds every parameter a model rewritten
    in place had before ``precondition`` but not those it added, once they have a gradient:
    built before the call (or from names that leave the new ones out), it would never move
    them (the new layers stay at their init)."""
    if not _ADDED or opt in _CHECKED_ADDED:
        return
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    pending = False
    for model, names in list(_ADDED.items()):
        params = dict(model.named_parameters())
        new = {n: params[n] for n in names if n in params}
        old = [p for n, p in params.items() if n not in new and p.requires_grad]
        if not old or not all(id(p) in held for p in old):
            continue                # not an optimizer over that whole model
        missing = [n for n, p in new.items() if p.requires_grad and id(p) not in held]
        if not missing:
            continue
        if all(new[n].grad is None for n in missing):
            pending = True          # no gradient yet: looked at again at the next step
            continue
        from precondfx.errors import PrecondError
        raise PrecondError(
            f"this {type(opt).__name__} holds every parameter {model._get_name()} had before "
            f"precondfx.precondition(..., inplace=True), but not the {len(missing)} it added "
            f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}: the convolutions "
            f"that replace max-pools): built before the call, or from parameter names that "
            f"leave these out, this step would leave them at their init. Build the optimizer "
            f"after precondition from model.parameters() "
            f"(opt = {type(opt).__name__}(model.parameters(), ...)), add them "
            f"(opt.add_param_group({{'params': [...]}})), or pass maxpool='keep'")
    if not pending:
        _CHECKED_ADDED.add(opt)


def guard_added(model: nn.Module, names: list[str]) -> None:
    """Remember the parameters ``precondition(..., inplace=True)`` added to ``model``, for
    :func:`_missing_new` (registered once, globally)."""
    _ADDED[model] = tuple(names)
    global _ADDED_HOOK
    if _ADDED_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _ADDED_HOOK = register_optimizer_step_pre_hook(_missing_new)


#: result -> (names of the trainable parameters precondition added to it (a max-pool's
#: replacement convolution), ids of its parameters), where no ``lr='auto'`` first step says
#: them (:func:`_unheld_new`)
_NEW: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple[str, ...], frozenset[int] | None]]" = \
    weakref.WeakKeyDictionary()
_NEW_HOOK: Any = None


#: the attribute of a result holding its :class:`_AddedMark` (deep copies of it are watched too)
ADDED_MARK = "_precondfx_added"


class _AddedMark:
    """The parameters ``precondition`` added to a result, kept on it: a deep copy of the
    result (a run copied from a template, ``copy.deepcopy(result)``) is watched by
    :func:`_unheld_new` like the result; a pickled copy is not."""

    def __init__(self, model: nn.Module | None, names: tuple[str, ...]) -> None:
        self.model = weakref.ref(model) if model is not None else None
        self.names = names

    def __deepcopy__(self, memo: dict) -> "_AddedMark":
        model = self.model() if self.model is not None else None
        copied = memo.get(id(model)) if model is not None else None
        if copied is None or not isinstance(copied, nn.Module):
            return _AddedMark(None, self.names)
        if model in _NEW:           # the original is still undecided: so is its copy
            _NEW[copied] = (self.names, None)
        return _AddedMark(copied, self.names)

    def __reduce__(self) -> tuple:
        return (_AddedMark, (None, self.names))


def _unheld_new(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook: at the first step of an optimizer over part of a result, say (a
    ``RuntimeWarning``, once per result) the parameters precondition added that have a gradient
    and that no optimizer's parameter group holds (groups built from parameter names leave
    them out): they would stay at their init, silently.  Decided at that step (a result is
    then no longer looked at); a result with an ``lr='auto'`` first step is left to it (it
    says the same, ``first_step._unstepped``)."""
    if not _NEW:
        return
    from precondfx.pytorch import first_step
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    for model, (names, ids) in list(_NEW.items()):
        if ids is None:             # a deep copy: its parameters' ids, known once it is built
            ids = frozenset(id(p) for p in model.parameters())
            _NEW[model] = (names, ids)
        if held.isdisjoint(ids):
            continue                # an optimizer over another model
        del _NEW[model]             # decided at this step
        if isinstance(model.__dict__.get(first_step.ATTR), first_step.Pending):
            continue
        params = dict(model.named_parameters())
        new = {n: params[n] for n in names if n in params and params[n].requires_grad}
        if model in _ADDED and all(id(p) in held for n, p in params.items()
                                   if n not in new and p.requires_grad):
            continue                # refused by _missing_new (built before an inplace call)
        out = {n: p for n, p in new.items() if id(p) not in held and p.grad is not None}
        if not out or first_step._in_a_param_group(list(out.values())):
            continue                # stepped, no gradient, or another optimizer holds them
        import warnings
        ns = list(out)
        warnings.warn(
            f"precondfx: precondition added {len(ns)} trainable parameters to "
            f"{model._get_name()} ({', '.join(ns[:4])}{' ...' if len(ns) > 4 else ''}: the "
            f"strided convolution replacing a max-pool) that no optimizer's parameter group "
            f"holds (groups built from parameter names leave them out): they get gradients "
            f"and never move from their init. Add them (by these names) to a group, build the "
            f"optimizer from model.parameters(), or precondition with maxpool='keep'",
            RuntimeWarning, stacklevel=4)


def guard_new(model: nn.Module, names: list[str]) -> None:
    """Remember the trainable parameters ``precondition`` added to ``model`` (its result), for
    :func:`_unheld_new` (registered once, globally)."""
    if not names:
        return
    _NEW[model] = (tuple(names), frozenset(id(p) for p in model.parameters()))
    model.__dict__[ADDED_MARK] = _AddedMark(model, tuple(names))
    global _NEW_HOOK
    if _NEW_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _NEW_HOOK = register_optimizer_step_pre_hook(_unheld_new)
