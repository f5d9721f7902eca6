"""Per-layer conditioning statistics of Defazio & Bottou, measured on any ``nn.Module``.

What is measured
----------------
Everything is measured at **batch size 1** (the paper's setting, Sec. 3.1): each sample of the
batch gets its own forward pass, under the paper's random quadratic loss
``L = y^T R y / 2`` over the flattened main output ``y`` of that sample, with a fresh ``R`` per
sample.  ``R = (A + A^T)/2`` with ``A`` i.i.d. N(0, 1) (off-diagonal variance 1/2, diagonal 1).
Outputs larger than ``dense_max`` (4096) elements use a random rank-64 ``R = V diag(s) V^T /
sqrt(2*64)`` (``V``, ``s`` i.i.d. N(0, 1)), scaled so that ``E[(R y)_i^2] ~ ||y||^2/2`` as for
the dense ``R``; ``quadratic="diagonal"`` gives ``R = sqrt(n/2) diag(d)`` instead.  ``E[X^2]``
is the element-wise non-central second moment, averaged over samples, ``R`` and probes.

``hessian``  ``E[(G_l r)^2]``: mean square of the Hessian-vector product restricted to layer l's
    weight block, for a probe ``r`` on that block (Sec. 3, Fig. 1/2; App. A).  Per sample it equals
    ``||H_ll||_F^2 / numel``.  The same HVPs give the whole block matrix
    ``B[m, l] = E[||H_ml r_l||^2] / numel_m`` (the heat map of Fig. 1; ``B[l, l]`` is ``hessian``).
``ratio``    ``nu_l = E[dW^2] / E[W^2]`` (Sec. 4) with ``dW`` the per-sample gradient of L and
    ``E[W^2]`` the current weights' second moment.
``gr``       the GR scaling (Eq. 1) from second moments captured by hooks on the weight's module:
    ``gamma_l = alpha^4 * n_in * k2 * rho2 * E[x^2]^2 * E[dy^2] / E[y^2]`` and for the bias
    ``gamma_b = rho2_bias * E[dy^2] / E[y^2]``; ``x`` is the module input, ``y`` its output
    (including the bias) and ``dy = dL/dy``.  Geometry (``b = 1``, per sample):

    * ``nn.Linear``: ``n_in = in_features``, ``k2 = 1``, ``rho2 =`` number of positions the weight
      is applied at (``y.numel() / out_features``: 1 for a plain vector, T for a sequence).
    * ``nn.ConvNd``: ``n_in = in_channels / groups`` (per group), ``k2 = prod(kernel_size)``,
      ``rho2 = prod(output spatial dims)``.  ``n_in * k2`` is the fan-in.
    * ``nn.ConvTransposeNd``: ``n_in = in_channels / groups``, ``k2 = prod(kernel)/prod(stride)``
      (kernel taps reaching one output), ``rho2 = prod(input spatial dims)`` (times each weight is
      used), ``rho2_bias = prod(output spatial dims)``.  In all cases
      ``n_in * k2 * rho2 = (non-zeros per row of J_l) * (non-zeros per column of J_l)``, which is
      what App. A's derivation uses.
    * A module called several times pools its calls: moments over all calls, ``rho2`` summed.
    * ``alpha`` (from the layer spec, default 1) multiplies by ``alpha^4``.  Set it only when the
      hooked module's own output already includes alpha (``y = alpha * W x``); when alpha is a
      separate multiplication after the module, the hooked ``dy``/``y`` already carry ``alpha^4``.

Every statistic is an :class:`Estimate`: mean, standard error and a 95% interval.  ``hessian``
and ``ratio`` are means of per-sample values (probe noise is inside the per-sample value), so the
standard error across samples covers sample, ``R`` and probe noise; the interval is
mean +- t_{0.975, n-1} * SE.  ``gr`` is a ratio of means; its SE and interval come from a
bootstrap over samples (2000 resamples, percentile interval).

Estimators and cost (per sample; L = number of layers)
------------------------------------------------------
``method="hvp"`` (default; the true Hessian, any twice-differentiable model):
    1 forward + 1 backward with ``create_graph`` + ``L * n_probes`` double-backward HVPs
    (each ~2-3 backward passes); the graph is built once per sample and reused by all probes.
    Probes are Rademacher (default) or Gaussian; both are unbiased for ``||H_ml||_F^2``;
    Rademacher's variance is never higher (lower when ``H^2`` is diagonally dominant).  A block with ``numel <= n_probes`` uses its basis vectors
    (exact, ``numel`` HVPs).  ``ratio`` and ``gr`` come free from the first backward.
    Batched HVPs (``is_grads_batched``, vmap) were 4x slower than a loop on CPU (40x with
    2 threads on a loaded machine), so we loop.
``method="ggn"`` (Rao-Blackwellized over R; dense R only; outputs <= ``ggn_max_outputs``):
    1 forward + ``n_out`` backward passes (one per output element), no double backward.
    With ``K_l = J_l J_l^T`` (``J_l`` = Jacobian of the output w.r.t. ``W_l``) the expectation
    over the symmetrized Gaussian R is exact:
    ``E_R ||G_l||_F^2 = (||K_l||_F^2 + tr(K_l)^2)/2``,
    ``E_R ||dW_l||^2 = (||y||^2 tr K_l + y^T K_l y)/2`` (same for ``dy`` with the Jacobian w.r.t.
    the layer output), ``B[m, l] = (tr(K_m K_l) + tr K_m tr K_l)/(2 numel_m)``.  No probe and no R
    noise; only sample noise remains.  It gives the Gauss-Newton block, which *equals* the Hessian
    diagonal block when the network above layer l is piecewise linear in the layer's output
    (ReLU/LeakyReLU, linear, conv, average/max pooling, no normalization, gating or softmax
    above, no weight sharing) -- the paper's setting (App. A.1).  Off-diagonal blocks are GGN
    blocks (the Hessian's cross blocks have extra terms even for ReLU nets).

Measured precision of ``hessian`` on a small strided conv net (3 convs + linear, 10 outputs,
16x16 inputs; ``python -m precondfx.pytorch.measure.conditioning`` reruns it).  Relative SE = median
over layers of ``rel_stderr``, mean of 3 seeds; "passes" per sample are for the 4 layers;
times with ``torch.set_num_threads(1)`` on a shared CPU core (with 2 threads on an oversubscribed
machine the same runs were 3-10x slower: tiny per-sample ops do not parallelize):

| method | probe | n_probes | passes/sample | rel SE, n=8 | rel SE, n=32 | ms/sample |
|---|---|---|---|---|---|---|
| hvp | gaussian | 1 | 1 + 4 HVP | 0.220 | 0.130 | 5 |
| hvp | rademacher | 1 | 1 + 4 HVP | 0.201 | 0.118 | 5 |
| hvp | gaussian | 4 | 1 + 16 HVP | 0.151 | 0.072 | 15 |
| hvp | rademacher | 4 | 1 + 16 HVP | 0.154 | 0.080 | 14 |
| hvp | rademacher | 16 | 1 + 64 HVP | 0.100 | 0.060 | 51 |
| ggn | - | - | 10 backward | 0.076 | 0.031 | 8 |

Decomposition (same net, per sample, relative std): one probe ~0.65 (Gaussian 0.61-0.72,
Rademacher 0.61-0.69: little gain, as ``H_ll`` has rank <= 10 and is not diagonally dominant);
the draw of R ~0.28; the input x ~0.16.  So ``rel var per sample ~ 0.65^2/P + 0.28^2 + 0.16^2``:
beyond P ~ 4-6 probes, more samples buy more precision than more probes (default P = 4).
``ggn`` removes the probe and R terms (0.16 left): for a 10-output model it costs about one
probe per layer and its SE is 2-2.6x below ``hvp`` with 4 probes (4-7x fewer samples for the
same SE).
On the 100-384-64-10 MLP, ``ratio`` alone (1 forward + 1 backward per sample) reaches ~5%
relative SE per layer with 256 samples (``hvp``) and ~2% with 1024 samples (either method).

Agreement of the proxies with ``hessian`` (gr/hessian per layer, measured): geometric-init
100-384-64-10 MLP 0.83-0.96 (spread <= 1.2x; ``gr``/``ratio`` 0.92-0.98 there, Prop. 4);
default-init conv net above 2.5, 2.6, 3.3 for the convs vs 0.99 for the final linear layer
(spread 3.4x): on convolutions the GR formula is a guide, not a measurement (Sec. 5).

Model state
-----------
The user's train/eval flags are kept, except that dropout modules (``_DropoutNd`` and classes
named ``*Dropout*``) are put in eval for the measurement; every buffer (BatchNorm running
statistics included) is snapshotted and restored, ``requires_grad`` of the measured parameters is
restored, and no ``.grad`` is written.  A train-mode BatchNorm sees batch statistics of one
sample (BatchNorm1d on a 2-D input then fails: measure such models in eval mode).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from precondfx.pytorch.capture.common import Sample, as_sample
from precondfx.errors import PrecondError
from precondfx.pytorch.measure.runtime import one_thread
from precondfx.core.progress import Progress

__all__ = [
    "LayerRef",
    "Estimate",
    "LayerConditioning",
    "BlockMatrix",
    "ConditioningResult",
    "measure_conditioning",
    "hessian_block_matrix",
    "resolve_layers",
    "default_output_fn",
    "spread",
    "STATS",
]

#: statistics understood by :func:`measure_conditioning` (and by ``ConditioningResult.values``)
STATS = ("hessian", "hessian_bias", "ratio", "gr", "gr_bias")

_DENSE_MAX = 4096
_LOWRANK_K = 64
_BOOTSTRAP = 2000
# two-sided 95% Student t quantiles, df = 1..30
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


# --------------------------------------------------------------------------------------------
# plain data
# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------
def default_output_fn(out: Any) -> torch.Tensor:
    """The main output (the rule of ``precondfx.core.outputs``, as the output scale uses it)."""
    from precondfx.pytorch.capture.common import main_output
    try:
        return main_output(out)
    except PrecondError:
        raise PrecondError(
            f"cannot find the main output tensor in a model output of type "
            f"{type(out).__name__}; pass output_fn=lambda out: <the tensor> to "
            f"measure_conditioning") from None


def _spec_get(spec: Any, keys: Sequence[str]) -> Any:
    for k in keys:
        v = spec.get(k) if isinstance(spec, Mapping) else getattr(spec, k, None)
        if isinstance(v, str) or (v is not None and k == "alpha"):
            return v
    return None


def _module_of(weight: str) -> str:
    """Path of the module that owns a parameter (parametrizations unwrapped)."""
    path = weight.rsplit(".", 1)[0] if "." in weight else ""
    marker = ".parametrizations."
    if marker in "." + path + ".":
        path = ("." + path).split(marker)[0].lstrip(".")
    return path


def resolve_layers(model: nn.Module, layers: Sequence[Any] | None = None) -> list[LayerRef]:
    """Normalize layer specs into :class:`LayerRef` and check the parameters exist.

    A spec is a :class:`LayerRef`, a weight parameter name, a dict or any object with a name and
    a weight parameter name (keys/attributes ``weight_name``/``weight``/``param``, ``bias_name``/
    ``bias``, ``name``, ``module``, ``alpha``; a ``params`` role->name dict is also read).
    ``None`` means every ``Linear``/``ConvNd``/``ConvTransposeNd`` module, in definition order.
    """
    if layers is None:
        refs = []
        for path, mod in model.named_modules():
            if isinstance(mod, (nn.Linear, nn.modules.conv._ConvNd)) and \
                    isinstance(getattr(mod, "weight", None), torch.Tensor):
                pre = path + "." if path else ""
                refs.append(LayerRef(path or "model", pre + "weight",
                                     pre + "bias" if mod.bias is not None else None, path))
        if not refs:
            raise PrecondError("the model has no Linear/Conv layers; pass layers=[...] explicitly")
        return refs
    refs: list[LayerRef] = []
    for spec in layers:
        if isinstance(spec, LayerRef):
            ref = LayerRef(spec.name, spec.weight, spec.bias, spec.module, float(spec.alpha))
        elif isinstance(spec, str):
            ref = LayerRef(spec.removesuffix(".weight"), spec)
        else:
            params = spec.get("params") if isinstance(spec, Mapping) else getattr(spec, "params", None)
            params = params if isinstance(params, Mapping) else {}
            weight = _spec_get(spec, ("weight_name", "weight_param", "weight", "param")) \
                or params.get("weight")
            if weight is None:
                raise PrecondError(f"layer spec {spec!r} names no weight parameter "
                                   "(give 'weight': '<parameter name>')")
            bias = _spec_get(spec, ("bias_name", "bias_param", "bias")) or params.get("bias")
            name = _spec_get(spec, ("name",)) or weight.removesuffix(".weight")
            alpha = _spec_get(spec, ("alpha",))
            ref = LayerRef(name, weight, bias, _spec_get(spec, ("module",)),
                           1.0 if alpha is None else float(alpha))
        if ref.module is None:
            ref.module = _module_of(ref.weight)
        for pname in (ref.weight, ref.bias):
            if pname is None:
                continue
            try:
                model.get_parameter(pname)
            except AttributeError as e:
                names = [n for n, _ in model.named_parameters()][:12]
                raise PrecondError(f"layer {ref.name!r}: no parameter {pname!r} in the model "
                                   f"(some parameters: {names})") from e
        refs.append(ref)
    seen = [r.weight for r in refs] + [r.bias for r in refs if r.bias]
    if len(seen) != len(set(seen)):
        raise PrecondError("a parameter appears in two layer specs; list each layer once")
    return refs


def per_sample(sample: Any, forward_kwargs: Mapping[str, Any] | None = None
               ) -> tuple[Sample, int]:
    """The sample as a :class:`Sample` and its batch size: per-sample passes call
    ``s.take(i).call(model)``, which slices only the inputs that carry the batch dimension
    (see :func:`precondfx.pytorch.capture.common.batch_layout`)."""
    s = as_sample(sample, forward_kwargs)
    return s, s.batch_size()


def sample_failed(e: Exception, s: Sample) -> PrecondError:
    """The error for a model that raised on one sample (batch size 1), with what to do."""
    from precondfx.pytorch.checks import is_out_of_memory, out_of_memory
    if is_out_of_memory(e):
        return out_of_memory(e)
    parts = ", ".join(f"{n} {tuple(t.shape)}" for n, t in s.inputs()
                      if isinstance(t, torch.Tensor))
    return PrecondError(
        f"the model failed on one sample (batch size 1): {type(e).__name__}: {e}. Inputs: "
        f"{parts}. Train-mode BatchNorm1d cannot run on one sample (measure in eval mode); if an "
        f"input was wrongly sliced or not sliced along dim 0, say which inputs are batched with "
        f"precondfx.Sample(args, kwargs, batched=[...])")


def run_sample(model: nn.Module, smp: Sample, i: int, output_fn: Callable[[Any], Any]) -> Any:
    """``output_fn`` of the model run on sample ``i`` alone; a failure becomes
    :func:`sample_failed`'s error (a PrecondError passes through)."""
    try:
        return output_fn(smp.take(i).call(model))
    except PrecondError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with advice
        raise sample_failed(e, smp) from e


