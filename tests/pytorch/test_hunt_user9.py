"""user9's hunt: the user's model contract and the training loop (user_class, first_step)."""
from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import precondfx


def _caught(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fn()
    return [str(i.message) for i in w if "precondfx" in str(i.message)]


class PoolNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def _train(model, opt, x, y, steps=3):
    def run():
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return _caught(run)


def test_lr_none_added_conv_left_out_of_optimizer_is_said():
    """lr=None: a max-pool's replacement convolution left out of parameter groups built by
    name was silent (before: 0 warnings, the conv never moved); now one warning naming it."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    m, _ = precondfx.precondition(PoolNet(), x, lr=None, maxpool="conv")
    assert "features.2.weight" in dict(m.named_parameters())
    w0 = m.features[2].weight.detach().clone()
    groups = [{"params": [p for n, p in m.named_parameters() if n.startswith("features.0")]},
              {"params": [p for n, p in m.named_parameters() if n.startswith("head")]}]
    said = _train(m, torch.optim.SGD(groups, lr=0.01), x, y)
    assert torch.equal(m.features[2].weight, w0)         # it indeed never moved
    hits = [s for s in said if "features.2.weight" in s and "no optimizer" in s]
    assert len(hits) == 1, said


def test_lr_none_added_conv_in_optimizer_or_inplace():
    """Silent where an optimizer holds every parameter; said for an inplace result too."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    m, _ = precondfx.precondition(PoolNet(), x, lr=None, maxpool="conv")
    assert _train(m, torch.optim.SGD(m.parameters(), lr=0.01), x, y) == []
    net = PoolNet()
    m, _ = precondfx.precondition(net, x, lr=None, maxpool="conv", inplace=True)
    opt = torch.optim.SGD([p for n, p in m.named_parameters() if n.startswith("features.0")],
                          lr=0.01)
    said = _train(m, opt, x, y)
    assert len([s for s in said if "features.2.weight" in s]) == 1, said
    # lr='auto' says it once at its first step, not twice
    m, _ = precondfx.precondition(PoolNet(), x, maxpool="conv")
    groups = [p for n, p in m.named_parameters() if not n.startswith("features.2")]
    said = _train(m, torch.optim.SGD(groups, lr=0.01), x, y)
    assert len([s for s in said if "features.2.weight" in s]) == 1, said


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.body = nn.Sequential(Block(), Block())
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.inp(x)))


def test_cloned_ema_of_own_weights_loads_without_plain_warning():
    """A hand-written EMA of a part's own weights ({k: v.clone()}), loaded back into the part,
    was warned about as plain weights (before: 1 warning); now silent, while the folded
    weights and those of the model before precondition are still said."""
    torch.manual_seed(0)
    x = torch.randn(32, 8)
    m, _ = precondfx.precondition(ResNet(), x, lr=None)
    consts = [float(b) for n, b in m.named_buffers() if "residual" in n]
    assert consts and all(abs(c - 1) > 0.1 for c in consts)     # the test needs c != 1
    ema = {k: v.detach().clone() for k, v in m.body.state_dict().items()}
    with torch.no_grad():                                   # a few steps later
        for p in m.body.parameters():
            p.add_(0.01 * torch.randn_like(p))
    assert _caught(lambda: m.body.load_state_dict(ema)) == []
    ref = m(x)
    folded = precondfx.fold(copy.deepcopy(m))
    said = _caught(lambda: m.body.load_state_dict(folded.body.state_dict()))
    assert len(said) == 1 and "plain weights" in said[0]
    said = _caught(lambda: m.body.load_state_dict(ResNet().body.state_dict()))
    assert len(said) == 1 and "plain weights" in said[0]
    assert not torch.allclose(m(x), ref)


def _conv() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))


def _bias_group_run(lr_w: float, lr_b: float, steps: int = 30):
    torch.manual_seed(0)
    x, y = torch.randn(32, 3, 16, 16), torch.randint(0, 5, (32,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, rep = precondfx.precondition(_conv(), x, seed=0)
    groups = [{"params": [p for n, p in m.named_parameters() if n.endswith("weight")],
               "lr": lr_w},
              {"params": [p for n, p in m.named_parameters() if n.endswith("bias")],
               "lr": lr_b}]
    opt = torch.optim.SGD(groups, lr=lr_w)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return rep.conditioning["lr_target"]["factor"], losses


def test_bias_in_a_group_at_a_higher_rate_is_under_the_ceiling():
    """Biases in a parameter group of their own at 40x the weights' rate: the first step's
    ceiling read the weights' group alone (factor 0.496 for lr 0.1) and the biases trained at
    40x the suggested rate: the loss rose 1.91 -> 3.20 and ended at 1.87 (1.36 with one
    group).  Now the rate is raised by the biases' own curvature: factor 0.18, the loss never
    rises above its start, ends below 1.5.  At 2x (Caffe's) the biases' curvature takes it:
    the factor is the one-group factor, as before."""
    c, losses = _bias_group_run(0.1, 4.0)
    assert max(losses) <= losses[0] + 1e-3, losses
    assert losses[-1] < 1.5
    assert c < 0.3
    c2, _ = _bias_group_run(0.1, 0.2, steps=1)
    c1, _ = _bias_group_run(0.1, 0.1, steps=1)
    assert c2 == c1


def test_lr_none_added_conv_left_out_in_a_deep_copied_run():
    """A run copied from the result (``run = copy.deepcopy(template)``, one per sweep point)
    with groups built by name: said for the copy too (before: silent), and only once."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,))
    template, _ = precondfx.precondition(PoolNet(), x, lr=None, maxpool="conv")
    for _ in range(2):
        run = copy.deepcopy(template)
        groups = [p for n, p in run.named_parameters() if not n.startswith("features.2")]
        said = _train(run, torch.optim.SGD(groups, lr=0.01), x, y)
        assert len([s for s in said if "features.2.weight" in s]) == 1, said


class EncoderLayer(nn.TransformerEncoderLayer):
    """A subclass of torch's layer (an installed library's class) with its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._sa_block(self.norm1(x), None, None)
        return x + self._ff_block(F.relu(self.norm2(x)))

    def ffn(self, h: torch.Tensor) -> torch.Tensor:
        """Runs the layers only through the library's own method."""
        return self._ff_block(h)

    def width(self) -> int:
        return self.linear1.out_features


def test_method_running_layers_through_an_inherited_library_method_is_said():
    """``ffn`` calls only ``self._ff_block`` (nn.TransformerEncoderLayer's), which runs
    linear1/linear2: it computes without the graph-only output scale like a method calling
    them itself, but was not named (library methods were not read; before: no warning).  Now
    named; ``width`` (reads ``self.linear1.out_features``, a number) is not (before: named
    as running the layers)."""
    torch.manual_seed(0)
    x = torch.randn(4, 10, 32)
    said = []

    def run():
        said.append(precondfx.precondition(
            EncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), x, lr=None))
    msgs = _caught(run)
    res, rep = said[0]
    assert rep.capture == "fx"
    assert "constant precondfx_output_scale" in rep.result["forward_only"]
    hits = [s for s in msgs if "run(s) your code" in s]
    assert len(hits) == 1 and "EncoderLayer.ffn" in hits[0] and "width" not in hits[0], msgs
