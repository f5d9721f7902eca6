"""The output and input scales' arithmetic, the same for every back end.

A back end measures (the output's std on the calibration batch, the inputs as arrays); these
functions turn the measurements into the scale the plan's constant takes (Sec. 6.3, 6.4), or
refuse with what to do.
"""
from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from precondfx.errors import PrecondError


def mask_named(name: str | None) -> bool:
    """Whether an input's name says it is a mask (``attention_mask``, ``keyPaddingMask``,
    ``masks``; not ``masked_image``): one rule for every back end.  Calibration fills such an
    input with ones when no data is given, and the input scale leaves it alone (``keep * 0.1
    < 0.5`` masks everything)."""
    words = re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name or "").lower())
    return any(w.endswith(("mask", "masks")) for w in words)


#: how a back end says a graph input's value is used (:func:`mask_by_use`): read as a
#: condition (a ``where`` condition, ``not``, cast to bool, ``1 - m``, ``masked_fill``'s
#: mask); carried on (a broadcast, a reshape, a dtype cast: follow its outputs); a count
#: (``m.sum(1)``, a masked mean's divisor); compared with a constant (``m < 0.5``);
#: multiplied into a value computed from other inputs (``scores * m``); anything else: data
CONDITION, CARRY, COUNT, TEST, GATE, DATA = "condition", "carry", "count", "test", "gate", \
    "data"


def mask_by_use(root: Any, uses: Any, gates: bool = True) -> str | None:
    """Why a graph input reads as a mask by its uses, or None: one rule for every back end,
    which says how each use reads a value (``uses(value)`` yields ``(key, role, why,
    outputs)``: a hashable key of the using node, one of :data:`CONDITION`, :data:`CARRY`,
    :data:`COUNT`, :data:`TEST`, :data:`GATE`, :data:`DATA`, the words for the report, and
    for :data:`CARRY` the values to follow).  A mask when one use, through carriers, reads
    it as a condition; or when every use is a test, a gate or a count, at least one of the
    first two.  Calibration fills such an input with ones when no data is given, and the
    input scale leaves it alone (``m * 0.1 < 0.5`` masks everything).  ``gates=False``: a
    product counts as data (``x * sigmoid(g(c))`` gates data as ``scores * m`` masks it; a
    back end that is given the data itself trusts conditions and comparisons only)."""
    used: list[str] = []
    data = False
    seen: set[Any] = set()

    def walk(x: Any) -> str | None:
        nonlocal data
        for key, role, why, outs in uses(x):
            if key in seen:
                continue
            seen.add(key)
            if role == CONDITION:
                return why
            if role == CARRY:
                for o in outs:
                    found = walk(o)
                    if found:
                        return found
            elif role == TEST or role == GATE and gates:
                used.append(why)
            elif role in (DATA, GATE):
                data = True
        return None

    why = walk(root)
    if why or data or not used:
        return why
    more = f" and {len(used) - 1} more use(s)" if len(used) > 1 else ""
    return f"read as a mask by all its uses, sums aside: {used[0]}{more}"


#: the op names (the neutral graph's: the target's last word, underscores stripped, ``aten.lt``,
#: ``TensorBase.__lt__``; fx's method names) that carry a mask on (operand 0), count it, or
#: compare it
_CARRIES = {"unsqueeze", "view", "reshape", "expand", "expand_as", "squeeze", "flatten", "float",
            "half", "double", "to", "type", "type_as", "contiguous", "to_copy", "clone",
            "getitem", "slice", "select", "alias"}
COUNT_OPS = {"sum", "mean"}
TEST_OPS = {"lt", "gt", "le", "ge", "eq", "ne"}
_NOTS = {"logical_not", "bitwise_not", "invert", "bool"}


