"""Max-pool replacement (Table 1, Sec. 7): fold, strided conv, average pool, keep."""
import copy

import torch
import torch.nn.functional as F
from torch import nn

import precondfx
from tests import zoo
from tests.helpers import call, frozen, main

MAXPOOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)


def _maxpools_left(pm):
    mods = [m for m in pm.modules() if isinstance(m, MAXPOOLS)]
    fns = []
    if isinstance(pm, torch.fx.GraphModule):
        fns = [n for n in pm.graph.nodes if n.op == "call_function"
               and n.target in (F.max_pool1d, F.max_pool2d, F.max_pool3d)]
    return len(mods) + len(fns)


def test_default_removes_every_maxpool_and_keeps_shapes():
    model, x = zoo.build("maxpool_cnn")
    assert _maxpools_left(torch.fx.symbolic_trace(model)) == 4
    pm, rep = precondfx.precondition(model, x)
    assert _maxpools_left(pm) == 0
    acts = sorted(p.action for p in rep.plan.pools)
    assert acts == ["conv", "fold", "fold", "fold"]
    # shapes identical to the original's (the model is built for 32x32 inputs)
    for size in (32,):
        xx = torch.randn(2, 3, size, size)
        assert main(call(pm, xx)).shape == main(call(model, xx)).shape


def test_folded_conv_has_the_pool_stride():
    model, x = zoo.build("maxpool_cnn")
    pm, rep = precondfx.precondition(model, x)
    folds = [p for p in rep.plan.pools if p.action == "fold"]
    for p in folds:
        conv_name = p.into
        mod = pm.get_submodule(conv_name.replace("_", ".")) if "." in conv_name else \
            pm.get_submodule(conv_name)
        orig = model.get_submodule(conv_name)
        assert tuple(mod.stride) == tuple(s * 2 for s in orig.stride)


def test_conv_mode_replaces_with_strided_convs_of_pool_geometry():
    model, x = zoo.build("vgg_bn")
    n_conv = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    pools = [m for m in model.modules() if isinstance(m, nn.MaxPool2d)]
    pm, rep = precondfx.precondition(model, x, maxpool="conv")
    convs = [m for m in pm.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == n_conv + len(pools)
    assert _maxpools_left(pm) == 0
    new = [c for c in convs if c.in_channels == c.out_channels and c.kernel_size == (2, 2)]
    assert len(new) == len(pools) and all(c.stride == (2, 2) for c in new)


def test_avgpool_mode_is_exactly_avg_pooling():
    model, x = zoo.build("vgg_bn")
    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules()):
        for cname, c in list(m.named_children()):
            if isinstance(c, nn.MaxPool2d):
                setattr(m, cname, nn.AvgPool2d(c.kernel_size, c.stride, c.padding, c.ceil_mode))
    pm, rep = precondfx.precondition(model, x, maxpool="avgpool", reinit_weights=False,
                                     balance="none", residual="none", target_std=None)
    with frozen(pm, False), frozen(ref, False):
        torch.testing.assert_close(main(call(pm, x)), main(call(ref, x)), rtol=1e-5, atol=1e-6)


def test_keep_mode_keeps_maxpool():
    model, x = zoo.build("maxpool_cnn")
    pm, rep = precondfx.precondition(model, x, maxpool="keep")
    assert _maxpools_left(pm) == 4
    assert all(p.action == "keep" for p in rep.plan.pools)


def test_eager_path_replaces_module_pools_and_reports_functional_ones():
    model, x = zoo.build("maxpool_cnn")
    pm, rep = precondfx.precondition(model, x, capture="eager")
    assert rep.capture == "eager"
    assert not any(isinstance(m, MAXPOOLS) for m in pm.modules())
    skipped = [w for w, why in rep.skipped if "maxpool" in w]
    assert len(skipped) == 1 and "functional" in dict(rep.skipped)[skipped[0]]


def test_ceil_mode_pool_that_cannot_match_is_kept_with_reason():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 4, 3, padding=1)
            self.p = nn.MaxPool2d(2, ceil_mode=True)
            self.fc = nn.Linear(4 * 4 * 4, 3)

        def forward(self, x):
            return self.fc(self.p(torch.relu(self.c(x))).flatten(1))

    pm, rep = precondfx.precondition(M(), torch.randn(4, 3, 7, 7), maxpool="conv")
    (pc,) = rep.plan.pools
    assert pc.action == "keep" and "ceil_mode" in pc.reason


