"""What TAT/DKS write into the plan besides the replacements: the normalized-sum constants at the
joins (spec §3.2) and the orthogonal / Delta-orthogonal weight inits (spec §2.9)."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from precondfx.core.graph import Graph, Node
from precondfx.core.options import Options
from precondfx.core.plan import ParamInfo, ParamInit, Plan, Scale
from precondfx.schemes.tat.analysis import Analysis


def plan_joins(scheme: str, plan: Plan, an: Analysis) -> int:
    """Plan the multipliers of every normalized sum (scales tagged ``shortcut`` and
    ``residual``) and say what each join does; returns the number of sums."""
    nsum = 0
    for j in an.joins:
        if j.kind == "concat":
            plan.reasons[j.node] = (f"{scheme}: concatenation, channel-weighted average "
                                    f"of its branches' C maps (weights {j.weights})")
            continue
        nsum += 1
        for pos, (idx, w) in enumerate(zip(j.indices, j.weights)):
            tag = "shortcut" if pos == j.shortcut else "residual"
            why = (f"{scheme}: normalized sum, operand {idx} "
                   + (f"(shortcut, {j.affine_counts[pos]} weighted layers) times w="
                      f"{w:.4g}" if tag == "shortcut" else f"times {w:.4g}")
                   + " so that the sum of squared weights is 1 (spec §3.2)")
            plan.scales.append(Scale(tag, j.node, "operand", idx, w, why))
        plan.reasons[j.node] = (f"{scheme}: normalized sum from fork {j.fork}: weights "
                                f"{[round(w, 4) for w in j.weights]} (affine layers per "
                                f"operand {j.affine_counts})")
    return nsum


def plan_inits(scheme: str, graph: Graph, plan: Plan, params: dict[str, ParamInfo],
               opts: Options, notes: list[str], delta: bool, redraw: set[str],
               an: Analysis | None, trelu: bool) -> None:
    """Every weighted layer's init becomes (Delta-)orthogonal; the weights the scheme step
    draws itself are added to ``redraw``; biases and PReLU slopes get their reasons."""
    if not opts.reinit:
        notes.append("reinit=False: weights kept; the kernel analysis assumes orthogonal "
                     "(Delta) initialization (spec §2.9)")
        return
    kept: dict[str, str] = {}
    for lay in plan.layers:
        w = lay.weight
        pi = plan.inits.get(w or "")
        if w and pi is not None and pi.rule in ("keep", "scale"):
            kept.setdefault(w, pi.reason)
        if not w or pi is None or pi.rule in ("keep", "scale") or w not in params:
            continue
        _plan_orthogonal(scheme, graph, plan, params, opts, notes, delta, redraw, lay)
    in_plan = {lay.node for lay in plan.layers}
    for n in graph:
        if n.status == "weighted" and n.name not in in_plan:
            kept.setdefault(n.name, "its weight is not a plain parameter of the plan "
                            "(parametrized, e.g. weight_norm): not re-drawn")
    if kept:
        by_why: dict[str, list[str]] = {}
        for w, why in kept.items():
            by_why.setdefault(why, []).append(w)
        notes.append(f"{len(kept)} weighted layer(s) kept as they are, not drawn orthogonal: "
                     + "; ".join(f"{', '.join(ws[:4])}{' ...' if len(ws) > 4 else ''} ({why})"
                                 for why, ws in by_why.items())
                     + ": the kernel analysis assumes orthogonal (Delta) initialization there "
                     "(spec §2.9)")
    for v in (an.activations if an else []):
        n = graph[v]
        w = n.params.get("weight")
        if w and w in plan.inits and trelu:
            plan.inits[w] = replace(plan.inits[w], reason=f"{scheme}: PReLU slope starts "
                                    f"at the TAT negative slope (set by the replacement "
                                    f"module, spec §3.3)")


def _plan_orthogonal(scheme: str, graph: Graph, plan: Plan, params: dict[str, ParamInfo],
                     opts: Options, notes: list[str], delta: bool, redraw: set[str],
                     lay: Any) -> None:
    """The orthogonal init of one layer's weight (and its bias's reason)."""
    w = lay.weight
    shape = params[w].shape
    n = graph.get(lay.node)
    conv = lay.kind in ("conv", "conv_transpose")
    odd = conv and len(shape) >= 3 and all(int(k) % 2 == 1 for k in shape[2:])
    use_delta = conv and delta and odd
    cout, cin = _out_in(lay.kind, shape, n, use_delta, lay)
    gain = max(math.sqrt(cout / max(cin, 1)), 1.0)
    how = ("Delta-orthogonal: centre tap a scaled uniform orthogonal matrix, other taps "
           "zero" if use_delta else "scaled uniform orthogonal"
           + (" over the flattened kernel" if conv else ""))
    if conv and not odd:
        notes.append(f"{lay.node}: even kernel {list(shape[2:])}, no Delta init "
                     f"possible; scaled orthogonal over the flattened kernel instead")
    drawn_here = use_delta or lay.kind == "conv_transpose"
    if drawn_here:
        redraw.add(w)
    plan.inits[w] = ParamInit(w, "orthogonal", gain,
                              f"{scheme}: {how} (gain max(sqrt(out/in), 1) = "
                              f"{gain:.4g}), "
                              + (f"drawn in the scheme step from seed {opts.seed}"
                                 if drawn_here else "Haar orthogonal by QR with sign fix")
                              + " (spec §2.9)", list(shape))
    if lay.bias and lay.bias in plan.inits and plan.inits[lay.bias].rule != "keep":
        plan.inits[lay.bias] = replace(plan.inits[lay.bias], reason=f"{scheme}: "
                                       f"biases start at zero (spec §2.9)")


def _out_in(kind: str, shape: tuple, n: Node | None, delta: bool, lay: Any) -> tuple[int, int]:
    """(out, in) of the matrix the orthogonal draw acts on (Delta: channel counts only)."""
    g = int((n.attrs.get("groups", 1) if n is not None else 1) or 1)
    if kind == "conv_transpose" and len(shape) >= 3:
        return int(shape[1]), int(shape[0]) // g * (1 if delta else math.prod(shape[2:]))
    if kind == "conv" and len(shape) >= 3:
        return int(shape[0]) // g, int(shape[1]) * (1 if delta else math.prod(shape[2:]))
    if kind == "matmul" and len(shape) == 2 and n is not None and \
            n.attrs.get("weight_side", "right") == "right":
        return int(shape[1]), int(shape[0])
    if len(shape) >= 2:
        return int(shape[0]), int(math.prod(shape[1:]))
    return lay.n_out, lay.n_in * lay.k2
