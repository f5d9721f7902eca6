"""Issue 2 figure: on the paper's LIBSVM MLP (100-384-64-10, ReLU) the per-sample
weight-to-gradient ratios E[dW^2]/E[W^2] (random quadratic loss, batch size 1, Sec. 3.1/4)
spread at most 1.2x across layers after precondition, and at least 20x under PyTorch's default
init.  The ratio is computed in tests/helpers.py, independently of precondfx."""
import torch

import precondfx
from precondfx import zoo
from tests.helpers import per_sample_ratios

N = 200


def _spread(r):
    return max(r) / min(r)


def _weights(model):
    return [p for n, p in model.named_parameters() if n.endswith("weight")]


def test_preconditioned_mlp_ratios_balanced_default_init_not():
    model, _ = zoo.build("mlp", batch=256)
    x = torch.randn(N, 100, generator=torch.Generator().manual_seed(1))
    default = per_sample_ratios(model, _weights(model), x, N)
    pm, rep = precondfx.precondition(model, x[:256] if len(x) >= 256 else x, seed=0)
    assert len(_weights(pm)) == 3
    pre = per_sample_ratios(pm, _weights(pm), x, N)
    print(f"default init spread {_spread(default):.1f}x, precondfx spread {_spread(pre):.3f}x")
    assert _spread(pre) <= 1.2
    assert _spread(default) >= 20


def test_geometric_std_matches_eq7():
    """E[W^2] = 2/sqrt(n_in n_out) for every layer (Eq. 7), measured on the drawn weights."""
    model, x = zoo.build("mlp", batch=64)
    pm, _ = precondfx.precondition(model, x, seed=0)
    for (n_out, n_in), w in zip([(384, 100), (64, 384), (10, 64)], _weights(pm)):
        target = 2 / (n_in * n_out) ** 0.5
        got = float(w.double().pow(2).mean())
        # sample second moment of n normals: relative sd sqrt(2/n)
        assert abs(got / target - 1) < 5 * (2 / w.numel()) ** 0.5, (n_in, n_out, got, target)
    for n, b in pm.named_parameters():
        if n.endswith("bias"):
            assert float(b.abs().max()) == 0.0
