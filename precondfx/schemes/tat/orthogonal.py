"""Scaled-uniform-orthogonal and Delta-orthogonal initializers for torch tensors (spec §2.9;
paper App. D)."""

from __future__ import annotations

import math

import torch

from precondfx.errors import PrecondError


def _suo_matrix(out_dim: int, in_dim: int, generator: torch.Generator | None) -> torch.Tensor:
    """Scaled uniform orthogonal out x in matrix (float64), paper App. D.

    Haar-distributed: a Gaussian min x max draw X is orthonormalised by Cholesky-QR applied
    twice (W = L^-1 X with L L^T = X X^T, i.e. the Q factor of X^T with positive-diagonal R,
    which is the sign-fixed QR the reference uses; the second pass restores orthogonality to
    rounding), falling back to Householder QR if a Cholesky fails. Orthonormal rows when
    out <= in, orthonormal columns when out > in, then times max(sqrt(out/in), 1).
    """
    big, small = max(out_dim, in_dim), min(out_dim, in_dim)
    x = torch.randn(small, big, dtype=torch.float64, generator=generator)
    w = x
    for _ in range(2):
        chol, info = torch.linalg.cholesky_ex(w @ w.T)
        if int(info) != 0:
            q, r = torch.linalg.qr(x.T)
            d = torch.sign(torch.diagonal(r))
            d[d == 0] = 1.0
            w = (q * d).T
            break
        w = torch.linalg.solve_triangular(chol, w, upper=False)
    w = w if out_dim <= in_dim else w.T
    return w * max(math.sqrt(out_dim / in_dim), 1.0)


def orthogonal_(weight: torch.Tensor, gain: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """In-place scaled uniform orthogonal (SUO) init in PyTorch layout (spec §2.9; paper App. D).

    ``weight`` is (out, in, *kernel) (Linear or a non-delta conv, flattened to out x in*prod(k)).
    W is Haar-orthogonal times max(sqrt(out/fan_in), 1) * gain: ||Wx|| = sqrt(out/in)||x||
    exactly when out >= in (q preserved), and in expectation when out < in.
    """
    if weight.dim() < 2:
        raise PrecondError("orthogonal_ needs a tensor with at least 2 dimensions (out, in, ...).")
    out_dim = weight.shape[0]
    fan_in = weight[0].numel()
    w = _suo_matrix(out_dim, fan_in, generator) * gain
    with torch.no_grad():
        weight.copy_(w.reshape(weight.shape).to(weight.dtype))
    return weight


def delta_orthogonal_(
    weight: torch.Tensor, gain: float = 1.0, groups: int = 1, generator: torch.Generator | None = None
) -> torch.Tensor:
    """In-place Delta-orthogonal init of a ConvNd weight (out, in/groups, *k) (spec §2.9).

    All taps are zero except the spatial centre, which holds an SUO matrix per group of shape
    (out/groups) x (in/groups) (orthonormal rows if out < in, columns if out > in, scaled by
    max(sqrt(out/in), 1) from channel counts only) times ``gain``. At init the conv acts as an
    independent dense layer per location. Kernel sizes must be odd.
    """
    if weight.dim() < 3:
        raise PrecondError("delta_orthogonal_ needs a conv weight (out, in/groups, k1, ...).")
    ks = tuple(weight.shape[2:])
    if any(k % 2 == 0 for k in ks):
        raise PrecondError(f"Delta initialisation needs odd kernel sizes, got {ks}; use orthogonal_ instead.")
    out_dim, in_per_group = weight.shape[0], weight.shape[1]
    if groups < 1 or out_dim % groups:
        raise PrecondError(f"out_channels={out_dim} is not divisible by groups={groups}.")
    og = out_dim // groups
    centre = (slice(None), slice(None)) + tuple(k // 2 for k in ks)
    mat = torch.cat([_suo_matrix(og, in_per_group, generator) for _ in range(groups)], dim=0) * gain
    with torch.no_grad():
        weight.zero_()
        weight[centre] = mat.to(weight.dtype)
    return weight
