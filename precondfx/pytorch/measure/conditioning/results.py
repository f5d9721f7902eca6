"""What a conditioning measurement returns: estimates with their standard errors, per-layer
statistics, the Hessian block matrix, and the spread that summarizes them."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from precondfx.errors import PrecondError

#: statistics understood by :func:`measure_conditioning` (and by ``ConditioningResult.values``)
STATS = ("hessian", "hessian_bias", "ratio", "gr", "gr_bias")


@dataclass
class LayerRef:
    """One layer to measure: a display name, its weight parameter and optional bias parameter.

    ``module`` is the module whose forward computes ``W x`` (default: the weight's parent);
    ``alpha`` multiplies the GR scaling by ``alpha^4`` (see the module docstring for when).
    """

    name: str
    weight: str
    bias: str | None = None
    module: str | None = None
    alpha: float = 1.0


@dataclass
class Estimate:
    """A mean with its standard error and a 95% confidence interval over ``n`` samples."""

    mean: float
    stderr: float
    ci_low: float
    ci_high: float
    n: int
    how: str = "t"  # "t": mean +- t*SE over per-sample values; "bootstrap"; "exact"

    @property
    def rel_stderr(self) -> float:
        """Standard error relative to the mean."""
        return abs(self.stderr / self.mean) if self.mean else float("inf")

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies in the 95% interval."""
        return self.ci_low <= value <= self.ci_high

    def __float__(self) -> float:
        return float(self.mean)


@dataclass
class LayerConditioning:
    """Per-layer statistics (any of them ``None`` when not requested or not applicable)."""

    name: str
    weight: str
    bias: str | None
    module: str | None
    module_type: str
    numel: int
    weight_sq: float                      # E[W^2] of the current weights
    hessian: Estimate | None = None       # E[(G_l r)^2], weight block
    hessian_bias: Estimate | None = None  # same for the bias block (include_bias=True)
    ratio: Estimate | None = None         # nu_l = E[dW^2]/E[W^2]
    grad_sq: Estimate | None = None       # E[dW^2]
    gr: Estimate | None = None            # gamma_l, Eq. 1
    gr_bias: Estimate | None = None       # gamma_b, Eq. 1
    x_sq: Estimate | None = None          # E[x^2] of the module input
    y_sq: Estimate | None = None          # E[y^2] of the module output
    dy_sq: Estimate | None = None         # E[dy^2]
    n_in: int | None = None
    k2: float | None = None
    rho2: float | None = None
    rho2_bias: float | None = None
    alpha: float = 1.0
    note: str = ""


@dataclass
class BlockMatrix:
    """``mean[m, l] = E[||H_ml r_l||^2] / numel_m`` for the blocks ``names`` (rows m, columns l)."""

    names: list[str]
    mean: np.ndarray
    stderr: np.ndarray
    method: str

    def diagonal(self) -> dict[str, float]:
        """The diagonal-block statistics by block name."""
        return {n: float(self.mean[i, i]) for i, n in enumerate(self.names)}


@dataclass
class ConditioningResult:
    """What :func:`measure_conditioning` returns: one :class:`LayerConditioning` per layer."""

    layers: list[LayerConditioning]
    blocks: BlockMatrix | None
    n_samples: int
    n_distinct_inputs: int
    n_probes: int
    seed: int
    method: str
    probe: str
    loss: str
    notes: list[str] = field(default_factory=list)

    def __getitem__(self, name: str) -> LayerConditioning:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def values(self, stat: str) -> dict[str, float]:
        """``{layer name: mean}`` for one statistic, skipping layers where it is missing."""
        if stat not in STATS and stat not in ("grad_sq", "x_sq", "y_sq", "dy_sq"):
            raise PrecondError(f"unknown statistic {stat!r}; choose one of {STATS}")
        out = {}
        for layer in self.layers:
            est = getattr(layer, stat)
            if est is not None:
                out[layer.name] = float(est.mean)
        return out

    def spread(self, stat: str = "hessian") -> float:
        """max/min of a statistic over layers (1.0 = perfectly balanced)."""
        return spread(self.values(stat))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        d = {k: v for k, v in asdict(self).items() if k != "blocks"}
        if self.blocks is not None:
            d["blocks"] = {"names": list(self.blocks.names), "mean": self.blocks.mean.tolist(),
                           "stderr": self.blocks.stderr.tolist(), "method": self.blocks.method}
        return d


def spread(values: Mapping[str, float] | Sequence[float] | ConditioningResult,
           stat: str = "hessian") -> float:
    """max/min over layers of positive values (a dict, a sequence, or a result plus ``stat``).

    Returns ``inf`` when some value is zero (a layer without signal) and ``nan`` when empty.
    """
    if isinstance(values, ConditioningResult):
        values = values.values(stat)
    vals = np.asarray(list(values.values()) if isinstance(values, Mapping) else list(values),
                      dtype=float)
    vals = vals[np.isfinite(vals)]
    if vals.size == 0:
        return float("nan")
    lo, hi = float(np.min(np.abs(vals))), float(np.max(np.abs(vals)))
    return float("inf") if lo == 0.0 else hi / lo


