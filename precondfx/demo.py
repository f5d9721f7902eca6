"""The models the ``precondfx demo`` command runs on: small, built-in, no downloads.

The test and benchmark zoo (``tests/zoo.py``, not shipped) registers these same builders beside
its other models.  A builder is ``builder(seed=0, **sizes) -> (model, sample)``; it seeds its own
draws without touching the caller's random state.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "MaxPoolCNN", "mlp", "maxpool_cnn", "DEMOS", "build"]


def _seeded(fn: Callable[[], tuple[nn.Module, Any]], seed: int) -> tuple[nn.Module, Any]:
    """Run ``fn`` with the CPU RNG seeded to ``seed``, restoring the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


class MLP(nn.Module):
    """Linear-ReLU stack; the default widths are the paper's LIBSVM MLP (384, 64)."""

    def __init__(self, n_in: int = 100, n_out: int = 10, hidden: Sequence[int] = (384, 64)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        prev = n_in
        for h in hidden:
            layers += [nn.Linear(prev, h), nn.ReLU()]
            prev = h
        layers.append(nn.Linear(prev, n_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mlp(seed: int = 0, *, n_in: int = 100, n_out: int = 10, batch: int = 32) -> tuple[nn.Module, Any]:
    """Paper's LIBSVM MLP: Linear(n_in,384)-ReLU-Linear(384,64)-ReLU-Linear(64,n_out)."""
    return _seeded(lambda: (MLP(n_in, n_out), torch.randn(batch, n_in)), seed)


class MaxPoolCNN(nn.Module):
    """conv-relu-MaxPool2d(2) x2 (foldable), conv-relu-MaxPool2d(3,2,1) (not
    foldable), conv-relu-F.max_pool2d(2) (functional, foldable), linear."""

    def __init__(self, in_ch: int = 3, width: int = 8, image: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, width, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(2 * width, 2 * width, 3, padding=1)
        self.relu3 = nn.ReLU()
        self.pool3 = nn.MaxPool2d(3, stride=2, padding=1)  # overlapping windows: not foldable
        self.conv4 = nn.Conv2d(2 * width, 2 * width, 3, padding=1)
        self.relu4 = nn.ReLU()
        side = image // 16
        self.fc = nn.Linear(2 * width * side * side, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.relu1(self.conv1(x)))
        x = self.pool2(self.relu2(self.conv2(x)))
        x = self.pool3(self.relu3(self.conv3(x)))
        x = F.max_pool2d(self.relu4(self.conv4(x)), 2)
        return self.fc(torch.flatten(x, 1))


def maxpool_cnn(seed: int = 0, *, image: int = 32, batch: int = 4, num_classes: int = 10) -> tuple[nn.Module, Any]:
    """CNN with two foldable MaxPool2d(2), one unfoldable MaxPool2d(3,2,1) and one F.max_pool2d."""
    if image % 16:
        raise ValueError("image must be a multiple of 16")
    return _seeded(lambda: (MaxPoolCNN(image=image, num_classes=num_classes),
                            torch.randn(batch, 3, image, image)), seed)


#: name -> builder, for ``precondfx demo --model NAME``.
DEMOS: dict[str, Callable[..., tuple[nn.Module, Any]]] = {"maxpool_cnn": maxpool_cnn, "mlp": mlp}


def build(name: str, **kw: Any) -> tuple[nn.Module, Any]:
    """Build demo model ``name``; KeyError names the known ones."""
    try:
        return DEMOS[name](**kw)
    except KeyError:
        raise KeyError(f"unknown demo model {name!r}; known: {', '.join(DEMOS)}") from None
