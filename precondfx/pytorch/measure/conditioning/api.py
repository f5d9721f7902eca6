"""The entry points: :func:`measure_conditioning` and :func:`hessian_block_matrix`."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from precondfx.core.progress import Progress
from precondfx.errors import PrecondError
from precondfx.pytorch.measure.runtime import one_thread
from precondfx.pytorch.measure.conditioning.estimates import _block_matrix, _layer_result
from precondfx.pytorch.measure.conditioning.hessian import _DENSE_MAX, _ggn_sample, _hvp_sample
from precondfx.pytorch.measure.conditioning.inputs import (measurement_state, per_sample,
                                                           resolve_layers, run_sample,
                                                           whole_batch_output_fn)
from precondfx.pytorch.measure.conditioning.records import _Blocks, _Capture, _Records, _Run
from precondfx.pytorch.measure.conditioning.results import BlockMatrix, ConditioningResult


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
    fn = output_fn or whole_batch_output_fn(model, smp, weights)
    run = _Run(model, smp, fn, blocks, caps,
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

