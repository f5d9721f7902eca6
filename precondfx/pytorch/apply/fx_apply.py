"""Carry a plan out on a ``torch.fx.GraphModule`` by graph surgery.

Scale constants become buffers of the GraphModule read by ``get_attr`` nodes and multiplied in
with ``mul`` nodes, so they show in ``gm.code``, save with ``state_dict`` and survive deep copies
and ONNX export.  Max-pools are folded into the convolution before them or replaced by a module.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from precondfx.core.backend import Records, key_of
from precondfx.pytorch.apply.common import (buffer_name, first_param, like_param,
                                            replacement_pool, scalar_buffer, scaled_operand,
                                            swap_references)
from precondfx.pytorch.apply.torch_backend import TorchBackend, mask_skip
from precondfx.pytorch.capture.common import placeholder_values
from precondfx.pytorch.capture.fx_capture import _metadata_read, _namedtuple_fields, \
    namedtuple_values
from precondfx.core.outputs import bounded_output, bounded_producer, scale_moves_up, \
    skip_bounded
from precondfx.core.calibration import mask_named
from precondfx.core.plan import Plan, Scale


#: fx ops that carry a mask's values on (indexing, broadcasts, reshapes, dtype casts)
_CARRY_METHODS = {"unsqueeze", "view", "reshape", "expand", "expand_as", "squeeze", "flatten",
                  "float", "half", "double", "to", "type", "type_as", "contiguous"}
_CARRY_FUNCS = {operator.getitem, torch.unsqueeze, torch.reshape, torch.squeeze, torch.flatten}
_TEST_FUNCS = {operator.lt, operator.gt, operator.le, operator.ge, operator.eq, operator.ne}
_NOTS = {operator.invert, torch.logical_not, torch.bitwise_not}
_SUBS = {operator.sub, torch.sub}


def _fx_role(x: fx.Node, u: fx.Node) -> tuple[Any, str, str, list]:
    """How fx node ``u`` reads ``x`` (a placeholder or a value carried from it), for
    ``core.calibration.mask_by_use`` with ``gates=False``: a product is data, as any use
    not named here."""
    from precondfx.core import calibration as c
    t = u.target
    name = t if isinstance(t, str) else getattr(t, "__name__", str(t))
    what = f"{name} node {u.name!r}"
    args = list(u.args)
    idx = next((i for i, a in enumerate(args) if a is x), None)
    other = args[1 - idx] if idx in (0, 1) and len(args) == 2 else None
    to_bool = torch.bool in args[1:] or u.kwargs.get("dtype") is torch.bool
    if u.op == "call_method":
        if t == "bool" or t in ("to", "type") and to_bool or t == "logical_not" or \
                t in ("masked_fill", "masked_fill_") and idx == 1:
            return u, c.CONDITION, f"{what} reads it as a condition", []
        if t in _CARRY_METHODS and idx == 0:
            return u, c.CARRY, "", [u]
        if t in c.COUNT_OPS and idx == 0:
            return u, c.COUNT, "", []
        if t in c.TEST_OPS and idx == 0 and len(args) == 2 and not isinstance(args[1], fx.Node):
            return u, c.TEST, f"{what} compares it with a constant", []
    elif u.op == "call_function":
        if t is torch.where and idx == 0 or t in _NOTS or \
                t is torch.masked_fill and idx == 1 or \
                t in _SUBS and idx == 1 and isinstance(args[0], (int, float)):
            return u, c.CONDITION, f"{what} reads it as a condition", []
        if t in _CARRY_FUNCS and idx == 0:
            return u, c.CARRY, "", [u]
        if t in (torch.sum, torch.mean) and idx == 0:
            return u, c.COUNT, "", []
        if t in _TEST_FUNCS and other is not None and not isinstance(other, fx.Node):
            return u, c.TEST, f"{what} compares it with a constant", []
    return u, c.DATA, "", []


def fx_mask_use(ph: fx.Node) -> str | None:
    """Why placeholder ``ph`` reads as a mask by its uses (``core.calibration.mask_by_use``,
    the rule the ONNX back end applies): a condition (``~m``, ``torch.where(m, ...)``,
    ``m.bool()``, ``1 - m``), or only comparisons with a constant (``m < 0.5``, ``m == 0``)
    and sums; None for data.  A product (``scores * m``) is not trusted here: the sample is
    the user's, and ``x * sigmoid(g(c))`` gates data the same way."""
    from precondfx.core import calibration as c
    return c.mask_by_use(ph, lambda x: (_fx_role(x, u) for u in list(x.users)), gates=False)


