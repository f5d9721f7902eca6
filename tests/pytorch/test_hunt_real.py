"""Defects found by running real-world model code (diffusion U-Net, VAE, PointNet, NeRF,
MLP-Mixer, ConvNeXt, EfficientNet, a GCN, DCGAN, Swin windows, a char-RNN, a two-tower
retriever, a multi-task head, LeNet) through the pass on every back end; each test failed
before its fix, named in its docstring."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx


class _NeRF(nn.Module):
    """A NeRF-style MLP: positional encoding, and an output that concatenates colours through a
    sigmoid with a density through a softplus."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3 + 12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.rgb = nn.Linear(32, 3)
        self.sigma = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        enc = torch.cat([x] + [f(2.0 ** i * x) for i in range(2) for f in (torch.sin, torch.cos)],
                        -1)
        h = self.body(enc)
        return torch.cat([torch.sigmoid(self.rgb(h)), F.softplus(self.sigma(h))], -1)


@pytest.mark.parametrize("capture", ["fx", "export", "eager"])
def test_a_concatenated_output_with_a_sigmoid_part_keeps_its_range(capture):
    """The output scale went on the whole concatenation, so the sigmoid's colours came out in
    0..12 on the fx and export back ends (a sigmoid output alone was already left unscaled,
    with a warning).  Now a bounded part of a concatenated main output leaves it unscaled on
    every back end, said the same way (``outputs.bounded_producer`` walks the parts)."""
    x = torch.rand(64, 3, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = _NeRF()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out, rep = precondfx.precondition(model, x, capture=capture)
    said = [str(m.message) for m in w if "concatenation" in str(m.message)]
    assert len(said) == 1 and "sigmoid" in said[0]
    with torch.no_grad():
        y = out(x)
    assert 0.0 < float(y[:, :3].min()) and float(y[:, :3].max()) < 1.0
    assert not [b for b, _ in out.named_buffers() if "output_scale" in b]
    assert any("output" in str(s) for s in rep.skipped)
