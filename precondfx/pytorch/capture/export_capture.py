"""Capture with ``torch.export.export`` (non-strict) or ``torch.export.draft_export``.

The exported graph is made of ATen ops.  Ops that ran inside one call of a leaf module known to
the op table (``nn_module_stack``'s innermost entry, e.g. ``conv1`` a ``Conv2d``) are grouped
back into one node per module call, so the neutral graph has the same granularity as an fx
trace; other ops stay one node each.  ``draft_export`` specializes data-dependent branches on
the sample, which the report says.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from precondfx.core import optable
from precondfx.pytorch import ops
from precondfx.pytorch.capture.common import (Act, Const, Param, Sample, build_node,
                                              input_attrs, shape_of)
from precondfx.core.graph import Graph, Node


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Trace without recording each node's Python stack trace (``node.meta["stack_trace"]``,
    debugging metadata that nothing here reads: :func:`to_graph` reads the module stack):
    extracting and symbolizing one traceback per traced op was ~10% of an export."""
    cfg = getattr(torch.fx, "config", None)
    if cfg is None or not hasattr(cfg, "do_not_emit_stack_traces"):
        yield
        return
    old = cfg.do_not_emit_stack_traces
    cfg.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        cfg.do_not_emit_stack_traces = old


def export(model: torch.nn.Module, sample: Sample, *, draft: bool = False
           ) -> torch.export.ExportedProgram:
    """Export ``model`` on the sample (non-strict), or draft-export it."""
    with _no_stack_traces():
        if draft:
            ep = torch.export.draft_export(model, sample.args, kwargs=sample.kwargs)
        else:
            ep = torch.export.export(model, sample.args, kwargs=sample.kwargs, strict=False)
    check_flat(ep)
    return ep


def check_flat(ep: torch.export.ExportedProgram) -> None:
    """Refuse a program that nests part of the forward in a higher-order op reading
    parameters: ``wrap_with_set_grad_enabled`` for a ``torch.no_grad()`` block, which is how a
    reentrant ``torch.utils.checkpoint`` (transformers' ``gradient_checkpointing_enable()``
    default) runs each block.  The layers inside would be hidden from the plan (a Llama's
    decoder layers kept their own init); the eager capture records them."""
    params = set(ep.graph_signature.inputs_to_parameters)
    for n in ep.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.HigherOrderOperator):
            continue
        reads = [a for a in n.args if isinstance(a, fx.Node) and a.name in params]
        if reads:
            raise RuntimeError(
                f"torch.export nested {len(reads)} parameter(s) in {n.target.__name__} (a "
                f"torch.no_grad()/enable_grad() block, or a reentrant torch.utils.checkpoint): "
                f"the layers inside would be hidden from the plan")


def _leaf_scope(node: fx.Node) -> tuple[str, str, int, optable.OpSpec] | None:
    """(scope key, module path, call index, spec) of the innermost known leaf module, if any."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    key, (path, cls) = list(stack.items())[-1]
    cls_name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
    spec = optable.for_module_class_name(cls_name)
    if spec is None:
        return None
    idx = 0
    if "@" in key:
        try:
            idx = int(key.rsplit("@", 1)[1])
        except ValueError:
            idx = 0
    return key, _clean_path(path), idx, spec


def _clean_path(path: str) -> str:
    """``L['self'].layer1[0].conv1`` style paths -> ``layer1.0.conv1``."""
    p = path.replace("L['self'].", "").replace("L['self']", "")
    p = p.replace("[", ".").replace("]", "").replace("'", "")
    return p.strip(".")


#: higher-order ops that run a nested graph under a context (an autocast region, a
#: ``torch.no_grad()`` block) and return its outputs as a tuple -> the position of the nested
#: graph among their arguments (its operands follow it)
_REGIONS = {"wrap_with_autocast": 4, "wrap_with_set_grad_enabled": 1}


def _region_at(n: fx.Node) -> int | None:
    """The position of the nested graph if ``n`` calls one of :data:`_REGIONS`, else None."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.HigherOrderOperator):
        return None
    return _REGIONS.get(getattr(n.target, "__name__", ""))


def inline_regions(ep: torch.export.ExportedProgram) -> fx.Graph:
    """The program's graph with each autocast or grad-mode region (:data:`_REGIONS`) replaced
    by the ops of its nested graph, for analysis.  torch.export keeps such a region as one
    higher-order op, whose ops would otherwise be one unknown node; the region's context
    changes the dtype the ops compute in or whether they record gradients, not how they
    scale, and the plan goes onto the user's module, which keeps the region.  Names and
    metadata (module stack, shapes) are kept; a name a nested graph repeats gets a suffix."""
    flat = fx.Graph()
    _copy_graph(flat, ep.graph, ep.graph_module, {}, top=True)
    return flat


