"""One draw routine for both back ends: the same rules, second moments matched exactly on the
PyTorch and the ONNX (numpy) path, orthogonal blocks orthonormal on both."""
import numpy as np
import pytest
import torch

from precondfx.core import draw as core
from precondfx.pytorch.apply.reinit import draw as torch_draw
from precondfx.onnx.reinit import draw as numpy_draw
from precondfx.core.plan import ParamInit


@pytest.mark.parametrize("shape", [(64, 10), (16, 3, 3, 3), (7,)])
@pytest.mark.parametrize("std", [0.3, 0.0123])
def test_normal_second_moment_is_exact_on_both_paths(shape, std):
    pi = ParamInit("w", "geometric", std, "", list(shape))
    t = torch_draw(pi, shape, torch.Generator().manual_seed(3))
    a = numpy_draw(pi, shape, np.random.default_rng(3))
    assert t.dtype == torch.float32 and a.dtype == np.float32
    assert tuple(t.shape) == shape and a.shape == shape
    assert float(t.double().pow(2).mean()) == pytest.approx(std ** 2, rel=1e-6)
    assert float(np.mean(a.astype(np.float64) ** 2)) == pytest.approx(std ** 2, rel=1e-6)


def test_torch_draw_is_randn_rescaled():
    """The PyTorch values are those of the first implementation: randn from the seeded
    generator times std / rms (bit for bit)."""
    pi = ParamInit("w", "fan_in", 0.2, "", [32, 5])
    ref = torch.randn((32, 5), generator=torch.Generator().manual_seed(9))
    ref = ref * (0.2 / float(ref.double().pow(2).mean()) ** 0.5)
    assert torch.equal(torch_draw(pi, (32, 5), torch.Generator().manual_seed(9)), ref)


@pytest.mark.parametrize("shape,gates", [((32, 8), 4), ((12, 20), 3), ((2, 24, 6), 4)])
def test_orthogonal_blocks_on_both_paths(shape, gates):
    pi = ParamInit("w", "orthogonal", 1.0, "", list(shape), gates)
    for w in (torch_draw(pi, shape, torch.Generator().manual_seed(0)).numpy(),
              numpy_draw(pi, shape, np.random.default_rng(0))):
        assert w.shape == shape
        for d in (w if w.ndim == 3 else w[None]):
            for blk in np.split(d.astype(np.float64), gates, axis=0):
                small = blk @ blk.T if blk.shape[0] <= blk.shape[1] else blk.T @ blk
                np.testing.assert_allclose(small, np.eye(len(small)), atol=1e-5)


def test_constant_rules_and_keep():
    ops = core.numpy_ops(np.random.default_rng(0))
    assert core.draw(ParamInit("b", "zeros", None, ""), (3,), ops).tolist() == [0.0] * 3
    assert core.draw(ParamInit("g", "ones", None, ""), (2,), ops).tolist() == [1.0] * 2
    assert core.draw(ParamInit("c", "constant", 0.25, ""), (2,), ops).tolist() == [0.25] * 2
    assert core.draw(ParamInit("k", "keep", None, ""), (2,), ops) is None
    assert core.draw(ParamInit("s", "scale", 2.0, ""), (2,), ops) is None


def test_counter_rng_reinit_uses_the_shared_draw():
    """``precondfx.pytorch.distributed.reinit(rng='counter')`` (whole-tensor rules on plain tensors):
    recurrent weights orthogonal per gate, normal weights with their exact second moment."""
    from torch import nn

    import precondfx
    from precondfx.pytorch import distributed

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.fc = nn.LSTM(6, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.fc(self.rnn(x)[0])

    with torch.random.fork_rng():
        torch.manual_seed(0)
        net, x = Net(), torch.randn(5, 3, 6)
    plan = precondfx.analyze(net, x, balance="none").plan
    assert plan.inits["rnn.weight_hh_l0"].rule == "orthogonal"
    distributed.reinit(net, plan, 0, rng="counter")
    with torch.no_grad():
        for blk in net.rnn.weight_hh_l0.double().split(8):
            torch.testing.assert_close(blk @ blk.T, torch.eye(8, dtype=torch.float64),
                                       atol=1e-5, rtol=0)
        assert float(net.fc.weight.double().pow(2).mean()) == \
            pytest.approx(plan.inits["fc.weight"].std ** 2, rel=1e-6)
