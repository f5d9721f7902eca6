"""Plan what to change: plain data computed from a classified graph, shared by every back end.

A :class:`Plan` says, keyed by parameter and node names: how each parameter is initialized
(rule and standard deviation), which scale constants go where (alpha on a layer's input, the
residual branch scale s on an add's operand, the input and output scales), and what happens to
each max-pooling node.  It serializes to JSON, so it can be printed, saved, diffed, compared
between the PyTorch and ONNX paths, and re-applied.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from precondfx.core import beta as betalib
from precondfx.core import classify
from precondfx.core import fans as fanlib
from precondfx.core import tokens as tokens_mod
from precondfx.core import lr_mode, optable, residual_schedule
from precondfx.core.graph import Graph, Node
from precondfx.core.options import (BALANCE_MODES, MAXPOOL_MODES, MEASURED, RESIDUAL_MODES,
                               fixed_lr, lr_auto,
                               Options)

# the options are defined in precondfx.core.options (re-exported here for older imports)
__all__ = ["Options", "MAXPOOL_MODES", "BALANCE_MODES", "MEASURED", "RESIDUAL_MODES", "Plan",
           "ParamInit", "ParamInfo", "Layer", "Scale", "PoolChange", "Residual", "make_plan",
           "plan_io"]


@dataclass
class ParamInit:
    """How one parameter is (re-)initialized."""

    name: str
    rule: str            # geometric | fan_in | fan_out | xavier | zeros | ones | orthogonal |
    #                      scale (multiply the current value by ``std``) |
    #                      constant (every element ``std``) | keep |
    #                      match (a normal draw at the measured rms of node ``match``'s
    #                      output: a free token or position parameter, core.tokens)
    std: float | None    # standard deviation of the normal draw (weights), the factor for
    #                      ``scale``, else None (``match``: None until measured)
    reason: str
    shape: list[int] = field(default_factory=list)
    gates: int = 1       # orthogonal per gate block (recurrent weights)
    match: str | None = None   # rule ``match``: the node whose output rms is the draw's std
    frozen: bool = False       # requires_grad=False: kept, and no optimizer moves it


@dataclass
class Layer:
    """One weighted call site: its fans and its alpha."""

    node: str
    kind: str
    module: str | None
    weight: str | None
    bias: str | None
    n_in: int
    n_out: int
    k2: int
    alpha: float = 1.0
    alpha_reason: str = ""
    in_residual_branch: bool = False
    k2_eff: float | None = None   # taps that reach the input on average (zero padding)
    beta: float = 1.0             # App. E's block multiplier, 1/beta at the input (core.beta)

    def constant(self) -> float:
        """The product of the constants on this layer's weight (alpha / beta): its init std is
        the rule's divided by it."""
        return self.alpha / self.beta


@dataclass
class Scale:
    """A fixed scalar multiplication inserted in the graph."""

    tag: str             # alpha | residual | beta (1/beta_l, App. E) | input | output | lr
    #                      (lr_scale's multiplier on a layer's output: weight and bias stored
    #                      divided by it)
    node: str            # node whose input/output/operand is scaled
    where: str           # input | output | operand
    index: int           # operand or input index
    value: float
    reason: str

    def key(self) -> str:
        """The scale's name in the back ends' outcomes and in ``report.measured``."""
        return f"{self.tag}:{self.node}:{self.where}:{self.index}"


@dataclass
class PoolChange:
    """What happens to one max-pooling node."""

    node: str
    action: str          # fold | conv | avgpool | keep
    reason: str
    into: str | None = None      # conv node the stride is folded into
    new_param: str | None = None  # weight of the replacement conv
    geometry: dict = field(default_factory=dict)
    conv: str = "full"   # replacement conv (action 'conv'): full | depthwise | avg (POOL_CONVS)


@dataclass
class Residual:
    """A residual join (skip connection) and its branch."""

    node: str
    branch_index: int
    fork: str
    branch_layers: list[str]
    s: float | None
    reason: str
    beta: float = 1.0    # App. E's beta_l of this block (1 where flat or not App. E's block)
    beta_reason: str = ""


@dataclass
class Plan:
    """Everything the pass will change; JSON-serializable."""

    options: dict
    layers: list[Layer] = field(default_factory=list)
    inits: dict[str, ParamInit] = field(default_factory=dict)
    scales: list[Scale] = field(default_factory=list)
    pools: list[PoolChange] = field(default_factory=list)
    residuals: list[Residual] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: what a scheme's plan says about a node (a replacement, a normalized sum), shown as the
    #: node's reason in the report instead of the classification's
    reasons: dict[str, str] = field(default_factory=dict)
    #: tied parameters: every other name of a parameter -> the name its init is planned under
    #: (``model.to_empty`` unties them; ``precondfx.reinit`` ties them again)
    aliases: dict[str, str] = field(default_factory=dict)
    #: the lr_scale mode the pass applies ("sgd", "user" or None), ``options['lr_scale']``
    #: resolved ("auto": ``precondfx.core.lr_mode``)
    lr_mode: str | None = None
    #: why ``lr_mode`` is what it is, when ``lr_scale="auto"`` decided it (also in ``notes``)
    lr_mode_reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if not isinstance(d, dict) or "options" not in d:
            # e.g. a whole report's dict (report.to_dict()) where its ['plan'] was meant
            from precondfx.errors import PrecondError
            got = sorted(d)[:8] if isinstance(d, dict) else type(d).__name__
            todo = ("this is a whole report's dict: pass its ['plan']"
                    if isinstance(d, dict) and isinstance(d.get("plan"), dict) else
                    "pass report.plan, or the ['plan'] of a saved report's dict")
            raise PrecondError(f"not a plan (a plan's dict has 'options', 'inits', "
                               f"'layers'...; got {got}): {todo}")
        return cls(options=d["options"],
                   layers=[Layer(**x) for x in d.get("layers", [])],
                   inits={k: ParamInit(**v) for k, v in d.get("inits", {}).items()},
                   scales=[Scale(**x) for x in d.get("scales", [])],
                   pools=[PoolChange(**{**x, "geometry": _geometry(x.get("geometry", {}))})
                          for x in d.get("pools", [])],
                   residuals=[Residual(**x) for x in d.get("residuals", [])],
                   notes=list(d.get("notes", [])), reasons=dict(d.get("reasons", {})),
                   aliases=dict(d.get("aliases", {})), lr_mode=d.get("lr_mode"),
                   lr_mode_reason=d.get("lr_mode_reason", ""))

    def alphas(self) -> dict[str, float]:
        """alpha per weight parameter name (first call site)."""
        out: dict[str, float] = {}
        for lay in self.layers:
            if lay.weight and lay.weight not in out:
                out[lay.weight] = lay.alpha
        return out

    def scale(self, tag: str) -> Scale | None:
        return next((s for s in self.scales if s.tag == tag), None)


