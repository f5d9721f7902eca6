"""Learning-rate transfer (``lr_scale=``): function-preserving per-layer scales chosen so that one
learning rate suits networks of different widths and depths.

Each weighted layer ``y = W x + b`` (after the alpha balancing put on its input, if any) becomes
``y = c * ((W / c) x + b / c)``: a multiplier ``c`` on the layer's output (a ``Scale`` of tag
``lr`` in the plan, a ``precondfx_lr*`` buffer placed by the back end) and the stored weight
*and bias* divided by ``c``.  The function is the same, but the optimizer sees the stored
``W / c`` and ``b / c``:

* SGD: their gradients are ``c`` times the function's, so the step of the effective ``c W'``
  and ``c b'`` is ``c^2`` times the step without the option: the layer's effective learning
  rate, weight and bias alike, is multiplied by ``c^2`` (its Hessian block by ``c^2``).
* Adam: a step does not depend on the gradient's scale, so the stored ``W'`` and ``b'`` move by
  the same amounts as without the option (about ``lr`` per entry) and the effective ``c W'``
  and ``c b'`` by ``c`` times that: the effective rate of the weight and of the bias is
  multiplied by ``c``.  The bias rule is therefore the weight's: stored ``b / c`` under the
  same ``c``, so that the bias's step relative to the weight's stays what it is without the
  option.  (When the multiplier was an alpha on the layer's input, the bias kept the raw
  rate while the weight's moved by ``c^2``: at depth 16 under SGD the biases ran ``1/c^2 =
  32x`` faster than the weights, which cost training; docs/results/lr_transfer_cpu.md.)
* AdamW's decoupled weight decay shrinks ``W'`` and ``b'`` by ``lr * wd`` per step, the same
  relative shrinkage of the effective weight as without the option.

``lr_scale`` picks ``c`` per layer:

* ``"user"``: ``c = (rms(W) / rms(W_user)) ** USER_POWER`` with ``USER_POWER = 0.5``: every
  stored weight at the geometric mean of its precondfx rms and the rms it had in the user's
  model before the pass (read before the re-draw).  Precondfx's geometric init stores weights
  larger than the framework's (9x on GPT-2's std 0.02), so an Adam step, which does not scale
  with the weight, is a smaller relative change and the best AdamW rate moves 1-3 octaves above
  the one a pipeline tuned for the framework's init uses.  Storing at the user's rms
  (power 1) overshoots: the best rate lands 1-2 octaves *below* the user's and it lost at the
  user's rate on four of four tasks; halfway (power 0.5) put it at the user's rate on GPT-2 and
  a tiny ViT (docs/results/heldout_cpu.md, section 2).
* ``"sgd"``: ``c = DEPTH_REF / L`` for every layer (effective rate ``x (DEPTH_REF/L)^2``).  Under
  SGD the relative update of a layer is its GR scaling, which precondfx already makes equal
  across layers; its best rate did not move across widths and fell with depth.
* ``"adam"``: one ``c = (WIDTH_REF / h) ** WIDTH_POWER * (DEPTH_REF / L) ** DEPTH_POWER["adam"]``
  on every layer (``WIDTH_REF = 128``, ``WIDTH_POWER = 0.5``, ``DEPTH_POWER = 1.5``), ``h`` the
  model's width (:func:`model_width`: the median over its layers of each one's fan-in
  ``n_in k^2``, or fan-out for a layer reading the model's input, whose fan-in the data sets),
  multiplied onto the declared-init storage ``"auto"`` chooses where it applies
  (transformers).  One factor, so the result trains as precondfx's default at the AdamW rate
  times ``c``: the layers' rates relative to each other are the default's, and only the
  rate's level moves with width and depth (the first steps agree to 1e-4; later the two part
  as chaotic training does).  Both exponents are the default's own measured movement
  (docs/results/lr_transfer_cpu.md, "lr_scale='adam' (2026-11-27)"): on the digits MLPs its
  best AdamW rate fell as about ``width^-0.5`` (3.1 octaves over widths 32-2048) and
  ``L^-1.5`` (4.4 octaves over depths 1-16); with the option, 1.4 and 1.8 octaves (fits; 2
  and 2 on the grid).  A factor per layer (each layer's own width) cost 0.028 nats on GPT-2
  (6 seeds), where the relative rates matter.

The depth factors come from training (docs/results/lr_transfer_cpu.md): on the digits MLPs the
best rate of precondfx's default fell as about ``L^-2`` under SGD.  An earlier
``lr_scale="adam"`` (stored weights at rms ``sqrt(fan_in)/64 (L/3)^1.5``, 4x the relative step
inside residual branches) was removed in 2026-11: on held-out data it lost to the default on a
tiny ViT at every rate (1.08 against 0.50) and at the user's rate on three of four tasks
(docs/results/heldout_cpu.md).  The present rule differs in its width factor (fan-in to the
power 0.5, the first layer sized by its fan-out) and has no residual-branch multiplier.  ``L`` is the
number of weighted layers on the longest input-to-output path with every residual branch cut
(the stream through the skip connections): ``D + 1`` for a plain MLP with ``D`` hidden layers;
stem, head and projection shortcuts for a residual network; embedding and head for a
transformer.  The measured curvature at initialization (top Gauss-Newton eigenvalue, curvature
along the first SGD or Adam step) predicted the best rate's movement worse than these rules.

The factors are set on the rewritten model after measured balancing, which leaves the
multipliers (1 until then) alone; a meta-device model gets them in its recorded constants and
in the plan's stds (W / c drawn by ``precondfx.reinit`` after ``to_empty``).  A layer whose call
sites do not all carry a multiplier (a functional call the eager back end cannot hook), or
whose bias another weight's layer also reads, keeps factor 1 (``left_out``).
"""
from __future__ import annotations

