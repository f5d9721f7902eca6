"""Nets with joins: bottleneck ResNet, DenseNet, U-Net, depthwise-separable (MobileNet-style)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from precondfx import demo
from tests.zoo.registry import HAS_TRANSFORMERS, _register, _seeded


# ---------------------------------------------------------------------------
# 5. bottleneck ResNet (ResNet-50 layout)
# ---------------------------------------------------------------------------


def _norm2d(norm: bool, ch: int) -> nn.Module:
    return nn.BatchNorm2d(ch) if norm else nn.Identity()


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride, as in torchvision's v1.5), 1x1 expand."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, norm: bool = True) -> None:
        super().__init__()
        out = planes * self.expansion
        bias = not norm
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=bias)
        self.bn1 = _norm2d(norm, planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=bias)
        self.bn2 = _norm2d(norm, planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=bias)
        self.bn3 = _norm2d(norm, out)
        self.relu = nn.ReLU(inplace=True)  # shared, as in torchvision
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, out, 1, stride=stride, bias=bias), _norm2d(norm, out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        branch = self.relu(self.bn1(self.conv1(x)))
        branch = self.relu(self.bn2(self.conv2(branch)))
        branch = self.bn3(self.conv3(branch))
        return self.relu(branch + shortcut)


class BottleneckResNet(nn.Module):
    def __init__(
        self,
        layers: Sequence[int] = (3, 4, 6, 3),
        width: int = 64,
        num_classes: int = 1000,
        norm: bool = True,
        in_ch: int = 3,
    ) -> None:
        super().__init__()
        bias = not norm
        self.conv1 = nn.Conv2d(in_ch, width, 7, stride=2, padding=3, bias=bias)
        self.bn1 = _norm2d(norm, width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        inplanes = width
        stages: list[nn.Module] = []
        for i, n in enumerate(layers):
            planes = width * 2**i
            blocks: list[nn.Module] = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(Bottleneck(inplanes, planes, stride, norm))
                inplanes = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        if len(stages) != 4:
            raise ValueError("layers must have 4 entries")
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(
    norm: bool = True,
    width: int = 64,
    layers: Sequence[int] = (3, 4, 6, 3),
    image: int = 224,
    batch: int = 2,
    num_classes: int = 1000,
    seed: int = 0,
) -> tuple[nn.Module, Any]:
    """Bottleneck ResNet; the defaults give torchvision's ResNet-50 (25,557,032 params with BN).

    ``norm=False`` drops BatchNorm (convs then get biases).  Works under
    ``with torch.device("meta"):`` for cheap parameter counting.
    """

    def make() -> tuple[nn.Module, Any]:
        model = BottleneckResNet(layers, width, num_classes, norm)
        return model, torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


@_register("resnet_bottleneck_bn", "conv", "residual", "maxpool", "batchnorm")
def resnet_bottleneck_bn(
    seed: int = 0,
    *,
    width: int = 8,
    layers: Sequence[int] = (1, 1, 1, 1),
    image: int = 32,
    batch: int = 2,
    num_classes: int = 10,
) -> tuple[nn.Module, Any]:
    """Tiny bottleneck ResNet with BatchNorm (ResNet-50 layout via resnet50())."""
    return resnet50(True, width, layers, image, batch, num_classes, seed)


@_register("resnet_bottleneck", "conv", "residual", "maxpool")
def resnet_bottleneck(
    seed: int = 0,
    *,
    width: int = 8,
    layers: Sequence[int] = (1, 1, 1, 1),
    image: int = 32,
    batch: int = 2,
    num_classes: int = 10,
) -> tuple[nn.Module, Any]:
    """Tiny bottleneck ResNet without normalization (convs with bias)."""
    return resnet50(False, width, layers, image, batch, num_classes, seed)


# ---------------------------------------------------------------------------
# 6. DenseNet
# ---------------------------------------------------------------------------


class DenseLayer(nn.Module):
    def __init__(self, in_ch: int, growth: int, bn_size: int = 2) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(in_ch)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(in_ch, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.relu2 = nn.ReLU()
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        x = self.conv1(self.relu1(self.norm1(x)))
        return self.conv2(self.relu2(self.norm2(x)))


class DenseBlock(nn.Module):
    def __init__(self, n_layers: int, in_ch: int, growth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(in_ch + i * growth, growth) for i in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__(
            nn.BatchNorm2d(in_ch),
            nn.ReLU(),
            nn.Conv2d(in_ch, out_ch, 1, bias=False),
            nn.AvgPool2d(2, stride=2),
        )


class DenseNet(nn.Module):
    def __init__(self, growth: int = 8, blocks: Sequence[int] = (3, 3), stem: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, stem, 3, padding=1, bias=False)
        parts: list[nn.Module] = []
        ch = stem
        for i, n in enumerate(blocks):
            parts.append(DenseBlock(n, ch, growth))
            ch += n * growth
            if i != len(blocks) - 1:
                parts.append(Transition(ch, ch // 2))
                ch //= 2
        self.features = nn.Sequential(*parts)
        self.norm = nn.BatchNorm2d(ch)
        self.fc = nn.Linear(ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.features(self.stem(x))))
        x = F.adaptive_avg_pool2d(x, 1)
        return self.fc(torch.flatten(x, 1))


@_register("densenet", "conv", "concat", "batchnorm")
def densenet(seed: int = 0, *, image: int = 16, batch: int = 4, num_classes: int = 10) -> tuple[nn.Module, Any]:
    """DenseNet-style net: dense blocks with torch.cat, transition (1x1 conv + avg pool)."""

    def make() -> tuple[nn.Module, Any]:
        return DenseNet(num_classes=num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 7. U-Net
# ---------------------------------------------------------------------------


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU()
    )


class UNet(nn.Module):
    def __init__(self, in_ch: int = 3, base: int = 8, num_classes: int = 2) -> None:
        super().__init__()
        b = base
        self.enc1 = _double_conv(in_ch, b)
        self.pool1 = nn.MaxPool2d(2)
        self.enc2 = _double_conv(b, 2 * b)
        self.pool2 = nn.MaxPool2d(2)
        self.bottom = _double_conv(2 * b, 4 * b)
        self.up2 = nn.ConvTranspose2d(4 * b, 2 * b, 2, stride=2)
        self.dec2 = _double_conv(4 * b, 2 * b)
        self.up1_conv = nn.Conv2d(2 * b, b, 1)  # after F.interpolate
        self.dec1 = _double_conv(2 * b, b)
        self.head = nn.Conv2d(b, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool1(e1))
        m = self.bottom(self.pool2(e2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], dim=1))
        u1 = self.up1_conv(F.interpolate(d2, scale_factor=2, mode="bilinear", align_corners=False))
        d1 = self.dec1(torch.cat([u1, e1], dim=1))
        return self.head(d1)


@_register("unet", "conv", "maxpool", "concat", "conv_transpose", "upsample")
def unet(seed: int = 0, *, image: int = 32, batch: int = 2, num_classes: int = 2) -> tuple[nn.Module, Any]:
    """Small U-Net: ConvTranspose2d and F.interpolate upsampling, skip concatenations."""

    def make() -> tuple[nn.Module, Any]:
        return UNet(num_classes=num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 8. depthwise-separable (MobileNet-style)
# ---------------------------------------------------------------------------


class DepthwiseSeparable(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, act: type[nn.Module]) -> None:
        super().__init__()
        self.dw = nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False)
        self.bn1 = nn.BatchNorm2d(cin)
        self.act1 = nn.ReLU6()
        self.pw = nn.Conv2d(cin, cout, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.act2 = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act2(self.bn2(self.pw(self.act1(self.bn1(self.dw(x))))))


class MobileNetish(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        self.blocks = nn.Sequential(
            DepthwiseSeparable(16, 32, 1, nn.ReLU6),
            DepthwiseSeparable(32, 64, 2, nn.Hardswish),
            DepthwiseSeparable(64, 64, 1, nn.Hardswish),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


@_register("depthwise_separable", "conv", "depthwise", "batchnorm")
def depthwise_separable(seed: int = 0, *, image: int = 32, batch: int = 4, num_classes: int = 10) -> tuple[nn.Module, Any]:
    """MobileNet-style net: depthwise (groups=C) + pointwise convs, ReLU6 and Hardswish."""

    def make() -> tuple[nn.Module, Any]:
        return MobileNetish(num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)
