"""The constants on the weight side: the finished fx result trains as fast as the user's model.

The fx back end multiplies each constant into an activation (``conv(x * alpha)``,
``conv(x) * s``), the form every stage of the pass works on (calibration, balancing, the mirror
hooks, fold's reading of the graph).  Such a product costs a pass over the activation forward
and one backward; under ``torch.compile`` on CPU a product between a ReLU and a convolution
(an extern kernel, nothing fuses into it) also makes the ReLU save a boolean mask, which the
generated code writes and reads slowly (``bench/user_class_cost.py``: 1.07x eager, 1.2-1.4x
compiled on small ResNets).

For a linear layer the same function with the same gradients puts the constant on its weight:
``conv(alpha x, W) + b == conv(x, alpha W) + b`` and ``s (conv(x, W) + b) == conv(x, s W, s b)``
(the gradients with respect to ``x``, ``W`` and ``b`` are identical).  :func:`to_weight_side`
rewrites the finished GraphModule so: the module call and its products become one call
``layer(self.conv, x, (alpha,), (s,), eager, compiled)`` (:func:`layer`), which puts them on
the weight in eager runs where the weight (and bias) has at most as many elements as the
activations the products pass over (the traced sample's shapes), and under ``torch.compile``
also where a product follows a ReLU-like op and the weight is at most :data:`MASK_PASSES`
times the activation (the mask's measured cost); ``policy='weight'``: always.  The
constants stay buffers read at run time (``set_constant``, ``load_state_dict``,
``distributed.calibrate`` still act) and the parameters keep their names.  :func:`layer` falls
back to the module call with the products whenever the module has hooks (the user's, FSDP's,
a measurement's: they see what they saw before) or is no longer a plain Linear/Conv (replaced
or wrapped after preconditioning).

:func:`to_module_calls` undoes the rewrite exactly; ``fold`` reads the graph in that form
(:func:`module_call_view`).
"""
from __future__ import annotations

import copy
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from precondfx.core.backend import PREFIX

#: module class -> the functional call computing it (exact classes only: a subclass may have
#: its own forward)
_FUNCS: dict[type, Any] = {nn.Linear: F.linear, nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d,
                           nn.Conv3d: F.conv3d}
POLICIES = ("cheaper", "weight")
#: the output scale's buffer (``FxApplier.output_scale``)
OUTPUT_SCALE = PREFIX + "output_scale"


def _hooked(mod: nn.Module) -> bool:
    """Whether a call of ``mod`` runs hooks (its own or global ones)."""
    g = nn.modules.module
    return bool(mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks or
                mod._backward_pre_hooks or g._global_forward_hooks or
                g._global_forward_pre_hooks or g._global_backward_hooks or
                g._global_backward_pre_hooks)


def _product(cs: tuple) -> torch.Tensor:
    s = cs[0]
    for c in cs[1:]:
        s = s * c
    return s


def layer(mod: nn.Module, x: torch.Tensor, inputs: tuple, outputs: tuple,
          eager: bool = True, compiled: bool = True) -> torch.Tensor:
    """``mod(x * inputs...) * outputs...`` (the constants: 0-d tensors).  With the constants on
    ``mod``'s weight (``F.conv2d(x, W * alpha * s, b * s, ...)``: the same function and the
    same gradients, no pass over the activations) where ``eager`` (or, under
    ``torch.compile`` and exports, ``compiled``) says so: :func:`to_weight_side` decides each
    by what the two forms cost there.  Where that would skip something a module call does
    (``mod`` has hooks, such as the user's, FSDP's or a measurement's, or is no longer a plain
    Linear/Conv: replaced, wrapped), it is the module call with the products.  Under an fx
    tracer (a pickled GraphModule is re-traced from its code when loaded) it is recorded as one
    call, so that :func:`to_module_calls` finds it."""
    if isinstance(x, fx.Proxy):
        return x.tracer.create_proxy("call_function", layer,
                                     (mod, x, tuple(inputs), tuple(outputs), eager, compiled),
                                     {})
    f = _FUNCS.get(type(mod))
    on_weight = compiled if torch.compiler.is_compiling() else eager
    if not on_weight or f is None or _hooked(mod):
        for c in inputs:
            x = x * c
        y = mod(x)
        for c in outputs:
            y = y * c
        return y
    w = mod.weight * _product(tuple(inputs) + tuple(outputs))
    b = mod.bias
    if b is not None and outputs:
        b = b * _product(tuple(outputs))
    if f is F.linear:
        return F.linear(x, w, b)
    return f(x, w, b, mod.stride, mod.padding, mod.dilation, mod.groups)


