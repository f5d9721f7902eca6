"""Capture by running the model eagerly on the sample: the fallback that works on any model that runs.

A ``TorchFunctionMode`` sees every torch function and Tensor method call, and global module
hooks mark the calls of leaf modules known to the op table (a Conv2d call is one node; the
functional calls inside it are not recorded).  Data flow is recovered from tensor identity: a
call's tensor operand is linked to the node that produced that tensor object.  Like
``draft_export``, the graph describes the path the sample took through data-dependent branches.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from precondfx.pytorch import ops
from precondfx.pytorch.capture.common import (Act, Const, Param, Sample, build_node,
                                      input_attrs, leaves, shape_of, target_name)
from precondfx.core.graph import Graph, Node

_SKIP_NAMES = {"__get__", "__set__", "dim", "size", "numel", "is_floating_point", "__len__",
               "__bool__", "__format__", "__repr__", "element_size", "stride", "data_ptr",
               "storage_offset", "is_contiguous", "__index__", "tolist", "item", "__iter__",
               "requires_grad_", "__hash__", "__eq__", "__ne__", "is_complex", "get_device",
               "nelement", "ndimension", "_is_view", "__reduce_ex__", "__setstate__",
               "__deepcopy__"}


#: the Tensor properties that transpose (``w.T``, ``w.mT``; ``w.H``, ``w.mH`` of a real
#: weight), recorded as the op table's method
_TRANSPOSE_PROPS = ("T", "mT", "H", "mH")


class _Recorder(TorchFunctionMode):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.params = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        self.params.update({id(b): n for n, b in model.named_buffers(remove_duplicate=False)})
        self.mod_names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self.producer: dict[int, str] = {}
        self.keep: list[Any] = []           # keeps tensors alive so ids are not reused
        self.nodes: list[Node] = []
        self.counts: dict[str, int] = {}
        self.depth = 0                       # > 0 while inside a known leaf module
        self.calls: dict[str, int] = {}
        self.leaf_stack: list[tuple[nn.Module, tuple, dict]] = []

    # -- helpers -------------------------------------------------------------------------
    def _name(self, base: str) -> str:
        base = base.replace(".", "_").replace("<", "").replace(">", "")
        c = self.counts.get(base, 0)
        self.counts[base] = c + 1
        return base if c == 0 else f"{base}_{c}"

    def marker(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            if id(a) in self.params:
                return Param(self.params[id(a)])
            src = self.producer.get(id(a))
            return Act(src) if src is not None else Const(None)
        if isinstance(a, (list, tuple)):  # namedtuples and PackedSequence as plain tuples
            return (list if isinstance(a, list) else tuple)(self.marker(x) for x in a)
        if isinstance(a, dict):
            return {k: self.marker(v) for k, v in a.items()}
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return Const(a)
        return a

    def produce(self, out: Any, name: str) -> None:
        for t in leaves(out):
            if isinstance(t, torch.Tensor):
                self.producer[id(t)] = name
                self.keep.append(t)

    def add_inputs(self, sample: Sample) -> None:
        for i, t in enumerate(sample.args):
            self._input(t, f"arg{i}")
        for k, t in sample.kwargs.items():
            self._input(t, str(k))

    def _input(self, t: Any, name: str) -> None:
        if isinstance(t, torch.Tensor):
            nm = self._name(name)
            self.nodes.append(Node(nm, "input", f"input {name}", out_shape=shape_of(t),
                                   attrs=input_attrs(t)))
            self.producer[id(t)] = nm
            self.keep.append(t)
        elif isinstance(t, (list, tuple)):
            for j, x in enumerate(t):
                self._input(x, f"{name}_{j}")
        elif isinstance(t, dict):
            for k, x in t.items():
                self._input(x, f"{name}_{k}")

    # -- hooks ---------------------------------------------------------------------------
    def pre_hook(self, mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if ops.for_module(mod) is None or id(mod) not in self.mod_names:
            return
        if self.depth == 0:
            self.leaf_stack.append((mod, args, kwargs))
        self.depth += 1

    def post_hook(self, mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if ops.for_module(mod) is None or id(mod) not in self.mod_names:
            return
        self.depth -= 1
        if self.depth > 0:
            return
        self.leaf_stack.pop()
        path = self.mod_names[id(mod)]
        idx = self.calls.get(path, 0)
        self.calls[path] = idx + 1
        name = self._name(path if idx == 0 else f"{path}@{idx}")
        spec = ops.for_module(mod)
        margs = [self.marker(a) for a in args]
        mkw = {k: self.marker(v) for k, v in kwargs.items()}
        # the first tensor operand, by position, else by keyword (``self.conv(input=h)``)
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)),
                     None)
        outt = out[0] if isinstance(out, (tuple, list)) and out else out
        self.nodes.append(build_node(name, spec, f"{type(mod).__module__}.{type(mod).__name__}",
                                     margs, mkw, module=path, module_obj=mod, call_index=idx,
                                     out_shape=shape_of(outt), in_shapes=[shape_of(first)]))
        self.produce(out, name)

    # -- functions -----------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth > 0:
            return out
        fname = getattr(func, "__name__", "")
        prop = getattr(getattr(func, "__self__", None), "__name__", None)
        if fname == "__get__" and prop in _TRANSPOSE_PROPS and len(args) == 1:
            # ``self.weight.T``: the transpose it is, as fx and export (numpy_T) read it
            self.nodes.append(build_node(self._name(prop), ops.for_method(prop),
                                         f"Tensor.{prop}", [self.marker(args[0])], {},
                                         out_shape=shape_of(out),
                                         in_shapes=[shape_of(args[0])]))
            self.produce(out, self.nodes[-1].name)
            return out
        if fname in _SKIP_NAMES:
            return out
        tensors_out = isinstance(out, torch.Tensor) or (
            isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out))
        if not tensors_out:
            return out
        spec = ops.for_function(func)
        name = self._name(fname or "call")
        margs = [self.marker(a) for a in args]
        mkw = {k: self.marker(v) for k, v in kwargs.items()}
        outt = out[0] if isinstance(out, (tuple, list)) else out
        self.nodes.append(build_node(name, spec, target_name(func), margs, mkw,
                                     out_shape=shape_of(outt),
                                     in_shapes=[shape_of(a) for a in
                                                (args or tuple(kwargs.values()))
                                                if isinstance(a, torch.Tensor)]))
        self.produce(out, name)
        return out


def capture(model: nn.Module, sample: Sample) -> tuple[Graph, Any]:
    """Run ``model`` on the sample under the recorder; returns the graph and the model output."""
    sample = sample.copy()  # the recorder maps these tensors: run on exactly them
    rec = _Recorder(model)
    rec.add_inputs(sample)
    handles = []
    for _, m in model.named_modules():
        if ops.for_module(m) is not None:
            handles.append(m.register_forward_pre_hook(rec.pre_hook, with_kwargs=True))
            handles.append(m.register_forward_hook(rec.post_hook, with_kwargs=True))
    try:
        with rec:
            out = sample.call(model, copy=False)
    finally:
        for h in handles:
            h.remove()
    outs: list[str] = []
    _collect(out, rec, outs)
    rec.nodes.append(Node("output", "output", "output", inputs=outs))
    return Graph(rec.nodes, "eager", outputs=outs), out


def _collect(out: Any, rec: _Recorder, acc: list[str]) -> None:
    for t in leaves(out):
        src = rec.producer.get(id(t)) if isinstance(t, torch.Tensor) else None
        if src is not None and src not in acc:
            acc.append(src)
