"""What does ``precondfx.precondition`` cost, in training steps of the same model?

For each model (MLPs over two orders of magnitude of parameters, the bottleneck ResNet-50 at
224x224, batch 8, with and without BatchNorm, and a tiny GPT-2 from a transformers config; the
strided-AlexNet conv family with ``--family conv``) and each mode (balance none / analytic /
auto / hessian, and measure=True on top of auto), the wall time of ``precondition(model,
sample)`` is divided by the wall time of one training step of the same model on the same batch
(SGD momentum 0.9: zero_grad, forward, loss, backward, step; the median of ``--steps`` steps
after one warm-up step), measured in the same process tree, one thread.  ``balancing`` is the
cost of measured balancing itself: the auto/hessian ratio minus the analytic one.

Memory: every measurement runs in a forked child (the parent has already warmed up the
imports and fx tracing), so each has a fresh high-water mark: the peak resident set size
(Linux ``VmHWM`` from /proc/self/status, reset with ``echo 5 > /proc/self/clear_refs``) above
the resident size once the model and the batch are built.  It counts every allocation,
PyTorch's C++ ones included (tracemalloc would see only Python's).  For the training step it
is the first step (which allocates gradients, momentum buffers and activations); for
``precondition`` the first call (which includes its copy of the model: ``inplace=False``).

Issue 14 targets: measured balancing on ResNet-50 (224x224, batch 8) at most 5 training steps
on a CPU; ``auto`` on the small MLPs at most 2x the cost of ``analytic``.  On models whose step
takes more than 0.5 s the ratio is taken to a training step timed right before and after the
call in the same child (a drifting machine load moves it less).  Also checks whether the
``lsuv`` and ``unit_scaling`` PyPI packages are importable (compared only if so; nothing is
installed).

    python bench/cost.py                     # ~6 minutes on one idle CPU thread
    python bench/cost.py --family resnet50   # one family
    python bench/cost.py --quick             # CI smoke run (small models, no ResNet)

Writes docs/results/cost[_TAG].json, .md (the table) and .png.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import os
import pickle
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
from results_io import write_text  # noqa: E402

import precondfx  # noqa: E402
from tests import zoo  # noqa: E402

MODES = {
    "none": dict(balance="none"),
    "analytic": dict(balance="analytic"),
    "auto": dict(balance="auto"),
    "hessian": dict(balance="hessian"),
    "auto+measure": dict(balance="auto", measure=True),
}


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def in_child(fn):
    """Run ``fn`` in a forked child (fresh memory high-water mark, same warmed-up imports) and
    return its (picklable) result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # child
        os.close(r)
        try:
            res = ("ok", fn())
        except BaseException as e:  # noqa: BLE001  (reported to the parent)
            res = ("err", f"{type(e).__name__}: {e}")
        with os.fdopen(w, "wb") as f:
            pickle.dump(res, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    status, val = pickle.loads(data)
    if status != "ok":
        raise RuntimeError(val)
    return val


#: where models, samples and training steps run (``--device``); children are forked before
#: CUDA is touched in the parent, so each child initializes its own context
DEVICE = "cpu"


def _sync() -> None:
    """Wait for queued GPU work, so that wall times include it."""
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def measured(fn):
    """(seconds, peak RSS above the start in MB or None, result) of one call."""
    gc.collect()
    ok = _reset_peak()
    rss0 = _status_kb("VmRSS")
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    dt = time.perf_counter() - t0
    peak = _status_kb("VmHWM") if ok else -1
    return dt, (peak - rss0) / 1024 if ok and peak >= 0 else None, out


def _labels(n: int, n_classes: int) -> torch.Tensor:
    return torch.randint(0, n_classes, (n,), generator=torch.Generator().manual_seed(0))


def classifier(model, x, n_classes):
    """(model, sample, loss of a training step, forward kwargs) of an image/vector classifier."""
    x, y = x.to(DEVICE), _labels(x.shape[0], n_classes).to(DEVICE)
    model = model.to(DEVICE)
    return model, x, (lambda m: F.cross_entropy(m(x), y)), {}


def _training(builder):
    """A fresh model from ``builder`` (seed 0, train mode) and its SGD-momentum training step,
    which returns the loss."""
    torch.manual_seed(0)
    model, _, loss_fn, _ = builder()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model)
        loss.backward()
        opt.step()
        return loss.item()
    return model, step


