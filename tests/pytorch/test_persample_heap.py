"""Measured balancing on a strided 1x1 convolution, one thread (a heap corruption in torch).

torch 2.13's CPU weight gradient of a 1x1 stride-2 convolution on a channels-last input
corrupts the heap on one thread; the per-sample measurement used to copy image inputs to
channels-last, and ``precondition`` then aborted the process ("free(): invalid pointer") in
``tests/batteries/test_fuzz.py``'s example 2894.  Run in a fresh process, with glibc's malloc
checks where the system has them, so that a corruption ends that process, not the suite's.
"""
from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r"""
import torch
from torch import nn
import precondfx
torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 10, 1, stride=2)
        self.head = nn.Linear(10, 2)

    def forward(self, x):
        return self.head(self.conv(x).mean(dim=(2, 3)))


torch.manual_seed(2894)
x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(2895))
for seed in range(1):
    out, rep = precondfx.precondition(Net(), x, seed=seed, target_std=0.05, lr=None)
    print(float(out.eval()(x).std(correction=0)))
import gc
gc.collect()
"""

MALLOC_DEBUG = "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"


def test_measured_balancing_strided_1x1_conv_one_thread() -> None:
    env = {**os.environ, "MALLOC_CHECK_": "3"}
    if os.path.exists(MALLOC_DEBUG):
        env["LD_PRELOAD"] = MALLOC_DEBUG
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    stds = [float(v) for v in run.stdout.split()]
    assert len(stds) == 1
    for s in stds:       # the calibrated output std, in eval mode (no dropout/BN here)
        assert abs(s / 0.05 - 1) < 0.02, stds
