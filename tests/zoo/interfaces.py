"""Call patterns: several inputs, dict outputs, keyword inputs, data-dependent control flow, mixed activations and tensor ops, a shared module."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from precondfx import demo
from tests.zoo.registry import HAS_TRANSFORMERS, _register, _seeded


# ---------------------------------------------------------------------------
# 15/16. several inputs, dict output, keyword inputs
# ---------------------------------------------------------------------------


class TwoInputs(nn.Module):
    def __init__(self, n_features: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.conv_act = nn.ReLU()
        self.feat = nn.Linear(n_features, 16)
        self.feat_act = nn.ReLU()
        self.fc = nn.Linear(8 + 16, num_classes)
        self.aux = nn.Linear(16, 1)

    def forward(self, image: torch.Tensor, features: torch.Tensor) -> dict[str, torch.Tensor]:
        a = self.conv_act(self.conv(image)).mean(dim=(2, 3))
        f = self.feat_act(self.feat(features))
        return {"logits": self.fc(torch.cat([a, f], dim=1)), "aux": self.aux(f)}


@_register("two_inputs_dict_out", "conv", "multi_input", "dict_output")
def two_inputs_dict_out(seed: int = 0, *, image: int = 16, batch: int = 4) -> tuple[nn.Module, Any]:
    """forward(image, features) -> {"logits", "aux"}; sample is a tuple of two tensors."""

    def make() -> tuple[nn.Module, Any]:
        return TwoInputs(), (torch.randn(batch, 3, image, image), torch.randn(batch, 8))

    return _seeded(make, seed)


class KwargsModel(nn.Module):
    def __init__(self, dim: int = 16, num_classes: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.act(self.fc1(x))
        if mask is None:
            pooled = h.mean(dim=1)
        else:
            m = mask.to(h.dtype).unsqueeze(-1)
            pooled = (h * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)
        return self.fc2(pooled)


@_register("kwargs_model", "linear", "kwargs")
def kwargs_model(seed: int = 0, *, seq: int = 6, dim: int = 16, batch: int = 4) -> tuple[nn.Module, Any]:
    """forward(x, *, mask=None): masked mean pooling; sample is a dict {"x", "mask"}."""

    def make() -> tuple[nn.Module, Any]:
        mask = torch.ones(batch, seq, dtype=torch.bool)
        mask[:, seq // 2 :] = torch.rand(batch, seq - seq // 2) > 0.5
        return KwargsModel(dim), {"x": torch.randn(batch, seq, dim), "mask": mask}

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 17. data-dependent control flow
# ---------------------------------------------------------------------------


class DataDependent(nn.Module):
    def __init__(self, dim: int = 16, num_classes: int = 4) -> None:
        super().__init__()
        self.path_a = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, num_classes))
        self.path_b = nn.Sequential(nn.Linear(dim, 32), nn.Tanh(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:  # data-dependent Python branch: defeats fx and plain export
            return self.path_a(x)
        return self.path_b(x)


@_register("data_dependent", "linear", "data_dependent")
def data_dependent(seed: int = 0, *, dim: int = 16, batch: int = 8, shift: float = 0.5) -> tuple[nn.Module, Any]:
    """`if x.mean() > 0:` chooses between two MLP paths (defeats fx and plain torch.export).

    The sample is shifted by ``shift`` so that path_a is taken (use a negative
    shift for path_b).
    """

    def make() -> tuple[nn.Module, Any]:
        return DataDependent(dim), torch.randn(batch, dim) + shift

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 19. mixed activations / norms / tensor ops
# ---------------------------------------------------------------------------


class MixedActivations(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.prelu = nn.PReLU(8)
        self.conv2 = nn.Conv2d(8, 8, 3)  # "same" size thanks to the F.pad before it
        self.inorm = nn.InstanceNorm2d(8, affine=True)
        self.lrelu = nn.LeakyReLU(0.1)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(16, 32)
        self.fc3 = nn.Linear(32, 32)
        self.rms = nn.RMSNorm(32)
        self.mish = nn.Mish()
        self.fc4 = nn.Linear(32, 32)
        self.selu = nn.SELU()
        self.out = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.prelu(self.gn(self.conv1(x)))
        h = F.pad(h, (1, 1, 1, 1))
        h = self.lrelu(self.inorm(self.conv2(h)))
        h = h[:, :, ::2, ::2]  # strided slicing
        a = h.mean(dim=(2, 3))  # mean reduction
        b = h[..., 0, :].mean(-1)  # indexing
        z = torch.stack([a, b], dim=1).flatten(1)
        u = torch.tanh(self.fc1(z))
        v = torch.sigmoid(self.fc2(z))
        w = u * v  # mul of two tensors
        w = w - self.fc3(F.softplus(w))  # sub of two tensors
        w = self.mish(self.rms(w))
        w = self.selu(self.fc4(w))
        return self.out(w)


@_register("mixed_activations", "conv", "linear", "groupnorm", "instancenorm", "rmsnorm")
def mixed_activations(seed: int = 0, *, image: int = 16, batch: int = 4, num_classes: int = 10) -> tuple[nn.Module, Any]:
    """tanh/sigmoid/softplus/Mish/PReLU/SELU/LeakyReLU, Group/Instance/RMSNorm, stack, pad, slicing, mul, sub."""

    def make() -> tuple[nn.Module, Any]:
        return MixedActivations(num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 20. shared module
# ---------------------------------------------------------------------------


class SharedModule(nn.Module):
    def __init__(self, image: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv_act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc_in = nn.Linear(8 * (image // 2) ** 2, 32)
        self.shared = nn.Linear(32, 32)  # called twice in forward
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.conv_act(self.conv(x)))
        h = F.relu(self.fc_in(torch.flatten(x, 1)))
        h = F.relu(self.shared(h))
        h = F.relu(self.shared(h))
        return self.head(h)


@_register("shared_module", "conv", "linear", "maxpool", "shared")
def shared_module(seed: int = 0, *, image: int = 16, batch: int = 8, num_classes: int = 10) -> tuple[nn.Module, Any]:
    """Calls the same Linear twice in forward; conv + MaxPool2d(2) front end."""

    def make() -> tuple[nn.Module, Any]:
        return SharedModule(image, num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)
