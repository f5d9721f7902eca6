"""The TAT/DKS scheme step (after the rewrite, on the calibration batch): check that every
replacement and normalized-sum constant is in place, draw the Delta-orthogonal weights, apply
the input-normalization option, and measure q at every activation as a self-check."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from precondfx.core.graph import Node
from precondfx.core.scheme import SchemeContext
from precondfx.errors import PrecondError
from precondfx.schemes.tat.analysis import Analysis, Join
from precondfx.schemes.tat.orthogonal import delta_orthogonal_, orthogonal_
from precondfx.schemes.tat.pln import insert_pln


def check_replacements(scheme: str, ctx: SchemeContext,
                       repl: list[tuple[str, nn.Module, str]]) -> None:
    """Every planned activation replacement must be in place; the new modules move to the
    model's device and dtype."""
    missing = ctx.unreplaced(repl)
    if missing:
        raise PrecondError(
            f"scheme={scheme!r}: the activations {missing[:8]} could not be replaced "
            f"(capture '{ctx.graph.method}': functional calls can only be rewritten in a "
            f"graph torch.fx captures, with inplace=False). A partly transformed network "
            f"does not have the solved C map: use nn.Module activations (e.g. nn.ReLU) or "
            f"make the model fx-traceable")
    ref = next(iter(ctx.model.parameters()), None)
    if ref is not None:
        for _, mod, _ in repl:
            mod.to(device=ref.device)
            if ref.is_floating_point():
                for p in mod.parameters():
                    p.data = p.data.to(ref.dtype)


def check_sums(scheme: str, trelu: bool, an: Analysis, ctx: SchemeContext,
               notes: list[str]) -> None:
    """Every normalized-sum constant must be in place (the back end's outcome for each
    planned scale says); in the eager back end a shortcut operand usually has no module of
    its own to hook: a TReLU network (positively homogeneous, zero biases) is then fixed
    exactly by putting w' = sqrt(1-w^2)/w on the branch's constant alone (the sum is the
    normalized one times 1/w), recorded in ``ctx.measured``."""
    be = ctx.applier
    bad = []
    for j in an.joins:
        if j.kind != "sum":
            continue
        keys = [f"{'shortcut' if pos == j.shortcut else 'residual'}:{j.node}:operand:{idx}"
                for pos, idx in enumerate(j.indices)]
        miss = [pos for pos, k in enumerate(keys) if be.missed(k)]
        if not miss:
            continue
        w = j.weights[j.shortcut] if j.shortcut is not None else 0.0
        fixed = False
        if trelu and j.shortcut is not None and miss == [j.shortcut] and w > 0:
            fixed = _branch_only(scheme, ctx, j, keys, w, notes)
        if not fixed:
            bad.append(j.node)
    if bad:
        raise PrecondError(
            f"scheme={scheme!r}: the normalized-sum constants could not be placed at the "
            f"joins {bad[:8]} (capture '{ctx.graph.method}': an operand produced by a "
            f"functional op or shared by several users has no module to hook). TAT/DKS need "
            f"w*x + sqrt(1-w^2)*F(x) at every join: use inplace=False on a model torch.fx "
            f"can trace, or write the joins as normalized sums yourself")


def _branch_only(scheme: str, ctx: SchemeContext, j: Join, keys: list[str], w: float,
                 notes: list[str]) -> bool:
    """Put sqrt(1-w^2)/w on the branch of a sum whose shortcut constant is missing; False when
    the branch's constant was not placed either."""
    be = ctx.applier
    assert j.shortcut is not None
    bpos = 1 - j.shortcut
    name = be.placed(keys[bpos])
    if name is None:
        return False
    value = j.weights[bpos] / w
    be.set_constant(name, value)
    ctx.measured.add(scheme, "scale", keys[bpos], value,
                     note="times 1/w: the shortcut operand has no module to "
                          "hook")
    be.made_good(keys[j.shortcut], f"{scheme}: {j.node}: branch multiplier "
                 f"sqrt(1-w^2)/w = {value:.4g} (shortcut operand has no module "
                 f"to hook)")
    notes.append(f"{j.node}: shortcut multiplier could not be placed (capture "
                 f"{ctx.graph.method}); the branch carries "
                 f"sqrt(1-w^2)/w = {j.weights[bpos] / w:.4g} instead (exact "
                 f"for a TReLU network up to a scalar)")
    return True


