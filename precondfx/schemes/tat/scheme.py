"""TAT and DKS: tailored activation transformations as precondfx schemes.

``scheme="tat"`` (Zhang, Botev & Martens, ICLR 2022) and ``scheme="dks"`` (Martens et al. 2021)
run over the shared pipeline (capture -> classify -> plan -> apply -> re-init -> scheme step ->
output scale).  Both shape the network's *kernel* at initialization: for a wide network with
Delta-orthogonal weights, the cosine similarity of two inputs' representations evolves through
a deterministic map C_f, built per location from the layers' local C maps (spec §2.5).  The
math lives in the package's other modules; this module is the scheme, the graph pass of spec §3:

1. **Analysis** (:func:`analyze_graph`): the classified graph becomes an architecture expression
   (:mod:`precondfx.schemes.tat.arch`: ``Act/Affine/Identity/Seq/Sum/Concat``).  Weighted layers
   are ``Affine``,
   activations ``Act``, transparent ops (reshape, dropout, padding, casts, folded or averaged
   max-pools, average pooling) vanish, and every join is built by recursing over fork/join pairs:
   the fork of a join is its immediate dominator, and each operand becomes a branch expression
   from the fork.  A sum of two activations becomes a *normalized sum*: the operand with fewer
   weighted layers (the shortcut) gets ``shortcut_weight`` w, the other ``sqrt(1 - w^2)``;
   equal counts give ``1/sqrt(2)`` each.  A concatenation becomes ``Concat`` weighted by channel
   counts.  "Depth" is never counted by hand: the solvers evaluate the U maps over the whole
   expression and take the maximum over subnetworks (the whole network and every branch of
   every join, recursively; spec §2.6).  What the theory does not cover is refused with a
   :class:`~precondfx.errors.PrecondError` that says why and what to do: normalization layers,
   attention/softmax and other products of activations, max pooling that was not replaced
   (``maxpool='keep'``), adaptive max pooling, embeddings, recurrent cells, non-linear
   elementwise ops without a transform, unknown ops, and models with several data inputs.
2. **Solve**: ReLU-family networks get TAT's TReLU ``sqrt(2/(1+a^2)) * leaky_relu(x, a)`` with
   the negative slope a such that the network's maximal C_g(0) over subnetworks is ``eta``
   (spec §2.7).  Smooth activations get ``gamma*(phi(alpha*x+beta)+delta)`` solved for TAT
   (Q(1)=1, Q'(1)=1, C'(1)=1, network curvature ``tau``) or DKS (Q(1)=1, Q'(1)=q_slope, C(0)=0,
   network slope ``zeta``) (spec §2.8).
3. **Rewrite**: activations are replaced through :meth:`Scheme.replacements` (modules and, in the
   fx path, functional calls), the join operands get constant multipliers (plan scales tagged
   ``shortcut`` and ``residual``), alphas and the core's residual scale are switched off
   (balance='none', residual='none': TAT fixes scales analytically, spec §3.3), every weighted
   layer is planned as ``orthogonal`` and drawn in the scheme step as scaled-uniform-orthogonal
   (Linear) or Delta-orthogonal (odd-kernel convolutions), biases zero (spec §2.9).
4. **Scheme step** (:meth:`TatScheme.calibrate`): the weight draws (a ``torch.Generator`` seeded
   from ``seed``), the input normalization option, and a self-check: the measured second moment
   q at every activation on the calibration batch, reported next to the solved constants.

Inputs should have q = mean(x^2 over channels) = 1 at every location (spec §2.1).  Per-location
normalization with a homogeneous coordinate adds a channel, so it cannot be inserted into a
model without changing its first layer: it is offered as the preprocessing function
:func:`per_location_normalize` users apply to their data.  In the graph, ``input_norm='scale'``
inserts one fixed input scale that makes the sample's mean q equal 1, and ``input_norm='pln'``
inserts a :class:`~precondfx.pytorch.modules.PerLocationNorm` (no homogeneous coordinate).
"""
from __future__ import annotations

import math
from typing import Any

from torch import nn

