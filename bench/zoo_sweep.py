"""Breadth sweep over real-world model zoos (run where torchvision / timm import, e.g. a GPU box).

For every torchvision classification / segmentation model and a representative of every timm
family (the smallest-named variant), built without pretrained weights: ``precondition`` with
the defaults on one batch, then the checks a user relies on, each a number that can fail:

- the output std after calibration against the report's target (ratio, 1 = on target);
- the user's model is untouched (largest change of any parameter or buffer, must be 0);
- the result is the user's class where the model could be traced, and every parameter of
  the result is reachable from ``parameters()`` (an optimizer built from it sees them all);
- one SGD step on the result gives a finite loss and finite gradients on every parameter
  that took part;
- the report's coverage (``unknown`` ops by target) and the capture method.

Each model runs in a worker process under a time limit; rows stream to ``OUT/zoo_sweep.jsonl``
so a run stopped at its deadline keeps what it measured.

    python bench/zoo_sweep.py --out results_dir --workers 12 --deadline 420
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import re
import signal
import sys
import time
import traceback

SMALL = ("atto", "femto", "pico", "nano", "tiny", "xxs", "xs", "small", "mini", "lite",
         "b0", "18", "_s", "050", "075", "100")


def _timm_names(per_family: int) -> list[str]:
    import timm
    fams: dict[str, list[str]] = {}
    for n in timm.list_models():
        fam = re.split(r"[_\d]", n, maxsplit=1)[0] or n
        fams.setdefault(fam, []).append(n)
    out = []
    for fam, names in sorted(fams.items()):
        names.sort(key=lambda n: (not any(s in n for s in SMALL), len(n), n))
        out += names[:per_family]
    return out


def _tv_names() -> list[str]:
    import torchvision.models as tvm
    names = [f"tv:{n}" for n in tvm.list_models(module=tvm)]
    try:
        names += [f"tvseg:{n}" for n in tvm.list_models(module=tvm.segmentation)]
    except Exception:
        pass
    return names


def _build(name: str):
    """(model, sample) for a zoo name; small batch, the model's own input size capped at 224."""
    import torch
    if name.startswith("zoo:"):              # the tests' own zoo (plain PyTorch, runs anywhere)
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests import zoo
        return zoo.build(name.split(":", 1)[1])
    if name.startswith("tv:") or name.startswith("tvseg:"):
        import torchvision.models as tvm
        mod = tvm if name.startswith("tv:") else tvm.segmentation
        n = name.split(":", 1)[1]
        kw = {}
        if n in ("googlenet", "inception_v3"):
            kw = {"aux_logits": False, "init_weights": True}
        if name.startswith("tvseg:"):
            kw = {"weights_backbone": None, "aux_loss": False} if "lraspp" not in n else \
                {"weights_backbone": None}
        model = tvm.get_model(n, weights=None, **kw) if mod is tvm else \
            getattr(mod, n)(weights=None, **kw)
        hw = 299 if n == "inception_v3" else 224
        return model, torch.randn(4, 3, hw, hw)
    import timm
    n = name.split(":", 1)[1]
    model = timm.create_model(n, pretrained=False)
    c, h, w = model.pretrained_cfg.get("input_size", (3, 224, 224))
    fixed = model.pretrained_cfg.get("fixed_input_size", False)
    if not fixed:
        h, w = min(h, 224), min(w, 224)
    return model, torch.randn(4, c, h, w)


def _first_tensor(out):
    import torch
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    for o in out:
        t = _first_tensor(o)
        if t is not None:
            return t
    return None


def report_row(rep) -> dict:
    """What a sweep row keeps of a report: capture and its notes (why a capture method was
    passed over), output std against the target, the op counts and the ops the table does not
    know (by target)."""
    row = {"capture": rep.capture, "capture_notes": [n[:300] for n in rep.capture_notes],
           "std_after": rep.output_std_after, "target_std": rep.target_std,
           "counts": rep.counts()}
    if rep.output_std_after and rep.target_std:
        row["std_ratio"] = rep.output_std_after / rep.target_std
    unk: dict[str, int] = {}
    for r in rep.nodes:
        if r.status == "unknown":
            unk[r.target] = unk.get(r.target, 0) + 1
    row["unknown_targets"] = unk
    return row


def _to(x, dev: str):
    import torch
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    if isinstance(x, dict):
        return {k: _to(v, dev) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, dev) for v in x)
    return x


def _call(model, x):
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, tuple):
        return model(*x)
    return model(x)


