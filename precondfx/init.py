"""Tensor-level initializers in the style of ``torch.nn.init``, for a model's own init code.

A model's ``_init_weights`` / ``post_init`` / ``reset_parameters`` can call
``precondfx.init.geometric_(module.weight)`` the way it calls ``torch.nn.init.normal_``: the
tensor is filled in place (under ``no_grad``) and returned.  The rules are the ones
``precondition`` plans (``precondfx/core/fans.py``): geometric-mean initialization
``E[W^2] = gain / (k^2 sqrt(n_in n_out))`` (Sec. 6, Eq. 7, gain 2), and ``fan_in``, ``fan_out``,
``xavier`` for comparison.  Fans are read from the shape, as ``torch.nn.init`` does:

* ``(out, in)`` (``nn.Linear``) and ``(out, in/groups, k1, ..., kd)`` (convolutions):
  ``n_in = shape[1]``, ``n_out = shape[0] / groups``, ``k^2 = k1 * ... * kd``;
* ``transposed=True`` for weights stored input-first: ``(in, out)`` (transformers' ``Conv1D``,
  ``x @ W``) and ``(in, out/groups, k...)`` (``nn.ConvTranspose*d``).

Normal draws are moment-matched by default (rescaled so that their empirical second moment is
exactly the planned one), as ``precondition`` does.  Only the weight's own rule is applied:
the scaling constants (alphas, output scale) need the model's graph and a batch, which is
``precondition``'s job.
"""
from __future__ import annotations

import math
import numbers

import torch

from precondfx.core import draw as drawing
from precondfx.pytorch.draws import torch_ops
from precondfx.errors import PrecondError
from precondfx.core.fans import Fans, second_moment, weight_fans

__all__ = ["geometric_", "fan_in_", "fan_out_", "xavier_", "embedding_", "fans", "target_std"]


def _check_tensor(tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise PrecondError(f"expected a torch.Tensor to initialize in place, got "
                           f"{type(tensor).__name__}")


def fans(tensor: torch.Tensor, *, groups: int = 1, transposed: bool = False) -> Fans:
    """``n_in``, ``n_out`` and kernel taps ``k^2`` of a weight, from its shape."""
    _check_tensor(tensor)
    shape = tuple(int(s) for s in tensor.shape)
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise PrecondError(f"groups must be a positive integer, got {groups!r}")
    if len(shape) < 2:
        raise PrecondError(f"a weight needs at least 2 dimensions to have fans, got shape "
                           f"{shape}: use torch.nn.init.zeros_ for biases")
    if len(shape) == 2:
        f = weight_fans("matmul", shape, {"weight_side": "right"}) if transposed else \
            weight_fans("linear", shape, {})
    else:
        f = weight_fans("conv_transpose" if transposed else "conv", shape, {"groups": groups})
    if f is None or min(f.n_in, f.n_out) < 1:
        raise PrecondError(f"no fans for a weight of shape {shape} (groups={groups})")
    return f


def target_std(tensor: torch.Tensor, rule: str = "geometric", *, groups: int = 1,
               transposed: bool = False, gain: float = 2.0) -> float:
    """The standard deviation ``sqrt(E[W^2])`` the rule gives this weight."""
    if not (isinstance(gain, numbers.Real) and not isinstance(gain, bool)
            and math.isfinite(gain) and gain > 0):
        raise PrecondError(f"gain={gain!r} must be a positive finite number: it multiplies the "
                           f"second moment E[W^2] (2, the default, for ReLU)")
    f = fans(tensor, groups=groups, transposed=transposed)
    return second_moment(Fans(f.n_in, f.n_out, f.k2, float(gain)), rule) ** 0.5


@torch.no_grad()
def _fill(tensor: torch.Tensor, std: float, generator: torch.Generator | None,
          moment_matched: bool) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise PrecondError(f"cannot initialize a {tensor.dtype} tensor: it must be floating-point")
    if tensor.device.type == "meta":
        return tensor
    ops = torch_ops(generator)
    draw = ops.normal(tuple(tensor.shape))
    draw = drawing.moment_matched(draw, std, ops) if moment_matched else draw * std
    tensor.copy_(draw.to(dtype=tensor.dtype, device=tensor.device))
    return tensor


def _rule_(rule: str, tensor: torch.Tensor, groups: int, transposed: bool, gain: float,
           generator: torch.Generator | None, moment_matched: bool) -> torch.Tensor:
    std = target_std(tensor, rule, groups=groups, transposed=transposed, gain=gain)
    return _fill(tensor, std, generator, moment_matched)


def geometric_(tensor: torch.Tensor, *, groups: int = 1, transposed: bool = False,
               gain: float = 2.0, generator: torch.Generator | None = None,
               moment_matched: bool = True) -> torch.Tensor:
    """Geometric-mean initialization in place: ``E[W^2] = gain/(k^2 sqrt(n_in n_out))``."""
    return _rule_("geometric", tensor, groups, transposed, gain, generator, moment_matched)


def fan_in_(tensor: torch.Tensor, *, groups: int = 1, transposed: bool = False,
            gain: float = 2.0, generator: torch.Generator | None = None,
            moment_matched: bool = True) -> torch.Tensor:
    """Fan-in initialization in place: ``E[W^2] = gain/(k^2 n_in)``."""
    return _rule_("fan_in", tensor, groups, transposed, gain, generator, moment_matched)


def fan_out_(tensor: torch.Tensor, *, groups: int = 1, transposed: bool = False,
             gain: float = 2.0, generator: torch.Generator | None = None,
             moment_matched: bool = True) -> torch.Tensor:
    """Fan-out initialization in place: ``E[W^2] = gain/(k^2 n_out)``."""
    return _rule_("fan_out", tensor, groups, transposed, gain, generator, moment_matched)


def xavier_(tensor: torch.Tensor, *, groups: int = 1, transposed: bool = False,
            gain: float = 2.0, generator: torch.Generator | None = None,
            moment_matched: bool = True) -> torch.Tensor:
    """Xavier initialization in place (Sec. 6.1, Eq. 6): ``E[W^2] = 2 gain/(k^2 (n_in+n_out))``."""
    return _rule_("xavier", tensor, groups, transposed, gain, generator, moment_matched)


def embedding_(tensor: torch.Tensor, *, padding_idx: int | None = None,
               generator: torch.Generator | None = None,
               moment_matched: bool = True) -> torch.Tensor:
    """Embedding table in place: unit second moment (a lookup reads one weight per output);
    the ``padding_idx`` row, if any, is set to zero as ``nn.Embedding`` does."""
    _check_tensor(tensor)
    if tensor.dim() != 2:
        raise PrecondError(f"an embedding table is 2-D (num, dim), got shape {tuple(tensor.shape)}")
    if padding_idx is not None and not (isinstance(padding_idx, int) and
                                        -tensor.shape[0] <= padding_idx < tensor.shape[0]):
        raise PrecondError(f"padding_idx={padding_idx!r} is not a row of the table of "
                           f"{tensor.shape[0]} rows (as nn.Embedding: -{tensor.shape[0]} <= "
                           f"padding_idx < {tensor.shape[0]})")
    _fill(tensor, 1.0, generator, moment_matched)
    if padding_idx is not None:
        with torch.no_grad():
            tensor[padding_idx].zero_()
    return tensor
