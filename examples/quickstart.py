"""Quickstart: precondition a small CNN, read the report, and train it for a few steps.

Run:  python examples/quickstart.py
"""
import torch
from torch import nn

import precondfx


class SmallCNN(nn.Module):
    """A CNN with what precondfx rewrites: max pooling, mixed kernel sizes, a linear head."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 5, padding=2)
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool2 = nn.MaxPool2d(2)
        self.head = nn.Linear(32 * 8 * 8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(torch.relu(self.conv1(x)))
        x = self.pool2(torch.relu(self.conv2(x)))
        return self.head(x.flatten(1))


def main(steps: int = 20) -> tuple[precondfx.Report, list[float]]:
    torch.manual_seed(0)
    model = SmallCNN()
    images = torch.randn(64, 3, 32, 32)           # your calibration batch
    labels = torch.randint(0, 10, (64,))

    # One call: capture, classify, re-initialize, insert constants, fix the output scale.
    model_pc, report = precondfx.precondition(model, images)
    print(report)                                  # every node, its status, what changed

    # The result is an ordinary trainable module.
    opt = torch.optim.SGD(model_pc.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model_pc(images), labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"loss: {losses[0]:.4f} at the first step, {losses[-1]:.4f} after {steps} steps")
    return report, losses


if __name__ == "__main__":
    main()
