"""Carry a plan out on an ordinary ``nn.Module`` (when fx could not trace it): hooks and buffers.

Each constant is a persistent buffer of the module it acts on (``conv1.precondfx_alpha``), read
by a forward (pre-)hook that is a plain module-level function, so the model keeps its class and
its parameter names, and saves, loads, deep-copies and pickles.  Constants that sit on a
functional call (no module to hook) are placed on the nearest module upstream when that is
exact (through positively homogeneous ops), and otherwise reported as not applied.
Every change is logged so that it can be undone if a later stage fails.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from precondfx.core.backend import Records
from precondfx.pytorch.apply.common import PREFIX, replacement_pool, scalar_buffer, scale_at_path
from precondfx.pytorch.apply.torch_backend import TorchBackend
from precondfx.pytorch.capture.common import at_path
from precondfx.errors import PrecondError
from precondfx.core.graph import Graph
from precondfx.core.outputs import bounded_output, bounded_producer, skip_bounded
from precondfx.core.plan import Plan, Scale

_PASS_THROUGH = ("relu", "leaky_relu", "prelu", "dropout", "avgpool", "mean", "neg", "reshape",
                 "select", "pad", "cast")


@functools.lru_cache(maxsize=None)
def _first_input(cls: type) -> str | None:
    """The name of the first argument of ``cls.forward`` after ``self`` (``input`` for
    ``nn.Linear``): where a call by keyword (``self.fc(input=h)``) passes the input."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    if params and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                     inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return params[0].name
    return None


# Hooks: module-level functions reading buffers, so that models pickle and deep-copy.
def _scale_input_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """The module's input times its ``in_scale``, whether passed by position or by keyword."""
    return _times_input(module, args, kwargs, getattr(module, PREFIX + "in_scale"))


def _beta_input_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """App. E's ``1/beta_l`` on the module's input: a buffer of its own (``beta_scale``),
    apart from the alpha on the same input."""
    return _times_input(module, args, kwargs, getattr(module, PREFIX + "beta_scale"))


def _times_input(module: nn.Module, args: tuple, kwargs: dict, s: torch.Tensor) -> tuple:
    """``(args, kwargs)`` with the module's first input multiplied by ``s``."""
    if args and isinstance(args[0], torch.Tensor):
        return (args[0] * s,) + tuple(args[1:]), kwargs
    name = None if args else _first_input(type(module))
    if name is not None and isinstance(kwargs.get(name), torch.Tensor):
        return args, {**kwargs, name: kwargs[name] * s}
    return args, kwargs


def _times_first(out: Any, s: torch.Tensor) -> Any:
    """``out`` with its tensor (or a tuple's first tensor) multiplied by ``s``."""
    if isinstance(out, torch.Tensor):
        return out * s
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (out[0] * s,) + tuple(out[1:])
    return out


def _scale_output_hook(module: nn.Module, args: tuple, out: Any) -> Any:
    return _times_first(out, getattr(module, PREFIX + "out_scale"))


def _lr_scale_hook(module: nn.Module, args: tuple, out: Any) -> Any:
    """lr_scale's multiplier on a layer's output (its weight and bias are stored divided by
    it); a buffer of its own, apart from a residual branch scale on the same module."""
    return _times_first(out, getattr(module, PREFIX + "lr_scale"))


def _root_input_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    s = getattr(module, PREFIX + "input_scale")

    def f(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x * s
        return x
    return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}


def _input_module_hook(module: nn.Module, args: tuple, kwargs: dict, name: str = "") -> tuple:
    """Run the submodule ``name`` on every floating-point positional input."""
    m = getattr(module, name)
    return tuple(m(a) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args), kwargs


def _module_output_scale_hook(module: nn.Module, args: tuple, out: Any) -> Any:
    """The output scale on the module that produces the main output (e.g. ``lm_head``), so
    that everything the model computes from it inside forward (its own loss) sees it."""
    return _times_first(out, getattr(module, PREFIX + "output_scale"))


