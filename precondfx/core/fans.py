"""Fan-in, fan-out and kernel size of every weighted kind, and the initialization rules.

Geometric-mean initialization (Sec. 6, Eq. 7, Remark 6) sets ``E[W^2] = c / (k^2 sqrt(n_in n_out))``
with ``c = 2`` (the value that balances biases too, App. D).  The definitions used here:

* Linear ``W: (out, in)``: ``n_in = in``, ``n_out = out``, ``k^2 = 1``.  Bilinear
  ``W: (out, in1, in2)``: each output sums ``in1 * in2`` products, ``n_in = in1 * in2``.
* Convolution ``W: (O, I/g, k1, ..., kd)`` (any d, groups g, dilation): every output reads
  ``I/g`` channels and every input feeds ``O/g`` channels, so ``n_in = I/g``, ``n_out = O/g``,
  ``k^2 = k1 * ... * kd`` (the number of taps; dilation spreads taps without changing their
  count).  Depthwise (``g = I``) gives ``n_in = 1``.  Stride is ignored, as for the strided
  convolutions of Remark 6: spatial changes enter the GR scaling through ``rho``.
* Transposed convolution ``W: (I, O/g, k...)``: the adjoint of a convolution, with the same
  definitions read on its own input/output channels: ``n_in = I/g``, ``n_out = O/g``.
* Matrix product with a parameter ``x @ W`` (``W: (..., K, N)``): ``n_in = K``, ``n_out = N``;
  ``W @ x`` (``W: (M, K)``): ``n_in = K``, ``n_out = M``.
* Embedding ``W: (num, dim)``: a lookup reads exactly one weight per output element, so
  ``n_in = n_out = 1`` with gain ``c = 1``: unit second moment.  The embedding output plays the
  part of a network input (Sec. 6.3's input scaling applies to it).
* Multi-head attention: its packed input projection ``(3E, E)`` is three ``E -> E`` linear maps;
  its output projection is a linear layer.
* Recurrent cells: input-to-hidden weights ``(G*H, in)`` are ``G`` gate maps ``in -> H``
  (geometric); hidden-to-hidden weights get an orthogonal initialization per gate (gain 1),
  because a map applied at every time step must keep norms, which no fan rule does.

Zero padding: on small feature maps a kernel's border taps fall on padding, so fewer than
``k^2`` taps reach the input.  The paper ignores padding (Sec. 5); here ``k^2`` in the init rules
is the average number of taps that reach the input (Chen et al.'s effective kernel size, App.
A.2.7: 0.96 of 9 taps at 32x32, 0.69 at 4x4, 0.44 at 2x2).  Without it, a 50-layer plain 3x3
net on 4x4 and 2x2 maps lost second moment at every layer (1e-11 after 45 convs) and its output
scale became 3.7e4, which made SGD diverge at every learning rate.  The analytic alpha (Sec. 5)
keeps the nominal ``k^2``.

The other rules (``fan_in``: ``2/(k^2 n_in)``; ``fan_out``: ``2/(k^2 n_out)``; ``xavier``:
``4/(k^2 (n_in + n_out))``, Sec. 6.1) are offered for comparison.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from precondfx.errors import PrecondError

INIT_RULES = ("geometric", "fan_in", "fan_out", "xavier")


@dataclass(frozen=True)
class Fans:
    """Fans of one weight: inputs per output, outputs per input, kernel taps, gain c."""

    n_in: int
    n_out: int
    k2: float = 1
    gain: float = 2.0


def effective_kernel_1d(
    size: int, kernel: int, stride: int = 1, padding: int | tuple[int, int] = 0, dilation: int = 1
) -> float:
    """Average number of the ``kernel`` taps that land inside an input of length ``size`` (zero
    padding), over output positions (A.2.7; ``(3H-2)/H`` for k=3, pad 1, stride 1).  ``padding``
    may be ``(left, right)``."""
    pl, pr = (padding, padding) if isinstance(padding, int) else (int(padding[0]), int(padding[1]))
    out = (size + pl + pr - dilation * (kernel - 1) - 1) // stride + 1
    if out <= 0:
        raise PrecondError(f"conv output would be empty (size={size}, kernel={kernel}, padding={padding}).")
    total = 0
    for i in range(out):
        start = i * stride - pl
        total += sum(1 for a in range(kernel) if 0 <= start + a * dilation < size)
    return total / out


def _tup(v: int | Sequence[int], d: int) -> tuple[int, ...]:
    if isinstance(v, int):
        return (v,) * d
    v = tuple(int(x) for x in v)
    if len(v) != d:
        raise PrecondError(f"expected {d} values, got {v!r}.")
    return v


def effective_kernel_size(
    input_size: int | Sequence[int], kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
    padding: int | str | Sequence[int] = 0, dilation: int | Sequence[int] = 1, padding_mode: str = "zeros",
) -> float:
    """Effective kernel size ``prod_d k~_d`` of a zero-padded conv (A.2.7), to be used in place of
    ``k_h k_w`` in fan-in ``n = c_in/groups * k~``.  The number of spatial dims is the longest of
    the sequence arguments (1 if all are ints).  ``padding`` may be ``'same'``/``'valid'`` as in
    PyTorch.  Non-zero padding modes (circular, reflect, replicate) route every tap to some input
    pixel, so ``phi = sigma^2 c_in k`` and the full ``k`` is returned [DERIVED]."""
    seqs = [v for v in (input_size, kernel_size, stride, padding, dilation) if not isinstance(v, (int, str))]
    d = max((len(v) for v in seqs), default=1)
    size, k, s, dil = _tup(input_size, d), _tup(kernel_size, d), _tup(stride, d), _tup(dilation, d)
    if padding_mode != "zeros" or padding == "valid":
        if padding_mode != "zeros":
            return float(math.prod(k))
        pads: list[int | tuple[int, int]] = [0] * d
    elif padding == "same":
        if any(x != 1 for x in s):
            raise PrecondError("padding='same' requires stride 1 (as in PyTorch).")
        pads = []
        for kk, dd in zip(k, dil):
            tot = dd * (kk - 1)
            pads.append((tot // 2, tot - tot // 2))
    elif isinstance(padding, str):
        raise PrecondError(f"padding must be an int, a tuple, 'same' or 'valid', got {padding!r}.")
    else:
        pads = list(_tup(padding, d))
    return float(math.prod(effective_kernel_1d(*args) for args in zip(size, k, s, pads, dil)))


def effective_taps_of(size: Any, kernel: Any, stride: Any, padding: Any, dilation: Any,
                      padding_mode: str = "zeros") -> float | None:
    """Average number of kernel taps that reach the input (zero padding), or None if unknown."""
    try:
        return effective_kernel_size(tuple(int(x) for x in size), kernel, stride, padding,
                                     dilation, padding_mode)
    except (PrecondError, TypeError, ValueError):
        return None


def effective_taps(node: Any) -> float | None:
    """``effective_taps_of`` for a captured convolution node (needs its input shape)."""
    shape = node.in_shapes[0] if node.in_shapes else None
    a = node.attrs
    if shape is None or "kernel_size" not in a or len(shape) < 3 or a.get("symbolic_spatial"):
        return None
    return effective_taps_of(shape[2:], a["kernel_size"], a.get("stride", 1),
                             a.get("padding", 0), a.get("dilation", 1),
                             a.get("padding_mode", "zeros"))


def second_moment(f: Fans, rule: str = "geometric") -> float:
    """Target ``E[W^2]`` of a weight under an initialization rule."""
    if rule == "geometric":
        return f.gain / (f.k2 * math.sqrt(f.n_in * f.n_out))
    if rule == "fan_in":
        return f.gain / (f.k2 * f.n_in)
    if rule == "fan_out":
        return f.gain / (f.k2 * f.n_out)
    if rule == "xavier":
        return 2.0 * f.gain / (f.k2 * (f.n_in + f.n_out))
    raise PrecondError(f"unknown init rule {rule!r}: use one of {INIT_RULES} or 'keep'")


def weight_fans(kind: str, shape: tuple[int, ...], attrs: dict) -> Fans | None:
    """Fans of a weight of the given kind and shape; None when they are not defined."""
    packed = max(1, int(attrs.get("packed", 1)))    # k maps in one weight (q, k, v)
    if kind in ("linear",) and len(shape) == 2:
        return Fans(int(shape[1]), int(shape[0]) // packed)
    if kind == "linear" and len(shape) == 3:     # nn.Bilinear: y_k = x1^T W_k x2 + b_k
        return Fans(int(shape[1]) * int(shape[2]), int(shape[0]))
    if kind == "conv" and len(shape) >= 3:
        g = int(attrs.get("groups", 1) or 1)
        return Fans(int(shape[1]), max(1, int(shape[0]) // g), math.prod(shape[2:]))
    if kind == "conv_transpose" and len(shape) >= 3:
        g = int(attrs.get("groups", 1) or 1)
        return Fans(max(1, int(shape[0]) // g), int(shape[1]), math.prod(shape[2:]))
    if kind == "matmul" and "einsum" in attrs:
        return einsum_fans(str(attrs["einsum"]), int(attrs.get("weight_operand", 1)), shape)
    if kind == "matmul" and len(shape) >= 2:
        if attrs.get("weight_side", "right") == "right":
            return Fans(int(shape[-2]), int(shape[-1]) // packed)
        # 'left' (W @ x) and 'right_t' (x @ W.t(): stored (out, in) as a Linear's weight)
        return Fans(int(shape[-1]), int(shape[-2]) // packed)
    if kind == "matmul" and len(shape) == 1:
        return Fans(int(shape[0]), 1)
    if kind == "embedding" and len(shape) == 2:
        return Fans(1, 1, 1, gain=1.0)
    return None


def einsum_fans(equation: str, weight_operand: int, shape: tuple[int, ...]) -> Fans | None:
    """Fans of the weight of a two-operand einsum (one activation, one weight) read from the
    equation: fan-in is the product of the weight's dimensions summed over (not in the
    output), fan-out of those in the output but not in the activation; a dimension in all
    three (the modes of a Fourier layer's ``"bix,iox->box"``) is a batch of separate maps and
    counts in neither.  None for an equation this does not cover (an ellipsis, a repeated
    index, a shape that does not match)."""
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    subs = lhs.split(",")
    if len(subs) != 2 or "." in eq or weight_operand not in (0, 1):
        return None
    if not arrow:     # implicit output: the indices that appear once, in alphabetical order
        out = "".join(sorted(c for c in set(lhs) if lhs.count(c) == 1 and c.isalpha()))
    w, act = subs[weight_operand], subs[1 - weight_operand]
    if len(w) != len(shape) or len(set(w)) != len(w):
        return None
    n_in = math.prod(int(d) for c, d in zip(w, shape) if c not in out)
    n_out = math.prod(int(d) for c, d in zip(w, shape) if c in out and c not in act)
    if not any(c not in out for c in w):
        return None     # nothing summed over: an elementwise product with a weight, no layer
    return Fans(n_in, n_out)


def attention_fans(param_role: str, shape: tuple[int, ...]) -> Fans | None:
    """Fans of nn.MultiheadAttention parameters (packed or separate projections)."""
    if len(shape) != 2:
        return None
    if param_role == "in_proj_weight":
        return Fans(int(shape[1]), int(shape[0]) // 3)
    if param_role.endswith("proj_weight") or param_role == "out_proj.weight":
        return Fans(int(shape[1]), int(shape[0]))
    return None


def recurrent_fans(param_role: str, shape: tuple[int, ...], gates: int) -> Fans | None:
    """Fans of an input-to-hidden recurrent weight ``(gates*H, in)``."""
    if "weight_ih" in param_role and len(shape) == 2:
        return Fans(int(shape[1]), int(shape[0]) // gates)
    return None
