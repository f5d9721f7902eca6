"""Issue 24: per-join residual scale schedules and App. E's per-block beta multipliers.

A normalization-free bottleneck ResNet (App. E's block: 1x1 conv, ReLU, 3x3 conv, ReLU, 1x1
conv, ``relu(s F(x) + x)``) preconditioned with a hand-written schedule ``s_l``."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import precondfx
from precondfx.errors import PrecondError
from precondfx.core.options import Options, from_text
from precondfx.core.plan import Plan

SCHEDULE = [0.9, 0.5, 0.3, 0.6, 0.2, 0.1]      # non-monotonic on purpose
CONVS = ("c0", "c1", "c2")


class Block(nn.Module):
    def __init__(self, c: int, mid: int, act: nn.Module | None = None) -> None:
        super().__init__()
        self.c0 = nn.Conv2d(c, mid, 1)
        self.c1 = nn.Conv2d(mid, mid, 3, padding=1)
        self.c2 = nn.Conv2d(mid, c, 1)
        self.act = act if act is not None else nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.c2(self.act(self.c1(torch.relu(self.c0(x))))))


class NFResNet(nn.Module):
    """Stem, ``n`` App. E blocks (block ``gelu_at`` with a GELU in its branch), pool, linear."""

    def __init__(self, n: int = 6, c: int = 16, gelu_at: int | None = None) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*[Block(c, c // 2, nn.GELU() if i == gelu_at else None)
                                      for i in range(n)])
        self.fc = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(torch.relu(self.stem(x))).mean((2, 3)))


def _x(n: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def _app_e_betas(s: list[float]) -> list[float]:
    """App. E, written out here: beta_l^2 = beta_{l-1}^2 (1+s_l^2)/(1+s_{l-1}^2), beta_0 = 1."""
    b2 = [1.0]
    for prev, cur in zip(s, s[1:]):
        b2.append(b2[-1] * (1 + cur ** 2) / (1 + prev ** 2))
    return [math.sqrt(v) for v in b2]


def test_betas_follow_the_recurrence_and_scale_the_init() -> None:
    torch.manual_seed(0)
    model = NFResNet()
    kw = dict(balance="none", target_std=None)
    rep = precondfx.analyze(model, _x(), residual_scale=SCHEDULE, **kw)
    flat = precondfx.analyze(model, _x(), residual_scale=0.5, **kw)
    want = _app_e_betas(SCHEDULE)
    got = [r.beta for r in rep.plan.residuals]
    assert [r.s for r in rep.plan.residuals] == SCHEDULE
    assert got == pytest.approx(want, rel=1e-12)
    assert [r.beta for r in flat.plan.residuals] == [1.0] * len(SCHEDULE)
    assert not [sc for sc in flat.plan.scales if sc.tag == "beta"]
    # 1/beta_l at the input of each branch convolution where beta_l != 1
    module_of = {lay.node: lay.module for lay in rep.plan.layers}
    beta_scales = {module_of[sc.node]: sc.value for sc in rep.plan.scales if sc.tag == "beta"}
    expect = {f"blocks.{i}.{c}": 1 / b for i, b in enumerate(want) for c in CONVS if b != 1}
    assert beta_scales.keys() == expect.keys()
    for k, v in expect.items():
        assert beta_scales[k] == pytest.approx(v, rel=1e-12)
        assert all(sc.where == "input" for sc in rep.plan.scales if sc.tag == "beta")
    # the init std is the flat (geometric) one times beta_l; layers outside branches unchanged
    for i, b in enumerate(want):
        for c in CONVS:
            w = f"blocks.{i}.{c}.weight"
            assert rep.plan.inits[w].std / flat.plan.inits[w].std == pytest.approx(b, rel=1e-12)
    for w in ("stem.weight", "fc.weight"):
        assert rep.plan.inits[w].std == flat.plan.inits[w].std
    # the plan round-trips through JSON with its betas
    again = Plan.from_dict(json.loads(rep.plan.to_json()))
    assert [r.beta for r in again.residuals] == got
    assert [lay.beta for lay in again.layers] == [lay.beta for lay in rep.plan.layers]


def _branch_gains(model: nn.Module, x: torch.Tensor) -> list[float]:
    """Per block: E[branch output^2] (before s) / E[block input^2]."""
    got: dict[int, list[float]] = {}
    hooks = []
    for i, blk in enumerate(model.blocks):
        hooks.append(blk.register_forward_pre_hook(
            lambda m, a, i=i: got.setdefault(i, []).insert(0, float(a[0].pow(2).mean()))))
        hooks.append(blk.c2.register_forward_hook(      # prepend: before the s hook
            lambda m, a, o, i=i: got.setdefault(i, []).append(float(o.pow(2).mean())),
            prepend=True))
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return [got[i][1] / got[i][0] for i in range(len(model.blocks))]


def test_forward_variance_at_init_equals_the_flat_geometric_models() -> None:
    """Each block's branch gain (branch output^2 before s over block input^2) with the schedule
    and its betas equals the flat-s geometric model's: the 1/beta constants are compensated by
    the init.  R independent inits each; the tolerance is 4 standard errors of the difference
    of the two means, sqrt(var_a/R + var_b/R) from the R samples (about 6e-5 chance per block
    of a false failure); forgetting the init's beta would change block l's gain by beta_l^-6
    (up to 5.8x here).  The pass is given the first 4 rows of the batch the gains are measured
    on: with balance="none" and no target_std the drawn weights do not depend on the sample
    (bitwise the same state_dict as with all 32 rows: checked below on seed 0 of each, and
    by hand on seed 3), and the pass costs 40% less."""
    R, x = 32, _x(32, seed=1)
    kw = dict(balance="none", target_std=None, capture="eager")
    gains = {}
    for name, rs in (("schedule", SCHEDULE), ("flat", 0.5)):
        rows = []
        for seed in range(R):
            torch.manual_seed(100 + seed)
            out, rep = precondfx.precondition(NFResNet(), x[:4], residual_scale=rs, seed=seed,
                                              **kw)
            if seed == 0:       # the premise: the whole batch gives the same weights
                torch.manual_seed(100 + seed)
                full, _ = precondfx.precondition(NFResNet(), x, residual_scale=rs, seed=seed,
                                                 **kw)
                assert all(torch.equal(v, full.state_dict()[k])
                           for k, v in out.state_dict().items())
            rows.append(_branch_gains(out, x))
        gains[name] = np.array(rows)
    assert rep.capture == "eager"
    a, b = gains["schedule"], gains["flat"]
    se = np.sqrt(a.var(0, ddof=1) / R + b.var(0, ddof=1) / R)
    diff = np.abs(a.mean(0) - b.mean(0))
    assert np.all(diff <= 4 * se), (a.mean(0), b.mean(0), se)
    betas = np.array(_app_e_betas(SCHEDULE))
    uncompensated = b.mean(0) * betas ** -6       # what the gain would be without the init
    assert np.all(np.abs(uncompensated - b.mean(0))[1:] > 4 * se[1:] + 0.5)


@pytest.mark.parametrize("capture", ["fx", "eager"])
def test_fold_folds_beta(capture: str) -> None:
    torch.manual_seed(1)
    model, x = NFResNet(), _x()
    out, rep = precondfx.precondition(model, x, residual_scale=SCHEDULE, capture=capture, seed=2)
    assert rep.capture == capture
    bufs = [n for n, _ in out.named_buffers() if "beta" in n]
    assert len(bufs) == 3 * sum(1 for b in _app_e_betas(SCHEDULE) if b != 1)
    assert precondfx.fold_problems(out) == []
    plain = precondfx.fold(out)
    assert not [n for n, _ in plain.named_buffers() if "precondfx" in n]
    with torch.no_grad():
        y, z = out(x), plain(x)
    assert torch.allclose(z, y, rtol=1e-5, atol=1e-5 * float(y.abs().max()))
    assert "1/beta" in rep.constants_line()


def test_reinit_false_keeps_the_function() -> None:
    """reinit_weights=False: each branch weight is stored times beta_l (divided by its constant
    alpha/beta), so the model computes the user's model with only s_l added (checked against
    the user's model with each branch output multiplied by s_l by hand)."""
    torch.manual_seed(2)
    model, x = NFResNet(), _x()
    out, rep = precondfx.precondition(model, x, residual_scale=SCHEDULE, reinit_weights=False,
                                      balance="none", target_std=None)
    betas = _app_e_betas(SCHEDULE)
    named = dict(model.named_parameters())
    stored = dict(out.named_parameters())
    for i, b in enumerate(betas):
        w = f"blocks.{i}.c1.weight"
        assert rep.plan.inits[w].rule == ("scale" if b != 1 else "keep")
        assert torch.allclose(stored[w], named[w] * b, rtol=1e-6)
    hooks = [blk.c2.register_forward_hook(lambda m, a, o, s=s: o * s)
             for blk, s in zip(model.blocks, SCHEDULE)]
    with torch.no_grad():
        ref = model(x)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        assert torch.allclose(out(x), ref, rtol=1e-5, atol=1e-6)


