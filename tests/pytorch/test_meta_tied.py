"""Tied weights through the meta-device flow: the plan records them (``plan.aliases``),
``model.to_empty`` unties them, ``precondfx.reinit`` ties them again, and calibration refuses an
untied, uninitialized copy instead of reporting NaN."""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

import precondfx
from tests import zoo
from tests.helpers import free_port, gloo_rank, start_ranks

pytestmark = pytest.mark.skipif(not zoo.HAS_TRANSFORMERS, reason="transformers not installed")

VOCAB = 61
KW = dict(balance="analytic", seed=7, use_cache=False, target_std=0.5)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB,
                                      n_positions=16, bos_token_id=0, eos_token_id=0))


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, vocab_size=VOCAB,
                                        max_position_embeddings=16, tie_word_embeddings=True,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0))


BUILD: dict[str, Callable[[], nn.Module]] = {"gpt2": _gpt2, "llama": _llama}
HEAD = "lm_head.weight"
EMB = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight"}


def _empty(how: str) -> Any:
    if how == "accelerate":
        accelerate = pytest.importorskip("accelerate")
        return accelerate.init_empty_weights()
    return torch.device("meta")


def _ids() -> dict:
    return {"input_ids": torch.randint(0, VOCAB, (3, 8),
                                       generator=torch.Generator().manual_seed(1))}


