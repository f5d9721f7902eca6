"""Which output is "the" output: the one rule every back end uses to pick the tensor that the
output scale (``target_std``) applies to and that calibration and measurements read.

Given the model's outputs as ``(key, is_floating_point_tensor)`` entries in order: the entry
named ``logits`` when it is a floating-point tensor, else the first floating-point one.  An
explicit ``output_key`` overrides the rule (each back end checks that it selects a tensor).
PyTorch adapters: ``precondfx.capture.common.output_path``/``main_output``; ONNX:
``precondfx.onnx.apply.OnnxApplier.main_output``.
"""
from __future__ import annotations

from typing import Hashable, Iterable

MAIN_NAME = "logits"


def pick_main(entries: Iterable[tuple[Hashable, bool]]) -> Hashable | None:
    """The key of the main output among ``(key, is_float_tensor)`` entries, or None."""
    entries = list(entries)
    for key, is_float in entries:
        if key == MAIN_NAME and is_float:
            return key
    return next((key for key, is_float in entries if is_float), None)
