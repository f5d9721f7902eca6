"""``python -m precondfx.pytorch.measure.conditioning``: the precision benchmark of ``hessian``."""
from precondfx.pytorch.measure.conditioning.benchmark import _benchmark_precision

if __name__ == "__main__":  # pragma: no cover
    print(_benchmark_precision())
