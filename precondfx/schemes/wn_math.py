"""Mathematical core of Arpit, Campos & Bengio's initialization for weight-normalized networks.

Spec: ``shared/spec/chen-arpit-spec.md`` part B ([004]).  A weight-normalized layer computes
``w_i = g_i v_i / ||v_i||`` per output row/channel (PyTorch
``torch.nn.utils.parametrizations.weight_norm(module, dim=0)``: ``original0`` is the magnitude
``g`` of shape ``[out, 1, ...]``, ``original1`` the direction ``v``).  The proposed,
data-independent initialization (B.2.4, B.2.5):

* directions ``v`` orthogonal (or Gaussian ``N(0, 1/fan_in)``), biases 0;
* ``g = sqrt(gamma * fan_in / fan_out)`` with ``gamma = 2`` before a ReLU, ``1`` otherwise
  (stems, projection shortcuts, linear outputs) and ``1/B_k`` for the last layer of every residual
  branch in a stage of ``B_k`` blocks (the branch scale ``alpha = 1/sqrt(B_k)`` absorbed into
  ``g``);
* for convs the fans are ``k^2 c`` (B.2.4 footnote 3; ``c/groups`` for grouped convs), so the
  ratio is ``c_in/c_out``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from precondfx.errors import PrecondError

__all__ = [
    "wn_gain",
    "wn_fans",
    "wn_layer_gamma",
    "residual_branch_scale",
    "residual_norm_factor",
    "stagewise_hanin_gamma",
    "theorem1_constant",
    "wn_parts",
    "wn_init_",
    "wn_init_feedforward_",
    "wn_init_residual_branch_",
]

_ROLES = ("relu", "linear", "stem", "shortcut", "residual_last")


def wn_gain(fan_in: float, fan_out: float, gamma: float = 2.0) -> float:
    """``g = sqrt(gamma * fan_in / fan_out)`` (B.2.4 forward rule; B.2.5 implementation)."""
    if fan_in <= 0 or fan_out <= 0 or gamma <= 0:
        raise PrecondError(f"fans and gamma must be > 0, got fan_in={fan_in}, fan_out={fan_out}, gamma={gamma}.")
    return math.sqrt(gamma * fan_in / fan_out)


def wn_fans(module: nn.Module) -> tuple[int, int]:
    """``(fan_in, fan_out)`` of an ``nn.Linear`` (widths) or ``nn.Conv{1,2,3}d``
    (``c_in/groups * k``, ``c_out/groups * k``; B.2.4 footnote 3, B.3 grouped-conv rule)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        k = math.prod(module.kernel_size)
        return module.in_channels // module.groups * k, module.out_channels // module.groups * k
    raise PrecondError(f"wn_fans supports nn.Linear and nn.Conv1d/2d/3d, got {type(module).__name__}.")


def wn_layer_gamma(role: str, *, blocks_in_stage: int | None = None) -> float:
    """``gamma`` of a layer by its role (B.2.5): ``'relu'`` (followed by a ReLU) 2; ``'linear'``,
    ``'stem'`` (no ReLU after the stem) and ``'shortcut'`` (projection) 1; ``'residual_last'``
    (last layer of a residual branch) ``1/B_k``."""
    if role not in _ROLES:
        raise PrecondError(f"role must be one of {_ROLES}, got {role!r}.")
    if role == "relu":
        return 2.0
    if role == "residual_last":
        if blocks_in_stage is None or blocks_in_stage < 1:
            raise PrecondError("role='residual_last' needs blocks_in_stage >= 1 (blocks of the stage, incl. the first).")
        return 1.0 / blocks_in_stage
    return 1.0


def residual_branch_scale(blocks_in_stage: int) -> float:
    """Branch multiplier ``alpha = 1/sqrt(B)`` of ``h <- h + alpha F(h)`` (Theorems 3/4, eq. 6)."""
    if blocks_in_stage < 1:
        raise PrecondError(f"blocks_in_stage must be >= 1, got {blocks_in_stage!r}.")
    return 1.0 / math.sqrt(blocks_in_stage)


def residual_norm_factor(blocks_in_stage: int) -> float:
    """Expected forward (and backward) norm factor of a stage of ``B`` blocks,
    ``c = (1 + 1/B)^{B/2}`` in ``[sqrt 2, sqrt e]`` (Theorem 3, B.2.5 [DERIVED]); 1.6386 at B=40."""
    if blocks_in_stage < 1:
        raise PrecondError(f"blocks_in_stage must be >= 1, got {blocks_in_stage!r}.")
    b = float(blocks_in_stage)
    return math.exp(0.5 * b * math.log1p(1.0 / b))


def stagewise_hanin_gamma(block_index: int) -> float:
    """Baseline "stage-wise Hanin" (B.2.6 [CODE]): last conv of block ``b`` (1-based within its
    stage) gets ``g = 0.9^b``, i.e. ``gamma = (0.9^b)^2`` inside ``sqrt(gamma fan_in/fan_out)``."""
    return 0.9 ** (2 * block_index)