def _copy_graph(flat: fx.Graph, graph: fx.Graph, owner: torch.nn.Module,
                env: dict[fx.Node, Any], top: bool) -> Any:
    """Copy ``graph``'s nodes into ``flat``, expanding regions recursively (``owner`` holds
    their nested graphs).  A nested graph's placeholders arrive mapped in ``env``; it returns
    what its output node returns, mapped."""
    for n in graph.nodes:
        if n.op == "placeholder" and n in env:
            continue
        if n.op == "output":
            if top:
                flat.node_copy(n, lambda a: env[a])
                return None
            return fx.map_arg(n.args[0], lambda a: env[a])
        at = _region_at(n)
        if at is not None:
            sub = getattr(owner, n.args[at].target)
            holes = [p for p in sub.graph.nodes if p.op == "placeholder"]
            inner = {p: env[a] if isinstance(a, fx.Node) else a
                     for p, a in zip(holes, n.args[at + 1:])}
            env[n] = _copy_graph(flat, sub.graph, sub, inner, top=False)
        elif n.op == "call_function" and n.target is operator.getitem and \
                _region_at(n.args[0]) is not None:
            env[n] = env[n.args[0]][n.args[1]]
        elif n.op == "get_attr" and n.users and all(_region_at(u) is not None for u in n.users):
            continue                                    # a nested graph, expanded where used
        else:
            env[n] = flat.node_copy(n, lambda a: env[a])
    raise ValueError("an fx graph without an output node")


def to_graph(ep: torch.export.ExportedProgram, model: torch.nn.Module, method: str) -> Graph:
    """Convert an ExportedProgram into the neutral graph, grouping leaf-module calls (autocast
    and grad-mode regions inlined, :func:`inline_regions`)."""
    sig = ep.graph_signature
    pmap: dict[str, str] = {}
    pmap.update(sig.inputs_to_parameters)
    pmap.update(sig.inputs_to_buffers)
    pmap.update(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    user_inputs = set(sig.user_inputs)
    flat = inline_regions(ep)
    order, groups, group_of = _group_leaf_calls(flat)
    marker = _marker(pmap, group_of)
    nodes: list[Node] = []
    outputs: list[str] = []
    for what, item in order:
        if what == "group":
            nodes.append(_group_node(item, groups[item], model, marker, pmap))
            continue
        n = item
        if n.op == "placeholder":
            if n.name in pmap or n.name not in user_inputs:
                continue
            nodes.append(Node(n.name, "input", f"input {n.name}", out_shape=_out_shape(n),
                              attrs=input_attrs(n.meta.get("val"))))
        elif n.op == "output":
            outputs = _output_sources(n, marker)
            nodes.append(Node(n.name, "output", "output", inputs=outputs))
        elif n.op == "call_function":
            nodes.append(_function_node(n, marker))
    notes = _nested_notes(flat, sig.inputs_to_parameters)
    if method == "draft_export":
        notes.append("draft_export specialized data-dependent branches on the sample: the "
                     "analysis describes the path the sample took")
    return Graph(nodes, method, notes=notes, outputs=outputs)


def _nested_notes(flat: fx.Graph, params: dict[str, str]) -> list[str]:
    """What each higher-order op left after the regions were inlined (``torch.cond``,
    ``while_loop``, ``map``) hides: the parameters its nested graphs read, which the plan
    does not see (before, they were only listed as kept, "read by an op that is not a
    weighted layer")."""
    from torch.utils._pytree import tree_leaves
    notes = []
    for n in flat.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.HigherOrderOperator):
            continue
        read = [params[a.name] for a in tree_leaves((n.args, n.kwargs))
                if isinstance(a, fx.Node) and a.name in params]
        if read:
            op = getattr(n.target, "__name__", str(n.target))
            shown = ", ".join(read[:6]) + (f" and {len(read) - 6} more" if len(read) > 6 else "")
            notes.append(f"{n.name}: torch.export keeps {op} as one call whose nested graphs "
                         f"read {len(read)} parameter(s) ({shown}): the layers inside are "
                         f"hidden from the plan and keep their values (not re-initialized, "
                         f"not scaled). To have them preconditioned, write the branch as "
                         f"Python control flow (the eager capture follows the sample's "
                         f"branch), or precondition the modules inside on their own")
    return notes


