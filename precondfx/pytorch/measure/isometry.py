"""Block dynamical isometry estimators for any torch callable block ``f``.

Spec: ``shared/spec/chen-arpit-spec.md`` A.2.1-A.2.2 ([001] definitions, [DERIVED] Hutchinson
algorithm).  For a block ``f: R^n -> R^m`` applied sample-wise to a batch ``x`` with per-sample
Jacobians ``J_b`` and ``A_b = J_b J_b^T``:

* ``phi = mean_b tr(A_b)/m`` (normalized trace; step 4), estimated with Gaussian probes
  ``v``: ``E ||J^T v||^2 = Tr(A)``;
* ``phi2 = mean_b Tr(A_b^2)/m`` (step 5), by (a) ``method='vjp'``: the probe variance
  ``Var(v^T A v) = 2 Tr(A^2)``, (b) ``method='jvp'``: ``E ||J J^T v||^2 = Tr(A^2)`` through the
  double-VJP trick, or (c) ``method='exact'``: materialized per-sample Jacobians;
* ``varphi = phi2 - phi^2`` with the square of the *mean* (step 6).

Standard errors are delete-one jackknife errors over the probes (probe noise, i.e. conditional
on ``x`` and the current weights), or over the weight re-draws when ``num_draws > 1`` (the
paper's expectation over weights).  Put batch-coupled normalization layers in eval mode first
(step 1): the estimators assume ``J`` is block diagonal over the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from precondfx.errors import PrecondError

__all__ = [
    "IsometryEstimate",
    "estimate_block_isometry",
    "gradient_norm_gain",
    "forward_moment_ratio",
    "positive_fraction",
]

_METHODS = ("vjp", "jvp", "exact")


@dataclass(frozen=True)
class IsometryEstimate:
    """Estimated spectrum moments of a block's ``J J^T`` (spec A.2.2) with standard errors.

    ``phi``: mean eigenvalue ``E[tr(J J^T)]``; ``phi2``: ``phi((J J^T)^2)``; ``varphi``:
    ``phi2 - phi^2`` (Def. 3.1's variance term); ``*_se``: standard errors (0 for the exact method
    with one draw); ``m``/``n``: per-sample output/input lengths."""

    phi: float
    phi_se: float
    phi2: float
    phi2_se: float
    varphi: float
    varphi_se: float
    m: int
    n: int
    batch_size: int
    num_probes: int
    num_draws: int
    method: str


def _per_sample_sq(t: torch.Tensor, batched: bool) -> torch.Tensor:
    """Per-sample squared norms, float64, shape ``[B]``."""
    t = t.detach().to(torch.float64)
    return t.reshape(t.shape[0], -1).pow(2).sum(1) if batched else t.pow(2).sum().reshape(1)


def _jackknife(
    values: torch.Tensor, stat: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Delete-one jackknife over dim 0 of ``values``: (estimate, standard error, replicates) of
    the vector statistic ``stat``."""
    r = values.shape[0]
    est = stat(values)
    if r < 2:
        return est, torch.zeros_like(est), est.unsqueeze(0)
    reps = torch.stack([stat(torch.cat([values[:i], values[i + 1:]])) for i in range(r)])
    se = ((r - 1) / r * (reps - reps.mean(0)).pow(2).sum(0)).sqrt()
    return est, se, reps


def _probe_quantities(
    f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, num_probes: int, method: str, batched: bool,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None, int, int, int]:
    """Run the probes once: ``q[p, b] = ||J_b^T v||^2`` and, for 'jvp', ``r[p, b] = ||J_b J_b^T v||^2``."""
    with torch.enable_grad():
        xr = x.detach().clone().requires_grad_(True)
        y = f(xr)
        if not isinstance(y, torch.Tensor):
            raise PrecondError("the block must return a single tensor.")
        if not y.requires_grad:
            raise PrecondError("the block's output does not depend differentiably on its input.")
        bsz = x.shape[0] if batched else 1
        if batched and (y.dim() == 0 or y.shape[0] != bsz):
            raise PrecondError(
                f"batched=True needs the output's first dim to be the batch ({bsz}); got shape {tuple(y.shape)}."
            )
        m, n = y.numel() // bsz, x.numel() // bsz
        u = None
        s = None
        if method == "jvp":
            u = torch.zeros_like(y, requires_grad=True)
            (s,) = torch.autograd.grad(y, xr, u, create_graph=True, retain_graph=True)
        qs, rs = [], []
        for _ in range(num_probes):
            v = torch.randn(y.shape, generator=generator, dtype=y.dtype, device=y.device)
            (w,) = torch.autograd.grad(y, xr, v, retain_graph=True)
            qs.append(_per_sample_sq(w, batched))
            if method == "jvp":
                (jw,) = torch.autograd.grad(s, u, w, retain_graph=True)
                rs.append(_per_sample_sq(jw, batched))
    return torch.stack(qs), (torch.stack(rs) if rs else None), m, n, bsz


