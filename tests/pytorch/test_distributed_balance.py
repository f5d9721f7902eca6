"""Measured balancing on a model sharded with FSDP2 over 2 gloo processes on the CPU: each rank
measures on its own half of the batch, the per-sample statistics are summed over the ranks,
and every rank sets the same alphas as one process balancing on the whole batch.

Rank r holds ``x[r::2]`` (what a ``DistributedSampler`` deals out); the single-process reference
runs on ``x``.  Each rank's balancing half (its first 8 samples) is then global samples 0..15,
the single process's balancing half, in the same order, with the same random cotangents.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Any

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
#: name -> (balance, balance_samples, force the per-sample loop engine, init); fan-in init
#: leaves the MLP's Hessian blocks 42x apart (geometric: 1.16x, which 'auto' leaves alone)
CASES = {
    "hessian": ("hessian", 16, False, "fan_in"),      # one batched round over the 16 samples
    "hessian_rounds": ("hessian", 40, False, "fan_in"),  # rounds of 16, 16, 8, stop checks
    "auto": ("auto", 16, False, "fan_in"),
    "auto_left": ("auto", 16, False, "geometric"),   # below the threshold: not applied
    "loop": ("hessian", 16, True, "fan_in"),         # per-sample loop: stop check every sample
}


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    return zoo.build("mlp", n_out=5, batch=32)


def _shard(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            fully_shard(mod, mesh=mesh)
    fully_shard(model, mesh=mesh)


@functools.lru_cache(maxsize=None)
def _no_batched() -> Any:
    """A stand-in for the batched engine that always declines (the per-sample loop runs)."""
    from precondfx.pytorch.measure.persample import Unsupported

    def refuse(*a: Any, **k: Any) -> Any:
        raise Unsupported("forced per-sample loop (test)")
    return refuse


def _run(model: nn.Module, x: torch.Tensor, case: str) -> dict:
    from precondfx.pytorch.measure import sketch
    balance, n, loop, init = CASES[case]
    saved = sketch.batched_sketch
    if loop:
        sketch.batched_sketch = _no_batched()
    try:
        with warnings.catch_warnings():   # the output std is checked on every rank's batch
            warnings.simplefilter("error", RuntimeWarning)
            _, rep = precondfx.precondition(model, x, balance=balance,
                                            balance_samples=n, init=init, seed=SEED,
                                            target_std=TARGET, inplace=True, capture="eager")
    finally:
        sketch.batched_sketch = saved
    h = rep.conditioning["hessian"]
    return {k: h.get(k) for k in ("applied", "factors", "before", "samples", "engine",
                                  "spread_before", "decision", "stopped_early", "ranks")}


def _state(model: nn.Module) -> dict:
    """Full parameters (gathered from the shards) and buffers."""
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}
    return {"full": full, "buffers": {n: b.detach().clone() for n, b in model.named_buffers()}}


def _recipe(rank: int, mesh: Any) -> dict:
    """The large-model recipe: plan on the meta device, shard, ``to_empty``, ``reinit``,
    ``distributed.calibrate`` and ``distributed.balance`` on this rank's half of the batch."""
    from torch.distributed.fsdp import fully_shard
    _, x = _mlp()
    with torch.device("meta"):
        m, _ = _mlp()
    pm, rep = precondfx.precondition(m, x, balance="hessian", init="fan_in", seed=SEED,
                                     target_std=TARGET)   # alpha sites; measured below
    assert rep.conditioning["hessian"]["decision"].startswith("deferred")
    for unit in precondfx.distributed.shard_units(pm, rep.plan):
        fully_shard(unit, mesh=mesh)
    fully_shard(pm, mesh=mesh)
    pm.to_empty(device="cpu")
    precondfx.reinit(pm, rep.plan, SEED)
    precondfx.distributed.calibrate(pm, x[rank::WORLD], target_std=TARGET)
    h = precondfx.distributed.balance(pm, x[rank::WORLD], "hessian", seed=SEED)
    precondfx.distributed.restore_constants(pm)   # what a later reinit writes back: balanced
    return {**{k: h.get(k) for k in ("applied", "factors", "samples", "ranks")}, **_state(pm)}


def _worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.tensor import DTensor
    with gloo_rank(rank, port, WORLD) as mesh:
        res = {}
        for case in CASES:
            model, x = _mlp()
            _shard(model, mesh)
            r = _run(model, x[rank::WORLD], case)
            r["sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
            res[case] = {**r, **_state(model)}
        res["recipe"] = _recipe(rank, mesh)
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("fsdp_balance"))
    return run_ranks(_worker, WORLD, out)