@dataclass
class ParamInfo:
    """What the planner needs to know of a parameter."""

    shape: tuple[int, ...]
    trainable: bool = True
    parametrized: bool = False
    aliases: tuple[str, ...] = ()   # the other names of a tied parameter
    #: its scale in the user's model (its rms before the pass, or the init std the model
    #: declares; None: not known): what ``lr_scale`` compares the planned scale with
    #: (``precondfx.core.lr_mode``, ``precondfx.pytorch.lr_transfer.user_scales``)
    user_scale: float | None = None
    #: every element exactly zero in the user's model (a zero-initialized adapter output,
    #: LoRA's B): see :func:`_zero_adapter`
    zero: bool = False


# ---------------------------------------------------------------------------------------------
def make_plan(graph: Graph, params: dict[str, ParamInfo], opts: Options,
              alpha_sites: bool = False) -> Plan:
    """Compute the plan for a classified graph; ``params`` describes the model's parameters.
    ``alpha_sites`` puts an alpha (1 where no correction is planned) at every weighted call
    site, as measured balancing and LSUV need."""
    plan = Plan(options=opts.planned())
    plan.aliases = {a: name for name, info in params.items() for a in info.aliases}
    _plan_pools(graph, params, plan, opts)
    _plan_layers(graph, params, plan)
    _plan_residuals(graph, params, plan, opts)
    if opts.balance == "analytic":
        _analytic_alphas(plan, {n.name: i for i, n in enumerate(graph)})
    if not opts.reinit:
        _shared_weight_constants(graph, plan)
    _plan_inits(graph, params, plan, opts)
    # lr_transfer sets the "lr" multipliers; "auto" compares the planned stds with the weights
    plan.lr_mode, why = lr_mode.resolve(plan, params, opts)
    if why:
        plan.lr_mode_reason = why
        plan.notes.append(why)
    for lay in plan.layers:
        info = params.get(lay.weight or "")
        if info is not None and not info.trainable:
            lay.alpha, lay.alpha_reason = 1.0, "frozen weight: no alpha (it would change the " \
                                                "function without a compensating weight)"
            continue
        if lay.alpha == 1.0 and opts.balance not in MEASURED and not alpha_sites:
            continue
        node = graph.get(lay.node)
        bilinear = node is not None and str(node.attrs.get("class", "")).endswith("Bilinear")
        # nn.Bilinear is linear in each input, not in both: a scale on its input would act
        # twice where both inputs are one tensor (y = B(h, h)); on its output it acts once
        where = "input" if lay.kind in ("conv", "conv_transpose", "linear", "matmul") and \
            not bilinear else "output"
        plan.scales.append(Scale("alpha", lay.node, where, 0, lay.alpha,
                                 lay.alpha_reason or "alpha site for measured balancing"))
    _beta_sites(plan)
    if plan.lr_mode is not None or fixed_lr(opts) is not None or lr_auto(opts):
        _lr_sites(plan, params)     # lr= (precondfx.pytorch.lr_target) sets them too, 'auto'
                                    # at the optimizer's first step (pytorch.first_step)
    return plan


def _beta_sites(plan: Plan) -> None:
    """App. E: ``1/beta_l`` on the input of every layer of block ``l``'s branch (where
    ``beta_l != 1``), placed like an alpha; the init std already carries ``beta_l``."""
    block = {m: r for r in plan.residuals for m in r.branch_layers}
    for lay in plan.layers:
        if lay.beta != 1.0:
            r = block.get(lay.node)
            plan.scales.append(Scale("beta", lay.node, "input", 0, 1.0 / lay.beta,
                                     f"1/beta_l of the block joined at {r.node if r else '?'} "
                                     f"(beta_l={lay.beta:.6g}, App. E); its weight starts at "
                                     f"beta_l times its std"))


#: the reason an lr multiplier carries until lr_scale or lr= sets it
LR_SITE_REASON = "lr_scale multiplier (weight and bias stored divided by it)"


def _lr_sites(plan: Plan, params: dict[str, ParamInfo]) -> None:
    """``lr_scale=``: a multiplier on the output of every weighted call site (1 here; set by
    ``precondfx.pytorch.lr_transfer`` after balancing, with the layer's weight and bias divided by it),
    so that the weight and the bias see the same change of effective learning rate."""
    for lay in plan.layers:
        info = params.get(lay.weight or "")
        if info is None or not info.trainable:
            continue
        plan.scales.append(Scale("lr", lay.node, "output", 0, 1.0, LR_SITE_REASON))


def plan_io(plan: Plan, opts: Options, input_value: float | None) -> None:
    """The input and output scales, planned with the rest (before anything is applied): the
    input scale's value is known now (Sec. 6.3; ``precondfx.core.driver.input_scale``), the output
    scale's is measured by calibration (Sec. 6.4), which records it in ``report.measured``."""
    if input_value is not None:
        plan.scales.append(Scale("input", "input", "input", 0, float(input_value),
                                 "input scale (Sec. 6.3)"))
    if opts.target_std is not None:
        plan.scales.append(Scale("output", "output", "output", 0, 1.0,
                                 f"output std -> {opts.target_std} on the calibration batch "
                                 f"(Sec. 6.4): the value is set by calibration"))