def _exact_quantities(
    f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batched: bool
) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """Per-sample ``Tr(A_b)`` and ``Tr(A_b^2)`` from materialized Jacobians (step 5c)."""
    samples = [x[b:b + 1].detach() for b in range(x.shape[0])] if batched else [x.detach()]
    tr1, tr2 = [], []
    m = n = 0
    for xb in samples:
        with torch.enable_grad():
            jac = torch.autograd.functional.jacobian(f, xb, vectorize=True)
        n = xb.numel()
        m = jac.numel() // n
        j = jac.reshape(m, n).to(torch.float64)
        gram = j @ j.T if m <= n else j.T @ j
        tr1.append(j.pow(2).sum())
        tr2.append(gram.pow(2).sum())
    return torch.stack(tr1), torch.stack(tr2), m, n, len(samples)


def estimate_block_isometry(
    f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, num_probes: int = 32, method: str = "vjp",
    batched: bool = True, redraw: Callable[[], None] | None = None, num_draws: int = 1,
    generator: torch.Generator | None = None,
) -> IsometryEstimate:
    """Estimate ``phi``, ``phi((JJ^T)^2)`` and ``varphi`` of block ``f`` at input ``x`` (A.2.2).

    ``f`` maps a batch to a batch sample-wise (``batched=True``: dim 0 of ``x`` and ``f(x)`` is the
    batch) or ``x`` is one sample (``batched=False``).  ``method``: ``'vjp'`` (Gaussian probes,
    needs ``num_probes >= 4``, relative error of ``phi2`` about ``sqrt(2/P)``), ``'jvp'`` (lower
    variance, needs double-differentiable ops), ``'exact'`` (small blocks only).  ``redraw``, if
    given, re-initializes the block's weights before each of ``num_draws`` draws so the estimate
    targets the expectation over weights; the standard errors then come from the spread over
    draws."""
    if method not in _METHODS:
        raise PrecondError(f"method must be one of {_METHODS}, got {method!r}.")
    if method != "exact" and num_probes < (4 if method == "vjp" else 2):
        raise PrecondError(f"method={method!r} needs num_probes >= {4 if method == 'vjp' else 2}, got {num_probes}.")
    if num_draws < 1 or (num_draws > 1 and redraw is None):
        raise PrecondError("num_draws > 1 needs a redraw() callable that re-initializes the block.")

    per_draw: list[tuple[torch.Tensor, torch.Tensor]] = []  # (phi, phi2) per draw
    m = n = bsz = 0
    probe_rows: torch.Tensor | None = None
    for _ in range(num_draws):
        if redraw is not None:
            redraw()
        if method == "exact":
            t1, t2, m, n, bsz = _exact_quantities(f, x, batched)
            per_draw.append((t1.mean() / m, t2.mean() / m))
            continue
        q, r, m, n, bsz = _probe_quantities(f, x, num_probes, method, batched, generator)
        if method == "jvp":
            rows = torch.stack([q / m, r / m], dim=-1)  # [P, B, 2]
        else:
            rows = (q / m).unsqueeze(-1)  # [P, B, 1]
        if num_draws == 1:
            probe_rows = rows
        per_draw.append(_probe_stats(rows, method, m))

    def varphi_of(phi: torch.Tensor, phi2: torch.Tensor) -> torch.Tensor:
        return phi2 - phi * phi

    if num_draws > 1:
        vals = torch.stack([torch.stack(pd) for pd in per_draw])  # [R, 2]

        def stat(v: torch.Tensor) -> torch.Tensor:
            phi, phi2 = v[:, 0].mean(), v[:, 1].mean()
            return torch.stack([phi, phi2, varphi_of(phi, phi2)])

        est, se, _ = _jackknife(vals, stat)
    elif method == "exact":
        phi, phi2 = per_draw[0]
        est, se = torch.stack([phi, phi2, varphi_of(phi, phi2)]), torch.zeros(3, dtype=torch.float64)
    else:
        assert probe_rows is not None

        def stat(rows: torch.Tensor) -> torch.Tensor:
            phi, phi2 = _probe_stats(rows, method, m)
            return torch.stack([phi, phi2, varphi_of(phi, phi2)])

        est, se, reps = _jackknife(probe_rows, stat)
        # jackknife bias correction for the nonlinear varphi (removes the O(1/P) bias of phi^2)
        p = probe_rows.shape[0]
        est = est.clone()
        est[2] = p * est[2] - (p - 1) * reps[:, 2].mean()
    e = [float(t) for t in est]
    s = [float(t) for t in se]
    return IsometryEstimate(
        phi=e[0], phi_se=s[0], phi2=e[1], phi2_se=s[1], varphi=e[2], varphi_se=s[2], m=m, n=n,
        batch_size=bsz, num_probes=0 if method == "exact" else num_probes, num_draws=num_draws, method=method,
    )