# --------------------------------------------------------------------------------------------
# model state
# --------------------------------------------------------------------------------------------
def _is_dropout(m: nn.Module) -> bool:
    from precondfx.pytorch.calibrate import is_stochastic
    return is_stochastic(m)


@contextmanager
def measurement_state(model: nn.Module, params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Dropout off, parameters differentiable; restore flags, buffers and requires_grad after."""
    from precondfx.pytorch.calibrate import NoDropout, preserved  # functional dropout too
    req = [(p, p.requires_grad) for p in params]
    try:
        with preserved(model):
            for m in model.modules():
                if _is_dropout(m):
                    m.training = False
            for p in params:
                p.requires_grad_(True)
            with NoDropout():
                yield
    finally:
        for p, r in req:
            p.requires_grad_(r)


# --------------------------------------------------------------------------------------------
# hooks: module input/output moments and the output tensors to differentiate against
# --------------------------------------------------------------------------------------------
class _Capture:
    """Forward hook for one layer: records E[x^2], E[y^2], geometry and the output tensors."""

    def __init__(self, ref: LayerRef, module: nn.Module | None, weight: torch.Tensor):
        self.ref, self.module, self.weight = ref, module, weight
        self.reset()
        kind = type(module).__name__ if module is not None else "none"
        self.kind = kind
        self.supported = isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)) and \
            getattr(module, "weight", None) is weight
        self.note = "" if self.supported else (
            f"GR formula needs the weight to belong to a Linear/ConvNd/ConvTransposeNd module "
            f"(found {kind}); gr not computed")

    def reset(self) -> None:
        self.outputs: list[torch.Tensor] = []
        self.x_sum = self.x_cnt = self.y_sum = self.y_cnt = 0.0
        self.rho2 = self.rho2_bias = 0.0

    def geometry(self) -> tuple[int, float]:
        m = self.module
        if isinstance(m, nn.Linear):
            return m.in_features, 1.0
        if isinstance(m, nn.modules.conv._ConvNd):
            k2 = float(np.prod(m.kernel_size))
            if m.transposed:
                k2 /= float(np.prod(m.stride))
            return m.in_channels // m.groups, k2
        return 0, 0.0

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not isinstance(output, torch.Tensor):
            return None
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is not None:
            xd = x.detach()
            self.x_sum += float(xd.double().pow(2).sum())
            self.x_cnt += xd.numel()
        yd = output.detach()
        self.y_sum += float(yd.double().pow(2).sum())
        self.y_cnt += yd.numel()
        if self.supported:
            m = self.module
            if isinstance(m, nn.Linear):
                pos = yd.numel() / m.out_features
                self.rho2 += pos
                self.rho2_bias += pos
            elif m.transposed:
                self.rho2 += (x.numel() / m.in_channels) if x is not None else 0.0
                self.rho2_bias += yd.numel() / m.out_channels
            else:
                pos = yd.numel() / m.out_channels
                self.rho2 += pos
                self.rho2_bias += pos
        if output.requires_grad:
            self.outputs.append(output)
            # hand a copy downstream so an in-place op after the module (ReLU(inplace=True))
            # cannot overwrite the tensor we differentiate against
            return output.clone()
        return None


# --------------------------------------------------------------------------------------------
# random quadratic loss
# --------------------------------------------------------------------------------------------
def _quadratic(kind: str | Callable, index: int, n: int, gen: torch.Generator,
               like: torch.Tensor, dense_max: int) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
    """Return ``y -> R y`` for this sample's R, and the resolved kind."""
    dt, dev = like.dtype, like.device
    if callable(kind):
        R = torch.as_tensor(kind(index, n)).to(dev, dt)
        if R.dim() == 1:
            return (lambda y: R * y), "custom"
        return (lambda y: R @ y), "custom"
    if kind == "auto":
        kind = "dense" if n <= dense_max else "lowrank"
    if kind == "dense":
        A = torch.randn(n, n, generator=gen, dtype=torch.float64)
        R = ((A + A.T) / 2).to(dev, dt)
        return (lambda y: R @ y), kind
    if kind == "lowrank":
        k = min(_LOWRANK_K, n)
        V = torch.randn(n, k, generator=gen, dtype=torch.float64).to(dev, dt)
        s = (torch.randn(k, generator=gen, dtype=torch.float64) / math.sqrt(2 * k)).to(dev, dt)
        return (lambda y: V @ (s * (V.T @ y))), kind
    if kind == "diagonal":
        d = (torch.randn(n, generator=gen, dtype=torch.float64) * math.sqrt(n / 2)).to(dev, dt)
        return (lambda y: d * y), kind
    raise PrecondError(f"quadratic={kind!r}: use 'auto', 'dense', 'lowrank', 'diagonal' or a "
                       "callable (sample_index, n) -> R")


def _probes(kind: str, shape: torch.Size, n: int, gen: torch.Generator,
            like: torch.Tensor) -> tuple[list[torch.Tensor], float]:
    """Probe vectors and the weight that turns sum ||H v||^2 into the estimate of ||H||_F^2."""
    numel = int(np.prod(shape)) if len(shape) else 1
    if numel <= n:
        eye = torch.eye(numel, dtype=like.dtype, device=like.device)
        return [eye[j].reshape(shape) for j in range(numel)], 1.0
    if kind == "rademacher":
        vs = [(torch.randint(0, 2, shape, generator=gen) * 2 - 1) for _ in range(n)]
    elif kind == "gaussian":
        vs = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(n)]
    else:
        raise PrecondError(f"probe={kind!r}: use 'rademacher' or 'gaussian'")
    return [v.to(like.device, like.dtype) for v in vs], 1.0 / n


