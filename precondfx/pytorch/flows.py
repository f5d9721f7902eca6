"""Normalizing flows: a model that returns ``(z, log_det)`` with ``log_det`` the log-determinant
of ``x -> z``.  The output scale ``c`` on ``z`` is itself a layer of the flow, whose
log-determinant ``d log c`` (``d``: the values of ``z`` per sample) ``log_det`` does not hold:
the gradients are those of the unscaled flow's likelihood (a constant term), but a likelihood
or bits-per-dimension computed from ``(z, log_det)`` is off by that constant.  Told apart from
a second output that merely has one value per sample by measurement: the log-determinant of
``x -> z`` on one sample, from its Jacobian."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from precondfx.errors import PrecondError
from precondfx.pytorch import calibrate as cal
from precondfx.pytorch.capture.common import Sample, at_path, output_path

#: the largest ``d`` whose Jacobian is measured (one backward pass per value of ``z``)
MAX_DIM = 256
#: agreement asked of the log-determinant the model returns, plus ``d log c``, with the
#: measured one (relative to ``max(1, |measured|)``)
RTOL = 1e-3


def _outputs(out: Any) -> list[tuple[Any, torch.Tensor]]:
    """The top-level floating-point tensors of a tuple, list or dict output, with their keys."""
    items = out.items() if isinstance(out, dict) else \
        enumerate(out) if isinstance(out, (tuple, list)) else ()
    return [(k, v) for k, v in items if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _parts(out: Any, sample: Sample, key: Any) -> tuple[torch.Tensor, Any, Any] | None:
    """(x, the main output's key, the other output's key) when ``out`` is shaped as a flow's:
    one floating-point input ``x`` with as many values per sample as the main output ``z``
    (at most :data:`MAX_DIM`), and exactly one other floating-point output with one value per
    sample; else None."""
    xs = [t for t in sample.tensors() if t.is_floating_point()]
    if len(xs) != 1 or xs[0].dim() < 2 or xs[0].shape[0] < 1:
        return None
    x = xs[0]
    path = output_path(out, key)
    z = at_path(out, path)
    b, d = x.shape[0], x[0].numel()
    if len(path) != 1 or not isinstance(z, torch.Tensor) or z.dim() < 1 or \
            z.shape[0] != b or z[0].numel() != d or d > MAX_DIM:
        return None
    others = [k for k, v in _outputs(out) if k != path[0] and v.numel() == b]
    return (x, path[0], others[0]) if len(others) == 1 else None


def shaped_as_flow(out: Any, sample: Sample, key: Any) -> bool:
    """Whether the model's output ``out`` on ``sample`` is shaped as ``(z, log_det)`` (the
    measurement of :func:`log_det_offset` runs only then)."""
    try:
        return _parts(out, sample, key) is not None
    except PrecondError:      # no main output: the output scale says why
        return False


def log_det_offset(model: nn.Module, sample: Sample, key: Any, mode: str,
                   scale: float | None) -> dict[str, Any] | None:
    """When ``model`` is a flow (the output next to its main output ``z`` is, on the first
    sample, the log-determinant of ``x -> z`` less ``d log scale``), the constant its
    ``log_det`` misses: ``{"output", "dims", "offset", "summary"}``; else None.  Checked only
    for one floating-point input with as many values per sample as ``z`` (a bijection) and at
    most :data:`MAX_DIM` of them."""
    if scale is None or not math.isfinite(scale) or scale <= 0 or scale == 1.0:
        return None
    parts = _parts(cal.forward(model, sample, mode), sample, key)
    if parts is None:
        return None
    x, zkey, k = parts
    d = x[0].numel()
    measured, returned = _log_det_first(model, sample, x, zkey, k, mode)
    if measured is None or not math.isfinite(measured) or not math.isfinite(returned):
        return None
    offset = d * math.log(scale)
    tol = RTOL * max(1.0, abs(measured))
    if abs(returned + offset - measured) > tol or abs(returned - measured) <= tol:
        return None
    name = repr(k) if isinstance(k, str) else f"output {k}"
    return {"output": k, "dims": d, "offset": offset,
            "summary": f"a normalizing flow: {name} is the log-determinant of x -> z "
                       f"(measured on the first sample: {measured:.6g}), and z now carries "
                       f"the output scale c={scale:.6g}, a layer whose log-determinant "
                       f"d log c = {d} x log c = {offset:.6g} {name} does not hold. Gradients "
                       f"are unchanged (a constant), but add {offset:.6g} to {name} for the "
                       f"likelihood of the scaled z (report.conditioning['flow']['offset']), "
                       f"or pass target_std=None to leave z unscaled"}


def _log_det_first(model: nn.Module, sample: Sample, x: torch.Tensor, zkey: Any, lkey: Any,
                   mode: str) -> tuple[float | None, float]:
    """log|det dz_0/dx_0| (the first sample's Jacobian, the others held) and the log-det the
    model returns for it."""
    x0 = x.detach().clone()
    flat = x0[0].reshape(-1)

    def z_of(row: torch.Tensor) -> torch.Tensor:
        xx = torch.cat([row.reshape(x0[0].shape)[None], x0[1:]])
        s = sample.map(lambda t: xx if t is x else t.detach().clone())
        return s.call(model, copy=False)

    with cal.quiet_run(model, mode), cal.NoDropout(), torch.enable_grad():
        row = flat.clone().requires_grad_()
        out = z_of(row)
        z0 = out[zkey][0].reshape(-1)
        rows = [torch.autograd.grad(z0[i], row, retain_graph=True, allow_unused=True)[0]
                for i in range(z0.numel())]
        returned = float(out[lkey].reshape(-1)[0].detach())
    if any(r is None for r in rows):
        return None, returned
    jac = torch.stack(rows).double()
    sign, logabs = torch.linalg.slogdet(jac)
    return (float(logabs) if float(sign) != 0 else None), returned
