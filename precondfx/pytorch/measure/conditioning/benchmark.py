"""The precision benchmark of ``hessian`` in the package docstring
(``python -m precondfx.pytorch.measure.conditioning`` reruns it)."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from precondfx.pytorch.measure.conditioning.api import measure_conditioning


def _benchmark_precision(repeats: int = 3) -> str:
    """Relative SE of ``hessian`` vs probes/samples/method on a small strided conv net.

    Net: Conv(3,16,3,p1)-ReLU-Conv(16,32,3,s2,p1)-ReLU-Conv(32,32,3,s2,p1)-ReLU-Linear(512,10),
    16x16 N(0,1) inputs, default init.  Reports the median over layers of ``rel_stderr`` (mean
    over ``repeats`` seeds), the HVPs/backward passes per sample and the wall time per sample.
    """
    import time

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                        nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.ReLU(),
                        nn.Flatten(), nn.Linear(512, 10))
    x = torch.randn(64, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    rows = ["| method | probe | n_probes | passes/sample | rel SE, n=8 | rel SE, n=32 | ms/sample |",
            "|---|---|---|---|---|---|---|"]
    configs = [("hvp", "gaussian", 1), ("hvp", "rademacher", 1), ("hvp", "gaussian", 4),
               ("hvp", "rademacher", 4), ("hvp", "rademacher", 16), ("ggn", "-", 0)]
    for method, probe, p in configs:
        rel = {}
        ms = []
        for n in (8, 32):
            vals = []
            for rep in range(repeats):
                t0 = time.perf_counter()
                r = measure_conditioning(net, x, stats=("hessian",), n_samples=n,
                                         n_probes=max(p, 1), seed=rep, method=method,
                                         probe=probe if method == "hvp" else "rademacher")
                ms.append((time.perf_counter() - t0) / n * 1e3)
                vals.append(float(np.median([lay.hessian.rel_stderr for lay in r.layers])))
            rel[n] = float(np.mean(vals))
        passes = f"1+{4 * p} HVP" if method == "hvp" else "10 backward"
        rows.append(f"| {method} | {probe} | {p or '-'} | {passes} | {rel[8]:.3f} | {rel[32]:.3f} "
                    f"| {np.median(ms):.0f} |")
    return "\n".join(rows)