def _tuple(v: Any, d: int) -> tuple[int, ...]:
    if isinstance(v, (list, tuple)):
        if len(v) == 0:
            return ()
        return tuple(int(x) for x in v) if len(v) == d else tuple(int(v[0]) for _ in range(d))
    return tuple(int(v) for _ in range(d))


def _geometry(g: dict) -> dict:
    """A pool geometry read back from JSON: its per-dimension entries are tuples again, as
    ``pool_geometry`` makes them (so a loaded plan equals the one saved)."""
    return {k: tuple(v) if k in ("kernel", "stride", "padding", "dilation")
            and isinstance(v, list) else v for k, v in g.items()}


def pool_geometry(n: Node) -> dict | None:
    """kernel/stride/padding/dilation of a max-pool node as tuples of its spatial rank."""
    shape = n.in_shapes[0] if n.in_shapes else None
    if shape is None or n.out_shape is None:
        return None
    d = len(shape) - 2
    if d < 1:
        return None
    a = n.attrs
    k = _tuple(a.get("kernel_size", 1), d)
    s = _tuple(a.get("stride") if a.get("stride") not in (None, [], ()) else k, d)
    p = _tuple(a.get("padding", 0), d)
    dil = _tuple(a.get("dilation", 1), d)
    return {"dims": d, "kernel": k, "stride": s, "padding": p, "dilation": dil,
            "ceil_mode": bool(a.get("ceil_mode", False)), "channels": int(shape[1]),
            "in_shape": list(shape), "out_shape": list(n.out_shape)}


def conv_out(size: int, k: int, s: int, p: int, d: int) -> int:
    """Output length of a convolution along one dimension (floor mode)."""
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _producer_keeps_pool(graph: Graph, n: Node, params: dict[str, ParamInfo],
                         module_calls: dict[str, int]) -> str | None:
    """Why the max-pool ``n`` stays because of the layer it pools (None: it need not): a
    frozen layer (replacing the pool would change what the frozen layers compute, which no
    training could undo) or a module called more than once (one replacement per call would
    make the calls compute different functions)."""
    layer = _pooled_layer(graph, n)
    if layer is None:
        return None
    if _frozen_layer(graph, layer.name, params):
        return (f"it pools the output of {layer.module or layer.name}, whose weight is frozen "
                f"(requires_grad=False): replacing it would change what the frozen layers "
                f"compute, which no training could undo")
    if layer.module and module_calls.get(layer.module, 0) > 1:
        return (f"it pools the output of {layer.module}, a module called more than once (a "
                f"siamese net's shared encoder): a replacement convolution per call would make "
                f"the calls compute different functions")
    return None


def _plan_pools(graph: Graph, params: dict[str, ParamInfo], plan: Plan, opts: Options) -> None:
    users = graph.users()
    module_calls: dict[str, int] = {}
    for n in graph:
        if n.module:
            module_calls[n.module] = module_calls.get(n.module, 0) + 1
    for n in graph:
        if n.kind != "maxpool":
            continue
        geo = pool_geometry(n)
        if opts.maxpool == "keep":
            plan.pools.append(PoolChange(n.name, "keep", "maxpool='keep' was asked for"))
            continue
        if n.attrs.get("keep_reason"):
            plan.pools.append(PoolChange(n.name, "keep", str(n.attrs["keep_reason"])))
            continue
        if n.attrs.get("return_indices"):
            plan.pools.append(PoolChange(n.name, "keep", "it returns indices (return_indices=True)"))
            continue
        if geo is None:
            plan.pools.append(PoolChange(n.name, "keep", "its input shape is unknown, so a "
                                         "replacement of the same geometry cannot be built"))
            continue
        why = _producer_keeps_pool(graph, n, params, module_calls)
        if why:
            plan.pools.append(PoolChange(n.name, "keep", why, geometry=geo))
            continue
        # under the module that calls it (a shared pool module: the one holding it), so that
        # the new parameters are named within the user's module (``backbone.*``)
        owner = n.attrs.get("owner") or (n.module or "").rpartition(".")[0]
        owner = f"{owner}." if owner else ""
        new_param = f"{n.module}.weight" if n.module and module_calls.get(n.module) == 1 \
            else f"{owner}precondfx_pool_{n.name}.weight"
        if opts.maxpool == "avgpool":
            plan.pools.append(PoolChange(n.name, "avgpool", "replaced by average pooling of the "
                                         "same geometry (preserves scaling, Table 1)",
                                         geometry=geo))
            continue
        if opts.maxpool == "stride":
            folded = _try_fold(graph, n, geo, users, module_calls)
            if isinstance(folded, PoolChange):
                plan.pools.append(folded)
                continue
            why_not = folded
        else:
            why_not = "maxpool='conv' was asked for"
        # replacement strided convolution C -> C with the pool's geometry
        k, s, p, dil = geo["kernel"], geo["stride"], geo["padding"], geo["dilation"]
        outs = [conv_out(geo["in_shape"][2 + i], k[i], s[i], p[i], dil[i])
                for i in range(geo["dims"])]
        if outs != geo["out_shape"][2:]:
            plan.pools.append(PoolChange(n.name, "keep", f"a strided convolution of the same "
                                         f"geometry would give spatial size {outs}, not "
                                         f"{geo['out_shape'][2:]} (ceil_mode)", geometry=geo))
            continue
        kind = opts.pool_conv
        what = {"full": "", "depthwise": "depthwise ",
                "avg": "average-pooling-initialized "}[kind]
        plan.pools.append(PoolChange(n.name, "conv", f"replaced by a {what}strided "
                                     f"{geo['channels']}->{geo['channels']} convolution of the "
                                     f"same geometry (not folded: {why_not})",
                                     new_param=new_param, geometry=geo, conv=kind))
        c = geo["channels"]
        params[new_param] = ParamInfo((c, 1 if kind == "depthwise" else c) + tuple(k))
        params[new_param[:-len("weight")] + "bias"] = ParamInfo((c,))