def _graph_role(node: Any, x: str) -> tuple[Any, str, str, list]:
    """How neutral-graph ``node`` reads the value of node ``x``, for :func:`mask_by_use`."""
    t = str(node.target).rsplit(".", 1)[-1].strip("_")
    idx = node.inputs.index(x)
    what = f"{t} node {node.name!r}"
    if t == "where" and idx == 0 or t in _NOTS or t.startswith("masked_fill") and idx == 1 \
            or t == "rsub" and len(node.inputs) == 1:
        return node.name, CONDITION, f"{what} reads it as a condition", []
    if t in _CARRIES and idx == 0:
        return node.name, CARRY, "", [node.name]
    if t in COUNT_OPS and idx == 0:
        return node.name, COUNT, "", []
    if t in TEST_OPS and len(node.inputs) == 1 and node.const_operands:
        return node.name, TEST, f"{what} compares it with a constant", []
    return node.name, DATA, "", []


def graph_mask_use(g: Any, name: str) -> str | None:
    """Why input node ``name`` of a neutral ``core.graph.Graph`` (the export and eager
    captures') reads as a mask by its uses, or None: :func:`mask_by_use` with the rule the
    fx back end applies (a condition, or only comparisons with a constant and sums; a
    product is data)."""
    users = g.users()
    return mask_by_use(name, lambda x: (_graph_role(g[u], x) for u in users.get(x, [])),
                       gates=False)


def is_additive_mask(a: np.ndarray) -> bool:
    """A float array used as an additive attention mask or bias: ``-inf`` where masked, finite
    values <= 0 elsewhere (``nn.Transformer.generate_square_subsequent_mask``, ALiBi-style
    biases).  Its ``-inf`` entries are meaningful, not bad data; NaN and ``+inf`` never are."""
    a = np.asarray(a)
    if a.dtype.kind != "f" or bool(np.isnan(a).any()):
        return False
    fin = np.isfinite(a)
    return bool((a[~fin] < 0).all()) and bool((a[fin] <= 0).all())


def masked_std(a: Any) -> tuple[float, int]:
    """The output std calibration reads, and how many entries it left out: over every element
    (float64, population std), or, when the only non-finite values are ``-inf`` (masked
    logits or attention scores: ``logits.masked_fill(~legal, -inf)``), over the finite ones,
    which the output scale multiplies (``-inf`` times a positive scale stays ``-inf``).  NaN
    when a value is NaN or ``+inf``, or fewer than two entries are finite."""
    a = np.asarray(a, dtype=np.float64)
    fin = np.isfinite(a)
    if bool(fin.all()):
        return float(a.std()), 0
    rest = a[~fin]
    if bool(np.isnan(rest).any()) or bool((rest > 0).any()) or int(fin.sum()) < 2:
        return float("nan"), 0
    return float(a[fin].std()), int(rest.size)


#: rounding's share of an output's magnitude, in units of its dtype's eps: an output whose std
#: is below it is constant on the sample (a cosine similarity of identical pairs: 1 +- 1e-7)
ROUNDING_EPS = 64
#: at most this share of its rms (a float16/bfloat16 output: 64 eps would be 6% or 50%, and a
#: real output with a large mean and a small spread would be called constant)
MAX_ROUNDING = 2.0 ** -10


def constancy(a: Any, eps: float) -> tuple[float, bool]:
    """How constant a main output ``a`` (a real or complex array, float64/complex128 or its own
    dtype) is on the sample, one rule for every back end: the std rounding alone gives it
    (:data:`ROUNDING_EPS` times ``eps``, the machine epsilon of the output's own dtype, at most
    :data:`MAX_ROUNDING`, times its root mean square over the finite entries), and whether
    every sample (rows along dim 0, two or more) holds the same values to that precision (an
    output that does not depend on the inputs).  ``(0.0, False)`` for fewer than two entries
    or none finite."""
    a = np.asarray(a)
    if a.size < 2:
        return 0.0, False
    fin = np.isfinite(a)
    finite = bool(fin.all())
    kept = a if finite else a[fin]          # masked (-inf) entries left out
    if kept.size == 0:
        return 0.0, False
    k = kept.astype(np.complex128 if np.iscomplexobj(kept) else np.float64)
    rms = float(np.sqrt(np.mean(np.abs(k) ** 2)))
    floor = min(ROUNDING_EPS * float(eps), MAX_ROUNDING) * rms
    same = finite and a.ndim >= 1 and a.shape[0] >= 2 and \
        float(np.abs(a.astype(k.dtype) - a[:1].astype(k.dtype)).max()) <= floor
    return floor, same


