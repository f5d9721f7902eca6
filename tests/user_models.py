"""Small timm-style stand-ins (timm and torchvision cannot import here) for the tests and the
benchmark of the result being the user's class (``tests/test_user_class.py``,
``bench/user_class_cost.py``): ``TimmResNet`` has timm's ``ResNet`` interface
(``forward_features``, ``forward_head``, ``reset_classifier``, ``get_classifier``,
``pretrained_cfg``, ``num_classes``, an ``nn.MaxPool2d`` stem, residual adds); ``Branchy`` adds a
data-dependent branch (fx and export cannot keep it)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, c: int, norm: bool = True, functional_relu: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=not norm)
        self.bn1 = nn.BatchNorm2d(c) if norm else nn.Identity()
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=not norm)
        self.bn2 = nn.BatchNorm2d(c) if norm else nn.Identity()
        self.act2 = nn.ReLU()
        self.functional_relu = functional_relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = F.relu(out) if self.functional_relu else out
        return self.act2(out + x)


class TimmResNet(nn.Module):
    """timm's ResNet interface on a 2-stage, 8-channel network."""

    def __init__(self, num_classes: int = 10, norm: bool = True, functional_pool: bool = False,
                 functional_relu: bool = False, widths: tuple[int, ...] = (8, 8),
                 blocks: tuple[int, ...] = (2, 1)) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.pretrained_cfg = {"architecture": "resnet_tiny", "mean": (0.5, 0.5, 0.5)}
        self.functional_pool = functional_pool
        c = widths[0]
        self.conv1 = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.act1 = nn.ReLU()
        self.maxpool = nn.MaxPool2d(2)
        for i, (w, n) in enumerate(zip(widths, blocks)):
            stage = [] if w == c else [nn.Conv2d(c, w, 1, stride=2, bias=False)]
            stage += [BasicBlock(w, norm, functional_relu) for _ in range(n)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
            c = w
        self.stages = len(widths)
        self.num_features = c
        self.fc = nn.Linear(c, num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2) if self.functional_pool else self.maxpool(x)
        for i in range(self.stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x.mean((2, 3))
        return x if pre_logits else self.fc(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def reset_classifier(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.fc = nn.Linear(self.num_features, num_classes)

    def get_classifier(self) -> nn.Module:
        return self.fc


class Branchy(TimmResNet):
    """A data-dependent branch: fx and export cannot keep it (eager or draft_export capture)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.forward_features(x)
        if float(f.abs().mean()) > 1e6:     # never taken, but decided by the data
            f = f * 0
        return self.forward_head(f)


class PoolCNN(nn.Module):
    """conv -> ReLU -> max-pool -> conv -> ReLU -> global mean -> linear: a max-pool that
    cannot fold into the convolution before it (a ReLU sits between)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.c1(x)))
        return self.fc(torch.relu(self.c2(x)).mean((2, 3)))



class SmallCNN(nn.Module):
    """conv -> ReLU -> functional max-pool -> conv -> ReLU -> global mean -> linear (the
    user-class hunts' model: scripted, copied, pickled, loaded from checkpoints)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.relu(self.c2(x))
        return self.fc(x.mean((2, 3)))


class AutoEncoder(nn.Module):
    """An encoder and a decoder, each Linear-ReLU-Linear, and an ``encode`` method (a user
    method returning a submodule's output)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 8))
        self.decoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 20))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))
