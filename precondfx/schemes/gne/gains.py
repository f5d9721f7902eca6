"""Activation-aware gains and the Table 4/5 block moments (A.2.9), Fixup-style branch scaling
(A.2.14), and the effective kernel size of zero-padded convolutions (A.2.7)."""
from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from precondfx.core.fans import _tup, effective_kernel_size
from precondfx.errors import PrecondError
from precondfx.schemes.gne.moments import (Moments, dense_gaussian_moments, identity_moments,
                                           leaky_relu_moments, orthogonal_moments, relu_moments,
                                           selu_moments, serial_moments, sprelu_moments,
                                           tanh_moments)

_LINEAR_NAMES = {"linear", "identity", "none", "conv", "conv1d", "conv2d", "conv3d"}


def _activation_spec(activation: str | nn.Module | None, slope: float | None) -> tuple[str, float | None]:
    """Normalize an activation given by name or module to ``(name, slope)``."""
    if activation is None:
        return "linear", None
    if isinstance(activation, nn.Module):
        if isinstance(activation, nn.Identity):
            return "linear", None
        if isinstance(activation, nn.ReLU):
            return "relu", None
        if isinstance(activation, nn.LeakyReLU):
            return "leaky_relu", float(activation.negative_slope)
        if isinstance(activation, nn.Tanh):
            return "tanh", None
        if isinstance(activation, nn.SELU):
            return "selu", None
        if isinstance(activation, nn.PReLU):
            return "prelu", float(activation.weight.detach().mean())
        raise PrecondError(
            f"no BDI gain is known for activation {type(activation).__name__}; supported: Identity, "
            "ReLU, LeakyReLU, Tanh, SELU, PReLU (or pass gain=1/sqrt(phi_act) yourself)."
        )
    name = str(activation).lower().replace("-", "_")
    if name in _LINEAR_NAMES:
        return "linear", None
    if name in {"leakyrelu", "lrelu"}:
        name = "leaky_relu"
    return name, slope


def gne_gain(activation: str | nn.Module | None = "relu", *, slope: float | None = None, gamma0: float = 1.0) -> float:
    """Gain ``c`` with weight std ``c/sqrt(n)`` (Gaussian) or ``beta = c`` (orthogonal) that gives
    a linear+activation block ``phi = 1`` (Tables 4-6, [CODE] gains): linear/tanh 1, ReLU
    ``sqrt 2``, leaky ReLU ``sqrt(2/(1+slope^2))``, PReLU and sPReLU ``sqrt 2`` (as in the authors'
    code: plain PReLU then has ``phi = (1+a^2)/... > 1`` per block, the instability sPReLU fixes),
    SELU ``sqrt(gamma0)`` (eq. 32: the linear layer has ``phi = gamma0``)."""
    name, slope = _activation_spec(activation, slope)
    if name == "linear" or name == "tanh":
        return 1.0
    if name in {"relu", "prelu", "sprelu"}:
        return math.sqrt(2.0)
    if name == "leaky_relu":
        g = 0.01 if slope is None else float(slope)
        return math.sqrt(2.0 / (1.0 + g * g))
    if name == "selu":
        return math.sqrt(gamma0)
    raise PrecondError(
        f"no BDI gain is known for activation {name!r}; supported: linear, relu, leaky_relu, tanh, "
        "prelu, sprelu, selu (or pass gain=1/sqrt(phi_act) yourself)."
    )


def gne_std(fan_in: float, gain: float) -> float:
    """Gaussian weight std ``gain / sqrt(n)`` (eq. 17, Table 4), ``n = c_in/groups * k~``."""
    return gain / math.sqrt(fan_in)


def activation_moments(
    activation: str | nn.Module | None, *, slope: float | None = None, p: float = 0.5,
    selu: tuple[float, float] | None = None, var: float = 1.0,
) -> Moments:
    """Table 3 moments of an activation by name/module (``p = P(x>0)``; SELU uses ``selu=(lam,
    alpha)`` at pre-activation variance ``var``, default the standard constants)."""
    name, slope = _activation_spec(activation, slope)
    if name == "linear":
        return identity_moments()
    if name == "relu":
        return relu_moments(p)
    if name in {"leaky_relu", "prelu"}:
        return leaky_relu_moments((0.25 if name == "prelu" else 0.01) if slope is None else slope, p)
    if name == "sprelu":
        return sprelu_moments(0.25 if slope is None else slope, p)
    if name == "tanh":
        return tanh_moments()
    if name == "selu":
        lam, alpha = selu if selu is not None else (1.0507009873554805, 1.6732632423543772)
        return selu_moments(lam, alpha, var)
    raise PrecondError(f"activation {name!r} is not in the components table (A.2.6).")


def linear_act_block_moments(
    activation: str | nn.Module | None, fan_in: int, fan_out: int, *, kind: str = "gaussian",
    gain: float | None = None, slope: float | None = None, p: float = 0.5,
) -> Moments:
    """Moments of one ``linear -> activation`` block (Sec. 5.1, eq. 17, Tables 4/5) via the
    serial rule.  ``gain=None`` uses :func:`gne_gain`, which gives ``phi = 1`` and
    ``varphi = 1 + m/n`` (KM+ReLU), ``((1-g^2)/(1+g^2))^2 + m/n`` (Gaussian + leaky ReLU), and
    without the ``m/n`` term for orthogonal kernels.  Orthogonal expanding layers are assumed to
    carry the ``beta^2 m/n`` correction of :func:`gne_init_`."""
    if gain is None:
        gain = gne_gain(activation, slope=slope)
    if kind == "gaussian":
        kern = dense_gaussian_moments(fan_in, fan_out, gne_std(fan_in, gain))
    elif kind in {"orthogonal", "delta_orthogonal"}:
        beta = gain * (math.sqrt(fan_out / fan_in) if fan_out > fan_in else 1.0)
        kern = orthogonal_moments(beta, fan_in, fan_out)
    else:
        raise PrecondError(f"kind must be 'gaussian' or 'orthogonal', got {kind!r}.")
    act = activation_moments(activation, slope=slope, p=p)
    return serial_moments([(kern, fan_out), (act, fan_out)])


def fixup_branch_scale(num_blocks: int, convs_per_branch: int, p: float = 1.5) -> float:
    """Chen's Fixup form (Prop. 6.2, A.2.14): multiply every one of the ``m`` activated branch
    convs' init (Kaiming std, or orthogonal ``beta = sqrt 2``) by ``L^{-p/(2m)}`` so that a block
    has ``phi = 1 + L^{-p}``; ``L`` = residual blocks in the whole net, ``p > 1`` (1.5 was best).
    Projection shortcuts keep gain 1."""
    if p <= 1.0:
        raise PrecondError(f"Prop. 6.2 needs p > 1 for gradient norm equality, got p={p!r}.")
    return float(num_blocks) ** (-p / (2.0 * convs_per_branch))


def conv_effective_kernel(conv: nn.Module, input_size: int | Sequence[int]) -> float:
    """Effective kernel size of a ``nn.Conv{1,2,3}d`` module for a given spatial input size."""
    if not isinstance(conv, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        raise PrecondError(f"expected nn.Conv1d/2d/3d, got {type(conv).__name__}.")
    d = len(conv.kernel_size)
    return effective_kernel_size(
        _tup(input_size, d), conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.padding_mode
    )

