"""Re-initialize ONNX initializers as the plan says, with numpy, deterministically from a seed.

One ``np.random.default_rng(seed)`` walks the plan's parameters in plan order (the graph's
topological order), so the output file is byte-identical across runs.  The draws are
``precondfx.core.draw``'s (the PyTorch path's rules: float32 normals whose empirical second moment is
exactly the planned one, orthogonal blocks per gate), cast to the initializer's dtype, so fp16
and bf16 models get the same values as an fp32 model, rounded.  Rules are those of
:class:`precondfx.core.plan.ParamInit`: geometric/fan_in/fan_out/xavier (normal with ``std``), zeros,
ones, orthogonal (per gate block), scale (multiply the current value by ``std``), keep.
"""
from __future__ import annotations


import numpy as np
import onnx_ir as ir

from precondfx.onnx.io import FLOAT_TYPES
from precondfx.core import draw as core
from precondfx.core.plan import ParamInit, Plan


def draw(pi: ParamInit, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray | None:
    """The new value of one parameter (float32), or None to keep it (``precondfx.core.draw``'s rule,
    shared with the PyTorch back ends)."""
    return core.draw(pi, shape, core.numpy_ops(rng))


def reinit(model: ir.Model, plan: Plan, seed: int) -> list[str]:
    """Apply the plan's parameter inits to the model's initializers; returns the names changed.
    A weight the graph multiplies by a factor (Gemm ``alpha``) is planned divided by it
    (``core.plan.divide_gains``)."""
    rng = np.random.default_rng(core.weight_seed(seed))
    match_rng = np.random.default_rng(int(seed) + core.MATCH_STREAM)
    inits = model.graph.initializers
    changed = []
    others, matches = core.split_match(plan.inits)
    for name, pi in others + matches:
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
            new = draw(pi, logical, match_rng if pi.rule == "match" else rng)
            if new is None:
                continue
            new = new.reshape(file_shape)
        v.const_value = ir.tensor(new.astype(dtype.numpy(), copy=False), dtype=dtype, name=name)
        changed.append(name)
    return changed
