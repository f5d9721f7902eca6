"""The report: what precondfx found, what it changed, and how the result measures up.

Every node of the captured graph appears with its status, its reason and the actions taken on
it; the report prints as a table, serializes to JSON, and says which capture method was used,
why earlier ones failed, and what could not be applied.
"""
from __future__ import annotations

import math

import json
import os
import re
import shutil
import textwrap
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from precondfx.core.graph import Graph
from precondfx.core.measured import Measured
from precondfx.core.plan import Plan

#: version of the JSON layout written by ``Report.save`` (docs/reference/report.md).
#: Bump it when a field changes meaning or is removed; adding a field keeps the version.
SCHEMA_VERSION = 1


@dataclass
class NodeRow:
    """One line of the report.  ``name`` is the graph node (the key the plan uses); ``label``
    is what the table shows: the module path where the node is a module call, unique among
    the rows."""

    name: str
    kind: str
    status: str
    reason: str
    target: str
    module: str | None
    out_shape: list[int] | None
    actions: list[str] = field(default_factory=list)
    label: str = ""


def _labels(graph: Graph) -> dict[str, str]:
    """A readable, unique label per node: the module path (``bert.encoder.layer.0.attention.
    self.query``) for module calls, with ``#k`` for the k-th call of a module called several
    times and ``:op`` where several graph nodes share one module (ONNX); the node name for
    functional ops; the node name appended where labels would still collide."""
    nodes = list(graph)
    per_module: dict[str, list] = {}
    for n in nodes:
        if n.module:
            per_module.setdefault(n.module, []).append(n)
    out: dict[str, str] = {}
    for n in nodes:
        if not n.module:
            # a functional call reading a module's parameter (GPT-2's Conv1D as addmm): that
            # module's path, with the op
            w = n.params.get("weight")
            owner = w.rpartition(".")[0] if w else ""
            out[n.name] = f"{owner}:{n.target.rsplit('.', 1)[-1]}" if owner else n.name
            continue
        lab = n.module
        same = per_module[n.module]
        if len(same) > 1:
            if len({m.call_index for m in same}) == len(same):
                lab = f"{lab}#{n.call_index}" if n.call_index else lab
            else:
                lab = f"{lab}:{n.target.rsplit('.', 1)[-1]}"
        out[n.name] = lab
    seen: dict[str, int] = {}
    for lab in out.values():
        seen[lab] = seen.get(lab, 0) + 1
    names = {n.name for n in nodes}
    for k, lab in list(out.items()):
        if seen[lab] > 1 or (lab != k and lab in names):
            out[k] = f"{lab} [{k}]"
    return out


def _alpha_source(reason: str) -> str:
    """Where a final alpha came from, from the reason the balancing steps leave on the layer."""
    if "LSUV" in reason:
        return " (LSUV)"
    if "measured balancing x" in reason:
        return " (measured)"
    return ""


def _bare(lay: Any, labels: dict[str, str]) -> bool:
    """Whether the layer's weight is a parameter no module of the row's label owns (``self.W``
    in a matmul): its row, the functional node, does not name it."""
    owner = (lay.weight or "").rpartition(".")[0]
    label = labels.get(lay.node) or lay.node
    return lay.module is None and bool(lay.weight) and not (owner and label.startswith(owner))


def _plan_actions(plan: Plan, labels: dict[str, str] | None = None) -> dict[str, list[str]]:
    """What the plan does at each node, in words with the constants' values (``labels``: the
    rows' labels by node name)."""
    acts: dict[str, list[str]] = {}
    labels = labels or {}
    for pc in plan.pools:
        acts.setdefault(pc.node, []).append(
            {"fold": f"folded into {pc.into}", "conv": "-> strided conv",
             "avgpool": "-> avg pool", "keep": "kept"}.get(pc.action, pc.action))
    layer_of = {lay.node: lay for lay in plan.layers}
    for lay in plan.layers:
        pi = plan.inits.get(lay.weight or "")
        # a bare parameter (``self.W`` used in a matmul, no module owns it): the row is the
        # functional node, so the parameter re-drawn is named
        bare = f"{lay.weight} " if pi is not None and _bare(lay, labels) else ""
        if pi is not None and pi.rule not in ("keep", "scale"):
            std = f" std={pi.std:.3g}" if pi.std is not None else ""
            acts.setdefault(lay.node, []).append(f"{bare}{pi.rule}{std}")
        elif pi is not None:
            acts.setdefault(lay.node, []).append(f"{bare or 'weights '}{pi.rule}")
    names = {"alpha": "alpha", "residual": "s", "shortcut": "w", "beta": "1/beta"}
    for r in plan.residuals:
        if getattr(r, "beta", 1.0) != 1.0:
            acts.setdefault(r.node, []).append(f"beta={r.beta:.4g}")
    for sc in plan.scales:
        if sc.tag in ("input", "output"):
            continue
        lay = layer_of.get(sc.node)
        src = _alpha_source(lay.alpha_reason) if sc.tag == "alpha" and lay else ""
        if sc.value != 1.0 or src:
            acts.setdefault(sc.node, []).append(f"{names.get(sc.tag, sc.tag)}={sc.value:.3g}{src}")
    return acts