import math
import statistics
from typing import Any

import torch
from torch import nn

from precondfx.errors import PrecondError
from precondfx.pytorch import reals
from precondfx.core.graph import Graph
from precondfx.core.options import INIT_RULES, LR_SCALE_MODES
from precondfx.core.plan import LR_SITE_REASON, Plan

#: depth (weighted layers on the main path) at which the depth factor is 1
DEPTH_REF = 3
#: c = (DEPTH_REF / L) ** DEPTH_POWER[mode]: effective rate ~ L^-2 under SGD (c^2)
DEPTH_POWER = {"sgd": 1.0, "adam": 1.5}
#: lr_scale="adam": fan-in at which the width factor is 1, and its power (c = (WIDTH_REF /
#: fan_in) ** WIDTH_POWER on every layer that reads another layer's output)
WIDTH_REF = 128
WIDTH_POWER = 0.5
#: lr_scale="user": c = (rms / user rms) ** USER_POWER (0.5: stored halfway, on the log scale,
#: between precondfx's rms and the user's; 1 overshoots: docs/results/heldout_cpu.md)
USER_POWER = 0.5


def layer_depths(graph: Graph, plan: Plan) -> dict[str, int]:
    """Each node's count of weighted layers on the longest path from the inputs to it (itself
    included), residual branches cut: 1 for a layer that reads the model's input directly."""
    layer_nodes = {lay.node for lay in plan.layers}
    cut = {r.node: r.branch_index for r in plan.residuals}
    depth: dict[str, int] = {}
    for n in graph:
        ins = [i for k, i in enumerate(n.inputs) if cut.get(n.name) != k]
        d = max((depth.get(i, 0) for i in ins), default=0)
        depth[n.name] = d + (1 if n.name in layer_nodes else 0)
    return depth


def main_path_depth(graph: Graph, plan: Plan) -> int:
    """Weighted layers on the longest input-to-output path, residual branches cut; >= 1."""
    depth = layer_depths(graph, plan)
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


def fan_out(lay: Any, node: Any = None) -> float:
    """Outputs one input of the layer reaches (``n_out * k^2``; the transpose of
    :func:`fan_in` for a linear call)."""
    if lay.kind == "linear":
        return float(lay.n_in * lay.n_out) / fan_in(lay, node)
    return float(lay.n_out) * float(lay.k2_eff or lay.k2)


def stored_rms(w: torch.Tensor) -> float:
    """Root mean square of a stored weight (what Adam's per-entry steps are relative to)."""
    return reals.mean_square(w) ** 0.5      # a complex weight: per real coordinate


#: the config attributes in which a transformers model declares the std its ``_init_weights``
#: draws Linear and Embedding weights with
INIT_STD_KEYS = ("initializer_range", "init_std")


