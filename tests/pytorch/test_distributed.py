"""Sharded re-initialization and distributed calibration on PyTorch's own engine: FSDP2
``fully_shard`` over 2 gloo processes on the CPU, compared with the single-process result.

The workers plan on the meta device, shard, ``to_empty``, re-initialize and calibrate, then
save the full tensors (``DTensor.full_tensor()``) and their statistics; the test process
computes the single-process references itself and compares.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import precondfx
from tests import zoo
from tests.helpers import gloo_rank, run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

WORLD = 2
SEED = 7
TARGET = 0.05


@functools.lru_cache(maxsize=1)
def _models() -> dict[str, tuple[nn.Module, torch.Tensor, nn.Module]]:
    """name -> (meta model, global calibration batch, real model): a residual conv net and an
    MLP whose 5-way head splits 3/2 over the ranks."""
    out = {}
    for name, kw in (("resnet_bottleneck", {"batch": 8}), ("mlp", {"n_out": 5, "batch": 32})):
        real, x = zoo.build(name, **kw)
        with torch.device("meta"):
            m, _ = zoo.build(name, **kw)
        out[name] = (m, x, real)
    return out


def _fresh_mlp() -> tuple[nn.Module, torch.Tensor]:
    return zoo.build("mlp", n_out=5, batch=32)


def _plan(m: nn.Module, x: torch.Tensor) -> tuple[nn.Module, precondfx.Plan]:
    pm, rep = precondfx.precondition(m, x, balance="analytic", seed=SEED)
    return pm, rep.plan


def _shard(pm: nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    for name, mod in pm.named_modules():
        if isinstance(mod, (nn.Conv2d, nn.Linear)):
            # the first linear layer is sharded along its input dimension (Shard(1)), the
            # others along the output dimension (FSDP2's default Shard(0))
            fn = (lambda p: Shard(1) if p.ndim == 2 else Shard(0)) if name == "net.0" else None
            fully_shard(mod, mesh=mesh, shard_placement_fn=fn)
    fully_shard(pm, mesh=mesh)


def _worker(rank: int, port: int, out: str) -> None:
    with gloo_rank(rank, port, WORLD) as mesh:
        res = {}
        for name, (m, x, _) in _models().items():
            pm, plan = _plan(m, x)
            _shard(pm, mesh)
            pm.to_empty(device="cpu")
            r = {"placements": {n: str(p.placements) for n, p in pm.named_parameters()}}
            precondfx.reinit(pm, plan, SEED)                 # the single-process stream
            r["stream"] = {n: p.full_tensor() for n, p in pm.named_parameters()}
            r["calib"] = precondfx.pytorch.distributed.calibrate(pm, x[rank::WORLD], target_std=TARGET)
            precondfx.pytorch.distributed.reinit(pm, plan, SEED, rng="counter")
            r["counter"] = {n: p.full_tensor() for n, p in pm.named_parameters()}
            res[name] = r
        # the pass itself on a model sharded before preconditioning (inplace: FSDP2 modules
        # cannot be deep-copied), each rank calibrating on its own half of the batch
        dflt, x = _fresh_mlp()
        _shard(dflt, mesh)
        try:       # the defaults (balance='auto'): measured balancing is distributed now
            _, rep = precondfx.precondition(dflt, x[rank::WORLD], inplace=True)
            res["refusal"] = rep.conditioning["hessian"].get("ranks")
        except precondfx.PrecondError as e:
            res["refusal"] = str(e)
        real, x = _fresh_mlp()
        _shard(real, mesh)
        _, rep = precondfx.precondition(real, x[rank::WORLD], balance="analytic", seed=SEED,
                                        inplace=True, target_std=TARGET)
        res["pass"] = {"scale": rep.output_scale, "std_after": rep.output_std_after,
                       "full": {n: p.full_tensor() for n, p in real.named_parameters()}}
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("fsdp"))
    return run_ranks(_worker, WORLD, out)


def _single(name: str, rng: str | None) -> tuple[nn.Module, dict]:
    m, x, _ = _models()[name]
    pm, plan = _plan(m, x)
    pm.to_empty(device="cpu")
    if rng is None:
        precondfx.reinit(pm, plan, SEED)
    else:
        precondfx.pytorch.distributed.reinit(pm, plan, SEED, rng=rng)
    stats = precondfx.pytorch.distributed.calibrate(pm, x, target_std=TARGET)
    return pm, stats


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet_bottleneck", "mlp"])
def test_sharded_reinit_equals_single_process(sharded: list[dict], name: str) -> None:
    ref, _ = _single(name, None)
    full = dict(ref.named_parameters())
    r0 = sharded[0][name]
    assert any("Shard(dim=0)" in p for p in r0["placements"].values())
    if name == "mlp":
        assert "Shard(dim=1)" in r0["placements"]["net.0.weight"]
    diff = max(float((r0["stream"][n] - full[n]).detach().abs().max()) for n in full)
    print(f"\n{name}: stream, max |sharded - single process| = {diff:.3g} "
          f"over {sum(p.numel() for p in full.values())} elements")
    assert diff == 0.0
    # the same as preconditioning the real model in one process (same seed, same plan)
    _, _, real = _models()[name]
    direct, _ = precondfx.precondition(real, _models()[name][1], balance="analytic", seed=SEED)
    assert all(torch.equal(p, full[n]) for n, p in direct.named_parameters())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet_bottleneck", "mlp"])
def test_counter_rng_shards_equal_single_process(sharded: list[dict], name: str) -> None:
    ref, _ = _single(name, "counter")
    plan = _plan(*_models()[name][:2])[1]
    diff = 0.0
    for n, p in ref.named_parameters():
        diff = max(diff, float((sharded[0][name]["counter"][n] - p).detach().abs().max()))
        pi = plan.inits.get(n)
        if pi is not None and pi.rule == "geometric":   # moment matched over the full tensor
            m2 = float(sharded[0][name]["counter"][n].double().pow(2).mean())
            assert m2 == pytest.approx(pi.std ** 2, rel=1e-6), n
    print(f"\n{name}: counter, max |sharded - single process| = {diff:.3g}")
    assert diff <= 1e-7 * max(float(p.abs().max()) for p in ref.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet_bottleneck", "mlp"])
def test_distributed_calibration_same_constant_on_every_rank(sharded: list[dict],
                                                             name: str) -> None:
    _, single = _single(name, None)       # the whole batch in one process
    stats = [sharded[r][name]["calib"] for r in range(WORLD)]
    print(f"\n{name}: " + "; ".join(
        f"rank {r}: scale {s['scale']:.7g}, std(all ranks' batches) {s['std_after']:.6f}, "
        f"std(own batch) {s['local_std_after']:.4f}" for r, s in enumerate(stats)))
    assert stats[0]["scale"] == stats[1]["scale"]          # bit-identical on every rank
    assert stats[0]["scale"] == pytest.approx(single["scale"], rel=1e-5)
    for s in stats:
        assert abs(s["std_after"] / TARGET - 1) < 0.02
        assert abs(s["std_after"] / TARGET - 1) < 1e-5


def test_counter_normal_slices_and_statistics() -> None:
    from precondfx.pytorch.distributed import counter_normal
    full = counter_normal(3, "w", 0, 10_007)
    for a, b in ((0, 1), (1, 2), (5, 4099), (6, 9), (4096, 10_007), (10_003, 10_007)):
        assert torch.equal(counter_normal(3, "w", a, b - a), full[a:b])
    assert not (counter_normal(3, "v", 0, 100) == full[:100]).any()
    assert not (counter_normal(4, "w", 0, 100) == full[:100]).any()
    n = 200_000
    big = counter_normal(0, "x", 0, n).double()
    assert abs(float(big.mean())) < 4 / n ** 0.5
    assert abs(float(big.var()) - 1) < 4 * (2 / n) ** 0.5
    assert abs(float(((big - big.mean()) ** 4).mean() / big.var() ** 2) - 3) < 0.1  # kurtosis
    assert abs(float((big[0::2] * big[1::2]).mean())) < 4 / (n / 2) ** 0.5  # pairs uncorrelated


def test_reinit_counter_on_plain_module_matches_moments() -> None:
    model, x = zoo.build("mlp")
    pm, rep = precondfx.precondition(model, x, balance="analytic", target_std=None)
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    precondfx.pytorch.distributed.reinit(pm, rep.plan, 1, rng="counter")
    for n, p in pm.named_parameters():
        pi = rep.plan.inits[n]
        if pi.rule == "geometric":
            assert float(p.double().pow(2).mean()) == pytest.approx(pi.std ** 2, rel=1e-6)
            assert not torch.equal(p, before[n])
        elif pi.rule == "zeros":
            assert float(p.abs().max()) == 0.0


@pytest.mark.slow
def test_fsdp_torchrun_example_trains(tmp_path, monkeypatch) -> None:
    """examples/fsdp_torchrun.py's training function, launched on 2 gloo processes."""
    import importlib
    import pathlib
    import sys

    from precondfx.core.options import Options
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
    sys.modules.pop("fsdp_torchrun", None)
    ex = importlib.import_module("fsdp_torchrun")
    ex.launch(world=WORLD, steps=10, out=str(tmp_path))
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert res[0]["calib"]["scale"] == res[1]["calib"]["scale"]
    assert res[0]["balance"] and res[0]["balance"] == res[1]["balance"]   # the same alphas
    target = Options().target_std                            # the example uses the default
    assert all(abs(r["calib"]["std_after"] / target - 1) < 0.02 for r in res)
    assert res[0]["losses"] == res[1]["losses"]              # all-reduced, the same on each
    assert res[0]["losses"][-1] < res[0]["losses"][0]


@pytest.mark.slow
def test_precondition_on_a_sharded_model(sharded: list[dict]) -> None:
    """precondition(inplace=True) on an FSDP2 model: the same weights and output scale as the
    single-process pass on the whole batch; measured balancing (the default 'auto') runs over
    both ranks (tests/pytorch/test_distributed_balance.py compares its factors)."""
    assert all(r["refusal"] == WORLD for r in sharded)
    real, x = _fresh_mlp()
    ref, rep = precondfx.precondition(real, x, balance="analytic", seed=SEED, capture="eager",
                                      target_std=TARGET)
    got = [r["pass"] for r in sharded]
    assert got[0]["scale"] == got[1]["scale"]
    assert got[0]["scale"] == pytest.approx(rep.output_scale, rel=1e-5)
    assert all(abs(g["std_after"] / TARGET - 1) < 1e-5 for g in got)
    for n, p in ref.named_parameters():
        assert torch.equal(got[0]["full"][n], p.detach()), n