def theorem1_constant(n: int) -> float:
    """``K_n`` of Theorem 1 (B.2.2), computed in log space with
    ``S_n = 2 pi^{(n+1)/2} / Gamma((n+1)/2)`` (the n-sphere in ``R^{n+1}``); it equals 1."""
    if n < 2:
        raise PrecondError(f"Theorem 1 needs n >= 2, got {n!r}.")

    def log_s(k: int) -> float:
        return math.log(2.0) + (k + 1) / 2.0 * math.log(math.pi) - math.lgamma((k + 1) / 2.0)

    # even n: prod_{j=1}^{n/2-1} (2j)/(2j+1) ; odd n: prod_{j=1}^{(n-3)/2} ... (1/2)(3/4)...((n-2)/(n-1)) * pi/2
    log_prod = 0.0
    if n % 2 == 0:
        for num in range(2, n - 1, 2):
            log_prod += math.log(num) - math.log(num + 1)
    else:
        for num in range(1, n - 1, 2):
            log_prod += math.log(num) - math.log(num + 1)
        log_prod += math.log(math.pi / 2.0)
    return math.exp(math.log(2.0) + log_s(n - 1) - log_s(n) + log_prod)


def wn_parts(module: nn.Module, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, v)`` tensors of a weight-normalized module: ``parametrizations.<name>.original0/1``
    (``torch.nn.utils.parametrizations.weight_norm``) or the legacy ``<name>_g``/``<name>_v``.
    Only ``dim=0`` (per output row/channel) is supported, as the paper's model assumes (B.2.1)."""
    parametrizations = getattr(module, "parametrizations", None)
    if parametrizations is not None and name in parametrizations:
        plist = parametrizations[name]
        g, v = plist.original0, plist.original1
    elif hasattr(module, f"{name}_g") and hasattr(module, f"{name}_v"):
        g, v = getattr(module, f"{name}_g"), getattr(module, f"{name}_v")
    else:
        raise PrecondError(
            f"{type(module).__name__} is not weight-normalized; wrap it with "
            "torch.nn.utils.parametrizations.weight_norm(module, dim=0) first."
        )
    if g.dim() != v.dim() or g.shape[0] != v.shape[0] or math.prod(g.shape) != v.shape[0]:
        raise PrecondError(
            f"expected a per-output-row weight norm (dim=0): magnitude shape {tuple(g.shape)} vs direction "
            f"shape {tuple(v.shape)}."
        )
    return g, v


@torch.no_grad()
def wn_init_(
    module: nn.Module, *, gamma: float = 2.0, direction: str = "orthogonal", zero_bias: bool = True,
    generator: torch.Generator | None = None,
) -> nn.Module:
    """Proposed WN init of one weight-normalized ``nn.Linear``/``nn.Conv{1,2,3}d`` (B.2.4):
    direction ``original1`` orthogonal (the kernel reshaped to ``c_out x c_in k``; unit-norm rows or
    columns) or ``'gaussian'`` ``N(0, 1/fan_in)`` ([CODE]); magnitude ``original0`` filled with
    ``sqrt(gamma fan_in/fan_out)``; bias zeroed.  Returns the module."""
    g, v = wn_parts(module)
    fan_in, fan_out = wn_fans(module)
    if direction == "orthogonal":
        mat = torch.empty(v.shape[0], math.prod(v.shape[1:]), dtype=v.dtype, device=v.device)
        nn.init.orthogonal_(mat, generator=generator)
        v.copy_(mat.view_as(v))
    elif direction == "gaussian":
        v.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=generator)
    else:
        raise PrecondError(f"direction must be 'orthogonal' or 'gaussian', got {direction!r}.")
    g.fill_(wn_gain(fan_in, fan_out, gamma))
    if zero_bias and getattr(module, "bias", None) is not None:
        module.bias.zero_()
    return module


def wn_init_feedforward_(
    layers: Sequence[nn.Module], *, relu_after: Sequence[bool] | None = None, direction: str = "orthogonal",
    generator: torch.Generator | None = None,
) -> None:
    """Proposed init of a feed-forward WN net (B.2.4): ``gamma = 2`` for layers followed by a ReLU,
    1 otherwise.  ``relu_after`` defaults to all-True (the paper's MLP: ReLU everywhere)."""
    flags = [True] * len(layers) if relu_after is None else list(relu_after)
    if len(flags) != len(layers):
        raise PrecondError(f"relu_after has {len(flags)} entries for {len(layers)} layers.")
    for layer, relu in zip(layers, flags):
        wn_init_(layer, gamma=wn_layer_gamma("relu" if relu else "linear"), direction=direction, generator=generator)


def wn_init_residual_branch_(
    branch: Sequence[nn.Module], *, blocks_in_stage: int, shortcut: nn.Module | None = None,
    relu_after: Sequence[bool] | None = None, direction: str = "orthogonal", generator: torch.Generator | None = None,
) -> None:
    """Proposed init of one residual block ``h + F(h)`` of a stage with ``blocks_in_stage`` blocks
    (B.2.5): the branch ``D x [layer -> ReLU ->] layer`` gets ``gamma = 2`` for layers followed by a
    ReLU (default: all but the last) and ``gamma = 1/B_k`` for its last layer; a projection
    ``shortcut`` gets ``gamma = 1``.  No ReLU is assumed after the addition."""
    if not branch:
        raise PrecondError("the residual branch has no weighted layers.")
    flags = [True] * (len(branch) - 1) + [False] if relu_after is None else list(relu_after)
    if len(flags) != len(branch):
        raise PrecondError(f"relu_after has {len(flags)} entries for {len(branch)} layers.")
    for i, (layer, relu) in enumerate(zip(branch, flags)):
        if i == len(branch) - 1:
            gamma = wn_layer_gamma("residual_last", blocks_in_stage=blocks_in_stage)
        else:
            gamma = wn_layer_gamma("relu" if relu else "linear")
        wn_init_(layer, gamma=gamma, direction=direction, generator=generator)
    if shortcut is not None:
        wn_init_(shortcut, gamma=wn_layer_gamma("shortcut"), direction=direction, generator=generator)
