"""A suggested learning rate from the curvature of the rewritten model (``suggest_lr=True``).

Both rates are ``1 / lambda``, with no constant fitted to any benchmark:

* **SGD**: ``lambda`` is the top eigenvalue of the Gauss-Newton matrix of the mean
  cross-entropy of the main output on the sample, ``J^T H J / N`` with ``H = diag(p) - p p^T``
  per row of logits (the softmax's own Hessian: no labels needed; the classes are in the
  last dimension, or in dim 1 of a convolution's output, as ``F.cross_entropy`` reads a
  segmentation net's ``(B, C, H, W)``: :func:`precondfx.core.outputs.class_dim`; read over
  the last, a small segmentation net's rate came out 1.20 where the curvature of its
  cross-entropy over dim 1 gives 0.28; a main output whose last
  dimension is 1 uses the squared error, ``H = 1``, and so does one of 3 or more dimensions
  shaped like a floating-point input of the sample: a denoiser's noise prediction, an
  autoencoder's reconstruction, each element one row: read as rows of logits over its last
  spatial dimension, a diffusion UNet's rate came out 0.97 where its squared error's
  curvature gives 0.18, and it diverged at SGD lr=1 under ``lr='auto'``; a segmentation net
  with as many classes as its input has channels is shaped like its input too, and read so:
  the squared error's rate is the lower one, 0.25 where its cross-entropy's is 0.29 on a
  small one, and the other reading would put a denoiser's rate 5x too high).  Gradient descent
  on a quadratic of that curvature is stable below ``2 / lambda``.
* **Adam**: ``lambda`` of the same matrix preconditioned as Adam preconditions it after its
  first steps, ``D^-1/2 G D^-1/2`` with ``D = sqrt(v) + eps``, ``v`` the mean squared gradient of
  :data:`CHUNKS` slices of the batch with labels drawn from the model's own softmax.

Each ``lambda`` comes from power iteration on Jacobian-vector products (``torch.func``), on
the model as it is returned, in the calibration mode (dropout off, BatchNorm statistics put
back).  Trained at it (``bench/suggested_lr_check.py``, docs/results/suggested_lr_check.md),
the CPU suite's six tasks came within 10% of the test loss at the rate chosen on validation
(0.03 nats on the language model) on 5 of 6 for SGD and 6 of 6 for Adam; treat both as the
centre of a short sweep, not a tuned rate.  The Adam rate falls behind the best one as a net
widens: on the digits MLPs it is 1.3 octaves low at width 128 and 4.5 at width 2048
(docs/results/suggested_lr_transfer.md).
"""
from __future__ import annotations

import math
import threading
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jvp, vjp

from precondfx.core.outputs import class_dim
from precondfx.pytorch import calibrate as cal, reals
from precondfx.pytorch.capture.common import Sample

#: power-iteration steps at most (each a Jacobian-vector and a vector-Jacobian product)
ITERS = 20
#: ... stopped earlier once a step raises the estimate by less than this fraction (1e-3 of
#: lambda is 0.0014 octaves of the rate; the estimate only grows, and on the suite's MLP, CNN
#: and GPT-2 it was within 0.4% of 40 steps' at 20)
CONVERGED = 1e-3
#: slices of the batch whose sampled-label gradients estimate Adam's second moment
CHUNKS = 8
#: held by a measurement: torch's forward-AD levels are process-wide, not per thread
_FORWARD_AD = threading.RLock()

#: the message of torch's lazy import of its jvp decompositions (torch.jit.script)
_JIT_SCRIPT = r"`torch\.jit\.script` is deprecated"
#: Adam's eps
EPS = 1e-8
#: central differences' step along a unit direction, relative to the parameters' norm
FD_STEP = 1e-3


def _logits(z: torch.Tensor, regression: bool = False, dim: int = -1) -> torch.Tensor:
    """Rows of logits over the class dimension ``dim`` (moved last), or one row per element
    (``regression``)."""
    if regression or z.dim() < 2:
        return z.reshape(-1, 1)
    z = z.movedim(dim, -1)
    return z.reshape(-1, z.shape[-1])


