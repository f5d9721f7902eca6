"""GPU check (run on a machine with CUDA): precondition real-world architectures on the GPU.

For every torchvision / timm / transformers model that is importable there (built without
pretrained weights), on CUDA: the capture method, time, output std after calibration, whether
every parameter and buffer stayed on the GPU in its dtype, one training step, and the report's
coverage.  Then the cost of each balance mode on the bottleneck ResNet-50 at 224x224, batch 8,
as a ratio to one training step measured in the same run.

    PYTHONPATH=. python bench/gpu_check.py --out results_dir
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

import precondfx
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import zoo  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_sweep import report_row  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _models():
    try:
        import torchvision.models as tvm
        for name in ("resnet50", "vgg11_bn", "mobilenet_v3_small", "efficientnet_b0",
                     "densenet121", "convnext_tiny", "regnet_y_400mf", "vit_b_16", "swin_t",
                     "googlenet", "shufflenet_v2_x1_0", "squeezenet1_0"):
            kw = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
            yield f"torchvision.{name}", (lambda n=name, kw=kw: getattr(tvm, n)(weights=None,
                                                                               **kw)), (3, 224)
    except ImportError as e:
        print("torchvision not importable:", e)
    try:
        import timm
        for name in ("resnet18", "vit_tiny_patch16_224", "convnext_nano", "efficientnet_b0",
                     "mixer_s16_224", "deit_tiny_patch16_224", "regnetx_002"):
            yield f"timm.{name}", (lambda n=name: timm.create_model(n, pretrained=False)), (3, 224)
    except ImportError as e:
        print("timm not importable:", e)


def check_models(dev: str) -> list[dict]:
    rows = []
    for label, build, (c, hw) in _models():
        row: dict = {"model": label}
        try:
            torch.manual_seed(0)
            model = build().to(dev)
            x = torch.randn(8, c, hw, hw, device=dev)
            _sync()
            t0 = time.perf_counter()
            pm, rep = precondfx.precondition(model, x)
            _sync()
            row["seconds"] = time.perf_counter() - t0
            row.update(report_row(rep))
            row["skipped"] = len(rep.skipped)
            row["balance"] = rep.conditioning.get("hessian", {}).get("decision") or \
                rep.conditioning.get("hessian", {}).get("spread")
            row["on_device"] = all(t.device.type == "cuda" for t in
                                   list(pm.parameters()) + list(pm.buffers()))
            opt = torch.optim.SGD(pm.parameters(), lr=0.01)
            out = pm(x)
            out = out if isinstance(out, torch.Tensor) else out[0]
            loss = torch.nn.functional.cross_entropy(out, torch.randint(0, out.shape[-1], (8,),
                                                                        device=dev))
            loss.backward()
            opt.step()
            row["train_step_loss"] = float(loss)
        except Exception as e:  # report, keep going
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row["trace"] = traceback.format_exc()[-1500:]
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
        rows.append(row)
    return rows


def cost(dev: str) -> list[dict]:
    rows = []
    for norm in (False, True):
        model, x = zoo.resnet50(norm=norm, width=64, layers=(3, 4, 6, 3), image=224, batch=8,
                                num_classes=1000)
        model, x = model.to(dev), x.to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        y = torch.randint(0, 1000, (8,), device=dev)

        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        for _ in range(3):
            step()
        _sync()
        t0 = time.perf_counter()
        for _ in range(10):
            step()
        _sync()
        t_step = (time.perf_counter() - t0) / 10
        for mode in ("none", "analytic", "auto", "hessian"):
            _sync()
            t0 = time.perf_counter()
            try:
                _, rep = precondfx.precondition(model, x, balance=mode)
                h = rep.conditioning.get("hessian", {})
                info = {"heldout_spread": h.get("spread"), "decision": h.get("decision"),
                        "spread_before": h.get("spread_before")}
            except precondfx.PrecondError as e:
                info = {"error": str(e)[:300]}
            _sync()
            t = time.perf_counter() - t0
            r = {"model": f"resnet50 norm={norm}", "balance": mode, "seconds": t,
                 "train_step_s": t_step, "ratio": t / t_step, **info}
            print(json.dumps(r), flush=True)
            rows.append(r)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/results")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print("device", dev, torch.__version__, flush=True)
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if dev == "cuda"
           else "cpu", "cost": cost(dev), "models": check_models(dev)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(res, f, indent=2, default=str)


if __name__ == "__main__":
    main()
