"""precondfx: rewrite a neural network before training so that it starts well conditioned.

``precondfx.precondition(model, sample)`` captures the model's graph, classifies every operation
against the scaling rules of Defazio & Bottou, re-initializes the weights (geometric-mean
initialization), inserts scaling constants, replaces max-pooling by striding and fixes the output
scale from a calibration batch.  ``precondfx.analyze`` reports the same without changing anything.
"""
import sys as _sys

from precondfx._deps import missing_required as _missing_required
from precondfx._deps import required_message as _required_message

__version__ = "0.1.0"
_MISSING = _missing_required(("torch", "numpy"))
if _MISSING:
    # installed without its dependencies (pip install --no-deps): the import succeeds, so that
    # the command line can say what to install, and every use of the API raises that
    def __getattr__(name: str) -> None:
        if name.startswith("__"):
            raise AttributeError(name)
        raise ModuleNotFoundError(_required_message(_MISSING), name=_MISSING[0])
else:
    from precondfx import init
    from precondfx.api import Result, analyze, precondition
    from precondfx.core.plan import Options, Plan
    from precondfx.core.report import Report
    from precondfx.errors import PrecondError
    from precondfx.pytorch import distributed
    from precondfx.pytorch.apply.reinit import reinit
    from precondfx.pytorch.capture.common import Sample
    from precondfx.pytorch.folding import fold, fold_problems, unfold
    from precondfx.pytorch.first_step import settle_rate

    # ``import precondfx.distributed`` is public API: the module lives in the PyTorch back end.
    _sys.modules.setdefault(__name__ + ".distributed", distributed)

__all__ = ["precondition", "analyze", "reinit", "fold", "fold_problems", "unfold",
           "settle_rate", "Sample",
           "PrecondError",
           "Plan", "Options", "Report", "Result", "distributed", "init", "__version__"]
