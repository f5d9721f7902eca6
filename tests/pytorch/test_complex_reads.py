"""A complex parameter is read as its real and imaginary parts (precondfx.pytorch.reals): the
stored rms (lr_scale='user', lr='auto') and the measured statistics (measure=True) equal those of
the same model holding the parts as a real parameter.  ``.double()`` kept the real parts only."""
import warnings

import pytest
import torch
from torch import nn

from precondfx.pytorch import lr_transfer
from precondfx.pytorch.measure.conditioning import measure_conditioning


class Spectral(nn.Module):
    """An FNO spectral layer: rfft, a complex weight on the low modes, irfft."""

    def __init__(self, width: int, modes: int, real: bool = False) -> None:
        super().__init__()
        self.modes, self.real = modes, real
        w = torch.rand(width, width, modes, dtype=torch.cfloat) / width ** 2
        w = torch.complex(w.real, 3 * w.imag)      # imaginary parts 3x the real ones
        self.weights = nn.Parameter(torch.view_as_real(w).clone() if real else w)

    def forward(self, x):
        w = torch.view_as_complex(self.weights) if self.real else self.weights
        y = torch.einsum("bix,iox->box", torch.fft.rfft(x)[:, :, :self.modes], w)
        y = nn.functional.pad(y, (0, x.size(-1) // 2 + 1 - self.modes))
        return torch.fft.irfft(y, n=x.size(-1))


class FNO(nn.Module):
    def __init__(self, real: bool = False) -> None:
        super().__init__()
        self.lift = nn.Linear(2, 8)
        self.spec = Spectral(8, 4, real)
        self.skip = nn.Conv1d(8, 8, 1)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.lift(x).permute(0, 2, 1)
        h = torch.relu(self.spec(h) + self.skip(h))
        return self.head(h.permute(0, 2, 1))


def _pair():
    torch.manual_seed(0)
    m = FNO()
    t = FNO(real=True)
    sd = dict(m.state_dict())
    sd["spec.weights"] = torch.view_as_real(sd["spec.weights"]).clone()
    t.load_state_dict(sd)
    return m, t


def test_stored_rms_of_a_complex_weight_counts_the_imaginary_parts():
    m, _ = _pair()
    w = m.spec.weights.detach()
    explicit = float(((w.real.double() ** 2 + w.imag.double() ** 2).mean() / 2) ** 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")       # no "discards the imaginary part"
        got = lr_transfer.stored_rms(m.spec.weights)
    assert got == pytest.approx(explicit, rel=1e-12)
    # the real parts alone are 2.2x smaller here (old reading)
    assert float(w.real.double().pow(2).mean() ** 0.5) < 0.6 * got
    assert lr_transfer.user_scales(m, "user")["spec.weights"] == pytest.approx(explicit, rel=1e-12)


@pytest.mark.parametrize("method", ["hvp", "ggn"])
def test_measured_statistics_equal_the_real_parameter_twin(method):
    m, t = _pair()
    x = torch.randn(4, 16, 2)
    assert torch.equal(m(x), t(x))
    layers = ["lift.weight", "spec.weights", "skip.weight", "head.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        a, b = (measure_conditioning(mm, x, layers, n_samples=2, seed=0, method=method,
                                     verbose=False) for mm in (m, t))
    for la, lb in zip(a.layers, b.layers):
        for stat in ("hessian", "grad_sq", "ratio"):
            assert getattr(la, stat).mean == pytest.approx(getattr(lb, stat).mean, rel=1e-9), \
                (la.name, stat)
        assert la.weight_sq == pytest.approx(lb.weight_sq, rel=1e-12)
    spec = a.layers[1]
    w = m.spec.weights.detach()
    assert spec.weight_sq == pytest.approx(
        float((w.real.double() ** 2 + w.imag.double() ** 2).mean() / 2), rel=1e-12)
