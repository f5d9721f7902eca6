"""precondfx: rewrite a neural network before training so that it starts well conditioned.

``precondfx.precondition(model, sample)`` captures the model's graph, classifies every operation
against the scaling rules of Defazio & Bottou, re-initializes the weights (geometric-mean
initialization), inserts scaling constants, replaces max-pooling by striding and fixes the output
scale from a calibration batch.  ``precondfx.analyze`` reports the same without changing anything.
"""
from precondfx import distributed
from precondfx.api import Result, analyze, precondition
from precondfx.apply.reinit import reinit
from precondfx.capture.common import Sample
from precondfx.errors import PrecondError
from precondfx.folding import fold, fold_problems
from precondfx.plan import Options, Plan
from precondfx.report import Report

__version__ = "0.1.0"
__all__ = ["precondition", "analyze", "reinit", "fold", "fold_problems", "Sample", "PrecondError",
           "Plan", "Options", "Report", "Result", "distributed", "__version__"]