def train_step_cost(builder, steps, min_s=0.5):
    """In a fresh child: peak memory of the first training step (it allocates the gradients
    and momentum buffers, and the activations) above the built model + optimizer, then the
    median time of ``steps`` further steps (more, up to 50, until they took ``min_s``
    seconds)."""
    def child():
        model, step = _training(builder)
        _, mem, _ = measured(step)
        ts: list[float] = []
        while len(ts) < steps or (sum(ts) < min_s and len(ts) < 50):   # >= min_s of steps
            ts.append(measured(step)[0])
        return statistics.median(ts), mem, sum(p.numel() for p in model.parameters())
    return in_child(child)


def _one_step_time(builder):
    """The time of one training step (after a warm-up step) of a fresh copy of the model."""
    _, step = _training(builder)
    return [measured(step)[0] for _ in range(2)][-1]


def precondition_cost(builder, kw, repeats, around=False):
    """In a fresh child: wall time (median of ``repeats`` calls) and peak memory above the
    built model (first call) of ``precondition``; what measured balancing did (report
    section); with ``around``, every call is bracketed by training steps and the returned step
    time is the one that makes ``time / step`` the median over calls of each call's time over
    the mean of the steps right before and after it (on a shared machine whose load drifts,
    that is the ratio to quote)."""
    def child():
        times, mems, ratios, rep = [], [], [], None
        before = _one_step_time(builder) if around else None
        for r in range(repeats):
            torch.manual_seed(0)
            m, smp, _, fkw = builder()
            dt, mem, out = measured(lambda: precondfx.precondition(m, smp, seed=r, **kw, **fkw))
            times.append(dt)
            mems.append(mem)
            rep = out.report
            out = m = None
            if around:
                after = _one_step_time(builder)
                ratios.append(dt / ((before + after) / 2))
                before = after
        t = statistics.median(times)
        step = t / statistics.median(ratios) if around else None
        hd = rep.conditioning.get("hessian", {}) if isinstance(rep.conditioning, dict) else {}
        hd = hd if isinstance(hd, dict) else {}
        info = {k: hd.get(k) for k in ("engine", "samples", "stopped_early", "applied")}
        info["decision"] = hd.get("decision") or ("balanced" if hd.get("applied") else None)
        info["ratios"] = ratios
        return t, mems[0], step, info
    return in_child(child)


