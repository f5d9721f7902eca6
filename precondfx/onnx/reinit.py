"""Re-initialize ONNX initializers as the plan says, with numpy, deterministically from a seed.

One ``np.random.default_rng(seed)`` walks the plan's parameters in plan order (the graph's
topological order), so the output file is byte-identical across runs.  Normal draws are made in
float32 (``standard_normal(dtype=float32)``) and cast to the initializer's dtype, so fp16 and
bf16 models get the same values as an fp32 model, rounded.  Rules are those of
:class:`precondfx.plan.ParamInit`: geometric/fan_in/fan_out/xavier (normal with ``std``), zeros,
ones, orthogonal (per gate block), scale (multiply the current value by ``std``), keep.
"""
from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from precondfx.onnx.io import FLOAT_TYPES
from precondfx.plan import ParamInit, Plan


def _orthogonal(shape: tuple[int, ...], gates: int, rng: np.random.Generator) -> np.ndarray:
    """Orthogonal blocks: ``(gates*H, cols)`` (or ``(D, gates*H, cols)`` per direction)."""
    if len(shape) == 3:
        return np.stack([_orthogonal(shape[1:], gates, rng) for _ in range(shape[0])])
    g = max(int(gates), 1)
    rows, cols = shape[0] // g, int(math.prod(shape[1:]))
    blocks = []
    for _ in range(g):
        a = rng.standard_normal((max(rows, cols), min(rows, cols)), dtype=np.float32)
        q, r = np.linalg.qr(a)
        q = q * np.sign(np.diagonal(r))[None, :]
        blocks.append(q if rows >= cols else q.T)
    return np.concatenate(blocks, 0).reshape(shape).astype(np.float32)


def draw(pi: ParamInit, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray | None:
    """The new value of one parameter (float32), or None to keep it."""
    if pi.rule in ("keep", "scale"):
        return None
    if pi.rule == "zeros":
        return np.zeros(shape, np.float32)
    if pi.rule == "ones":
        return np.ones(shape, np.float32)
    if pi.rule == "constant":
        return np.full(shape, float(pi.std), np.float32)
    if pi.rule == "orthogonal":
        return _orthogonal(shape, pi.gates, rng) * np.float32(pi.std or 1.0)
    out = rng.standard_normal(shape, dtype=np.float32)
    out *= np.float32(pi.std)
    return out


def reinit(model: ir.Model, plan: Plan, seed: int) -> list[str]:
    """Apply the plan's parameter inits to the model's initializers; returns the names changed."""
    rng = np.random.default_rng(int(seed))
    inits = model.graph.initializers
    changed = []
    for name, pi in plan.inits.items():
        v = inits.get(name)
        if v is None or v.const_value is None or v.dtype not in FLOAT_TYPES:
            continue
        file_shape = tuple(int(d) for d in v.const_value.shape)
        dtype = v.const_value.dtype
        if pi.rule == "scale":
            cur = v.const_value.numpy().astype(np.float64)
            new = cur * float(pi.std)
        else:
            logical = tuple(pi.shape) if pi.shape else file_shape
            new = draw(pi, logical, rng)
            if new is None:
                continue
            new = new.reshape(file_shape)
        v.const_value = ir.tensor(new.astype(dtype.numpy(), copy=False), dtype=dtype, name=name)
        changed.append(name)
    return changed