@contextlib.contextmanager
def _one_rank_group():
    """A one-process gloo group for FSDP2, destroyed on the way out."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _user_init(pm: nn.Module, real: nn.Module, plan: Any) -> None:
    """What the user's own init does after to_empty for what the plan keeps (position
    embeddings, rotary frequencies): taken here from a real model of the same config."""
    params, bufs = dict(pm.named_parameters()), dict(pm.named_buffers())
    with torch.no_grad():
        for n, t in real.named_parameters():
            if n in params and (plan.inits.get(n) is None or plan.inits[n].rule == "keep"):
                params[n].copy_(t)
        for n, t in real.named_buffers():
            if n in bufs and "precondfx_" not in n:
                bufs[n].copy_(t)


@pytest.mark.parametrize("how", ["meta", "accelerate"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_to_empty_then_reinit_reties_and_matches_the_real_run(name: str, how: str) -> None:
    torch.manual_seed(0)
    real = BUILD[name]()
    assert real.get_parameter(HEAD) is real.get_parameter(EMB[name])
    ref, rref = precondfx.precondition(real, _ids(), **KW)
    with _empty(how):
        mm = BUILD[name]()
    if how == "accelerate":     # accelerate registers each parameter anew: the tie is lost
        with pytest.raises(precondfx.PrecondError, match=r"lm_head\.weight.*tie_weights\(\)"):
            precondfx.precondition(mm, _ids(), **KW)
        mm.tie_weights()        # what the error says to do
    pm, rep = precondfx.precondition(mm, _ids(), **KW)
    assert rep.plan.aliases == {HEAD: EMB[name]} == rref.plan.aliases
    pm.to_empty(device="cpu")
    assert pm.get_parameter(HEAD) is not pm.get_parameter(EMB[name])   # what to_empty does
    _user_init(pm, real, rep.plan)
    precondfx.reinit(pm, rep.plan, seed=7)
    assert pm.get_parameter(HEAD) is pm.get_parameter(EMB[name])       # tied again
    stats = precondfx.pytorch.distributed.calibrate(pm, _ids(), target_std=0.5)
    assert stats["scale"] == pytest.approx(rref.output_scale, rel=1e-5)
    assert stats["std_after"] == pytest.approx(0.5, rel=1e-5)
    with torch.no_grad():     # eval: GPT-2's dropout is on in train mode
        a = ref.eval()(**_ids(), use_cache=False).logits
        b = pm.eval()(**_ids(), use_cache=False).logits
    assert torch.isfinite(b).all()
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), float((a - b).abs().max())
    # one training step moves the tied weight once, for both uses, as in the real model
    pm.train()
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ids = _ids()["input_ids"]
    pm(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    assert pm.get_parameter(HEAD) is pm.get_parameter(EMB[name])


def test_calibrate_refuses_untied_copy_instead_of_nan() -> None:
    with torch.device("meta"):
        mm = _gpt2()
    pm, rep = precondfx.precondition(mm, _ids(), **KW)
    pm.to_empty(device="cpu")
    with torch.no_grad():
        pm.get_parameter(HEAD).fill_(float("nan"))    # what uninitialized memory may hold
    with pytest.raises(precondfx.PrecondError, match="tied parameters.*lm_head.weight.*"
                                                     "precondfx.reinit"):
        precondfx.pytorch.distributed.calibrate(pm, _ids())


def test_calibrate_names_uninitialized_parameters() -> None:
    """Tied again but never re-initialized: a NaN output is an error naming the parameters and
    the call to make, never a NaN std."""
    with torch.device("meta"):
        mm = _gpt2()
    pm, rep = precondfx.precondition(mm, _ids(), **KW)
    pm.to_empty(device="cpu")
    with torch.no_grad():
        for p in pm.parameters():
            p.fill_(0.01)
        pm.transformer.h[1].mlp.c_fc.weight.fill_(float("nan"))
    pm.tie_weights()
    with pytest.raises(precondfx.PrecondError, match=r"h\.1\.mlp\.c_fc\.weight.*precondfx\.reinit"):
        precondfx.pytorch.distributed.calibrate(pm, _ids())


def test_reinit_refuses_alias_of_another_shape() -> None:
    with torch.device("meta"):
        mm = _gpt2()
    pm, rep = precondfx.precondition(mm, _ids(), **KW)
    pm.to_empty(device="cpu")
    pm.lm_head.weight = nn.Parameter(torch.zeros(VOCAB + 1, 32))
    with pytest.raises(precondfx.PrecondError, match="shape"):
        precondfx.reinit(pm, rep.plan, seed=7)


def test_sharded_untied_copies_get_the_same_values_and_a_warning() -> None:
    """A one-rank FSDP2 model whose tied weights were separated: reinit cannot swap FSDP's
    parameters, so both copies get the planned values (equal to the canonical draw) and a
    warning says they will train apart."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    with torch.device("meta"):
        mm = _gpt2()
    pm, rep = precondfx.precondition(mm, _ids(), **KW)
    pm.lm_head.weight = nn.Parameter(torch.empty_like(pm.lm_head.weight))   # untied
    with _one_rank_group():
        fully_shard(pm)
        pm.to_empty(device="cpu")
        with pytest.warns(RuntimeWarning, match="train apart"):
            precondfx.reinit(pm, rep.plan, seed=7)
        w = pm.get_parameter(EMB["gpt2"]).full_tensor()
        h = pm.get_parameter(HEAD).full_tensor()
    assert torch.equal(w, h)
    std = rep.plan.inits[EMB["gpt2"]].std
    assert float(w.detach().double().pow(2).mean().sqrt()) == pytest.approx(std, rel=1e-5)