def gpt2(n_embd: int = 64, n_layer: int = 2, seq: int = 32, batch: int = 8, vocab: int = 1000):
    """A small GPT-2 (transformers config, no dropout) on random tokens; next-token loss."""
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=2, vocab_size=vocab,
                                  n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).to(DEVICE)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(DEVICE)

    def loss(m):
        logits = m(input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    return model, {"input_ids": ids}, loss, {"use_cache": False}


def models(quick: bool, families):
    """(family, name, builder -> (model, sample, loss_fn, forward kwargs), modes)."""
    all_modes = list(MODES)
    big = ["analytic", "auto", "hessian"]
    fam = set(families or ("mlp", "resnet50", "gpt2"))
    if quick:
        fam -= {"resnet50"}
    if "mlp" in fam:
        for w in ([32, 128] if quick else [32, 128, 512, 2048]):
            yield "mlp", f"MLP 256-{w}-{w}-10 (batch 64)", (
                lambda w=w: classifier(zoo.MLP(256, 10, (w, w)), torch.randn(64, 256), 10)), \
                all_modes
    if "conv" in fam:
        for d in ([32] if quick else [32, 8, 2]):
            yield "conv", f"strided AlexNet /{d} (32x32, batch 16)", (
                lambda d=d: classifier(*zoo.alexnet_strided(0, width_div=d, image=32,
                                                            batch=16), 10)), all_modes
    if "resnet50" in fam:
        for norm in (True, False):
            yield "resnet50", f"ResNet-50 {'BN' if norm else 'no norm'} (224x224, batch 8)", (
                lambda norm=norm: classifier(*zoo.resnet50(norm=norm, width=64,
                                                           layers=(3, 4, 6, 3), image=224,
                                                           batch=8), 1000)), big
    if "gpt2" in fam:
        try:
            import transformers
        except ImportError:
            return
        # resolve the lazy modeling module here, in the parent (warm, like the other imports):
        # otherwise every forked child imports it again before it builds the model (~3 s)
        transformers.GPT2LMHeadModel  # noqa: B018
        yield "gpt2", "GPT-2 tiny (64 wide, 2 layers, 32 tokens, batch 8)", gpt2, all_modes


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=3,
                    help="timed training steps (median; at least 0.5 s worth on small models)")
    ap.add_argument("--min-step-s", type=float, default=0.5,
                    help="time the training step until the timed steps took this many seconds "
                         "(at most 50 steps)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="precondition calls per (model, mode) on small models (median)")
    ap.add_argument("--big-repeats", type=int, default=2,
                    help="calls per (model, mode) on models whose step takes > 0.5 s, each "
                         "bracketed by training steps (median of the ratios)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=C.RESULTS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu",
                    help="where models and training steps run, e.g. cuda (ratios stay in "
                         "training steps on that device; peak memory columns are host RSS)")
    ap.add_argument("--family", action="append", choices=("mlp", "conv", "resnet50", "gpt2"),
                    help="only these model families (repeatable; default mlp, resnet50, gpt2)")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    C.setup(args.threads)
    tag = args.tag or ("quick" if args.quick else "")
    say = C.Progress("cost")
    peers = {}
    for pkg in ("lsuv", "unit_scaling"):
        try:
            importlib.import_module(pkg)
            peers[pkg] = "importable (not compared yet: no adapter written)"
        except Exception as e:
            peers[pkg] = f"not importable here ({type(e).__name__}): not compared, not installed"
        say(f"peer package {pkg}: {peers[pkg]}")
    # warm-up: first fx trace / export imports are one-off costs of the process
    m0, s0 = zoo.mlp(0, n_in=16, batch=8)
    precondfx.precondition(m0, s0, balance="hessian", measure=True)
    rows = []
    for family, name, builder, modes in models(args.quick, args.family):
        step_s, step_mb, n_params = train_step_cost(builder, args.steps, args.min_step_s)
        say(f"{name}: {n_params:,} params; training step {step_s * 1e3:.1f} ms, first-step peak +"
            f"{step_mb if step_mb is None else round(step_mb, 1)} MB")
        big = step_s > 0.5
        for mode in modes:
            t, mem, around, info = precondition_cost(
                builder, MODES[mode], args.big_repeats if big else args.repeats, around=big)
            each = info.pop("ratios")
            ratio = t / around if around else t / step_s
            row = {"family": family, "model": name, "params": n_params, "mode": mode,
                   "precondition_s": t, "step_s": step_s, "step_around_s": around,
                   "ratio_steps": ratio, "ratio_steps_median_step": t / step_s,
                   "ratio_steps_each_call": each,
                   "precondition_peak_mb": mem, "step_peak_mb": step_mb,
                   "mem_ratio": (mem / step_mb) if (mem is not None and step_mb) else None,
                   **{f"balance_{k}": v for k, v in info.items()}}
            rows.append(row)
            say(f"   {mode:13} {t:8.3f}s = {ratio:7.2f} steps; peak +"
                f"{mem if mem is None else round(mem, 1)} MB" +
                (f" (step timed around the call: {around:.2f} s)" if around else "") +
                (f"; {info['samples']} samples, {info['engine']}; {info['decision']}"
                 f"{'; ' + info['stopped_early'] if info['stopped_early'] else ''}"
                 if info.get("engine") else ""))
    _balancing_cost(rows)
    targets = _targets(rows)
    payload = {"rows": rows, "targets": targets, "peers": peers,
               "memory_method": "each measurement in a forked child (after the parent warmed up "
                                "the imports); peak RSS (VmHWM, reset via clear_refs=5) above "
                                "the RSS with the model and batch built, MB. Training step: the "
                                "first step (allocates grads, momentum, activations); "
                                "precondition: the first call (includes its copy of the model)",
               "time_method": "wall time in the child (small models: median of repeats); "
                              "training step = median of --steps steps after the first; models "
                              "whose step takes > 0.5 s: the median over --big-repeats calls of "
                              "the call's time over the mean of a step timed right before and "
                              "right after it in the same child; "
                              "balancing_steps = ratio(auto or hessian) - ratio(analytic)",
               "env": {**C.env_info(), "loadavg_1min_end": os.getloadavg()[0]},
               "wall_s": say.elapsed()}
    name = "cost" + (f"_{tag}" if tag else "")
    jpath = C.write_json(os.path.join(args.out, name + ".json"), payload)
    try:
        plot(rows, os.path.join(args.out, name + ".png"))
    except Exception as e:
        say(f"plot skipped: {e}")
    table = markdown(rows, targets)
    print("\n" + table)
    mpath = os.path.join(args.out, name + ".md")
    write_text(mpath, _document(table, payload, argv))
    say(f"wrote {jpath} and {mpath}")
    return payload


def _balancing_cost(rows: list[dict]) -> None:
    """``balancing_steps``: what measured balancing adds, in training steps (the auto/hessian
    ratio minus the analytic one of the same model)."""
    ref = {r["model"]: r["ratio_steps"] for r in rows if r["mode"] == "analytic"}
    for r in rows:
        base = ref.get(r["model"])
        r["balancing_steps"] = (r["ratio_steps"] - base if base is not None and r["mode"] in
                                ("auto", "hessian", "auto+measure") else None)
        r["x_analytic"] = r["ratio_steps"] / base if base else None


def _targets(rows: list[dict]) -> dict:
    """Issue 14: measured balancing on ResNet-50 <= 5 training steps; auto <= 2x analytic on
    the small MLPs."""
    targets = {}
    for r in rows:
        if r["family"] == "resnet50" and r["mode"] in ("auto", "hessian"):
            targets[f"{r['model']} {r['mode']}: balancing steps"] = {
                "value": r["balancing_steps"], "target": 5.0,
                "met": r["balancing_steps"] is not None and r["balancing_steps"] <= 5.0}
        if r["family"] == "mlp" and r["mode"] == "auto":
            targets[f"{r['model']} auto / analytic"] = {
                "value": r["x_analytic"], "target": 2.0,
                "met": r["x_analytic"] is not None and r["x_analytic"] <= 2.0}
    return targets


def markdown(rows: list[dict], targets: dict) -> str:
    """The result table (cells in training steps of the same model) and the targets."""
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    out = ["| model | params | step (s) | " + " | ".join(modes) +
           " | balancing: auto | balancing: hessian | samples auto / hessian |",
           "|---|---|---|" + "---|" * (len(modes) + 3)]
    for name in dict.fromkeys(r["model"] for r in rows):
        rr = {r["mode"]: r for r in rows if r["model"] == name}
        r0 = next(iter(rr.values()))
        step = r0["step_s"] if r0["step_around_s"] is None else statistics.mean(
            r["step_around_s"] for r in rr.values())
        cells = [f"{rr[m]['ratio_steps']:.2f}" if m in rr else "-" for m in modes]
        bal = [f"{rr[m]['balancing_steps']:.2f}" if m in rr and rr[m]["balancing_steps"]
               is not None else "-" for m in ("auto", "hessian")]
        smp = " / ".join(str(rr[m].get("balance_samples") or "-") if m in rr else "-"
                         for m in ("auto", "hessian"))
        out.append(f"| {name} | {r0['params']:,} | {step:.3g} | " + " | ".join(cells) + " | "
                   + " | ".join(bal) + f" | {smp} |")
    out.append("")
    for k, v in targets.items():
        val = "n/a" if v["value"] is None else f"{v['value']:.2f}"
        out.append(f"- target {k}: {val} (<= {v['target']:g}): "
                   f"{'met' if v['met'] else '**not met**'}")
    return "\n".join(out)


def _document(table: str, payload: dict, argv) -> str:
    argv = sys.argv[1:] if argv is None else argv
    cmd = "python bench/cost.py" + ("" if not argv else " " + " ".join(argv))
    env = payload["env"]
    dec = []
    for r in payload["rows"]:
        if r["mode"] in ("auto", "hessian") and r.get("balance_engine"):
            dec.append(f"- {r['model']}, {r['mode']}: {r['balance_samples']} samples "
                       f"({r['balance_engine']}); "
                       + "; ".join(x for x in (r.get("balance_decision"),
                                               r.get("balance_stopped_early")) if x))
    return (
        "# What does `precondition` cost, in training steps of the same model?\n\n"
        f"Written by `{cmd}` (torch {env['torch']}, {env['threads']} thread(s), "
        f"{env['cpu_count']} CPUs, {env['device']}; load average {env['loadavg_1min_end']:.1f} "
        f"at the end: the machine may be shared, compare ratios within one run).\n\n"
        "Each cell is the wall time of `precondfx.precondition(model, sample, **mode)` divided "
        "by one training step of the same model on the same batch (SGD momentum 0.9; median of "
        "steps after a warm-up; for models whose step takes over 0.5 s, the median over "
        "calls of each call over the steps timed right before and after it in the same "
        "process). `balancing` = the auto/hessian cell "
        "minus the analytic one: what measured balancing itself costs.\n\n"
        + table + "\n\nWhat measured balancing did:\n\n" + "\n".join(dec) + "\n\n"
        "Peak memory above start (MB, precondition / first training step) and every field: "
        "the `.json` next to this file.\n")




def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    fams = list(dict.fromkeys(r["family"] for r in rows))
    marks = {"mlp": "o-", "conv": "s--", "resnet50": "^", "gpt2": "D"}
    for j, mode in enumerate(MODES):
        for fam in fams:
            rr = [r for r in rows if r["family"] == fam and r["mode"] == mode]
            if not rr:
                continue
            lab = mode if fam == fams[0] else None
            axes[0].plot([r["params"] for r in rr], [r["ratio_steps"] for r in rr],
                         marks.get(fam, "o-"), color=f"C{j}", label=lab)
            if all(r["mem_ratio"] is not None for r in rr):
                axes[1].plot([r["params"] for r in rr], [r["precondition_peak_mb"] for r in rr],
                             marks.get(fam, "o-"), color=f"C{j}", label=lab)
    for fam in fams:
        rr = [r for r in rows if r["family"] == fam and r["mode"] == "analytic"]
        axes[1].plot([r["params"] for r in rr], [r["step_peak_mb"] for r in rr],
                     marks.get(fam, "o-"), color="k", lw=0.8,
                     label="training step" if fam == fams[0] else None)
    axes[0].axhline(2, color="gray", ls=":", lw=0.8)
    axes[0].axhline(10, color="gray", ls=":", lw=0.8)
    for ax in axes:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters (o MLP, s AlexNet, ^ ResNet-50, D GPT-2)")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("precondition time / one training step")
    axes[1].set_ylabel("peak RSS above start (MB)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