def _pooled_layer(graph: Graph, pool: Node) -> Node | None:
    """The weighted layer whose output the pool takes: the nearest one along the chain of
    first inputs (a normalization's affine weight passed through); None if there is none."""
    cur = graph.get(pool.inputs[0]) if pool.inputs else None
    while cur is not None and cur.status != optable.WEIGHTED:
        cur = graph.get(cur.inputs[0]) if cur.inputs else None
    return cur


def _try_fold(graph: Graph, pool: Node, geo: dict, users: dict, module_calls: dict
              ) -> PoolChange | str:
    """Fold the pool's stride into the convolution before it, or say why not."""
    k, s, p, dil = geo["kernel"], geo["stride"], geo["padding"], geo["dilation"]
    if k != s or any(p) or any(x != 1 for x in dil) or geo["ceil_mode"]:
        return "kernel differs from stride, or padding/dilation/ceil_mode is set"
    cur = graph.get(pool.inputs[0]) if pool.inputs else None
    chain = []
    while cur is not None and cur.kind in ("relu", "leaky_relu", "prelu", "dropout"):
        if len(users.get(cur.name, [])) != 1:
            return f"{cur.name} has more than one user"
        chain.append(cur.name)
        cur = graph.get(cur.inputs[0]) if cur.inputs else None
    if cur is None or cur.kind != "conv" or cur.module is None:
        return "the pool's input does not come from a convolution module through elementwise " \
               "homogeneous ops"
    if len(users.get(cur.name, [])) != 1:
        return f"the convolution {cur.name} has other users"
    if cur.attrs.get("no_fold_reason"):
        return str(cur.attrs["no_fold_reason"])
    if module_calls.get(cur.module, 0) != 1:
        return f"the convolution module {cur.module} is called more than once"
    a = cur.attrs
    if isinstance(a.get("padding"), str):
        return f"the convolution uses padding={a.get('padding')!r}"
    d = geo["dims"]
    ck, cs = _tuple(a.get("kernel_size", 1), d), _tuple(a.get("stride", 1), d)
    cp, cd = _tuple(a.get("padding", 0), d), _tuple(a.get("dilation", 1), d)
    in_shape = cur.in_shapes[0] if cur.in_shapes else None
    if in_shape is None or len(in_shape) != d + 2:
        return "the convolution's input shape is unknown"
    new_out = [conv_out(in_shape[2 + i], ck[i], cs[i] * s[i], cp[i], cd[i]) for i in range(d)]
    if new_out != geo["out_shape"][2:]:
        return (f"folding would give spatial size {new_out}, not the pool's "
                f"{geo['out_shape'][2:]}")
    geo = dict(geo, conv_stride=[cs[i] * s[i] for i in range(d)])
    return PoolChange(pool.name, "fold", f"stride {list(s)} folded into {cur.module} (output "
                      f"shape identical for the sample's input size)", into=cur.name,
                      geometry=geo)


def _plan_layers(graph: Graph, params: dict[str, ParamInfo], plan: Plan) -> None:
    folded = {pc.node: pc for pc in plan.pools}
    for n in graph:
        if n.status == optable.WEIGHTED and n.kind in ("conv", "conv_transpose", "linear",
                                                      "matmul", "embedding"):
            w = n.params.get("weight")
            info = params.get(w) if w else None
            if w is None and any(".parametrizations." in p or "original" in p
                                 for p in n.params.values()):
                n.reason += "; its weight is parametrized (weight/spectral norm): left as is " \
                            "(scheme='wn' initializes weight-normalized layers)"
                plan.notes.append(f"{n.name}: parametrized weight left as is")
                continue
            f = fanlib.weight_fans(n.kind, info.shape, n.attrs) if info else None
            if f is None:
                plan.notes.append(f"{n.name}: fans of {n.kind} weight {w} are not defined "
                                  f"(shape {info.shape if info else None}); weight left as is")
                continue
            plan.layers.append(Layer(n.name, n.kind, n.module, w, n.params.get("bias"),
                                     f.n_in, f.n_out, f.k2,
                                     k2_eff=fanlib.effective_taps(n) if n.kind == "conv"
                                     else None))
        elif n.kind == "maxpool" and n.name in folded and folded[n.name].action == "conv":
            pc = folded[n.name]
            c = 1 if pc.conv == "depthwise" else pc.geometry["channels"]   # fans per group
            k2 = math.prod(pc.geometry["kernel"])
            w = pc.new_param
            eff = fanlib.effective_taps_of(pc.geometry["in_shape"][2:], pc.geometry["kernel"],
                                           pc.geometry["stride"], pc.geometry["padding"],
                                           pc.geometry["dilation"])
            plan.layers.append(Layer(n.name, "conv", n.module, w, w[:-len("weight")] + "bias",
                                     c, c, k2, k2_eff=eff))


