"""Precondition a model that is built on the meta device and trained sharded with FSDP2.

Run with torchrun (one process per GPU, or CPU processes with gloo):

    torchrun --nproc_per_node 2 examples/fsdp_torchrun.py

or as is, which starts 2 CPU processes (gloo) itself:

    python examples/fsdp_torchrun.py

The recipe: plan and apply on the meta device (shapes only, no memory), shard with
``fully_shard``, ``to_empty``, then ``precondfx.reinit`` (each rank writes its shard of the same
full tensors as a single-process run), ``precondfx.distributed.calibrate`` (the output std
over every rank's batch, all-reduced: every rank sets the same output scale) and
``precondfx.distributed.balance`` (measured balancing: per-sample Hessian-block statistics
summed over the ranks, every rank sets the same alphas).
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import precondfx

DIM, DEPTH, CLASSES, BATCH = 64, 4, 10, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))   # a residual branch: precondfx sets s


class ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(32, DIM)
        self.blocks = nn.Sequential(*[Block() for _ in range(DEPTH)])
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.stem(x))))


def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch: a fixed random teacher labels Gaussian inputs."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 32, generator=g)
    teacher = torch.randn(32, CLASSES, generator=torch.Generator().manual_seed(0))
    return x, (x @ teacher).argmax(1)


def train(steps: int = 30, seed: int = 0) -> dict:
    """The training script; expects torchrun's environment (RANK, WORLD_SIZE, MASTER_*)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    try:
        # 1. Build on the meta device and plan + apply there: no weight is allocated.
        with torch.device("meta"):
            model = ResidualMLP()
        #    balance="hessian" places an alpha on every weighted layer, measured in step 3.
        model, report = precondfx.precondition(model, data(rank, 0)[0], balance="hessian",
                                               seed=seed)
        # 2. Shard every module that holds parameters (with a GraphModule result these are
        #    the leaf layers the graph calls; modules sharing a tied weight go in one unit),
        #    then the root.
        for unit in precondfx.distributed.shard_units(model, report.plan):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # 3. Storage for this rank's shards, the plan's weights and constants, output scale.
        model.to_empty(device=device)
        precondfx.reinit(model, report.plan, seed)
        calib = precondfx.distributed.calibrate(model, data(rank, 0)[0].to(device))
        bal = precondfx.distributed.balance(model, data(rank, 0)[0].to(device), seed=seed)
        # 4. Train as usual.
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(1, steps + 1):
            x, y = data(rank, step)
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
        if rank == 0:
            print(f"output scale {calib['scale']:.4g}: output std {calib['std_after']:.4f} "
                  f"over all ranks' batches (target {calib['target_std']:g})")
            print(bal["summary"])
            print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {steps} steps on {world} ranks")
        return {"rank": rank, "calib": calib, "balance": bal.get("factors"), "losses": losses}
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, steps: int, out: str | None) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    res = train(steps)
    if out:
        torch.save(res, os.path.join(out, f"rank{rank}.pt"))


def launch(world: int = 2, steps: int = 30, out: str | None = None) -> None:
    """Without torchrun: start ``world`` CPU processes (gloo) on this machine."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(world, port, steps, out), nprocs=world, join=True)


if __name__ == "__main__":
    if "WORLD_SIZE" in os.environ:   # started by torchrun
        train()
    else:
        launch()
