"""The report's note on the outputs returned beside the main one, on the PyTorch back end:
it said every other output was "not" under the output scale, also the probabilities a model
returns as ``softmax(logits)``, which the result computes from the scaled logits (as the ONNX
back end says since its own fix).  Now the outputs that see the scale are told apart by
measurement (the output scale doubled against as calibrated), on every capture."""
import pytest
import torch
from torch import nn

import precondfx


class Heads(nn.Module):
    """Logits, their softmax, and a second head that does not read the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 5), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        logits = self.b(h)
        return logits, logits.softmax(-1), torch.tanh(self.c(h))


@pytest.mark.parametrize("capture", ["fx", "eager", "export"])
def test_the_note_says_which_outputs_see_the_scale(capture):
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    res, rep = precondfx.precondition(Heads(), x, capture=capture, lr=None)
    assert rep.capture == capture
    note = [n for n in rep.capture_notes if n.startswith("output scale on output[0]")]
    assert len(note) == 1, rep.capture_notes
    assert "output[1] is computed from it in the model, so it sees the scale too" in note[0]
    assert "not on output[2]" in note[0] and "not on output[1]" not in note[0]
    with torch.no_grad():      # what the note says is what the result computes
        logits, probs, _ = res(x)
        assert float((probs - logits.softmax(-1)).abs().max()) < 1e-6
        assert abs(float(logits.std()) - 1.0) < 0.05 and rep.output_scale != 1.0
