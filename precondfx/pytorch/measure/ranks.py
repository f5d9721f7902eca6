"""Measured balancing over the ranks of a process group: which rank measures which of the
balancing samples, and the collectives that make every rank hold the same per-sample values.

The global balancing samples are ordered as a ``DistributedSampler`` deals them out: rank r's
local sample l is global sample ``l * world + r`` (ranks with fewer samples are skipped where
they have none).  Draw s of the sketch uses global sample ``s % total`` with the s-th set of
random cotangents, exactly as one process does with its own batch; the rank that holds the
sample measures it and the others add zeros, so after a sum all-reduce every rank holds the
same per-sample matrix, bit for bit (``x + 0 = x``).  With every rank holding the same even
number of samples, the first half of each rank's batch (what balancing measures) is the first
half of the global batch ``x`` whose rank-r part is ``x[r::world]``: the statistics, the
early-stop decisions and the factors are those of one process balancing on ``x``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist


def _device(group: Any) -> torch.device:
    """Where the group's collectives take their tensors (NCCL: the current GPU)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class Ranks:
    """This rank's place among the ranks that share a measurement (see the module docstring)."""

    rank: int
    sizes: tuple[int, ...]     # each rank's number of balancing samples
    group: Any = None

    @classmethod
    def gather(cls, n_local: int, group: Any = None) -> "Ranks":
        """Every rank's number of samples (one all-reduce)."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        t = torch.zeros(world, dtype=torch.int64, device=_device(group))
        t[rank] = int(n_local)
        dist.all_reduce(t, group=group)
        return cls(rank, tuple(int(v) for v in t.cpu()), group)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def world(self) -> int:
        return len(self.sizes)

    def order(self) -> list[tuple[int, int]]:
        """(rank, local index) of every global sample, in global order."""
        return [(r, l) for l in range(max(self.sizes, default=0))
                for r in range(self.world) if l < self.sizes[r]]

    def local(self, g: int) -> int | None:
        """This rank's local index of global sample ``g`` (None: another rank holds it)."""
        r, l = self.order()[g]
        return l if r == self.rank else None

    def owned(self, count: int) -> list[int]:
        """The global samples among the first ``count`` that this rank holds, in order (their
        local indices are 0, 1, 2, ...)."""
        return [g for g, (r, _) in enumerate(self.order()[:count]) if r == self.rank]

    def sum(self, a: np.ndarray) -> np.ndarray:
        """The element-wise sum over ranks (float64)."""
        t = torch.as_tensor(np.ascontiguousarray(a, dtype=np.float64), device=_device(self.group))
        dist.all_reduce(t, group=self.group)
        return t.cpu().numpy()

    def max(self, values: Sequence[float]) -> list[float]:
        """The element-wise maximum over ranks (NaN counts as largest)."""
        v = np.asarray(values, dtype=np.float64)
        v = np.where(np.isnan(v), np.inf, v)
        t = torch.as_tensor(v, device=_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [float(x) for x in t.cpu()]

    def failed(self, error: BaseException | None) -> BaseException | None:
        """Agree on a failure: ``error`` where this rank failed, else an error naming the rank
        that did (None: no rank failed), so that every rank leaves the collective sequence at
        the same point."""
        flags = self.sum(np.array([1.0 if r == self.rank and error is not None else 0.0
                                   for r in range(self.world)]))
        if error is not None:
            return error
        bad = [r for r, f in enumerate(flags) if f > 0]
        return RuntimeError(f"the measurement failed on rank {bad[0]}") if bad else None


def agreed(ranks: Ranks | None, step: Callable[[], None]) -> BaseException | None:
    """Run one measuring step.  Alone (``ranks`` None) its exception propagates; over ranks
    every rank runs the same agreement after it (:meth:`Ranks.failed`), so a failure on any
    rank is returned on all of them and the collectives stay paired (None: no rank failed)."""
    error: BaseException | None = None
    try:
        step()
    except Exception as e:  # noqa: BLE001 - agreed over the ranks below
        if ranks is None:
            raise
        error = e
    return None if ranks is None else ranks.failed(error)


def for_group(n_local: int, group: Any = None) -> Ranks | None:
    """A :class:`Ranks` when a process group with more than one rank is initialized, else
    None (one process measures alone)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return None
    return Ranks.gather(n_local, group)