def _probe_stats(rows: torch.Tensor, method: str, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(phi, phi2)`` from probe rows ``[P, B, k]`` (``k=1``: q/m; ``k=2``: q/m, r/m)."""
    phi = rows[..., 0].mean()
    if method == "jvp":
        phi2 = rows[..., 1].mean()
    else:
        # unbiased variance over probes of q_b = v^T A_b v is 2 Tr(A_b^2): phi2 = mean_b Var/(2m);
        # rows hold q/m, so Var(q)/(2m) = m * Var(q/m) / 2.
        phi2 = rows[..., 0].var(dim=0, unbiased=True).mean() * m / 2.0
    return phi, phi2


def gradient_norm_gain(
    f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, num_probes: int = 4,
    generator: torch.Generator | None = None,
) -> tuple[float, float]:
    """Backward gain ``||dL/dx_0||^2 / ||dL/dx_L||^2`` of ``f`` at ``x`` for random Gaussian output
    gradients ``dL/dx_L = u`` (eq. 10: its expectation is ``phi(JJ^T) * m/n`` and equals ``phi``
    when input and output lengths agree).  Returns ``(mean over probes, standard error)``."""
    with torch.enable_grad():
        xr = x.detach().clone().requires_grad_(True)
        y = f(xr)
        ratios = []
        for _ in range(num_probes):
            u = torch.randn(y.shape, generator=generator, dtype=y.dtype, device=y.device)
            (g,) = torch.autograd.grad(y, xr, u, retain_graph=True)
            ratios.append(float(g.double().pow(2).sum() / u.double().pow(2).sum()))
    t = torch.tensor(ratios, dtype=torch.float64)
    se = float(t.std(unbiased=True) / math.sqrt(len(ratios))) if len(ratios) > 1 else 0.0
    return float(t.mean()), se


@torch.no_grad()
def forward_moment_ratio(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    """Forward-only proxy ``E[||y||^2/len(y)] / E[||x||^2/len(x)]`` (Prop. 5.5, A.2.2 step 7):
    equals ``phi`` only for blocks of general linear transforms (zero-mean linear/conv, ReLU,
    leaky ReLU, data normalization); not through tanh, SELU, max-pool or residual adds."""
    y = f(x)
    return float(y.double().pow(2).mean() / x.double().pow(2).mean())


@torch.no_grad()
def positive_fraction(t: torch.Tensor) -> float:
    """``p = P(x > 0)`` of pre-activations, to feed the ReLU/leaky-ReLU table rows when the input
    is not zero-mean (after residual adds or concats; A.3)."""
    return float((t > 0).double().mean())