def regression_shapes(sample: Sample) -> set[tuple[int, ...]]:
    """The shapes (3 or more dimensions) of the sample's floating-point tensors: a main output
    of one of them predicts an input-shaped target (noise, a reconstruction), not logits."""
    return {tuple(t.shape) for t in sample.tensors() if t.is_floating_point() and t.dim() >= 3}


def _out_hessian(z: torch.Tensor) -> tuple[Any, str]:
    """``u -> H u`` per row of the logits ``z`` (rows x classes), and the loss it is of."""
    if z.shape[-1] == 1:
        return (lambda u: u), "squared error"
    p = torch.softmax(z.double(), -1)
    return (lambda u: p * u - p * (p * u).sum(-1, keepdim=True)), "cross-entropy"


def suggest_lr(model: nn.Module, sample: Sample, *, mode: str = "train", key: Any = None,
               seed: int = 0, iters: int = ITERS, chunks: int = CHUNKS,
               families: tuple[str, ...] = ("sgd", "adam"), only: Any = None,
               tol: float = CONVERGED, graph: Any = None) -> dict[str, Any]:
    """``{"sgd": rate, "adam": rate, "sgd_curvature", "adam_curvature", "loss", "how"}`` for
    ``model`` on ``sample`` (see the module docstring); ``families``: which of the two to
    measure (the other's entries are None); ``only``: the names of the parameters the
    optimizer steps (the curvature of the others is no limit on its rate), None: all;
    ``tol``: the power iteration stops once a step raises the estimate by less than this
    fraction (0: all ``iters`` steps); ``graph``: the model's captured graph, which says
    where the main output's classes are (:func:`precondfx.core.outputs.class_dim`: dim 1 of
    a convolution's output, a segmentation net's ``(B, C, H, W)``; else the last)."""
    while isinstance(model, nn.DataParallel):   # torch.func refuses the wrapper: the module it
        model = model.module                    # replicates computes the same function
        only = None if only is None else {n[len("module."):] for n in only
                                          if n.startswith("module.")}
    params = {n: p.detach() for n, p in model.named_parameters()
              if p.requires_grad and (only is None or n in only)}
    bufs = {n: b.detach() for n, b in model.named_buffers()}
    # the parameters the optimizer does not step, as constants: no graph through them, and
    # no products that require grad (a warning at the user's step)
    fixed = {n: p.detach() for n, p in model.named_parameters() if n not in params}
    if not params:
        return {}
    shaped = regression_shapes(sample)
    dims: list[int] = []        # the class dimension, decided on the first forward

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:   # buffers cloned: BatchNorm's update
        out = sample.call(lambda *a, **k: functional_call(
            model, ({n: b.clone() for n, b in bufs.items()}, fixed, p), a, k))
        y = cal.main_output(out, key)
        cal.check_differentiable(y, "suggest_lr=True (the curvature of a loss on it)",
                                 "drop suggest_lr=True")          # .float() would hide it
        if not dims:
            dims.append(class_dim(graph, tuple(y.shape)))
        return _logits(y.float(), tuple(y.shape) in shaped, dims[0])

    # forward-mode AD (jvp) has no rule for the fused attention kernels (CPU flash attention):
    # measured through the math kernel, the same function
    # torch's first jvp imports its decompositions through torch.jit.script, which warns
    # (DeprecationWarning, 18 times): not the user's to see, and under warnings-as-errors
    # (pytest's filterwarnings = error) it failed the measurement
    # functional dropout (``F.dropout(h, p, self.training)``, a transformers attention's) off
    # too, as in calibration: with it on, every product drew its own masks and the rate
    # moved with the user's random state (0.49 or 0.65 for 0.47 on a two-dropout MLP)
    # one measurement at a time in the process: torch's forward-AD levels are shared by all
    # threads (a jvp in a second thread failed, "a forward AD level with an invalid index", and
    # its rate came out None); a precondition in each of two threads waits here for the other
    with _FORWARD_AD, cal.quiet_run(model, mode), cal.NoDropout(), cal.math_attention(), \
            cal.checkpoint_as_call(), cal.PROCESS_STATE, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_JIT_SCRIPT, category=DeprecationWarning)
        with torch.enable_grad():   # a forward that turns gradients off: said, not a zero rate
            f({n: p.requires_grad_() for n, p in params.items()})
        params = {n: p.detach() for n, p in params.items()}
        with torch.no_grad():
            z = f(params)
        h, loss = _out_hessian(z)
        n_rows = z.shape[0]
        gen = torch.Generator().manual_seed(int(seed))
        lam_sgd = _top(f, params, h, n_rows, None, iters, gen, tol) if "sgd" in families else 0.0
        lam_adam = 0.0
        if "adam" in families:
            d = _adam_scale(f, params, z, loss, chunks, gen)
            lam_adam = _top(f, params, h, n_rows, d, iters, gen, tol)
    how = (f"1/lambda, lambda the top eigenvalue ({iters} power iterations) of the "
           f"{loss} Gauss-Newton matrix on the calibration batch (Adam: preconditioned by "
           f"sqrt(v)+eps, v from {chunks} slices with labels drawn from the model); no "
           f"constant fitted; trained at it, within 10% of the chosen rate's test loss on 5 "
           f"of 6 suite tasks for SGD, 6 of 6 for Adam (docs/results/suggested_lr_check.md): "
           f"the centre of a short sweep (the Adam rate runs low on wide nets: 4.5 octaves "
           f"below the best at MLP width 2048, docs/results/suggested_lr_transfer.md)")
    if loss == "cross-entropy" and dims and dims[0] != -1:
        loss = f"cross-entropy over dim {dims[0]}"
    out = {"sgd": 1.0 / lam_sgd if lam_sgd > 0 else None,
           "adam": 1.0 / lam_adam if lam_adam > 0 else None,
           "sgd_curvature": lam_sgd or None, "adam_curvature": lam_adam or None, "loss": loss,
           "how": how}
    return out