def _plan_residuals(graph: Graph, params: dict[str, ParamInfo], plan: Plan, opts: Options
                    ) -> None:
    """The residual joins, their branch scale ``s_l`` (``residual_schedule``) and, with a
    non-flat schedule, App. E's per-block beta (``precondfx.core.beta``)."""
    joins = _find_joins(graph, plan)
    spec = opts.residual_scale
    s_of = residual_schedule.values(spec, len(joins), [j[0].name for j in joins])
    why = residual_schedule.describe(spec, len(joins))
    entries = []
    adapters = adapter_layers(graph, params)
    for (n, bi, fork, branch, has_norm), s in zip(joins, s_of):
        base = [w for w in branch if w not in adapters]
        frozen = bool(base) and all(_frozen_layer(graph, w, params) for w in base)
        insert = not frozen and (opts.residual == "all" or
                                 (opts.residual == "auto" and not has_norm))
        if not insert:
            no = ("residual='none'" if opts.residual == "none" else
                  "the branch's weights are all frozen (requires_grad=False): s would change "
                  "what the frozen layers compute, without a weight to compensate" +
                  (" (its other weights are zero-initialized adapters, kept at zero)"
                   if len(base) < len(branch) else "") if frozen else
                  "the branch has a normalization layer, which sets its scale (residual='all' "
                  "inserts s anyway)")
            plan.residuals.append(Residual(n.name, bi, fork, branch, None, f"no s: {no}"))
            n.reason = f"residual join of branch {n.inputs[bi]}: {no}"
        else:
            plan.residuals.append(Residual(n.name, bi, fork, branch, s, why))
            plan.scales.append(Scale("residual", n.name, "operand", bi, s, why))
            n.reason = f"residual join: branch {n.inputs[bi]} ({len(branch)} weighted) scaled " \
                       f"by s={s:.4g} (App. E)"
        entries.append(betalib.Join(plan.residuals[-1], n.inputs[bi]))
    in_branch = {m for r in plan.residuals if r.s is not None for m in r.branch_layers}
    for lay in plan.layers:
        lay.in_residual_branch = lay.node in in_branch
    trainable = {k: v.trainable for k, v in params.items()}
    betalib.plan_betas(graph, plan, entries, residual_schedule.is_flat(spec), trainable)
    for r in plan.residuals:
        if r.s is not None and (r.beta != 1.0 or not residual_schedule.is_flat(spec)):
            graph[r.node].reason += f"; {r.beta_reason}"


ZERO_ADAPTER = ("all zero in your model, which has frozen weights, and its layer's output is "
                "added to another path (a zero-initialized adapter, LoRA's B): kept at zero so "
                "the model starts at the base model's function")
#: ops a zero-initialized adapter's output may pass through before its join (its value stays 0)
_TO_JOIN = ("mul", "reshape", "cast", "select", "dropout")


def adapter_layers(graph: Graph, params: dict[str, ParamInfo]) -> set[str]:
    """In a model with frozen weights, the weighted nodes of zero-initialized adapters
    (:func:`_zero_adapter`) and the weighted nodes feeding only them (LoRA's A, through a
    dropout): the layers that leave the model's function as the base model's."""
    if all(i.trainable for i in params.values()):
        return set()
    users = graph.users()
    out: set[str] = set()
    for n in graph:
        if n.status != optable.WEIGHTED or \
                not _zero_adapter(graph, n, params.get(n.params.get("weight", ""))):
            continue
        out.add(n.name)
        cur = n
        while len(cur.inputs) == 1:
            up = graph.get(cur.inputs[0])
            if up is None or len(users.get(up.name, [])) != 1 or \
                    (up.status != optable.WEIGHTED and up.kind not in _TO_JOIN):
                break
            if up.status == optable.WEIGHTED:
                out.add(up.name)
            cur = up
    return out


def _zero_adapter(graph: Graph, n: Node, info: ParamInfo | None) -> bool:
    """Whether the weighted node ``n`` reads a trainable weight that is all zero whose output
    (through products, reshapes, casts and dropout) is added to another path: a
    zero-initialized adapter (LoRA's B) or branch output, whose zeros make the model start at
    the function of its other path.  Called only in models with frozen weights (a
    fine-tuning setup); a zero classifier head (torchvision's ViT), whose output is the model's,
    is drawn."""
    if info is None or not info.trainable or not info.zero or info.parametrized:
        return False
    users = graph.users()
    cur = n
    for _ in range(16):
        nxt = [graph.get(u) for u in users.get(cur.name, [])]
        if len(nxt) != 1 or nxt[0] is None:
            return False
        cur = nxt[0]
        if cur.kind in ("add", "sum") and len(cur.inputs) >= 2:
            return True
        if cur.kind not in _TO_JOIN or len(cur.inputs) != 1:
            return False
    return False


def _frozen_layer(graph: Graph, name: str, params: dict[str, ParamInfo]) -> bool:
    """Whether the weighted node ``name`` reads a frozen weight (requires_grad=False)."""
    node = graph.get(name)
    info = params.get(node.params.get("weight", "")) if node is not None else None
    return info is not None and not info.trainable


