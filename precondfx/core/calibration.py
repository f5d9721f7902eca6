"""The output and input scales' arithmetic, the same for every back end.

A back end measures (the output's std on the calibration batch, the inputs as arrays); these
functions turn the measurements into the scale the plan's constant takes (Sec. 6.3, 6.4), or
refuse with what to do.
"""
from __future__ import annotations

import math

import numpy as np

from precondfx.errors import PrecondError


def is_additive_mask(a: np.ndarray) -> bool:
    """A float array used as an additive attention mask or bias: ``-inf`` where masked, finite
    values <= 0 elsewhere (``nn.Transformer.generate_square_subsequent_mask``, ALiBi-style
    biases).  Its ``-inf`` entries are meaningful, not bad data; NaN and ``+inf`` never are."""
    a = np.asarray(a)
    if a.dtype.kind != "f" or bool(np.isnan(a).any()):
        return False
    fin = np.isfinite(a)
    return bool((a[~fin] < 0).all()) and bool((a[fin] <= 0).all())


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


def solve_output_scale(std: float, target: float, reinit: bool = True) -> float:
    """The scalar that brings the output std to ``target``, with a clear error for std 0
    (``reinit``: whether the weights were re-initialized, for the wording)."""
    weights = "after re-initialization" if reinit else \
        "with the model's own weights kept (reinit_weights=False)"
    if not math.isfinite(std):
        raise PrecondError(f"the model's output on the calibration batch has NaN/inf values "
                           f"{weights}; check the model for numerical issues")
    if std <= 1e-30:
        raise PrecondError("the model's output has zero variance on the calibration batch, so no "
                           "output scale can reach the target std; use a batch of varied inputs, "
                           "or pass target_std=None")
    scale = target / std
    if not SCALE_REFUSE[0] <= scale <= SCALE_REFUSE[1]:
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


def scale_warning(std: float, scale: float) -> str | None:
    """A warning for an output scale that is applied but far from 1 (None when it is not)."""
    if SCALE_WARN[0] <= scale <= SCALE_WARN[1]:
        return None
    return (f"output scale {scale:.3g} (output std {std:.3g} before it): the forward signal "
            f"{'shrinks' if scale > 1 else 'grows'} {max(scale, 1 / scale):.3g}-fold through "
            f"the re-initialized model; check the first training steps for overflow, or try "
            f"another init= or a shallower/wider model")