class _Row(str):
    """A table row (laid out to the width already; never re-wrapped)."""


_WORD = re.compile(r"[A-Za-z_][\w.]*")


def _relabel(text: str, rename: dict[str, str]) -> str:
    """Node names quoted in a reason, shown as the rows' labels (module paths)."""
    if not rename:
        return text
    return _WORD.sub(lambda m: rename.get(m.group(0), m.group(0)), text)


def _join(parts: list[str | None]) -> str:
    """Dotted path from components, ``None`` marking elided runs (shown as one ellipsis)."""
    out = ""
    prev: str | None = ""
    for p in parts:
        if p is None:
            if prev is not None:
                out += "\u2026"
        else:
            out += (p if not out or prev is None else "." + p)
        prev = p
    return out


def _cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, cut in the middle.  A dotted module path
    loses its inner names from the left (the root name, layer indices and the names near the
    end are what tell rows apart: ``bert\u20260.attention.self.query``); anything else keeps
    its head and tail."""
    if len(text) <= width:
        return text
    parts: list[str | None] = list(text.split("."))
    if len(parts) > 2:
        inner = [i for i in range(1, len(parts) - 1) if not parts[i].isdigit()]
        for i in inner:
            parts[i] = None
            cand = _join(parts)
            if len(cand) <= width:
                return cand
        text = _join(parts)
        if len(text) <= width:
            return text
        if width > 3:    # the tail of a path is its most specific part
            return "\u2026" + text[len(text) - width + 1:]
    if width <= 3:
        return text[:width]
    tail = (width - 1) * 3 // 5
    head = width - 1 - tail
    return text[:head] + "\u2026" + text[len(text) - tail:]


def _fit_unique(labels: list[str], width: int) -> int:
    """The smallest column width >= ``width`` at which the cut labels stay distinct."""
    longest = max((len(x) for x in labels), default=0)
    w = min(width, longest)
    while w < longest and len({_cut(x, w) for x in labels}) < len(set(labels)):
        w += 1
    return w


def _name_reason_widths(labels: list[str], reasons: list[str], avail: int) -> tuple[int, int]:
    """Widths of the node and reason columns in ``avail`` characters: as long as the longest
    when both fit; else the node names cut (still unique) and the reasons cut, and 0 for the
    reasons when fewer than 10 characters are left for them."""
    wn_nat = max([len("node")] + [len(x) for x in labels])
    wr_nat = max([len("reason")] + [len(r) for r in reasons])
    if wn_nat + wr_nat <= avail:
        return wn_nat, wr_nat
    wr_min = min(wr_nat, 16)
    wn = min(wn_nat, max(24, avail * 3 // 5))
    if avail - wn < wr_min:
        wn = max(12, avail - wr_min)
    wn = _fit_unique(labels, wn)
    wr = avail - wn
    return wn, (wr if wr >= 10 else 0)


def _wrap_prose(lines: list[str], width: int) -> str:
    """Table rows as laid out; prose wrapped to the width."""
    out: list[str] = []
    for ln in lines:
        if isinstance(ln, _Row) or len(ln) <= width:
            out.append(str(ln))
        else:
            ind = " " * (len(ln) - len(ln.lstrip()) + 4)
            out.extend(textwrap.wrap(ln, width, subsequent_indent=ind,
                                     break_on_hyphens=False))
    return "\n".join(out)


@dataclass
class Report:
    """Result of ``analyze`` or ``precondition``."""

    capture: str
    capture_notes: list[str]
    nodes: list[NodeRow]
    plan: Plan | None = None
    applied: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    output_std_before: float | None = None
    output_std_after: float | None = None
    target_std: float | None = None
    output_scale: float | None = None
    input_scale: float | None = None
    conditioning: dict[str, Any] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    verification: dict[str, Any] = field(default_factory=dict)
    #: the plan as planned, before anything was applied (``plan`` is it with ``measured``
    #: applied: the values the model holds)
    planned: Plan | None = None
    #: what calibration, balancing and the schemes set after the plan was applied
    measured: Measured = field(default_factory=Measured)
    #: what the returned model is (``precondition``): ``class`` (the user's), ``is_user_class``,
    #: ``graph_module`` (whether it is also the rewritten ``torch.fx.GraphModule``), and
    #: ``forward_only``: constants and edits at functional sites that only its ``forward``
    #: applies (the user's other methods, e.g. ``forward_features``, run without them), and the
    #: user's methods that read a weight or bias whose module carries constants outside a call
    #: of it (``F.linear(h, self.head.weight)``: computed without them)
    result: dict[str, Any] = field(default_factory=dict)
    #: (not a field: not in the JSON) the rewritten ``torch.fx.GraphModule`` (fx capture; the
    #: returned model itself, which is also of the user's class), None where the model was
    #: rewritten with hooks on its own modules (the other capture methods, ``inplace=True``)
    graph_module = None

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_graph(cls, graph: Graph, plan: Plan | None = None) -> "Report":
        labels = _labels(graph)
        said = plan.reasons if plan is not None else {}
        rows = [NodeRow(n.name, n.kind, n.status, said.get(n.name, n.reason), n.target, n.module,
                        list(n.out_shape) if n.out_shape else None, [], labels[n.name])
                for n in graph]
        rep = cls(graph.method, list(graph.notes), rows, plan)
        rep.refresh()
        return rep

    def refresh(self) -> None:
        """Re-derive each row's actions from the plan (the driver replaces it at the end with
        the planned values plus what was measured; the table and the JSON show the final
        values)."""
        if self.plan is None:
            return
        acts = _plan_actions(self.plan, self._labels())
        for r in self.nodes:
            r.actions = acts.get(r.name, [])

    # -- summaries ---------------------------------------------------------------------------
    def _labels(self) -> dict[str, str]:
        """The rows' labels by node name (where a row has one)."""
        return {r.name: r.label for r in self.nodes if r.label}

    def counts(self) -> dict[str, int]:
        """Number of nodes per status."""
        out: dict[str, int] = {}
        for r in self.nodes:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    def rows(self, status: str | None = None) -> list[NodeRow]:
        return [r for r in self.nodes if status is None or r.status == status]

    def table(self, width: int | None = None, all_nodes: bool = False) -> str:
        """A table that fits ``width`` columns (default: the terminal's, 150 when there is
        none); structural nodes are folded into a count unless ``all_nodes``.  Rows show the
        module path (unique; cut in the middle when it must be), every constant set at the node
        (init std, alpha and where it came from, residual s/w) and the reason."""
        self.refresh()
        if width is None:
            width = shutil.get_terminal_size(fallback=(150, 24)).columns
        width = max(int(width), 60)
        lines: list[str] = [f"precondfx report  (capture: {self.capture})"]
        for note in self.capture_notes:
            lines.append(f"  note: {note}")
        c = self.counts()
        rest = ["  nodes: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))]
        rename = {r.name: r.label for r in self.nodes if r.label and r.label != r.name}
        rest += self._node_rows(width, all_nodes, rename)
        rest += self._plan_lines(rename)
        rest += self._measured_lines()
        said = "\n".join(lines + rest)
        # the plan's notes (options without effect, a scheme's overrides...) that no other
        # line says
        lines += [f"  note: {n}" for n in (self.plan.notes if self.plan is not None else ())
                  if n not in said]
        return _wrap_prose(lines + rest, width)

    def _node_rows(self, width: int, all_nodes: bool, rename: dict[str, str]) -> list[str]:
        """The node table (header, rule, one row a node) and what it leaves out."""
        shown = [r for r in self.nodes
                 if all_nodes or r.status != "structural" or r.actions]
        labels = [r.label or r.name for r in shown]
        changes = [", ".join(r.actions) for r in shown]
        wk = max([len("kind")] + [len(r.kind) for r in shown])
        ws = max([len("status")] + [len(r.status) for r in shown])
        # the change column gives way first: names need room to stay unique, reasons 16
        wn_need = _fit_unique(labels, min(24, max([len("node")] + [len(x) for x in labels])))
        wc = max(len("change"), min(60, max([len("change")] + [len(x) for x in changes]),
                                    width - wk - ws - 4 - wn_need - 16))
        wn, wr = _name_reason_widths(labels, [r.reason for r in shown], width - wk - ws - wc - 4)
        lines: list[str] = [
            "", f"{'node':{wn}} {'kind':{wk}} {'status':{ws}} {'change':{wc}} "
                f"{'reason' if wr else ''}".rstrip(),
            "-" * min(width, wn + wk + ws + wc + wr + 4)]
        for r, lab, act in zip(shown, labels, changes):
            act = act if len(act) <= wc else act[: wc - 3] + "..."
            reason = _relabel(r.reason, rename)
            reason = reason if len(reason) <= wr else reason[: wr - 3] + "..." if wr else ""
            lines.append(_Row(f"{_cut(lab, wn):{wn}} {r.kind:{wk}} {r.status:{ws}} {act:{wc}} "
                              f"{reason}".rstrip()))
        if not wr:      # no room was left for prose
            lines.append(f"(reasons left out at width {width}: report.table(width=...) or "
                         f"report.save(path) for the full text)")
        hidden = sum(1 for r in self.nodes if r.status == "structural" and not r.actions)
        if hidden and not all_nodes:
            lines.append(f"({hidden} structural nodes not shown: report.table(all_nodes=True))")
        return lines

    def _plan_lines(self, rename: dict[str, str]) -> list[str]:
        """Parameters re-initialized and kept, the scales, the constants, what was not
        applied."""
        lines: list[str] = []
        if self.plan is not None:
            nre = sum(1 for p in self.plan.inits.values() if p.rule != "keep")
            nkeep = sum(1 for p in self.plan.inits.values() if p.rule == "keep")
            lines += ["", f"parameters: {nre} re-initialized, {nkeep} kept"]
            labels = self._labels()
            bare = {lay.weight: lay.node for lay in self.plan.layers
                    if _bare(lay, labels) and lay.weight in self.plan.inits and
                    self.plan.inits[lay.weight].rule != "keep"}
            if bare:        # no module row names them: the table shows the functional node
                lines.append("  re-initialized parameters used outside a module: " + ", ".join(
                    f"{w} (row {labels.get(n, n)})" for w, n in bare.items()))
            for p in self.plan.inits.values():
                if p.rule == "keep":
                    lines.append(f"  kept {p.name}: {p.reason}")
            for pc in self.plan.pools:      # the row says 'kept'; here is why
                if pc.action == "keep" and pc.reason:
                    why = pc.reason[len("kept: "):] if pc.reason.startswith("kept: ") else \
                        pc.reason
                    lines.append(f"  kept max pool {labels.get(pc.node, pc.node)}: {why}")
        if self.input_scale is not None:
            lines.append(f"input scale: {self.input_scale:.4g}")
        if self.output_std_after is not None:
            drawn = self.plan is None or any(p.rule != "keep" for p in self.plan.inits.values())
            lines.append(f"output std: {self.output_std_before:.4g} "
                         f"({'after re-init' if drawn else 'weights kept'}) -> "
                         f"{self.output_std_after:.4g} (target {self.target_std}), "
                         f"output scale {self.output_scale:.4g}")
        consts = self.constants_line()
        if consts:
            lines.append(consts)
        if self.result:
            lines.append(self.result_line())
        if self.skipped:
            lines.append("")
            lines.append("NOT APPLIED:")
            for what, why in self.skipped:
                lines.append(f"  {_relabel(what, rename)}: {_relabel(why, rename)}")
        return lines

    def _measured_lines(self) -> list[str]:
        """Balancing, the measured conditioning, other stages' sections, verification, time."""
        lines: list[str] = []
        h = self.conditioning.get("hessian")
        if isinstance(h, dict):  # the line balance.summary_line wrote (counts what was done)
            if h.get("summary"):
                lines.append(h["summary"])
            elif "decision" in h:
                lines.append(f"measured balancing: {h['decision']}")
        m = self.conditioning.get("measure")
        if isinstance(m, dict) and "before" in m:
            where = ("held-out half of the batch" if m["after"].get("held_out", True) else
                     "the batch's one sample, also balanced on: no held-out half")
            lines.append(f"Hessian-block spread, original model {m['before']['spread']:.3g}x, "
                         f"rewritten model {m['after']['spread']:.3g}x ({where})")
        tok = [pi for pi in (self.plan.inits.values() if self.plan is not None else ())
               if pi.rule == "match"]
        if tok and not any(pi.std for pi in tok) and "match" not in self.stage_seconds:
            lines.append("token/position parameters to be drawn at the rms of the layer output "
                         "they join (measured on the sample by precondition): "
                         + ", ".join(pi.name for pi in tok))
        elif tok:
            drawn = [f"{pi.name} ({pi.std:.3g})" for pi in tok if pi.std]
            kept = [pi.name for pi in tok if not pi.std]
            lines.append("token/position parameters drawn at the rms of the layer output they "
                         "join: " + (", ".join(drawn) or "none")
                         + (f"; left as is (not measured): {', '.join(kept)}" if kept else ""))
        sl = self.suggested_lr
        if sl:
            lines.append(f"suggested learning rate: SGD {_rate(sl.get('sgd'))}, Adam "
                         f"{_rate(sl.get('adam'))} ({sl.get('how', '')})")
        for sec in ("lr_scale", "lr_target"):                # what was scaled, and why
            lr = self.conditioning.get(sec)
            if isinstance(lr, dict) and lr.get("summary"):
                lines += [lr[k] for k in ("summary", "decision") if lr.get(k)]
        for i, sec in enumerate(self.conditioning.get("lr_target_copies") or []):
            if isinstance(sec, dict) and sec.get("summary") and \
                    sec != self.conditioning.get("lr_target"):  # copies trained apart
                lines.append(f"copy {i + 1} (its own first step): {sec['summary']}")
        for k, v in self.conditioning.items():
            if k not in ("hessian", "measure", "suggested_lr", "lr_scale", "lr_target",
                         "lr_target_copies") and \
                    isinstance(v, dict) and v:
                brief = ", ".join(f"{a}={b}" for a, b in v.items()
                                  if isinstance(b, (int, float, str)) and len(str(b)) < 40)
                if brief:
                    lines.append(f"{k}: {brief[:200]}")
                notes = v.get("notes")
                if isinstance(notes, list):     # what a stage or scheme says it did or skipped
                    lines += [f"  {k} note: {n}" for n in notes if isinstance(n, str)]
        if self.verification.get("note") and self.verification["note"] not in self.capture_notes:
            lines.append(self.verification["note"])
        if self.stage_seconds:
            st = ", ".join(f"{k} {v:.2f}" for k, v in self.stage_seconds.items() if k != "total")
            tot = self.stage_seconds.get("total")
            lines.append(f"time: {tot:.2f} s ({st})" if tot is not None else f"time: {st}")
        return lines

    @property
    def suggested_lr(self) -> dict[str, Any] | None:
        """``suggest_lr=True``: ``{"sgd": rate, "adam": rate, "sgd_curvature",
        "adam_curvature", "loss", "how"}`` (``conditioning["suggested_lr"]``), else None."""
        return self.conditioning.get("suggested_lr") or None

    def result_line(self) -> str:
        """What the returned model is, and what only its forward sees."""
        r = self.result
        name = r["class"].rpartition(".")[2]
        if not r.get("is_user_class"):
            return f"result: a torch.fx.GraphModule, not your class {name} ({r.get('note')})"
        what = f"result: your class {name}" + (" (also the rewritten torch.fx.GraphModule: "
                                               "report.graph_module)" if r["graph_module"] else "")
        only = r.get("forward_only") or []
        # the graph applies constants around the modules it calls: a submodule called from a
        # script, not from a method of the class, runs without them (docs/concepts.md)
        direct = ("; a submodule you call from your script (model.encoder(x), model[0](x)) "
                  "runs without the constants the graph applies around it: call it from a "
                  "method of your class" if r.get("graph_module") else "")
        if not only:
            return what + "; every method computes with the constants" + direct
        return (what + f"; only its forward applies {len(only)} change(s) (at functional "
                f"sites, or read outside a module call: your other methods, e.g. "
                f"forward_features, run without them): "
                f"{'; '.join(only[:6])}" + (" ..." if len(only) > 6 else "") + direct)

    def constants_line(self) -> str:
        """Every constant the plan set, in one line: alphas by origin and range, residual
        branch scales, input and output scale (per-node values are in the table)."""
        if self.plan is None:
            return ""
        by: dict[str, list[float]] = {}
        layer_of = {lay.node: lay for lay in self.plan.layers}
        for sc in self.plan.scales:
            if sc.tag == "alpha":
                lay = layer_of.get(sc.node)
                src = _alpha_source(lay.alpha_reason if lay else "").strip(" ()") or "analytic"
                if sc.value != 1.0 or src != "analytic":
                    by.setdefault(f"alpha ({src})", []).append(sc.value)
            elif sc.tag not in ("input", "output"):
                by.setdefault({"residual": "s", "shortcut": "w",
                               "beta": "1/beta"}.get(sc.tag, sc.tag),
                              []).append(sc.value)
        parts = []
        for k, vs in by.items():
            lo, hi = min(vs), max(vs)
            rng = f"{lo:.3g}" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g}..{hi:.3g}"
            later = k == "lr" and (self.plan.options or {}).get("lr") not in (None, "auto") \
                and "lr_target" not in self.conditioning
            pending = k == "lr" and (self.conditioning.get("lr_target") or {}).get("pending")
            parts.append(f"{len(vs)} {k} = {rng}" + (" (lr=: precondition sets them from the "
                                                     "measured curvature)" if later else
                                                     " (lr='auto': set at your SGD optimizer's "
                                                     "first step if its rate is above the "
                                                     "suggested one)" if pending else ""))
        if self.input_scale is not None:
            parts.append(f"input scale {self.input_scale:.4g}")
        if self.output_scale is not None:
            parts.append(f"output scale {self.output_scale:.4g}")
        return "constants: " + "; ".join(parts) if parts else "constants: none set"

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        """The JSON form (layout: docs/reference/report.md; ``schema_version``)."""
        from precondfx import __version__
        self.refresh()
        return {
            "schema_version": SCHEMA_VERSION, "precondfx_version": __version__,
            "capture": self.capture, "capture_notes": list(self.capture_notes),
            "counts": self.counts(),
            "nodes": [asdict(r) for r in self.nodes],
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "applied": list(self.applied), "skipped": [list(s) for s in self.skipped],
            "output_std_before": self.output_std_before,
            "output_std_after": self.output_std_after, "target_std": self.target_std,
            "output_scale": self.output_scale, "input_scale": self.input_scale,
            "conditioning": self.conditioning,
            "stage_seconds": self.stage_seconds, "verification": self.verification,
            "planned": self.planned.to_dict() if self.planned is not None else None,
            "measured": self.measured.to_dict(),
            "result": dict(self.result),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Report":
        """Inverse of ``to_dict``; refuses a layout newer than this version reads."""
        from precondfx.errors import PrecondError
        ver = d.get("schema_version")
        if not isinstance(ver, int) or ver > SCHEMA_VERSION:
            raise PrecondError(f"report JSON schema_version {ver!r}: this precondfx reads "
                               f"versions up to {SCHEMA_VERSION} (upgrade precondfx, or the file "
                               f"is not a precondfx report)")
        row_fields = {f.name for f in fields(NodeRow)}
        rows = [NodeRow(**{k: v for k, v in r.items() if k in row_fields}) for r in d["nodes"]]
        plan = Plan.from_dict(d["plan"]) if d.get("plan") is not None else None
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d and f.name not in
              ("nodes", "plan", "skipped", "planned", "measured")}
        planned = Plan.from_dict(d["planned"]) if d.get("planned") is not None else None
        rep = cls(nodes=rows, plan=plan, skipped=[(a, b) for a, b in d.get("skipped", [])],
                  planned=planned, measured=Measured.from_dict(d.get("measured")), **kw)
        return rep

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Report":
        """Read a report written by ``save``."""
        from precondfx.errors import PrecondError
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise PrecondError(f"{os.fspath(path)!r} is not a precondfx report: not JSON "
                                   f"({e}); pass a file written by report.save(path)") from None
        if not isinstance(d, dict):
            raise PrecondError(f"{os.fspath(path)!r} is not a precondfx report (JSON "
                               f"{type(d).__name__}, not an object); pass a file written by "
                               f"report.save(path)")
        return cls.from_dict(d)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def plot(self, path: str) -> list[str]:
        """Write PNG plots of what was measured (per-layer bars before/after to ``path``; the
        Hessian block heat map and the GR/measured histogram beside it when measured).  Needs
        matplotlib and a report from ``precondition(..., measure=True)`` or
        ``balance='hessian'``.  Returns the paths written."""
        from precondfx.core.plots import plot_report
        return plot_report(self.conditioning, path)

    def save(self, path: str | os.PathLike) -> None:
        """Write the JSON report (atomically: a temporary file moved into place)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            from precondfx.errors import PrecondError
            raise PrecondError(f"{path} is a folder: give the report a file name "
                               f"(e.g. {os.path.join(path, 'report.json')})")
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                f.write(self.to_json())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def _rate(v: Any) -> str:
    if not isinstance(v, (int, float)) or v <= 0:
        return "-"
    return f"{v:.3g} (2^{math.log2(v):.1f})"