def test_same_betas_from_pytorch_and_onnx(tmp_path) -> None:
    from precondfx.onnx import inspect_onnx, precondition_onnx
    import onnx
    torch.manual_seed(3)
    model, x = NFResNet().eval(), _x()
    path = str(tmp_path / "nf.onnx")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), path, dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "batch"}})
    kw = dict(residual_scale=SCHEDULE, balance="analytic")
    pt = precondfx.analyze(model, x, **kw).plan
    ox = inspect_onnx(path, **kw).plan
    assert [r.beta for r in ox.residuals] == pytest.approx([r.beta for r in pt.residuals],
                                                          rel=1e-12)
    assert [sc.value for sc in ox.scales if sc.tag == "beta"] == \
        pytest.approx([sc.value for sc in pt.scales if sc.tag == "beta"], rel=1e-12)
    out = str(tmp_path / "out.onnx")
    rep = precondition_onnx(path, out, feeds={"x": x.numpy()}, **kw)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(out).graph.initializer}
    betas = sorted(float(v) for k, v in inits.items() if "beta" in k)
    assert betas == pytest.approx(sorted(sc.value for sc in pt.scales if sc.tag == "beta"),
                                  rel=1e-6)
    assert "1/beta" in rep.constants_line()


def test_wrong_length_schedule_is_refused() -> None:
    model, x = NFResNet(), _x()
    with pytest.raises(PrecondError, match=r"has 4 values, but the model has 6 residual joins"):
        precondfx.precondition(model, x, residual_scale=[0.5] * 4)
    with pytest.raises(PrecondError, match="one value per residual join"):
        Options(residual_scale=[0.5, 1.5])
    with pytest.raises(PrecondError, match="a string"):
        Options(residual_scale="0.5")
    assert from_text("residual_scale", "0.5,0.25") == (0.5, 0.25)
    assert from_text("residual_scale", "nf:0.3") == "nf:0.3"


