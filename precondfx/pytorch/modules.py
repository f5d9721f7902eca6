"""Modules precondfx inserts into a rewritten model.

They are plain ``nn.Module`` classes defined here (not built on the fly), with their constants as
buffers, so rewritten models pickle, save with ``state_dict``, deep-copy and export to ONNX.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class ScaledLeakyReLU(nn.Module):
    """``scale * leaky_relu(x, negative_slope)``: TAT's TReLU with ``scale =
    sqrt(2/(1+slope^2))`` keeps the second moment of a unit Gaussian input (Zhang et al.)."""

    def __init__(self, negative_slope: float, scale: float | None = None) -> None:
        super().__init__()
        if scale is None:
            scale = math.sqrt(2.0 / (1.0 + negative_slope ** 2))
        self.negative_slope = float(negative_slope)
        self.register_buffer("scale", torch.tensor(float(scale)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(x, self.negative_slope) * self.scale.to(x.dtype)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope:.6g}, scale={float(self.scale):.6g}"


_ACTS = {
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "softplus": F.softplus, "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "swish": F.silu,
    "elu": F.elu, "selu": torch.selu, "erf": torch.erf, "relu": torch.relu,
    "mish": F.mish, "softsign": F.softsign, "atan": torch.atan, "asinh": torch.asinh,
}


class TransformedActivation(nn.Module):
    """``gamma * (phi(alpha * x + beta) + delta)``: the DKS/TAT transform of a smooth activation
    ``phi`` (Martens et al.; Zhang et al., eqs. 15-16)."""

    def __init__(self, name: str, alpha: float, beta: float, gamma: float, delta: float) -> None:
        super().__init__()
        if name not in _ACTS:
            raise ValueError(f"no torch activation named {name!r}: {sorted(_ACTS)}")
        self.name = name
        for k, v in (("alpha", alpha), ("beta", beta), ("gamma", gamma), ("delta", delta)):
            self.register_buffer(k, torch.tensor(float(v)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, g, d = (t.to(x.dtype) for t in (self.alpha, self.beta, self.gamma, self.delta))
        return g * (_ACTS[self.name](a * x + b) + d)

    def extra_repr(self) -> str:
        return (f"{self.name}, alpha={float(self.alpha):.5g}, beta={float(self.beta):.5g}, "
                f"gamma={float(self.gamma):.5g}, delta={float(self.delta):.5g}")


class ScaledPReLU(nn.Module):
    """``scale * prelu(x, weight)``: TAT's TReLU for a PReLU layer, its learnable slope starting
    at the TAT negative slope and ``scale = sqrt(2/(1+slope^2))`` kept as a constant (spec §3.3:
    "PReLU: set its initial slope to alpha and keep the gamma multiply")."""

    def __init__(self, num_parameters: int, init: float, scale: float | None = None) -> None:
        super().__init__()
        if scale is None:
            scale = math.sqrt(2.0 / (1.0 + init ** 2))
        self.num_parameters = int(num_parameters)
        self.weight = nn.Parameter(torch.full((self.num_parameters,), float(init)))
        self.register_buffer("scale", torch.tensor(float(scale)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.prelu(x, self.weight) * self.scale.to(x.dtype)

    def extra_repr(self) -> str:
        return f"num_parameters={self.num_parameters}, scale={float(self.scale):.6g}"


class TransformedLeakyReLU(nn.Module):
    """``gamma * (leaky_relu(x + beta, negative_slope) + delta)``: the DKS transform of a leaky
    ReLU (its input scale is 1 because the function is positively homogeneous; spec §2.8)."""

    def __init__(self, negative_slope: float, beta: float, gamma: float, delta: float) -> None:
        super().__init__()
        self.negative_slope = float(negative_slope)
        for k, v in (("beta", beta), ("gamma", gamma), ("delta", delta)):
            self.register_buffer(k, torch.tensor(float(v)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, g, d = (t.to(x.dtype) for t in (self.beta, self.gamma, self.delta))
        return g * (F.leaky_relu(x + b, self.negative_slope) + d)

    def extra_repr(self) -> str:
        return (f"negative_slope={self.negative_slope:.6g}, beta={float(self.beta):.5g}, "
                f"gamma={float(self.gamma):.5g}, delta={float(self.delta):.5g}")


class PerLocationNorm(nn.Module):
    """Per-location normalization without a homogeneous coordinate (spec §2.10, mode "off"):
    divides every location by the root mean square over the channel axis, so that each location
    has q = mean(x^2 over channels) = 1.  ``channel_dim`` is 1 for NCHW-like inputs and -1 for
    (batch, features); ``eps`` guards all-zero locations (which PLN cannot normalize)."""

    def __init__(self, channel_dim: int = 1, eps: float = 1e-12) -> None:
        super().__init__()
        self.channel_dim = int(channel_dim)
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.pow(2).mean(dim=self.channel_dim, keepdim=True)
        return x * torch.rsqrt(q + self.eps)

    def extra_repr(self) -> str:
        return f"channel_dim={self.channel_dim}"