def declared_stds(model: nn.Module) -> dict[str, float]:
    """Each weight's (dim >= 2) init std as the model declares it, without reading values: the
    ``initializer_range`` (or ``init_std``) of the config of the innermost transformers model
    holding it (an encoder-decoder's encoder and decoder each declare their own).
    Data-free, so that a model on the meta device, a sharded one and the same model with its
    values get the same ``lr_scale='auto'`` decision and factors."""
    from precondfx.integrations.hf_checkpoints import is_transformers_model
    out: dict[str, float] = {}
    for path, mod in model.named_modules():
        if not is_transformers_model(mod):
            continue
        cfg = getattr(mod, "config", None)
        std = next((float(v) for k in INIT_STD_KEYS for v in [getattr(cfg, k, None)]
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0), None)
        if std is None:
            continue
        for n, p in mod.named_parameters(remove_duplicate=False):
            if p.dim() >= 2:
                out[f"{path}.{n}" if path else n] = std   # an inner model's own config wins
    return out


def user_scales(model: nn.Module, mode: str | None) -> dict[str, float]:
    """What ``lr_scale`` compares each weight's planned scale with: ``"user"``: its rms in
    ``model`` now (before the re-draw; none on the meta device); ``"auto"``: the std the model
    declares (``declared_stds``); otherwise nothing."""
    if mode == "user":
        return {n: stored_rms(p) for n, p in model.named_parameters(remove_duplicate=False)
                if p.dim() >= 2 and p.numel() and p.device.type != "meta"}
    return declared_stds(model) if mode in ("auto", "adam") else {}


def power_of_two(c: float) -> float:
    """``c`` rounded to the nearest power of two (on the log scale): dividing a weight by it and
    drawing at ``std / c`` are exact in every float format, so a half-precision model planned
    on the meta device holds bit for bit what the same model preconditioned with data holds,
    and its constants hold the factor exactly."""
    if not (c > 0 and math.isfinite(c)):
        return c
    return 2.0 ** round(math.log2(c))


def _planned_rms(plan: Plan, w: str) -> float:
    """The planned draw's std of ``w`` (0: not re-drawn by an init rule: factor 1)."""
    pi = plan.inits.get(w)
    return float(pi.std) if pi is not None and pi.rule in INIT_RULES and pi.std else 0.0


def _rms_of(model: nn.Module, plan: Plan, w: str) -> float:
    """The stored weight's rms: measured, or on the meta device the planned draw's std."""
    p = model.get_parameter(w)
    if p.device.type != "meta":
        return stored_rms(p)
    pi = plan.inits.get(w)
    if pi is not None and pi.rule in INIT_RULES and pi.std:
        return float(pi.std)
    raise PrecondError(f"lr_scale='user' needs the scale of {w}, which is on the meta device and "
                       f"not re-drawn by the plan ({pi.rule if pi else 'no plan entry'}): "
                       f"materialize the model first, or use lr_scale='sgd'")


def factors(graph: Graph, plan: Plan, mode: str, rms: dict[str, float],
            user_rms: dict[str, float] | None = None) -> tuple[dict[str, float], int]:
    """The factor ``c`` per weight (the first call site's, so that a shared weight gets one
    factor) and the main-path depth ``L``; ``rms``: each stored weight's root mean square
    (``"user"``; a weight with rms 0 keeps c = 1); ``user_rms``: the rms of
    each weight in the user's model before the pass (``"user"``: ``c = (rms / user_rms) **
    USER_POWER``, so that the stored weight gets ``rms ** (1 - p) * user_rms ** p``, the
    geometric mean for p = 0.5; a weight without one keeps c = 1)."""
    if mode not in LR_SCALE_MODES:
        raise PrecondError(f"lr_scale={mode!r} is not one of {LR_SCALE_MODES} (or None)")
    L = main_path_depth(graph, plan)
    if mode == "user":
        out_u: dict[str, float] = {}
        for lay in plan.layers:
            w = lay.weight
            if not w or w in out_u:
                continue
            r, u = rms.get(w, 0.0), (user_rms or {}).get(w, 0.0)
            if r > 0 and u > 0 and math.isfinite(r) and math.isfinite(u):
                out_u[w] = (r / u) ** USER_POWER
        return out_u, L
    depth_c = (DEPTH_REF / L) ** DEPTH_POWER[mode]
    if mode == "adam":
        depth_c *= (WIDTH_REF / model_width(graph, plan)) ** WIDTH_POWER
    out: dict[str, float] = {}
    for lay in plan.layers:
        if not lay.weight or lay.weight in out:
            continue
        out[lay.weight] = depth_c
    return out, L


