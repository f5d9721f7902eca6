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