# --------------------------------------------------------------------------------------------
# estimates
# --------------------------------------------------------------------------------------------
def _t975(df: int) -> float:
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df


def _mean_estimate(values: np.ndarray, scale: float = 1.0) -> Estimate:
    v = np.asarray(values, dtype=float) * scale
    n = v.size
    mean = float(v.mean())
    if n < 2:
        return Estimate(mean, float("nan"), float("nan"), float("nan"), n)
    se = float(v.std(ddof=1) / math.sqrt(n))
    t = _t975(n - 1)
    return Estimate(mean, se, mean - t * se, mean + t * se, n)


def _ratio_estimate(fn: Callable[[np.ndarray], np.ndarray], cols: np.ndarray,
                    rng: np.random.Generator) -> Estimate:
    """Plug-in estimate ``fn(column means)`` with a bootstrap SE and percentile interval."""
    n = cols.shape[0]
    mean = float(fn(cols.mean(axis=0, keepdims=True))[0])
    if n < 2:
        return Estimate(mean, float("nan"), float("nan"), float("nan"), n, "bootstrap")
    idx = rng.integers(0, n, size=(_BOOTSTRAP, n))
    boot = fn(cols[idx].mean(axis=1))
    boot = boot[np.isfinite(boot)]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return Estimate(mean, float(boot.std(ddof=1)), float(lo), float(hi), n, "bootstrap")


