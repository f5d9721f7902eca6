"""Hunt masks11: the captures (fx, export, eager) agree with each other and with ONNX."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precondfx


class _LtMask(nn.Module):
    """A float mask read by a comparison: ``m < 0.5`` marks the padded positions."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        h = h.masked_fill((m < 0.5).unsqueeze(-1), 0.0)
        return self.l2(h)


class _WhereMask(_LtMask):
    """A float mask read as ``1 - m`` (the padding) inside ``torch.where``."""

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        pad = (1 - m).unsqueeze(-1) > 0.5
        return self.l2(torch.where(pad, torch.zeros_like(h), h))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = 4 * torch.randn(32, 5, 8, generator=g)     # input scale ~0.15: keep * s < 0.5
    m = (torch.rand(32, 5, generator=g) > 0.3).float()
    return x, m


@pytest.mark.parametrize("capture", ["export", "eager"])
@pytest.mark.parametrize("cls", [_LtMask, _WhereMask])
def test_mask_by_use_left_alone_by_input_scale(capture: str, cls: type) -> None:
    """(a) before: export/eager multiplied m by the input scale (0.153): every position
    masked, calibration refused (zero variance); fx left it alone.  Now all three agree."""
    x, m = _data()
    torch.manual_seed(0)
    ref, _ = precondfx.precondition(cls(), (x, m), capture="fx", input_scale="auto")
    torch.manual_seed(0)
    out, rep = precondfx.precondition(cls(), (x, m), capture=capture, input_scale="auto")
    assert "not on input" in str(rep) and "a mask" in str(rep)
    with torch.no_grad():
        y, y_ref = out(x, m), ref(x, m)
        assert float(y.std()) == pytest.approx(1.0, rel=0.05)
        assert torch.allclose(y, y_ref, atol=1e-5)
        # the mask still masks: the padded positions give the bias alone
        pad = m < 0.5
        assert torch.allclose(y[pad], y[pad][:1].expand_as(y[pad]), atol=1e-5)


class _DataInput(nn.Module):
    """A second input used as data (``x * s``): scaled on every capture."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return self.l1(x * s.unsqueeze(-1))


@pytest.mark.parametrize("capture", ["export", "eager"])
def test_data_input_still_scaled(capture: str) -> None:
    """A product with another input is data: the input scale still multiplies it."""
    x, m = _data()
    out, rep = precondfx.precondition(_DataInput(), (x, m), capture=capture,
                                      input_scale="auto")
    assert "a mask" not in str(rep)


class _Transposed(nn.Module):
    """A hand-written linear layer: ``x @ self.weight.T + self.bias`` (weight stored (out, in)
    as nn.Linear's)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.weight = nn.Parameter(3 * torch.randn(16, 8))
        self.bias = nn.Parameter(torch.zeros(16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.T if self.how == "T" else self.weight.mT if self.how == "mT" \
            else self.weight.t()
        return self.head(torch.relu(x @ w + self.bias))


@pytest.mark.parametrize("capture", ["fx", "export", "eager"])
@pytest.mark.parametrize("how", ["T", "mT"])
def test_weight_property_transpose_is_a_linear_layer(capture: str, how: str) -> None:
    """(c) before: ``.T``/``.mT`` read as a product of two activations ("breaks"), the weight
    kept at std 3.13 (eager: the parameter not even seen); ``.t()`` a linear layer at the
    plan's std 0.42.  Now all three captures read both as ``.t()``."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ref, ref_rep = precondfx.precondition(_Transposed("t"), (x,), capture=capture)
    torch.manual_seed(0)
    out, rep = precondfx.precondition(_Transposed(how), (x,), capture=capture)
    assert rep.capture == capture
    assert [n.status for n in rep.nodes if n.kind == "matmul"] == ["weighted"]
    assert "breaks" not in {n.status for n in rep.nodes}
    w, w_ref = float(out.weight.detach().std()), float(ref.weight.detach().std())
    assert w == pytest.approx(w_ref, rel=1e-6)
    assert float(out.weight.detach().std()) < 1.0
    with torch.no_grad():
        assert torch.allclose(out(x), ref(x), atol=1e-5)
