"""LSUV (Mishkin & Matas, "All you need is a good init"): layer-sequential unit variance.

Algorithm 1 of the paper (``shared/seeds/mishkin-lsuv-poster.txt``): pre-initialize every
convolution and fully-connected layer with an orthonormal matrix (Saxe et al.; a conv kernel is
flattened to ``out x (in k^2)``), biases zero; then, layer by layer, run the mini-batch, measure
the variance of the layer's output and divide the layer by its standard deviation until
``|var - 1| < tol`` or ``max_iter`` is reached.

What this scheme does differently from the packaged implementations (DESIGN.md, peers survey):

* It walks the *call sites* of the captured graph in *execution order* (``plan.layers``), not
  the modules in definition order, so a model whose ``__init__`` lists its layers in another
  order than ``forward`` uses them is processed correctly, and a module called twice is two
  call sites, each brought to unit variance.
* The scale of each call site lives in its own alpha buffer (``needs_alpha_sites``), so the two
  call sites of a shared module are scaled independently (fx capture).  In the eager back end a
  module called twice has one input-scale buffer; its call sites then share one scale, fitted to
  the geometric mean of their variances, and the report says so.
* At the end (``fold=True``, default) each scale is folded into the weight where that is exact
  (``W (a x) = (a W) x``): the first call site's factor goes into the weight, later call sites of
  the same weight keep their ratio to it in their alpha.  The result is then the paper's LSUV (a
  scaled orthonormal weight, alpha 1) wherever the weight has a single call site, and the plan's
  ``orthogonal`` init std equals the final scale, so re-applying the plan reproduces it.
* Every forward pass is counted.  A call site's output scales exactly with its alpha once
  biases are zero, so one step usually lands within ``tol``; the pass that checks call site
  ``i`` also measures call site ``i+1``, so the whole model typically takes ``sites + 1`` passes.

Options (``scheme_options``): ``tol`` (0.1), ``max_iter`` (10), ``target_var`` (1.0), ``fold``
(True), ``alphas`` ('none': see :meth:`LSUV.options`).

Report section ``report.conditioning['lsuv']``: per call site (execution order) ``variance_before``
(when LSUV reached it, after the orthonormal init and the earlier sites' scaling), ``variance``
(final), ``iterations``, ``scale`` (its alpha after folding), ``converged``; ``forwards`` (passes
LSUV used), ``forwards_total`` (with the final re-measurement of shared buffers),
``all_converged`` (every conv/linear call site scaled and converged: False when one was
skipped),
``folded``, ``skipped`` (with reasons) and ``notes``.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from precondfx.errors import PrecondError
from precondfx.core.graph import Graph
from precondfx.core.options import Options, Override
from precondfx.core.plan import ParamInfo, ParamInit, Plan
from precondfx.core.scheme import Scheme, SchemeContext, register

#: weighted kinds Algorithm 1 covers ("each convolutional and fully-connected layer")
_KINDS = ("conv", "conv_transpose", "linear", "matmul")


def _var(t: torch.Tensor) -> float:
    """Population variance over every element (the paper's ``var(O_L)`` of the whole blob)."""
    t = t.detach()
    if not t.is_floating_point():
        return float("nan")
    return float(t.double().var(correction=0)) if t.numel() > 1 else float("nan")


@register("lsuv")
class LSUV(Scheme):
    """Layer-sequential unit-variance orthogonal initialization (Mishkin & Matas, Alg. 1)."""

    name = "lsuv"
    needs_alpha_sites = True

    def __init__(self, tol: float = 0.1, max_iter: int = 10, target_var: float = 1.0,
                 fold: bool = True, alphas: str = "none") -> None:
        if not (tol > 0 and math.isfinite(tol)):
            raise PrecondError(f"lsuv: tol={tol!r} must be a positive number")
        if int(max_iter) < 1:
            raise PrecondError(f"lsuv: max_iter={max_iter!r} must be >= 1")
        if not (target_var > 0 and math.isfinite(target_var)):
            raise PrecondError(f"lsuv: target_var={target_var!r} must be a positive number")
        if alphas not in ("none", "keep"):
            raise PrecondError(f"lsuv: alphas={alphas!r} must be 'none' (no analytic alphas) or "
                               f"'keep' (use the balance= option as given)")
        self.tol, self.max_iter, self.target_var = float(tol), int(max_iter), float(target_var)
        self.fold, self.alphas = bool(fold), alphas
        self._notes: list[str] = []

    # -- before planning ----------------------------------------------------------------------
    def overrides(self, opts: Options) -> list[Override]:
        """LSUV sets each layer's scale from data, so the alphas of the core method (the
        analytic kernel-size and residual corrections derived for geometric init, and the
        measured balancing that starts from them) are not applied: the pipeline's default
        balance modes ('auto', 'analytic') become 'none' unless ``alphas='keep'``.
        ``balance='hessian'`` (never a default, so asked for) is kept: it only redistributes
        alphas against the weights after LSUV, leaving the forward pass (and so LSUV's unit
        variances) unchanged."""
        if self.alphas == "keep" and opts.balance not in ("auto", "analytic"):
            note = (f"scheme_options alphas='keep' has no effect: it keeps the alphas of "
                    f"balance='auto' or 'analytic', and balance={opts.balance!r}")
            if note not in self._notes:
                self._notes.append(note)
        if opts.balance in ("auto", "analytic") and self.alphas == "none":
            return [Override("balance", "none", "LSUV fixes each call site's scale from data; "
                             "the alphas of the geometric scheme are not used "
                             "(scheme_options={'alphas': 'keep'} keeps them, balance='hessian' "
                             "balances after LSUV)")]
        return []

    def plan(self, graph: Graph, plan: Plan, params: dict[str, ParamInfo], opts: Options
             ) -> None:
        """Orthonormal pre-initialization (gain 1, divided by any planned alpha so the layer's
        effective weight is orthonormal), biases zero (the core plan already zeroes them)."""
        done: set[str] = set()
        for lay in plan.layers:
            if lay.kind not in _KINDS or not lay.weight or lay.weight in done:
                continue
            done.add(lay.weight)
            pi = plan.inits.get(lay.weight)
            if pi is None or pi.rule in ("keep", "scale"):
                continue  # frozen, parametrized or reinit=False: left as the core plan says
            plan.inits[lay.weight] = ParamInit(
                lay.weight, "orthogonal", 1.0 / lay.alpha,
                "LSUV: orthonormal pre-initialization (Saxe et al.; Mishkin & Matas Alg. 1)"
                + (f", divided by alpha={lay.alpha:.4g}" if lay.alpha != 1.0 else "")
                + "; then scaled to unit output variance on the batch",
                list(pi.shape), gates=1)
        plan.notes.extend(f"lsuv: {n}" for n in self._notes)

    # -- data-driven step ---------------------------------------------------------------------
    def calibrate(self, ctx: SchemeContext) -> dict[str, Any]:
        tgt = self.target_var
        sites, skipped = _sites(ctx)
        buf_of = {lay.node: ctx.site_buffers[lay.node] for lay in sites}
        # call sites per buffer, in execution order (eager: a shared module has one buffer)
        group: dict[str, list[str]] = {}
        for lay in sites:
            group.setdefault(buf_of[lay.node], []).append(lay.node)
        rows = self._fit_sites(ctx, sites, group, buf_of, skipped)
        # Outputs only depend on the scales of earlier call sites, so each site's last measured
        # variance is final, except where call sites share a buffer (eager): re-measure then.
        lsuv_forwards = ctx.forwards
        if rows and any(len(v) > 1 for v in group.values()):
            final = _variances(ctx, list(rows))
            for n, r in rows.items():
                r["variance"] = final.get(n, r["variance"])
        for n, r in rows.items():
            r["converged"] = bool(math.isfinite(r["variance"])
                                  and abs(r["variance"] / tgt - 1.0) < self.tol)
            r["scale"] = float(ctx.buffer(n))
        notes = list(self._notes) + _shared_notes(group, rows, ctx.graph.method)
        missed = _missed(ctx, skipped)
        if rows and missed:
            notes.append(f"{len(missed)} convolution or fully-connected layer(s) not scaled "
                         f"by LSUV ({', '.join(missed[:5])}{', ...' if len(missed) > 5 else ''}"
                         f"; see skipped): all_converged is False, their output variance was "
                         f"not brought to the target")
        if not rows:
            notes.append(f"LSUV scaled no call site: none of the {len(skipped)} weighted layers "
                         f"is a plain convolution or fully-connected call site it can scale "
                         f"(see skipped); the weights are the core plan's")
        folded = self._fold(ctx, sites, rows) if self.fold else []
        notes += sorted({r["note"] for r in rows.values()
                         if r.get("note", "").startswith("scale kept in the alpha")})
        self._record(ctx, rows)
        return {
            "target_var": tgt, "tol": self.tol, "max_iter": self.max_iter,
            "order": "execution order of call sites (plan.layers)",
            "sites": list(rows.values()),
            "forwards": lsuv_forwards,
            "forwards_total": ctx.forwards,
            # a skipped conv/linear layer was not brought to the target variance
            "all_converged": bool(rows) and not missed and
            all(r["converged"] for r in rows.values()),
            "folded": folded,
            "skipped": skipped,
            "notes": notes,
        }

    def _fit_sites(self, ctx: SchemeContext, sites: list, group: dict[str, list[str]],
                   buf_of: dict[str, str], skipped: list[tuple[str, str]]
                   ) -> dict[str, dict[str, Any]]:
        """Algorithm 1 over the call sites in execution order: scale each site's buffer until
        its output variance is the target (one row a site; unprobed sites go to ``skipped``)."""
        rows: dict[str, dict[str, Any]] = {}
        cache: dict[str, float] = {}
        order = [lay.node for lay in sites]
        for i, lay in enumerate(sites):
            node = lay.node
            buf = ctx.buffer(node)
            seen = [n for n in group[buf_of[node]] if order.index(n) <= i]
            first, iters, cache = self._scale_site(ctx, node, buf, seen, order[i + 1:i + 2],
                                                   cache)
            if node not in cache:
                skipped.append((node, "its output could not be probed on the calibration batch "
                                      f"(capture: {ctx.graph.method})"))
            else:
                row: dict[str, Any] = {"node": node, "module": lay.module, "weight": lay.weight,
                                       "variance_before": first, "variance": cache[node],
                                       "iterations": iters, "scale": float(buf),
                                       "buffer": buf_of[node]}
                if not (math.isfinite(cache[node]) and cache[node] > 0):
                    row["note"] = "output variance is zero or not finite: not scaled"
                rows[node] = row
            for n in seen[:-1]:  # earlier call sites sharing this buffer moved with it
                if n in rows and n in cache:
                    rows[n]["variance"] = cache[n]
        return rows

    def _scale_site(self, ctx: SchemeContext, node: str, buf: torch.Tensor, seen: list[str],
                    nxt: list[str], cache: dict[str, float]
                    ) -> tuple[float | None, int, dict[str, float]]:
        """Scale ``buf`` (shared by the call sites ``seen``, ``node`` the last) until the
        geometric mean of their variances is the target, within ``tol`` or ``max_iter``
        steps; measures ``nxt`` too, for the next site.  Returns the first variance of
        ``node``, the steps taken and the last measurements."""
        tgt, iters = self.target_var, 0
        first: float | None = None
        while True:
            if any(n not in cache for n in seen):
                cache = _variances(ctx, seen + nxt)
                if any(n not in cache for n in seen):
                    break
            vs = [cache[n] for n in seen]
            if first is None:
                first = cache[node]
            if not all(math.isfinite(v) and v > 0 for v in vs):
                break
            # one scale per buffer: the geometric mean of its call sites' variances
            v = math.exp(sum(math.log(x) for x in vs) / len(vs))
            if abs(v / tgt - 1.0) < self.tol or iters >= self.max_iter:
                break
            with torch.no_grad():
                buf.mul_(math.sqrt(tgt / v))
            iters += 1
            cache = {}
        return first, iters, cache

    def _fold(self, ctx: SchemeContext, sites: list, rows: dict[str, dict]) -> list[str]:
        """Move each weight's first call-site scale into the weight (exact: the alpha multiplies
        the layer's input); later call sites of the same weight keep their ratio."""
        folded = []
        by_weight: dict[str, list[str]] = {}
        for lay in sites:
            if lay.node in rows and lay.weight:
                by_weight.setdefault(lay.weight, []).append(lay.node)
        readers: dict[str, set[str]] = {}    # parameter -> every node that reads it
        for n in ctx.graph:
            for p in n.params.values():
                readers.setdefault(p, set()).add(n.name)
        for w, nodes in by_weight.items():
            pi = ctx.plan.inits.get(w)
            if pi is None or pi.rule in ("keep", "scale") or pi.std is None:
                continue  # frozen / reinit=False weights stay as they are: scale kept in alpha
            others = sorted(readers.get(w, set()) - set(nodes))
            if others:    # a tied weight (an embedding's, read transposed...): folding the scale
                for n in nodes:     # would scale those reads too, and the earlier call sites
                    rows[n]["note"] = (f"scale kept in the alpha: the weight {w} is also read by "
                                       f"{others}, which folding would change")
                continue
            names = list(dict.fromkeys(ctx.site_buffers[n] for n in nodes))
            a = float(ctx.model.get_buffer(names[0]))
            if not (a > 0 and math.isfinite(a)):
                continue
            try:
                p = ctx.model.get_parameter(w)
            except AttributeError:
                continue
            with torch.no_grad():
                p.mul_(a)
                for b in names:
                    ctx.model.get_buffer(b).div_(a)
            ctx.measured.add("lsuv", "std", w, a, op="mul",
                             note=f"LSUV scale {a:.4g} folded into the weight")
            for n in nodes:
                rows[n]["scale"] = float(ctx.buffer(n))
                rows[n]["folded_into_weight"] = a
            folded.append(w)
        return folded

    @staticmethod
    def _record(ctx: SchemeContext, rows: dict[str, dict]) -> None:
        """Record what the model now holds at each call site: its alpha (``ctx.measured``;
        the plan stays as planned)."""
        why = "LSUV: unit output variance on the calibration batch"
        for lay in ctx.plan.layers:
            if lay.node in rows:
                ctx.measured.add("lsuv", "alpha", lay.node, rows[lay.node]["scale"], reason=why)
        for sc in ctx.plan.scales:
            if sc.tag == "alpha" and sc.node in rows:
                ctx.measured.add("lsuv", "scale", sc.key(), rows[sc.node]["scale"],
                                 reason=why)


def _missed(ctx: SchemeContext, skipped: list[tuple[str, str]]) -> list[str]:
    """The skipped nodes that Algorithm 1 covers (convolutions and fully-connected layers: a
    parametrized Linear, a kept weight without an alpha, an unprobed site), which LSUV left
    off the target variance; an embedding or a normalization is outside its scope."""
    kind = {n.name: n.kind for n in ctx.graph}
    kind.update((lay.node, lay.kind) for lay in ctx.plan.layers)
    return [n for n, _ in skipped if kind.get(n) in _KINDS]


def _sites(ctx: SchemeContext) -> tuple[list, list[tuple[str, str]]]:
    """The plan's conv/linear layers with an alpha buffer at their call site, and every other
    weighted node with why it is not scaled."""
    skipped: list[tuple[str, str]] = []
    sites = []
    for lay in ctx.plan.layers:
        if lay.kind not in _KINDS:
            skipped.append((lay.node, f"{lay.kind}: not a convolution or fully-connected "
                                      f"layer (Algorithm 1 covers only those)"))
        elif ctx.buffer(lay.node) is None:
            pi = ctx.plan.inits.get(lay.weight or "")
            skipped.append((lay.node, f"its weight {lay.weight} is kept ({pi.reason}) and has "
                                      f"no alpha at this call site: not scaled, its output "
                                      f"variance is not brought to the target"
                            if pi is not None and pi.rule == "keep" else
                            "no alpha buffer could be placed at this call site "
                            "(see the report's skipped list)"))
        else:
            sites.append(lay)
    in_plan = {lay.node for lay in ctx.plan.layers}
    for n in ctx.graph:
        if n.status == "weighted" and n.name not in in_plan:
            skipped.append((n.name, f"{n.kind}: not a plain conv/linear weight of the plan "
                                    f"(parametrized, attention or recurrent weights): its "
                                    f"init is the core plan's, not scaled"))
    return sites, skipped


def _variances(ctx: SchemeContext, names: list[str]) -> dict[str, float]:
    """Output variance of each node in ``names`` on the calibration batch (one forward)."""
    got = ctx.outputs(names)
    return {k: _var(v) for k, v in got.items()}


def _shared_notes(group: dict[str, list[str]], rows: dict[str, dict[str, Any]], method: str
                  ) -> list[str]:
    notes = []
    for buf, names in group.items():
        names = [n for n in names if n in rows]
        if len(names) > 1:
            notes.append(f"call sites {names} share one scale buffer {buf} (module called "
                         f"{len(names)} times; the {method} back end places one "
                         f"input scale per module): fitted to the geometric mean of their "
                         f"variances, {[round(rows[n]['variance'], 4) for n in names]}")
    return notes