def masked_note(n: int, total: int | None) -> str:
    """The report's line when calibration left ``n`` masked (-inf) output entries out."""
    of = f" of {total}" if total else ""
    return (f"the main output holds -inf in {n}{of} entries on the calibration batch (a mask: "
            f"masked logits or scores); its std was measured over the finite entries, and the "
            f"output scale leaves -inf as it is. If -inf is not meant (log(0), an overflow), "
            f"fix the model; target_std=None skips the output scale")


def input_second_moment(arrays: list[np.ndarray]) -> float | None:
    """``E[x^2]`` over the floating-point inputs (additive masks left out), for Sec. 6.3's input
    scale; None when there is no such input."""
    floats = [np.asarray(a, dtype=np.float64).ravel() for a in arrays
              if np.asarray(a).dtype.kind == "f" and
              (bool(np.isfinite(a).all()) or not is_additive_mask(a))]
    if not floats:
        return None
    return float(np.square(np.concatenate(floats)).mean())


def refuse_empty(empty: list[str]) -> None:
    """Refuse parameters with no elements (the PyTorch and ONNX front ends both call it)."""
    if empty:
        raise PrecondError(
            f"parameters with no elements: {empty[:5]} (a layer of width 0): there is nothing "
            f"to initialize or scale, and every fan-based rule divides by its zero width. "
            f"Remove the layer or give it a non-zero width")


def solve_output_scale(std: float, target: float, reinit: bool = True,
                       input_rms: float | None = None, floor: float = 0.0) -> float:
    """The scalar that brings the output std to ``target``, with a clear error for std 0
    (``reinit``: whether the weights were re-initialized, for the wording; ``input_rms``: the
    rms of the floating-point inputs as the model sees them, so that a scale out of range
    because of the data is blamed on the data, :func:`input_blame`; ``floor``: the std that
    rounding alone gives the output, at or below which it is constant on the sample)."""
    weights = "after re-initialization" if reinit else \
        "with the model's own weights kept (reinit_weights=False)"
    if not math.isfinite(std):
        raise PrecondError(f"the model's output on the calibration batch has NaN/inf values "
                           f"{weights}; check the model for numerical issues (-inf alone, a "
                           f"mask, is measured over the finite entries; NaN and +inf are not, "
                           f"nor an output with fewer than two finite entries). Or pass "
                           f"target_std=None to skip the output scale, or output_key= an "
                           f"output without them")
    if std <= 1e-30:
        if not reinit:     # the kept weights, more often than the data: a zero-initialized head
            raise PrecondError(
                f"the model's output has zero variance on the calibration batch {weights}, so no "
                f"output scale can reach the target std: a layer whose weights are all zero (a "
                f"classifier head initialized to zero, as torchvision's ViT does) makes the "
                f"output constant; re-initialize the weights (reinit_weights=True, the default), "
                f"use a batch of varied inputs, or pass target_std=None")
        raise PrecondError("the model's output has zero variance on the calibration batch, so no "
                           "output scale can reach the target std; use a batch of varied inputs, "
                           "or pass target_std=None")
    if std <= floor:
        raise PrecondError(
            f"the model's main output is constant on the calibration batch {weights} (std "
            f"{std:.3g}, what rounding alone gives an output of its size: {floor:.3g}), so no "
            f"output scale can bring it to the target std (it would scale rounding noise): a "
            f"similarity of identical pairs (a siamese model called with (x, x)), or an output "
            f"that does not depend on the inputs. Calibrate on inputs for which the output "
            f"varies (pairs that differ), name a varying output with output_key=, or pass "
            f"target_std=None to skip the output scale")
    scale = target / std
    if not SCALE_REFUSE[0] <= scale <= SCALE_REFUSE[1]:
        blame = input_blame(std, target, input_rms)
        if blame:
            raise PrecondError(
                f"the output scale would be {scale:.3g} (beyond {SCALE_REFUSE[0]:g}.."
                f"{SCALE_REFUSE[1]:g}; output std {std:.3g} on the calibration batch): {blame}; a "
                f"model trained from there overflows within a few steps. Or pass target_std=None "
                f"to skip the output scale")
        if SCALE_WARN[0] <= std <= SCALE_WARN[1]:    # the model is fine: the target is not
            raise PrecondError(
                f"target_std={target:g} is {scale:.3g} times the output std {std:.3g} of the "
                f"{'re-initialized model' if reinit else 'model'} on the calibration batch: an "
                f"output scale beyond {SCALE_REFUSE[0]:g}..{SCALE_REFUSE[1]:g} overflows or "
                f"underflows in training. Pass a target of the order of 1 (the default 1.0; the "
                f"paper's Sec. 6.4 uses 0.05), or target_std=None to skip the output scale")
        way = "vanishes" if scale > 1 else "explodes"
        raise PrecondError(
            f"the signal {way} through the "
            f"{'re-initialized model' if reinit else 'model with its own weights'}: its output "
            f"std on the "
            f"calibration batch is {std:.3g}, so the output scale would be {scale:.3g} (beyond "
            f"{SCALE_REFUSE[0]:g}..{SCALE_REFUSE[1]:g}); a model trained from there overflows "
            f"within a few steps. Make the model shallower or wider, add normalization or "
            f"residual connections, try another init= ('fan_in' preserves the variance of ReLU "
            f"networks on average), or pass target_std=None to skip the output scale")
    return scale


