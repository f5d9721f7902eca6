"""What does the result being the user's class cost in training? (issue 21, item 1)

For each model, the training-step time (zero_grad, forward, cross-entropy, backward, SGD step;
one thread, CPU; the process's CPU time, ``time.process_time``, so that time the shared machine
gives to other processes does not count) of

* ``user``: the user's model as built (the reference);
* ``result``: ``precondfx.precondition(model, sample, maxpool="keep")``: a GraphModule of the
  user's class (fx capture), or the user's module with hooks (eager);
* ``plain_gm`` (fx only): the same graph as a plain ``torch.fx.GraphModule``, i.e. what
  ``precondition`` returned before the result became the user's class;
* ``folded``: ``precondfx.fold(result)``, a plain model of the user's class;
* ``products``: the result with every constant multiplying activations (the form every stage
  of the pass works on, and what ``precondition`` returned before the constants went onto the
  layers' weights, ``apply.weight_side``): the same function and gradients;

eager and under ``torch.compile`` (each variant compiled once, warmed up, then timed).  The
variants are timed interleaved, ``--rounds`` rounds of ``--steps`` steps each, and each ratio is
the median over rounds of (variant's median step / user's median step in the same round), so a
drifting machine load moves it less.  ``maxpool="keep"`` so that the result computes the same
layers as the user's model (the default replaces the stem's max-pool by a strided convolution,
a different computation) and folds.

Targets: result / user at most 1.05 eager and 1.02 compiled; folded / user 1.00.

    python bench/user_class_cost.py            # ~10 minutes on one idle CPU thread
    python bench/user_class_cost.py --quick    # smoke run (small models, few steps)

Writes docs/results/user_class_cost[_quick].md and .json.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
from results_io import write_table  # noqa: E402

import precondfx  # noqa: E402
from tests.user_models import TimmResNet  # noqa: E402

TARGET = {"eager": 1.05, "compiled": 1.02}


def _resnet(norm: bool, quick: bool) -> Callable[[], tuple[Any, Any, Callable]]:
    def make() -> tuple[Any, Any, Callable]:
        torch.manual_seed(0)
        if quick:
            m = TimmResNet(norm=norm, widths=(8, 16), blocks=(1, 1))
            x = torch.randn(8, 3, 16, 16)
        else:
            m = TimmResNet(norm=norm, widths=(16, 32, 64, 128), blocks=(2, 2, 2, 2))
            x = torch.randn(16, 3, 32, 32)
        y = torch.arange(x.shape[0]) % 10
        return m, x, lambda mod: F.cross_entropy(mod(x), y)
    return make


def _gpt2(quick: bool) -> Callable[[], tuple[Any, Any, Callable]]:
    def make() -> tuple[Any, Any, Callable]:
        import transformers as tf
        torch.manual_seed(0)
        cfg = tf.GPT2Config(n_embd=32 if quick else 128, n_layer=2 if quick else 4, n_head=2,
                            vocab_size=97, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0)
        m = tf.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, 97, (8, 16 if quick else 48))
        return m, {"input_ids": ids}, lambda mod: mod(input_ids=ids, labels=ids,
                                                      use_cache=False).loss
    return make


def plain_graph_module(result: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The result's graph as a plain GraphModule (the old result)."""
    g = copy.deepcopy(result)
    return torch.fx.GraphModule(g, g.graph)


def products_form(result: torch.nn.Module) -> torch.nn.Module:
    """A copy of the result computing with the constants on the activations (fx: the graph's
    ``layer`` calls back to module calls and products; eager: the layers' weight-side
    forwards removed, so the scale hooks multiply the activations)."""
    from precondfx.pytorch.apply import weight_side
    g = copy.deepcopy(result)
    if isinstance(g, torch.fx.GraphModule):
        weight_side.to_module_calls(g.graph)
        g.recompile()
    else:
        for m in g.modules():
            m.__dict__.pop("forward", None)
    return g


# Dynamo does not guard on module hooks by default: the variants share their classes' code
# objects, so a hook-carrying variant (the eager back end's constants are hooks) compiled
# after a hook-free one of the same class would run the hook-free graph (silently: wrong
# outputs, and the user's speed).  Guarding on hooks keeps each variant's own graph.
torch._dynamo.config.skip_nnmodule_hook_guards = False