def _const(n: Any, consts: set[str]) -> fx.Node | None:
    """The constant's get_attr node of ``x * c`` (``c`` a root precondfx buffer), else None."""
    if not isinstance(n, fx.Node) or n.op != "call_function" or \
            n.target not in (operator.mul, torch.mul) or len(n.args) != 2 or n.kwargs:
        return None
    for c, x in (n.args, n.args[::-1]):
        if isinstance(c, fx.Node) and c.op == "get_attr" and str(c.target) in consts and \
                isinstance(x, fx.Node) and not (x.op == "get_attr" and str(x.target) in consts):
            return c
    return None


def _operand(n: fx.Node, c: fx.Node) -> fx.Node:
    return n.args[1] if n.args[0] is c else n.args[0]


def _numel(n: fx.Node) -> int | None:
    tm = n.meta.get("tensor_meta")
    shape = getattr(tm, "shape", None)
    if shape is None:
        return None
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _eligible(gm: fx.GraphModule, path: str, shared: set[int]) -> nn.Module | None:
    """The module at ``path`` if its call can become :func:`layer`'s functional one: an exact
    Linear/Conv class with plain parameters no other module holds, zero padding mode."""
    try:
        mod = gm.get_submodule(path)
    except AttributeError:
        return None
    if type(mod) not in _FUNCS or getattr(mod, "parametrizations", None) is not None:
        return None
    if getattr(mod, "padding_mode", "zeros") != "zeros":
        return None
    for p in (mod.weight, mod.bias):
        if p is not None and (type(p) is not nn.Parameter or id(p) in shared):
            return None
    return mod


_MASKING_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh, nn.Threshold)
#: under torch.compile a product after a ReLU-like op costs a boolean mask; the weight side is
#: taken while the weight has at most this many times the activation's elements.  16 (one
#: measurement of the mask alone) left the deepest layers of the normalization-free ResNet of
#: bench/user_class_cost.py (weight / activation = 18) on the activation side: compiled
#: result/user 1.032 and 1.045 in two runs; at 32, 0.986 and 1.016 (folded model, the floor:
#: 0.98-1.03)
MASK_PASSES = 32
_MASKING_FUNCTIONS = {F.relu, torch.relu, F.relu6, F.leaky_relu, F.hardtanh, F.threshold,
                      torch.threshold}


