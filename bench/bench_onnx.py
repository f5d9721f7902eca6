"""Time ``precondfx.onnx.precondition_onnx`` on a ResNet-50-sized ONNX model.

The model is ``tests/zoo.py: resnet50(norm=True, width=64, layers=(3, 4, 6, 3),
num_classes=1000)`` (25.56 M parameters), exported once with ``torch.onnx.export`` (dynamo
exporter, dynamic batch; BatchNorm is folded into the convolutions by the exporter) into a cache
folder, then preconditioned with a batch-8 224x224 calibration batch.  The script prints the
per-stage timings (median over ``--repeat`` runs) and writes them to
``docs/results/bench_onnx.json``.

    python bench/bench_onnx.py              # ResNet-50, 3 runs
    python bench/bench_onnx.py --quick      # tiny model, for CI smoke runs
    python bench/bench_onnx.py --legacy     # export with the TorchScript exporter instead

The export is not timed (it is the user's step); importing precondfx is reported separately.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

t_import = time.perf_counter()
import numpy as np  # noqa: E402
import onnxruntime  # noqa: E402
import torch  # noqa: E402

import precondfx  # noqa: E402
from tests import zoo  # noqa: E402
from precondfx.onnx import STAGES, precondition_onnx  # noqa: E402
IMPORT_S = time.perf_counter() - t_import

TARGET_S = 3.0


def export(path: str, quick: bool, legacy: bool) -> tuple[int, float]:
    """Export the benchmark model to ``path``; returns (parameter count, seconds)."""
    if quick:
        model, _ = zoo.resnet50(norm=True, width=8, layers=(1, 1, 1, 1), num_classes=10,
                                image=32)
        shape = (2, 3, 32, 32)
    else:
        model, _ = zoo.resnet50(norm=True, width=64, layers=(3, 4, 6, 3), num_classes=1000)
        shape = (2, 3, 224, 224)
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    x = torch.randn(*shape)
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if legacy:
            torch.onnx.export(model, (x,), path, dynamo=False, input_names=["x"],
                              output_names=["logits"], dynamic_axes={"x": {0: "batch"},
                                                                      "logits": {0: "batch"}})
        else:
            batch = torch.export.Dim("batch", min=1, max=1024)
            torch.onnx.export(model, (x,), path, dynamo=True, dynamic_shapes=({0: batch},),
                              verbose=False)
    return n, time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model (CI smoke run)")
    ap.add_argument("--legacy", action="store_true", help="TorchScript exporter (dynamo=False)")
    ap.add_argument("--repeat", type=int, default=None, help="runs (default 3, 1 with --quick)")
    ap.add_argument("--batch", type=int, default=8, help="calibration batch (default 8)")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "precondfx-bench"),
                    help="folder for the exported model (reused when present)")
    ap.add_argument("--fresh", action="store_true", help="re-export even if cached")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "bench_onnx.json"),
                    help="JSON results file ('-' to skip)")
    args = ap.parse_args(argv)
    repeat = args.repeat or (1 if args.quick else 3)
    os.makedirs(args.cache, exist_ok=True)
    tag = ("tiny" if args.quick else "resnet50") + ("_legacy" if args.legacy else "_dynamo")
    src = os.path.join(args.cache, f"{tag}.onnx")
    if args.fresh or not os.path.exists(src):
        n_params, export_s = export(src, args.quick, args.legacy)
        print(f"exported {tag} ({n_params / 1e6:.2f} M params) in {export_s:.1f} s -> {src}",
              file=sys.stderr)
    else:
        n_params, export_s = None, None
    image = 32 if args.quick else 224
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((args.batch, 3, image, image), dtype=np.float32)}
    runs = []
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory(dir=args.cache) as tmp:
        out = os.path.join(tmp, "out.onnx")
        for _ in range(repeat):
            rep = precondition_onnx(src, out, feeds=feed, seed=0)
            runs.append(dict(rep.stage_seconds))
        out_bytes = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
    stages = [s for s in STAGES if any(s in r for r in runs)] + ["total"]
    med = {s: statistics.median(r.get(s, 0.0) for r in runs) for s in stages}
    if n_params is None:
        import onnx_ir as ir
        m = ir.load(src)
        n_params = sum(int(np.prod(v.shape)) for v in m.graph.initializers.values()
                       if v.shape is not None and len(v.shape) > 0)
    print(f"\nprecondition_onnx on {tag}: {n_params / 1e6:.2f} M weights, calibration batch "
          f"{args.batch}x3x{image}x{image}, median of {repeat} run(s)")
    print(f"{'stage':12} {'seconds':>9}")
    print("-" * 22)
    for s in stages:
        print(f"{s:12} {med[s]:9.3f}")
    print(f"(import of precondfx + torch + onnxruntime: {IMPORT_S:.2f} s, not included; "
          f"1-min load average before the runs: {load_before}, {os.cpu_count()} CPUs)")
    if not args.quick:
        verdict = "under" if med["total"] < TARGET_S else "OVER"
        print(f"target {TARGET_S:.1f} s: {verdict} ({med['total']:.2f} s)")
    result = {
        "model": tag, "weights": n_params, "calibration_batch": [args.batch, 3, image, image],
        "repeat": repeat, "median_seconds": med, "runs": runs, "import_seconds": IMPORT_S,
        "export_seconds": export_s, "output_bytes": out_bytes, "target_seconds": TARGET_S,
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "cpus": os.cpu_count(), "load_average_1min": load_before,
                    "torch": torch.__version__,
                    "onnxruntime": onnxruntime.__version__,
                    "precondfx": precondfx.__version__},
    }
    if args.out != "-":
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        if args.quick and args.out.endswith("bench_onnx.json"):
            args.out = args.out[: -len(".json")] + "_quick.json"
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
