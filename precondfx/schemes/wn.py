"""Arpit, Campos & Bengio's initialization of weight-normalized networks: ``scheme="wn"``.

Spec: ``shared/spec/chen-arpit-spec.md`` part B.  For every layer parametrized with
``torch.nn.utils.parametrizations.weight_norm`` (``dim=0``: magnitude ``g`` =
``parametrizations.weight.original0``, direction ``v`` = ``original1``), the plan's inits say:

* ``v`` orthogonal (``direction='orthogonal'``, default; the kernel flattened to
  ``out x (in k)``) or Gaussian ``N(0, 1/fan_in)`` (``direction='gaussian'``, [CODE]);
* ``g = sqrt(gamma * fan_in / fan_out)`` for every row (B.2.4; conv fans ``k^2 c``, so the ratio
  is ``c_in/c_out``), with ``gamma = 2`` before a ReLU, ``1/phi_act`` before other activations
  of the components table (leaky ReLU ``2/(1+slope^2)``: [DERIVED] generalization), 1 for
  linear outputs, stems and projection shortcuts, and ``1/B_k`` for the last layer of each
  residual branch in a stage of ``B_k`` blocks (B.2.5: the branch scale ``1/sqrt(B_k)`` absorbed
  into ``g``);
* biases zero.

Residual blocks and stages come from the plan's residual joins (``plan.residuals``): a stage is
a maximal run of consecutive blocks; a block whose shortcut carries a weighted layer
(projection) or that is separated from the previous block by a weighted layer starts a new one.
Weighted layers that are not weight-normalized get the same forward rule on their plain weight
(``E[W^2] = gamma / fan_out``, He fan-out: spec B.2.4 [DERIVED]).

``g`` is a constant per layer, which no ParamInit rule draws yet: the plan records it as rule
``constant`` (std = the value) and the scheme writes it in its data-free step (``calibrate``),
so the result does not depend on how the re-initializer treats that rule.

Options (``scheme_options``): ``direction`` ('orthogonal' | 'gaussian'), ``residual``
('absorb': ``1/B_k`` in ``g``, default; the pipeline's branch scale is then turned off) and
``gamma_relu`` (2.0).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from precondfx.errors import PrecondError
from precondfx.core.graph import Graph, Node
from precondfx.core.options import Options, Override
from precondfx.core.plan import ParamInfo, ParamInit, Plan
from precondfx.core.scheme import Scheme, SchemeContext, register
from precondfx.schemes import wn_math as W
from precondfx.schemes.activations import activation_of, activation_params
from precondfx.schemes.gne import activation_gain, following_activation

_G = "parametrizations.weight.original0"
_V = "parametrizations.weight.original1"
_WEIGHTED = ("conv", "conv_transpose", "linear", "matmul")


def wn_params(node: Node) -> tuple[str, str] | None:
    """``(g, v)`` parameter names of a weight-normalized layer node, else None."""
    g, v = node.params.get(_G), node.params.get(_V)
    return (g, v) if g and v else None


@register("wn")
class WeightNormInit(Scheme):
    """Proposed data-independent init for weight-normalized feed-forward and residual nets."""

    name = "wn"

    def __init__(self, direction: str = "orthogonal", residual: str = "absorb",
                 gamma_relu: float = 2.0) -> None:
        if direction not in ("orthogonal", "gaussian"):
            raise PrecondError(f"wn: direction={direction!r} must be 'orthogonal' or 'gaussian'")
        if residual not in ("absorb", "pipeline"):
            raise PrecondError(f"wn: residual={residual!r} must be 'absorb' (1/B_k inside g, "
                               f"the paper's implementation) or 'pipeline' (keep the pass's "
                               f"branch scale s)")
        if not (gamma_relu > 0 and math.isfinite(gamma_relu)):
            raise PrecondError(f"wn: gamma_relu={gamma_relu!r} must be a positive finite number "
                               f"(gamma of layers followed by a ReLU, g = sqrt(gamma fan_in/"
                               f"fan_out); 2 in the paper, B.2.4)")
        self.direction, self.residual, self.gamma_relu = direction, residual, float(gamma_relu)
        self._rows: list[dict[str, Any]] = []
        self._stages: list[dict[str, Any]] = []
        self._notes: list[str] = []
        self._g: dict[str, float] = {}

    # -- before planning ----------------------------------------------------------------------
    def overrides(self, opts: Options) -> list[Override]:
        out = []
        if opts.balance in ("auto", "analytic"):
            out.append(Override("balance", "none", "the WN init fixes every layer's scale "
                                "through g; the geometric scheme's alphas are not mixed in"))
        if self.residual == "absorb" and opts.residual == "auto" and opts.reinit:
            out.append(Override("residual", "none", "the branch scale alpha = 1/sqrt(B_k) is "
                                "absorbed into the g of each branch's last layer (B.2.5, "
                                "footnote 5), so the pass inserts no s"))
        return out

    # -- plan ---------------------------------------------------------------------------------
    def plan(self, graph: Graph, plan: Plan, params: dict[str, ParamInfo], opts: Options
             ) -> None:
        users = graph.users()
        last_of, stage_of = self._residual_roles(graph, plan)
        done: set[str] = set()
        n_wn = kept = 0
        relu_used = False
        # the plan's layers on a node that is not a weighted one: a max-pool replaced by a
        # strided convolution (a new plain weight, drawn by the forward rule too)
        pool_convs = {lay.node for lay in plan.layers if lay.kind in _WEIGHTED}
        for n in graph:
            if not (n.status == "weighted" and n.kind in _WEIGHTED or n.name in pool_convs):
                continue
            gv = wn_params(n)
            act, _, note = following_activation(graph, n.name, users)
            name, slope = activation_of(act) if act is not None else ("linear", None)
            row: dict[str, Any] = {"node": n.name, "activation": name}
            if note:
                row["note"] = note
            if n.name in last_of:
                b = last_of[n.name]
                gamma = W.wn_layer_gamma("residual_last", blocks_in_stage=b)
                why = f"last layer of a residual branch in a stage of {b} blocks: gamma = 1/B_k " \
                      f"(B.2.5)"
                if name != "linear":
                    row["note"] = (row.get("note", "") + "; " if row.get("note") else "") + \
                        f"followed by {name} before the join: Theorem 3 assumes a linear end"
            elif name == "relu":
                gamma, relu_used = self.gamma_relu, True
                why = (f"followed by ReLU: gamma = {self.gamma_relu:g} ("
                       + ("B.2.4)" if self.gamma_relu == 2.0 else "gamma_relu; B.2.4 has 2)"))
            elif name == "linear":
                gamma, why = W.wn_layer_gamma("linear"), "no activation follows (linear output, stem or shortcut): " \
                                  "gamma = 1 (B.2.5)"
            else:
                c, src = activation_gain(name, slope, params=activation_params(act))
                gamma, why = c * c, f"followed by {name}: gamma = 1/phi_act ({src}) [DERIVED]"
            row.update(gamma=gamma, gamma_source=why)
            if n.name in stage_of:
                row["stage"] = stage_of[n.name]
            self._rows.append(row)
            if gv is None:
                self._plain(n, plan, params, gamma, why, row, done)
                continue
            g, v = gv
            if g in done:
                row["action"] = "shared weight: planned at its first call site"
                continue
            done.add(g)
            gi, vi = params.get(g), params.get(v)
            if gi is None or vi is None or not vi.trainable:
                row["action"] = "left as is (parameters missing or frozen)"
                continue
            if not opts.reinit:
                row["action"] = "left as is (reinit=False): g, v and bias kept"
                kept += 1
                continue
            if len(vi.shape) < 2 or math.prod(gi.shape) != vi.shape[0] or gi.shape[0] != \
                    vi.shape[0]:
                row["action"] = (f"left as is: magnitude shape {list(gi.shape)} is not per "
                                 f"output row (weight_norm dim=0 is what the paper assumes)")
                continue
            groups = int(n.attrs.get("groups", 1) or 1)
            k = math.prod(vi.shape[2:]) if len(vi.shape) > 2 else 1
            if n.kind == "conv_transpose":  # weight (in, out/g, k...)
                fan_in, fan_out = vi.shape[0] // groups * k, vi.shape[1] * k
            else:
                fan_in, fan_out = vi.shape[1] * k, vi.shape[0] // groups * k
            gval = W.wn_gain(fan_in, fan_out, gamma)
            self._g[g] = gval
            n_wn += 1
            plan.inits[g] = ParamInit(g, "constant", gval,
                                      f"WN magnitude g = sqrt(gamma fan_in/fan_out) = sqrt("
                                      f"{gamma:.4g}*{fan_in}/{fan_out}) (Arpit et al. B.2.4); "
                                      f"{why}; written by scheme wn", list(gi.shape))
            if self.direction == "orthogonal":
                plan.inits[v] = ParamInit(v, "orthogonal", 1.0, "WN direction v: orthogonal "
                                          "(B.2.4; its scale is irrelevant after normalization)",
                                          list(vi.shape), gates=1)
            else:
                plan.inits[v] = ParamInit(v, "normal", 1.0 / math.sqrt(fan_in),
                                          "WN direction v ~ N(0, 1/fan_in) ([CODE] 'Proposed "
                                          "(He)')", list(vi.shape))
            bias = n.params.get("bias")
            if bias and bias in params:
                plan.inits[bias] = ParamInit(bias, "zeros", None, "biases start at zero (B.2.4)",
                                             list(params[bias].shape))
            row.update(fan_in=fan_in, fan_out=fan_out, g=gval, g_param=g, v_param=v,
                       action=f"g = {gval:.4g}, v {self.direction}")
        if self.gamma_relu != 2.0 and not relu_used:
            self._notes.append(f"gamma_relu={self.gamma_relu!r} has no effect: no weighted "
                               f"layer is followed by a ReLU")
        if self.direction != "orthogonal" and not n_wn:
            self._notes.append(f"scheme_options direction={self.direction!r} has no effect: "
                               f"it draws the direction v of weight-normalized layers, and "
                               + ("reinit=False keeps them" if kept else "the model has none"))
        if kept:
            self._notes.append(f"reinit=False: the {kept} weight-normalized layer(s) keep "
                               f"their g, v and bias; the WN init (B.2.4) is not applied")
        elif not n_wn:
            self._notes.append("no weight-normalized layer (torch.nn.utils.parametrizations."
                               "weight_norm) found: only the forward rule on plain weights was "
                               "applied")
        plan.notes.extend(f"wn: {t}" for t in self._notes)

    def _plain(self, n: Node, plan: Plan, params: dict[str, ParamInfo], gamma: float, why: str,
               row: dict[str, Any], done: set[str]) -> None:
        """A weighted layer without weight norm: the same forward rule on its weight."""
        lay = next((x for x in plan.layers if x.node == n.name), None)
        w = n.params.get("weight") or (lay.weight if lay is not None else None)
        pi = plan.inits.get(w or "")
        if lay is None or pi is None or pi.rule in ("keep", "scale") or w in done or \
                lay.kind == "embedding":
            row["action"] = "not weight-normalized: left as the core plan says"
            return
        done.add(w)
        std = math.sqrt(gamma / (lay.n_out * lay.k2)) / lay.alpha
        plan.inits[w] = ParamInit(w, "normal", std, f"not weight-normalized: the WN forward rule "
                                  f"on the plain weight, E[W^2] = gamma/fan_out = {gamma:.4g}/"
                                  f"{lay.n_out * lay.k2} (He fan-out, spec B.2.4 [DERIVED]); "
                                  f"{why}", list(pi.shape))
        row.update(std=std, action=f"plain weight: normal std={std:.4g}")

    def _residual_roles(self, graph: Graph, plan: Plan
                        ) -> tuple[dict[str, int], dict[str, int]]:
        """Last layer of each residual branch -> B_k of its stage; layer -> stage index."""
        if self.residual != "absorb" or not plan.residuals:
            if plan.residuals and self.residual != "absorb":
                self._notes.append("residual='pipeline': the pass's branch scale s is kept and "
                                   "branch ends get gamma = 1")
            elif self.residual != "absorb":
                self._notes.append("scheme_options residual='pipeline' has no effect: the "
                                   "model has no residual join")
            return {}, {}
        anc = graph.ancestors()
        order = {n.name: i for i, n in enumerate(graph)}
        weighted = {n.name for n in graph if n.status == "weighted"}
        joins = sorted(plan.residuals, key=lambda r: order.get(r.node, 0))
        stages: list[list[Any]] = []
        prev = None
        for r in joins:
            join = graph[r.node]
            other = join.inputs[1 - r.branch_index] if len(join.inputs) > 1 else None
            short = (anc.get(other, frozenset()) | {other}) if other else frozenset()
            proj = any(m in weighted and r.fork in anc.get(m, frozenset()) for m in short)
            between = False
            if prev is not None:
                fork_anc = anc.get(r.fork, frozenset()) | {r.fork}
                between = prev.node not in fork_anc or any(
                    m in weighted and prev.node in anc.get(m, frozenset()) for m in fork_anc)
            if prev is None or proj or between:
                stages.append([])
            stages[-1].append(r)
            prev = r
            users = graph.users().get(r.node, [])
            if any(graph[u].kind == "relu" for u in users):
                self._notes.append(f"{r.node}: a ReLU follows the residual addition; Theorems "
                                   f"3/4 assume none (the norm factor changes, spec C.3)")
            if any(graph[m].kind == "normalization" for m in anc.get(join.inputs[r.branch_index],
                                                                      frozenset())
                   if r.fork in anc.get(m, frozenset())):
                self._notes.append(f"{r.node}: the residual branch contains a normalization "
                                   f"layer, which sets its scale itself")
        last_of: dict[str, int] = {}
        stage_of: dict[str, int] = {}
        for k, st in enumerate(stages):
            self._stages.append({"stage": k, "blocks": len(st), "joins": [r.node for r in st]})
            for r in st:
                for m in r.branch_layers:
                    stage_of[m] = k
                if r.branch_layers:
                    last_of[r.branch_layers[-1]] = len(st)
                else:
                    self._notes.append(f"{r.node}: residual branch without a weighted layer")
        return last_of, stage_of

    # -- data-free step -----------------------------------------------------------------------
    def calibrate(self, ctx: SchemeContext) -> dict[str, Any]:
        """Write every WN magnitude ``g`` (a constant per layer; see the module docstring)."""
        written = []
        with torch.no_grad():
            for name, val in self._g.items():
                try:
                    p = ctx.model.get_parameter(name)
                except AttributeError:
                    continue
                p.fill_(val)
                written.append(name)
        return {"direction": self.direction, "layers": self._rows, "stages": self._stages,
                "g_written": len(written), "notes": list(self._notes)}