def _activation_args(node: fx.Node) -> list[fx.Node]:
    acts: list[fx.Node] = []

    def walk(a: Any) -> None:
        if isinstance(a, fx.Node) and _namedtuple_fields(a) is not None:
            walk(namedtuple_values(a))      # a namedtuple built in forward: its fields
        elif isinstance(a, fx.Node):
            # a size or a number computed from sizes (``x.size(-1)``, ``math.sqrt(d)``) is a
            # constant operand, as in the captured graph (``fx_capture._marker``): not counted
            if a.op != "get_attr" and "precondfx_value" not in a.meta and a not in acts:
                acts.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                walk(x)
        elif isinstance(a, dict):
            for x in a.values():
                walk(x)

    walk(node.args)
    walk(node.kwargs)
    return acts


def _replace_operand(node: fx.Node, src: fx.Node, new: fx.Node) -> None:
    """``src`` replaced by ``new`` among ``node``'s operands, also inside a namedtuple built in
    forward (``torch.cat(Pair(a, b))``): a copy of that construction takes ``new``, so the
    other uses of the namedtuple (a returned value) keep ``src``."""
    if src in node.args or src in node.kwargs.values() or \
            not any(_namedtuple_fields(a) is not None for a in node.all_input_nodes):
        node.replace_input_with(src, new)
        return
    for a in node.all_input_nodes:
        if _namedtuple_fields(a) is not None and src in _activation_args(a):
            with node.graph.inserting_before(node):
                twin = node.graph.call_function(a.target, a.args, dict(a.kwargs))
            twin.meta = dict(a.meta)
            _replace_operand(twin, src, new)
            node.replace_input_with(a, twin)
            if not a.users:
                node.graph.erase_node(a)
            return
    node.replace_input_with(src, new)       # inside a plain list or tuple operand


def _mutates(node: fx.Node, src: fx.Node) -> bool:
    """Whether ``node`` changes ``src`` in place: an in-place Tensor method on it
    (``src.add_(h)``, ``src.mul_(2)``) or an in-place operator (``operator.iadd``)."""
    if not node.args or node.args[0] is not src:
        return False
    if node.op == "call_method":
        t = str(node.target)
        return t.endswith("_") and not t.startswith("_")
    return node.op == "call_function" and node.target in _INPLACE_OPERATORS


_INPLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv,
                                operator.ifloordiv, operator.imod, operator.ipow,
                                operator.imatmul, operator.iand, operator.ior, operator.ixor,
                                operator.ilshift, operator.irshift})


def _rebind_after(node: fx.Node, src: fx.Node, new: fx.Node) -> None:
    """Every use of ``src`` by a node after ``node`` (graph order: the order forward runs)
    reads ``new`` instead."""
    after, seen = [], False
    for n in node.graph.nodes:
        if n is node:
            seen = True
        elif seen and src in n.all_input_nodes:
            after.append(n)
    for n in after:
        n.replace_input_with(src, new)


def _read_before(node: fx.Node, src: fx.Node) -> fx.Node | None:
    """A node before ``node`` (graph order) that reads ``src``'s values or takes a view of it
    (``v = b.view(...)`` before ``b.add_(h)``: ``v`` sees the in-place change), else None.
    Reads of its shape alone are left out."""
    for n in node.graph.nodes:
        if n is node:
            return None
        if src in n.all_input_nodes and not _metadata_read(n):
            return n
    return None


#: Tensor methods and functions whose result shares its first operand's storage (a view)
_VIEW_METHODS = frozenset({"view", "view_as", "reshape", "flatten", "unflatten", "t", "transpose",
                           "permute", "squeeze", "unsqueeze", "expand", "expand_as", "narrow",
                           "select", "swapaxes", "movedim", "unfold", "diagonal", "as_strided"})
