"""Per-layer statistics per sample: the forward hook that records a layer's input/output moments,
geometry and output tensors, the Hessian blocks, and the per-sample records."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from precondfx.pytorch import reals
from precondfx.pytorch.capture.common import Sample
from precondfx.pytorch.measure.conditioning.results import LayerRef


class _Capture:
    """Forward hook for one layer: records E[x^2], E[y^2], geometry and the output tensors."""

    def __init__(self, ref: LayerRef, module: nn.Module | None, weight: torch.Tensor):
        self.ref, self.module, self.weight = ref, module, weight
        self.reset()
        kind = type(module).__name__ if module is not None else "none"
        self.kind = kind
        self.supported = isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)) and \
            getattr(module, "weight", None) is weight
        self.note = "" if self.supported else (
            f"GR formula needs the weight to belong to a Linear/ConvNd/ConvTransposeNd module "
            f"(found {kind}); gr not computed")

    def reset(self) -> None:
        self.outputs: list[torch.Tensor] = []
        self.x_sum = self.x_cnt = self.y_sum = self.y_cnt = 0.0
        self.rho2 = self.rho2_bias = 0.0

    def geometry(self) -> tuple[int, float]:
        m = self.module
        if isinstance(m, nn.Linear):
            return m.in_features, 1.0
        if isinstance(m, nn.modules.conv._ConvNd):
            k2 = float(np.prod(m.kernel_size))
            if m.transposed:
                k2 /= float(np.prod(m.stride))
            return m.in_channels // m.groups, k2
        return 0, 0.0

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not isinstance(output, torch.Tensor):
            return None
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is not None:
            xd = x.detach()
            self.x_sum += reals.sum_square(xd)
            self.x_cnt += reals.real_numel(xd)
        yd = output.detach()
        self.y_sum += reals.sum_square(yd)
        self.y_cnt += reals.real_numel(yd)
        if self.supported:
            m = self.module
            if isinstance(m, nn.Linear):
                pos = yd.numel() / m.out_features
                self.rho2 += pos
                self.rho2_bias += pos
            elif m.transposed:
                self.rho2 += (x.numel() / m.in_channels) if x is not None else 0.0
                self.rho2_bias += yd.numel() / m.out_channels
            else:
                pos = yd.numel() / m.out_channels
                self.rho2 += pos
                self.rho2_bias += pos
        if output.requires_grad:
            self.outputs.append(output)
            # hand a copy downstream so an in-place op after the module (ReLU(inplace=True))
            # cannot overwrite the tensor we differentiate against
            return output.clone()
        return None


@dataclass
class _Blocks:
    """The Hessian blocks: every layer's weight, then (``include_bias``) the biases."""

    params: list[torch.Tensor]
    names: list[str]
    layer: list[tuple[int, str]]           # (layer index, "weight" or "bias") per block
    biases: list[torch.Tensor | None]

    @classmethod
    def of(cls, model: nn.Module, refs: list[LayerRef], weights: list[torch.Tensor],
           include_bias: bool) -> "_Blocks":
        biases = [model.get_parameter(r.bias) if r.bias else None for r in refs]
        blocks = cls(list(weights), [r.name for r in refs],
                     [(i, "weight") for i in range(len(refs))], biases)
        if include_bias:
            for i, (r, b) in enumerate(zip(refs, biases)):
                if b is not None:
                    blocks.params.append(b)
                    blocks.names.append(r.name + ".bias")
                    blocks.layer.append((i, "bias"))
        return blocks


class _Records:
    """Per-sample records: the block matrix, E[dW^2] and the hooked moments per layer."""

    def __init__(self, n: int, nb: int, nl: int) -> None:
        self.blk = np.zeros((n, nb, nb))          # B[m, l] per sample
        self.grad_sq, self.x2, self.y2, self.dy2, self.rho2, self.rho2b = (
            np.zeros((n, nl)) for _ in range(6))
        self.loss_kind = ""

    def moments(self, s: int, caps: list["_Capture"]) -> None:
        """Sample ``s``'s hooked input/output moments and geometry."""
        for l, c in enumerate(caps):
            self.x2[s, l] = c.x_sum / c.x_cnt if c.x_cnt else float("nan")
            self.y2[s, l] = c.y_sum / c.y_cnt if c.y_cnt else float("nan")
            self.rho2[s, l] = c.rho2
            self.rho2b[s, l] = c.rho2_bias
            c.reset()


@dataclass
class _Run:
    """What one measurement needs in every sample."""

    model: nn.Module
    smp: Sample
    output_fn: Callable[[Any], torch.Tensor]
    blocks: _Blocks
    caps: list["_Capture"]
    gen: torch.Generator
    want_h: bool
    probe: str
    n_probes: int
    quadratic: Any
    dense_max: int
    ggn_max_outputs: int
    ggn_max_bytes: int