def _find_joins(graph: Graph, plan: Plan) -> list[tuple[Node, int, str, list[str], bool]]:
    """The residual joins in execution order: (node, branch operand index, fork, the
    branch's weighted layers, whether the branch holds a normalization)."""
    # ancestor sets as bitmasks over execution indices (Graph.ancestor_masks): linear memory
    # per node, so deep models (hundreds of blocks) plan in time linear in their joins
    idx, anc = graph.ancestor_masks()
    nodes = list(graph)
    weighted = {n.name for n in graph if n.status == optable.WEIGHTED}
    weighted |= {pc.node for pc in plan.pools if pc.action == "conv"}
    wmask = sum(1 << idx[w] for w in weighted if w in idx)
    nmask = sum(1 << i for i, n in enumerate(nodes) if n.kind == "normalization")

    def names(mask: int) -> list[str]:       # in execution order
        out = []
        while mask:
            low = mask & -mask
            out.append(nodes[low.bit_length() - 1].name)
            mask ^= low
        return out

    def below(fork: int, end: int) -> int:
        """Nodes before index ``end`` that descend from node ``fork``."""
        d = 1 << fork
        for k in range(fork + 1, end):
            if any(j is not None and (d >> j) & 1 for j in map(idx.get, nodes[k].inputs)):
                d |= 1 << k
        return d & ~(1 << fork)

    # what carries data: weighted layers, ops reading a parameter (a table indexed by ids) and
    # the inputs that are not integer (ids, masks); a value with none of them upstream is
    # computed from masks and constants alone
    data = wmask | sum(1 << i for i, n in enumerate(nodes) if n.params or (
        n.kind == "input" and not n.attrs.get("integer")))

    joins: list[tuple[Node, int, str, list[str], bool]] = []
    for n in graph:
        if n.kind not in ("add",) or len(n.inputs) < 2:
            continue
        a, b = n.inputs[0], n.inputs[1]
        ia, ib = idx.get(a), idx.get(b)
        ca = 0 if ia is None else anc[ia] | (1 << ia)
        cb = 0 if ib is None else anc[ib] | (1 << ib)
        common = ca & cb
        if not common:
            n.reason = "merge of two activations with no common ancestor: not a residual " \
                       "join (breaks scaling, left as is)"
            continue
        masked = [x for x, c in ((a, ca), (b, cb)) if not c & data]
        if masked:   # an additive attention mask, a position table: not a second path
            n.reason = (f"adds {masked[0]}, computed from integer inputs (ids, masks) and "
                        f"constants alone (an additive mask or position table): not a "
                        f"residual join")
            continue
        f = common.bit_length() - 1                    # the latest common ancestor
        fork = nodes[f].name
        since = below(f, idx[n.name])
        la, lb = names(ca & since & wmask), names(cb & since & wmask)
        if len(la) == len(lb):
            n.reason = (f"join of two paths from {fork} with equal numbers of weighted layers "
                        f"({len(la)}): ambiguous, no branch scale inserted")
            continue
        bi = 0 if len(la) > len(lb) else 1
        branch = la if bi == 0 else lb
        summed = _summed_branch(graph, n, n.inputs[bi], weighted)
        if summed:
            n.reason = (f"adds {n.inputs[bi]}, whose last layer's features are summed to fewer "
                        f"values ({summed}: a per-sample total, as a normalizing flow's "
                        f"log-determinant or a penalty accumulates): not a residual join")
            continue
        bset = (ca if bi == 0 else cb) & since
        joins.append((n, bi, fork, branch, bool(bset & nmask)))
    return joins


def _numel(shape: tuple | None) -> int | None:
    """Elements of a known static shape, else None."""
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return math.prod(shape)


def _summed_branch(graph: Graph, join: Node, operand: str, weighted: set[str]) -> str | None:
    """The ``sum`` node on the way from the branch's last weighted layers to ``join`` when the
    join adds fewer values than each of those layers computes (a flow's ``log_det = log_det +
    s.sum(-1)``: the branch's features summed per sample, not a residual of the signal), else
    None.  A mixture of experts' sum over experts keeps a layer's size: not this."""
    size = _numel(join.out_shape)
    if size is None:
        return None
    seen, todo, summed, last = set(), [operand], None, []
    while todo:
        name = todo.pop()
        node = graph.get(name)
        if node is None or name in seen:
            continue
        seen.add(name)
        if name in weighted:
            last.append(node)
            continue
        if node.kind == "sum" and summed is None:
            summed = name
        todo.extend(node.inputs)
    if summed is None or not last:
        return None
    sizes = [_numel(w.out_shape) for w in last]
    return summed if all(m is not None and m > size for m in sizes) else None


def _analytic_alphas(plan: Plan, order: dict[str, int]) -> None:
    """Sec. 5 and App. E: alpha^4 * k^2 * m = const, m = s^4/(1+s^2)^2 in residual branches.

    Kernel-size correction alpha = (k^2)^(-1/4) (the 1/sqrt(3) of a bottleneck's 3x3 conv);
    layers outside residual branches of a network with branch scale s get the extra factor
    s/sqrt(1+s^2) (the stem and final-layer alphas of App. E.1).  With a per-join schedule
    s_l, such a layer takes the s of the first join after it (the last join's after them all):
    the stem gets s_1, as App. E.1 derives it."""
    joins = sorted((order.get(r.node, 0), r.s) for r in plan.residuals if r.s is not None)
    flat = bool(joins) and all(abs(x - joins[0][1]) < 1e-12 for _, x in joins)
    for lay in plan.layers:
        if lay.kind == "embedding":
            continue
        a = lay.k2 ** -0.25
        why = [f"kernel size correction (k^2={lay.k2})^(-1/4) (Sec. 5)"] if lay.k2 != 1 else []
        if joins and not lay.in_residual_branch:
            at = order.get(lay.node, 0)
            s = next((x for i, x in joins if i > at), joins[-1][1])
            a *= s / math.sqrt(1 + s * s)
            why.append(f"outside residual branches: s/sqrt(1+s^2) with s={s:.4g} (App. E.1"
                       + ("" if flat else ", s of the next join") + ")")
        lay.alpha = a
        lay.alpha_reason = "; ".join(why) if why else "no correction needed"


def _shared_weight_constants(graph: Graph, plan: Plan) -> None:
    """``reinit=False`` keeps one stored weight per parameter, divided by one constant
    (alpha/beta, the first layer's that uses it): a later layer sharing the weight with another
    alpha would compute with a weight scaled for another layer, and the function would change.
    Such a layer takes the first layer's constant (its alpha is set so that alpha/beta equals
    it), and says why.  A weight that other nodes read too (not as a layer's weight: its mean
    added somewhere, say) cannot be divided at all without changing what they compute: its
    layers get the constant 1."""
    layer_nodes: dict[str, set[str]] = {}
    for lay in plan.layers:
        if lay.weight:
            layer_nodes.setdefault(lay.weight, set()).add(lay.node)
    readers: dict[str, str] = {}
    for n in graph:
        for pname in n.params.values():
            if pname in layer_nodes and n.name not in layer_nodes[pname]:
                readers.setdefault(pname, n.name)
    first: dict[str, Layer] = {}
    for lay in plan.layers:
        if not lay.weight:
            continue
        if lay.weight in readers:
            if not math.isclose(lay.constant(), 1.0, rel_tol=1e-12):
                lay.alpha_reason = (f"its weight {lay.weight} is also read by "
                                    f"{readers[lay.weight]} (not as a layer's weight): kept "
                                    f"(reinit_weights=False), it cannot be divided by a constant "
                                    f"without changing what that node computes, so none (was: "
                                    f"alpha {lay.alpha:.4g}: {lay.alpha_reason or '-'})")
                lay.alpha = lay.beta
            continue
        f = first.setdefault(lay.weight, lay)
        c = f.constant()
        if f is lay or math.isclose(lay.constant(), c, rel_tol=1e-12):
            continue
        lay.alpha = c * lay.beta
        lay.alpha_reason = (f"shares its weight {lay.weight} with {f.node}, which is kept divided "
                            f"by that layer's constant {c:.4g} (reinit_weights=False): the same "
                            f"constant here keeps the function (was: "
                            f"{lay.alpha_reason or 'no correction'})")


