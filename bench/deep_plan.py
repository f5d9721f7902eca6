"""Planning deep models on the meta device: seconds per stage against depth.

    python bench/deep_plan.py [--depths 32 64 128] [--repo DIR]   # docs/results/deep_plan.md

A tiny-width Llama (hidden 32) at each depth, built under ``torch.device("meta")`` and
preconditioned with ``balance="analytic"``, one thread, each depth in a fresh process.
``--repo`` runs another checkout's precondfx (e.g. the previous commit) in the same run, so the
two columns are comparable (same machine load).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import child_json, write_table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(depth: int) -> dict:
    import time

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import precondfx
    torch.set_num_threads(1)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=depth,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=61,
                      max_position_embeddings=16)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    t0 = time.perf_counter()
    _, rep = precondfx.precondition(model, {"input_ids": torch.zeros(1, 8, dtype=torch.long)},
                                    balance="analytic", use_cache=False)
    return {"depth": depth, "wall_s": time.perf_counter() - t0, "nodes": len(rep.nodes),
            "joins": len(rep.plan.residuals), "stages": rep.stage_seconds,
            "file": precondfx.__file__}


def run(depth: int, repo: str) -> dict:
    return child_json(__file__, [str(depth)], repo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--depths", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--repo", help="another checkout to time in the same run")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "deep_plan"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    repos = [ROOT] + ([os.path.abspath(args.repo)] if args.repo else [])
    load0 = os.getloadavg()[0]
    rows = [dict(run(d, r), repo=r) for d in args.depths for r in repos]
    load = (load0 + os.getloadavg()[0]) / 2
    lines = ["# Planning deep models on the meta device", "",
             f"`python bench/deep_plan.py --depths {' '.join(map(str, args.depths))}"
             f"{' --repo ' + args.repo if args.repo else ''}` (tiny-width Llama, one thread, "
             f"each row a fresh process; load average {load:.1f} on {os.cpu_count()} cores).",
             "", "| tree | depth | nodes | joins | capture (s) | plan (s) | apply (s) | "
             "total (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        st = r["stages"]
        tree = "this" if r["repo"] == ROOT else os.path.basename(r["repo"])
        lines.append(f"| {tree} | {r['depth']} | {r['nodes']} | {r['joins']} | "
                     f"{st.get('capture', 0):.2f} | {st.get('plan', 0):.2f} | "
                     f"{st.get('apply', 0):.2f} | {st.get('total', 0):.2f} |")
    write_table(args.out, lines, rows)


if __name__ == "__main__":
    main()
