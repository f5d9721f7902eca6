"""Block dynamical isometry diagnostics: ``phi(J J^T)`` and ``varphi`` per block (a weighted
layer with its following activation) on the calibration batch, fx graphs re-run by an
interpreter, eager models through hooks."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from precondfx.core.graph import Node
from precondfx.core.scheme import SchemeContext
from precondfx.errors import PrecondError
from precondfx.pytorch.calibrate import quiet_run
from precondfx.pytorch.capture.common import placeholder_values
from precondfx.pytorch.measure.isometry import estimate_block_isometry
from precondfx.schemes.activations import activation_of
from precondfx.schemes.gne.blocks import _SMOOTH, following_activation

#: activations as functions (diagnostics of eager blocks whose activation is functional)
_ACT_FN: dict[str, Callable[..., torch.Tensor]] = {
    "relu": torch.relu, "tanh": torch.tanh, "selu": torch.selu, "sigmoid": torch.sigmoid,
    **_SMOOTH,
}


class _Stop(BaseException):
    """Raised to end a forward pass once a block's output has been computed."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value



def block_diagnostics(ctx: SchemeContext, probes: int = 32, mode: str = "eval",
                      seed: int = 0) -> dict[str, Any]:
    """``phi(J J^T)`` and ``varphi`` per block (a weighted layer with its following activation;
    spec A.2.2, Hutchinson estimator of ``measure.isometry``) on the calibration batch, plus the
    product of the ``phi`` (the gradient-norm gain through the chain of blocks, eq. 13)."""
    users = ctx.graph.users()
    blocks, skipped = [], []
    gen = torch.Generator().manual_seed(seed)
    for lay in ctx.plan.layers:
        node = ctx.graph.get(lay.node)
        if node is None or lay.kind == "embedding" or not node.inputs:
            skipped.append((lay.node, "no activation input (embedding or constant input)"))
            continue
        act, _, _ = following_activation(ctx.graph, lay.node, users)
        dst = act.name if act is not None else lay.node
        try:
            f, x = _block(ctx, node, ctx.graph[dst], mode)
        except PrecondError as e:
            skipped.append((lay.node, str(e)))
            continue
        if x is None or not x.is_floating_point():
            skipped.append((lay.node, "the block's input is not a floating-point activation"))
            continue
        try:
            with quiet_run(ctx.model, mode):
                est = estimate_block_isometry(f, x, num_probes=max(4, probes), generator=gen)
        except (PrecondError, RuntimeError) as e:
            skipped.append((lay.node, f"estimate failed: {str(e)[:120]}"))
            continue
        blocks.append({"block": lay.node, "activation": act.name if act is not None else None,
                       "phi": est.phi, "phi_se": est.phi_se, "varphi": est.varphi,
                       "varphi_se": est.varphi_se, "m": est.m, "n": est.n,
                       "probes": est.num_probes})
    prod = math.prod(b["phi"] for b in blocks) if blocks else None
    return {"blocks": blocks, "product_phi": prod, "skipped": skipped, "mode": mode,
            "estimator": "Gaussian-probe VJPs (spec A.2.2 step 5a), jackknife errors"}


def _block(ctx: SchemeContext, layer: Node, dst: Node, mode: str
           ) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor | None]:
    """The block ``x -> dst`` where ``x`` is the layer's input activation (before its alpha, so
    the block is the effective layer), and that input on the calibration batch; fx graphs are
    re-run by an interpreter that substitutes ``x``, eager models through hooks on the layer's
    module."""
    gm, applier = ctx.model, ctx.applier
    if isinstance(gm, fx.GraphModule) and hasattr(applier, "nodes"):
        live = set(gm.graph.nodes)
        fl, fd = applier.nodes.get(layer.name), applier.nodes.get(dst.name)
        if fl not in live or fd not in live:
            raise PrecondError("block nodes not found in the rewritten graph")
        src = _fx_input(fl)
        if src is None:
            raise PrecondError("the layer has no activation input in the graph")
        with quiet_run(gm, mode), torch.no_grad():
            x = _fx_run(gm, ctx, src, src, None)
        return (lambda t: _fx_run(gm, ctx, src, fd, t)), x
    return _eager_block(ctx, layer, dst, mode)