def _opaque_inits(n: Node, params: dict[str, ParamInfo], rule: str, put: Any) -> None:
    """Inits of an opaque weighted module (multi-head attention, recurrent cell): projection and
    input weights by the fan rule, recurrent weights orthogonal per gate, biases zero."""
    cls = n.attrs.get("class", "")
    gates = 4 if "LSTM" in cls else 3 if "GRU" in cls else 1
    what = "attention" if n.kind == "attention" else "recurrent"
    for role, pname in n.params.items():
        info = params.get(pname)
        if info is None:
            continue
        f = (fanlib.attention_fans(role, info.shape) if n.kind == "attention"
             else fanlib.recurrent_fans(role, info.shape, gates))
        if "weight_hh" in role and rule != "keep":
            put(pname, ParamInit(pname, "orthogonal", 1.0, "recurrent weight: orthogonal per "
                                 "gate (keeps norms over time steps)", gates=gates))
        elif "weight_hr" in role and rule != "keep":    # LSTM(proj_size=P): h_t = W_hr h'_t
            put(pname, ParamInit(pname, "orthogonal", 1.0, "recurrent projection weight: "
                                 "orthogonal rows (applied at every time step)", gates=1))
        elif f is not None and rule != "keep":
            put(pname, ParamInit(pname, rule, math.sqrt(fanlib.second_moment(f, rule)),
                                 f"{what} weight {role} (n_in={f.n_in}, n_out={f.n_out})"))
        elif "bias" in role:
            put(pname, ParamInit(pname, "zeros", None, f"{what} bias starts at zero"))
        else:
            put(pname, ParamInit(pname, "keep", None, f"{what} {role}: left as is"))


