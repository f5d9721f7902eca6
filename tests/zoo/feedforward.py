"""MLPs and plain convolutional nets: strided, max-pool, VGG, 1-D, 3-D, the paper's strided AlexNet, a deep plain CNN."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from precondfx import demo
from tests.zoo.registry import HAS_TRANSFORMERS, _register, _seeded


# ---------------------------------------------------------------------------
# 1. MLP (LIBSVM experiments of the paper)
# ---------------------------------------------------------------------------


MLP = demo.MLP
mlp = _register("mlp", "linear")(demo.mlp)


# ---------------------------------------------------------------------------
# 2. strided CNN
# ---------------------------------------------------------------------------


class StridedCNN(nn.Module):
    def __init__(self, in_ch: int = 3, widths: Sequence[int] = (16, 32, 64), num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        prev = in_ch
        for w in widths:
            layers += [nn.Conv2d(prev, w, 3, stride=2, padding=1), nn.ReLU()]
            prev = w
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


@_register("strided_cnn", "conv")
def strided_cnn(seed: int = 0, *, image: int = 32, batch: int = 4, num_classes: int = 10) -> tuple[nn.Module, Any]:
    """CNN of stride-2 3x3 convs with ReLU, global average pool and a linear head."""

    def make() -> tuple[nn.Module, Any]:
        return StridedCNN(num_classes=num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 3. max-pool CNN
# ---------------------------------------------------------------------------


MaxPoolCNN = demo.MaxPoolCNN
maxpool_cnn = _register("maxpool_cnn", "conv", "maxpool")(demo.maxpool_cnn)


# ---------------------------------------------------------------------------
# 4. VGG with BatchNorm
# ---------------------------------------------------------------------------


class VGG(nn.Module):
    def __init__(
        self,
        cfg: Sequence[int | str] = (16, "M", 32, "M", 64, 64, "M"),
        in_ch: int = 3,
        hidden: int = 128,
        num_classes: int = 10,
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        prev = in_ch
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                assert isinstance(v, int)
                layers.append(nn.Conv2d(prev, v, 3, padding=1, bias=not batch_norm))
                if batch_norm:
                    layers.append(nn.BatchNorm2d(v))
                layers.append(nn.ReLU(inplace=True))
                prev = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Linear(prev * 4, hidden),
            nn.ReLU(True),
            nn.Dropout(0.5),
            nn.Linear(hidden, hidden),
            nn.ReLU(True),
            nn.Dropout(0.5),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


@_register("vgg_bn", "conv", "maxpool", "batchnorm", "dropout")
def vgg_bn(seed: int = 0, *, image: int = 32, batch: int = 4, num_classes: int = 10) -> tuple[nn.Module, Any]:
    """Small VGG: Conv-BatchNorm-ReLU blocks, MaxPool2d(2), classifier with Dropout."""

    def make() -> tuple[nn.Module, Any]:
        return VGG(num_classes=num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 12. 1-D conv net
# ---------------------------------------------------------------------------


class Conv1dNet(nn.Module):
    def __init__(self, in_ch: int = 4, num_classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(in_ch, 16, 5, padding=2)
        self.act1 = nn.ELU()
        self.conv2 = nn.Conv1d(16, 32, 3, padding=2, dilation=2)
        self.act2 = nn.SiLU()
        self.conv3 = nn.Conv1d(32, 32, 3, stride=2, padding=1)
        self.act3 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.conv1(x))
        x = self.act2(self.conv2(x))
        x = self.act3(self.conv3(x))
        return self.fc(torch.flatten(self.pool(x), 1))


@_register("conv1d", "conv")
def conv1d(seed: int = 0, *, length: int = 64, batch: int = 4, in_ch: int = 4, num_classes: int = 5) -> tuple[nn.Module, Any]:
    """1-D conv net over sequences: dilated Conv1d, ELU, SiLU, AdaptiveAvgPool1d."""

    def make() -> tuple[nn.Module, Any]:
        return Conv1dNet(in_ch, num_classes), torch.randn(batch, in_ch, length)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 18. 3-D conv net
# ---------------------------------------------------------------------------


class Conv3dNet(nn.Module):
    def __init__(self, in_ch: int = 1, num_classes: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv3d(in_ch, 8, 3, padding=1, bias=False),
            nn.BatchNorm3d(8),
            nn.ReLU(),
            nn.AvgPool3d(2),
            nn.Conv3d(8, 16, 3, padding=1, bias=False),
            nn.BatchNorm3d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool3d(1),
        )
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))


@_register("conv3d", "conv", "batchnorm")
def conv3d(seed: int = 0, *, size: int = 8, batch: int = 2, num_classes: int = 3) -> tuple[nn.Module, Any]:
    """Small Conv3d net with BatchNorm3d and AvgPool3d."""

    def make() -> tuple[nn.Module, Any]:
        return Conv3dNet(num_classes=num_classes), torch.randn(batch, 1, size, size, size)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 21. strided AlexNet (paper, App. F)
# ---------------------------------------------------------------------------


class StridedAlexNet(nn.Module):
    def __init__(self, width_div: int = 1, num_classes: int = 10, in_ch: int = 3) -> None:
        super().__init__()

        def w(c: int) -> int:
            return max(1, c // width_div)

        specs = [  # (out, kernel, stride)
            (w(64), 11, 1),
            (w(192), 5, 2),
            (w(384), 3, 2),
            (w(256), 3, 1),
            (w(256), 3, 1),
        ]
        layers: list[nn.Module] = []
        prev = in_ch
        for out, k, s in specs:
            layers += [nn.Conv2d(prev, out, k, stride=s, padding=k // 2, padding_mode="circular"), nn.ReLU()]
            prev = out
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(prev, w(4096)),
            nn.ReLU(),
            nn.Linear(w(4096), w(4096)),
            nn.ReLU(),
            nn.Linear(w(4096), num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


@_register("alexnet_strided", "conv", "linear", "circular_padding")
def alexnet_strided(seed: int = 0, *, width_div: int = 4, image: int = 32, batch: int = 2,
                    num_classes: int = 10) -> tuple[nn.Module, Any]:
    """Paper's App. F strided AlexNet (circular padding); widths divided by width_div (1 = full)."""

    def make() -> tuple[nn.Module, Any]:
        return StridedAlexNet(width_div, num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 22. plain deep CNN
# ---------------------------------------------------------------------------


class PlainDeepCNN(nn.Module):
    def __init__(self, depth: int = 30, width: int = 16, in_ch: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        prev = in_ch
        for _ in range(depth):
            layers += [nn.Conv2d(prev, width, 3, padding=1), nn.ReLU()]
            prev = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


@_register("plain_deep_cnn", "conv", "deep")
def plain_deep_cnn(seed: int = 0, *, depth: int = 30, width: int = 16, image: int = 16, batch: int = 4,
                   num_classes: int = 10) -> tuple[nn.Module, Any]:
    """Plain deep CNN: `depth` 3x3 conv+ReLU layers, no normalization or skips, avg pool + linear."""

    def make() -> tuple[nn.Module, Any]:
        return PlainDeepCNN(depth, width, 3, num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)