@functools.lru_cache(maxsize=None)
def _single(case: str) -> dict:
    torch.set_num_threads(1)
    model, x = _mlp()
    return {**_run(model, x, case), **_state(model)}


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_balancing_equals_single_process_on_the_union(ranks: list[dict],
                                                              case: str) -> None:
    ref = _single(case)
    got = [r[case] for r in ranks]
    assert all(g["sharded"] for g in got)               # still an FSDP2 model afterwards
    assert got[0]["ranks"] == WORLD and ref["ranks"] is None
    # the same samples, engine and stop decision as one process
    assert got[0]["samples"] == got[1]["samples"] == ref["samples"]
    assert got[0]["engine"] == got[1]["engine"] == ref["engine"]
    assert got[0]["applied"] == got[1]["applied"] == ref["applied"]
    if case == "loop":
        assert ref["engine"].startswith("per-sample loop")
    assert got[0]["before"] == got[1]["before"]          # bit-identical on every rank
    stat = max(abs(got[0]["before"][w] / v - 1) for w, v in ref["before"].items())
    line = f"\n{case}: {ref['samples']} samples ({ref['engine']}), statistics vs single " \
           f"process: max rel diff {stat:.2g}"
    assert stat < 1e-5
    if not ref["applied"]:
        print(line + f"; not applied: {ref['decision']}")
        assert got[0]["decision"] == got[1]["decision"]
        return
    assert got[0]["factors"] == got[1]["factors"]        # the same alphas on every rank
    assert set(got[0]["factors"]) == set(ref["factors"]) and len(ref["factors"]) >= 3
    diff = max(abs(got[0]["factors"][w] / f - 1) for w, f in ref["factors"].items())
    spread = max(ref["factors"].values()) / min(ref["factors"].values())
    print(line + f"; factors (spread {spread:.3g}x) max rel diff {diff:.2g}")
    assert spread > 1.01                                # the balancing did something
    assert diff < 1e-5
    # what the ranks hold: the same alpha buffers and full weights (bitwise), and those of the
    # single process (to float32 rounding: the output scale is calibrated on an all-reduced
    # std, 1e-7 off the single process's, as in test_distributed)
    for n in got[0]["buffers"]:
        assert torch.equal(got[0]["buffers"][n], got[1]["buffers"][n]), n
    for n in got[0]["full"]:
        assert torch.equal(got[0]["full"][n], got[1]["full"][n]), n
    assert set(got[0]["buffers"]) == set(ref["buffers"])   # the alphas and the output scale
    for n, b in ref["buffers"].items():
        torch.testing.assert_close(got[0]["buffers"][n], b, rtol=1e-5, atol=0)
    for n, p in ref["full"].items():
        torch.testing.assert_close(got[0]["full"][n], p, rtol=1e-5, atol=1e-7)


def test_distributed_balance_recipe_equals_precondition_on_the_union(ranks: list[dict]) -> None:
    """Planned on the meta device, sharded, materialized, calibrated and balanced on 2 ranks:
    the factors, weights and constants of ``precondition(model, x, balance='hessian')``."""
    torch.set_num_threads(1)
    model, x = _mlp()
    ref_model, rep = precondfx.precondition(model, x, balance="hessian", init="fan_in",
                                            seed=SEED, target_std=TARGET)
    ref = {**rep.conditioning["hessian"], **_state(ref_model)}
    got = [r["recipe"] for r in ranks]
    assert got[0]["applied"] and got[0]["ranks"] == WORLD
    assert got[0]["samples"] == got[1]["samples"] == ref["samples"]
    assert got[0]["factors"] == got[1]["factors"]
    diff = max(abs(got[0]["factors"][w] / f - 1) for w, f in ref["factors"].items())
    print(f"\nrecipe: factors max rel diff {diff:.2g} vs precondition on the whole batch")
    assert set(got[0]["factors"]) == set(ref["factors"]) and diff < 1e-5
    for n, p in ref["full"].items():
        assert torch.equal(got[0]["full"][n], got[1]["full"][n]), n
        torch.testing.assert_close(got[0]["full"][n], p, rtol=1e-5, atol=1e-7)
    assert set(got[0]["buffers"]) == set(ref["buffers"])
    for n, b in ref["buffers"].items():
        assert torch.equal(got[0]["buffers"][n], got[1]["buffers"][n]), n
        torch.testing.assert_close(got[0]["buffers"][n], b, rtol=1e-5, atol=0)
