"""Chen et al.'s gradient norm equality (block dynamical isometry) as a scheme: ``scheme="gne"``.

Spec: ``shared/spec/chen-arpit-spec.md`` part A.  For every weighted layer the scheme finds the
activation that follows it in the graph (through the users of its output, across dropout,
reshapes, pooling and normalization) and plans the weight so that the block *layer +
activation* has ``phi(J J^T) = 1`` (Tables 4/5):

* Gaussian kernels (``kind='gaussian'``, default): ``std = gain / sqrt(n)``, ``n = c_in/groups *
  k~`` with ``k~`` the effective kernel size of a zero-padded convolution at the layer's input
  size (A.2.7; nominal ``k`` for circular/reflect padding, ``effective_kernel=False`` turns the
  correction off);
* orthogonal kernels (``kind='orthogonal'``): ``beta = gain``, times ``sqrt(rows/cols)`` for
  expanding shapes and ``sqrt(k/k~)`` for the padding cut-off (A.2.6, A.2.7 [DERIVED]);
* gains ``c = 1/sqrt(phi_act)``: linear and tanh 1, ReLU ``sqrt 2``, leaky ReLU
  ``sqrt(2/(1+slope^2))`` (the slope read from the graph), PReLU ``sqrt 2`` (authors' code),
  SELU ``sqrt(gamma0)`` (eq. 32); other smooth activations (ELU, GELU, SiLU, Mish, Softplus...)
  ``1/sqrt(E[f'(x)^2])`` at ``x ~ N(0, 1)`` (A.2.6 extension, [DERIVED]); activations outside
  the table (sigmoid...) gain 1, said in the report.

The plan's ``inits`` carry the resulting std per weight, so the result is reproducible and
reportable.  Options (``scheme_options``):

* ``kind``: 'gaussian' | 'orthogonal';
* ``selu``: 'standard' | 'depth' -- 'depth' replaces every SELU by :class:`ScaledSELU` with the
  depth-aware ``(lambda, alpha)`` of eq. 32 for the number ``L`` of linear+SELU blocks
  (``selu_epsilon``, default ``0.95/L``; ``gamma0``, default 1, the linear layers' ``phi``);
* ``norm``: None | 'smn' -- swap every BatchNorm module for Second Moment Normalization
  (eq. 25; ``smn_center=True`` also centres the weight of the conv/linear feeding it, eq. 26);
* ``diagnostics``: add per-block ``phi`` / ``varphi`` estimates (Hutchinson probes,
  ``diag_probes`` of them, ``diag_mode`` 'eval' so batch statistics do not couple samples)
  to the report; ``effective_kernel``: use ``k~`` (default True).

Analytic alphas are not used: under the BDI criterion kernel-size corrections are not needed
(spec C.2: "offer both criteria; don't mix them within one pass"), so ``balance='analytic'`` (the
default) becomes 'none'; 'hessian' is kept (it does not change the forward pass).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from precondfx.pytorch.calibrate import quiet_run
from precondfx.errors import PrecondError
from precondfx.core.graph import Graph, Node
from precondfx.pytorch.measure.isometry import estimate_block_isometry
from precondfx.core.options import Options, Override
from precondfx.core.plan import Layer, ParamInfo, ParamInit, Plan
from precondfx.schemes.activations import activation_of, get_activation  # noqa: F401
from precondfx.schemes import gne_math as G
from precondfx.core.scheme import Scheme, SchemeContext, register

#: kinds that are activations (the end of a "layer + activation" block)
ACTIVATION_KINDS = ("relu", "leaky_relu", "prelu", "exp_linear", "saturating", "smooth_gate",
                    "clipped_relu")
#: kinds the search for a layer's activation walks through (elementwise-linear or
#: scale-resetting ops that sit between a layer and its activation)
_PASS = ("dropout", "reshape", "cast", "normalization", "maxpool", "avgpool", "pad", "select")

#: smooth activations (A.2.6 extension: phi = E[f'(x)^2]); torch callables for the derivative
_SMOOTH: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "elu": F.elu, "celu": F.celu, "gelu": F.gelu, "silu": F.silu, "mish": F.mish,
    "softplus": F.softplus, "hardswish": F.hardswish, "softsign": F.softsign,
}
#: activations as functions (diagnostics of eager blocks whose activation is functional)
_ACT_FN: dict[str, Callable[..., torch.Tensor]] = {
    "relu": torch.relu, "tanh": torch.tanh, "selu": torch.selu, "sigmoid": torch.sigmoid,
    **_SMOOTH,
}


# ---------------------------------------------------------------------------------------------
# Graph helpers (also used by the wn scheme)
# ---------------------------------------------------------------------------------------------
def following_activation(graph: Graph, name: str, users: dict[str, list[str]] | None = None
                         ) -> tuple[Node | None, list[str], str]:
    """The activation node that consumes layer ``name``'s output, found through the graph's
    users across elementwise-linear ops; ``(node or None, nodes walked through, note)``."""
    users = graph.users() if users is None else users
    cur, path = name, []
    while True:
        us = users.get(cur, [])
        if len(us) != 1:
            return None, path, ("its output has no user" if not us else
                                f"its output has {len(us)} users ({', '.join(us[:3])}): no "
                                f"single activation follows")
        nxt = graph[us[0]]
        if nxt.kind in ACTIVATION_KINDS:
            note = ""
            if any(graph[p].kind == "normalization" for p in path):
                note = ("a normalization layer sits between the layer and its activation: it "
                        "resets the scale (Prop. 5.6), so the gain hardly matters")
            return nxt, path, note
        bias_like = nxt.kind in ("add", "sub", "mul") and len(nxt.inputs) == 1
        if nxt.kind in _PASS or bias_like:
            path.append(nxt.name)
            cur = nxt.name
            continue
        return None, path, f"followed by {nxt.kind} ({nxt.name}), not an activation: linear"


#: gne activation name -> the shared registry's (``F.gelu`` is the exact, erf form)
_REGISTRY_NAME = {"gelu": "gelu_exact", "silu": "swish"}


def _smooth_phi(name: str, var: float = 1.0) -> float:
    """``E[f'(x)^2]`` at ``x ~ N(0, var)`` for a smooth activation (A.2.6 extension), from the
    shared activation registry's analytic derivative."""
    act = get_activation(_REGISTRY_NAME.get(name, name))
    return G.pointwise_moments(act.d1, var, breaks=act.kinks).phi


def activation_gain(name: str, slope: float | None, gamma0: float = 1.0
                    ) -> tuple[float, str]:
    """BDI gain ``c = 1/sqrt(phi_act)`` (Tables 4-6) and where it comes from."""
    if name in ("linear", "tanh"):
        return 1.0, f"{name}: phi_act = 1 (Table 3/4), gain 1"
    if name in ("relu", "prelu", "leaky_relu", "selu"):
        g = G.gne_gain(name, slope=slope, gamma0=gamma0)
        if name == "relu":
            src = "ReLU phi_act = 1/2 (Table 3), gain sqrt 2"
        elif name == "prelu":
            src = "PReLU: gain sqrt 2 as in the authors' code (its slope is trainable)"
        elif name == "leaky_relu":
            src = (f"leaky ReLU slope {slope:g}: phi_act = (1+slope^2)/2 (Table 3), gain "
                   f"sqrt(2/(1+slope^2))")
        else:
            src = f"SELU: linear layer phi = gamma0 = {gamma0:g} (eq. 32), gain sqrt(gamma0)"
        return g, src
    if name in _SMOOTH:
        phi = _smooth_phi(name)
        return 1.0 / math.sqrt(phi), (f"{name}: phi_act = E[f'(x)^2] = {phi:.4g} at x ~ N(0,1) "
                                      f"(components-table extension, A.2.6 [DERIVED])")
    if name == "relu6":
        return math.sqrt(2.0), "ReLU6: a ReLU at initialization scales, gain sqrt 2"
    return 1.0, f"{name}: not in the components table (A.2.6): gain 1, phi not guaranteed"


def conv_effective_k(graph: Graph, plan: Plan, lay: Layer, shape: tuple[int, ...]
                     ) -> tuple[float, str]:
    """Effective kernel size ``k~`` (A.2.7) of a convolution layer at its input size."""
    k = math.prod(shape[2:]) if len(shape) > 2 else 1
    node = graph.get(lay.node)
    pc = next((p for p in plan.pools if p.node == lay.node and p.action == "conv"), None)
    if pc is not None:  # a max-pool replaced by a strided conv of the pool's geometry
        geo = pc.geometry
        size, kern, stride = geo["in_shape"][2:], geo["kernel"], geo["stride"]
        pad, dil, mode = geo["padding"], geo["dilation"], "zeros"
    else:
        a = node.attrs if node is not None else {}
        size = node.in_shapes[0][2:] if node is not None and node.in_shapes and \
            node.in_shapes[0] is not None else None
        kern = tuple(shape[2:])
        stride, pad = a.get("stride", 1) or 1, a.get("padding", 0)
        dil, mode = a.get("dilation", 1) or 1, a.get("padding_mode", "zeros") or "zeros"
    if not size or len(size) != len(shape) - 2:
        return float(k), "input size unknown: nominal kernel size"
    try:
        keff = G.effective_kernel_size(tuple(int(s) for s in size), tuple(int(x) for x in kern),
                                       stride, pad, dil, mode)
    except PrecondError as e:
        return float(k), f"effective kernel size not computable ({e}): nominal"
    return keff, f"effective kernel size {keff:.4g} of {k} taps at input {list(size)} (A.2.7)"


#: epsilon of the original SELU constants (spec A.2.11: gamma0 = 1, epsilon ~ 0.0716)
_SELU_EPS = 0.0716


class _Stop(BaseException):
    """Raised to end a forward pass once a block's output has been computed."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


# ---------------------------------------------------------------------------------------------
@register("gne")
class GNE(Scheme):
    """Activation-aware gains for gradient norm equality (Chen et al., Tables 4/5)."""

    name = "gne"

    def __init__(self, kind: str = "gaussian", norm: str | None = None, smn_center: bool = True,
                 selu: str = "standard", selu_epsilon: float | None = None,
                 gamma0: float = 1.0, effective_kernel: bool = True, diagnostics: bool = False,
                 diag_probes: int = 32, diag_mode: str = "eval") -> None:
        if kind not in ("gaussian", "orthogonal"):
            raise PrecondError(f"gne: kind={kind!r} must be 'gaussian' or 'orthogonal'")
        if norm not in (None, "none", "smn"):
            raise PrecondError(f"gne: norm={norm!r} must be None or 'smn'")
        if selu not in ("standard", "depth"):
            raise PrecondError(f"gne: selu={selu!r} must be 'standard' or 'depth'")
        if not gamma0 > 0:
            raise PrecondError(f"gne: gamma0={gamma0!r} must be > 0")
        if diag_mode not in ("train", "eval"):
            raise PrecondError(f"gne: diag_mode={diag_mode!r} must be 'train' or 'eval'")
        self.kind, self.norm = kind, (None if norm == "none" else norm)
        self.smn_center, self.selu, self.selu_epsilon = bool(smn_center), selu, selu_epsilon
        self.gamma0, self.effective_kernel = float(gamma0), bool(effective_kernel)
        self.diagnostics, self.diag_probes, self.diag_mode = bool(diagnostics), int(diag_probes), \
            diag_mode
        self.model: nn.Module | None = None   # set by the pipeline when it passes the model
        self._rows: list[dict[str, Any]] = []
        self._notes: list[str] = []
        self._selu_coef: tuple[float, float] | None = None
        self._selu_layers = 0
        self._smn: list[dict[str, Any]] = []
        self._repl: list[tuple[str, nn.Module, str]] = []

    # -- before planning ----------------------------------------------------------------------
    def overrides(self, opts: Options) -> list[Override]:
        """Under the BDI criterion each layer is normalized by its own fan-in, so the GR
        criterion's alphas (kernel-size corrections, and the measured balancing that starts from
        them) are not mixed in (spec C.2): the pipeline's default balance modes ('auto',
        'analytic') become 'none'; 'hessian' (asked for explicitly) is kept, it does not change
        the forward pass."""
        if opts.balance in ("auto", "analytic"):
            return [Override("balance", "none", "under the BDI criterion each layer is "
                             "normalized by its own fan-in, so the alphas of the GR criterion "
                             "are not applied (spec C.2)")]
        return []

    def plan(self, graph: Graph, plan: Plan, params: dict[str, ParamInfo], opts: Options
             ) -> None:
        users = graph.users()
        rows: list[dict[str, Any]] = []
        planned: dict[str, dict[str, Any]] = {}
        for lay in plan.layers:
            row: dict[str, Any] = {"node": lay.node, "weight": lay.weight, "kind": lay.kind}
            rows.append(row)
            if lay.kind == "embedding":
                row["action"] = "kept the core plan (an embedding is a lookup, no fan-in)"
                continue
            act, path, note = following_activation(graph, lay.node, users)
            name, slope = activation_of(act) if act is not None else ("linear", None)
            gain, gsrc = activation_gain(name, slope, self.gamma0)
            row.update(activation=act.name if act is not None else None, act=name,
                       slope=slope, gain=gain, gain_source=gsrc)
            if note:
                row["note"] = note
            if name == "selu":
                self._selu_layers += 1
            pi = plan.inits.get(lay.weight or "")
            if pi is None or pi.rule in ("keep", "scale"):
                row["action"] = f"weight kept ({pi.reason if pi else 'no init planned'})"
                continue
            if lay.weight in planned:
                prev = planned[lay.weight]
                if abs(prev["gain"] - gain) > 1e-12:
                    pi.reason += (f"; call site {lay.node} is followed by {name} (gain "
                                  f"{gain:.4g}): the first call site's gain was used")
                row["action"] = f"shared weight: planned at call site {prev['node']}"
                continue
            shape = tuple(params[lay.weight].shape) if lay.weight in params else tuple(pi.shape)
            n, keff, ksrc = self._fan_in(graph, plan, lay, shape)
            row.update(fan_in=n, effective_k=keff, k=lay.k2, fan_in_source=ksrc)
            if self.kind == "gaussian":
                std, rule = gain / math.sqrt(n), "normal"
                why = (f"GNE Gaussian: std = gain/sqrt(n) = {gain:.4g}/sqrt({n:.5g}) (eq. 17, "
                       f"Table 4); {gsrc}; n: {ksrc}")
            else:
                rows_, cols = self._orth_dims(lay, shape)
                b2 = gain * gain * (rows_ / cols if rows_ > cols else 1.0)
                if keff and lay.kind == "conv":
                    b2 *= lay.k2 / keff
                std, rule = math.sqrt(b2), "orthogonal"
                why = (f"GNE orthogonal: beta = {std:.4g} (gain {gain:.4g}, Table 5"
                       + (f"; x sqrt({rows_}/{cols}) for an expanding shape" if rows_ > cols
                          else "")
                       + (f"; x sqrt(k/k~) = sqrt({lay.k2}/{keff:.4g})" if keff and
                          lay.kind == "conv" and keff != lay.k2 else "") + f"); {gsrc}")
            if lay.alpha != 1.0:
                std /= lay.alpha
                why += f"; divided by alpha={lay.alpha:.4g}"
            plan.inits[lay.weight] = ParamInit(lay.weight, rule, std, why, list(pi.shape), gates=1)
            row.update(rule=rule, std=std, action=f"init {rule} std={std:.4g}")
            planned[lay.weight] = {"node": lay.node, "gain": gain}
        in_plan = {lay.node for lay in plan.layers}
        for n in graph:
            if n.status == "weighted" and n.name not in in_plan:
                rows.append({"node": n.name, "kind": n.kind,
                             "action": "not covered: not a plain conv/linear weight of the plan "
                                       "(parametrized, attention or recurrent weights keep the "
                                       "core plan's init)"})
        if self.selu == "depth" and self._selu_layers:
            # default: "slightly below 1/L" (0.95/L), capped at the original SELU's 0.0716 so a
            # shallow net gets the standard constants rather than an extreme alpha
            eps = self.selu_epsilon if self.selu_epsilon is not None else \
                min(G.selu_epsilon_for_depth(self._selu_layers), _SELU_EPS)
            self._selu_coef = G.selu_coefficients(self._selu_layers, epsilon=eps,
                                                  gamma0=self.gamma0)
            self._selu_eps = eps
            plan.notes.append(f"gne: depth-aware SELU for L={self._selu_layers} linear+SELU "
                              f"blocks, epsilon={eps:.4g}: lambda={self._selu_coef[0]:.5g}, "
                              f"alpha={self._selu_coef[1]:.5g} (eq. 32)")
        elif self.selu == "depth":
            self._notes.append("selu='depth' asked for, but no layer is followed by a SELU")
        self._rows = rows
        plan.notes.extend(f"gne: {n}" for n in self._notes)

    def _fan_in(self, graph: Graph, plan: Plan, lay: Layer, shape: tuple[int, ...]
                ) -> tuple[float, float | None, str]:
        """``n`` of the block's linear component and the effective kernel size used."""
        if lay.kind == "conv":
            if self.effective_kernel:
                keff, src = conv_effective_k(graph, plan, lay, shape)
            else:
                keff, src = float(lay.k2), "nominal kernel size (effective_kernel=False)"
            return lay.n_in * keff, keff, f"c_in/groups={lay.n_in} x {src}"
        if lay.kind == "conv_transpose":
            node = graph.get(lay.node)
            st = node.attrs.get("stride", 1) if node is not None else 1
            st = math.prod(st) if isinstance(st, (list, tuple)) else int(st or 1)
            n = lay.n_in * lay.k2 / max(st, 1)
            return n, None, (f"transposed conv: each output reads c_in/groups * k/stride = "
                             f"{n:.4g} inputs [DERIVED]")
        return float(lay.n_in * lay.k2), None, f"fan-in {lay.n_in * lay.k2}"

    @staticmethod
    def _orth_dims(lay: Layer, shape: tuple[int, ...]) -> tuple[int, int]:
        """(output rows, input columns) of the map, for the expanding-shape correction."""
        if lay.kind == "matmul":
            return lay.n_out, lay.n_in
        return int(shape[0]), int(math.prod(shape[1:]))

    # -- replacements -------------------------------------------------------------------------
    def replacements(self, graph: Graph, plan: Plan) -> list[tuple[str, nn.Module, str]]:
        out: list[tuple[str, nn.Module, str]] = []
        if self._selu_coef is not None:
            made: dict[str, nn.Module] = {}
            for n in graph:
                if n.kind == "exp_linear" and activation_of(n)[0] == "selu":
                    path = n.module or f"precondfx_selu_{n.name}"
                    mod = made.setdefault(path, G.ScaledSELU(*self._selu_coef))
                    out.append((n.name, mod, path))
        if self.norm == "smn":
            for n in graph:
                if n.kind != "normalization":
                    continue
                cls = str(n.attrs.get("class", ""))
                if not cls.startswith("BatchNorm") and "batch_norm" not in n.target:
                    continue
                if n.module is None:
                    self._smn.append({"node": n.name, "replaced": False, "why": "functional "
                                      "batch_norm (its running statistics are arguments): no "
                                      "module to swap"})
                    continue
                smn, how = self._smn_for(n, plan)
                self._smn.append({"node": n.name, "module": n.module, "replaced": True,
                                  "built_from": how})
                out.append((n.name, smn, n.module))
        self._repl = list(out)
        return out

    def _smn_for(self, n: Node, plan: Plan) -> tuple[nn.Module, str]:
        """A SecondMomentNorm with the BN's num_features/eps/momentum/affine."""
        bn = None
        if self.model is not None and n.module:
            try:
                bn = self.model.get_submodule(n.module)
            except AttributeError:
                bn = None
        if isinstance(bn, nn.modules.batchnorm._BatchNorm):
            return G.SecondMomentNorm.from_batchnorm(bn), "the BatchNorm module's attributes"
        w = plan.inits.get(n.params.get("weight", ""))
        nf = int(n.out_shape[1]) if n.out_shape and len(n.out_shape) > 1 else \
            (int(w.shape[0]) if w is not None and w.shape else 0)
        if nf <= 0:
            raise PrecondError(f"gne norm='smn': number of features of {n.name} unknown")
        affine = "weight" in n.params
        return G.SecondMomentNorm(nf, affine=affine), (
            f"the graph: num_features={nf}, affine={affine}; eps=1e-5 and momentum=0.1 (PyTorch "
            f"defaults: the normalization module was not found)")

    # -- after re-initialization --------------------------------------------------------------
    def calibrate(self, ctx: SchemeContext) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "layers": self._rows,
                               "notes": list(self._notes)}
        if self._selu_coef is not None:
            out["selu"] = {"layers": self._selu_layers, "epsilon": self._selu_eps,
                           "gamma0": self.gamma0, "lambda": self._selu_coef[0],
                           "alpha": self._selu_coef[1],
                           "block_phi": 1.0 + self._selu_eps}
        if self.norm == "smn":
            self._center(ctx)
            out["smn"] = self._smn
        for node in ctx.unreplaced(self._repl):
            out["notes"].append(f"{node}: replacement not applied (see the report's skipped "
                                f"list)")
        if self.diagnostics:
            ctx.say("gne: block dynamical isometry estimates")
            out["diagnostics"] = block_diagnostics(ctx, self.diag_probes, self.diag_mode)
        return out

    def _center(self, ctx: SchemeContext) -> None:
        """eq. 26: the conv/linear feeding each SMN gets a per-output-channel mean removal."""
        calls: dict[str, int] = {}
        for n in ctx.graph:
            if n.module:
                calls[n.module] = calls.get(n.module, 0) + 1
        for row in self._smn:
            if not row.get("replaced"):
                continue
            bn = ctx.graph[row["node"]]
            prod = ctx.graph.get(bn.inputs[0]) if bn.inputs else None
            if not self.smn_center:
                row["centered"] = "no (smn_center=False)"
            elif prod is None or prod.kind not in ("conv", "linear") or prod.module is None \
                    or "weight" not in prod.params:
                row["centered"] = "no: the SMN's input does not come from a conv/linear module"
            elif calls.get(prod.module, 0) != 1:
                row["centered"] = f"no: {prod.module} is called more than once"
            elif ctx.opts.balance in ("hessian", "auto"):
                row["centered"] = ("no: measured balancing rescales the plain weight parameter, "
                                   "which a parametrization would hide")
            else:
                mod = ctx.model.get_submodule(prod.module)
                if torch.nn.utils.parametrize.is_parametrized(mod, "weight"):
                    row["centered"] = f"no: {prod.module}.weight is already parametrized"
                    continue
                G.register_weight_centering(mod)
                row["centered"] = (f"{prod.module}.weight centred per output channel (eq. 26; "
                                   f"now {prod.module}.parametrizations.weight.original; a "
                                   f"parametrized model saves through state_dict, not pickle)")


# ---------------------------------------------------------------------------------------------
# Block dynamical isometry diagnostics
# ---------------------------------------------------------------------------------------------
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
    placeholders = [p.target for p in gm.graph.nodes if p.op == "placeholder"]

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
        vals = list(args) + [kwargs.get(t.lstrip("*")) for t in placeholders[len(args):]]
        return interp.run(*vals)
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