def _group_leaf_calls(graph: fx.Graph) -> tuple[list[tuple[str, Any]], dict[str, dict],
                                                 dict[str, str]]:
    """The calls of each leaf-module call grouped: the order of groups and other nodes
    (("group", key) or ("node", fx.Node)), the groups (scope key -> nodes, path, call index,
    op table entry), and the group of each grouped fx node."""
    group_of: dict[str, str] = {}      # fx node name -> neutral node name
    groups: dict[str, dict] = {}        # scope key -> {nodes, path, idx, spec}
    order: list[tuple[str, Any]] = []   # ("group", key) or ("node", fx.Node)
    for n in graph.nodes:
        scope = _leaf_scope(n) if n.op == "call_function" else None
        if scope is None:
            order.append(("node", n))
            continue
        key, path, idx, spec = scope
        if key not in groups:
            groups[key] = {"nodes": [], "path": path, "idx": idx, "spec": spec}
            order.append(("group", key))
        groups[key]["nodes"].append(n)
        group_of[n.name] = key
    return order, groups, group_of


def _marker(pmap: dict[str, str], group_of: dict[str, str]) -> Callable[[Any], Any]:
    """The operand markers of an fx argument (parameters by their state_dict name,
    activations by the neutral node that produces them)."""
    def marker(a: Any) -> Any:
        if isinstance(a, fx.Node):
            if a.op == "placeholder" and a.name in pmap:
                return Param(pmap[a.name])
            if a.op == "get_attr":
                return Param(str(a.target))
            return Act(group_of.get(a.name, a.name))
        if isinstance(a, (list, tuple)):
            return type(a)(marker(x) for x in a)
        if isinstance(a, dict):
            return {k: marker(v) for k, v in a.items()}
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return Const(a)
        return a
    return marker


def _group_node(key: str, g: dict, model: torch.nn.Module, marker: Callable[[Any], Any],
                pmap: dict[str, str]) -> Node:
    """One leaf-module call: its operands are what its calls read from outside the group."""
    members = {m.name for m in g["nodes"]}
    ext_args = []
    for m in g["nodes"]:
        for a in m.all_input_nodes:
            if a.name not in members:
                ext_args.append(a)
    path = g["path"]
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        mod = None
    # the module's own parameters are its params, not operands; another parameter passed in
    # (self.norm(self.latents)) is an operand the call reads
    own = {id(t) for t in (*mod.parameters(), *mod.buffers())} if mod is not None else None

    def owned(a: fx.Node) -> bool:
        t = _param(model, pmap[a.name])
        return own is None or t is None or id(t) in own
    args = [marker(a) for a in ext_args
            if not (a.op == "placeholder" and a.name in pmap and owned(a))]
    out_shape = _out_shape(g["nodes"][-1])
    if mod is None:
        return build_node(key, g["spec"], g["spec"].kind, args, {}, out_shape=out_shape)
    return build_node(key, g["spec"], f"{type(mod).__module__}.{type(mod).__name__}",
                      args, {}, module=path, module_obj=mod, call_index=g["idx"],
                      out_shape=out_shape, in_shapes=[_out_shape(a) for a in ext_args])


def _param(model: torch.nn.Module, name: str) -> Any:
    """The parameter or buffer of ``model`` at ``name`` (None if there is none)."""
    try:
        return model.get_parameter(name)
    except AttributeError:
        try:
            return model.get_buffer(name)
        except AttributeError:
            return None


def _output_sources(n: fx.Node, marker: Callable[[Any], Any]) -> list[str]:
    """The nodes the output node returns (activations, each once)."""
    outs = [marker(a) for a in n.args[0]] if isinstance(n.args[0], (list, tuple)) \
        else [marker(n.args[0])]
    outputs: list[str] = []
    for o in outs:
        if isinstance(o, Act) and o.src not in outputs:
            outputs.append(o.src)
    return outputs


def _function_node(n: fx.Node, marker: Callable[[Any], Any]) -> Node:
    """A call outside any leaf module, looked up in the op table by its aten name."""
    tgt = n.target
    packet = getattr(tgt, "_opname", None) or getattr(tgt, "__name__", str(tgt))
    spec = optable.for_aten(packet) if str(tgt).startswith("aten") else \
        ops.for_function(tgt)
    if spec is None and packet == "getitem":
        spec = optable.BY_KIND["select"]
    args = [marker(a) for a in n.args]
    kwargs = {k: marker(v) for k, v in n.kwargs.items()}
    return build_node(n.name, spec, f"aten.{packet}" if str(tgt).startswith("aten")
                      else str(tgt), args, kwargs, out_shape=_out_shape(n),
                      in_shapes=[_out_shape(a) for a in n.all_input_nodes])


def _out_shape(n: fx.Node) -> tuple[int, ...] | None:
    v = n.meta.get("val")
    if isinstance(v, (tuple, list)):
        v = v[0] if v else None
    return shape_of(v) if v is not None else None