def _gn_forward(f: Any, params: dict, v: dict) -> tuple[Any, Any]:
    """``J v`` by forward-mode AD and the vector-Jacobian map ``u -> J^T u`` (torch.func)."""
    _, jv = jvp(f, (params,), (v,))
    _, back = vjp(f, params)
    return jv, lambda u: back(u)[0]


def _gn_reverse(f: Any, params: dict, v: dict) -> tuple[Any, Any]:
    """The same by reverse mode only, for ops without a forward-mode rule (an RNN's fused
    kernel, an ``autograd.Function`` without ``setup_context``): ``J v`` is the gradient with
    respect to ``u`` of ``<J^T u, v>``, which is linear in ``u``."""
    keys = list(params)
    p = {k: t.detach().requires_grad_(True) for k, t in params.items()}
    with torch.enable_grad():
        z = f(p)
        u = torch.zeros_like(z, requires_grad=True)
        g = torch.autograd.grad(z, [p[k] for k in keys], grad_outputs=u, create_graph=True,
                                allow_unused=True)
        dot = sum((gi * v[k]).sum() for gi, k in zip(g, keys) if gi is not None)
        jv = torch.autograd.grad(dot, u, retain_graph=True, allow_unused=True)[0] \
            if torch.is_tensor(dot) and dot.requires_grad else None
    jv = torch.zeros_like(z) if jv is None else jv

    def back(hu: torch.Tensor) -> dict:
        with torch.enable_grad():
            gs = torch.autograd.grad(z, [p[k] for k in keys], grad_outputs=hu,
                                     allow_unused=True)
        return {k: torch.zeros_like(p[k]) if gk is None else gk for k, gk in zip(keys, gs)}
    return jv.detach(), back


def _gn_differences(f: Any, params: dict, v: dict) -> tuple[Any, Any]:
    """``J v`` by central differences, for a model with ops that have neither a forward-mode
    rule nor a second derivative (``nn.EmbeddingBag``'s backward): a step of ``FD_STEP`` of
    the parameters' norm along ``v`` (dropout is off while measuring, so both evaluations are
    the same function); the vector-Jacobian map by reverse mode, which such ops have."""
    norm = lambda d: math.sqrt(sum(float(_real(t).pow(2).sum()) for t in d.values()))  # noqa: E731
    vn = norm(v)
    eps = FD_STEP * (norm(params) or 1.0) / (vn or 1.0)
    with torch.no_grad():
        zp = f({k: p + eps * v[k] for k, p in params.items()})
        zm = f({k: p - eps * v[k] for k, p in params.items()})
    jv = ((zp.double() - zm.double()) / (2 * eps)).to(zp.dtype)
    _, back = vjp(f, params)
    return jv, lambda u: back(u)[0]


