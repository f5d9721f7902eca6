"""Compare plans of one architecture at two sizes: what the rules say must not depend on width.

Widths change fans, init standard deviations, shapes and pool geometry; they must not change
which node is what, the alphas, the residual branch scales, the scale sites or the pool actions.
:func:`width_invariant` keeps exactly those, so two plans can be compared with ``==``.
"""
from __future__ import annotations

from typing import Any, Iterable

from precondfx.core.plan import Plan


def width_invariant(plan: Plan, nodes: Iterable[Any] | None = None) -> dict[str, Any]:
    """The width-independent part of a plan, and of the classified nodes when given (a
    ``Graph`` or ``report.nodes``; structural nodes, which only move elements, are left out)."""
    out: dict[str, Any] = {
        "layers": [(la.node, la.kind, la.module, la.weight, la.bias, la.alpha,
                    la.in_residual_branch) for la in plan.layers],
        "inits": {k: pi.rule for k, pi in plan.inits.items()},
        "scales": [(s.tag, s.node, s.where, s.index, s.value) for s in plan.scales],
        "residuals": [(r.node, r.branch_index, r.fork, tuple(r.branch_layers), r.s)
                      for r in plan.residuals],
        "pools": [(p.node, p.action, p.into) for p in plan.pools],
    }
    if nodes is not None:
        out["nodes"] = [(n.name, n.kind, n.status) for n in nodes if n.status != "structural"]
    return out


def differences(a: dict[str, Any], b: dict[str, Any], limit: int = 5) -> list[str]:
    """Human-readable differences between two :func:`width_invariant` results."""
    diffs: list[str] = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if va == vb:
            continue
        if isinstance(va, list) and isinstance(vb, list):
            if len(va) != len(vb):
                diffs.append(f"{key}: {len(va)} vs {len(vb)} entries")
            diffs += [f"{key}: {x} vs {y}" for x, y in zip(va, vb) if x != y][:limit]
        elif isinstance(va, dict) and isinstance(vb, dict):
            diffs += [f"{key}[{k}]: {va.get(k)} vs {vb.get(k)}"
                      for k in sorted(set(va) | set(vb)) if va.get(k) != vb.get(k)][:limit]
        else:
            diffs.append(f"{key}: differs")
    return diffs