def model_width(graph: Graph, plan: Plan) -> float:
    """``lr_scale='adam'``'s width: the median over the weighted layers (embeddings aside) of
    each one's width, its fan-in where it reads another layer's output, its fan-out where it
    reads the model's input (whose fan-in the data sets); ``WIDTH_REF`` where there is none.
    A plain MLP's hidden width; one number, so that the option rescales the rate and leaves
    the layers' rates relative to each other as the default's."""
    first = layer_depths(graph, plan)
    hs = []
    for lay in plan.layers:
        if not lay.weight or lay.kind == "embedding":
            continue
        node = graph.get(lay.node)
        h = fan_out(lay, node) if first.get(lay.node, 1) <= 1 else fan_in(lay, node)
        if h > 0 and math.isfinite(h):
            hs.append(h)
    return float(statistics.median(hs)) if hs else float(WIDTH_REF)


def summary(mode: str, fac: dict[str, float], L: int) -> str:
    vals = list(fac.values()) or [1.0]
    return (f"lr_scale={mode!r}: main-path depth {L}, {len(fac)} layers scaled by "
            f"{min(vals):.3g}..{max(vals):.3g} (output x c, weight and bias / c: same function; "
            f"each layer's effective learning rate x c{'^2' if mode == 'sgd' else ''})")