# --------------------------------------------------------------------------------------------
# main entry points
# --------------------------------------------------------------------------------------------
def measure_conditioning(
    model: nn.Module,
    sample: Any,
    layers: Sequence[Any] | None = None,
    *,
    stats: Sequence[str] = ("hessian", "ratio", "gr"),
    n_samples: int = 16,
    n_probes: int = 4,
    seed: int = 0,
    forward_kwargs: Mapping[str, Any] | None = None,
    output_fn: Callable[[Any], torch.Tensor] | None = None,
    method: str = "hvp",
    probe: str = "rademacher",
    include_bias: bool = False,
    quadratic: str | Callable[[int, int], torch.Tensor] = "auto",
    dense_max: int = _DENSE_MAX,
    ggn_max_outputs: int = 256,
    ggn_max_bytes: int = 2**31,
    verbose: bool | None = None,
) -> ConditioningResult:
    """Measure per-layer conditioning statistics at batch size 1 (see the module docstring).

    ``sample`` is a batch: a tensor, a tuple of positional tensors, a dict of keyword tensors or
    a :class:`~precondfx.pytorch.capture.common.Sample`; samples are taken along dim 0 of the inputs that
    carry the batch dimension (those of ``forward_kwargs`` included; inputs shared by the batch,
    such as a ``(T, T)`` attention mask, are passed whole).  ``n_samples`` forwards are run, cycling over the batch with fresh R and probes
    when it is smaller.  ``stats`` picks from ``"hessian"`` (also fills ``result.blocks`` and,
    with ``include_bias``, ``hessian_bias``), ``"ratio"`` and ``"gr"`` (also ``gr_bias``).
    ``method`` is ``"hvp"`` (true Hessian by double backward) or ``"ggn"`` (exact expectation
    over R of the Gauss-Newton quantities, dense R only).  ``quadratic``: ``"auto"`` (dense up to
    ``dense_max`` outputs, else rank-64), ``"dense"``, ``"lowrank"``, ``"diagonal"`` or a callable
    ``(sample_index, n) -> R`` (an n x n matrix or a length-n diagonal).  ``method="ggn"``
    refuses outputs above ``ggn_max_outputs`` elements or per-output gradients above
    ``ggn_max_bytes``.  A progress bar with the ETA per sample goes to stderr on a terminal unless
    ``verbose=False`` (:mod:`precondfx.core.progress`).
    """
    stats = tuple(stats)
    _check_arguments(stats, method, quadratic, n_samples, n_probes)
    refs = resolve_layers(model, layers)
    smp, batch = per_sample(sample, forward_kwargs)
    weights = [model.get_parameter(r.weight) for r in refs]
    blocks = _Blocks.of(model, refs, weights, include_bias)
    caps = [_Capture(r, _submodule(model, r.module), w) for r, w in zip(refs, weights)]
    run = _Run(model, smp, output_fn or default_output_fn, blocks, caps,
               torch.Generator().manual_seed(int(seed)), want_h="hessian" in stats,
               probe=probe, n_probes=n_probes, quadratic=quadratic, dense_max=dense_max,
               ggn_max_outputs=ggn_max_outputs, ggn_max_bytes=ggn_max_bytes)
    rec = _Records(n_samples, len(blocks.params), len(refs))
    _measure_samples(run, rec, method, n_samples, batch, verbose)
    rng = np.random.default_rng(seed)
    results = [_layer_result(r, w, c, rec, l, stats, rng)
               for l, (r, w, c) in enumerate(zip(refs, weights, caps))]
    matrix = _block_matrix(rec, blocks, results, method) if run.want_h else None
    notes = [f"n_samples={n_samples} > batch size {batch}: inputs reused with fresh R/probes"
             ] if n_samples > batch else []
    return ConditioningResult(layers=results, blocks=matrix, n_samples=n_samples,
                              n_distinct_inputs=min(n_samples, batch), n_probes=n_probes,
                              seed=int(seed), method=method, probe=probe, loss=rec.loss_kind,
                              notes=notes)