def _plan_inits(graph: Graph, params: dict[str, ParamInfo], plan: Plan, opts: Options) -> None:
    inits = plan.inits
    rule = opts.init
    derived = {p: n.name for n, ps in classify.derived_weights(graph) for p in ps}
    alpha_of: dict[str, float] = {}     # the constant on each weight: alpha / beta
    for lay in plan.layers:
        if lay.weight:
            alpha_of.setdefault(lay.weight, lay.constant())
    # lr_scale divides these afterwards: with reinit=False they get a 'scale' rule (1/alpha),
    # whose factor lr_transfer divides, so that the plan keeps saying what the model holds
    lr_params = {p for lay in plan.layers for p in (lay.weight, lay.bias) if p} \
        if getattr(opts, "lr_scale", None) not in (None, "auto") or \
        fixed_lr(opts) is not None or lr_auto(opts) else set()

    def put(name: str | None, pi: ParamInit, new: bool = False) -> None:
        """``new``: a parameter the pass creates (a max-pool's replacement conv): there is no
        user value to keep, so reinit=False and init='keep' do not apply to it."""
        if not name or name not in params:
            return
        info = params[name]
        pi.shape = list(info.shape)
        if name in inits:
            prev = inits[name]
            if prev.rule != pi.rule or (prev.std or 0) != (pi.std or 0):
                prev.reason += f"; also used as {pi.rule} by another layer (first use wins)"
            return
        if not info.trainable:
            pi = ParamInit(name, "keep", None, "frozen (requires_grad=False): left as is",
                           list(info.shape), frozen=True)
        elif info.parametrized:
            pi = ParamInit(name, "keep", None, "parametrized weight: left as is",
                           list(info.shape))
        elif not opts.reinit and not new:
            alpha = alpha_of.get(name, 1.0)
            if alpha != 1.0:
                pi = ParamInit(name, "scale", 1.0 / alpha, f"reinit=False: existing weight "
                               f"divided by its constant {alpha:.4g} (alpha/beta) so the "
                               f"function is unchanged",
                               list(info.shape))
            elif name in lr_params:
                pi = ParamInit(name, "scale", 1.0, "reinit=False: existing value (lr_scale "
                               "divides it by its layer's multiplier)", list(info.shape))
            else:
                pi = ParamInit(name, "keep", None, "reinit=False", list(info.shape))
        inits[name] = pi

    layer_of = {lay.node: lay for lay in plan.layers}
    tuning = any(not i.trainable for i in params.values())
    kept_zero: list[str] = []
    avg_pools = {pc.node for pc in plan.pools if pc.action == "conv" and pc.conv == "avg"}
    # the replacement convs of max-pools are new layers: drawn from the seed even with
    # init='keep' or reinit=False (else torch's default init, from the global RNG)
    new_convs = {pc.node for pc in plan.pools if pc.action == "conv"}
    for n in graph:
        lay = layer_of.get(n.name)
        if lay is not None:
            new = n.name in new_convs
            f = fanlib.Fans(lay.n_in, lay.n_out, lay.k2_eff or lay.k2,
                            gain=1.0 if lay.kind == "embedding" else 2.0)
            if n.name in avg_pools:
                # built holding average pooling's weights (apply.common.replacement_pool):
                # kept, divided by alpha (the function at init is average pooling)
                put(lay.weight, ParamInit(lay.weight, "scale", 1.0 / lay.alpha,
                                          "replacement conv initialized as average pooling"
                                          + (f", divided by alpha={lay.alpha:.4g}"
                                             if lay.alpha != 1 else "")), new)
            elif rule == "keep" and not new:
                put(lay.weight, ParamInit(lay.weight, "keep", None, "init='keep'"))
            elif not new and tuning and _zero_adapter(graph, n, params.get(lay.weight or "")):
                kept_zero.append(str(lay.weight))
                put(lay.weight, ParamInit(lay.weight, "keep", None, ZERO_ADAPTER))
            else:
                r = "geometric" if lay.kind == "embedding" or rule == "keep" else rule
                std = math.sqrt(fanlib.second_moment(f, r)) / lay.constant()
                put(lay.weight, ParamInit(lay.weight, r, std,
                                          f"E[W^2]={fanlib.second_moment(f, r):.4g} ({r}, n_in="
                                          f"{f.n_in}, n_out={f.n_out}, k^2={f.k2:.4g}"
                                          + (f" taps reaching the input of {lay.k2} under "
                                             f"zero padding" if lay.k2_eff and
                                             abs(lay.k2_eff - lay.k2) > 1e-9 else "") + ")"
                                          + (f", divided by alpha^2={lay.alpha**2:.4g}"
                                             if lay.alpha != 1 else "")
                                          + (f", times beta^2={lay.beta**2:.6g} (App. E)"
                                             if lay.beta != 1 else "")
                                          + ("; a new layer (max-pool replacement): drawn "
                                             "whatever init/reinit_weights say" if new else "")),
                    new)
            put(lay.bias, ParamInit(lay.bias or "", "zeros", None, "biases start at zero (Sec. 6)"),
                new)
            for role, pname in n.params.items():
                if role not in ("weight", "bias"):
                    put(pname, ParamInit(pname, "keep", None,
                                         f"{role} of {n.name}: not a weight of the layer"))
        elif n.kind in ("attention", "recurrent") and n.status == optable.WEIGHTED:
            _opaque_inits(n, params, rule, put)
        elif n.kind == "normalization":
            for role, pname in n.params.items():
                if role.endswith("weight"):
                    put(pname, ParamInit(pname, "ones", None, "normalization scale starts at 1"))
                elif role.endswith("bias"):
                    put(pname, ParamInit(pname, "zeros", None, "normalization shift starts at 0"))
    if kept_zero:
        plan.notes.append(f"kept at zero {len(kept_zero)} trainable weight(s) that are all zero "
                          f"in a model with frozen weights, whose layer's output is added to "
                          f"another path (zero-initialized adapters, LoRA's B: the model starts "
                          f"at the base model's function, as designed): "
                          f"{', '.join(kept_zero[:6])}{', ...' if len(kept_zero) > 6 else ''}")
    read = {p for n in graph for p in n.params.values()}
    with_parametrized = {n.params["bias"]: n.name for n in graph
                         if "bias" in n.params and "weight" not in n.params and
                         any(params[p].parametrized for p in n.params.values() if p in params)}
    tokens = tokens_mod.token_partners(graph, {k: v.shape for k, v in params.items()}) \
        if opts.reinit and rule != "keep" else {}
    for name, info in params.items():
        if name in inits:
            continue
        if name in tokens and info.trainable and not info.parametrized:
            partner, join = tokens[name]
            what = "concatenated to" if join.kind == "concat" else "added to"
            inits[name] = ParamInit(
                name, "match", None,
                f"a free token or position parameter {what} the output of {partner} (at "
                f"{join.name}): drawn at the rms of that output, measured on the calibration "
                f"batch after re-initialization, so that the joined parts start at one scale",
                list(info.shape), match=partner)
            continue
        if name in derived:
            inits[name] = ParamInit(
                name, "keep", None, f"the weight of {derived[name]}, computed in forward from "
                f"it (e.g. an equalized learning rate's weight * constant): precondfx "
                f"re-initializes only a weight passed to the layer as a parameter; left as is",
                list(info.shape))
            continue
        why = ("a tensor of a parametrization (torch.nn.utils.parametrizations weight_norm, "
               "spectral_norm, ...): the weight it computes is left as is (scheme='wn' "
               "initializes weight-normalized layers)" if info.parametrized else
               f"the bias of {with_parametrized[name]}, whose weight is parametrized (weight "
               f"or spectral norm): left as is with that weight" if name in with_parametrized
               else "read by an op that is not a weighted layer (e.g. a position embedding, a "
               "class token, an activation slope): left as is" if name in read else
               "not read by any captured operation: left as is")
        inits[name] = ParamInit(name, "keep", None, why, list(info.shape))
    divide_gains(inits, graph.gains)


def divide_gains(inits: dict[str, ParamInit], gains: dict[str, float]) -> None:
    """A parameter the forward multiplies by a fixed factor ``c`` before its layer reads it
    (``graph.gains``: ``self.weight * c``, a Gemm's ``alpha``, ``Mul(g, 3)``) is stored at the
    planned value divided by ``c``, so that the value the layer applies is the planned one:
    a normal draw at ``std / |c|``, ones as the constant ``1 / c``, a constant divided by
    ``c``; a ``match`` draw is divided when its std is measured (``driver.match_tokens``).
    Zeros, kept and rescaled values are what they are whatever the factor.  One rule for
    every front end."""
    for name, c in gains.items():
        pi = inits.get(name)
        if pi is None or c == 1.0 or pi.rule in ("zeros", "keep", "scale", "match"):
            continue
        if pi.rule == "ones":
            pi.rule, pi.std = "constant", 1.0 / c
        elif pi.rule == "constant":
            pi.std = float(pi.std or 0.0) / c
        elif pi.std is not None:
            pi.std = pi.std / abs(c)
        else:
            continue
        pi.reason += f"; divided by the gain {c:.4g} the forward multiplies it by"