def check(name: str, dev: str) -> dict:
    """Precondition one zoo model and measure what the module docstring lists."""
    import torch
    import precondfx
    row: dict = {"model": name}
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, x = _build(name)
    model = model.to(dev)
    x = _to(x, dev)
    row["params_M"] = sum(p.numel() for p in model.parameters()) / 1e6
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    row["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        pm, rep = precondfx.precondition(model, x)
    except precondfx.PrecondError as e:          # a refusal with a reason: report it
        row["refused"] = str(e)[:400]
        return row
    if dev == "cuda":
        torch.cuda.synchronize()
    row["seconds"] = time.perf_counter() - t0
    row.update(report_row(rep))
    row["skipped"] = [list(s) for s in rep.skipped][:20]
    after = model.state_dict()
    row["user_model_max_change"] = max(
        (float((after[k].double() - v.double()).abs().max()) if v.is_floating_point() else
         float((after[k] != v).any()) for k, v in before.items() if v.numel()), default=0.0)
    row["same_class"] = isinstance(pm, type(model))
    named = dict(pm.named_parameters())
    row["n_params"] = len(named)
    pm.train()
    out = _first_tensor(_call(pm, x))
    y = torch.randn_like(out)
    loss = ((out.float() - y) ** 2).mean()
    pm.zero_grad(set_to_none=True)
    loss.backward()
    row["loss"] = float(loss)
    bad = [k for k, p in named.items() if p.grad is not None and not torch.isfinite(p.grad).all()]
    row["nonfinite_grads"] = bad[:10]
    row["params_with_grad"] = sum(p.grad is not None for p in named.values())
    return row


def _worker(q_in, q_out, dev: str, per_model_s: int) -> None:
    import torch
    torch.set_num_threads(1)

    def _alarm(*_):
        raise TimeoutError(f"over {per_model_s} s")

    signal.signal(signal.SIGALRM, _alarm)
    while True:
        try:
            name = q_in.get_nowait()
        except queue.Empty:
            return
        signal.alarm(per_model_s)
        try:
            row = check(name, dev)
        except BaseException as e:  # noqa: BLE001 - report and go on
            row = {"model": name, "error": f"{type(e).__name__}: {str(e)[:400]}",
                   "trace": traceback.format_exc()[-2500:]}
        finally:
            signal.alarm(0)
        try:
            import torch
            if dev == "cuda":
                torch.cuda.empty_cache()
        except Exception:
            pass
        q_out.put(row)


def flags(row: dict) -> list[str]:
    """What a row says went wrong (empty: every check held)."""
    out = []
    if "error" in row:
        out.append(row["error"].splitlines()[0][:160])
    if "refused" in row:
        out.append("refused: " + row["refused"][:160])
    if row.get("user_model_max_change"):
        out.append(f"user's model changed by {row['user_model_max_change']:.3g}")
    if "std_ratio" in row and abs(row["std_ratio"] - 1) > 0.01:
        out.append(f"output std {row['std_ratio']:.3f} x target")
    if row.get("nonfinite_grads"):
        out.append("non-finite gradients: " + ", ".join(row["nonfinite_grads"][:3]))
    if row.get("same_class") is False:
        out.append("not the user's class")
    if row.get("unknown_targets"):
        out.append("ops not in the table: " + ", ".join(f"{k} x{v}" for k, v in
                                                         row["unknown_targets"].items()))
    return out


def summarize(path: str) -> str:
    """A markdown summary of a sweep's rows: counts, then every model with a flag."""
    rows = [json.loads(line) for line in open(path)]
    bad = [(r["model"], flags(r)) for r in rows if flags(r)]
    caps: dict[str, int] = {}
    for r in rows:
        caps[r.get("capture", "-")] = caps.get(r.get("capture", "-"), 0) + 1
    lines = [f"{len(rows)} models; every check held on {len(rows) - len(bad)}; captures: "
             + ", ".join(f"{k} {v}" for k, v in sorted(caps.items())), "",
             "| model | what the checks say |", "|---|---|"]
    lines += [f"| {m} | {'; '.join(f)} |" for m, f in bad]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--deadline", type=float, default=420, help="seconds for the whole sweep")
    ap.add_argument("--per-model", type=int, default=90)
    ap.add_argument("--per-family", type=int, default=1, help="timm models per family")
    ap.add_argument("--only", default="", help="comma list of names (tv:..., timm:...)")
    ap.add_argument("--zoo", action="store_true", help="the tests' zoo (runs anywhere)")
    ap.add_argument("--summarize", default="", metavar="JSONL", help="print a sweep's summary")
    args = ap.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize), end="")
        return
    import torch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.only:
        names = args.only.split(",")
    elif args.zoo:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests import zoo
        names = [f"zoo:{n}" for n in zoo.names()]
    else:
        names = []
        try:
            names += _tv_names()
        except ImportError as e:
            print("torchvision not importable:", e)
        try:
            names += [f"timm:{n}" for n in _timm_names(args.per_family)]
        except ImportError as e:
            print("timm not importable:", e)
    print(f"{len(names)} models, {args.workers} workers, device {dev}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "zoo_sweep.jsonl")
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    for n in names:
        q_in.put(n)
    procs = [ctx.Process(target=_worker, args=(q_in, q_out, dev, args.per_model), daemon=True)
             for _ in range(args.workers)]
    for p in procs:
        p.start()
    t_end = time.time() + args.deadline
    done = 0
    with open(path, "w") as f:
        while done < len(names) and time.time() < t_end:
            try:
                row = q_out.get(timeout=5)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            done += 1
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            print(json.dumps({k: v for k, v in row.items()
                              if k in ("model", "error", "refused", "std_ratio", "seconds",
                                       "user_model_max_change", "same_class")},
                             default=str)[:300], flush=True)
    for p in procs:
        p.kill()
    print(f"done {done} of {len(names)}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