def draw_weights(ctx: SchemeContext, redraw: set[str], delta: bool) -> str:
    """Draw the weights the plan left to the scheme step (Delta-orthogonal, transposed
    convolutions) from a generator seeded from ``seed``; returns what was drawn."""
    if not ctx.opts.reinit:
        return "kept (reinit=False)"
    gen = torch.Generator().manual_seed(int(ctx.opts.seed))
    named = dict(ctx.model.named_parameters(remove_duplicate=False))
    done: set[str] = set()
    kinds: dict[str, int] = {}
    for lay in ctx.plan.layers:
        w = lay.weight
        pi = ctx.plan.inits.get(w or "")
        if not w or pi is None or pi.rule != "orthogonal" or w in done or w not in named:
            continue
        done.add(w)
        if w not in redraw:  # re-initialization drew it: scaled uniform orthogonal
            kinds["orthogonal"] = kinds.get("orthogonal", 0) + 1
            continue
        how = _init_affine(named[w], lay.kind, ctx.graph.get(lay.node), gen, delta)
        kinds[how] = kinds.get(how, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in kinds.items()) or "no weighted layer"


def _init_affine(p: torch.Tensor, kind: str, n: Node | None, gen: torch.Generator,
                 delta: bool) -> str:
    """Draw one weight in place: SUO (Linear, matmul), Delta-orthogonal (odd-kernel conv)."""
    with torch.no_grad():
        if kind in ("conv", "conv_transpose") and p.dim() >= 3:
            return _init_conv(p, kind, n, gen, delta)
        if kind == "matmul" and p.dim() == 2 and n is not None and \
                n.attrs.get("weight_side", "right") == "right":
            tmp = torch.empty(p.shape[1], p.shape[0], dtype=torch.float64)
            orthogonal_(tmp, generator=gen)
            p.copy_(tmp.T.to(p.dtype))
            return "orthogonal"
        if p.dim() >= 2:
            orthogonal_(p, generator=gen)
            return "orthogonal"
        return "kept (1-d weight)"


