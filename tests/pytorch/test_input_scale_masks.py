"""``input_scale="auto"`` on a model with a float mask input (``attention_mask``): the input
scale multiplied every floating-point input, the mask too, so ``mask > 0.5`` masked every
token (a scale of 0.06: nothing kept, a constant output, and precondition refused with "zero
variance"); the mask's ones also entered the scale's rms.  Now an input named as a mask is
left alone on every capture, as the ONNX back end leaves it (``core.calibration.mask_named``,
one rule), and the report says so."""
import pytest
import torch
from torch import nn

import precondfx


class Pool(nn.Module):
    """A masked mean-pool over tokens, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.emb(x))
        keep = (attention_mask > 0.5).float()
        h = (h * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp_min(1)
        return self.head(h)


class Blend(nn.Module):
    """Two float inputs; ``masked_image`` is data (an inpainting input), not a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, masked_image: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x + masked_image)))


def _data(kept: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = 10 * torch.randn(32, 6, 8, generator=g)
    m = torch.ones(32, 6)
    m[:, kept:] = 0
    return x, m


@pytest.mark.parametrize("capture", ["fx", "eager", "export"])
def test_a_mask_input_is_not_scaled(capture):
    x, m = _data()
    res, rep = precondfx.precondition(Pool(), (x, m), input_scale="auto", capture=capture,
                                      lr=None)
    assert rep.capture == capture
    assert rep.input_scale < 0.2        # x's rms is 10: the mask would be masked away
    x2 = x.clone()
    x2[:, 4:] = 100 * torch.randn(32, 2, 8)      # the masked tokens changed
    with torch.no_grad():
        y = res(x, m)
        assert float((y - res(x2, m)).abs().max()) < 1e-6
    assert abs(float(y.std()) - 1.0) < 0.05
    said = [why for what, why in rep.skipped if what == "input scale"]
    assert len(said) == 1 and "'attention_mask'" in said[0] and "a mask" in said[0]


def test_the_input_scale_is_read_from_the_data_alone():
    """Masks of 4 and of 1 kept tokens give one input scale (before, the mask's values were
    part of the rms the scale is read from)."""
    scales = []
    for kept in (4, 1):
        x, m = _data(kept)
        _, rep = precondfx.precondition(Pool(), (x, m), input_scale="auto", capture="fx",
                                        lr=None)
        scales.append(rep.input_scale)
    assert scales[0] == pytest.approx(scales[1], rel=1e-6)
    x, _ = _data()
    assert 0.01 < scales[0] * float(x.pow(2).mean().sqrt()) < 10     # read from x


@pytest.mark.parametrize("capture", ["fx", "eager"])
def test_an_input_named_masked_image_is_data(capture):
    g = torch.Generator().manual_seed(1)
    x, im = 10 * torch.randn(16, 8, generator=g), 10 * torch.randn(16, 8, generator=g)
    res, rep = precondfx.precondition(Blend(), (x, im), input_scale="auto", capture=capture,
                                      lr=None)
    assert not [why for what, why in rep.skipped if what == "input scale"]
    with torch.no_grad():      # both inputs carry the scale: f(s x + s im) = f(s (x + im) + 0)
        got, moved = res(x, im), res(x + im, torch.zeros_like(im))
        assert float((got - moved).abs().max()) < 1e-4 * float(got.abs().max())
