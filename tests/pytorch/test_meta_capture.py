"""Capture on the meta device: forwards that create tensors without ``device=``, models fx
cannot trace (torch.export on meta), and clear errors where a forward needs values or mixes
devices.  Each planned model materializes to the same function as preconditioning the real
model."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

import precondfx

SEED, TARGET = 3, 0.5


class LSTMCellLoop(nn.Module):
    """Sequence-first input, state made with torch.zeros (no device=)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(5, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[1], 12)
        c = torch.zeros(x.shape[1], 12)
        for t in range(x.shape[0]):
            h, c = self.cell(x[t], (h, c))
        return self.head(h)


class CausalEncoder(nn.Module):
    """The causal mask made in forward on the default device."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.enc(self.emb(ids), mask=mask, is_causal=True))


class SizeLoop(nn.Module):
    """fx cannot trace a loop over a size; torch.export can, on meta too."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        for _ in range(x.size(1) // 8):
            h = h * 1.0
        return self.b(h)


def _ids() -> torch.Tensor:
    return torch.randint(0, 20, (4, 7), generator=torch.Generator().manual_seed(0))


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any], str]] = {
    "lstmcell_loop": (LSTMCellLoop, lambda: _x(6, 4, 5), "export"),
    "causal_encoder": (CausalEncoder, _ids, "export"),
    "size_loop": (SizeLoop, lambda: _x(4, 8), "export"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_meta_capture_materializes_to_the_real_result(name: str) -> None:
    build, sample, method = CASES[name]
    torch.manual_seed(0)
    real = build()
    ref, rref = precondfx.precondition(real, sample(), balance="analytic", seed=SEED,
                                       target_std=TARGET)
    with torch.device("meta"):
        mm = build()
    pm, rep = precondfx.precondition(mm, sample(), balance="analytic", seed=SEED,
                                     target_std=TARGET)
    assert rep.capture == rref.capture == method
    assert rep.plan.to_dict()["layers"] == rref.plan.to_dict()["layers"]
    assert {k: (v.rule, v.std) for k, v in rep.plan.inits.items()} == \
        {k: (v.rule, v.std) for k, v in rref.plan.inits.items()}
    pm.to_empty(device="cpu")
    with torch.no_grad():   # the user's init of what the plan keeps
        mine = dict(pm.named_parameters())
        for n, p in real.named_parameters():
            if rep.plan.inits.get(n) is None or rep.plan.inits[n].rule == "keep":
                mine[n].copy_(p)
    precondfx.reinit(pm, rep.plan, seed=SEED)
    stats = precondfx.pytorch.distributed.calibrate(pm, sample(), target_std=TARGET)
    assert stats["scale"] == pytest.approx(rref.output_scale, rel=1e-5)
    assert stats["std_after"] == pytest.approx(TARGET, rel=1e-5)
    with torch.no_grad():
        a, b = ref.eval()(sample()), pm.eval()(sample())
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), float((a - b).abs().max())


class MaskedDecoder(nn.Module):
    """nn.TransformerDecoder reads the values of a mask passed in (is it causal?)."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoder(layer, 1)
        self.head = nn.Linear(16, 5)

    def forward(self, tgt: torch.Tensor, mem: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.dec(tgt, mem, tgt_mask=mask, tgt_is_causal=None))


def test_meta_value_read_on_an_input_names_it() -> None:
    with torch.device("meta"):
        m = MaskedDecoder()
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    with pytest.raises(precondfx.PrecondError, match=r"meta device.*Tensor\.item\(\).*"
                                                     r"test_meta_capture\.py"):
        precondfx.precondition(m, (_x(2, 5, 16), _x(2, 3, 16), mask), balance="analytic")


class CpuAttr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.offset = torch.ones(4)          # a plain attribute: not moved by .to()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.offset


def test_meta_device_mismatch_says_what_to_do() -> None:
    m = CpuAttr()
    m.lin.to("meta")
    with pytest.raises(precondfx.PrecondError, match=r"mixes a meta tensor.*cpu.*"
                                                     r"torch\.device\('meta'\)"):
        precondfx.precondition(m, _x(3, 8), balance="analytic")


class LossOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.lin(x), y)


def test_meta_model_returning_a_loss_is_refused_as_with_data() -> None:
    """The check the calibration makes with data (a single number has no std) is made on the
    meta device from the output's shape, before anything is materialized."""
    sample = (_x(6, 8), torch.randint(0, 4, (6,)))
    with pytest.raises(precondfx.PrecondError, match="single number") as real:
        precondfx.precondition(LossOnly(), sample, balance="analytic")
    with torch.device("meta"):
        m = LossOnly()
    with pytest.raises(precondfx.PrecondError, match="single number") as fake:
        precondfx.precondition(m, sample, balance="analytic")
    assert str(fake.value) == str(real.value)
    _, rep = precondfx.precondition(m, sample, balance="analytic", target_std=None)
    assert rep.plan.scale("output") is None
