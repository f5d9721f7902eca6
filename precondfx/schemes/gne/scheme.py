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
import numbers
from typing import Any

from torch import nn

from precondfx.core.graph import Graph
from precondfx.core.options import Options, Override
from precondfx.core.plan import Layer, ParamInfo, ParamInit, Plan
from precondfx.core.scheme import Scheme, SchemeContext, register
from precondfx.errors import PrecondError
from precondfx.schemes.activations import activation_of, activation_params
from precondfx.schemes.gne.blocks import activation_gain, following_activation
from precondfx.schemes.gne.diagnostics import block_diagnostics
from precondfx.schemes.gne.planning import fan_in, layer_std, uncovered_rows
from precondfx.schemes.gne.replacements import center_weights, selu_replacements, smn_replacements
from precondfx.schemes.gne.selu import selu_coefficients, selu_epsilon_for_depth

#: epsilon of the original SELU constants (spec A.2.11: gamma0 = 1, epsilon ~ 0.0716)
_SELU_EPS = 0.0716


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
        if not (gamma0 > 0 and math.isfinite(gamma0)):
            raise PrecondError(f"gne: gamma0={gamma0!r} must be a positive finite number")
        if selu_epsilon is not None and (
                isinstance(selu_epsilon, bool) or not isinstance(selu_epsilon, numbers.Real)
                or not (0 <= selu_epsilon < math.inf)):
            raise PrecondError(f"gne: selu_epsilon={selu_epsilon!r} must be None (0.95/L) or a "
                               f"finite number >= 0 (eq. 32's epsilon)")
        if int(diag_probes) < 1:
            raise PrecondError(f"gne: diag_probes={diag_probes!r} must be >= 1 (Hutchinson "
                               f"probes per block; at least 4 are drawn)")
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
        # options given (not their defaults) that the other options leave without effect
        idle = (("selu_epsilon", selu_epsilon, selu_epsilon is not None, selu != "depth",
                 "selu='depth'"),
                ("diag_probes", diag_probes, diag_probes != 32, not diagnostics,
                 "diagnostics=True"),
                ("diag_mode", diag_mode, diag_mode != "eval", not diagnostics,
                 "diagnostics=True"),
                ("smn_center", smn_center, not smn_center, self.norm != "smn", "norm='smn'"))
        for key, value, given, moot, needs in idle:
            if given and moot:
                self._notes.append(f"scheme_options {key}={value!r} has no effect: it is read "
                                   f"only with {needs}")

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
            self._plan_layer(graph, plan, params, lay, users, planned, row)
        rows.extend(uncovered_rows(graph, plan))
        if not self.effective_kernel and not any(lay.kind in ("conv", "conv_transpose")
                                                 for lay in plan.layers):
            self._notes.append("scheme_options effective_kernel=False has no effect: the model "
                               "has no convolution")
        self._plan_selu(plan)
        self._rows = rows
        plan.notes.extend(f"gne: {n}" for n in self._notes)

    def _plan_layer(self, graph: Graph, plan: Plan, params: dict[str, ParamInfo], lay: Layer,
                    users: dict[str, list[str]], planned: dict[str, dict[str, Any]],
                    row: dict[str, Any]) -> None:
        """One layer: its following activation and gain, then its weight's init (``row``: what
        the report says; ``planned``: weights already planned, by their first call site)."""
        if lay.kind == "embedding":
            row["action"] = "kept the core plan (an embedding is a lookup, no fan-in)"
            return
        act, path, note = following_activation(graph, lay.node, users)
        name, slope = activation_of(act) if act is not None else ("linear", None)
        gain, gsrc = activation_gain(name, slope, self.gamma0,
                                     activation_params(act) if act is not None else None)
        row.update(activation=act.name if act is not None else None, act=name,
                   slope=slope, gain=gain, gain_source=gsrc)
        if note:
            row["note"] = note
        if name == "selu":
            self._selu_layers += 1
        pi = plan.inits.get(lay.weight or "")
        if pi is None or pi.rule in ("keep", "scale"):
            row["action"] = f"weight kept ({pi.reason if pi else 'no init planned'})"
            return
        if lay.weight in planned:
            prev = planned[lay.weight]
            if abs(prev["gain"] - gain) > 1e-12:
                pi.reason += (f"; call site {lay.node} is followed by {name} (gain "
                              f"{gain:.4g}): the first call site's gain was used")
            row["action"] = f"shared weight: planned at call site {prev['node']}"
            return
        shape = tuple(params[lay.weight].shape) if lay.weight in params else tuple(pi.shape)
        n, keff, ksrc = fan_in(graph, plan, lay, shape, self.effective_kernel)
        row.update(fan_in=n, effective_k=keff, k=lay.k2, fan_in_source=ksrc)
        std, rule, why = layer_std(self.kind, lay, shape, gain, gsrc, n, keff, ksrc)
        if lay.alpha != 1.0:
            std /= lay.alpha
            why += f"; divided by alpha={lay.alpha:.4g}"
        plan.inits[lay.weight] = ParamInit(lay.weight, rule, std, why, list(pi.shape), gates=1)
        row.update(rule=rule, std=std, action=f"init {rule} std={std:.4g}")
        planned[lay.weight] = {"node": lay.node, "gain": gain}

    def _plan_selu(self, plan: Plan) -> None:
        """selu='depth': the depth-aware SELU constants for the linear+SELU blocks found."""
        if self.selu == "depth" and self._selu_layers:
            # default: "slightly below 1/L" (0.95/L), capped at the original SELU's 0.0716 so a
            # shallow net gets the standard constants rather than an extreme alpha
            eps = self.selu_epsilon if self.selu_epsilon is not None else \
                min(selu_epsilon_for_depth(self._selu_layers), _SELU_EPS)
            self._selu_coef = selu_coefficients(self._selu_layers, epsilon=eps,
                                                gamma0=self.gamma0)
            self._selu_eps = eps
            plan.notes.append(f"gne: depth-aware SELU for L={self._selu_layers} linear+SELU "
                              f"blocks, epsilon={eps:.4g}: lambda={self._selu_coef[0]:.5g}, "
                              f"alpha={self._selu_coef[1]:.5g} (eq. 32)")
        elif self.selu == "depth":
            self._notes.append("selu='depth' asked for, but no layer is followed by a SELU")
        if self.gamma0 != 1.0 and not self._selu_layers:
            self._notes.append(f"scheme_options gamma0={self.gamma0!r} has no effect: it sets "
                               f"the gain of layers followed by a SELU, and no layer is")

    # -- replacements -------------------------------------------------------------------------
    def replacements(self, graph: Graph, plan: Plan) -> list[tuple[str, nn.Module, str]]:
        out: list[tuple[str, nn.Module, str]] = []
        if self._selu_coef is not None:
            out.extend(selu_replacements(graph, self._selu_coef))
        if self.norm == "smn":
            out.extend(smn_replacements(graph, plan, self.model, self._smn))
            if not self._smn:
                self._notes.append("norm='smn' has no effect: the model has no BatchNorm to "
                                   "replace by Second Moment Normalization")
        self._repl = list(out)
        return out

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
            center_weights(ctx, self._smn, self.smn_center)
            out["smn"] = self._smn
        for node in ctx.unreplaced(self._repl):
            out["notes"].append(f"{node}: replacement not applied (see the report's skipped "
                                f"list)")
        if self.diagnostics:
            ctx.say("gne: block dynamical isometry estimates")
            out["diagnostics"] = block_diagnostics(ctx, self.diag_probes, self.diag_mode)
        return out