from precondfx.core.graph import Graph
from precondfx.core.options import Options, Override
from precondfx.core.plan import ParamInfo, Plan
from precondfx.core.scheme import Scheme, SchemeContext, register
from precondfx.errors import PrecondError
from precondfx.schemes.tat.analysis import Analysis, analyze_graph
from precondfx.schemes.tat.arch import describe
from precondfx.schemes.tat.elements import RELU_FAMILY
from precondfx.schemes.tat.local_maps import ActivationTransform
from precondfx.schemes.tat.planning import plan_inits, plan_joins
from precondfx.schemes.tat.replacements import (Replacements, add_transformed, add_trelu,
                                               transforms_info)
from precondfx.schemes.tat.step import (check_replacements, check_sums, draw_weights, input_norm,
                                       q_check)
from precondfx.schemes.tat.targets import _curvature_target, _slope_target, _trelu_slope
from precondfx.schemes.tat.transforms import solve_dks_local, solve_tat_smooth_local
from precondfx.schemes.tat.trelu import leaky_relu_c_map

_INPUT_NORM = ("auto", "check", "scale", "pln", "off")


@register("tat")
class TatScheme(Scheme):
    """Tailored Activation Transformation (Zhang et al. 2022; spec ``tat-dks-spec.md``).

    Options (``precondition(..., scheme="tat", scheme_options={...})``):

    * ``eta`` (0.9): the TReLU target C_f(0) (max over subnetworks) for ReLU-family networks.
    * ``tau`` (0.3): the network curvature C''_f(1) for smooth activations.
    * ``shortcut_weight`` (0.8): w of the normalized sums ``w*shortcut + sqrt(1-w^2)*branch``
      inserted at residual joins (0 = vanilla; the paper's best rescaled ResNet uses 0.8).
    * ``delta`` (True): Delta-orthogonal convolutions (odd kernels); False draws scaled
      orthogonal matrices over the flattened kernel instead.
    * ``input_norm`` ('auto'): 'check' measures q = mean(x^2 over channels) of the sample per
      location and reports it; 'scale' inserts one input scale giving mean q = 1 on the sample;
      'pln' inserts a PerLocationNorm module at the input; 'off' does nothing; 'auto' is 'check'
      for TReLU networks (positively homogeneous: the input scale does not change the C map)
      and 'scale' for smooth activations.  Per-location normalization with a homogeneous
      coordinate is the preprocessing function :func:`per_location_normalize`.
    """

    name = "tat"

    def __init__(self, eta: float = 0.9, tau: float = 0.3, shortcut_weight: float = 0.8,
                 delta: bool = True, input_norm: str = "auto") -> None:
        if not 0.0 < float(eta) < 1.0:
            raise PrecondError(f"eta={eta!r} must be in (0, 1): the target C_f(0)")
        if input_norm not in _INPUT_NORM:
            raise PrecondError(f"input_norm={input_norm!r} is not one of {_INPUT_NORM}")
        if not (0.0 < float(tau) < math.inf):
            raise PrecondError(f"tau={tau!r} must be a positive finite number (TAT's network "
                               f"curvature C''_f(1); the paper's grid is 0.2, 0.3, 0.5)")
        if not 0.0 <= float(shortcut_weight) < 1.0:
            raise PrecondError(f"shortcut_weight={shortcut_weight!r} must be in [0, 1) (the "
                               f"weight w of the normalized sum w*x + sqrt(1-w^2)*F(x); w = 1 "
                               f"multiplies every residual branch by 0, so its layers would "
                               f"never train)")
        self.eta, self.tau = float(eta), float(tau)
        self._given = {k: v for k, v, d in (("eta", eta, 0.9), ("tau", tau, 0.3),
                                            ("shortcut_weight", shortcut_weight, 0.8))
                       if float(v) != d}
        if not delta:
            self._given["delta"] = False
        self.shortcut_weight, self.delta = float(shortcut_weight), bool(delta)
        self.input_norm = input_norm
        self.analysis: Analysis | None = None
        self.method = ""
        self.info: dict[str, Any] = {}
        self._repl = Replacements(self.name)
        self._redraw: set[str] = set()         # weights the scheme step draws itself

    # -- pipeline hooks ----------------------------------------------------------------------
    def overrides(self, opts: Options) -> list[Override]:
        why = f"{self.name} fixes the scales analytically (spec §3.3)"
        return [Override("balance", "none", why),
                Override("residual", "none", f"{self.name} sets the residual weights itself "
                         f"(shortcut_weight)")]

    def plan(self, graph: Graph, plan: Plan, params: dict[str, ParamInfo], opts: Options) -> None:
        an = analyze_graph(graph, plan, self.shortcut_weight)
        self.analysis = an
        notes = list(an.notes)
        if not an.activations:
            raise PrecondError(f"scheme={self.name!r}: the network has no nonlinear layer on its "
                               f"data path, so there is no kernel to shape; use "
                               f"scheme='geometric'")
        self._solve(graph, an, params, notes)
        notes.extend(self._idle_options())
        given = getattr(self, "_given", {})
        if "shortcut_weight" in given and not any(j.kind == "sum" and j.shortcut is not None
                                                  for j in an.joins):
            notes.append(f"scheme_options shortcut_weight={given['shortcut_weight']!r} has no "
                         f"effect: the network has no residual sum with a shortcut")
        if "delta" in given and not any(lay.kind in ("conv", "conv_transpose")
                                        for lay in plan.layers):
            notes.append("scheme_options delta=False has no effect: the network has no "
                         "convolution (Delta initialization is for convolutions)")
        plan.reasons.update(self._repl.reasons)
        self.info["normalized_sums"] = plan_joins(self.name, plan, an)
        self.info["shortcut_weight"] = self.shortcut_weight
        plan_inits(self.name, graph, plan, params, opts, notes, self.delta, self._redraw,
                   self.analysis, self.method == "TReLU")
        self.info["notes"] = notes
        plan.notes.extend(f"{self.name}: {t}" for t in [self._headline()] + notes)

    def replacements(self, graph: Graph, plan: Plan) -> list[tuple[str, nn.Module, str]]:
        return list(self._repl.items)

    # -- solving -------------------------------------------------------------------------------
    def _solve(self, graph: Graph, an: Analysis, params: dict[str, ParamInfo],
               notes: list[str]) -> None:
        kinds = set(an.act_names.values())
        relu = kinds & set(RELU_FAMILY)
        if relu and kinds - relu:
            raise PrecondError(f"scheme='tat' cannot mix ReLU-family activations ({sorted(relu)}) "
                               f"with smooth ones ({sorted(kinds - relu)}): TAT's leaky-ReLU "
                               f"method needs leaky ReLUs to be the only activation type (spec "
                               f"§2.7); use one family, or scheme='dks'")
        if relu:
            self._solve_trelu(graph, an, params)
            return
        self.method = "TAT-smooth"
        kappa = _curvature_target(an, self.tau)
        self.info.update(method="TAT smooth", tau=self.tau, local_curvature=kappa)
        sol = {}
        for k in sorted(kinds):
            try:
                sol[k] = solve_tat_smooth_local(k, kappa)
            except PrecondError as e:
                raise PrecondError(
                    f"scheme='tat' found no transform of the {k} activation(s) that meets its "
                    f"target: the local curvature C''(1)={kappa:.6g} (tau={self.tau} over the "
                    f"network's depth); the solver said: {e} What to do: try another "
                    f"scheme_options tau (now {self.tau}; 0.3 by default), "
                    f"or scheme='dks', or the default scheme='geometric'") from None
        self._transform(graph, an, sol)

    def _idle_options(self) -> list[str]:
        """A note for each TAT option given that the solved method does not read (eta is the
        TReLU target, tau the smooth activations' curvature)."""
        reads = {"TReLU": "eta", "TAT-smooth": "tau"}.get(self.method)
        return [f"scheme_options {k}={v!r} has no effect: the {self.method} method reads "
                f"{reads} only" for k, v in getattr(self, "_given", {}).items()
                if reads is not None and k in ("eta", "tau") and k != reads]

    def _solve_trelu(self, graph: Graph, an: Analysis, params: dict[str, ParamInfo]) -> None:
        """TAT's TReLU: the negative slope whose network C_f(0) is eta (spec §2.7)."""
        try:
            p = _trelu_slope(an, self.eta)
        except PrecondError as e:
            top = an.subnet_max(0.0, lambda y: leaky_relu_c_map(y, 0.0))
            raise PrecondError(
                f"scheme='tat': the target eta={self.eta} is unreachable for this network: "
                f"the largest C_f(0) a leaky ReLU with slope in [0, 1] can give is {top:.6f} "
                f"(plain ReLU). Use a smaller eta, a deeper network or a smaller "
                f"shortcut_weight (now {self.shortcut_weight}). ({e})") from None
        self.method = "TReLU"
        a, g = p.negative_slope, p.output_scale
        self.info.update(method="TReLU (TAT leaky ReLU)", eta=self.eta, negative_slope=a,
                         output_scale=g,
                         c_f0_predicted=an.subnet_max(0.0, lambda y: leaky_relu_c_map(y, a)),
                         max_reachable_eta=an.subnet_max(0.0, lambda y: leaky_relu_c_map(y, 0.0)))
        add_trelu(self._repl, graph, an, params, p, self.eta)

    def _transform(self, graph: Graph, an: Analysis, sol: dict[str, ActivationTransform]
                   ) -> None:
        """Replace every activation by its solved transform (TAT smooth, DKS)."""
        self.info["transforms"] = transforms_info(sol)
        add_transformed(self._repl, graph, an, sol, self.method)

    def _headline(self) -> str:
        """The plan's first note: the solved constants and the network's shape."""
        an = self.analysis
        s = an.summary() if an else {}
        base = (f"{s.get('nonlinear_layers')} nonlinear layers, {s.get('joins')} joins, "
                f"effective depth (curvature coefficient) {s.get('effective_depth', 0):.4g}")
        if self.method == "TReLU":
            return (f"TReLU negative slope {self.info['negative_slope']:.10g}, output scale "
                    f"{self.info['output_scale']:.10g} for C_f(0) = {self.eta} ({base})")
        if self.method == "TAT-smooth":
            return (f"TAT smooth, tau={self.tau}, local C''(1)="
                    f"{self.info['local_curvature']:.6g} ({base})")
        return (f"DKS, zeta={self.info.get('zeta')}, local C'(1)="
                f"{self.info.get('local_slope', 0):.8g} ({base})")

    # -- scheme step -----------------------------------------------------------------------------
    def calibrate(self, ctx: SchemeContext) -> dict[str, Any]:
        an = self.analysis
        assert an is not None
        notes: list[str] = list(self.info.get("notes", []))
        trelu = self.method == "TReLU"
        check_replacements(self.name, ctx, self._repl.items)
        check_sums(self.name, trelu, an, ctx, notes)
        init = draw_weights(ctx, self._redraw, self.delta)
        inp = input_norm(ctx, self.input_norm, trelu, notes)
        qs = q_check(ctx, an)
        if qs.get("off_target") and not trelu:
            notes.append(
                f"self-check: the second moment q at {len(qs['off_target'])} activation(s) is "
                f"far from the q = 1 the transforms were solved for ("
                + ", ".join(f"{k}: {v:.3g}" for k, v in list(qs["off_target"].items())[:5])
                + "): the kernel is not shaped as solved there (an average pooling or "
                f"mean mixes locations and lowers q; input_norm='off'/'check' leaves the "
                f"input's q)")
        out = {k: v for k, v in self.info.items() if k != "notes"}
        out.update(an.summary())
        out.update(scheme=self.name, replaced=len(self._repl.items), init=init, input=inp,
                   q_at_activations=qs, notes=notes,
                   architecture=describe(an.arch))
        return out


