"""What the data-driven stages set after the plan was applied, kept apart from the plan.

The plan (``precondfx.core.plan``) states intent and is complete before it is applied; calibration
(the output scale), measured balancing, LSUV and TAT then measure the model and set constants
and weights from what they measure.  Each such change is a :class:`Change` in one
:class:`Measured` record (``report.measured``): which stage, which entry of the plan (a scale by
``precondfx.core.backend.key_of``, a layer's alpha by node, a parameter's std by name, a pool by
node), the new value or factor, and the words it adds to the entry's reason.
``Measured.final(plan)`` replays them on a copy of the plan: the values the model holds
(``report.plan``; the intent stays in ``report.planned``).
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

from precondfx.core.plan import Plan

KINDS = ("scale", "alpha", "std", "pool")
OPS = ("set", "mul", "div")


@dataclass
class Change:
    """One value a stage set after the plan was applied."""

    stage: str                   # calibrate | balance | lsuv | tat | apply
    kind: str                    # scale | alpha | std | pool (see KINDS)
    key: str                     # scale key, layer node, parameter name, pool node
    value: float | str | None    # new value, or the factor (op 'mul'/'div'); a pool's action
    op: str = "set"              # set | mul | div
    reason: str | None = None    # replaces the entry's reason
    note: str | None = None      # appended to the entry's reason ("; " + note)

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.op not in OPS:
            raise ValueError(f"Change({self.kind!r}, op={self.op!r})")


def _value(old: float | None, ch: Change) -> float | str | None:
    if ch.op == "set" or old is None:
        return ch.value if ch.op == "set" else old
    return old * ch.value if ch.op == "mul" else old / ch.value


def _reason(old: str, ch: Change) -> str:
    if ch.reason is not None:
        return ch.reason
    if ch.note is not None:
        return f"{old}; {ch.note}" if old else ch.note
    return old


@dataclass
class Measured:
    """Every change the data-driven stages made, in order."""

    changes: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)     # added to the plan's notes

    def add(self, stage: str, kind: str, key: str, value: float | str | None, *,
            op: str = "set", reason: str | None = None, note: str | None = None) -> None:
        self.changes.append(Change(stage, kind, key, value, op, reason, note))

    def of(self, stage: str) -> list[Change]:
        return [c for c in self.changes if c.stage == stage]

    def record_diff(self, stage: str, before: Plan, after: Plan) -> None:
        """Record as changes of ``stage`` how ``after`` (a copy of ``final(plan)`` a step
        edited) differs from ``before`` (that copy as it was): alphas, scale values, stds, pool
        actions, their reasons, and notes added."""
        old_sc = {sc.key(): sc for sc in before.scales}
        for sc in after.scales:
            o = old_sc.get(sc.key())
            if o is not None and (o.value, o.reason) != (sc.value, sc.reason):
                self.add(stage, "scale", sc.key(), sc.value, reason=sc.reason)
        old_lay = {lay.node: lay for lay in before.layers}
        for lay in after.layers:
            o = old_lay.get(lay.node)
            if o is not None and (o.alpha, o.alpha_reason) != (lay.alpha, lay.alpha_reason):
                self.add(stage, "alpha", lay.node, lay.alpha, reason=lay.alpha_reason)
        for name, pi in after.inits.items():
            o = before.inits.get(name)
            if o is not None and (o.std, o.reason) != (pi.std, pi.reason):
                self.add(stage, "std", name, pi.std, reason=pi.reason)
        old_pool = {pc.node: pc for pc in before.pools}
        for pc in after.pools:
            o = old_pool.get(pc.node)
            if o is not None and (o.action, o.reason) != (pc.action, pc.reason):
                self.add(stage, "pool", pc.node, pc.action, reason=pc.reason)
        self.notes.extend(after.notes[len(before.notes):])

    def final(self, plan: Plan) -> Plan:
        """A copy of ``plan`` with every change applied: what the model now holds."""
        out = copy.deepcopy(plan)
        scales = {sc.key(): sc for sc in out.scales}
        layers = {lay.node: lay for lay in out.layers}
        pools = {pc.node: pc for pc in out.pools}
        for ch in self.changes:
            if ch.kind == "scale" and ch.key in scales:
                sc = scales[ch.key]
                sc.value, sc.reason = _value(sc.value, ch), _reason(sc.reason, ch)
            elif ch.kind == "alpha" and ch.key in layers:
                lay = layers[ch.key]
                lay.alpha, lay.alpha_reason = _value(lay.alpha, ch), _reason(lay.alpha_reason, ch)
            elif ch.kind == "std" and ch.key in out.inits:
                pi = out.inits[ch.key]
                pi.std, pi.reason = _value(pi.std, ch), _reason(pi.reason, ch)
            elif ch.kind == "pool" and ch.key in pools:
                pc = pools[ch.key]
                pc.action, pc.reason = str(ch.value), _reason(pc.reason, ch)
        out.notes.extend(self.notes)
        return out

    def to_dict(self) -> dict:
        return {"changes": [asdict(c) for c in self.changes], "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: dict | None) -> "Measured":
        d = d or {}
        return cls([Change(**c) for c in d.get("changes", [])], list(d.get("notes", [])))
