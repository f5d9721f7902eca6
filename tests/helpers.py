"""Test helpers written independently of the code under test (no precondfx imports)."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode


class NoDropout(TorchFunctionMode):
    """Identity for every functional dropout call (transformers call F.dropout directly)."""

    FNS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, torch.dropout}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FNS:
            return args[0]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def frozen(model: nn.Module, train: bool = True) -> Iterator[None]:
    """Train (or eval) mode, dropout modules off, buffers restored afterwards."""
    modes = {m: m.training for m in model.modules()}
    saved = {k: v.clone() for k, v in model.named_buffers()}
    model.train(train)
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.eval()
    try:
        with torch.no_grad(), NoDropout():
            yield
    finally:
        for m, t in modes.items():
            m.training = t
        with torch.no_grad():
            for k, v in model.named_buffers():
                if k in saved and saved[k].shape == v.shape:
                    v.copy_(saved[k])


def call(model: nn.Module, sample: Any) -> Any:
    if isinstance(sample, torch.Tensor):
        return model(sample)
    if isinstance(sample, (tuple, list)):
        return model(*sample)
    return model(**sample)


def main(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "keys"):
        if "logits" in out.keys():
            return out["logits"]
        return next(v for v in out.values() if isinstance(v, torch.Tensor)
                    and v.is_floating_point())
    return next(v for v in out if isinstance(v, torch.Tensor) and v.is_floating_point())


def train_std(model: nn.Module, sample: Any) -> float:
    """Population std of the main output in train mode with dropout off."""
    with frozen(model, True):
        return float(main(call(model, sample)).double().std(correction=0))


def per_sample_ratios(model: nn.Module, weights: list[torch.Tensor], x: torch.Tensor,
                      n: int, seed: int = 0) -> list[float]:
    """Mean over n samples (batch size 1) of E[dW^2]/E[W^2] under a random quadratic loss
    y^T R y / 2 with R = (A + A^T)/2, A i.i.d. normal, fresh per sample (the paper's Sec. 3.1 /
    Sec. 4 set-up).  Per-sample gradients via torch.func (vmap of grad), in chunks."""
    from torch.func import functional_call, grad, vmap

    g = torch.Generator().manual_seed(seed)
    names = {id(p): k for k, p in model.named_parameters()}
    wnames = [names[id(w)] for w in weights]
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss(ws, xi, r):
        p = {**params, **dict(zip(wnames, ws))}
        y = functional_call(model, (p, buffers), (xi.unsqueeze(0),)).flatten()
        return 0.5 * y @ r @ y

    per = vmap(grad(loss), in_dims=(None, 0, 0))
    acc = torch.zeros(len(weights), dtype=torch.float64)
    w2 = [float(w.detach().double().pow(2).mean()) for w in weights]
    ws = tuple(w.detach() for w in weights)
    done = 0
    while done < n:
        m = min(128, n - done)
        idx = torch.arange(done, done + m) % len(x)
        k = int(model(x[:1]).numel())
        a = torch.randn(m, k, k, generator=g)
        r = (a + a.transpose(1, 2)) / 2
        grads = per(ws, x[idx], r)
        for j, gj in enumerate(grads):
            # sum over the chunk of each sample's mean square, accumulated in float64 (each
            # sample's norm in float32: relative error ~1e-7, 20x cheaper than a float64 copy)
            per_norm = torch.linalg.vector_norm(gj.reshape(m, -1), dim=1)
            sq = float(per_norm.double().pow(2).sum())
            acc[j] += sq / gj[0].numel() / w2[j]
        done += m
    return (acc / n).tolist()


def all_tensors(out: Any) -> list[torch.Tensor]:
    """Every floating-point tensor in a (nested) output."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict) or hasattr(out, "keys"):
        return [t for k in out.keys() for t in all_tensors(out[k])]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in all_tensors(o)]
    return []


def free_port() -> int:
    """A free TCP port on the loopback interface (for a gloo process group's rendezvous)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rms(t: torch.Tensor) -> float:
    """Root mean square of a tensor, in float64 (a measurement the tests make themselves)."""
    return float(t.detach().double().pow(2).mean().sqrt())


@contextlib.contextmanager
def gloo_rank(rank: int, port: int, world: int) -> Iterator[Any]:
    """This process as rank ``rank`` of a ``world``-rank gloo group (rendezvous on ``port``),
    one CPU thread; yields the 1-D CPU device mesh and destroys the group on exit."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def _forked_rank(rank: int, worker: Any, port: int, out: str) -> None:
    # one thread before any op: a forked child that enters an OpenMP parallel region the
    # parent's threads served hangs (GNU libgomp); the ranks run one thread anyway (gloo_rank)
    torch.set_num_threads(1)
    worker(rank, port, out)


def start_ranks(worker: Any, world: int, out: str) -> None:
    """Run ``worker(rank, port, out)`` on ``world`` CPU processes, one thread each, forked from
    a fork server that imported torch and precondfx once (not from this process: a fork of a
    process holding threads, as the gloo threads an earlier test's process group leaves
    behind, can inherit a lock held mid-operation, and both ranks hung at start-up in a full
    CI run; a fresh interpreter per rank costs ~3 s of imports)."""
    import multiprocessing

    import torch.multiprocessing as mp
    multiprocessing.set_forkserver_preload(["torch", "precondfx", "tests.helpers"])
    mp.start_processes(_forked_rank, args=(worker, free_port(), out), nprocs=world, join=True,
                       start_method="forkserver")


def run_ranks(worker: Any, world: int, out: str) -> list[dict]:
    """Run ``worker(rank, port, out)`` on ``world`` CPU processes; each saves ``rank{r}.pt``
    into ``out``, which comes back as a list of dicts, by rank."""
    import os
    start_ranks(worker, world, out)
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]


@functools.lru_cache(maxsize=None)
def cli_help(command: str) -> str:
    """What ``python -m precondfx COMMAND --help`` prints (``precondfx.cli.main``, which the
    module entry point exits with, run in process), wide enough that each option stays on one
    line (once per command and session: the text is fixed)."""
    import contextlib
    import io
    import os
    from unittest import mock

    from precondfx.cli import main
    out = io.StringIO()
    with mock.patch.dict(os.environ, {"COLUMNS": "200"}), contextlib.redirect_stdout(out):
        assert main([command, "--help"]) == 0
    return out.getvalue()