def carried(lr_buffers: dict[str, list[str]], plan: Plan, graph: Graph | None = None
            ) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The weights whose every call site carries an lr multiplier (weight -> the constants),
    and why the others are left out (factor 1): a site with none (see NOT APPLIED), a bias
    also read by a layer of another weight (one stored bias cannot take two factors), or a
    weight ``graph`` shows read outside its layers (``F.linear(h, w.t())``: dividing it would
    change that use)."""
    from precondfx.pytorch.balance import other_readers
    sites: dict[str, int] = {}
    bias_users: dict[str, set[str]] = {}
    nodes: dict[str, set[str]] = {}
    for lay in plan.layers:
        if lay.weight:
            sites[lay.weight] = sites.get(lay.weight, 0) + 1
            nodes.setdefault(lay.weight, set()).add(lay.node)
            if lay.bias:
                bias_users.setdefault(lay.bias, set()).add(lay.weight)
                nodes.setdefault(lay.bias, set()).add(lay.node)
    others = other_readers(graph, nodes) if graph is not None else {}
    ok: dict[str, list[str]] = {}
    left: dict[str, str] = {}
    for w, n in sites.items():
        bufs = lr_buffers.get(w, [])
        shared = [b for lay in plan.layers if lay.weight == w and lay.bias
                  for b in [lay.bias] if len(bias_users[b]) > 1]
        outside = others.get(w) or [o for lay in plan.layers if lay.weight == w and lay.bias
                                    for o in others.get(lay.bias, [])]
        pi = plan.inits.get(w)
        if not bufs and pi is not None and pi.frozen:
            left[w] = "frozen (requires_grad=False): the optimizer does not move it: factor 1"
        elif len(bufs) != n:
            left[w] = (f"an lr multiplier was placed on {len(bufs)} of its {n} call sites (see "
                       f"NOT APPLIED): factor 1")
        elif outside:
            left[w] = (f"the weight or its bias is also read outside its layer (by "
                       f"{', '.join(outside[:3])}): dividing it would change that use: factor 1")
        elif shared:
            left[w] = f"its bias {shared[0]} is also read by another weight's layer: factor 1"
        else:
            ok[w] = sorted(set(bufs))
    return ok, left


def apply(model: nn.Module, graph: Graph, plan: Plan, lr_buffers: dict[str, list[str]],
          mode: str, planned: dict[str, float] | None = None,
          set_constant: Any = None, user_rms: dict[str, float] | None = None,
          from_plan: bool = False, declared: bool = False) -> dict[str, Any]:
    """Set each layer's lr multipliers to its factor ``c`` and divide its weight and bias by
    ``c``, keeping the plan (and ``planned``, the constants recorded for materializing) equal
    to what the model holds.  ``set_constant(name, value)``: the back end's
    (``Backend.set_constant``).  Layers whose call sites do not all carry a multiplier keep
    factor 1 and are listed in ``left_out``.  ``from_plan``: take each weight's scale from the
    plan's std rather than its values (``lr_scale='auto'``: data-free, so that the meta device,
    sharded and real runs get the same factors).  ``declared`` (``"adam"``): multiply its
    factors onto the declared-init storage ``"auto"`` would choose (``lr_mode.declared_base``).
    Returns the report section."""
    ok, left = carried(lr_buffers, plan, graph)
    rms = {w: _planned_rms(plan, w) if from_plan or mode == "adam" else _rms_of(model, plan, w)
           for w in ok} if mode == "user" or (mode == "adam" and declared) else {}
    fac, L = factors(graph, plan, mode, rms, user_rms)
    if from_plan:       # exact in every dtype: meta == real, bit for bit (power_of_two)
        fac = {w: power_of_two(c) for w, c in fac.items()}
    if mode == "adam" and declared:     # on top of the storage "auto" chooses (lr_mode)
        base, _ = factors(graph, plan, "user", rms, user_rms)
        fac = {w: c * power_of_two(base.get(w, 1.0)) for w, c in fac.items()}
    done = {w: c for w, c in fac.items() if w in ok and c != 1.0}
    store(model, plan, ok, done, f"lr_scale={mode!r} (main-path depth {L})", planned,
          set_constant)
    note = summary(mode, done, L)
    plan.notes.append(note)
    vals = list(done.values()) or [1.0]
    return {"mode": mode, "depth": L, "factor_min": min(vals), "factor_max": max(vals),
            "factors": done, "left_out": dict(left), "summary": note}


def store(model: nn.Module, plan: Plan, ok: dict[str, list[str]], done: dict[str, float],
          why: str, planned: dict[str, float] | None = None, set_constant: Any = None) -> None:
    """Multiply the lr multipliers of each weight in ``done`` (``ok``: weight -> its
    constants, from :func:`carried`) by its factor ``c`` and divide the weight and its bias by
    ``c``: the same function, the layer's effective rate x c^2 (SGD) or x c (Adam).  The plan
    (and ``planned``, the constants recorded for materializing) is kept equal to what the
    model holds; ``why`` goes into each changed scale's reason."""
    bias_of = {lay.weight: lay.bias for lay in plan.layers if lay.weight and lay.bias}
    if set_constant is None:
        def set_constant(name: str, value: float) -> None:
            model.get_buffer(name).fill_(value)
    with torch.no_grad():
        for w, c in done.items():
            for b in ok[w]:
                now = planned.get(b, 1.0) if planned is not None else \
                    float(model.get_buffer(b).reshape(-1)[0])
                set_constant(b, now * c)
                if planned is not None:
                    planned[b] = now * c
            model.get_parameter(w).div_(c)
            if w in bias_of:
                model.get_parameter(bias_of[w]).div_(c)
    _record(plan, done, bias_of, why)


def _record(plan: Plan, done: dict[str, float], bias_of: dict[str, str], why: str) -> None:
    """Keep the plan equal to what the model now holds: each layer's ``lr`` scale x c, its
    weight's and bias's std (or rescaling factor) / c (a zero bias stays zero)."""
    node_w = {lay.node: lay.weight for lay in plan.layers}
    for sc in plan.scales:
        c = done.get(node_w.get(sc.node) or "") if sc.tag == "lr" else None
        if c is not None:
            sc.value *= c
            what = f"{why} x{c:.4g}: weight and bias stored / {c:.4g}"
            sc.reason = what if sc.reason == LR_SITE_REASON else f"{sc.reason}; {what}"
    for w, c in done.items():
        for name in (w, bias_of.get(w)):
            pi = plan.inits.get(name or "")
            if pi is not None and pi.std is not None:
                pi.std = pi.std / c


def effective_lr_multiplier(c: float, mode: str) -> float:
    """How much a layer's effective learning rate changes for a factor ``c``: ``c^2`` under SGD,
    ``c`` under Adam."""
    return c * c if mode == "sgd" else c


__all__ = ["DEPTH_REF", "DEPTH_POWER", "USER_POWER", "INIT_STD_KEYS", "main_path_depth",
           "fan_in", "stored_rms", "declared_stds", "user_scales", "power_of_two", "factors",
           "carried", "apply", "store", "effective_lr_multiplier", "summary"]
