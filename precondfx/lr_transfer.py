"""Learning-rate transfer (``lr_scale=``): function-preserving per-layer scales chosen so that one
learning rate suits networks of different widths and depths.

``y = alpha * W x`` computes the same function when ``alpha`` is multiplied by ``c`` and the
stored ``W`` is divided by ``c``, but the optimizer sees the stored ``W``: its gradient shrinks
by ``c`` and its Hessian block by ``c^2``.  So under SGD the layer's effective learning rate
(the step of ``alpha * W``) is multiplied by ``c^2``, and under Adam, whose steps do not depend
on the gradient's scale, by ``c``.  ``lr_scale`` picks ``c`` per layer:

* ``"adam"``: an Adam step moves each stored weight by about ``lr`` per entry, with signs that
  follow the input, so it changes the layer's output by ``lr * sqrt(fan_in) / rms(W)`` relative
  to its size (``rms(W)``: the stored weight's root mean square; the alpha cancels).  Scaling
  every stored weight to ``rms(W) = sqrt(fan_in) / NU_REF * (L / DEPTH_REF)^2`` makes that
  relative change ``lr * NU_REF * (DEPTH_REF / L)^2`` in every layer, whatever its shape (for
  fan-in-scaled hidden weights this is muP's Adam rule, learning rate ~ 1/fan_in; it also
  covers the input and output layers of geometric init, whose scales muP does not assume).
* ``"sgd"``: ``c = DEPTH_REF / L`` for every layer (effective rate ``x (DEPTH_REF/L)^2``).  Under
  SGD the relative update of a layer is its GR scaling, which precondfx already makes equal
  across layers; its best rate did not move across widths and fell with depth.

The depth factors come from training (docs/results/lr_transfer_cpu.md): on the digits MLPs the
best rate of precondfx's default fell as about ``L^-2`` with both optimizers.  ``L`` is the
number of weighted layers on the longest input-to-output path with every residual branch cut
(the stream through the skip connections): ``D + 1`` for a plain MLP with ``D`` hidden layers;
stem, head and projection shortcuts for a residual network; embedding and head for a
transformer.  The measured curvature at initialization (top Gauss-Newton eigenvalue, curvature
along the first SGD or Adam step) predicted the best rate's movement worse than these rules.

The scales are applied to the rewritten model after measured balancing (which would otherwise
undo them): every layer carries an alpha buffer when ``lr_scale`` is set.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from precondfx.errors import PrecondError
from precondfx.graph import Graph
from precondfx.options import INIT_RULES, LR_SCALE_MODES
from precondfx.plan import Plan

#: Adam: relative change of a layer's output per unit learning rate (at depth DEPTH_REF);
#: 64 keeps c near 1 for a 128-wide hidden layer of geometric init
NU_REF = 64.0
#: depth (weighted layers on the main path) at which the depth factor is 1
DEPTH_REF = 3
#: c = (DEPTH_REF / L) ** DEPTH_POWER[mode]: effective rate ~ L^-2 under both optimizers
#: (c^2 for SGD, c for Adam)
DEPTH_POWER = {"sgd": 1.0, "adam": 2.0}


def main_path_depth(graph: Graph, plan: Plan) -> int:
    """Weighted layers on the longest input-to-output path, residual branches cut; >= 1."""
    layer_nodes = {lay.node for lay in plan.layers}
    cut = {r.node: r.branch_index for r in plan.residuals}
    depth: dict[str, int] = {}
    for n in graph:
        ins = [i for k, i in enumerate(n.inputs) if cut.get(n.name) != k]
        d = max((depth.get(i, 0) for i in ins), default=0)
        depth[n.name] = d + (1 if n.name in layer_nodes else 0)
    ends = [depth[o] for o in graph.outputs if o in depth] or list(depth.values()) or [1]
    return max(1, max(ends))


def fan_in(lay: Any, node: Any = None) -> float:
    """Inputs one output of the layer sums over (``n_in * k^2``, zero-padding taps counted as
    the planner counts them); 1 for an embedding (a one-hot input).  For a linear call the
    output's last dimension says which side of the weight is the output: ``addmm(b, x, W)``
    (transformers' Conv1D) holds W as (in, out), the transpose of nn.Linear's."""
    if lay.kind == "embedding":
        return 1.0
    out = getattr(node, "out_shape", None)
    if lay.kind == "linear" and out and lay.n_in != lay.n_out and out[-1] in (lay.n_in,
                                                                               lay.n_out):
        return float(lay.n_in * lay.n_out // out[-1])
    return float(lay.n_in) * float(lay.k2_eff or lay.k2)


def stored_rms(w: torch.Tensor) -> float:
    """Root mean square of a stored weight (what Adam's per-entry steps are relative to)."""
    return float(w.detach().double().pow(2).mean().sqrt())


def _rms_of(model: nn.Module, plan: Plan, w: str) -> float:
    """The stored weight's rms: measured, or on the meta device the planned draw's std."""
    p = model.get_parameter(w)
    if p.device.type != "meta":
        return stored_rms(p)
    pi = plan.inits.get(w)
    if pi is not None and pi.rule in INIT_RULES and pi.std:
        return float(pi.std)
    raise PrecondError(f"lr_scale='adam' needs the scale of {w}, which is on the meta device and "
                       f"not re-drawn by the plan ({pi.rule if pi else 'no plan entry'}): "
                       f"materialize the model first, or use lr_scale='sgd'")


def factors(graph: Graph, plan: Plan, mode: str, rms: dict[str, float]
            ) -> tuple[dict[str, float], int]:
    """The factor ``c`` per weight (the first call site's, so that a shared weight gets one
    factor) and the main-path depth ``L``; ``rms``: each stored weight's root mean square
    (``"adam"`` only; a weight with rms 0 keeps c = 1)."""
    if mode not in LR_SCALE_MODES:
        raise PrecondError(f"lr_scale={mode!r} is not one of {LR_SCALE_MODES} (or None)")
    L = main_path_depth(graph, plan)
    depth_c = (DEPTH_REF / L) ** DEPTH_POWER[mode]
    out: dict[str, float] = {}
    for lay in plan.layers:
        if not lay.weight or lay.weight in out:
            continue
        c = depth_c
        if mode == "adam":
            r = rms.get(lay.weight, 0.0)
            if not (r > 0 and math.isfinite(r)):
                continue
            c *= NU_REF * r / math.sqrt(fan_in(lay, graph.get(lay.node)))
        out[lay.weight] = c
    return out, L


def _why(mode: str, c: float, L: int) -> str:
    return f"lr_scale={mode!r} x{c:.4g} (main-path depth {L})"


def summary(mode: str, fac: dict[str, float], L: int) -> str:
    vals = list(fac.values()) or [1.0]
    return (f"lr_scale={mode!r}: main-path depth {L}, {len(fac)} layers scaled by "
            f"{min(vals):.3g}..{max(vals):.3g} (alpha x c, weight / c: same function; each "
            f"layer's effective learning rate x c{'^2' if mode == 'sgd' else ''})")


def apply(model: nn.Module, graph: Graph, plan: Plan, alpha_buffers: dict[str, list[str]],
          mode: str, planned: dict[str, float] | None = None) -> dict[str, Any]:
    """Multiply each layer's alpha buffers by its factor and divide its weight by it, keeping
    the plan (and ``planned``, the constants recorded for materializing) equal to what the
    model holds.  Layers whose call sites do not all carry an alpha keep factor 1 and are listed
    in ``left_out``.  Returns the report section."""
    from precondfx.balance import _rescale, balanceable
    ok, left = balanceable(alpha_buffers, plan)
    rms = {w: _rms_of(model, plan, w) for w in ok} if mode == "adam" else {}
    fac, L = factors(graph, plan, mode, rms)
    done = {w: c for w, c in fac.items() if w in ok and c != 1.0}
    with torch.no_grad():
        for w, c in done.items():
            _rescale(model, w, ok[w], c)
            for b in ok[w]:
                if planned is not None and b in planned:
                    planned[b] *= c
    _record(plan, done, mode, L)
    note = summary(mode, done, L)
    plan.notes.append(note)
    vals = list(done.values()) or [1.0]
    return {"mode": mode, "depth": L, "factor_min": min(vals), "factor_max": max(vals),
            "factors": done, "left_out": dict(left), "summary": note}


def _record(plan: Plan, done: dict[str, float], mode: str, L: int) -> None:
    """Keep the plan equal to what the model now holds: alphas (layers and scale entries) x c,
    weight stds (or rescaling factors) / c."""
    node_w = {lay.node: lay.weight for lay in plan.layers}
    for lay in plan.layers:
        c = done.get(lay.weight or "")
        if c is not None:
            lay.alpha *= c
            lay.alpha_reason = "; ".join(x for x in (lay.alpha_reason, _why(mode, c, L)) if x)
    for sc in plan.scales:
        if sc.tag == "alpha" and node_w.get(sc.node) in done:
            sc.value *= done[node_w[sc.node]]
    for w, c in done.items():
        pi = plan.inits.get(w)
        if pi is not None and pi.std is not None:
            pi.std = pi.std / c


def effective_lr_multiplier(c: float, mode: str) -> float:
    """How much a layer's effective learning rate changes for a factor ``c``: ``c^2`` under SGD,
    ``c`` under Adam."""
    return c * c if mode == "sgd" else c


__all__ = ["NU_REF", "DEPTH_REF", "DEPTH_POWER", "main_path_depth", "fan_in",
           "stored_rms", "factors", "apply", "effective_lr_multiplier", "summary"]