def _check_arguments(stats: tuple[str, ...], method: str, quadratic: Any, n_samples: int,
                     n_probes: int) -> None:
    for s in stats:
        if s not in ("hessian", "ratio", "gr"):
            raise PrecondError(f"unknown statistic {s!r}; choose from 'hessian', 'ratio', 'gr'")
    if method not in ("hvp", "ggn"):
        raise PrecondError(f"method={method!r}: use 'hvp' or 'ggn'")
    if method == "ggn" and quadratic not in ("auto", "dense"):
        raise PrecondError("method='ggn' averages over the dense symmetrized Gaussian R exactly; "
                           "it cannot use another quadratic (use method='hvp')")
    if n_samples < 1 or n_probes < 1:
        raise PrecondError("n_samples and n_probes must be at least 1")


def _submodule(model: nn.Module, path: str | None) -> nn.Module | None:
    try:
        return model.get_submodule(path) if path is not None else None
    except AttributeError:
        return None


@dataclass
class _Blocks:
    """The Hessian blocks: every layer's weight, then (``include_bias``) the biases."""

    params: list[torch.Tensor]
    names: list[str]
    layer: list[tuple[int, str]]           # (layer index, "weight" or "bias") per block
    biases: list[torch.Tensor | None]

    @classmethod
    def of(cls, model: nn.Module, refs: list[LayerRef], weights: list[torch.Tensor],
           include_bias: bool) -> "_Blocks":
        biases = [model.get_parameter(r.bias) if r.bias else None for r in refs]
        blocks = cls(list(weights), [r.name for r in refs],
                     [(i, "weight") for i in range(len(refs))], biases)
        if include_bias:
            for i, (r, b) in enumerate(zip(refs, biases)):
                if b is not None:
                    blocks.params.append(b)
                    blocks.names.append(r.name + ".bias")
                    blocks.layer.append((i, "bias"))
        return blocks


