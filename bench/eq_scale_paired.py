"""Equal output scale with common random numbers (issue 20, "at equal output scale").

The plain rules' baselines ``fan_in_pair``, ``fan_out_pair``, ``xavier_pair`` of
``bench/train_suite.py`` start from precondfx's own normal draws for the seed, each layer at
the rule's std, biases 0, output std 1 (``common.init_rule_from_draws_``); ``geometric_pair``
is the same with the geometric std, which is precondfx's result without its pass.  So for one
seed the methods differ only in each layer's scale, and the seed-to-seed spread of which draws
a method got (which decided the unpaired comparison's ranking: precondfx's default at depth 1
went from 0.082 to 0.074 and 0.073 with the draws of seeds 1000+ and 2000+) cancels in the
differences.  This script reads the suite's JSON and writes, per net, each method's median test
loss at its validation-chosen rate, the paired difference from precondfx's (mean over seeds of
the per-seed differences, each at its method's chosen rate, with its standard error), and the
issue's summary: each method's loss over the best of the compared methods, averaged over the
nets, with a bootstrap over seeds (the same seeds drawn for every method).

    python bench/train_suite.py --cpu-lr --tasks mlp_w32_d2,mlp_w128_d2,mlp_w512_d2,mlp_w128_d1,\
mlp_w128_d4,mlp_w128_d8,mlp_w128_d16 --optimizers sgd --methods pfx,geometric_pair,fan_in_pair,\
fan_out_pair,xavier_pair --seeds 24 --lr-step 0.5 --n-lr 12 --tag eq_pair24     # ~25 min, 1 core
    python bench/eq_scale_paired.py docs/results/train_suite_eq_pair24.json
    # precondfx's default re-run on some nets against the same seeds' baselines:
    python bench/eq_scale_paired.py docs/results/train_suite_eq_pair24.json \
        --pfx docs/results/train_suite_eq_ceiling_cpu24.json --out docs/results/eq_scale_paired_ceiling_cpu24
    python bench/eq_scale_paired.py docs/results/train_suite_eq_pair24.json \
        --pfx docs/results/train_suite_eq_ceiling_cpu24.json \
        --pfx docs/results/train_suite_eq_ceiling_cpu24b.json --out docs/results/eq_scale_paired_ceiling_cpu24_all
    python bench/eq_scale_paired.py docs/results/train_suite_eq_pair24.json --pfx-method pfx_margin1 \
        --pfx docs/results/train_suite_eq_margin1_cpu24.json --out docs/results/eq_scale_paired_margin1_cpu24

    # what the comparison resolves: another draw stream analysed the same way, and the geometric
    # rule alone in precondfx's column
    python bench/eq_scale_paired.py docs/results/train_suite_eq_pair24_r19.json \
        --replicate docs/results/train_suite_eq_pair24.json --out docs/results/eq_scale_paired_r19
    python bench/eq_scale_paired.py docs/results/train_suite_eq_pair24_r19.json \
        --pfx docs/results/train_suite_eq_pair24_r19.json --pfx-method geometric_pair \
        --replicate docs/results/train_suite_eq_pair24.json \
        --out docs/results/eq_scale_paired_r19_geometric

Every analysis also says what the protocol can resolve (``null_pass_share``): the methods'
losses of each seed handed out at random, the share of permutations in which the first
column meets the target, and how much lower on every seed a method must be to pass in 80%.

Writes docs/results/eq_scale_paired.{md,json} (``--out`` for another name).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
from results_io import write_table  # noqa: E402

#: the methods the issue compares (precondfx's default against the plain rules)
COMPARED = ["pfx", "fan_in_pair", "fan_out_pair", "xavier_pair"]
LABEL = {"pfx": "precondfx default", "fan_in_pair": "fan-in", "fan_out_pair": "fan-out",
         "xavier_pair": "Xavier", "geometric_pair": "geometric, no pass"}


def chosen(cell: dict) -> np.ndarray:
    """Per-seed reported (test) losses at the rate the suite chose on validation for the cell
    (its ``best_lr_log2``)."""
    i = cell["lr_log2"].index(cell["best_lr_log2"])
    return np.asarray(cell["losses"][cell["metric"]], float)[i]


def normalized(per: dict, nets: list[str], idx: np.ndarray | None = None) -> np.ndarray:
    """(nets, COMPARED) array: each method's median loss over the seeds ``idx`` (all: None),
    divided by the lowest of the compared methods' on that net."""
    out = []
    for t in nets:
        med = np.array([np.median(per[t][m] if idx is None else per[t][m][idx])
                        for m in COMPARED])
        out.append(med / med.min())
    return np.array(out)


