"""``lr=`` across every model the tests know: the test zoo (plain PyTorch: MLPs, CNNs, ResNets,
RNNs, attention, unusual interfaces) with an SGD and an Adam rate, and the transformers zoo (30
architectures, Mistral to Whisper) with an SGD rate.  Per model: the factor the pass chose, the
suggested rate before and after, whether it landed within a quarter octave (``lr_target``'s
tolerance), and the report's warning if any.  A model that fails is listed with its error.

    python bench/lr_target_zoo.py        # ~5 minutes on one core

Writes docs/results/lr_target_zoo.{md,json}.
"""
from __future__ import annotations

import math
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402
from results_io import write_table  # noqa: E402

RATES = {"sgd": 0.05, "adam": 1e-3}


def _one(name: str, model, sample, fwd: dict, opt: str) -> dict:
    import precondfx
    row = {"model": name, "optimizer": opt, "lr": RATES[opt]}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, rep = precondfx.precondition(model, sample, lr=RATES[opt], optimizer=opt, **fwd)
        sec = rep.conditioning["lr_target"]
        a = sec.get("suggested_after")
        row.update(factor=sec["factor"], before=sec.get("suggested_before"), after=a,
                   landed=bool(a) and abs(math.log2(a / RATES[opt])) <= 0.25 + 1e-9,
                   kept=sec["layers"] == 0, warning=sec.get("warning", ""))
    except Exception as e:          # listed, not hidden
        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
    return row


def main() -> None:
    import torch
    from tests import hf_zoo, zoo
    C.setup(1)
    say = C.Progress("lr_target_zoo")
    rows = []
    for n in zoo.names(include_transformers=False):
        for opt in RATES:
            m, s = zoo.build(n)
            rows.append(_one(n, m, s, {}, opt))
            say(f"{n} {opt}: {rows[-1].get('error') or rows[-1]['factor']}")
    for n, build in hf_zoo.BUILDERS.items():
        m, batch, kind = build(torch.Generator().manual_seed(1))
        rows.append(_one(f"hf/{n}", m, batch, {"use_cache": False} if kind == "causal" else {},
                         "sgd"))
        say(f"hf/{n} sgd: {rows[-1].get('error') or rows[-1]['factor']}")

    def rate(v: float | None) -> str:
        return f"{v:.3g}" if v else "-"
    lines = ["# `lr=` across the test zoos", "",
             f"`precondition(model, sample, lr=..., optimizer=...)` with SGD rate {RATES['sgd']} "
             f"and Adam rate {RATES['adam']} (Adam on the plain zoo only; a transformers "
             "model keeps its declared-init storage under Adam). Landed: the suggested rate "
             "after is within a quarter octave of `lr`.", "",
             "| model | optimizer | factor c | suggested before -> after | landed | warning |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['optimizer']} | - | - | **error** | "
                         f"{r['error']} |")
            continue
        lines.append(f"| {r['model']} | {r['optimizer']} | {r['factor']:.3g} | "
                     f"{rate(r['before'])} -> {rate(r['after'])} | "
                     f"{'kept' if r['kept'] else 'yes' if r['landed'] else 'no'} | "
                     f"{r['warning'][:90]} |")
    ok = [r for r in rows if "error" not in r]
    lines += ["", f"- {len(rows)} runs, {len(rows) - len(ok)} errors; landed on "
                  f"{sum(r['landed'] for r in ok)}, storage kept on {sum(r['kept'] for r in ok)}, "
                  f"short of the rate on {sum(not r['landed'] and not r['kept'] for r in ok)}",
              "", "Reproduce: `python bench/lr_target_zoo.py`", "", f"Environment: {C.env_info()}"]
    write_table(os.path.join(C.RESULTS, "lr_target_zoo"), lines, {"rows": rows,
                                                                  "env": C.env_info()})


if __name__ == "__main__":
    main()