class _Records:
    """Per-sample records: the block matrix, E[dW^2] and the hooked moments per layer."""

    def __init__(self, n: int, nb: int, nl: int) -> None:
        self.blk = np.zeros((n, nb, nb))          # B[m, l] per sample
        self.grad_sq, self.x2, self.y2, self.dy2, self.rho2, self.rho2b = (
            np.zeros((n, nl)) for _ in range(6))
        self.loss_kind = ""

    def moments(self, s: int, caps: list["_Capture"]) -> None:
        """Sample ``s``'s hooked input/output moments and geometry."""
        for l, c in enumerate(caps):
            self.x2[s, l] = c.x_sum / c.x_cnt if c.x_cnt else float("nan")
            self.y2[s, l] = c.y_sum / c.y_cnt if c.y_cnt else float("nan")
            self.rho2[s, l] = c.rho2
            self.rho2b[s, l] = c.rho2_bias
            c.reset()


@dataclass
class _Run:
    """What one measurement needs in every sample."""

    model: nn.Module
    smp: Sample
    output_fn: Callable[[Any], torch.Tensor]
    blocks: _Blocks
    caps: list["_Capture"]
    gen: torch.Generator
    want_h: bool
    probe: str
    n_probes: int
    quadratic: Any
    dense_max: int
    ggn_max_outputs: int
    ggn_max_bytes: int


def _measure_samples(run: _Run, rec: _Records, method: str, n_samples: int, batch: int,
                     verbose: bool | None) -> None:
    """One forward per sample (cycling over the batch), hooks recording, then the method's
    backward passes; the model's state is restored afterwards."""
    nb = len(run.blocks.params)
    n_hvp = nb if run.want_h else 0
    per_block = method == "hvp" and n_hvp > 1  # ETA per block: a sample is slow
    what = (f"Hessian block matrix ({nb} x {nb}, {method})" if run.want_h
            else f"conditioning statistics ({len(run.caps)} layers)")
    all_params = list(dict.fromkeys(run.blocks.params +
                                    [b for b in run.blocks.biases if b is not None]))
    handles = []
    try:
        with measurement_state(run.model, all_params), torch.enable_grad(), \
                one_thread(run.model), \
                Progress(n_samples * (n_hvp if per_block else 1), what,
                         unit="block" if per_block else "sample", verbose=verbose) as bar:
            handles = [c.module.register_forward_hook(c) for c in run.caps
                       if c.module is not None]
            for s in range(n_samples):
                for c in run.caps:
                    c.reset()
                out = run_sample(run.model, run.smp, s % batch, run.output_fn)
                if not isinstance(out, torch.Tensor) or not out.is_floating_point():
                    raise PrecondError("output_fn must return a floating-point tensor")
                if method == "hvp":
                    _hvp_sample(run, rec, s, out.reshape(-1), bar if per_block else None)
                else:
                    _ggn_sample(run, rec, s, out.reshape(-1))
                rec.moments(s, run.caps)
                del out
                bar.step()  # the sample (or its last block)
    finally:
        for h in handles:
            h.remove()
        for c in run.caps:
            c.reset()


def _dy_moments(rec: _Records, s: int, outs: list[list[torch.Tensor]],
                g_outs: Sequence[torch.Tensor | None]) -> None:
    """E[dy^2] per layer from the gradients of its hooked outputs (every call pooled)."""
    k = 0
    for l, os_ in enumerate(outs):
        tot, cnt = 0.0, 0
        for o in os_:
            g = g_outs[k]
            k += 1
            cnt += o.numel()
            if g is not None:
                tot += float(g.detach().double().pow(2).sum())
        rec.dy2[s, l] = tot / cnt if cnt else float("nan")