#: output scales beyond this range are refused (float32 carries about 7 significant digits: a
#: forward pass that moves the signal 1e8-fold has vanished or exploded, and training from it
#: overflows; a 500-layer width-16 ReLU MLP needs 3e18 and is inf after two SGD steps)
SCALE_REFUSE = (1e-8, 1e8)
#: output scales beyond this range are reported (and warned about) but applied
SCALE_WARN = (1e-4, 1e4)


def scale_warning(std: float, scale: float, input_rms: float | None = None,
                  target: float = 1.0) -> str | None:
    """A warning for an output scale that is applied but far from 1 (None when it is not);
    ``input_rms``, ``target``: see :func:`solve_output_scale`."""
    if SCALE_WARN[0] <= scale <= SCALE_WARN[1]:
        return None
    blame = input_blame(std, target, input_rms)
    if blame:
        return f"output scale {scale:.3g} (output std {std:.3g} before it): {blame}"
    return (f"output scale {scale:.3g} (output std {std:.3g} before it): the forward signal "
            f"{'shrinks' if scale > 1 else 'grows'} {max(scale, 1 / scale):.3g}-fold through "
            f"the re-initialized model; check the first training steps for overflow, or try "
            f"another init= or a shallower/wider model")


def input_blame(std: float, target: float, input_rms: float | None) -> str | None:
    """Why an output std far from ``target`` comes from the data rather than from the model:
    the inputs' rms is further from 1 (in orders of magnitude, and the same way) than the
    model's own gain ``std / input_rms`` (raw pixel values, unnormalized features); None when
    the model is the larger part, or the inputs' rms is unknown."""
    if input_rms is None or not (input_rms > 0 and math.isfinite(input_rms)) or std <= 0:
        return None
    off, own = math.log(input_rms), math.log(std / input_rms)
    if abs(off) <= abs(own) or (off > 0) != (std > target):
        return None
    return (f"the sample's floating-point inputs have rms {input_rms:.3g} and the model "
            f"carries that scale through (output std {std / input_rms:.3g}x the input rms): "
            f"normalize the inputs (e.g. mean 0, std 1 per feature), or pass "
            f"input_scale='auto' (Sec. 6.3: the inputs multiplied by one constant that brings "
            f"them to the first layer's scale)")