def test_fsdp2_recipe_with_shard_units_keeps_the_tie_and_matches_the_real_run() -> None:
    """The README recipe on a one-rank FSDP2 mesh: shard_units puts wte and lm_head in one
    fully_shard unit (FSDP2 refuses a parameter managed by two), the tie survives to_empty,
    and the full tensors and the output scale equal preconditioning the real model."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    real = _gpt2()
    ref, rref = precondfx.precondition(real, _ids(), **KW)
    with torch.device("meta"):
        mm = _gpt2()
    pm, rep = precondfx.precondition(mm, _ids(), **KW)
    units = precondfx.pytorch.distributed.shard_units(pm, rep.plan)
    tied = [u for u in units if pm.lm_head in u]
    assert len(tied) == 1 and pm.transformer.wte in tied[0]
    assert sum(len(u) for u in units) == sum(
        1 for m in pm.modules() if m is not pm and any(True for _ in m.parameters(False)))
    with _one_rank_group():
        for u in units:
            fully_shard(u)
        fully_shard(pm)
        pm.to_empty(device="cpu")
        assert pm.get_parameter(HEAD) is pm.get_parameter(EMB["gpt2"])
        _user_init(pm, real, rep.plan)      # kept parameters (position embeddings)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)   # no untied-copies warning
            precondfx.reinit(pm, rep.plan, seed=7)
        stats = precondfx.pytorch.distributed.calibrate(pm, _ids(), target_std=0.5)
        full = {n: p.full_tensor().detach() for n, p in pm.named_parameters()}
    assert stats["scale"] == pytest.approx(rref.output_scale, rel=1e-6)
    for n, p in ref.named_parameters():
        assert torch.equal(full[n], p.detach()), n


def _tied_worker(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: GPT-2 planned on meta, sharded with shard_units (wte and
    lm_head in one unit, Shard(0) over 2 ranks), materialized, re-initialized with both
    random streams, calibrated on this rank's half of the batch."""
    import os

    from torch.distributed.fsdp import fully_shard
    with gloo_rank(rank, port, 2) as mesh:
        torch.manual_seed(0)
        real = _gpt2()
        with torch.device("meta"):
            mm = _gpt2()
        pm, rep = precondfx.precondition(mm, _ids(), **KW)
        for u in precondfx.pytorch.distributed.shard_units(pm, rep.plan):
            fully_shard(u, mesh=mesh)
        fully_shard(pm, mesh=mesh)
        pm.to_empty(device="cpu")
        res = {"tied": pm.get_parameter(HEAD) is pm.get_parameter(EMB["gpt2"])}
        with torch.no_grad():       # the user's init of what the plan keeps, shard by shard
            from torch.distributed.tensor import distribute_tensor
            for n, t in real.named_parameters():
                pi = rep.plan.inits.get(n)
                if pi is None or pi.rule == "keep":
                    p = pm.get_parameter(n)
                    p.to_local().copy_(distribute_tensor(t.detach(), mesh, p.placements,
                                                         src_data_rank=None).to_local())
        for rng in ("stream", "counter"):
            precondfx.pytorch.distributed.reinit(pm, rep.plan, 7, rng=rng)
            stats = precondfx.pytorch.distributed.calibrate(pm, {"input_ids": _ids()["input_ids"][
                rank::2]}, target_std=0.5)
            res[rng] = {"scale": stats["scale"], "std_after": stats["std_after"],
                        "full": {n: p.full_tensor().detach() for n, p in pm.named_parameters()}}
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.slow
def test_two_rank_fsdp2_tied_gpt2_equals_single_process(tmp_path) -> None:
    import os

    start_ranks(_tied_worker, 2, str(tmp_path))
    ranks = [torch.load(os.path.join(tmp_path, f"rank{r}.pt")) for r in range(2)]
    assert all(r["tied"] for r in ranks)
    torch.manual_seed(0)
    real = _gpt2()
    ref, rref = precondfx.precondition(real, _ids(), **KW)      # one process, whole batch
    with torch.device("meta"):
        mm = _gpt2()
    one, rep = precondfx.precondition(mm, _ids(), **KW)
    one.to_empty(device="cpu")
    _user_init(one, real, rep.plan)
    precondfx.pytorch.distributed.reinit(one, rep.plan, 7, rng="counter")
    one_scale = precondfx.pytorch.distributed.calibrate(one, _ids(), target_std=0.5)["scale"]
    want = {"stream": (dict(ref.named_parameters()), rref.output_scale),
            "counter": (dict(one.named_parameters()), one_scale)}
    for rng, (params, scale) in want.items():
        for r in ranks:
            got = r[rng]
            for n, p in params.items():
                assert torch.equal(got["full"][n], p.detach()), (rng, n)
            assert got["scale"] == ranks[0][rng]["scale"]                 # same on both ranks
            assert got["scale"] == pytest.approx(scale, rel=1e-5)
            assert got["std_after"] == pytest.approx(0.5, rel=1e-5)