# -- pool_conv: which strided convolution replaces a max-pool that is not folded -------------
def test_pool_conv_avg_is_average_pooling_at_init():
    """pool_conv='avg': the replacement convolutions (trainable, C->C) compute average pooling
    at init, so the preconditioned model equals maxpool='avgpool' with the same seed (every
    other weight, alpha and the output scale included) to float rounding, on fresh inputs."""
    model, x = zoo.build("maxpool_cnn")
    pa, ra = precondfx.precondition(model, x, seed=3, maxpool="avgpool")
    pc, rc = precondfx.precondition(model, x, seed=3, maxpool="conv", pool_conv="avg")
    assert [p.action for p in rc.plan.pools] == ["conv"] * 4
    assert all(p.conv == "avg" for p in rc.plan.pools)
    new = [m for n, m in pc.named_modules() if isinstance(m, nn.Conv2d) and "pool" in n]
    assert len(new) == 4 and all(m.weight.requires_grad for m in new)
    xx = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with frozen(pa, False), frozen(pc, False):
        torch.testing.assert_close(main(call(pc, xx)), main(call(pa, xx)), rtol=1e-5, atol=1e-5)


def test_avg_pool_weight_convolution_equals_avg_pool2d():
    from precondfx.pytorch.apply.common import avg_pool_weight
    x = torch.randn(2, 6, 9, 9, generator=torch.Generator().manual_seed(0))
    w = avg_pool_weight(6, (3, 3))
    got = F.conv2d(x, w, stride=2, padding=1)
    torch.testing.assert_close(got, F.avg_pool2d(x, 3, 2, 1), rtol=1e-6, atol=1e-6)


def test_pool_conv_depthwise_replaces_unfoldable_pool_with_grouped_conv():
    """pool_conv='depthwise': the pool that cannot fold (MaxPool2d(3, 2, 1)) becomes a C->C
    convolution with groups=C (weight (C, 1, 3, 3)), re-initialized with the init rule's
    second moment for fans (1, 1, taps); the foldable pools still fold."""
    model, x = zoo.build("maxpool_cnn")
    pm, rep = precondfx.precondition(model, x, pool_conv="depthwise", balance="none")
    assert sorted(p.action for p in rep.plan.pools) == ["conv", "fold", "fold", "fold"]
    (pc,) = [p for p in rep.plan.pools if p.action == "conv"]
    assert pc.conv == "depthwise"
    mod = pm.get_submodule(pc.new_param[:-len(".weight")])
    assert isinstance(mod, nn.Conv2d) and mod.groups == 16 and tuple(mod.weight.shape) == (16, 1, 3, 3)
    lay = next(lay for lay in rep.plan.layers if lay.weight == pc.new_param)
    assert (lay.n_in, lay.n_out) == (1, 1)
    pi = rep.plan.inits[pc.new_param]
    assert pi.rule == "geometric"
    ms = float(mod.weight.detach().pow(2).mean())
    assert abs(ms - pi.std ** 2) < 1e-4 * pi.std ** 2          # moment-matched draw
    assert torch.isfinite(main(call(pm, x))).all()


def test_pool_conv_full_is_the_old_replacement():
    model, x = zoo.build("maxpool_cnn")
    pm, rep = precondfx.precondition(model, x, pool_conv="full")
    (pc,) = [p for p in rep.plan.pools if p.action == "conv"]
    mod = pm.get_submodule(pc.new_param[:-len(".weight")])
    assert mod.groups == 1 and tuple(mod.weight.shape) == (16, 16, 3, 3)


def test_pool_conv_bad_value_is_refused():
    model, x = zoo.build("maxpool_cnn")
    try:
        precondfx.precondition(model, x, pool_conv="grouped")
    except precondfx.PrecondError as e:
        assert "pool_conv" in str(e) and "depthwise" in str(e)
    else:
        raise AssertionError("pool_conv='grouped' was accepted")