_VIEW_FUNCTIONS = frozenset({operator.getitem, torch.reshape, torch.flatten, torch.t,
                             torch.transpose, torch.permute, torch.squeeze, torch.unsqueeze,
                             torch.narrow, torch.select, torch.swapaxes, torch.movedim})


def _view_of(v: fx.Node, src: fx.Node) -> bool:
    """Whether ``v`` is ``src`` or a view of it (through view-making methods and functions on
    their first operand): the same numbers, so an in-place change of ``src`` shows in ``v``."""
    cur: Any = v
    for _ in range(64):
        if cur is src:
            return True
        if not isinstance(cur, fx.Node) or not cur.args or \
                not isinstance(cur.args[0], fx.Node) or not (
                    (cur.op == "call_method" and cur.target in _VIEW_METHODS) or
                    (cur.op == "call_function" and cur.target in _VIEW_FUNCTIONS)):
            return False
        cur = cur.args[0]
    return False


def _set_submodule(gm: fx.GraphModule, path: str, mod: torch.nn.Module) -> None:
    """Put ``mod`` at ``path``; every other reference to the module there (another name, a
    plain list or dict the user's methods iterate) follows (``swap_references``)."""
    parent, _, leaf = path.rpartition(".")
    owner = gm.get_submodule(parent) if parent else gm
    previous = owner._modules.get(leaf)
    setattr(owner, leaf, mod)
    if previous is not None:
        swap_references(gm, previous, mod)


def _is_tensor(n: fx.Node) -> bool:
    tm = n.meta.get("tensor_meta")
    return tm is not None and hasattr(tm, "shape")


def _under_own_products(n: fx.Node) -> fx.Node:
    """``n`` with precondfx's own products by a constant (an lr multiplier on a layer's
    output) looked through: the node whose value they scale."""
    while scaled_operand(n) is not None:
        n = scaled_operand(n)
    return n


def _same_meta(m: fx.Node, src: Any) -> None:
    """A product by a scalar constant has its operand's shape and dtype: said in its meta, so
    that later edits (the output scale walking up to the node that computes the main output)
    see a tensor there, as they would without the product."""
    if isinstance(src, fx.Node) and "tensor_meta" in src.meta:
        m.meta["tensor_meta"] = src.meta["tensor_meta"]