def target_met(norm: np.ndarray) -> tuple[bool, bool]:
    """The issue's two conditions on a ``normalized`` array for precondfx: never the worst on
    any net, and its mean over the nets at or below every other method's."""
    j = COMPARED.index("pfx")
    never_worst = bool(np.all(norm[:, j] < norm.max(1)))
    mean = norm.mean(0)
    return never_worst, bool(mean[j] <= np.delete(mean, j).min())


def null_pass_share(per: dict, nets: list[str], n_perm: int = 1000, seed: int = 0,
                    gains: tuple[float, ...] = tuple(np.arange(21) / 100)) -> dict | None:
    """How often a method no better than the others meets the target: the compared methods'
    labels permuted within each seed of each net (the seed's four losses, each at its method's
    chosen rate, handed out at random), precondfx's conditions checked on each permutation.
    Under that null every method is exchangeable with every other, so the shares say what the
    protocol can resolve: 'never the worst on 7 nets' alone passes about (3/4)^7 of the time
    when the nets' rankings are independent.  ``power``: the share meeting both conditions when
    precondfx's column is, on top, lower by a fraction g on every seed (a method g better than
    the others); ``gain_for_80pct``: the smallest g passing in 80% of the permutations."""
    if n_perm <= 0:
        return None
    rng = np.random.default_rng(seed + 1)
    n = {t: min(len(per[t][m]) for m in COMPARED) for t in nets}
    stacks = {t: np.stack([per[t][m][:n[t]] for m in COMPARED], 1) for t in nets}  # (seeds, 4)
    never = mean_ok = both = 0
    power = np.zeros(len(gains))
    j = COMPARED.index("pfx")
    for _ in range(n_perm):
        shuffled = {}
        for t in nets:
            a = stacks[t]
            p = np.argsort(rng.random(a.shape), axis=1)
            shuffled[t] = dict(zip(COMPARED, np.take_along_axis(a, p, 1).T))
        norm = normalized(shuffled, nets)
        nw, mo = target_met(norm)
        never, mean_ok, both = never + nw, mean_ok + mo, both + (nw and mo)
        for k, g in enumerate(gains):        # precondfx's column g lower than its draw
            scaled = {t: {**shuffled[t], "pfx": shuffled[t]["pfx"] * (1 - g)} for t in nets}
            power[k] += all(target_met(normalized(scaled, nets)))
    power /= n_perm
    needed = next((float(g) for g, pw in zip(gains, power) if pw >= 0.8), None)
    return {"n_perm": n_perm, "never_worst": never / n_perm, "at_least_best_on_average":
            mean_ok / n_perm, "both": both / n_perm,
            "power": {f"{g:.2f}": float(pw) for g, pw in zip(gains, power)},
            "gain_for_80pct": needed}


