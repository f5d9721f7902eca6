"""The ONNX front end: precondition an exported ``.onnx`` file without PyTorch in the loop.

``precondition_onnx(in_path, out_path, feeds=...)`` runs the same stages as
``precondfx.precondition`` (capture -> classify -> plan -> apply -> re-initialize -> calibrate ->
verify -> report) on an ONNX graph, with the shared op table, planner and report; it writes the
rewritten model atomically and returns the report.  ``inspect_onnx(path)`` classifies and plans
without writing anything.

Stages, one module each: ``io`` (lazy loading, atomic saving, calibration data), ``normalize``,
``capture``, ``apply``, ``reinit``, ``calibrate``, ``pipeline``.
"""
from precondfx.onnx.pipeline import STAGES, inspect_onnx, precondition_onnx

__all__ = ["precondition_onnx", "inspect_onnx", "STAGES"]