class FxApplier(TorchBackend, Records):
    """The fx back end (``precondfx.core.backend.Backend``): applies pools and scales to a
    GraphModule; records what was applied and what was not."""

    name = "fx"

    def __init__(self, gm: fx.GraphModule, graph: Any = None) -> None:
        self.gm = self.module = gm
        self.kinds: dict[str, str] = {n.name: n.kind for n in graph} if graph is not None else {}
        self.core = graph       # the captured graph (precondfx.core.graph), None if not given
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self._records()
        #: edits at functional sites, which only the graph's forward sees (not the user's other
        #: methods, on a result that is the user's class: ``apply.user_class``)
        self.graph_only: list[str] = []
        #: each constant's side of the node it was placed for: 'in' (an alpha on a layer's
        #: input) or 'out' (``user_class.mirror`` mirrors it on that side first)
        self.sides: dict[str, str] = {}

    def _buffer(self, name: str, value: float) -> fx.Node:
        self.gm.register_buffer(name, scalar_buffer(value, like_param(self.gm)))
        return name

    def _mul(self, before: fx.Node, value_src: fx.Node, bname: str) -> fx.Node:
        with self.gm.graph.inserting_before(before):
            c = self.gm.graph.get_attr(bname)
            m = self.gm.graph.call_function(operator.mul, (value_src, c))
        _same_meta(m, value_src)
        return m

    def scale(self, sc: Scale) -> str | None:
        """Insert one scale; returns the buffer name (None if it could not be placed)."""
        node, key, what = self._scale_node(self.nodes, sc, "node not found in the traced graph")
        if node is None:
            return None
        bname = buffer_name(sc.tag, sc.node, sc.index if sc.where == "operand" else None)
        if sc.where in ("input", "operand"):
            acts = _activation_args(node)
            first = node.args[0] if node.args else None
            if sc.where == "input" and not acts and isinstance(first, fx.Node) and \
                    first.op == "get_attr":
                # a layer applied to a parameter (a hypernetwork's generator on its embedding
                # z): its input is that parameter, scaled on this call only, as the eager back
                # end's pre-hook scales the module's input
                acts = [first]
            if sc.index >= len(acts):
                self._skip(key, what, f"{node.name} has no activation operand {sc.index} in "
                                      f"the traced graph (its other operands are parameters "
                                      f"or constants): no {sc.tag} placed")
                return None
            src = acts[sc.index]
            mutated = _mutates(node, src)
            early = _read_before(node, src) if mutated else None
            if early is not None:
                self._skip(key, what, f"{node.name} changes its operand {src.name} in place, "
                           f"and {early.name} reads {src.name} before that (a view of it sees "
                           f"the change): a scaled copy would leave that read without the "
                           f"change and the scale; no {sc.tag} placed (capture: fx)")
                return None
            self._buffer(bname, sc.value)
            m = self._mul(node, src, bname)
            _replace_operand(node, src, m)
            if mutated:
                # ``b.add_(h)`` updates the scaled copy now: the uses of ``b`` after it take
                # that copy (the user's forward reads the updated ``b`` there), not the
                # unscaled ``b`` without the update
                _rebind_after(node, src, node)
        else:  # output
            self._buffer(bname, sc.value)
            with self.gm.graph.inserting_after(node):
                c = self.gm.graph.get_attr(bname)
            with self.gm.graph.inserting_after(c):
                m = self.gm.graph.call_function(operator.mul, (node, c))
            _same_meta(m, node)
            node.replace_all_uses_with(m, delete_user_cb=lambda u: u is not m)
        self.sides[bname] = "in" if sc.where in ("input", "operand") else "out"
        self._done(key, f"{sc.tag} {sc.value:.4g} at {sc.where} of {sc.node} ({bname})", bname)
        return bname

    def pools(self, plan: Plan) -> None:
        for pc in plan.pools:
            node = self.nodes.get(pc.node)
            if node is None or pc.action == "keep":
                continue
            src = _activation_args(node)[0]
            if pc.action == "fold":
                conv_node = self.nodes[pc.into]
                conv = self.gm.get_submodule(str(conv_node.target))
                conv.stride = tuple(pc.geometry["conv_stride"])
                node.replace_all_uses_with(src)
                self.gm.graph.erase_node(node)
                if node.op != "call_module":
                    self.graph_only.append(f"max-pool {pc.node} (a functional call) folded "
                                           f"into {conv_node.target}'s stride")
                elif not any(n.op == "call_module" and n.target == node.target
                             for n in self.gm.graph.nodes):
                    self._drop(str(node.target), torch.nn.Identity())
                self._done(f"pool:{pc.node}", f"maxpool {pc.node} folded into {conv_node.target}")
                continue
            mod = replacement_pool(pc, first_param(self.gm))
            path = pc.new_param[:-len(".weight")] if pc.new_param else \
                (str(node.target) if node.op == "call_module" else f"precondfx_pool_{pc.node}")
            self.replace(pc.node, mod, path)
            self._done(f"pool:{pc.node}",
                       f"maxpool {pc.node} replaced by {type(mod).__name__} at {path}")

    def replace(self, name: str, mod: torch.nn.Module, path: str | None = None,
                all_calls: bool = False) -> bool:
        """Make node ``name`` a call of ``mod`` (a new submodule at ``path``; default: the
        node's own module path) on its first activation operand; the old submodule is dropped
        when nothing else calls it.  Each call site is its own node here, so ``all_calls`` (an
        eager-path notion) is moot."""
        node = self.nodes.get(name)
        if node is None:
            self._skip(f"replace:{name}", name, "replacement: node not found in the traced graph")
            return False
        src = _activation_args(node)[0]
        old = str(node.target) if node.op == "call_module" else None
        path = path or old or f"precondfx_{name}"
        if old != path:
            self.graph_only.append(f"{name} ({old or 'a functional call'}) replaced by "
                                   f"{type(mod).__name__} at {path}")
        if old == path:
            _set_submodule(self.gm, path, mod)
            node.args, node.kwargs = (src,), {}
            self._done(f"replace:{name}", None)
            return True
        self.gm.add_submodule(path, mod)
        with self.gm.graph.inserting_before(node):
            new = self.gm.graph.call_module(path, (src,))
        node.replace_all_uses_with(new)
        self.gm.graph.erase_node(node)
        self.nodes[name] = new
        if old is not None and not any(n.op == "call_module" and n.target == old
                                       for n in self.gm.graph.nodes):
            self._drop(old, None)
        self._done(f"replace:{name}", None)
        return True

    def _drop(self, path: str, instead: torch.nn.Module | None) -> None:
        """A submodule the graph no longer calls: deleted from a plain GraphModule; on one
        that is the user's class (its own module tree, which the user's methods call) replaced
        by ``instead`` (an ``Identity`` for a pool folded into a stride), or kept (None)."""
        from precondfx.pytorch.apply.user_class import is_user_graph
        if not is_user_graph(self.gm):
            self.gm.delete_submodule(path)
        elif instead is not None:
            _set_submodule(self.gm, path, instead)

    def input_scale(self, value: float) -> list[str]:
        names = []
        # the masks, found before any input is scaled (a scaled input is a computed value)
        masks = {n: fx_mask_use(n) for n in self.gm.graph.nodes if n.op == "placeholder"}
        for n in list(self.gm.graph.nodes):
            if n.op != "placeholder":
                continue
            tm = n.meta.get("tensor_meta")
            if tm is None or not getattr(tm, "dtype", torch.int64).is_floating_point:
                continue
            if mask_named(str(n.target)):
                self._skip(None, "input scale", mask_skip(str(n.target)))
                continue
            why = masks.get(n)
            if why:
                self._skip(None, "input scale", mask_skip(str(n.target), why))
                continue
            b = buffer_name("input", n.name)
            self._buffer(b, value)
            users = list(n.users)
            first = next(iter(users), None)
            if first is None:
                continue
            with self.gm.graph.inserting_after(n):
                c = self.gm.graph.get_attr(b)
            with self.gm.graph.inserting_after(c):
                m = self.gm.graph.call_function(operator.mul, (n, c))
            n.replace_all_uses_with(m, delete_user_cb=lambda u: u is not m)
            names.append(b)
        self._done("input", None, names[0] if names else None)
        return names

    def output_scale(self, path: list) -> str | None:
        """Multiply the main output by a buffer where it is produced: every use of it inside
        forward (a loss the model computes from its logits) sees the scale, not only the
        returned value.  The scale goes up through reshapes, selections and casts to the node
        that computes the values, so a loss computed before a final ``view`` sees it too."""
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        target = out.args[0]
        for k in path:
            whole, target = target, _select(target, k)
        if not isinstance(target, fx.Node):
            why = "main output is not a graph value"
            if path and isinstance(whole, fx.Node):   # e.g. torch.topk's (values, indices)
                why = (f"the main output is part of the value {whole.name} returns whole (a "
                       f"structseq such as torch.topk's), which the graph cannot edit: no "
                       f"output scale. Return the tensor itself (values, indices = "
                       f"torch.topk(...)) to get it")
            self._skip("output", "output", why)
            return None
        node = self._producer(target)
        bounded = bounded_producer(self.core, node.name) if node.name in self.kinds else \
            bounded_output(self.kinds.get(node.name), str(getattr(node.target, "__name__",
                                                                  node.target)))
        if bounded is not None:
            skip_bounded(self, bounded)
            return None
        b = buffer_name("output", "scale")
        self._buffer(b, 1.0)
        if self._shared_call(_under_own_products(node)):
            # a module called more than once (the twin encoder of a siamese net): scaling this
            # call alone would change what forward computes from it and its twin's output (a
            # contrastive loss), so only the returned value takes the scale, as on the eager
            # back end
            # the twins' returned values (a triplet net's anchor, positive and negative
            # embeddings) take the same scale: one encoder, one function at every output
            values = [target] + self._twin_outputs(out, target, node)
            with self.gm.graph.inserting_before(out):
                c = self.gm.graph.get_attr(b)
                for v in values:
                    out.replace_input_with(v, self.gm.graph.call_function(operator.mul, (v, c)))
            self._done("output", f"output scale on the returned value(s) "
                       f"{', '.join(v.name for v in values)}: {node.target} is called more "
                       f"than once, so the values forward computes from its calls keep their "
                       f"scale", b)
            return b
        heads = self._summed_heads(node)
        if heads:
            # the main output sums or averages heads (DeiT's class and distillation heads,
            # returned beside it): the scale on each head keeps them and it in agreement
            for h in heads:
                with self.gm.graph.inserting_after(h):
                    c = self.gm.graph.get_attr(b)
                with self.gm.graph.inserting_after(c):
                    m = self.gm.graph.call_function(operator.mul, (h, c))
                h.replace_all_uses_with(m, delete_user_cb=lambda u, m=m: u is not m)
            names = ", ".join(str(_under_own_products(h).target) for h in heads)
            self._done("output", f"output scale at the outputs of {names}, which the main "
                       f"output {target.name} is a sum or average of: every use inside forward and "
                       f"each head's own output see it", b)
            return b
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        # forward changes the output in place after computing it (``y.clamp_(-5, 5)``): the
        # scale goes after the last such change, as on the value forward returns
        changes = sorted((u for u in node.users if _mutates(u, node)), key=order.get)
        early = [u for u in node.users if changes and u not in changes and
                 order[u] < order[changes[-1]] and not _metadata_read(u)]
        if early:
            # a view of it taken before an in-place change (``v = y.view(...)``, then
            # ``y.clamp_(...)``, ``return v``) reads the changed values, which a product after
            # the change would not reach: the returned value takes the scale
            # returned views of the same numbers (``flat = y.view(-1)`` taken before the
            # change, returned beside ``y``) take it too: in forward they are ``y`` itself
            leaves: list[fx.Node] = []
            fx.node.map_arg(out.args[0], leaves.append)
            values = [target] + [v for v in dict.fromkeys(leaves) if v is not target and
                                 _view_of(v, node)]
            with self.gm.graph.inserting_before(out):
                c = self.gm.graph.get_attr(b)
                for v in values:
                    out.replace_input_with(v, self.gm.graph.call_function(operator.mul,
                                                                          (v, c)))
            also = (f" and the returned view(s) {', '.join(v.name for v in values[1:])} of "
                    f"it") if values[1:] else ""
            self._done("output", f"output scale on the returned value {target.name}{also}: "
                       f"{early[0].name} reads {node.name} before forward changes it in place "
                       f"({changes[-1].name}), so a scale where it is computed would miss the "
                       f"change", b)
            return b
        at = changes[-1] if changes else node
        with self.gm.graph.inserting_after(at):
            c = self.gm.graph.get_attr(b)
        with self.gm.graph.inserting_after(c):
            m = self.gm.graph.call_function(operator.mul, (node, c))
        if changes:
            for src in (node, *changes):
                _rebind_after(m, src, m)
        else:
            node.replace_all_uses_with(m, delete_user_cb=lambda u: u is not m)
        self._done("output", f"output scale at the output of {node.name} (the main output"
                   f"{'' if node is target else ' up to ' + target.name}): every use inside "
                   f"forward sees it", b)
        return b

    def _twin_outputs(self, out: fx.Node, target: fx.Node, node: fx.Node) -> list[fx.Node]:
        """The other values the graph returns that other calls of ``node``'s module produce
        (through value-keeping ops and precondfx's own products)."""
        mod = self.gm.get_submodule(str(_under_own_products(node).target))
        leaves: list[fx.Node] = []
        fx.node.map_arg(out.args[0], leaves.append)
        twins: list[fx.Node] = []
        for v in leaves:
            if v is target or v in twins:
                continue
            p = _under_own_products(self._producer(v))
            if p.op == "call_module" and self.gm.get_submodule(str(p.target)) is mod:
                twins.append(v)
        return twins

    def _shared_call(self, node: fx.Node) -> bool:
        """Whether ``node`` calls a module that the graph calls more than once."""
        if node.op != "call_module":
            return False
        mod = self.gm.get_submodule(str(node.target))
        return sum(1 for n in self.gm.graph.nodes if n.op == "call_module" and
                   self.gm.get_submodule(str(n.target)) is mod) > 1

    def _summed_heads(self, node: fx.Node) -> list[fx.Node]:
        """The module calls whose outputs ``node`` adds up (through sums, differences and
        products or quotients by Python numbers), when there are two or more, each called
        once and read elsewhere too (returned beside the main output); [] otherwise."""
        def leaves(n: Any) -> list[fx.Node] | None:
            if not isinstance(n, fx.Node):
                return None
            if n.op == "call_module":
                return [n]
            inner = scaled_operand(n)         # a module's output times a constant (lr_scale)
            if inner is not None:
                return [n] if leaves(inner) == [inner] else None
            if n.op != "call_function":
                return None
            name = getattr(n.target, "__name__", str(n.target))
            ts = [a for a in n.args if isinstance(a, fx.Node)]
            if n.kwargs or len(n.args) != 2:
                return None
            if name in ("add", "sub") and len(ts) == 2:
                a, b = leaves(ts[0]), leaves(ts[1])
                return a + b if a and b else None
            if name in ("mul", "truediv") and len(ts) == 1 and \
                    isinstance(n.args[1 - n.args.index(ts[0])], (int, float)) and \
                    (name == "mul" or n.args[0] is ts[0]):
                return leaves(ts[0])
            return None
        heads = leaves(node)
        if not heads or len(heads) < 2 or len(set(heads)) != len(heads) or \
                all(len(h.users) == 1 for h in heads) or \
                any(self._shared_call(_under_own_products(h)) for h in heads):
            return []
        return heads

    def _producer(self, node: fx.Node) -> fx.Node:
        """Walk up from ``node`` through single-operand ops that keep the values (reshape, cast:
        every other use of the operand reads the same values), and selections whose operand has
        no other use."""
        while True:
            kind = self.kinds.get(node.name)
            acts = [a for a in _activation_args(node) if _is_tensor(a)]
            src = acts[0] if len(acts) == 1 else None
            if src is None or src.op == "placeholder" or \
                    not scale_moves_up(kind, len(acts), len(src.users)):
                return node
            node = src

    def probe(self, run: Callable[[torch.nn.Module], Any], names: list[str]
              ) -> dict[str, torch.Tensor]:
        """Outputs of the named nodes during ``run(gm)`` (an Interpreter records them)."""
        wanted = {self.nodes[n]: n for n in names if n in self.nodes}
        got: dict[str, torch.Tensor] = {}

        class Rec(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                out = super().run_node(n)
                if n in wanted:  # copied now: a later in-place op cannot change it
                    t = out[0] if isinstance(out, (tuple, list)) and out else out
                    got[wanted[n]] = t.detach().clone() if isinstance(t, torch.Tensor) else t
                return out

        interp = Rec(self.gm)

        def call(*args: Any, **kwargs: Any) -> Any:
            return interp.run(*placeholder_values(self.gm.graph, args, kwargs))

        run(call)
        return got

    def input_module(self, name: str, mod: torch.nn.Module) -> bool:
        """A call of ``mod`` (submodule ``name``) on the first input, before every use of it."""
        self.gm.add_submodule(name, mod)
        ph = next(n for n in self.gm.graph.nodes if n.op == "placeholder")
        with self.gm.graph.inserting_after(ph):
            new = self.gm.graph.call_module(name, (ph,))
        ph.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new)
        self.graph_only.append(f"{type(mod).__name__} {name} at the input")
        self.finish()
        self._done(f"module:{name}", f"{type(mod).__name__} inserted at the input ({name})")
        return True

    def finish(self) -> None:
        # Type annotations copied from the user's forward can be strings (``from __future__
        # import annotations``), which GraphModule pickling cannot resolve: drop them.
        for n in self.gm.graph.nodes:
            n.type = None
        self.gm.graph.lint()
        self.gm.recompile()

    def rollback(self) -> None:
        """Nothing to undo: the fx back end edits a new GraphModule, never the user's model."""


def _select(value: Any, key: Any) -> Any:
    """``value[key]`` on the traced output: a tuple, list or dict of nodes, or a node that
    builds a namedtuple (fx records ``Out(logits, hidden)`` as a call); None where the traced
    graph does not tell which value it is."""
    if isinstance(value, fx.Node):
        cls = value.target if value.op == "call_function" else None
        fields = getattr(cls, "_fields", None) if isinstance(cls, type) else None
        if fields is None:
            return None
        vals = list(value.args) + [value.kwargs.get(f) for f in fields[len(value.args):]]
        return vals[fields.index(key) if isinstance(key, str) else key]
    if value is None:
        return None
    return value[key]