#: the products tried in turn: forward mode, reverse over reverse, central differences
_GN_PRODUCTS = (_gn_forward, _gn_reverse, _gn_differences)


def _top(f: Any, params: dict, h: Any, n_rows: int, d: dict | None, iters: int,
         gen: torch.Generator, tol: float = CONVERGED) -> float:
    """Top eigenvalue of ``J^T H J / n`` (``d``: of ``D^-1/2 (.) D^-1/2``), power iteration;
    forward-mode products where every op has a rule, else reverse-mode ones, else central
    differences (``_GN_PRODUCTS``)."""
    how = [_gn_forward]

    def mv(v: dict) -> dict:
        vv = {k: _scaled(v[k], d[k]) for k in v} if d else v
        while True:
            try:
                jv, back = how[0](f, params, vv)
                break
            except (NotImplementedError, RuntimeError):
                i = _GN_PRODUCTS.index(how[0])
                if i == len(_GN_PRODUCTS) - 1:
                    raise
                how[0] = _GN_PRODUCTS[i + 1]
        hu = h(jv.double()) / n_rows
        g = back(hu.to(jv.dtype))
        return {k: _scaled(g[k], d[k]) for k in g} if d else g

    v = {k: _draw(t, gen) for k, t in params.items()}
    lam = 0.0
    for _ in range(iters):
        nrm = math.sqrt(sum(float((_real(t) * _real(t)).sum()) for t in v.values()))
        if nrm == 0 or not math.isfinite(nrm):
            return 0.0
        v = {k: t / nrm for k, t in v.items()}
        w = mv(v)
        prev, lam = lam, sum(float((_real(w[k]) * _real(v[k])).sum()) for k in v)
        if 0 < lam - prev <= tol * lam or lam == prev:
            break
        v = w
    return lam


_real = reals.as_real   # a complex parameter (or direction): its real and imaginary parts


def _draw(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random direction shaped like ``t``: both parts random for a complex parameter."""
    if t.is_complex():
        return torch.view_as_complex(torch.randn((*t.shape, 2), generator=gen)).to(t)
    return torch.randn(t.shape, generator=gen).to(t)


def _scaled(v: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``v / d`` per real coordinate: a complex ``v`` has a real ``d`` of shape ``(..., 2)``,
    one scale for its real and one for its imaginary parts, as Adam keeps them."""
    if v.is_complex():
        return torch.view_as_complex((torch.view_as_real(v) / d.to(v.real.dtype)).contiguous())
    return v / d


def _adam_scale(f: Any, params: dict, z: torch.Tensor, loss: str, chunks: int,
                gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``sqrt(sqrt(v) + eps)`` per parameter, ``v`` the mean squared gradient over ``chunks``
    slices of the rows, with labels drawn from the model's softmax (targets = output +
    unit noise for the squared error)."""
    pp = {k: t.clone().requires_grad_(True) for k, t in params.items()}
    out = f(pp)
    if loss == "cross-entropy":
        y = torch.multinomial(torch.softmax(z.double(), -1), 1, generator=gen).squeeze(-1)
    else:
        y = z.detach() + torch.randn(z.shape, generator=gen).to(z)
    sq = {k: torch.zeros_like(_real(t), dtype=t.real.dtype) for k, t in params.items()}
    parts = [s for s in torch.arange(out.shape[0]).tensor_split(min(chunks, out.shape[0]))
             if len(s)]
    for i, rows in enumerate(parts):
        o, t = out[rows], y[rows]
        ell = F.cross_entropy(o, t) if loss == "cross-entropy" else 0.5 * F.mse_loss(o, t)
        grads = torch.autograd.grad(ell, list(pp.values()), retain_graph=i < len(parts) - 1,
                                    allow_unused=True)
        for k, g in zip(pp, grads):
            if g is not None:      # a complex one per part, as torch.optim.Adam keeps it
                g = g.detach()
                sq[k] += (torch.view_as_real(g) if g.is_complex() else g) ** 2 / len(parts)
    return {k: (v.sqrt() + EPS).sqrt() for k, v in sq.items()}


__all__ = ["suggest_lr", "ITERS", "CHUNKS"]
