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
