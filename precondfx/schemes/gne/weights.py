"""Weight initializers with the activation-aware gains (A.2.9, A.3 "Per-activation gain init")."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from precondfx.errors import PrecondError
from precondfx.schemes.gne.gains import conv_effective_kernel, gne_gain

_KINDS = ("gaussian", "orthogonal", "delta_orthogonal")


@torch.no_grad()
def gne_init_(
    weight: torch.Tensor, *, gain: float, kind: str = "gaussian", effective_k: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Initialize a linear/conv weight in place so its Jacobian has ``phi = gain^2``
    (Tables 4/5; A.3).  ``weight`` is ``[out, in]`` or ``[c_out, c_in/groups, *k]``.

    * ``gaussian``: ``N(0, gain^2/n)`` with ``n = c_in/groups * k~`` (``k~ = effective_k`` if given,
      else the nominal kernel size), eq. 17.
    * ``orthogonal``: the kernel reshaped to ``c_out x (c_in k)`` made orthogonal with
      ``beta = gain``; expanding shapes get ``beta^2 *= c_out/(c_in k)`` [DERIVED, A.2.6] and a
      given ``effective_k`` multiplies ``beta^2`` by ``k/k~`` to undo the padding cut-off.
    * ``delta_orthogonal``: an orthogonal ``c_out x c_in`` matrix (``beta`` as above) at the centre
      tap, zeros elsewhere (A.2.9 [CODE]); no cut-off correction is needed.

    Returns ``weight``.  Multiply ``gain`` by :func:`fixup_branch_scale` for residual branches."""
    if weight.dim() < 2:
        raise PrecondError(f"gne_init_ needs a weight with >= 2 dims, got shape {tuple(weight.shape)}.")
    if kind not in _KINDS:
        raise PrecondError(f"kind must be one of {_KINDS}, got {kind!r}.")
    c_out, c_in = weight.shape[0], weight.shape[1]
    k = math.prod(weight.shape[2:]) if weight.dim() > 2 else 1
    n_nom = c_in * k
    if effective_k is not None and not 0 < effective_k <= k:
        raise PrecondError(f"effective_k must be in (0, {k}], got {effective_k!r}.")
    if kind == "gaussian":
        n = c_in * (effective_k if effective_k is not None else k)
        return weight.normal_(0.0, gain / math.sqrt(n), generator=generator)
    if kind == "orthogonal":
        mat = torch.empty(c_out, n_nom, dtype=weight.dtype, device=weight.device)
        nn.init.orthogonal_(mat, generator=generator)
        b2 = gain * gain * (c_out / n_nom if c_out > n_nom else 1.0)
        if effective_k is not None:
            b2 *= k / effective_k
        return weight.copy_(mat.view_as(weight) * math.sqrt(b2))
    if weight.dim() < 3:
        raise PrecondError("delta_orthogonal needs a conv weight [c_out, c_in, *k].")
    mat = torch.empty(c_out, c_in, dtype=weight.dtype, device=weight.device)
    nn.init.orthogonal_(mat, generator=generator)
    b2 = gain * gain * (c_out / c_in if c_out > c_in else 1.0)
    weight.zero_()
    centre = (slice(None), slice(None)) + tuple(s // 2 for s in weight.shape[2:])
    weight[centre] = mat * math.sqrt(b2)
    return weight


def gne_layer_init_(
    module: nn.Module, *, activation: str | nn.Module | None = "relu", slope: float | None = None,
    kind: str = "gaussian", input_size: int | Sequence[int] | None = None, gamma0: float = 1.0,
    scale: float = 1.0, zero_bias: bool = True, generator: torch.Generator | None = None,
) -> nn.Module:
    """Apply :func:`gne_init_` to an ``nn.Linear`` / ``nn.Conv{1,2,3}d`` followed by
    ``activation``: gain from :func:`gne_gain` times ``scale`` (e.g. a Fixup branch scale), the
    effective kernel size from ``input_size`` (spatial, for convs; nominal kernel if omitted),
    bias zeroed.  Returns the module."""
    if not isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        raise PrecondError(f"gne_layer_init_ supports nn.Linear and nn.Conv1d/2d/3d, got {type(module).__name__}.")
    if torch.nn.utils.parametrize.is_parametrized(module, "weight"):
        raise PrecondError("this layer's weight is parametrized (e.g. weight_norm); initialize it with wn_math instead.")
    gain = gne_gain(activation, slope=slope, gamma0=gamma0) * scale
    eff = None
    if input_size is not None and not isinstance(module, nn.Linear) and kind != "delta_orthogonal":
        eff = conv_effective_kernel(module, input_size)
    gne_init_(module.weight, gain=gain, kind=kind, effective_k=eff, generator=generator)
    if zero_bias and getattr(module, "bias", None) is not None:
        with torch.no_grad():
            module.bias.zero_()
    return module