def _root_output_hook(module: nn.Module, args: tuple, out: Any) -> Any:
    path = getattr(module, PREFIX + "output_path")
    if internal_loss(out, list(path)):
        raise PrecondError(LOSS_BEFORE_SCALE)
    return scale_at_path(out, list(path), getattr(module, PREFIX + "output_scale"))


LOSS_BEFORE_SCALE = (
    "this preconditioned model computed a loss inside its forward (the output has a 'loss'), but "
    "its output scale sits on the returned value, after that loss: the loss would not see the "
    "scale.  precondfx found no module producing the main output to carry the scale.  Compute "
    "the loss outside the model from the returned output (do not pass labels), or precondition "
    "with target_std=None")


def internal_loss(out: Any, path: list) -> bool:
    """Whether a model output carries a loss computed inside forward (transformers models with
    ``labels``), other than the main output itself."""
    if not (isinstance(out, Mapping) or hasattr(out, "keys")) or isinstance(out, torch.Tensor):
        return False
    try:
        loss = out["loss"] if "loss" in out.keys() else None
    except (KeyError, TypeError):
        return False
    return isinstance(loss, torch.Tensor) and (not path or path[0] != "loss")


class EagerApplier(TorchBackend, Records):
    """The eager back end (``precondfx.core.backend.Backend``): applies pools and scales to a
    live module through hooks and module replacement, every change undoable (``rollback``).
    ``run(model)`` runs the model on the sample (to find the module producing the main
    output)."""

    name = "eager"

    def __init__(self, model: nn.Module, graph: Graph,
                 run: Callable[[nn.Module], Any] | None = None,
                 run_train: Callable[[nn.Module], Any] | None = None) -> None:
        self.model = self.module = model
        self.graph = graph
        self.runner = run
        self.train_runner = run_train   # the same run in train mode (where it differs)
        self._records()
        self.undo: list[Any] = []
        self.calls: dict[str, int] = {}
        for n in graph:
            if n.module:
                self.calls[n.module] = self.calls.get(n.module, 0) + 1
        self.users = graph.users()
        self._done_modules: dict[tuple[str, str], float] = {}
        self._swapped: set[str] = set()
        self.output_module: str | None = None

    def _like(self) -> torch.Tensor | None:
        return next(iter(self.model.parameters()), None)

    def _register(self, mod: nn.Module, name: str, value: float) -> None:
        mod.register_buffer(name, scalar_buffer(value, self._like()))
        self.undo.append(("buffer", mod, name))

    def _hook(self, handle: Any) -> None:
        self.undo.append(("hook", handle))

    def _module_scale(self, path: str, where: str, value: float, what: str,
                      skey: str | None = None, tag: str | None = None) -> str | None:
        """A constant on module ``path``'s input or output (one buffer per module and place;
        ``tag="lr"``: lr_scale's output multiplier, ``tag="beta"``: App. E's 1/beta on the
        input, each its own buffer and hook)."""
        lr = tag == "lr" and where == "output"
        beta = tag == "beta" and where == "input"
        key = (path, "lr" if lr else "beta" if beta else where)
        bname = PREFIX + ("lr_scale" if lr else "beta_scale" if beta else
                          "in_scale" if where == "input" else "out_scale")
        fqn = f"{path}.{bname}" if path else bname
        if key in self._done_modules:
            if abs(self._done_modules[key] - value) > 1e-12 * max(1.0, abs(value)):
                self._skip(skey, what, f"module {path} already carries a different {where} "
                           f"scale from another call site")
                return None
            return fqn
        mod = self.model.get_submodule(path)
        self._register(mod, bname, value)
        if where == "input":
            self._hook(mod.register_forward_pre_hook(_beta_input_hook if beta else
                                                     _scale_input_hook, with_kwargs=True))
        else:
            self._hook(mod.register_forward_hook(_lr_scale_hook if lr else _scale_output_hook))
        self._done_modules[key] = value
        return fqn

    def _upstream_module(self, name: str) -> str | None:
        """Nearest module call upstream of ``name`` through single-user homogeneous ops."""
        cur = self.graph.get(name)
        while cur is not None:
            if cur.module and self.calls.get(cur.module, 0) == 1:
                return cur.module
            if cur.kind not in _PASS_THROUGH or len(cur.inputs) != 1:
                return None
            prev = cur.inputs[0]
            if len(self.users.get(prev, [])) != 1:
                return None
            cur = self.graph.get(prev)
        return None

    def _linear_owner(self, node: Any) -> str | None:
        """The module owning a functional linear op's weight, when scaling that module's input
        (output) is exactly scaling the op's: transformers' ``Conv1D`` (GPT-2), whose forward is
        ``view -> addmm(bias, x, weight) -> view``, called once (one graph node uses the weight).
        Its ops are traced as ``addmm`` with no module of their own; the module itself can
        still carry a hook."""
        w = node.params.get("weight")
        if node.kind != "linear" or not w or not w.endswith(".weight"):
            return None
        path = w.rpartition(".")[0]
        try:
            mod = self.model.get_submodule(path)
        except AttributeError:
            return None
        cls = type(mod)
        if not (cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")
                and isinstance(getattr(mod, "nf", None), int)
                and getattr(mod, "weight", None) is not None
                and tuple(mod.weight.shape)[-1:] == (mod.nf,)):
            return None
        uses = sum(1 for n in self.graph if n.params.get("weight") == w)
        return path if uses == 1 and self.calls.get(path, 0) == 0 else None

    def scale(self, sc: Scale) -> str | None:
        node, key, what = self._scale_node(self.graph, sc, "node not in the captured graph")
        if node is None:
            return None
        if sc.where == "operand":
            src = node.inputs[sc.index] if sc.index < len(node.inputs) else None
            path = self._upstream_module(src) if src else None
            if path is None or len(self.users.get(src, [])) != 1:
                self._skip(key, what, f"the {sc.tag} operand is produced by a functional op "
                           f"with no module to hook (capture: {self.graph.method})")
                return None
            fqn = self._module_scale(path, "output", sc.value, what, key)
        elif node.module is None and sc.where in ("input", "output") and \
                self._linear_owner(node) is not None:
            fqn = self._module_scale(self._linear_owner(node), sc.where, sc.value, what, key,
                                     sc.tag)
        elif node.module is None:
            self._skip(key, what, f"functional call: no module to hook and no editable "
                       f"graph (capture: {self.graph.method})")
            return None
        else:
            fqn = self._module_scale(node.module, sc.where, sc.value, what, key, sc.tag)
        if fqn is not None:
            self._done(key, f"{what}: {sc.value:.4g}", fqn)
        return fqn

    def upstream_module(self, node: str) -> str | None:
        """The module whose output is node ``node``'s value up to a positive factor (the
        nearest single-call module upstream through homogeneous single-user ops): a scale on
        its output is a scale on the node's (None when there is none)."""
        return self._upstream_module(node)

    def pools(self, plan: Plan) -> None:
        for pc in plan.pools:
            if pc.action == "keep":
                continue
            node = self.graph.get(pc.node)
            if node is None or node.module is None:
                self._skip(f"pool:{pc.node}", f"maxpool {pc.node}", "functional max-pool: no "
                           f"module to replace and no editable graph (capture: "
                           f"{self.graph.method})")
                self.pool_notes[pc.node] = "NOT APPLIED: functional call"
                continue
            if self.calls.get(node.module, 0) > 1 and pc.action != "avgpool":
                self._skip(f"pool:{pc.node}", f"maxpool {pc.node}", "the pool module is called "
                           "more than once")
                self.pool_notes[pc.node] = "NOT APPLIED: module called twice"
                continue
            if pc.action == "fold":
                conv_node = self.graph[pc.into]
                conv = self.model.get_submodule(conv_node.module)
                self.undo.append(("attr", conv, "stride", conv.stride))
                conv.stride = tuple(pc.geometry["conv_stride"])
                self._replace(node.module, nn.Identity())
                self._done(f"pool:{pc.node}", f"maxpool {pc.node} folded into {conv_node.module}")
            else:
                mod = replacement_pool(pc, self._like())
                self._replace(node.module, mod)
                self._done(f"pool:{pc.node}",
                           f"maxpool {pc.node} replaced by {type(mod).__name__}")

    def replace(self, name: str, mod: nn.Module, path: str | None = None,
                all_calls: bool = False) -> bool:
        """Swap the module called at node ``name`` for ``mod``.  Only a module called once can
        be swapped, unless ``all_calls`` says every call of it gets the same replacement."""
        node = self.graph.get(name)
        if node is None or node.module is None:
            self._skip(f"replace:{name}", name, f"replacement: functional call, no module to swap "
                       f"and no editable graph (capture: {self.graph.method})")
            return False
        if self.calls.get(node.module, 0) > 1 and not all_calls:
            self._skip(f"replace:{name}", name, f"replacement: module {node.module} is called "
                       f"more than once")
            return False
        if node.module not in self._swapped:
            self._replace(node.module, mod)
            self._swapped.add(node.module)
        self._done(f"replace:{name}", None)
        return True

    def _replace(self, path: str, mod: nn.Module) -> None:
        parent, _, leaf = path.rpartition(".")
        p = self.model.get_submodule(parent) if parent else self.model
        self.undo.append(("module", p, leaf, getattr(p, leaf)))
        setattr(p, leaf, mod)

    def input_scale(self, value: float) -> list[str]:
        self._register(self.model, PREFIX + "input_scale", value)
        self._hook(self.model.register_forward_pre_hook(_root_input_hook, with_kwargs=True,
                                                        prepend=True))
        self._done("input", None, PREFIX + "input_scale")
        return [PREFIX + "input_scale"]

    def output_scale(self, path: list, run: Callable[[nn.Module], Any] | None = None
                     ) -> str | None:
        """The output scale, on the module whose output *is* the main output (found by running
        ``run(model)``), so that a loss the model computes from it inside forward sees the
        scale; on the returned value otherwise (refused when the model returns a loss).
        ``run`` defaults to the one given to the constructor."""
        run = run or self.runner
        found, out = self._output_module(path, run) if run is not None else (None, None)
        if found is not None and self.train_runner is not None and \
                self._output_module(path, self.train_runner)[0] != found:
            found = None    # another module produces it in train mode (a self.training branch)
        bounded = self._bounded(found, out, path)
        if bounded is not None:
            skip_bounded(self, bounded)
            return None
        if found is not None:
            mod = self.model.get_submodule(found)
            self._register(mod, PREFIX + "output_scale", 1.0)
            self._hook(mod.register_forward_hook(_module_output_scale_hook))
            self.output_module = found
            self._done("output", f"output scale on the output of {found} (the main output): "
                       f"everything forward computes from it, its own loss included, sees the "
                       f"scale", f"{found}.{PREFIX}output_scale")
            return f"{found}.{PREFIX}output_scale"
        if out is not None and internal_loss(out, path):
            raise PrecondError(LOSS_BEFORE_SCALE.replace("this preconditioned model computed",
                                                         "the model computes"))
        self._register(self.model, PREFIX + "output_scale", 1.0)
        setattr(self.model, PREFIX + "output_path", tuple(path))
        self.undo.append(("attrdel", self.model, PREFIX + "output_path"))
        self._hook(self.model.register_forward_hook(_root_output_hook))
        self._done("output", None, PREFIX + "output_scale")
        return PREFIX + "output_scale"

    def _output_module(self, path: list, run: Callable[[nn.Module], Any]
                       ) -> tuple[str | None, Any]:
        """The innermost submodule, called once per forward, whose returned tensor is the main
        output itself (forward hooks run innermost first and see earlier hooks' results)."""
        first: dict[int, str] = {}
        calls: dict[str, int] = {}
        keep: list[torch.Tensor] = []
        handles = []
        for name, m in self.model.named_modules():
            if not name:
                continue

            def hook(mod: nn.Module, args: tuple, out: Any, name: str = name) -> None:
                calls[name] = calls.get(name, 0) + 1
                t = out[0] if isinstance(out, tuple) and out else out
                if isinstance(t, torch.Tensor):
                    first.setdefault(id(t), name)
                    keep.append(t)
            handles.append(m.register_forward_hook(hook))
        try:
            out = run(self.model)
        finally:
            for h in handles:
                h.remove()
        try:
            target = at_path(out, path)
        except (KeyError, IndexError, TypeError, AttributeError):
            return None, out
        name = first.get(id(target)) if isinstance(target, torch.Tensor) else None
        if name is not None and calls.get(name, 0) == 1 and self._unique(name):
            return name, out
        if not isinstance(target, torch.Tensor):
            return None, out
        for cand in self._graph_candidates(tuple(target.shape)):
            if calls.get(cand, 0) == 1 and self._unique(cand) and \
                    self._scales_output(cand, path, run, target):
                return cand, out
        return None, out

    def _bounded(self, found: str | None, out: Any, path: list) -> str | None:
        """Why the main output cannot take a scale (``outputs.bounded_output``): the op of the
        module that produces it, or of the graph node the model's output comes from."""
        if found is not None:
            nodes = [n for n in self.graph if n.module == found]
            return bounded_output(nodes[-1].kind, nodes[-1].target) if nodes else None
        try:
            target = at_path(out, path) if out is not None else None
        except (KeyError, IndexError, TypeError, AttributeError):
            return None
        if not isinstance(target, torch.Tensor):
            return None
        same = [self.graph.get(o) for o in self.graph.outputs]
        same = [n for n in same if n is not None and n.out_shape is not None and
                tuple(n.out_shape) == tuple(target.shape)]
        if len(same) != 1:      # which output is the main one cannot be told from the graph
            return None
        return bounded_producer(self.graph, same[0].name)

    def _unique(self, path: str) -> bool:
        mod = self.model.get_submodule(path)
        return sum(m is mod for m in self.model.modules()) == 1 and \
            sum(1 for n, m in self.model.named_modules(remove_duplicate=False)
                if m is mod) == 1

    def _graph_candidates(self, shape: tuple) -> list[str]:
        """Modules whose output the main output is a reshape, cast or sole selection of (walking
        up the captured graph from the model outputs of the same shape)."""
        found = []
        for o in self.graph.outputs:
            node = self.graph.get(o)
            if node is None or node.out_shape is None or tuple(node.out_shape) != shape:
                continue
            while node is not None and node.module is None:
                live = [i for i in node.inputs if not self._frozen(i)]
                if node.kind in ("add", "sub", "mul") and len(live) == 1 and \
                        self._frozen_params(node):
                    # plus a zero buffer (BART's final_logits_bias), times a constant
                    # (Granite's / logits_scaling): exact only when the run check says so
                    src = live[0]
                    node = self.graph.get(src)
                    continue
                if node.kind not in ("reshape", "cast", "select") or len(node.inputs) != 1:
                    node = None
                    break
                src = node.inputs[0]
                if node.kind == "select" and len(self.users.get(src, [])) != 1:
                    node = None
                    break
                node = self.graph.get(src)
            if node is not None and node.module and node.module not in found:
                found.append(node.module)
        return found

    def _frozen_params(self, node: Any) -> bool:
        """Whether every parameter-like operand ``node`` reads is a buffer of the model (no
        trainable parameter: it does not change in training)."""
        bufs = getattr(self, "_buffer_names", None)
        if bufs is None:
            bufs = self._buffer_names = {n for n, _ in self.model.named_buffers()}
        return all(v in bufs for v in node.params.values())

    def _frozen(self, name: str) -> bool:
        """Whether node ``name`` computes from the model's buffers alone (no model input, no
        trainable parameter): a constant of the forward, such as an added logits bias."""
        node = self.graph.get(name)
        if node is None or not self._frozen_params(node) or \
                len(node.params) + len(node.inputs) < len(node.in_shapes):
            return False
        return all(self._frozen(i) for i in node.inputs)

    def _scales_output(self, path: str, out_path: list, run: Callable[[nn.Module], Any],
                       before: torch.Tensor) -> bool:
        """Check, by running, that doubling ``path``'s output doubles the main output."""
        def double(mod: nn.Module, args: tuple, out: Any) -> Any:
            if isinstance(out, torch.Tensor):
                return out * 2
            return out
        h = self.model.get_submodule(path).register_forward_hook(double)
        try:
            after = at_path(run(self.model), out_path)
            return isinstance(after, torch.Tensor) and after.shape == before.shape and \
                bool(torch.allclose(after, before * 2, rtol=1e-5, atol=1e-30))
        except Exception:   # the model does not run that way, or has no data (meta device)
            return False
        finally:
            h.remove()

    def probe(self, run: Callable[[nn.Module], Any], names: list[str]
              ) -> dict[str, torch.Tensor]:
        """Outputs of the named module-call nodes during ``run(model)`` (forward hooks), copied
        when produced: a later in-place op (``ReLU(inplace=True)``, ``mul_``) cannot change
        them."""
        want: dict[str, dict[int, str]] = {}
        for n in names:
            node = self.graph.get(n)
            if node is not None and node.module:
                want.setdefault(node.module, {})[node.call_index] = n
        got: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        handles = []
        for path, idx in want.items():
            def hook(mod: nn.Module, args: tuple, out: Any, path: str = path,
                     idx: dict = idx) -> None:
                k = counts.get(path, 0)
                counts[path] = k + 1
                if k in idx:
                    got[idx[k]] = _snapshot(out)
            handles.append(self.model.get_submodule(path).register_forward_hook(hook))
        try:
            run(self.model)
        finally:
            for h in handles:
                h.remove()
        return got

    def input_module(self, name: str, mod: nn.Module) -> bool:
        """``mod`` becomes submodule ``name`` of the model, run on its floating-point
        positional inputs by a forward pre-hook (undone by ``rollback``).  Refused for a
        container whose forward runs every child in turn (``nn.Sequential``): the module
        would run on the output too."""
        if isinstance(self.model, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            self._skip(f"module:{name}", name, f"the model is an {type(self.model).__name__}, "
                       f"whose forward runs every child: a module added at the input would run "
                       f"at the end too (wrap the model in a module of your own)")
            return False
        self.model.add_module(name, mod)
        self._hook(self.model.register_forward_pre_hook(
            functools.partial(_input_module_hook, name=name), with_kwargs=True, prepend=True))
        self.undo.append(("attrdel", self.model, name))
        self._done(f"module:{name}", f"{type(mod).__name__} applied at the input ({name}, "
                   f"pre-hook)")
        return True

    def finish(self) -> None:
        pass

    def rollback(self) -> None:
        """Undo every change, newest first (used when a later stage fails on inplace=True)."""
        for item in reversed(self.undo):
            kind = item[0]
            if kind == "hook":
                item[1].remove()
            elif kind == "buffer":
                mod, name = item[1], item[2]
                mod._buffers.pop(name, None)
            elif kind == "attr":
                setattr(item[1], item[2], item[3])
            elif kind == "module":
                setattr(item[1], item[2], item[3])
            elif kind == "attrdel":
                if hasattr(item[1], item[2]):
                    delattr(item[1], item[2])
        self.undo.clear()


def _snapshot(out: Any) -> Any:
    """A detached copy of a node's (first) output tensor, taken when it is produced."""
    t = out[0] if isinstance(out, (tuple, list)) and out else out
    return t.detach().clone() if isinstance(t, torch.Tensor) else t