def analyse(results: dict, opt: str = "sgd", n_boot: int = 1000, seed: int = 0,
            n_perm: int = 1000) -> dict:
    """The per-net table and the summary (see the module docstring)."""
    nets = [t for t in results if all(m in results[t].get(opt, {}) for m in COMPARED)]
    extra = [m for m in ("geometric_pair",)
             if all(m in results[t][opt] for t in nets)]
    methods = COMPARED + extra
    per = {t: {m: chosen(results[t][opt][m]) for m in methods} for t in nets}
    rows = {}
    for t in nets:
        pfx = per[t]["pfx"]
        row = {}
        for m in methods:
            v = per[t][m]
            d = pfx - v
            row[m] = {"median": float(np.median(v)), "se": float(results[t][opt][m]["se"]),
                      "lr_log2": results[t][opt][m]["best_lr_log2"],
                      "pfx_minus": float(d.mean()),
                      "pfx_minus_se": float(d.std(ddof=1) / np.sqrt(len(d)))}
        rows[t] = row

    norm = normalized(per, nets)
    rng = np.random.default_rng(seed)
    n_seeds = min(len(per[t]["pfx"]) for t in nets)
    boots = np.array([normalized(per, nets, rng.integers(0, n_seeds, n_seeds)).mean(0)
                      for _ in range(n_boot)])
    j = COMPARED.index("pfx")
    others = [i for i in range(len(COMPARED)) if i != j]
    summary = {m: {"mean_over_best": float(norm[:, i].mean()),
                   "se": float(boots[:, i].std()),
                   "worst_on": [t for k, t in enumerate(nets)
                                if norm[k, i] == norm[k].max()],
                   "best_on": [t for k, t in enumerate(nets) if norm[k, i] == 1.0]}
               for i, m in enumerate(COMPARED)}
    summary["pfx_at_or_below_best_other_share"] = float(
        np.mean(boots[:, j] <= boots[:, others].min(1)))
    summary["pfx_never_worst"], summary["pfx_at_least_best_on_average"] = target_met(norm)
    summary["null"] = null_pass_share(per, nets, n_perm, seed)
    return {"nets": nets, "methods": methods, "rows": rows, "summary": summary,
            "seeds": n_seeds, "optimizer": opt}


