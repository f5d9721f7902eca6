"""The draw of every init rule, written once for torch tensors and numpy arrays.

A :class:`ParamInit` says how one parameter starts (``precondfx.core.plan``); :func:`draw` makes
that value from a back end's generator through a few array operations (:class:`ArrayOps`):
``precondfx.pytorch.draws.torch_ops`` for the PyTorch back ends, ``numpy_ops`` for the ONNX
one (``precondfx.onnx.reinit``).  Both therefore draw the same way: float32 normals rescaled so
that their empirical second moment is exactly the planned one (:func:`moment_matched`), and
orthogonal blocks per gate with the signs of R's diagonal fixed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from precondfx.core.plan import ParamInit


@dataclass(frozen=True)
class ArrayOps:
    """What a draw needs of an array library (all draws are float32)."""

    normal: Callable[[tuple[int, ...]], Any]          # standard normal from the generator
    full: Callable[[tuple[int, ...], float], Any]
    qr: Callable[[Any], tuple[Any, Any]]              # reduced (Q, R); R's diagonal is read
    diagonal: Callable[[Any], Any]
    sign: Callable[[Any], Any]
    concat: Callable[[list[Any]], Any]
    stack: Callable[[list[Any]], Any]
    mean_square: Callable[[Any], float]               # computed in float64


def numpy_ops(rng: Any) -> ArrayOps:
    """Numpy operations drawing from ``rng`` (a ``numpy.random.Generator``)."""
    import numpy as np
    return ArrayOps(
        normal=lambda shape: rng.standard_normal(shape, dtype=np.float32),
        full=lambda shape, v: np.full(shape, float(v), np.float32),
        qr=np.linalg.qr, diagonal=np.diagonal, sign=np.sign,
        concat=lambda xs: np.concatenate(xs, 0), stack=np.stack,
        mean_square=lambda t: float(np.mean(np.square(t, dtype=np.float64))))


def moment_matched(t: Any, std: float, ops: ArrayOps) -> Any:
    """Rescale a normal draw so its empirical second moment is exactly ``std**2``.

    The rules fix ``E[W^2]``; a finite draw misses it by about ``sqrt(2/numel)`` (6% on a
    64x10 layer), which alone moved the per-layer weight-to-gradient ratios of the paper's MLP
    by up to 1.37x across seeds; matching the moment brought the worst of 12 seeds to 1.2x."""
    m2 = ops.mean_square(t)
    return t * (std / m2 ** 0.5) if m2 > 0 else t


def orthogonal(shape: tuple[int, ...], gates: int, ops: ArrayOps) -> Any:
    """Orthogonal blocks, one per gate: ``(gates*H, cols...)``; a 3-d ``(D, gates*H, cols)``
    (one per direction, as ONNX's recurrent weights) gets one set per direction."""
    if len(shape) == 3:
        return ops.stack([orthogonal(shape[1:], gates, ops) for _ in range(shape[0])])
    g = max(int(gates), 1)
    rows, cols = shape[0] // g, int(math.prod(shape[1:]))
    blocks = []
    for _ in range(g):
        q, r = ops.qr(ops.normal((max(rows, cols), min(rows, cols))))
        q = q * ops.sign(ops.diagonal(r))[None, :]
        blocks.append(q if rows >= cols else q.T)
    return ops.concat(blocks).reshape(shape)


def draw(pi: ParamInit, shape: tuple[int, ...], ops: ArrayOps) -> Any | None:
    """The new value of one parameter (float32), or None where the rule keeps or rescales the
    current value (``keep``, ``scale``: the back end multiplies in place)."""
    if pi.rule in ("keep", "scale") or (pi.rule == "match" and pi.std is None):
        return None
    if pi.rule == "zeros":
        return ops.full(shape, 0.0)
    if pi.rule == "ones":
        return ops.full(shape, 1.0)
    if pi.rule == "constant":
        return ops.full(shape, float(pi.std))
    if pi.rule == "orthogonal":
        return orthogonal(shape, pi.gates, ops) * float(pi.std or 1.0)
    return moment_matched(ops.normal(shape), float(pi.std), ops)


#: The weights' stream is seeded ``seed + WEIGHT_STREAM``, not ``seed``: a sample drawn right
#: after ``torch.manual_seed(0)`` (or from ``np.random.default_rng(0)``) is the start of the
#: stream a generator seeded 0 gives, so with the default ``seed=0`` the first layer's weight
#: rows were the sample's rows times a constant; every sample then met its own copy, the
#: first pre-activations' second moment on the sample was up to 4x what any other batch gives,
#: and the output scale fitted on the sample was 2.7x too small on other data.
WEIGHT_STREAM = 0x5EED_D8A3_1F0B


def weight_seed(seed: int) -> int:
    """Seed of the generator the weights are drawn from (torch and numpy alike)."""
    return (int(seed) + WEIGHT_STREAM) % 2 ** 63


#: ``match`` draws (core.tokens) come from their own stream, seeded ``seed + MATCH_STREAM``,
#: after every other draw: whether they are drawn (measured) or not, the other parameters get
#: the same values, in the pass and in ``precondfx.reinit`` from its plan
MATCH_STREAM = 7919


def split_match(inits: Any) -> tuple[list, list]:
    """``plan.inits`` items in order, the ``match`` rules apart: (others, matches)."""
    items = list(inits.items())
    return ([kv for kv in items if kv[1].rule != "match"],
            [kv for kv in items if kv[1].rule == "match"])

