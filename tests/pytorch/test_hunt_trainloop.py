"""Regression tests from the training-loop hunt (the result inside real training code)."""
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch import nn

import precondfx


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.c2 = nn.Conv2d(c, c, 3, padding=1, bias=False)

    def forward(self, x):
        return F.relu(x + self.c2(F.relu(self.c1(x))))


class _CheckpointedNet(nn.Module):
    """Blocks run under torch.utils.checkpoint, reentrant or not."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList([_Block(8) for _ in range(2)])
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.stem(x))
        for b in self.blocks:
            x = cp.checkpoint(b, x, use_reentrant=self.reentrant)
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("kw", [{"balance": "hessian"}, {"balance": "none", "measure": True},
                                {"balance": "none", "suggest_lr": True}])
def test_reentrant_checkpoint_measured_like_non_reentrant(kw):
    # the measurements differentiate with torch.autograd.grad, which a reentrant checkpoint's
    # backward refuses: precondition raised a bare RuntimeError on such a model (balance="auto",
    # the default, included); measured as a plain call it must give what the non-reentrant
    # model gives, and leave the checkpoint in the result
    torch.manual_seed(0)
    x = torch.randn(8, 3, 8, 8)
    plain = _CheckpointedNet(reentrant=False)
    reent = _CheckpointedNet(reentrant=True)
    reent.load_state_dict(plain.state_dict())
    r1, rep1 = precondfx.precondition(plain, x, **kw)
    r2, rep2 = precondfx.precondition(reent, x, **kw)
    assert torch.utils.checkpoint.CheckpointFunction.__name__ == "CheckpointFunction"
    b1 = {n: b for n, b in r1.named_buffers() if "precondfx" in n}
    b2 = {n: b for n, b in r2.named_buffers() if "precondfx" in n}
    assert b1.keys() == b2.keys()
    for n in b1:
        torch.testing.assert_close(b2[n], b1[n], rtol=1e-5, atol=0)
    if "suggest_lr" in kw:
        assert rep2.suggested_lr["sgd"] == pytest.approx(rep1.suggested_lr["sgd"], rel=1e-4)
    y1, y2 = r1(x), r2(x)
    torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-6)
    y2.pow(2).mean().backward()      # the result trains
    assert all(p.grad is not None for p in r2.parameters())


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, x):
        return F.relu(self.b(F.relu(self.a(x))))


class _WithCompiledBody(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.compile(_Body())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.body(x))


def test_compiled_submodule_not_recompiled_by_the_pass():
    # a submodule wrapped by torch.compile (the top-level wrapper is unwrapped with a note) was
    # compiled again by dynamo on every calibration and measuring forward of the pass (new
    # hooks and constants each time): 10 s and a recompile_limit warning on a tiny ResNet
    # against 0.4 s; the pass now runs it eagerly, says so, and the result still computes
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = _WithCompiledBody()
    x = torch.randn(32, 16)
    before = sum(counters["stats"].values())
    result, report = precondfx.precondition(model, x, balance="hessian")
    assert sum(counters["stats"].values()) == before       # dynamo compiled nothing
    assert any("body wrapped by torch.compile" in n for n in report.capture_notes)
    assert isinstance(result, _WithCompiledBody)
    with torch.compiler.set_stance("force_eager"):        # (compiling here would take seconds)
        y = result(x)
    assert float(y.std()) == pytest.approx(1.0, rel=0.2)


class _PooledBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


@pytest.mark.parametrize("maxpool", ["stride", "conv", "avgpool"])
def test_frozen_backbone_keeps_its_max_pools(maxpool):
    # linear probing: the pretrained features are frozen and only the head trains.  The pass
    # left the frozen weights as they were but still replaced the backbone's max-pools (the
    # stride folded into the frozen convs, or new trainable convs inside the frozen part): the
    # frozen features changed by 79% (stride) to 158% (conv), and nothing could train back
    torch.manual_seed(0)
    model = _PooledBackbone()
    model.features.requires_grad_(False)
    x = torch.randn(8, 3, 16, 16)
    result, report = precondfx.precondition(model, x, maxpool=maxpool)
    assert [n for n, p in result.named_parameters() if p.requires_grad] == \
        ["classifier.weight", "classifier.bias"]
    assert {pc.action for pc in report.plan.pools} == {"keep"}
    assert any("frozen" in pc.reason for pc in report.plan.pools)
    seen = {}
    result.classifier.register_forward_pre_hook(lambda m, i: seen.setdefault("f", i[0]))
    result(x)
    torch.testing.assert_close(seen["f"], model.features(x).flatten(1), rtol=0, atol=0)
    # a trainable layer before a pool: replaced as before
    torch.manual_seed(0)
    model = _PooledBackbone()
    model.features[3].requires_grad_(False)
    _, report = precondfx.precondition(model, x, maxpool=maxpool)
    assert [pc.action for pc in report.plan.pools][0] != "keep"
    assert [pc.action for pc in report.plan.pools][1] == "keep"
    # a frozen BatchNorm affine after a trainable conv is not a frozen feature extractor
    seq = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
    seq[1].requires_grad_(False)
    _, report = precondfx.precondition(seq, x, maxpool=maxpool)
    assert report.plan.pools[0].action != "keep"


class _ResMLP(nn.Module):
    """A normalization-free residual MLP (residual='auto' scales its branches by s)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.ReLU(),
                                                   nn.Linear(32, 32)) for _ in range(3)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(F.relu(h))
        return self.head(F.relu(h))