def table(res: dict, source: str, args: str = "", pfx_label: str = LABEL["pfx"]) -> list[str]:
    """The markdown lines; ``pfx_label``: the name of the method in precondfx's column (another
    one under ``--pfx-method``)."""
    ms = res["methods"]
    label = {**LABEL, "pfx": pfx_label}
    lines = ["# Equal output scale with common random numbers (issue 20)", "",
             f"Source: `{source}` ({res['seeds']} seeds, {res['optimizer'].upper()}, each "
             "method's rate chosen on validation on a half-octave grid). Every method of a seed "
             "starts from precondfx's own normal draws, each layer at its rule's std, biases 0, "
             "output std 1 (`bench/eq_scale_paired.py`). Cells: median test loss ± SE (the "
             "suite's) at the chosen rate (log2); below it, precondfx's minus the method's, the mean of the "
             "per-seed differences ± its SE (negative: precondfx lower).", "",
             "| net | " + " | ".join(label.get(m, m) for m in ms) + " |",
             "|---" * (len(ms) + 1) + "|"]
    for t in res["nets"]:
        r = res["rows"][t]
        cells = []
        for m in ms:
            c = f"{r[m]['median']:.4f} ± {r[m]['se']:.4f} @{r[m]['lr_log2']}"
            if m != "pfx":
                c += f"<br>{r[m]['pfx_minus']:+.4f} ± {r[m]['pfx_minus_se']:.4f}"
            cells.append(c)
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    s = res["summary"]
    lines += ["", "Each method's median loss over the best of the four, averaged over the nets "
              "(± bootstrap SE over seeds):", ""]
    for m in COMPARED:
        lines.append(f"- {label[m]}: **{s[m]['mean_over_best']:.3f}** ± {s[m]['se']:.3f}; "
                     f"the worst of the four on {len(s[m]['worst_on'])} net(s)"
                     f"{' (' + ', '.join(s[m]['worst_on']) + ')' if s[m]['worst_on'] else ''}, "
                     f"the best on {len(s[m]['best_on'])}")
    nl = s["null"]
    lines += ["", f"- {pfx_label}'s mean at or below the best other rule's in "
              f"{100 * s['pfx_at_or_below_best_other_share']:.0f}% of the bootstrap draws",
              f"- the issue's target (never the worst, on average at least as good as the best "
              f"of them): never the worst: {'yes' if s['pfx_never_worst'] else 'no'}; "
              f"at least as good on average: "
              f"{'yes' if s['pfx_at_least_best_on_average'] else 'no'}"]
    if nl:
        lines += [f"- what the protocol resolves: with the four methods' labels permuted "
                  f"within each seed ({nl['n_perm']} permutations, every method then as good "
                  f"as every other), the first column is never the worst in "
                  f"{100 * nl['never_worst']:.0f}%, at least as good on average in "
                  f"{100 * nl['at_least_best_on_average']:.0f}%, both in {100 * nl['both']:.0f}%; "
                  f"a method lower by a fraction g on every seed passes both in 80% of them "
                  f"from g = {nl['gain_for_80pct']}"]
    for rep in res.get("replications", ()):
        lines += ["", f"Other draw streams, analysed the same way (`{rep['source']}`; its "
                  f"first column is the code of that run): "
                  + "; ".join(f"{label[m]} **{rep['summary'][m]['mean_over_best']:.3f}** "
                              f"(worst on {len(rep['summary'][m]['worst_on'])}, best on "
                              f"{len(rep['summary'][m]['best_on'])})" for m in COMPARED)]
    lines += ["", f"Environment of this analysis: {C.env_info()}",
              f"Reproduce: `python bench/eq_scale_paired.py {source}{args}`"]
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="a train_suite JSON with pfx and the *_pair methods")
    ap.add_argument("--out", default=os.path.join(C.RESULTS, "eq_scale_paired"),
                    help="output path without extension")
    ap.add_argument("--optimizer", default="sgd")
    ap.add_argument("--pfx", action="append", default=None,
                    help="a train_suite JSON whose pfx cells replace the first one's, on the nets "
                         "it holds (only those nets are compared): a re-run of precondfx's "
                         "default against the same seeds' baselines; repeat it for re-runs "
                         "split over several JSONs (a net in two of them: the later wins)")
    ap.add_argument("--pfx-method", default="pfx",
                    help="--pfx: the method of that JSON taken as precondfx's (pfx_margin1: "
                         "the ceiling-margin experiment)")
    ap.add_argument("--replicate", action="append", default=[],
                    help="another train_suite JSON of the same comparison on other draws (an "
                         "earlier run): analysed the same way and listed under the table, to "
                         "show which rankings hold from one draw stream to the next")
    args = ap.parse_args(argv)
    data = json.load(open(args.json))
    results, command = data["results"], data.get("command")
    if args.pfx:
        others = [json.load(open(f)) for f in args.pfx]
        rerun = {t: cells for o in others for t, cells in o["results"].items() if t in results}
        results = {t: {**results[t], args.optimizer: {**results[t][args.optimizer],
                                                      "pfx": cells[args.optimizer][
                                                          args.pfx_method]}}
                   for t, cells in rerun.items()}
        command = [command] + [o.get("command") for o in others]
    res = analyse(results, args.optimizer)
    res["source_command"] = command
    rel = (lambda f: os.path.relpath(f, C.ROOT) if os.path.isabs(f) else f)
    def same_method(results: dict) -> dict:     # --pfx-method's cells in precondfx's column
        if args.pfx_method == "pfx":
            return results
        return {t: {**c, args.optimizer: {**c[args.optimizer],
                                          "pfx": c[args.optimizer][args.pfx_method]}}
                for t, c in results.items() if args.pfx_method in c.get(args.optimizer, {})}

    res["replications"] = [{"source": rel(f), "summary": analyse(
        same_method(json.load(open(f))["results"]), args.optimizer, n_perm=0)["summary"]}
        for f in args.replicate]
    extra = "".join(f" --pfx {rel(f)}" for f in args.pfx or ()) + "".join(
        f" --replicate {rel(f)}" for f in args.replicate) + (
        f" --pfx-method {args.pfx_method}" if args.pfx_method != "pfx" else "") + (
        f" --out {rel(args.out)}" if args.out != os.path.join(C.RESULTS, "eq_scale_paired")
        else "")
    lines = table(res, rel(args.json), extra, LABEL["pfx"] if args.pfx_method == "pfx" else
                  f"{LABEL.get(args.pfx_method, args.pfx_method)} (in precondfx's column)")
    write_table(args.out, lines, res)
    print("\n".join(lines))
    return res


if __name__ == "__main__":
    main()