def _hvp_sample(run: _Run, rec: _Records, s: int, y: torch.Tensor, bar: Progress | None) -> None:
    """One sample under the random quadratic loss: the first backward (``create_graph`` when
    the Hessian is wanted) gives E[dW^2] and E[dy^2]; the HVPs of every block's probes give the
    block matrix row by row."""
    params = run.blocks.params
    nb, nl = len(params), len(run.caps)
    ry, rec.loss_kind = _quadratic(run.quadratic, s, y.numel(), run.gen, y, run.dense_max)
    L = 0.5 * torch.dot(y, ry(y))
    outs = [c.outputs for c in run.caps]
    grads = torch.autograd.grad(L, params + [o for os_ in outs for o in os_],
                                create_graph=run.want_h, allow_unused=True)
    g_blocks = grads[:nb]
    for l in range(nl):
        g = g_blocks[l]
        rec.grad_sq[s, l] = 0.0 if g is None else float(g.detach().double().pow(2).mean())
    _dy_moments(rec, s, outs, grads[nb:])
    for b in range(nb if run.want_h else 0):
        if b and bar is not None:
            bar.step()
        gb = g_blocks[b]
        if gb is None or not gb.requires_grad:
            continue  # no curvature through this block
        vs, wgt = _probes(run.probe, params[b].shape, run.n_probes, run.gen, params[b])
        for v in vs:
            try:
                hv = torch.autograd.grad(gb, params, grad_outputs=v, retain_graph=True,
                                         allow_unused=True)
            except RuntimeError as e:
                raise PrecondError(
                    f"Hessian-vector product failed ({e}); an op of the model may "
                    "lack double backward: use method='ggn' or "
                    "stats=('ratio', 'gr')") from e
            for m in range(nb):
                if hv[m] is not None:
                    rec.blk[s, m, b] += wgt * float(hv[m].detach().double().pow(2).mean())


def _ggn_rows(run: _Run, y: torch.Tensor, targets: list[torch.Tensor]
              ) -> list[list[torch.Tensor | None]]:
    """Per target, the gradient of every output element (one backward pass each)."""
    n_out = y.numel()
    if n_out > run.ggn_max_outputs:
        raise PrecondError(
            f"method='ggn' needs one backward pass per output element; the output "
            f"has {n_out} > ggn_max_outputs={run.ggn_max_outputs}: use method='hvp'")
    need = n_out * sum(t.numel() * t.element_size() for t in targets)
    if need > run.ggn_max_bytes:
        raise PrecondError(
            f"method='ggn' would hold {need / 2**30:.1f} GiB of per-output "
            f"gradients (> ggn_max_bytes={run.ggn_max_bytes}): use method='hvp'")
    rows: list[list[torch.Tensor | None]] = [[] for _ in targets]
    for a in range(n_out):
        g = torch.autograd.grad(y[a], targets, retain_graph=a < n_out - 1, allow_unused=True)
        for t, gt in enumerate(g):
            rows[t].append(None if gt is None else gt.detach().reshape(-1))
    return rows


def _jacobian_gram(rs: list[torch.Tensor | None]) -> torch.Tensor | None:
    """``J J^T`` from the per-output gradient rows (None when no row depends on the target)."""
    if all(r_ is None for r_ in rs):
        return None
    ref_ = next(r_ for r_ in rs if r_ is not None)
    J = torch.stack([r_ if r_ is not None else torch.zeros_like(ref_) for r_ in rs]).double()
    return J @ J.T


def _ggn_sample(run: _Run, rec: _Records, s: int, y: torch.Tensor) -> None:
    """One sample, exact expectation over the dense R: Gram matrices of the Jacobians of the
    output w.r.t. each block and each hooked output (one backward per output element)."""
    rec.loss_kind = "dense (exact expectation)"
    params = run.blocks.params
    nb = len(params)
    outs = [c.outputs for c in run.caps]
    rows = _ggn_rows(run, y, params + [o for os_ in outs for o in os_])
    yd = y.detach().double()
    yy = float(yd @ yd)
    Ks = [_jacobian_gram(rows[t]) for t in range(nb)]
    for l in range(len(run.caps)):
        K = Ks[l]
        if K is not None:
            rec.grad_sq[s, l] = (yy * float(K.trace()) + float(yd @ K @ yd)) / \
                (2 * params[l].numel())
    if run.want_h:
        tr = [float(K.trace()) if K is not None else 0.0 for K in Ks]
        for m in range(nb):
            for b in range(nb):
                if Ks[m] is not None and Ks[b] is not None:
                    rec.blk[s, m, b] = (float((Ks[m] * Ks[b]).sum()) + tr[m] * tr[b]) / \
                        (2 * params[m].numel())
    k = nb
    for l, os_ in enumerate(outs):
        rs_all: list[torch.Tensor] = []
        cnt = 0
        for o in os_:
            cnt += o.numel()
            rs = rows[k]
            k += 1
            if any(r_ is not None for r_ in rs):
                rs_all.append(torch.stack([
                    r_.double() if r_ is not None else
                    torch.zeros(o.numel(), dtype=torch.float64, device=o.device)
                    for r_ in rs]))
        if cnt and rs_all:
            A = torch.cat(rs_all, dim=1)
            M = A @ A.T
            rec.dy2[s, l] = (yy * float(M.trace()) + float(yd @ M @ yd)) / (2 * cnt)
        else:
            rec.dy2[s, l] = 0.0 if cnt else float("nan")


def _layer_result(r: LayerRef, w: torch.Tensor, c: "_Capture", rec: _Records, l: int,
                  stats: tuple[str, ...], rng: np.random.Generator) -> LayerConditioning:
    """Layer ``l``'s estimates from the per-sample records."""
    w2 = float(w.detach().double().pow(2).mean())
    lc = LayerConditioning(name=r.name, weight=r.weight, bias=r.bias, module=r.module,
                           module_type=c.kind, numel=w.numel(), weight_sq=w2, alpha=r.alpha)
    notes_l = []
    if "hessian" in stats:
        lc.hessian = _mean_estimate(rec.blk[:, l, l])
    if "ratio" in stats:
        lc.grad_sq = _mean_estimate(rec.grad_sq[:, l])
        lc.ratio = _mean_estimate(rec.grad_sq[:, l], 1.0 / w2) if w2 > 0 else None
        if w2 == 0:
            notes_l.append("weights are all zero: ratio undefined")
    captured = np.all(np.isfinite(rec.y2[:, l])) and np.all(np.isfinite(rec.x2[:, l]))
    if ("gr" in stats or "ratio" in stats) and captured:
        lc.x_sq = _mean_estimate(rec.x2[:, l])
        lc.y_sq = _mean_estimate(rec.y2[:, l])
        lc.dy_sq = _mean_estimate(rec.dy2[:, l])
    if "gr" in stats:
        if not c.supported:
            notes_l.append(c.note)
        elif not captured:
            notes_l.append("the layer's module was not called in the forward pass; gr not computed")
        else:
            _gr_estimates(lc, r, c, rec, l, rng)
    lc.note = "; ".join(n for n in notes_l if n)
    return lc