def test_nf_schedule_is_brock_et_al() -> None:
    """'nf:<a>': s_l = a/sqrt(1+(l-1)a^2), so prod(1+s_l^2) = 1 + N a^2 (NF-ResNet growth)."""
    model, x = NFResNet(), _x()
    for spec, a in (("nf", 0.2), ("nf:0.7", 0.7)):
        rep = precondfx.analyze(model, x, residual_scale=spec, balance="none")
        s = [r.s for r in rep.plan.residuals]
        assert s == pytest.approx([a / math.sqrt(1 + l * a * a) for l in range(6)], rel=1e-12)
        assert math.prod(1 + v * v for v in s) == pytest.approx(1 + 6 * a * a, rel=1e-12)
        assert [r.beta for r in rep.plan.residuals] == pytest.approx(_app_e_betas(s),
                                                                     rel=1e-12)


def test_a_branch_that_is_not_app_e_block_keeps_beta_1_and_says_why() -> None:
    torch.manual_seed(4)
    model, x = NFResNet(gelu_at=2), _x()
    rep = precondfx.analyze(model, x, residual_scale=SCHEDULE, balance="none")
    res = rep.plan.residuals
    assert res[2].beta == 1.0 and "not App. E's block" in res[2].beta_reason
    assert "(smooth_gate) is neither a convolution" in res[2].beta_reason   # the GELU
    module_of = {lay.node: lay.module for lay in rep.plan.layers}
    assert not [sc for sc in rep.plan.scales
                if sc.tag == "beta" and module_of[sc.node].startswith("blocks.2.")]
    # the recurrence runs over the matching blocks
    keep = [0, 1, 3, 4, 5]
    want = _app_e_betas([SCHEDULE[i] for i in keep])
    assert [res[i].beta for i in keep] == pytest.approx(want, rel=1e-12)
    assert "not App. E's block" in rep.table(width=400, all_nodes=True)


