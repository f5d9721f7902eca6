"""How measurement passes run: intra-op threads for the small per-sample passes.

Kept apart from ``conditioning`` (the HVP estimators) and ``sketch`` (the cotangent-pair
estimator) so that both import it and neither imports the other.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def one_thread(model: nn.Module | None = None, large: int = 1_000_000) -> Iterator[None]:
    """Run the batch-size-1 passes of a small model on one intra-op thread.  Their ops are
    small; on this 2-core machine under load, two contending threads made them up to 40x slower
    (a 6-layer CNN's 16 samples took 12.5 s with 2 threads and 0.3 s with one).  Models with
    more than ``large`` parameters keep their threads (ResNet-50: one thread was 2x slower)."""
    n = torch.get_num_threads()
    if model is not None and sum(p.numel() for p in model.parameters()) > large:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