def _init_conv(p: torch.Tensor, kind: str, n: Node | None, gen: torch.Generator,
               delta: bool) -> str:
    """A (transposed) convolution's weight: Delta-orthogonal for odd kernels, else orthogonal
    over the flattened kernel."""
    ks = tuple(p.shape[2:])
    odd = all(k % 2 == 1 for k in ks)
    groups = int((n.attrs.get("groups", 1) if n is not None and n.kind == kind else 1)
                 or 1)
    if kind == "conv_transpose":
        tmp = torch.empty((p.shape[1] * groups, p.shape[0] // groups) + ks,
                          dtype=torch.float64)
        if delta and odd:
            delta_orthogonal_(tmp, groups=groups, generator=gen)
        else:
            orthogonal_(tmp, generator=gen)
        # (out, in/g, k) per group -> (in, out/g, k)
        og = p.shape[1]
        blocks = [tmp[i * og:(i + 1) * og].transpose(0, 1) for i in range(groups)]
        p.copy_(torch.cat(blocks, 0).to(p.dtype))
        return "delta-orthogonal (transposed)" if delta and odd else "orthogonal"
    if delta and odd:
        delta_orthogonal_(p, groups=groups, generator=gen)
        return "delta-orthogonal"
    orthogonal_(p, generator=gen)
    return "orthogonal (flattened kernel)"


def input_norm(ctx: SchemeContext, mode: str, trelu: bool, notes: list[str]) -> dict[str, Any]:
    """The ``input_norm`` option on the sample's first floating-point input (spec §2.1)."""
    floats = [t for t in ctx.sample.tensors() if t.is_floating_point()]
    if not floats:
        return {"mode": "off", "reason": "no floating-point input"}
    x = floats[0].detach().double()
    cdim = 1 if x.dim() >= 2 else 0
    q = x.pow(2).mean(dim=cdim) if x.dim() >= 2 else x.pow(2).mean().reshape(1)
    stats = {"q_mean": float(q.mean()), "q_min": float(q.min()), "q_max": float(q.max()),
             "zero_locations": float((q == 0).double().mean())}
    if mode == "auto":
        mode = "check" if trelu else "scale"
    res: dict[str, Any] = {"mode": mode, "sample": stats}
    if mode in ("scale", "pln") and ctx.opts.input_scale is not None:
        notes.append(f"input_norm={mode!r} not applied: input_scale was given")
        res["mode"] = "check"
        return res
    if mode == "scale":
        _scale_input(ctx, stats, res, notes)
    elif mode == "pln":
        _pln_input(ctx, x, cdim, stats, res, notes)
    elif mode == "check":
        if abs(stats["q_mean"] - 1.0) > 0.1 or stats["zero_locations"] > 0:
            notes.append(f"input q per location is {stats['q_mean']:.3g} on average "
                         f"({stats['zero_locations']:.1%} zero locations); TAT assumes q = 1 "
                         f"(spec §2.1): preprocess with "
                         f"precondfx.schemes.tat.per_location_normalize"
                         + (" (TReLU networks are positively homogeneous, so only zero "
                            "locations matter)" if trelu else ""))
    return res


def _scale_input(ctx: SchemeContext, stats: dict[str, float], res: dict[str, Any],
                 notes: list[str]) -> None:
    """input_norm='scale': one fixed input scale giving the sample mean q = 1."""
    if stats["q_mean"] <= 0:
        raise PrecondError("input_norm='scale': the sample's inputs are all zero")
    value = 1.0 / math.sqrt(stats["q_mean"])
    ctx.applier.input_scale(value)
    ctx.applier.finish()
    res["scale"] = value
    notes.append(f"input scaled by {value:.4g} so that the sample's mean q per location "
                 f"is 1 (spec §2.1; per-location normalization is "
                 f"precondfx.schemes.tat.per_location_normalize)")


def _pln_input(ctx: SchemeContext, x: torch.Tensor, cdim: int, stats: dict[str, float],
               res: dict[str, Any], notes: list[str]) -> None:
    """input_norm='pln': a PerLocationNorm module at the input."""
    if x.dim() >= 2 and x.shape[cdim] < 2:
        raise PrecondError("input_norm='pln' on a single-channel input would map every "
                           "location to its sign: preprocess the data with "
                           "precondfx.schemes.tat.per_location_normalize (which adds a "
                           "homogeneous channel) and build the model for one more "
                           "input channel, or use input_norm='scale'")
    insert_pln(ctx, cdim if x.dim() >= 3 else -1)
    res["module"] = "precondfx_pln"
    notes.append("PerLocationNorm inserted at the input (no homogeneous coordinate)")
    if stats["zero_locations"] > 0:
        notes.append(f"{stats['zero_locations']:.1%} of the sample's locations are all "
                     f"zero: PLN leaves them at zero (spec §2.10: add a homogeneous "
                     f"coordinate with per_location_normalize)")


def q_check(ctx: SchemeContext, an: Analysis) -> dict[str, Any]:
    """The measured second moment q at every activation on the calibration batch."""
    try:
        got = ctx.outputs(list(an.activations))
    except Exception as e:  # the self-check must never break the pass
        return {"error": f"{type(e).__name__}: {e}"}
    named = {k: float(t.detach().double().pow(2).mean()) for k, t in got.items()
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()}
    qs = list(named.values())
    if not qs:
        return {}
    out: dict[str, Any] = {"measured": len(qs), "min": min(qs), "max": max(qs),
                           "first": qs[0], "last": qs[-1]}
    lo, hi = Q_RANGE
    off = {k: q for k, q in named.items() if not lo <= q <= hi}
    if off:
        out["off_target"] = off
    return out


#: measured q at an activation outside this range is reported as off the theory's q = 1 (spec
#: §3.4: "empirical q at each NONLINEAR output should be ~1"); finite width alone moves it by
#: tens of percent on deep narrow nets
Q_RANGE = (0.5, 2.0)
