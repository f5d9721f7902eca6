"""The report: what precondfx found, what it changed, and how the result measures up.

Every node of the captured graph appears with its status, its reason and the actions taken on
it; the report prints as a table, serializes to JSON, and says which capture method was used,
why earlier ones failed, and what could not be applied.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from precondfx.graph import Graph
from precondfx.plan import Plan


@dataclass
class NodeRow:
    """One line of the report."""

    name: str
    kind: str
    status: str
    reason: str
    target: str
    module: str | None
    out_shape: list[int] | None
    actions: list[str] = field(default_factory=list)


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

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_graph(cls, graph: Graph, plan: Plan | None = None) -> "Report":
        acts: dict[str, list[str]] = {}
        if plan is not None:
            for pc in plan.pools:
                acts.setdefault(pc.node, []).append(
                    {"fold": f"folded into {pc.into}", "conv": "-> strided conv",
                     "avgpool": "-> avg pool", "keep": "kept"}[pc.action])
            for lay in plan.layers:
                pi = plan.inits.get(lay.weight or "")
                if pi is not None and pi.rule not in ("keep", "scale"):
                    acts.setdefault(lay.node, []).append(f"{pi.rule} std={pi.std:.3g}")
                elif pi is not None:
                    acts.setdefault(lay.node, []).append(f"weights {pi.rule}")
            for sc in plan.scales:
                if sc.tag in ("alpha", "residual", "shortcut") and sc.value != 1.0:
                    name = {"alpha": "alpha", "residual": "s", "shortcut": "w"}[sc.tag]
                    acts.setdefault(sc.node, []).append(f"{name}={sc.value:.3g}")
        rows = [NodeRow(n.name, n.kind, n.status, n.reason, n.target, n.module,
                        list(n.out_shape) if n.out_shape else None, acts.get(n.name, []))
                for n in graph]
        return cls(graph.method, list(graph.notes), rows, plan)

    # -- summaries ---------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Number of nodes per status."""
        out: dict[str, int] = {}
        for r in self.nodes:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    def rows(self, status: str | None = None) -> list[NodeRow]:
        return [r for r in self.nodes if status is None or r.status == status]

    def table(self, width: int = 150, all_nodes: bool = False) -> str:
        """A fixed-width table; structural nodes are folded into a count unless ``all_nodes``."""
        lines = [f"precondfx report  (capture: {self.capture})"]
        for note in self.capture_notes:
            lines.append(f"  note: {note}")
        c = self.counts()
        lines.append("  nodes: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
        hdr = f"{'node':26} {'kind':14} {'status':10} {'change':34} reason"
        lines += ["", hdr, "-" * width]
        for r in self.nodes:
            if not all_nodes and r.status == "structural" and not r.actions:
                continue
            act = ", ".join(r.actions)
            act = act if len(act) <= 34 else act[:31] + "..."
            room = max(20, width - 88)
            reason = r.reason if len(r.reason) <= room else r.reason[: room - 3] + "..."
            lines.append(f"{r.name[:26]:26} {r.kind[:14]:14} {r.status:10} {act:34} {reason}")
        hidden = sum(1 for r in self.nodes if r.status == "structural" and not r.actions)
        if hidden and not all_nodes:
            lines.append(f"({hidden} structural nodes not shown: report.table(all_nodes=True))")
        if self.plan is not None:
            nre = sum(1 for p in self.plan.inits.values() if p.rule != "keep")
            nkeep = sum(1 for p in self.plan.inits.values() if p.rule == "keep")
            lines += ["", f"parameters: {nre} re-initialized, {nkeep} kept"]
            for p in self.plan.inits.values():
                if p.rule == "keep":
                    lines.append(f"  kept {p.name}: {p.reason}")
        if self.input_scale is not None:
            lines.append(f"input scale: {self.input_scale:.4g}")
        if self.output_std_after is not None:
            lines.append(f"output std: {self.output_std_before:.4g} (after re-init) -> "
                         f"{self.output_std_after:.4g} (target {self.target_std}), "
                         f"output scale {self.output_scale:.4g}")
        if self.skipped:
            lines.append("")
            lines.append("NOT APPLIED:")
            for what, why in self.skipped:
                lines.append(f"  {what}: {why}")
        h = self.conditioning.get("hessian")
        if isinstance(h, dict):  # the line balance.summary_line wrote (counts what was done)
            if h.get("summary"):
                lines.append(h["summary"])
            elif "decision" in h:
                lines.append(f"measured balancing: {h['decision']}")
        m = self.conditioning.get("measure")
        if isinstance(m, dict) and "before" in m:
            lines.append(f"Hessian-block spread, original model {m['before']['spread']:.3g}x, "
                         f"rewritten model {m['after']['spread']:.3g}x (held-out half of the "
                         f"batch)")
        for k, v in self.conditioning.items():
            if k not in ("hessian", "measure") and isinstance(v, dict) and v:
                brief = ", ".join(f"{a}={b}" for a, b in v.items()
                                  if isinstance(b, (int, float, str)) and len(str(b)) < 40)
                if brief:
                    lines.append(f"{k}: {brief[:200]}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        d = {
            "capture": self.capture, "capture_notes": self.capture_notes,
            "counts": self.counts(),
            "nodes": [asdict(r) for r in self.nodes],
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "applied": self.applied, "skipped": [list(s) for s in self.skipped],
            "output_std_before": self.output_std_before,
            "output_std_after": self.output_std_after, "target_std": self.target_std,
            "output_scale": self.output_scale, "input_scale": self.input_scale,
            "conditioning": self.conditioning,
            "stage_seconds": self.stage_seconds, "verification": self.verification,
        }
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def plot(self, path: str) -> list[str]:
        """Write PNG plots of what was measured (per-layer bars before/after to ``path``; the
        Hessian block heat map and the GR/measured histogram beside it when measured).  Needs
        matplotlib and a report from ``precondition(..., measure=True)`` or
        ``balance='hessian'``.  Returns the paths written."""
        from precondfx.verify import plot_report
        return plot_report(self.conditioning, path)

    def save(self, path: str) -> None:
        """Write the JSON report."""
        with open(path, "w") as f:
            f.write(self.to_json())