def _fx_input(node: fx.Node) -> fx.Node | None:
    """First activation operand of a graph node, stepping over an inserted alpha product."""
    import operator

    def acts(n: fx.Node) -> list[fx.Node]:
        return [a for a in n.all_input_nodes if a.op != "get_attr"]
    src = next(iter(acts(node)), None)
    if src is not None and src.op == "call_function" and src.target is operator.mul:
        consts = [a for a in src.all_input_nodes if a.op == "get_attr"]
        if any(str(c.target).startswith("precondfx_alpha") for c in consts) and acts(src):
            src = acts(src)[0]
    return src


def _fx_run(gm: fx.GraphModule, ctx: SchemeContext, src: fx.Node, dst: fx.Node,
            x: torch.Tensor | None) -> torch.Tensor:
    """Interpret ``gm`` on the calibration batch up to ``dst``; with ``x`` given, ``src``'s
    value is replaced by ``x`` and everything upstream of it runs without autograd."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    class Run(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n is src and x is not None:
                if n.op == "placeholder":
                    super().run_node(n)
                out = x
            elif x is not None and order[n] < order[src]:
                with torch.no_grad():
                    out = super().run_node(n)
            else:
                out = super().run_node(n)
            if n is dst:
                raise _Stop(out)
            return out

    interp = Run(gm)
    interp.extra_traceback = False

    def call(*args: Any, **kwargs: Any) -> Any:
        return interp.run(*placeholder_values(gm.graph, args, kwargs))
    try:
        ctx.sample.call(call)
    except _Stop as s:
        v = s.value
        return v[0] if isinstance(v, (tuple, list)) else v
    raise PrecondError(f"the block's output {dst.name} was not reached")


def _eager_block(ctx: SchemeContext, layer: Node, dst: Node, mode: str
                 ) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor | None]:
    if layer.module is None:
        raise PrecondError("functional layer call: no module to substitute its input (eager)")
    model = ctx.model
    lm = model.get_submodule(layer.module)
    post: Callable[[torch.Tensor], torch.Tensor] | None = None
    if dst.name == layer.name:
        out_mod, out_idx = lm, layer.call_index
    elif dst.module is not None:
        out_mod, out_idx = model.get_submodule(dst.module), dst.call_index
    elif dst.inputs == [layer.name]:
        name, slope = activation_of(dst)
        if name == "leaky_relu":
            post = lambda t: F.leaky_relu(t, slope)  # noqa: E731
        elif name == "elu":
            post = lambda t: F.elu(t, slope or 1.0)  # noqa: E731
        elif name in _ACT_FN:
            post = _ACT_FN[name]
        else:
            raise PrecondError(f"functional activation {name} not supported in eager blocks")
        out_mod, out_idx = lm, layer.call_index
    else:
        raise PrecondError("functional activation after intermediate ops: not reachable by hooks")
    captured: dict[str, torch.Tensor] = {}

    def grab_input(mod: nn.Module, args: tuple) -> None:
        if counts["in"] == layer.call_index and args:
            captured["x"] = args[0].detach().clone()  # as produced, before any in-place op
        counts["in"] += 1

    counts = {"in": 0, "out": 0}
    h = lm.register_forward_pre_hook(grab_input, prepend=True)
    try:
        with quiet_run(model, mode), torch.no_grad():
            ctx.sample.call(model)
    finally:
        h.remove()
    x0 = captured.get("x")

    def f(x: torch.Tensor) -> torch.Tensor:
        cnt = {"in": 0, "out": 0}

        def pre(mod: nn.Module, args: tuple) -> Any:
            k = cnt["in"]
            cnt["in"] += 1
            if k == layer.call_index:
                return (x,) + tuple(args[1:])
            return None

        def hook(mod: nn.Module, args: tuple, out: Any) -> None:
            k = cnt["out"]
            cnt["out"] += 1
            if k == out_idx:
                o = out[0] if isinstance(out, (tuple, list)) else out
                raise _Stop(post(o) if post is not None else o)

        hs = [lm.register_forward_pre_hook(pre, prepend=True),
              out_mod.register_forward_hook(hook)]
        try:
            ctx.sample.call(model)
        except _Stop as s:
            return s.value
        finally:
            for hh in hs:
                hh.remove()
        raise PrecondError(f"the block's output {dst.name} was not reached")
    return f, x0
