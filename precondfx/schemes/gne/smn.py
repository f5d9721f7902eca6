"""Second Moment Normalization and the weight-centering parametrization it is paired with
(A.2.10, eq. 25-26, Algorithm 1)."""
from __future__ import annotations

import torch
from torch import nn

from precondfx.errors import PrecondError


class CenteredWeight(nn.Module):
    """Parametrization ``K -> K - mean(K[c_out, :])`` (eq. 26, Algorithm 1 steps 1-2): the weight
    mean is removed per output channel so that SMN's zero-mean assumption holds during training."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:  # noqa: D102
        dims = tuple(range(1, weight.dim()))
        return weight - weight.mean(dim=dims, keepdim=True)


def register_weight_centering(module: nn.Module, name: str = "weight") -> nn.Module:
    """Register :class:`CenteredWeight` on ``module.<name>`` (the conv/linear before an SMN)."""
    torch.nn.utils.parametrize.register_parametrization(module, name, CenteredWeight())
    return module


class SecondMomentNorm(nn.Module):
    """Second Moment Normalization (eq. 25, Algorithm 1; A.2.10): per channel (dim 1),
    ``y = beta + gamma * x / (sqrt(E[x^2]) + eps)`` with the second moment taken over the batch
    and all spatial positions; no mean subtraction (pair it with :func:`register_weight_centering`
    on the preceding layer).  Drop-in for ``BatchNorm{1,2,3}d``: same constructor arguments, any
    input ``[N, C, *]``.

    Eval mode divides by ``running_rms + eps``, a BN-style running average of the batch RMS
    ``sqrt(alpha_2)`` ([CODE]: eps outside the sqrt; the authors store it in ``running_var``).
    ``momentum=None`` uses a cumulative average, like BN.  ``norm='l1'`` gives the L1 variant
    ``x / E|x|`` (eq. 29).  Per eq. 27 [RECON] its Jacobian has ``phi ~= 1/alpha_2``."""

    def __init__(
        self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
        track_running_stats: bool = True, norm: str = "l2", device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if norm not in ("l2", "l1"):
            raise PrecondError(f"norm must be 'l2' or 'l1', got {norm!r}.")
        fk = {"device": device, "dtype": dtype}
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        self.norm = norm
        if affine:
            self.weight = nn.Parameter(torch.ones(num_features, **fk))
            self.bias = nn.Parameter(torch.zeros(num_features, **fk))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            self.register_buffer("running_rms", torch.ones(num_features, **fk))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))
        else:
            self.register_buffer("running_rms", None)
            self.register_buffer("num_batches_tracked", None)

    @classmethod
    def from_batchnorm(cls, bn: nn.modules.batchnorm._BatchNorm) -> SecondMomentNorm:
        """An SMN with the BN's hyper-parameters and (copied) affine parameters."""
        ref = bn.weight if bn.affine else bn.running_mean
        fk = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
        smn = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, **fk)
        if bn.affine:
            with torch.no_grad():
                smn.weight.copy_(bn.weight)
                smn.bias.copy_(bn.bias)
        return smn

    def reset_running_stats(self) -> None:
        """Running RMS back to 1 and the batch counter to 0."""
        if self.track_running_stats:
            self.running_rms.fill_(1.0)
            self.num_batches_tracked.zero_()

    def reset_parameters(self) -> None:
        """Reset running statistics and the affine parameters to (1, 0)."""
        self.reset_running_stats()
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def _batch_scale(self, x: torch.Tensor) -> torch.Tensor:
        dims = [0] + list(range(2, x.dim()))
        if self.norm == "l2":
            return x.pow(2).mean(dim=dims).sqrt()
        return x.abs().mean(dim=dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise PrecondError(
                f"SecondMomentNorm expects input [N, {self.num_features}, *], got shape {tuple(x.shape)}."
            )
        use_batch = self.training or not self.track_running_stats
        if use_batch:
            scale = self._batch_scale(x)
            if self.training and self.track_running_stats:
                with torch.no_grad():
                    self.num_batches_tracked.add_(1)
                    mom = (1.0 / float(self.num_batches_tracked)) if self.momentum is None else self.momentum
                    self.running_rms.mul_(1.0 - mom).add_(scale.detach().to(self.running_rms.dtype), alpha=mom)
        else:
            scale = self.running_rms
        shape = (1, -1) + (1,) * (x.dim() - 2)
        y = x / (scale + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"track_running_stats={self.track_running_stats}, norm={self.norm!r}"
        )