def _gr_estimates(lc: LayerConditioning, r: LayerRef, c: "_Capture", rec: _Records, l: int,
                  rng: np.random.Generator) -> None:
    """The GR scaling of Eq. 1 (and of the bias) as ratios of means, bootstrapped."""
    n_in, k2 = c.geometry()
    lc.n_in, lc.k2 = n_in, k2
    lc.rho2 = float(rec.rho2[:, l].mean())
    lc.rho2_bias = float(rec.rho2b[:, l].mean())
    a4 = r.alpha ** 4
    cols = np.stack([rec.x2[:, l], rec.y2[:, l], rec.dy2[:, l], rec.rho2[:, l],
                     rec.rho2b[:, l]], axis=1)

    def gamma(m: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return a4 * n_in * k2 * m[:, 3] * m[:, 0] ** 2 * m[:, 2] / m[:, 1]

    def gamma_b(m: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return m[:, 4] * m[:, 2] / m[:, 1]

    lc.gr = _ratio_estimate(gamma, cols, rng)
    if r.bias is not None:
        lc.gr_bias = _ratio_estimate(gamma_b, cols, rng)


def _block_matrix(rec: _Records, blocks: _Blocks, results: list[LayerConditioning],
                  method: str) -> BlockMatrix:
    """Means and standard errors over samples of the block matrix; bias blocks' diagonal goes
    to their layer's ``hessian_bias``."""
    n = rec.blk.shape[0]
    mean = rec.blk.mean(axis=0)
    se = rec.blk.std(axis=0, ddof=1) / math.sqrt(n) if n > 1 else np.full_like(mean, np.nan)
    for b, (l, kind) in enumerate(blocks.layer):
        if kind == "bias":
            results[l].hessian_bias = _mean_estimate(rec.blk[:, b, b])
    return BlockMatrix(blocks.names, mean, se, "ggn" if method == "ggn" else "hessian")


def hessian_block_matrix(
    model: nn.Module,
    sample: Any,
    layers: Sequence[Any] | None = None,
    **kwargs: Any,
) -> BlockMatrix:
    """The block matrix ``E[||H_ml r_l||^2]/numel_m`` over the layers' weight blocks (Fig. 1).

    Keyword arguments are those of :func:`measure_conditioning` (``n_samples``, ``n_probes``,
    ``seed``, ``method``, ``include_bias``...).  Cost: ``n_samples * n_blocks * n_probes`` HVPs.
    """
    kwargs["stats"] = ("hessian",)
    res = measure_conditioning(model, sample, layers, **kwargs)
    assert res.blocks is not None
    return res.blocks


# --------------------------------------------------------------------------------------------
# precision benchmark (python -m precondfx.pytorch.measure.conditioning)
# --------------------------------------------------------------------------------------------
def _benchmark_precision(repeats: int = 3) -> str:
    """Relative SE of ``hessian`` vs probes/samples/method on a small strided conv net.

    Net: Conv(3,16,3,p1)-ReLU-Conv(16,32,3,s2,p1)-ReLU-Conv(32,32,3,s2,p1)-ReLU-Linear(512,10),
    16x16 N(0,1) inputs, default init.  Reports the median over layers of ``rel_stderr`` (mean
    over ``repeats`` seeds), the HVPs/backward passes per sample and the wall time per sample.
    """
    import time

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                        nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.ReLU(),
                        nn.Flatten(), nn.Linear(512, 10))
    x = torch.randn(64, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    rows = ["| method | probe | n_probes | passes/sample | rel SE, n=8 | rel SE, n=32 | ms/sample |",
            "|---|---|---|---|---|---|---|"]
    configs = [("hvp", "gaussian", 1), ("hvp", "rademacher", 1), ("hvp", "gaussian", 4),
               ("hvp", "rademacher", 4), ("hvp", "rademacher", 16), ("ggn", "-", 0)]
    for method, probe, p in configs:
        rel = {}
        ms = []
        for n in (8, 32):
            vals = []
            for rep in range(repeats):
                t0 = time.perf_counter()
                r = measure_conditioning(net, x, stats=("hessian",), n_samples=n,
                                         n_probes=max(p, 1), seed=rep, method=method,
                                         probe=probe if method == "hvp" else "rademacher")
                ms.append((time.perf_counter() - t0) / n * 1e3)
                vals.append(float(np.median([lay.hessian.rel_stderr for lay in r.layers])))
            rel[n] = float(np.mean(vals))
        passes = f"1+{4 * p} HVP" if method == "hvp" else "10 backward"
        rows.append(f"| {method} | {probe} | {p or '-'} | {passes} | {rel[8]:.3f} | {rel[32]:.3f} "
                    f"| {np.median(ms):.0f} |")
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover
    print(_benchmark_precision())
