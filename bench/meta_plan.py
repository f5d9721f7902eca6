"""Plan a Llama-7B configuration on the meta device: wall time, peak memory, and agreement
with the plan of the same architecture at small width.

    python bench/meta_plan.py            # writes docs/results/meta_plan.md and .json

Each measurement runs in a fresh subprocess so that its peak resident memory (``ru_maxrss``)
is its own; the baseline row is the same process after importing torch, transformers and
precondfx, before building the model.  Planning uses ``balance="analytic"`` (measured balancing
needs data) and the default output scale, which is inserted at 1 and calibrated after
materializing (``precondfx.pytorch.distributed.calibrate``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import child_json, write_table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Llama-2-7B (transformers' LlamaConfig defaults) and the same architecture at small width:
# depth, heads, vocabulary and the MLP ratio kept, every width divided by 32.
SIZES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
    "small": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
}


def child(size: str, entry: str) -> dict:
    """One measurement, in this (fresh) process."""
    import resource
    import time

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import precondfx
    from precondfx.core.compare import width_invariant
    torch.set_num_threads(1)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SIZES[size]))
    ids = {"input_ids": torch.zeros(1, 16, dtype=torch.long)}
    kw = dict(balance="analytic", use_cache=False)
    if entry == "analyze":
        rep = precondfx.analyze(model, ids, target_std=None, **kw)
    else:
        _, rep = precondfx.precondition(model, ids, **kw)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    plan = rep.plan
    eq7 = all(math.isclose(plan.inits[la.weight].std ** 2 * la.alpha ** 2,
                           2.0 / (la.k2 * math.sqrt(la.n_in * la.n_out)), rel_tol=1e-12)
              for la in plan.layers if la.kind != "embedding"
              and plan.inits[la.weight].rule == "geometric")
    return {"size": size, "entry": entry, "params": sum(p.numel() for p in model.parameters()),
            "capture": rep.capture, "nodes": len(rep.nodes), "wall_s": wall,
            "baseline_rss_mb": base, "peak_rss_mb": peak, "eq7": eq7,
            "invariant": json.loads(json.dumps(width_invariant(plan, rep.nodes)))}


def run(size: str, entry: str) -> dict:
    return child_json(__file__, [size, entry], ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=2, metavar=("SIZE", "ENTRY"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "meta_plan"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    from precondfx.core.compare import differences
    load0 = os.getloadavg()[0]
    rows = [run(size, entry) for size in ("7b", "small") for entry in ("analyze", "precondition")]
    load = (load0 + os.getloadavg()[0]) / 2
    small_of = {r["entry"]: r for r in rows if r["size"] == "small"}
    small = small_of["analyze"]
    lines = ["# Planning a Llama-7B configuration on the meta device", "",
             "`python bench/meta_plan.py` (one thread, each row a fresh process; peak = "
             f"`ru_maxrss`, baseline = after imports; machine load average {load:.1f} on "
             f"{os.cpu_count()} cores during the run).", "",
             "| config | call | parameters | capture | nodes | wall (s) | baseline RSS (MB) | "
             "peak RSS (MB) | Eq. 7 stds | width-invariant part = same call at small width |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        # each call against the same call at small width (precondition also plans the output
        # scale, which analyze with target_std=None leaves out)
        d = differences(r["invariant"], small_of[r["entry"]]["invariant"])
        r["differences"] = d
        lines.append(f"| {r['size']} | {r['entry']} | {r['params'] / 1e9:.2f}e9 | {r['capture']} "
                     f"| {r['nodes']} | {r['wall_s']:.1f} | {r['baseline_rss_mb']:.0f} | "
                     f"{r['peak_rss_mb']:.0f} | {'yes' if r['eq7'] else 'NO'} | "
                     f"{'identical' if not d else '; '.join(d[:3])} |")
    inv = small["invariant"]
    lines += ["", f"Width-invariant part compared: {len(inv['nodes'])} non-structural nodes "
              f"(name, kind, status), {len(inv['layers'])} layers (kind, alpha), "
              f"{len(inv['scales'])} scales (tag, site, value), {len(inv['residuals'])} "
              f"residual joins (branch, s), init rules of {len(inv['inits'])} parameters. "
              "Init stds are width-dependent; every re-drawn weight was checked against Eq. 7, "
              "E[W^2] alpha^2 = 2/(k^2 sqrt(n_in n_out)).", ""]
    for r in rows:
        del r["invariant"]
    write_table(args.out, lines, rows)


if __name__ == "__main__":
    main()