def _masking(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Whether ``n`` is a ReLU-like op (its backward needs only where the input was positive:
    compiled, it saves a boolean mask when its output is not saved otherwise)."""
    if n.op == "call_module":
        try:
            return isinstance(gm.get_submodule(str(n.target)), _MASKING_MODULES)
        except AttributeError:
            return False
    if n.op == "call_function":
        return n.target in _MASKING_FUNCTIONS
    return n.op == "call_method" and n.target in ("relu", "relu_", "clamp_min")


def _shared_params(gm: fx.GraphModule) -> set[int]:
    seen: dict[int, int] = {}
    for _, m in gm.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, v in seen.items() if v > 1}


def _call_args(mod: nn.Module) -> tuple:
    """The functional call's arguments after input, weight and bias."""
    if isinstance(mod, nn.Linear):
        return ()
    return (mod.stride, mod.padding, mod.dilation, mod.groups)


def to_weight_side(gm: fx.GraphModule, policy: str = "cheaper") -> list[str]:
    """Rewrite ``gm`` (in place, recompiled) so that each constant multiplying the input or the
    output of an eligible Linear/Conv call is on the layer's weight (and bias, for an output
    scale) instead: with ``policy='cheaper'`` where the weight has at most as many elements
    as the activation the product runs over (the traced sample's shapes), with ``'weight'``
    always.  Returns the constants moved."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}: one of {POLICIES}")
    # the model's output scale stays a product: the main output is exactly the layers' output
    # times it (fold's and the tests' contract), and it multiplies an output, usually small
    consts = {n for n in gm._buffers if n.startswith(PREFIX) and n != OUTPUT_SCALE}
    if not consts:
        return []
    g = gm.graph
    shared = _shared_params(gm)
    moved: list[str] = []
    for u in list(g.nodes):
        if u.op != "call_module" or len(u.args) != 1 or u.kwargs or \
                not isinstance(u.args[0], fx.Node):
            continue
        mod = _eligible(gm, str(u.target), shared)
        if mod is None:
            continue
        wn = mod.weight.numel() + (mod.bias.numel() if mod.bias is not None else 0)
        # the products on the input: x * c1 * c2 ... read by this call only
        ins: list[fx.Node] = []
        cur = u.args[0]
        while True:
            c = _const(cur, consts)
            if c is None or len(cur.users) != 1:
                break
            ins.append(cur)
            cur = _operand(cur, c)
        x = cur
        # the products on the output: call (-> Identity module ...) * c1 * c2, nothing else
        # reading the values in between
        outs: list[fx.Node] = []
        cur = u
        while len(cur.users) == 1:
            (v,) = cur.users
            c = _const(v, consts)
            if c is not None and _operand(v, c) is cur:
                outs.append(v)
            elif v.op == "call_module" and len(v.args) == 1 and not v.kwargs and \
                    type(gm.get_submodule(str(v.target))) is nn.Identity and \
                    not gm.get_submodule(str(v.target))._forward_hooks and \
                    not gm.get_submodule(str(v.target))._forward_pre_hooks:
                pass
            else:
                break
            cur = v
        if not ins and not outs:
            continue
        # what the products cost on the activations (elements per pass) against one pass over
        # the weight; under torch.compile a product fuses into its neighbours except after a
        # ReLU-like op, where it costs a slow boolean mask (MASK_PASSES)
        act = (_numel(x) or 0) * len(ins) + (_numel(u) or 0) * len(outs)
        masked = bool(ins) and _masking(gm, x)
        eager = policy == "weight" or wn <= act
        compiled = policy == "weight" or wn <= act or \
            (masked and wn <= MASK_PASSES * (_numel(x) or 0))
        if not eager and not compiled:
            continue
        names_in = [str(_const(n, consts).target) for n in ins]
        names_out = [str(_const(n, consts).target) for n in outs]
        path = str(u.target)
        with g.inserting_before(u):     # the constants read afresh, before the call
            cin = tuple(g.get_attr(t) for t in names_in)
            cout = tuple(g.get_attr(t) for t in names_out)
            m = g.get_attr(path)
            new = g.call_function(layer, (m, x, cin, cout, eager, compiled))
        new.meta = dict(u.meta)
        u.replace_all_uses_with(new)
        g.erase_node(u)
        for n in ins:               # the products nothing reads now (last first)
            if not n.users:
                g.erase_node(n)
        for n in outs:              # each product: its operand takes its place
            n.replace_all_uses_with(_operand(n, _const(n, consts)))
            g.erase_node(n)
        moved += names_in + names_out
    if moved:
        for n in list(g.nodes):     # constants' get_attr nodes nothing reads any more
            if n.op == "get_attr" and str(n.target) in consts and not n.users:
                g.erase_node(n)
        g.lint()
        gm.recompile()
    return moved


def sites(gm: nn.Module) -> list[fx.Node]:
    """The :func:`layer` calls :func:`to_weight_side` made in ``gm``'s graph."""
    if not isinstance(gm, fx.GraphModule):
        return []
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is layer]


def to_module_calls(graph: fx.Graph) -> int:
    """Undo :func:`to_weight_side` on ``graph`` (edited in place): each :func:`layer` call
    becomes the module call again with the constants' products on its input and output.
    Returns the number of calls restored."""
    count = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not layer:
            continue
        m, x, cin, cout = n.args[:4]
        with graph.inserting_before(n):
            for c in cin:
                x = graph.call_function(operator.mul, (x, c))
            call = graph.call_module(str(m.target), (x,))
        call.meta = dict(n.meta)
        last = call
        for c in cout:
            with graph.inserting_after(last):
                last = graph.call_function(operator.mul, (last, c))
        n.replace_all_uses_with(last)
        graph.erase_node(n)
        if not m.users:
            graph.erase_node(m)
        count += 1
    return count


def module_call_view(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule sharing ``gm``'s modules, parameters and buffers whose graph is ``gm``'s
    in the module-call form (``gm`` itself when it has no :func:`layer` call)."""
    if not sites(gm):
        return gm
    g = copy.deepcopy(gm.graph)
    to_module_calls(g)
    return fx.GraphModule(gm, g)