@pytest.mark.parametrize("residual", ["auto", "all"])
def test_frozen_residual_branches_get_no_branch_scale(residual):
    # a frozen residual backbone under a trainable head: each frozen branch was scaled by
    # s = 0.577 at its join, changing the frozen features by 15.8% with no weight that trains
    # to undo it (the same reason frozen weights get no alpha)
    torch.manual_seed(0)
    model = _ResMLP()
    model.inp.requires_grad_(False)
    model.blocks.requires_grad_(False)
    x = torch.randn(16, 12)
    result, report = precondfx.precondition(model, x, residual=residual)
    assert len(report.plan.residuals) == 3
    assert all(r.s is None and "frozen" in r.reason for r in report.plan.residuals)
    seen = {}
    result.head.register_forward_pre_hook(lambda m, i: seen.setdefault("f", i[0]))
    result(x)
    h = model.inp(x)
    for b in model.blocks:
        h = h + b(F.relu(h))
    torch.testing.assert_close(seen["f"], F.relu(h), rtol=0, atol=0)
    # one trainable layer in each branch: the branches are scaled as before
    torch.manual_seed(0)
    model = _ResMLP()
    for b in model.blocks:
        b[0].requires_grad_(False)
    _, report = precondfx.precondition(model, x, residual=residual)
    assert all(r.s is not None for r in report.plan.residuals)


class _FunctionalPoolBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 3, 2, 1)     # not foldable: a new strided conv
        return self.pool(self.pool(F.relu(self.c2(x))))    # a shared pool module, called twice


class _BackboneHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = _FunctionalPoolBackbone()
        self.head = nn.Linear(8 * 2 * 2, 10)

    def forward(self, x):
        return self.head(self.backbone(x).flatten(1))


def test_replacement_convs_are_named_inside_the_calling_module():
    # fine-tuning with one learning rate per part, groups built by name prefix: the strided
    # convolutions replacing a functional max-pool (and a shared pool module) inside the
    # backbone were named at the root (precondfx_pool_max_pool2d.weight), so they fell
    # outside 'backbone.' and were silently left out of the optimizer, never trained
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    result, report = precondfx.precondition(_BackboneHead(), x, maxpool="conv")
    assert {pc.action for pc in report.plan.pools} == {"conv"}
    names = [n for n, p in result.named_parameters() if p.requires_grad]
    groups = [[n for n in names if n.startswith(k)] for k in ("backbone.", "head.")]
    assert sorted(groups[0] + groups[1]) == sorted(names)
    assert sum("precondfx_pool" in n for n in groups[0]) == 6     # 3 convs, weight and bias
    result(x).sum().backward()
    assert all(p.grad is not None for p in result.parameters())


class _MixedPrecision(nn.Module):
    """A bfloat16 body under a float32 norm and head (the model casts between them)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 32).to(torch.bfloat16)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.norm(F.relu(self.body(x.to(torch.bfloat16))).float()))


@pytest.mark.parametrize("capture", ["fx", "eager"])
def test_mixed_precision_model_gets_float32_constants(capture):
    # the constants took the first parameter's dtype: bfloat16 here, so the float32 head's
    # output scale was rounded to 8 bits (output std 0.9987 after calibration, and a
    # RuntimeWarning asking to report the model)
    import warnings
    torch.manual_seed(0)
    model = _MixedPrecision()
    x = torch.randn(32, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        result, report = precondfx.precondition(model, x, capture=capture)
    consts = {n: b.dtype for n, b in result.named_buffers() if "precondfx" in n}
    assert consts and set(consts.values()) == {torch.float32}
    assert result.body.weight.dtype == torch.bfloat16 and result.head.weight.dtype == torch.float32
    y = result(x)
    assert y.dtype == torch.float32
    assert float(y.std(correction=0)) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("pool_conv", ["full", "avg"])
def test_channels_last_model_gets_channels_last_replacement_convs(pool_conv):
    # model.to(memory_format=torch.channels_last): the re-drawn convolutions kept the format,
    # but the strided convolutions replacing max-pools were made contiguous (NCHW), so every
    # step converted layouts around them
    torch.manual_seed(0)
    model = _PooledBackbone().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 16, 16).to(memory_format=torch.channels_last)
    result, report = precondfx.precondition(model, x, maxpool="conv", pool_conv=pool_conv)
    assert {pc.action for pc in report.plan.pools} == {"conv"}
    convs = {n: p for n, p in result.named_parameters() if p.dim() == 4}
    assert len(convs) == 4
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in convs.values())
    assert result(x).is_contiguous()                       # (N, 10) logits