def test_meta_plan_carries_beta() -> None:
    """Plan on the meta device, to_empty, reinit: the beta buffers come back (recorded
    constants) and the model computes what preconditioning the real model gives."""
    kw = dict(residual_scale=SCHEDULE, balance="analytic", seed=3, target_std=None)
    torch.manual_seed(5)
    real, x = NFResNet(), _x()
    ref, rref = precondfx.precondition(real, x, **kw)
    with torch.device("meta"):
        mm = NFResNet()
    pm, rep = precondfx.precondition(mm, x, **kw)
    assert [r.beta for r in rep.plan.residuals] == [r.beta for r in rref.plan.residuals]
    pm = pm.to_empty(device="cpu")
    precondfx.reinit(pm, rep.plan, seed=3)
    betas = {n: float(b) for n, b in pm.named_buffers() if "beta" in n}
    assert betas and betas == {n: float(b) for n, b in ref.named_buffers() if "beta" in n}
    with torch.no_grad():
        assert torch.allclose(pm(x), ref(x), rtol=1e-5, atol=1e-6)


def nf_resnet() -> tuple[nn.Module, torch.Tensor]:
    """The test model and a sample, for the command line (``tests.pytorch.test_beta:nf_resnet``)."""
    torch.manual_seed(6)
    return NFResNet(), _x()


def test_cli_takes_a_schedule(tmp_path, capsys) -> None:
    from precondfx.cli import main
    rep = tmp_path / "r.json"
    text = ",".join(str(v) for v in SCHEDULE)
    assert main(["precondition", "tests.pytorch.test_beta:nf_resnet", "-o",
                 str(tmp_path / "m.pt"), "--quiet", "--residual-scale", text,
                 "--report", str(rep)]) == 0
    d = json.loads(rep.read_text())
    assert [r["beta"] for r in d["plan"]["residuals"]] == pytest.approx(
        _app_e_betas(SCHEDULE), rel=1e-12)
    assert d["plan"]["options"]["residual_scale"] == SCHEDULE
    capsys.readouterr()
    assert main(["precondition", "tests.pytorch.test_beta:nf_resnet", "-o",
                 str(tmp_path / "m.pt"), "--residual-scale", "0.5,0.5"]) == 2
    assert "the model has 6 residual joins" in capsys.readouterr().err


def test_sharded_draw_carries_beta() -> None:
    """The per-shard ('counter') draw of precondfx.pytorch.distributed.reinit, as FSDP2 ranks
    run it after to_empty: each branch weight is exactly beta_l times the flat-s draw (same
    seed, same counters), and the 1/beta constants are written back."""
    from precondfx.pytorch.distributed import reinit
    kw = dict(balance="none", seed=3, target_std=None)
    x = _x()
    drawn = {}
    for name, rs in (("schedule", SCHEDULE), ("flat", 0.5)):
        with torch.device("meta"):
            mm = NFResNet()
        pm, rep = precondfx.precondition(mm, x, residual_scale=rs, **kw)
        pm = pm.to_empty(device="cpu")
        reinit(pm, rep.plan, 3, rng="counter")
        drawn[name] = (dict(pm.named_parameters()), dict(pm.named_buffers()))
    betas = _app_e_betas(SCHEDULE)
    params, bufs = drawn["schedule"]
    for i, b in enumerate(betas):
        for c in CONVS:
            w = f"blocks.{i}.{c}.weight"
            assert torch.allclose(params[w], b * drawn["flat"][0][w], rtol=1e-6, atol=0)
    got = sorted(float(v) for k, v in bufs.items() if "beta" in k)
    assert got == pytest.approx(sorted(1 / b for b in betas for _ in CONVS if b != 1), rel=1e-6)