@register("dks")
class DksScheme(TatScheme):
    """Deep Kernel Shaping (Martens et al. 2021; spec §2.8) over the same graph pass.

    Options: ``zeta`` (1.5): the network slope C'_f(1) (max over subnetworks);
    ``q_slope`` (1.0): the local Q'(1) target; ``shortcut_weight``, ``delta`` and
    ``input_norm`` as for ``tat`` ('auto' means 'scale').  ReLU is only partly supported by DKS
    (its Q'(1) condition is dropped, spec §2.8); leaky ReLU and PReLU get the DKS leaky-ReLU
    transform (a PReLU's learnable slope becomes a constant)."""

    name = "dks"

    def __init__(self, zeta: float = 1.5, q_slope: float = 1.0, shortcut_weight: float = 0.8,
                 delta: bool = True, input_norm: str = "auto") -> None:
        super().__init__(shortcut_weight=shortcut_weight, delta=delta, input_norm=input_norm)
        if not (1.0 < float(zeta) < math.inf):
            raise PrecondError(f"zeta={zeta!r} must be a finite number > 1 (DKS's network slope "
                               f"C'_f(1); the paper uses 1.5, 10, 100)")
        if not (0.0 < float(q_slope) < math.inf):
            raise PrecondError(f"q_slope={q_slope!r} must be a positive finite number (the "
                               f"local Q'(1) target; 1 in DKS)")
        self.zeta, self.q_slope = float(zeta), float(q_slope)

    def _solve(self, graph: Graph, an: Analysis, params: dict[str, ParamInfo],
               notes: list[str]) -> None:
        self.method = "DKS"
        s = _slope_target(an, self.zeta)
        kinds = set(an.act_names.values())
        sol = {}
        for k in sorted(kinds):
            key = "leaky_relu" if k in ("leaky_relu", "prelu") else k
            try:
                sol[k] = solve_dks_local(key, s, self.q_slope)
            except PrecondError as e:
                raise PrecondError(self._unsolved(k, s, e)) from None
        if "relu" in kinds:
            notes.append("ReLU under DKS is only partly supported: its Q'(1) condition is dropped "
                         "(spec §2.8)")
            if kinds == {"relu"} and self.q_slope != 1.0:
                notes.append(f"scheme_options q_slope={self.q_slope!r} has no effect: the "
                             f"network's only activation is ReLU, whose Q'(1) condition DKS "
                             f"drops (spec §2.8)")
        if "prelu" in kinds:
            notes.append("PReLU replaced by the DKS leaky-ReLU transform: its slope becomes a "
                         "constant")
        self.info.update(method="DKS", zeta=self.zeta, q_slope=self.q_slope, local_slope=s)
        self._transform(graph, an, sol)


    def _unsolved(self, act: str, s: float, e: Exception) -> str:
        """Why DKS found no transform for ``act`` at the local slope ``s``, and what to do."""
        fix = (f"q_slope={self.q_slope!r} is a target DKS itself does not use (DKS sets Q'(1) "
               f"= 1): drop scheme_options q_slope, or move it toward 1"
               if self.q_slope != 1.0 else
               f"try another scheme_options zeta (the DKS paper uses 1.5, 10 and 100; now "
               f"{self.zeta})")
        return (f"scheme='dks' found no transform of the {act} activation(s) that meets its two "
                f"targets, the local slope C'(1)={s:.6g} (from zeta={self.zeta} over the "
                f"network's depth) and Q'(1)=q_slope={self.q_slope}: these may be unreachable "
                f"together for {act} (the solver said: {e}). What to do: {fix}; or use "
                f"scheme='tat' (smooth activations: its curvature target) or the default "
                f"scheme='geometric'")


def architecture(model: nn.Module, sample: Any, *, maxpool: str = "stride",
                 shortcut_weight: float = 0.8, capture: Any = ("fx", "export", "draft_export",
                                                               "eager")) -> Analysis:
    """The TAT/DKS analysis of a model without changing it: its per-location architecture
    expression(s), activations and joins (raises what ``scheme='tat'`` would refuse)."""
    from precondfx.pytorch import calibrate as cal
    from precondfx.pytorch.pipeline import capture_classify, prepare_sample
    from precondfx.core.plan import make_plan
    opts = Options(maxpool=maxpool, balance="none", residual="none")
    model, s, notes = prepare_sample(model, sample, {})
    cal.forward(model, s, "train")
    cap, infos = capture_classify(model, s, capture, "train", notes)
    plan = make_plan(cap.graph, infos, opts)
    return analyze_graph(cap.graph, plan, shortcut_weight)