def _step_fn(model: torch.nn.Module, loss_of: Callable, compiled: bool) -> Callable[[], None]:
    run = torch.compile(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(run).backward()
        opt.step()
    return step


def measure(name: str, make: Callable, rounds: int, steps: int, say: Callable) -> dict:
    model, sample, loss_of = make()
    result, rep = precondfx.precondition(model, sample, maxpool="keep",
                                         **({"use_cache": False} if "gpt2" in name else {}))
    variants = {"user": model, "result": result}
    if isinstance(result, torch.fx.GraphModule):
        variants["plain_gm"] = plain_graph_module(result)
    variants["folded"] = precondfx.fold(result)
    variants["products"] = products_form(result)
    for v in variants.values():
        v.train()
    row: dict[str, Any] = {"model": name, "capture": rep.capture,
                           "result_class": type(result).__mro__[1].__name__
                           if isinstance(result, torch.fx.GraphModule) else
                           type(result).__name__,
                           "is_user_class": isinstance(result, type(model)),
                           "forward_only": len(rep.result["forward_only"]),
                           "params": sum(p.numel() for p in model.parameters())}
    for mode in ("eager", "compiled"):
        fns = {k: _step_fn(v, loss_of, mode == "compiled") for k, v in variants.items()}
        for f in fns.values():        # warm-up (compilation)
            for _ in range(3):
                f()
        per: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(rounds):
            for k, f in fns.items():
                ts = []
                for _ in range(steps):
                    t = time.process_time()
                    f()
                    ts.append(time.process_time() - t)
                per[k].append(statistics.median(ts))
        base = per["user"]
        row[f"{mode}_step_ms"] = {k: 1e3 * statistics.median(v) for k, v in per.items()}
        ratios = {k: sorted(a / b for a, b in zip(v, base)) for k, v in per.items()
                  if k != "user"}
        row[mode] = {k: statistics.median(r) for k, r in ratios.items()}
        # the spread over rounds (a shared machine's load moves single rounds)
        row[f"{mode}_quartiles"] = {k: statistics.quantiles(r, n=4)[::2] if len(r) > 1
                                    else [r[0], r[0]] for k, r in ratios.items()}
        say(f"{name} {mode}: " + ", ".join(f"{k} {r:.3f}" for k, r in row[mode].items()))
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--models", default="resnet_bn,resnet_nf,gpt2")
    args = ap.parse_args(argv)
    C.setup(1)
    rounds = args.rounds or (2 if args.quick else 5)
    steps = args.steps or (3 if args.quick else 8)
    say = C.Progress("user_class_cost")
    makers = {"resnet_bn": _resnet(True, args.quick), "resnet_nf": _resnet(False, args.quick),
              "gpt2": _gpt2(args.quick)}
    rows = [measure(n, makers[n], rounds, steps, say) for n in args.models.split(",")]
    lines = ["# Training-step time of the result against the user's model (CPU time, 1 thread)", "",
             f"Median over {rounds} interleaved rounds of the per-round ratio (each round: "
             f"median of {steps} steps per variant). Targets: result/user <= "
             f"{TARGET['eager']} eager, <= {TARGET['compiled']} compiled; folded/user = 1.",
             "`plain_gm`: the same graph as a plain GraphModule (the result before it became "
             "the user's class). `products`: the result with its constants multiplying "
             "activations (before they went onto the layers' weights; same function and "
             "gradients). In brackets: the quartiles of the per-round ratios (the spread a "
             "shared machine's load gives; `plain_gm` runs the result's own graph).", "",
             "| model | capture | result class | user step ms (eager / compiled) | mode | "
             "result/user | products/user | plain_gm/user | folded/user | target met |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for mode in ("eager", "compiled"):
            rr = r[mode]
            ok = rr["result"] <= TARGET[mode]
            pg = f"{rr['plain_gm']:.3f}" if "plain_gm" in rr else "-"
            q = r[f"{mode}_quartiles"]["result"]
            lines.append(f"| {r['model']} | {r['capture']} | {r['result_class']} | "
                         f"{r['eager_step_ms']['user']:.1f} / {r['compiled_step_ms']['user']:.1f}"
                         f" | {mode} | {rr['result']:.3f} ({q[0]:.3f}-{q[1]:.3f}) | "
                         f"{rr['products']:.3f} | {pg} | {rr['folded']:.3f} | "
                         f"{'yes' if ok else 'NO'} |")
    lines += ["", f"Environment: {C.env_info()}",
              "Reproduce: `python bench/user_class_cost.py" + (" --quick" if args.quick else "")
              + "`"]
    out = os.path.join(C.RESULTS, "user_class_cost" + ("_quick" if args.quick else ""))
    write_table(out, lines, {"rows": C.clean(rows), "env": C.env_info(), "rounds": rounds,
                             "steps": steps, "targets": TARGET})


if __name__ == "__main__":
    main()
