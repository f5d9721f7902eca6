"""Training suite (issue 11): does a preconditioned start train better, at each method's best
learning rate, with SGD (momentum 0.9) and with AdamW?

For every task and optimizer, each method's learning rate is swept over a grid of powers of two
(at least 8 rates, 2x apart); the grid is widened by two rates on a side whenever a method's best
rate (median over seeds) sits at that edge.  What users judge is held-out data: every
classification task (but the LIBSVM sets, which keep the paper's training-loss protocol) has a
training, a validation and a test split, and the LM a validation and a test set of files.  Each
method's rate is the one with the lowest median *validation* loss; the reported figure is the
*test* loss (and accuracy) at that rate, the median over >= 3 seeds with its standard error.
Each method's test loss is also reported at the framework default's chosen rate (the rate a
pipeline tuned for the default init uses; every grid is extended to reach it).  Within a family (MLPs or plain CNNs of several
widths, or of several depths) the best rate's movement is reported in octaves (log2), both on
the grid and from a parabola through the best rate and its neighbours.

Tasks (``--tasks``, comma list of names or family prefixes; ``--list`` prints them):

* ``libsvm/<set>``: the paper's MLP (LayerNorm, 384-64) on bench/libsvm_study.py's 27 sets;
  5 epochs, batch 32; loss = final full training-set cross-entropy (the paper's metric).
* ``mlp_w<W>_d<D>``: digits (64 pixels in [-1, 1], 1197 train / 300 validation / 300 test), D
  hidden ReLU layers of width W; 3 epochs, batch 32.  Families: widths 32..2048 at depth 2,
  depths 1..16 at width 256.  Training-set loss recorded too.
* ``cnn_w<W>_d<D>``: plain CNN (D 3x3 convolutions of width W, ReLU, global average pool,
  linear) on the 8x8 digits; families as for the MLP.
* ``conv_bn`` / ``conv_nobn``: a 5-convolution strided net on 16x16 digits with / without
  BatchNorm.  ``nf_resnet``: a normalization-free ResNet (basic blocks) on the same data.
* ``pool_cnn`` / ``pool_cnn_bn``: a 3-convolution digits CNN (8x8) with two max-pools that
  cannot fold into the convolution before them (overlapping ``MaxPool2d(3, 2, 1)``; with
  BatchNorm, ``conv-BN-ReLU-MaxPool2d(2)``): what replaces them is ``pool_conv``'s choice.
* ``gpt2``: transformers GPT2LMHeadModel from a config (byte-level, vocabulary 256, dropout 0)
  on Python's own standard-library sources (files 8 mod 10 validation, 9 mod 10 test); loss =
  test next-byte cross-entropy (nats, ``heldout``).  ``vit``: transformers
  ViTForImageClassification on 16x16 digits.

Methods (``--methods``): ``default`` (the model as constructed: PyTorch's default, or the
transformers init ``_init_weights`` for transformers models), ``torch_default`` (transformers
models with every layer re-drawn by PyTorch's own rule), ``fan_in`` (He normal, biases 0),
``lsuv`` (precondfx ``scheme="lsuv"``, output scale off), ``mup`` (the ``mup`` package:
MuReadout + base shapes at width 32 + MuSGD/MuAdamW learning-rate multipliers; MLP and CNN
families only; skipped, and said so, when ``mup`` is not installed), ``pfx`` (precondfx with
its defaults) and the ablations listed in ``ABLATIONS`` (one choice of the pass changed at a
time).  No method gets any other output calibration than its own.

Many copies (learning rate x seed) of one (task, method) train at once as one batched model
(stacked parameters, ``vmap(functional_call)``, SGD / AdamW updates written out with
PyTorch's semantics, checked against torch.optim in tests/test_bench_smoke.py); a model that
cannot be batched falls back to one ``torch.optim`` run per copy.

    python bench/train_suite.py --device cuda            # the full suite (GPU)
    python bench/train_suite.py --cpu                    # the CPU held-out runs (heldout_cpu.md)
    python bench/train_suite.py --cpu-small              # the CPU-reduced ablation runs
    python bench/train_suite.py --quick                  # CI smoke run (< 30 s)
    python bench/train_suite.py --tasks gpt2 --methods default,pfx,pfx_std0.5 --seeds 5

Writes docs/results/train_suite[_tag].json, .md and .png.
"""
from __future__ import annotations

import argparse
import copy
import glob
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

# ---------------------------------------------------------------------------------------------
# methods
# ---------------------------------------------------------------------------------------------

#: precondfx variants: name -> keyword arguments of ``precondfx.precondition`` (beyond seed).
#: ``pfx`` passes nothing, so it always measures the current defaults.
PFX: dict[str, dict] = {
    "pfx": {},                  # the library's defaults (lr_scale='auto' since 2026-11-25)
    "pfx_margin1": {},          # pfx, lr='auto''s SGD ceiling one octave higher (experiment)
    "pfx_margin2": {},          # ... two octaves higher (experiment)
    "pfx_off": {"lr_scale": None},   # the default until 2026-11-25: no lr scales
    "pfx_std0.05": {"target_std": 0.05},
    "pfx_std0.5": {"target_std": 0.5},
    "pfx_std1": {"target_std": 1.0},
    "pfx_std2": {"target_std": 2.0},
    "pfx_stdNone": {"target_std": None},
    "pfx_in_auto": {"input_scale": "auto"},
    "pfx_fan_in": {"init": "fan_in"},
    "pfx_fan_out": {"init": "fan_out"},
    "pfx_none": {"balance": "none"},
    "pfx_analytic": {"balance": "analytic"},
    "pfx_hessian": {"balance": "hessian"},
    "pfx_res_none": {"residual": "none"},
    "pfx_res_all": {"residual": "all"},
    "pfx_s_nf": {"residual_scale": "nf"},        # NF-ResNet schedule a=0.2 (issue 24)
    "pfx_s_nf1": {"residual_scale": "nf:1"},     # s_l = 1/sqrt(l) (issue 24)
    "pfx_defbias": {},          # pfx, then the biases of PyTorch's default init put back
    "pfx_none_stdNone": {"balance": "none", "target_std": None},
    "pfx_fan_in_stdNone": {"init": "fan_in", "target_std": None},
    "pfx_lr": {},               # pfx with lr_scale= matching the optimizer (see OPT_LR_SCALE)
    "pfx_lr_sgd": {"lr_scale": "sgd"},
    "pfx_lr_adam": {"lr_scale": "adam"},
    # what replaces a max-pool that cannot fold into the convolution before it
    "pfx_pool_keep": {"maxpool": "keep"},
    "pfx_pool_avgpool": {"maxpool": "avgpool"},          # average pooling: frozen
    "pfx_pool_full": {"pool_conv": "full"},              # full strided conv, re-initialized
    "pfx_pool_dw": {"pool_conv": "depthwise"},           # depthwise strided conv
    "pfx_pool_avgconv": {"pool_conv": "avg"},            # full conv = average pooling at init
    # pfx with every weight matrix stored at the user's model's own init scale (see user_scale)
    "pfx_ws": {},
    "pfx_ws_half": {},          # the same with c^0.5: weights stored halfway (geometric mean)
    "pfx_lr_user": {"lr_scale": "user"},   # until 2026-11-25: power 1 (rms = the user's)
    "pfx_user": {"lr_scale": "user"},      # halfway: rms = sqrt(precondfx's x the user's)
    "pfx_emb": {},              # pfx, then the ViT's cls token and position embeddings redrawn
                                # at the rms of the patch embedding (emulation, see vit_tokens_)
}

#: ``pfx_lr``: the lr_scale of each optimizer of the suite (the model depends on the optimizer)
OPT_LR_SCALE = {"sgd": "sgd", "adamw": None}        # pfx_lr_adam: lr_scale='adam' (2026-11-27)
#: methods whose model depends on the optimizer
PER_OPTIMIZER = ("mup", "umup", "pfx_lr", "pfx_ws", "pfx_ws_half")
#: methods named ``pfx_ax:p_q_r`` (experiment, ``ax_mult``) also depend on the optimizer

BASELINES = ["default", "torch_default", "default_std0.05", "default_zb", "fan_in", "lsuv", "mup",
             "umup",
             "default_eq", "fan_in_eq", "fan_out_eq", "xavier_eq", "geometric_eq",
             "fan_in_pair", "fan_out_pair", "xavier_pair", "geometric_pair"]
#: the plain init rules brought to precondfx's output scale (the paper's Table-2 protocol: every
#: method's output std made equal, here 1, precondfx's target_std, by one scalar on the output)
EQ_RULES = {"default_eq": "default", "fan_in_eq": "fan_in", "fan_out_eq": "fan_out",
            "xavier_eq": "xavier", "geometric_eq": "geometric"}
#: the same rules, output std 1, on precondfx's own draws for the seed (common random numbers:
#: common.init_rule_from_draws_); against "pfx" they differ only in each layer's scale
PAIRED_RULES = {"fan_in_pair": "fan_in", "fan_out_pair": "fan_out", "xavier_pair": "xavier",
                "geometric_pair": "geometric"}
MAIN_METHODS = ["default", "torch_default", "fan_in", "lsuv", "mup", "umup", "pfx", "pfx_lr", "pfx_user"]
ABLATIONS = ["default_std0.05", "default_zb", "pfx_std0.5", "pfx_stdNone", "pfx_in_auto",
             "pfx_fan_in", "pfx_none", "pfx_analytic", "pfx_hessian", "pfx_res_none",
             "pfx_defbias"]

LABELS = {
    "default": "framework default", "torch_default": "PyTorch default (re-drawn)",
    "default_std0.05": "default + output std 0.05", "default_zb": "default, biases 0",
    "fan_in": "fan-in (He)", "lsuv": "LSUV", "mup": "muP (mup package)",
    "pfx": "precondfx default", "pfx_std0.05": "pfx target_std=0.05",
    "pfx_std0.5": "pfx target_std=0.5", "pfx_std1": "pfx target_std=1", "pfx_std2": "pfx target_std=2",
    "pfx_stdNone": "pfx target_std=None", "pfx_in_auto": "pfx input_scale=auto",
    "pfx_fan_in": "pfx init=fan_in", "pfx_fan_out": "pfx init=fan_out",
    "pfx_none": "pfx balance=none", "pfx_analytic": "pfx balance=analytic",
    "pfx_hessian": "pfx balance=hessian", "pfx_res_none": "pfx residual=none",
    "pfx_res_all": "pfx residual=all", "pfx_s_nf": "pfx residual_scale=nf",
    "pfx_s_nf1": "pfx residual_scale=nf:1", "pfx_defbias": "pfx + default biases",
    "pfx_none_stdNone": "pfx balance=none, target_std=None",
    "pfx_fan_in_stdNone": "pfx init=fan_in, target_std=None",
    "pfx_lr": "pfx lr_scale=<optimizer>", "pfx_lr_sgd": "pfx lr_scale=sgd",
    "pfx_lr_adam": "pfx lr_scale=adam",
    "pfx_pool_keep": "pfx maxpool=keep", "pfx_pool_avgpool": "pfx maxpool=avgpool (frozen)",
    "pfx_pool_full": "pfx pool_conv=full", "pfx_pool_dw": "pfx pool_conv=depthwise",
    "pfx_pool_avgconv": "pfx pool_conv=avg (trained)",
    "pfx_ws": "pfx, weights at the user's init scale (emulated by per-weight rates)",
    "pfx_lr_user": "pfx lr_scale=user (power 1, replaced)",
    "pfx_user": "pfx lr_scale=user (halfway)",
    "pfx_off": "pfx lr_scale=None (the default before 'auto')",
    "pfx_margin1": "pfx, SGD ceiling 1 octave above the suggested rate (experiment)",
    "pfx_margin2": "pfx, SGD ceiling 2 octaves above the suggested rate (experiment)",
    "umup": "u-muP (unit_scaling)",
    "pfx_emb": "pfx, ViT tokens at the patch scale (emulated)",
    "default_eq": "PyTorch default, output std 1", "fan_in_eq": "fan-in, output std 1",
    "fan_out_eq": "fan-out, output std 1", "xavier_eq": "Xavier (Eq. 6), output std 1",
    "geometric_eq": "geometric (Eq. 7, a plain draw), output std 1",
    "fan_in_pair": "fan-in on precondfx's draws, output std 1",
    "fan_out_pair": "fan-out on precondfx's draws, output std 1",
    "xavier_pair": "Xavier on precondfx's draws, output std 1",
    "geometric_pair": "geometric on precondfx's draws, output std 1 (pfx without its pass)",
    "pfx_ws_half": "pfx, weights halfway to the user's scale (emulated)",
}


def mup_available() -> bool:
    try:
        import mup  # noqa: F401
        return True
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------

def _digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    d = load_digits()
    perm = np.random.RandomState(0).permutation(len(d.target))
    return d.images.astype(np.float32) / 16.0 * 2 - 1, d.target.astype(np.int64), perm


#: digits split: training / validation (picks the learning rate) / test (reported)
DIGITS_SPLIT = (1197, 300, 300)


def digits(kind: str) -> dict:
    """Digits split 1197 train / 300 validation / 300 test (one fixed permutation):
    ``flat`` (64 features), ``img8`` (1x8x8), ``img16`` (3x16x16, bilinear)."""
    img, y, perm = _digits_split()
    x = torch.tensor(img).unsqueeze(1)
    if kind == "flat":
        x = x.flatten(1)
    elif kind == "img16":
        x = F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    y = torch.tensor(y)
    a, b, _ = DIGITS_SPLIT
    tr, va, te = (torch.tensor(perm[:a]), torch.tensor(perm[a:a + b]),
                  torch.tensor(perm[a + b:]))
    return {"x": x[tr].contiguous(), "y": y[tr], "x_val": x[va].contiguous(), "y_val": y[va],
            "x_test": x[te].contiguous(), "y_test": y[te]}


def text_corpus(max_bytes: int | None = None) -> dict:
    """Byte-level corpus: Python's own standard-library sources (``Lib/*.py``), sorted by name;
    every 10th file (index 9 mod 10) is the test set, the one before it (8 mod 10) the
    validation set (picks the learning rate), the rest is trained on."""
    lib = os.path.dirname(os.__file__)
    files = sorted(glob.glob(os.path.join(lib, "*.py")))
    tr, va, te = [], [], []
    for i, f in enumerate(files):
        with open(f, "rb") as fh:
            (te if i % 10 == 9 else va if i % 10 == 8 else tr).append(fh.read())
    a, v, b = b"\n".join(tr), b"\n".join(va), b"\n".join(te)
    if max_bytes:
        a, v, b = a[:max_bytes], v[:max(max_bytes // 8, 4096)], b[:max(max_bytes // 8, 4096)]
    to = lambda s: torch.frombuffer(bytearray(s), dtype=torch.uint8).long()  # noqa: E731
    return {"train": to(a), "val": to(v), "test": to(b), "files": len(files),
            "train_bytes": len(a), "val_bytes": len(v), "test_bytes": len(b)}


def _site_packages() -> str:
    import sysconfig
    return sysconfig.get_paths()["purelib"]


#: ``code_languages``' classes: the files each is read from (globs; the standard library's and
#: the installed packages' own files, so the data is on every machine that runs the suite)
CODE_LANGUAGES: dict[str, Callable[[], list[str]]] = {
    "python": lambda: glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")),
    "c_header": lambda: glob.glob(os.path.join(_site_packages(), "**", "*.h"), recursive=True),
    "javascript": lambda: glob.glob(os.path.join(_site_packages(), "**", "*.js"),
                                    recursive=True),
    "restructuredtext": lambda: glob.glob(os.path.join(_site_packages(), "**", "*.rst"),
                                          recursive=True),
    "json": lambda: glob.glob(os.path.join(_site_packages(), "**", "*.json"), recursive=True),
}


def code_languages(ctx: int = 64, per_class: int = 300, seed: int = 0,
                   max_files: int = 400) -> dict:
    """Text classification on real, offline data: which language (``CODE_LANGUAGES``: Python,
    C headers, JavaScript, reStructuredText, JSON) a ``ctx``-byte window comes from.  Files are
    split, not windows: within each language, files (at least 256 bytes; the first
    ``max_files`` in sorted order) with index ``i % 5 == 4`` are test, ``== 3`` validation, the
    rest training, so every held-out window comes from a file never trained on.
    ``per_class`` training windows per language (a fifth of that for validation and test),
    drawn at fixed random offsets; bytes are the tokens."""
    g = np.random.default_rng(seed)
    parts: dict[str, tuple[list, list]] = {"train": ([], []), "val": ([], []), "test": ([], [])}
    for c, (_lang, find) in enumerate(CODE_LANGUAGES.items()):
        files = sorted(f for f in find() if os.path.getsize(f) >= 256)[:max_files]
        split: dict[str, list[bytes]] = {"train": [], "val": [], "test": []}
        for i, f in enumerate(files):
            with open(f, "rb") as fh:
                split["test" if i % 5 == 4 else "val" if i % 5 == 3 else "train"].append(
                    fh.read(1 << 16))
        for k, n in (("train", per_class), ("val", per_class // 5), ("test", per_class // 5)):
            blob = b"\n".join(split[k])
            starts = g.integers(0, len(blob) - ctx, n)
            arr = np.frombuffer(blob, np.uint8)
            parts[k][0].extend(arr[s:s + ctx] for s in starts)
            parts[k][1].extend([c] * n)
    out = {}
    for k, (xs, ys) in parts.items():
        sfx = "" if k == "train" else f"_{k}"
        out[f"x{sfx}"] = torch.from_numpy(np.stack(xs).astype(np.int64))
        out[f"y{sfx}"] = torch.tensor(ys)
    return out


# ---------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------

def mlp(n_in: int, width: int, depth: int, n_out: int, readout: type = nn.Linear) -> nn.Module:
    layers: list[nn.Module] = []
    prev = n_in
    for _ in range(depth):
        layers += [nn.Linear(prev, width), nn.ReLU()]
        prev = width
    layers.append(readout(prev, n_out))
    return nn.Sequential(*layers)


class PlainCNN(nn.Module):
    """``depth`` 3x3 convolutions (padding 1) of ``width`` channels, ReLU, global average pool,
    linear head."""

    def __init__(self, in_ch: int, width: int, depth: int, n_out: int,
                 readout: type = nn.Linear) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        prev = in_ch
        for _ in range(depth):
            layers += [nn.Conv2d(prev, width, 3, padding=1), nn.ReLU()]
            prev = width
        self.features = nn.Sequential(*layers)
        self.head = readout(prev, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class ConvNet(nn.Module):
    """Five 3x3 convolutions (32-32s2-64-64s2-128), optional BatchNorm, pool, linear."""

    def __init__(self, bn: bool, n_out: int = 10) -> None:
        super().__init__()
        spec = [(3, 32, 1), (32, 32, 2), (32, 64, 1), (64, 64, 2), (64, 128, 1)]
        layers: list[nn.Module] = []
        for cin, cout, s in spec:
            layers.append(nn.Conv2d(cin, cout, 3, stride=s, padding=1, bias=not bn))
            if bn:
                layers.append(nn.BatchNorm2d(cout))
            layers.append(nn.ReLU())
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(128, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean((2, 3)))


class PoolCNN(nn.Module):
    """The digits CNN with max-pools that cannot fold into the convolution before them:
    ``conv3x3(1->32)-ReLU-pool-conv3x3(32->64)-ReLU-pool-conv3x3(64->64)-ReLU``, global
    average pool, linear.  Without BatchNorm the pools overlap (``MaxPool2d(3, 2, 1)``: kernel
    differs from stride); with BatchNorm (``conv-BN-ReLU-MaxPool2d(2)``) the normalization
    sits between the convolution and the pool.  On 8x8 digits: 8 -> 4 -> 2."""

    def __init__(self, bn: bool, n_out: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (cin, cout) in enumerate([(1, 32), (32, 64), (64, 64)]):
            layers.append(nn.Conv2d(cin, cout, 3, padding=1, bias=not bn))
            if bn:
                layers.append(nn.BatchNorm2d(cout))
            layers.append(nn.ReLU())
            if i < 2:
                layers.append(nn.MaxPool2d(2) if bn else nn.MaxPool2d(3, 2, 1))
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(64, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean((2, 3)))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.short = (nn.Conv2d(cin, cout, 1, stride=stride)
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.short(x) + self.conv2(torch.relu(self.conv1(x))))


class NFResNet(nn.Module):
    """Normalization-free ResNet: stem, 2 stages of 2 basic blocks (32, 64), pool, linear."""

    def __init__(self, n_out: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.blocks = nn.Sequential(BasicBlock(32, 32, 1), BasicBlock(32, 32, 1),
                                    BasicBlock(32, 64, 2), BasicBlock(64, 64, 1))
        self.fc = nn.Linear(64, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(torch.relu(self.stem(x))).mean((2, 3)))


class HFLogits(nn.Module):
    """A transformers model called with one tensor (``key=x``), returning its logits."""

    def __init__(self, model: nn.Module, key: str) -> None:
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kw = {"use_cache": False} if self.key == "input_ids" else {}
        return self.model(**{self.key: x}, **kw).logits


def gpt2(n_embd: int, n_layer: int, n_head: int, ctx: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=256, n_positions=ctx, n_embd=n_embd, n_layer=n_layer,
                     n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return HFLogits(GPT2LMHeadModel(cfg), "input_ids")


def bert(hidden: int, layers: int, ctx: int, n_out: int = len(CODE_LANGUAGES)) -> nn.Module:
    """A byte-level BERT sequence classifier from a config (transformers' own init)."""
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=256, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=4, intermediate_size=4 * hidden,
                     max_position_embeddings=ctx, type_vocab_size=1, num_labels=n_out,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     attn_implementation="eager")
    return HFLogits(BertForSequenceClassification(cfg), "input_ids")


def vit(hidden: int, layers: int) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=hidden,
                    num_hidden_layers=layers, num_attention_heads=4,
                    intermediate_size=4 * hidden, num_labels=10, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return HFLogits(ViTForImageClassification(cfg), "pixel_values")


# ---------------------------------------------------------------------------------------------
# tasks
# ---------------------------------------------------------------------------------------------

@dataclass
class Task:
    """One training problem.  ``make(readout)`` builds the user's model (under the caller's
    ``torch.manual_seed``); ``data``: ``x, y, x_val, y_val, x_test, y_test``
    (classification) or ``train, val, test`` token streams (``lm``).  ``metric``: what is
    reported at the chosen rate (``test`` / ``heldout``: the test split; ``train``: the final
    training-set loss, the paper's protocol, used where a task has no split); ``select``: the
    evaluation set that chooses each method's rate (``val``, or ``train`` without a split)."""

    name: str
    make: Callable[..., nn.Module]
    data: dict
    batch: int
    steps: int = 0
    epochs: float = 0.0
    kind: str = "cls"                 # cls | lm
    ctx: int = 0                      # lm: tokens per window
    family: str = ""                  # e.g. mlp_width, mlp_depth
    member: int = 0                   # width or depth within the family
    hf: bool = False                  # transformers model (default = _init_weights)
    mup_width: Callable[[int], nn.Module] | None = None   # builder at another width (muP)
    metric: str = "test"              # test | heldout (LM test split) | train (no split)
    select: str = "val"               # val | train (tasks without a validation split)

    def n_steps(self) -> int:
        if self.kind == "lm":
            return self.steps
        return max(1, int(round(self.epochs * (len(self.data["y"]) // self.batch))))

    def sampler(self, seed: int) -> torch.Tensor:
        """(steps, batch) indices of the minibatches of one seed (shared by every method and
        learning rate): epoch permutations (classification) or window starts (LM)."""
        g = torch.Generator().manual_seed(777 + seed)
        T = self.n_steps()
        if self.kind == "lm":
            hi = len(self.data["train"]) - self.ctx - 1
            return torch.randint(0, hi, (T, self.batch), generator=g)
        n = len(self.data["y"])
        spe = n // self.batch
        ep = math.ceil(T / spe)
        perms = [torch.randperm(n, generator=g)[:spe * self.batch].view(spe, self.batch)
                 for _ in range(ep)]
        return torch.cat(perms)[:T]

    def get(self, idx: torch.Tensor, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets at ``idx`` of ``split`` (train | val | test; ``heldout`` is the
        LM test split's name)."""
        split = "test" if split == "heldout" else split
        if self.kind == "lm":
            tok = self.data[split]
            ar = torch.arange(self.ctx + 1, device=idx.device)
            w = tok[idx.unsqueeze(-1) + ar]
            return w[..., :-1], w[..., 1:]
        if split == "train":
            return self.data["x"][idx], self.data["y"][idx]
        return self.data[f"x_{split}"][idx], self.data[f"y_{split}"][idx]

    def eval_sets(self) -> dict[str, torch.Tensor]:
        """Index sets of the evaluations, keyed by split name: classification ``train`` (the
        whole training set), ``val`` and ``test``; LM ``val`` and ``heldout`` (the test split,
        256 windows each)."""
        if self.kind == "lm":
            out = {}
            for k, split in (("val", "val"), ("heldout", "test")):
                n = len(self.data[split]) - self.ctx - 1
                m = min(256, max(1, n // self.ctx))
                out[k] = torch.linspace(0, n - 1, m).long()
            return out
        out = {"train": torch.arange(len(self.data["y"]))}
        for k in ("val", "test"):
            if len(self.data.get(f"y_{k}", ())):
                out[k] = torch.arange(len(self.data[f"y_{k}"]))
        return out


def _family(prefix: str, make_net: Callable, data: dict, widths: list[int], depths: list[int],
            w0: int, d0: int, epochs: float, batch: int) -> list[Task]:
    out: list[Task] = []
    seen = set()
    for fam, pairs in ((f"{prefix}_width", [(w, d0) for w in widths]),
                       (f"{prefix}_depth", [(w0, d) for d in depths])):
        for w, d in pairs:
            name = f"{prefix}_w{w}_d{d}"
            t = Task(name, (lambda readout=nn.Linear, w=w, d=d: make_net(w, d, readout)), data,
                     batch, epochs=epochs, family=fam, member=w if fam.endswith("width") else d,
                     mup_width=(lambda w2, d=d: make_net(w2, d, nn.Linear)))
            if name in seen:          # the shared member belongs to both families
                t.family = f"{prefix}_width+{prefix}_depth"
                out = [x for x in out if x.name != name]
            seen.add(name)
            out.append(t)
    return out


def all_tasks(cfg: dict) -> list[Task]:
    """Every task of the suite for the size configuration ``cfg`` (see ``SIZES``)."""
    tasks: list[Task] = []
    if cfg.get("libsvm", True):
        import libsvm_study as L
        for name, fn, _spec in L.datasets():
            X, y = L.load(fn)
            d, c = X.shape[1], int(y.max()) + 1
            data = {"x": X, "y": y, "x_test": X[:0], "y_test": y[:0]}
            tasks.append(Task(f"libsvm/{name}", (lambda readout=nn.Linear, d=d, c=c:
                                                 L.make_net(d, c)), data, 32, epochs=5,
                              family="libsvm", metric="train", select="train"))
    flat = digits("flat")
    tasks += _family("mlp", lambda w, d, r: mlp(64, w, d, 10, r), flat, cfg["mlp_widths"],
                     cfg["mlp_depths"], cfg["mlp_w0"], cfg["mlp_d0"], cfg["epochs"], 32)
    tasks.append(Task("mlp_w512_d1", lambda readout=nn.Linear: mlp(64, 512, 1, 10, readout),
                      flat, 32, epochs=cfg["epochs"], family="shallow",
                      mup_width=lambda w2: mlp(64, w2, 1, 10)))
    img8 = digits("img8")
    tasks += _family("cnn", lambda w, d, r: PlainCNN(1, w, d, 10, r), img8, cfg["cnn_widths"],
                     cfg["cnn_depths"], cfg["cnn_w0"], cfg["cnn_d0"], cfg["epochs"], 32)
    img16 = digits("img16")
    tasks.append(Task("conv_bn", lambda readout=nn.Linear: ConvNet(True), img16, 32,
                      epochs=cfg["epochs"], family="conv"))
    tasks.append(Task("conv_nobn", lambda readout=nn.Linear: ConvNet(False), img16, 32,
                      epochs=cfg["epochs"], family="conv"))
    tasks.append(Task("nf_resnet", lambda readout=nn.Linear: NFResNet(), img16, 32,
                      epochs=cfg["epochs"], family="conv"))
    g = cfg["gpt2"]
    text = text_corpus(g.get("max_bytes"))
    tasks.append(Task("gpt2", lambda readout=None: gpt2(g["n_embd"], g["n_layer"], g["n_head"],
                                                        g["ctx"]),
                      text, g["batch"], steps=g["steps"], kind="lm", ctx=g["ctx"],
                      family="transformer", hf=True, metric="heldout"))
    if "gpt2_l" in cfg:        # the larger GPT-2 (issue 20's 4-layer, n_embd 128 model)
        gl = cfg["gpt2_l"]
        tasks.append(Task("gpt2_l", lambda readout=None: gpt2(gl["n_embd"], gl["n_layer"],
                                                              gl["n_head"], gl["ctx"]),
                          text, gl["batch"], steps=gl["steps"], kind="lm", ctx=gl["ctx"],
                          family="transformer", hf=True, metric="heldout"))
    if "bert" in cfg:
        b = cfg["bert"]
        tasks.append(Task("bert", lambda readout=None: bert(b["hidden"], b["layers"], b["ctx"]),
                          code_languages(b["ctx"], b["per_class"]), 32, epochs=cfg["epochs"],
                          family="transformer", hf=True))
    tasks.append(Task("pool_cnn", lambda readout=nn.Linear: PoolCNN(False), img8, 32,
                      epochs=cfg["epochs"], family="pool"))
    tasks.append(Task("pool_cnn_bn", lambda readout=nn.Linear: PoolCNN(True), img8, 32,
                      epochs=cfg["epochs"], family="pool"))
    v = cfg["vit"]
    tasks.append(Task("vit", lambda readout=None: vit(v["hidden"], v["layers"]), img16, 32,
                      epochs=cfg["epochs"], family="transformer", hf=True))
    return tasks


#: size configurations: the full suite (GPU), the CPU-reduced one, the CI smoke run.
SIZES: dict[str, dict] = {
    "full": dict(epochs=3, mlp_widths=[32, 128, 512, 2048], mlp_depths=[1, 2, 4, 8, 16],
                 mlp_w0=256, mlp_d0=2, cnn_widths=[32, 128, 512, 2048],
                 cnn_depths=[1, 2, 4, 8, 16], cnn_w0=64, cnn_d0=2,
                 gpt2=dict(n_embd=128, n_layer=4, n_head=4, ctx=128, batch=32, steps=600),
                 vit=dict(hidden=64, layers=4), seeds=3, n_lr=8),
    "cpu_small": dict(epochs=3, mlp_widths=[32, 128, 512], mlp_depths=[1, 2, 4, 8],
                      mlp_w0=128, mlp_d0=2, cnn_widths=[16, 32, 64], cnn_depths=[1, 2, 4, 8],
                      cnn_w0=32, cnn_d0=2, libsvm=False,
                      gpt2=dict(n_embd=64, n_layer=2, n_head=4, ctx=32, batch=8, steps=150,
                                max_bytes=2_000_000),
                      vit=dict(hidden=32, layers=2), seeds=3, n_lr=8),
    # learning-rate transfer on CPU: the MLP family over the full suite's widths and depths
    "cpu_lr": dict(epochs=3, mlp_widths=[32, 128, 512, 2048], mlp_depths=[1, 2, 4, 8, 16],
                   mlp_w0=128, mlp_d0=2, cnn_widths=[16, 32, 64], cnn_depths=[1, 2, 4, 8],
                   cnn_w0=32, cnn_d0=2, libsvm=False,
                   gpt2=dict(n_embd=64, n_layer=2, n_head=4, ctx=32, batch=8, steps=150,
                             max_bytes=2_000_000),
                   vit=dict(hidden=32, layers=2), seeds=3, n_lr=8),
    # held-out CPU configuration (--cpu): small models, 3 seeds, rate chosen on validation
    "cpu": dict(epochs=3, mlp_widths=[128], mlp_depths=[2], mlp_w0=128, mlp_d0=2,
                cnn_widths=[32], cnn_depths=[2], cnn_w0=32, cnn_d0=2, libsvm=False,
                gpt2=dict(n_embd=64, n_layer=2, n_head=4, ctx=32, batch=8, steps=150,
                          max_bytes=2_000_000),
                vit=dict(hidden=32, layers=2), seeds=3, n_lr=8,
                gpt2_l=dict(n_embd=128, n_layer=4, n_head=4, ctx=64, batch=16, steps=200,
                            max_bytes=2_000_000),
                bert=dict(hidden=64, layers=2, ctx=64, per_class=300)),
    "quick": dict(epochs=0.25, mlp_widths=[32, 64], mlp_depths=[1, 2], mlp_w0=32, mlp_d0=1,
                  cnn_widths=[8], cnn_depths=[1], cnn_w0=8, cnn_d0=1, libsvm=False,
                  gpt2=dict(n_embd=32, n_layer=1, n_head=2, ctx=16, batch=8, steps=6,
                            max_bytes=200_000),
                  vit=dict(hidden=16, layers=1), seeds=3, n_lr=8),
}

#: epochs of the held-out suite's max-pool CNNs (heldout_cpu.md, section 1: 10, not 3)
HELDOUT_EPOCHS = {"pool_cnn": 10, "pool_cnn_bn": 10}


def heldout_task(name: str) -> "Task":
    """The ``--cpu`` size's task ``name`` as the held-out suite ran it (its epochs)."""
    cfg = dict(SIZES["cpu"])
    if name in HELDOUT_EPOCHS:
        cfg["epochs"] = HELDOUT_EPOCHS[name]
    return next(t for t in all_tasks(cfg) if t.name == name)


#: the default task selection of each size (``--tasks`` overrides it)
DEFAULT_TASKS = {
    "full": ["libsvm", "mlp", "cnn", "conv_bn", "conv_nobn", "nf_resnet", "gpt2", "vit",
             "pool_cnn", "pool_cnn_bn"],
    "cpu_small": ["mlp_w512_d1", "gpt2", "mlp"],
    "cpu_lr": ["mlp"],
    "cpu": ["mlp_w128_d2", "pool_cnn", "pool_cnn_bn", "conv_bn", "gpt2", "vit"],
    "quick": ["mlp_w32_d1", "gpt2"],
}


# ---------------------------------------------------------------------------------------------
# building each method's model
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def fan_in_(model: nn.Module, seed: int) -> nn.Module:
    """He-normal (std sqrt(2/fan_in)) on every Linear / Conv / transformers Conv1D weight,
    biases 0; embeddings and normalizations untouched."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    for m in model.modules():
        w = getattr(m, "weight", None)
        if w is None or w.dim() < 2 or isinstance(m, nn.Embedding):
            continue
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            fan = int(math.prod(w.shape[1:]))
        elif type(m).__name__ == "Conv1D":           # transformers' (in, out) linear
            fan = int(w.shape[0])
        else:
            continue
        w.copy_(torch.randn(w.shape, generator=gen) * math.sqrt(2.0 / fan))
        if getattr(m, "bias", None) is not None:
            m.bias.zero_()
    return model


@torch.no_grad()
def torch_default_(model: nn.Module) -> nn.Module:
    """PyTorch's own init on every module that has one (``reset_parameters``); transformers'
    Conv1D is drawn as nn.Linear would be (uniform, bound 1/sqrt(fan_in))."""
    for m in model.modules():
        if type(m).__name__ == "Conv1D":
            b = 1.0 / math.sqrt(m.weight.shape[0])
            m.weight.uniform_(-b, b)
            if m.bias is not None:
                m.bias.uniform_(-b, b)
        elif hasattr(m, "reset_parameters") and m is not model:
            m.reset_parameters()
    return model


class FixedReadout(nn.Linear):
    """mup's MuReadout with its width multiplier frozen into a float (so that the model can be
    batched with functional_call, which drops mup's ``infshape`` attributes)."""

    def __init__(self, src: nn.Linear, mult: float) -> None:
        super().__init__(src.in_features, src.out_features, bias=src.bias is not None)
        with torch.no_grad():
            self.weight.copy_(src.weight)
            if src.bias is not None:
                self.bias.copy_(src.bias)
        self.mult = float(mult)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * self.mult)


def build_mup(task: Task, seed: int, opt: str, base_width: int = 32) -> tuple[nn.Module, dict]:
    """muP with the mup package: MuReadout head, base shapes from the same architecture at
    ``base_width`` (delta at 2x), PyTorch's default init elsewhere (fan-in: muP-correct for
    hidden and input weights), learning-rate multipliers from MuSGD / MuAdamW."""
    import mup
    torch.manual_seed(seed)
    model = task.make(readout=mup.MuReadout)
    base = task.mup_width(base_width)
    delta = task.mup_width(2 * base_width)
    mup.set_base_shapes(model, base, delta=delta)
    params = list(model.parameters())
    maker = mup.MuSGD if opt == "sgd" else mup.MuAdamW
    o = maker(params, lr=1.0)
    mult_by_id = {id(p): g["lr"] for g in o.param_groups for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    mult = {names[i]: float(v) for i, v in mult_by_id.items()}
    # swap every MuReadout for a plain module with the same multiplier
    for name, mod in list(model.named_modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, mup.MuReadout):
                setattr(mod, cname, FixedReadout(child, child.output_mult / child.width_mult()))
    return model, mult


class ScaledReLU(nn.Module):
    """ReLU x sqrt(2): unit second moment out for a unit Gaussian in (unit_scaling has no relu;
    its GELU would change the architecture)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * math.sqrt(2.0)


def build_umup(task: Task, seed: int, opt: str) -> tuple[nn.Module, dict]:
    """u-muP (the unit_scaling package) for the MLP family: the same layers as ``mlp`` with
    ``uu.Linear`` (unit-variance weights, 1/sqrt(fan_in) in the forward), ``uu.LinearReadout``
    (1/fan_in: u-muP's readout) and a unit-scaled ReLU; per-parameter rate multipliers from
    ``unit_scaling.optim.lr_scale_func_adam`` / ``_sgd`` (what its Adam/SGD wrappers apply).
    The loss is the suite's plain cross-entropy, not ``uu.functional.cross_entropy``: its
    backward scale is a constant factor, which Adam does not see (SGD does)."""
    import re

    import unit_scaling as uu
    from unit_scaling.optim import lr_scale_func_adam, lr_scale_func_sgd
    m = re.fullmatch(r"mlp_w(\d+)_d(\d+)", task.name)
    if m is None:
        raise ValueError(f"u-muP is built for the MLP family only, not {task.name}")
    width, depth = int(m.group(1)), int(m.group(2))
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    prev = 64
    for _ in range(depth):
        layers += [uu.Linear(prev, width, bias=True), ScaledReLU()]
        prev = width
    layers.append(uu.LinearReadout(prev, 10, bias=True))
    model = nn.Sequential(*layers)
    rule = lr_scale_func_adam if opt == "adamw" else lr_scale_func_sgd
    return model, {n: float(rule(p)) for n, p in model.named_parameters()}


def build(task: Task, method: str, seed: int, calib: torch.Tensor, opt: str
          ) -> tuple[nn.Module, dict]:
    """The initialized model of ``method`` for ``seed`` (built under ``torch.manual_seed(seed)``
    so 'default' is the framework's own init for that seed), and its per-parameter
    learning-rate multipliers (empty: all 1)."""
    if method == "mup":
        return build_mup(task, seed, opt)
    if method == "umup":
        return build_umup(task, seed, opt)
    torch.manual_seed(seed)
    model = task.make()
    model.train()
    if method == "default":
        return model, {}
    if method == "torch_default":
        return torch_default_(model), {}
    if method == "default_std0.05":
        return C.calibrated(model, calib, 0.05), {}
    if method == "default_zb":
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)) or \
                        type(m).__name__ == "Conv1D":
                    if m.bias is not None:
                        m.bias.zero_()
        return model, {}
    if method == "fan_in":
        return fan_in_(model, seed), {}
    if method in EQ_RULES:
        return C.calibrated(C.init_rule_(model, EQ_RULES[method], seed), calib, 1.0), {}
    import precondfx
    if method in PAIRED_RULES:
        drawn, rep = precondfx.precondition(model, calib, seed=seed)
        return C.calibrated(C.init_rule_from_draws_(model, PAIRED_RULES[method], drawn,
                                                     rep.plan), calib, 1.0), {}
    if method == "lsuv":
        out, _ = precondfx.precondition(model, calib, seed=seed, scheme="lsuv", target_std=None)
        return out.train(), {}
    if method.startswith("pfx_ax:"):
        out, _ = precondfx.precondition(model, calib, seed=seed)
        return out.train(), ax_mult(out, method, opt)
    if method not in PFX:
        raise ValueError(f"unknown method {method!r}; known: {BASELINES + list(PFX)}")
    kw = dict(PFX[method], lr_scale=OPT_LR_SCALE[opt]) if method == "pfx_lr" else PFX[method]
    out, _ = precondfx.precondition(model, calib, seed=seed, **kw)
    if method in ("pfx_ws", "pfx_ws_half"):
        return out.train(), user_scale_mult(model, out, opt,
                                            0.5 if method == "pfx_ws_half" else 1.0)
    if method == "pfx_emb":
        return vit_tokens_(out, calib, seed).train(), {}
    if method == "pfx_defbias":
        with torch.no_grad():
            ref = dict(model.named_parameters())
            for n, p in out.named_parameters():
                if n.endswith("bias") and n in ref and ref[n].shape == p.shape:
                    p.copy_(ref[n])
    return out.train(), {}


@torch.no_grad()
def vit_tokens_(out: nn.Module, calib: torch.Tensor, seed: int) -> nn.Module:
    """Emulation: redraw a ViT's cls token and position embeddings (transformers' init: std
    0.02, which precondfx leaves alone) at the rms of the patch embedding's output on
    ``calib``, so that every token of the residual stream starts at one scale (the cls token's
    stream at 0.02 puts a 1/0.02 gain in the LayerNorms it meets: the top Gauss-Newton
    eigenvalue of the ViT's precondfx result lies on these two parameters,
    bench/suggested_lr_probe.py), then bring the output's std back to 1 through the output
    scale constant."""
    emb = out.model.vit.embeddings
    seen: list[float] = []
    h = emb.patch_embeddings.projection.register_forward_hook(
        lambda m, a, o: seen.append(float(o.pow(2).mean().sqrt())))
    out(calib)
    h.remove()
    gen = torch.Generator().manual_seed(20_000 + seed)
    for p in (emb.cls_token, emb.position_embeddings):
        p.copy_(torch.randn(p.shape, generator=gen) * seen[0])
    sc = dict(out.named_buffers())["model.classifier.precondfx_output_scale"]
    sc.mul_(1.0 / float(out(calib).std()))
    return out


def ax_mult(model: nn.Module, method: str, opt: str, base: int = 128, depth0: int = 3
            ) -> dict[str, float]:
    """Experiment (issue 20, item 5): per-layer AdamW rate multipliers for ``pfx_ax:p_q_r``,
    ``m = (base/fan_in)^p (base/fan_out)^q (depth0/L)^r`` on each Linear's weight and bias,
    where a fan set by the data (the first layer's input, the last layer's output) counts as
    ``base`` and ``L`` is the number of Linear layers.  Under Adam a rate multiplier on a
    layer equals storing it divided by ``m`` with ``m`` on its output (same function), up to
    eps and the decoupled decay's rate.  SGD: the multipliers squared."""
    p, q, r = (float(v) for v in method.split(":", 1)[1].split("_"))
    lins = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    out: dict[str, float] = {}
    for k, (n, m) in enumerate(lins):
        fi = base if k == 0 else m.in_features
        fo = base if k == len(lins) - 1 else m.out_features
        mult = (base / fi) ** p * (base / fo) ** q * (depth0 / len(lins)) ** r
        for pn, _ in m.named_parameters(recurse=False):
            out[f"{n}.{pn}" if n else pn] = mult if opt == "adamw" else mult * mult
    return out


def user_scale_mult(user: nn.Module, pfx: nn.Module, opt: str, power: float = 1.0
                    ) -> dict[str, float]:
    """Per-parameter rate multipliers that emulate storing each weight matrix of ``pfx`` at
    the user's model's own init scale, with the ratio ``c = rms(pfx W) / rms(user W)`` moved
    into a constant on the layer's input (same function): the stored ``W / c`` then gets
    gradient ``c g``, so the effective weight moves by ``c`` times an Adam step (AdamW: rate x
    c, exact up to eps; the decoupled weight decay also runs x c) and ``c^2`` times an SGD step
    (SGD: rate x c^2).  Biases and normalization parameters: x 1 (an input constant leaves
    them alone).  Weights with no counterpart of the same name and shape: x 1.  ``power``:
    store at ``rms(pfx W) / c^power`` instead (0.5: the geometric mean of the two scales)."""
    ref = {n: p for n, p in user.named_parameters()}
    out = {}
    for n, p in pfx.named_parameters():
        q = ref.get(n)
        if p.dim() < 2 or q is None or q.shape != p.shape:
            continue
        ru, rp = float(q.detach().pow(2).mean().sqrt()), float(p.detach().pow(2).mean().sqrt())
        if ru > 0 and rp > 0:
            c = (rp / ru) ** power
            out[n] = c if opt == "adamw" else c * c
    return out


def method_note(task: Task, method: str) -> str | None:
    """Why ``method`` is not run on ``task`` (None: it is)."""
    if method == "mup":
        if not mup_available():
            return "the mup package is not installed (pip install --no-deps mup)"
        if task.mup_width is None:
            return "muP is run on the MLP and CNN families only (needs a width-parametrized builder)"
    if method == "pfx_emb" and task.name != "vit":
        return "the cls-token emulation is written for the ViT task"
    if method == "umup":
        try:
            import unit_scaling  # noqa: F401
        except ImportError:
            return "the unit-scaling package is not installed (pip install unit-scaling)"
        if not task.name.startswith("mlp_w"):
            return "u-muP is run on the MLP family only"
    if method == "pfx_lr_user":
        return ("lr_scale='user' at power 1 (weights stored at the user's rms) was replaced by "
                "the halfway rule: run 'pfx_user' (docs/results/heldout_cpu.md)")
    if method == "torch_default" and not task.hf:
        return "same as 'default' for a plain PyTorch model"
    if method in ("pfx_res_none", "pfx_res_all", "pfx_s_nf", "pfx_s_nf1") and \
            task.family not in ("conv", "transformer"):
        return "no residual join"
    return None


# ---------------------------------------------------------------------------------------------
# training: many copies at once (vmap), or one at a time (torch.optim)
# ---------------------------------------------------------------------------------------------

@dataclass
class Hyper:
    opt: str                     # sgd | adamw
    momentum: float = 0.9
    sgd_wd: float = 0.0
    adam_wd: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-copy mean cross-entropy: ``out (M, B, ..., V)``, ``y (M, B, ...)``."""
    m = y.shape[0]
    v = out.shape[-1]
    ce = F.cross_entropy(out.reshape(-1, v).float(), y.reshape(-1), reduction="none")
    return ce.view(m, -1).mean(1)


def _acc(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-copy top-1 accuracy: ``out (M, B, ..., V)``, ``y (M, B, ...)``."""
    m = y.shape[0]
    return (out.argmax(-1) == y).reshape(m, -1).float().mean(1)


class VTrainer:
    """Copies of one architecture trained at once: parameters stacked along dim 0,
    ``vmap(functional_call)``; the update is torch.optim.SGD's (momentum buffer = gradient on
    the first step) or torch.optim.AdamW's (bias-corrected, decoupled weight decay), with a
    learning rate per copy times a per-parameter multiplier."""

    def __init__(self, models: list[nn.Module], lrs: list[float], hp: Hyper, mult: dict,
                 device: str) -> None:
        # the base module stays real: a meta copy loses tensors that are plain attributes
        # (transformers models keep some), and vmap then computes garbage
        self.base = copy.deepcopy(models[0]).to(device)
        self.base.train()
        params, bufs = C.stack_state(models)
        self.names = list(params)
        self.p = {k: v.to(device).contiguous() for k, v in params.items()}
        self.b = {k: v.to(device).contiguous() for k, v in bufs.items()}
        self.s1 = {k: torch.zeros_like(v) for k, v in self.p.items()}
        self.s2 = ({k: torch.zeros_like(v) for k, v in self.p.items()}
                   if hp.opt == "adamw" else {})
        self.lr = torch.tensor(lrs, dtype=torch.float32, device=device)
        self.mult = {k: float(mult.get(k, 1.0)) for k in self.names}
        self.hp, self.t, self.device = hp, 0, device
        self.alive = torch.arange(len(lrs), device=device)

        def f(p: dict, b: dict, x: torch.Tensor) -> torch.Tensor:
            return functional_call(self.base, (p, b), (x,))
        self._f = f

    def forward(self, x: torch.Tensor, shared: bool = False) -> torch.Tensor:
        return vmap(self._f, in_dims=(0, 0, None if shared else 0))(self.p, self.b, x)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ps = [self.p[k].requires_grad_(True) for k in self.names]
        loss = _ce(self.forward(x), y)
        grads = torch.autograd.grad(loss.sum(), ps)
        hp = self.hp
        self.t += 1
        with torch.no_grad():
            for k, p, g in zip(self.names, ps, grads):
                p.requires_grad_(False)
                lr = (self.lr * self.mult[k]).view(-1, *([1] * (p.dim() - 1)))
                if hp.opt == "sgd":
                    if hp.sgd_wd:
                        g = g.add(p, alpha=hp.sgd_wd)
                    buf = self.s1[k]
                    if self.t == 1:
                        buf.copy_(g)
                    else:
                        buf.mul_(hp.momentum).add_(g)
                    p.sub_(lr * buf)
                else:
                    b1, b2 = hp.betas
                    p.mul_(1 - lr * hp.adam_wd)
                    self.s1[k].mul_(b1).add_(g, alpha=1 - b1)
                    self.s2[k].mul_(b2).addcmul_(g, g, value=1 - b2)
                    bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
                    den = (self.s2[k].sqrt() / math.sqrt(bc2)).add_(hp.eps)
                    p.sub_((lr / bc1) * self.s1[k] / den)
        return loss.detach()

    def keep(self, ok: torch.Tensor) -> None:
        idx = ok.nonzero().flatten()
        for d in (self.p, self.b, self.s1, self.s2):
            for k in list(d):
                d[k] = d[k][idx].contiguous()
        self.lr = self.lr[idx]
        self.alive = self.alive[idx]

    def finite(self) -> torch.Tensor:
        ok = torch.ones(len(self.alive), dtype=torch.bool, device=self.device)
        for v in self.p.values():
            ok &= torch.isfinite(v.flatten(1)).all(1)
        return ok

    @torch.no_grad()
    def evaluate(self, task: Task, idx: torch.Tensor, split: str, chunk: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-copy mean cross-entropy and accuracy (top-1) on ``idx`` of ``split``."""
        self.base.eval()
        try:
            tot = torch.zeros(len(self.alive), dtype=torch.float64, device=self.device)
            hit = torch.zeros(len(self.alive), dtype=torch.float64, device=self.device)
            for i in range(0, len(idx), chunk):
                x, y = task.get(idx[i:i + chunk], split)
                out = self.forward(x, shared=True)
                yy = y.unsqueeze(0).expand(out.shape[0], *y.shape)
                tot += _ce(out, yy).double() * len(y)
                hit += _acc(out, yy).double() * len(y)
            tot /= len(idx)
            hit /= len(idx)
        finally:
            self.base.train()
        return torch.where(torch.isfinite(tot), tot, torch.full_like(tot, math.inf)), hit


@torch.no_grad()
def check_batched(tr: VTrainer, models: list[nn.Module], task: Task, idx: torch.Tensor,
                  device: str) -> None:
    """The batched forward must reproduce each model's own forward (first and last copy, on
    their first minibatch, on copies so that no BatchNorm statistics move); raises if not."""
    x, _ = task.get(idx)
    out = tr.forward(x)
    for i in {0, len(models) - 1}:
        ref = copy.deepcopy(models[i]).to(device).train()(x[i])
        if not torch.allclose(out[i], ref, rtol=1e-3, atol=1e-5 * (1 + float(ref.abs().max()))):
            raise RuntimeError(f"batched forward differs from the model's own "
                               f"(max {float((out[i] - ref).abs().max()):.3g})")


def _optimizer(model: nn.Module, lr: float, hp: Hyper, mult: dict) -> torch.optim.Optimizer:
    groups: dict[float, list] = {}
    for n, p in model.named_parameters():
        groups.setdefault(float(mult.get(n, 1.0)), []).append(p)
    pg = [{"params": ps, "lr": lr * m} for m, ps in groups.items()]
    if hp.opt == "sgd":
        return torch.optim.SGD(pg, lr=lr, momentum=hp.momentum, weight_decay=hp.sgd_wd)
    return torch.optim.AdamW(pg, lr=lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.adam_wd)


def _to_dev(task: Task, device: str) -> None:
    for k, v in list(task.data.items()):
        if isinstance(v, torch.Tensor) and v.device.type != torch.device(device).type:
            task.data[k] = v.to(device)


def train_copies(task: Task, models: list[nn.Module], lrs: list[float], seeds: list[int],
                 hp: Hyper, mult: dict, device: str, engine: str = "auto") -> dict:
    """Train copy ``i`` (``models[i]``, ``lrs[i]``, the minibatches of ``seeds[i]``) for the
    task's steps; returns per-copy final losses per evaluation set (+inf when diverged) and the
    engine used."""
    _to_dev(task, device)
    T = task.n_steps()
    uniq = sorted(set(seeds))
    samp = torch.stack([task.sampler(s) for s in uniq]).to(device)       # (S, T, B)
    row = torch.tensor([uniq.index(s) for s in seeds], device=device)
    sets = {k: v.to(device) for k, v in task.eval_sets().items()}
    chunk = 64 if task.kind == "lm" else 512
    M = len(models)
    res = {k: np.full(M, math.inf) for k in sets}
    res.update({f"{k}_acc": np.zeros(M) for k in sets})
    if engine in ("auto", "vmap"):
        try:
            tr = VTrainer(models, lrs, hp, mult, device)
            check_batched(tr, models, task, samp[row, 0], device)
            for t in range(T):
                x, y = task.get(samp[row[tr.alive], t])
                loss = tr.step(x, y)
                ok = torch.isfinite(loss)
                if t % 8 == 7 or t == T - 1:
                    ok &= tr.finite()
                if not bool(ok.all()):
                    tr.keep(ok)
                    if len(tr.alive) == 0:
                        break
            if len(tr.alive):
                alive = tr.alive.cpu().numpy()
                for k, idx in sets.items():
                    lo, acc = tr.evaluate(task, idx, k, chunk)
                    res[k][alive] = lo.cpu().numpy()
                    res[f"{k}_acc"][alive] = acc.cpu().numpy()
            return {**res, "engine": "vmap"}
        except Exception as e:          # not batchable: one torch.optim run per copy
            if engine == "vmap":
                raise
            note = f"vmap failed ({type(e).__name__}: {str(e)[:120]}); torch.optim loop"
    else:
        note = "torch.optim loop"
    for i, (m0, lr, s) in enumerate(zip(models, lrs, seeds)):
        m = copy.deepcopy(m0).to(device).train()
        o = _optimizer(m, lr, hp, mult)
        ok = True
        for t in range(T):
            x, y = task.get(samp[row[i], t])
            loss = _ce(m(x).unsqueeze(0), y.unsqueeze(0))[0]
            if not torch.isfinite(loss):
                ok = False
                break
            o.zero_grad(set_to_none=True)
            loss.backward()
            o.step()
        if not ok:
            continue
        m.eval()
        with torch.no_grad():
            for k, idx in sets.items():
                tot = hit = 0.0
                for j in range(0, len(idx), chunk):
                    x, y = task.get(idx[j:j + chunk], k)
                    out = m(x).unsqueeze(0)
                    tot += float(_ce(out, y.unsqueeze(0))[0]) * len(y)
                    hit += float(_acc(out, y.unsqueeze(0))[0]) * len(y)
                v = tot / len(idx)
                res[k][i] = v if math.isfinite(v) else math.inf
                res[f"{k}_acc"][i] = hit / len(idx)
    return {**res, "engine": note}


# ---------------------------------------------------------------------------------------------
# learning-rate sweeps
# ---------------------------------------------------------------------------------------------

_BUILT: dict = {}

LR_CENTER = {"sgd": -3.5, "adamw": -7.5}       # the first grid: 2^(c-3.5) .. 2^(c+3.5)


def fit_log2_lr(exps: list[int], med: np.ndarray) -> float:
    """Sub-grid best rate: vertex of the parabola through log(loss) at the best rate and its
    two neighbours (the grid point itself at an edge or when the fit is not convex)."""
    b = int(np.argmin(med))
    if b == 0 or b == len(med) - 1 or not np.all(np.isfinite(med[b - 1:b + 2])):
        return float(exps[b])
    y0, y1, y2 = np.log(med[b - 1:b + 2])
    den = y0 - 2 * y1 + y2
    if den <= 0:
        return float(exps[b])
    return float(exps[b] + 0.5 * (y0 - y2) / den)


def _grid_point(k: int, step: float) -> float | int:
    """The k-th rate exponent of a grid with spacing ``step`` (an int where it is one, so a
    2x grid's JSON is unchanged)."""
    e = k * step
    return int(e) if float(e).is_integer() else e


def sweep(task: Task, method: str, opt: str, seeds: list[int], n_lr: int, device: str,
          max_widen: int = 3, say: Callable[[str], None] = print, engine: str = "auto",
          include: Sequence[float | None] = (), step: float = 1.0) -> dict:
    """One (task, method, optimizer): the LR grid, widened while the best rate (median over
    seeds of the ``task.select`` loss) is at an edge; the reported loss (``best``, ``se``) is
    ``task.metric``'s at that rate.  ``include``: log2 rates the grid must reach (the
    framework default's chosen rate, so that every method is measured there too, and
    ``--lr-include``'s; None entries ignored).  ``step``:
    the grid's spacing in octaves (1: rates 2x apart; 0.5: sqrt(2) apart, for comparisons
    that a 2x grid's placement could decide)."""
    hp = Hyper(opt)
    calib = {s: task.get(task.sampler(s)[0].to("cpu") if task.kind != "lm" else
                         task.sampler(s)[0])[0].cpu() for s in seeds}
    _to_cpu_data = {k: v.cpu() for k, v in task.data.items() if isinstance(v, torch.Tensor)}
    task.data.update(_to_cpu_data)
    built = {}
    for s in seeds:        # every method but muP builds the same model for both optimizers
        per_opt = method in PER_OPTIMIZER or method.startswith("pfx_ax:")
        key = (task.name, method, s, opt if per_opt else "")
        if key not in _BUILT:
            _BUILT.clear() if len(_BUILT) > 64 else None
            _BUILT[key] = build(task, method, s, calib[s], opt)
        built[s] = _BUILT[key]
    mult = built[seeds[0]][1]
    c = LR_CENTER[opt]
    lo = int(math.ceil((c - n_lr * step / 2) / step + 0.5))
    exps = [_grid_point(k, step) for k in range(lo, lo + n_lr)]
    reach = [e for e in include if e is not None]
    if reach:
        k0 = min([lo] + [math.floor(e / step) for e in reach])
        k1 = max([lo + n_lr - 1] + [math.ceil(e / step) for e in reach])
        exps = [_grid_point(k, step) for k in range(k0, k1 + 1)]
    losses: dict[int, dict[str, np.ndarray]] = {}
    engines = set()
    factors: dict[float, list[float]] = {}

    def run(new: list[int]) -> None:
        models, lrs, sd = [], [], []
        for e in new:
            for s in seeds:
                models.append(settled(task, method, s, calib[s], opt, 2.0 ** e, built[s][0],
                                      factors, device))
                lrs.append(2.0 ** e)
                sd.append(s)
        r = train_copies(task, models, lrs, sd, hp, mult, device, engine)
        engines.add(r["engine"])
        for j, e in enumerate(new):
            sl = slice(j * len(seeds), (j + 1) * len(seeds))
            losses[e] = {k: r[k][sl] for k in r if k != "engine"}

    run(exps)
    widened = 0
    key = task.select
    while True:
        grid = sorted(losses)
        med = np.array([np.median(losses[e][key]) for e in grid])
        b = int(np.argmin(med)) if np.isfinite(med).any() else 0   # all diverged: go lower
        if widened >= max_widen:
            break
        if b == 0:
            new = [_grid_point(round(grid[0] / step) - i, step) for i in (2, 1)]
        elif b == len(grid) - 1:
            new = [_grid_point(round(grid[-1] / step) + i, step) for i in (1, 2)]
        else:
            break
        widened += 1
        say(f"    {task.name} {method} {opt}: best rate 2^{grid[b]} at the edge: adding "
            f"2^{new[0]}, 2^{new[1]}")
        run(new)
    out = summarize(losses, key, task.metric, widened, engines, mult)
    if factors:     # lr='auto''s first SGD step: log2 of the factor per rate and seed
        sugg = factors.pop("suggested")
        out["first_step_factor_log2"] = {str(k): [round(math.log2(f), 3) for f in v]
                                         for k, v in sorted(factors.items())}
        out["suggested_sgd_log2"] = {str(s): round(math.log2(v), 3) for s, v in sugg.items()}
    return out


def summarize(losses: dict, key: str, rep: str, widened: int = 0, engines: Any = (),
              mult: dict | None = None) -> dict:
    """A cell from per-rate losses (``losses[log2 rate][split]``: one value per seed): the
    rate chosen on ``key`` (median over seeds), the ``rep`` loss there, its fit and edges."""
    mult = mult or {}
    grid = sorted(losses)
    S = np.stack([losses[e][key] for e in grid])                  # (n_lr, seeds): selects
    sel = np.median(S, axis=1)
    b = int(np.argmin(sel)) if np.isfinite(sel).any() else 0
    L = np.stack([losses[e][rep] for e in grid])                  # (n_lr, seeds): reported
    med = np.median(L, axis=1)
    out = {"lr_log2": grid, "losses": {k: np.stack([losses[e][k] for e in grid])
                                       for k in losses[grid[0]]},
           "median": med, "select_median": sel, **at_rate(L, b), "best_lr_log2": grid[b],
           "best_lr_log2_fit": fit_log2_lr(grid, sel) if np.isfinite(sel[b]) else None,
           "at_edge": b in (0, len(grid) - 1), "widened": widened, "metric": rep,
           "select": key, "engine": sorted(engines),
           "lr_mult": {k: v for k, v in mult.items() if v != 1.0}}
    if f"{rep}_acc" in losses[grid[0]]:
        out["acc"] = float(np.median(out["losses"][f"{rep}_acc"][b]))
    out["own_best"] = float(np.nanmin(np.where(np.isfinite(med), med, np.nan))) \
        if np.isfinite(med).any() else math.inf       # the reported loss at its own best rate
    for k in out["losses"]:
        if k != rep and not k.endswith("_acc"):
            out[f"{k}_at_best"] = float(np.median(out["losses"][k][b]))
    return out


#: methods whose result keeps lr='auto''s first step pending (the library's defaults): under
#: SGD the suite's batched trainer has no torch.optim step to hook, so each rate's copy is built
#: afresh and its first step done by precondfx.settle_rate at that rate (the ceiling acts only
#: above the measured suggested rate; tests/pytorch/test_first_step.py checks that settle_rate
#: and a torch.optim first step give one factor)
#: method -> C.ceiling_margin's octaves
SETTLED = {"pfx": 0.0, "pfx_margin1": 1.0, "pfx_margin2": 2.0}


def settled(task: Task, method: str, seed: int, calib: torch.Tensor, opt: str, lr: float,
            model: nn.Module, factors: dict, device: str = "cpu") -> nn.Module:
    """``model`` (the cached build) as its first step at ``lr`` leaves it: for ``SETTLED``
    methods under SGD a fresh build settled at ``lr`` on ``device`` (its factor recorded in
    ``factors``); otherwise ``model`` itself (under AdamW ``lr='auto'`` keeps the storage)."""
    if method not in SETTLED or opt != "sgd":
        return model
    import precondfx
    from precondfx.pytorch.first_step import headroom
    from precondfx.pytorch.lr_target import TOLERANCE
    mom = Hyper(opt).momentum   # the loop's, read as torch.optim.SGD's first step reads it
    seen = factors.setdefault("suggested", {})
    first = seen.get(seed)      # the seed's suggested rate, measured by an earlier settle
    ceiling = first * headroom({"momentum": mom}) if first else None
    if ceiling and lr <= ceiling * 2.0 ** (TOLERANCE + SETTLED[method]):   # storage kept:
        factors.setdefault(math.log2(lr), []).append(1.0)   # the cached build is that model
        return model
    fresh, _ = build(task, method, seed, calib, opt)
    fresh.to(device)            # the kept batch follows the model: measured where it trains
    with C.ceiling_margin(SETTLED[method]):
        sec = precondfx.settle_rate(fresh, lr, "sgd", momentum=mom)
    if sec.get("suggested_before"):
        seen[seed] = float(sec["suggested_before"])
    factors.setdefault(math.log2(lr), []).append(float(sec.get("factor", 1.0)))
    return fresh.train()


def at_rate(L: np.ndarray, b: int) -> dict:
    """``best`` (median over seeds of row ``b`` of ``L``) and ``se`` (its standard error over
    seeds; inf when a seed diverged)."""
    row = L[b]
    fin = row[np.isfinite(row)]
    se = (float(np.std(row, ddof=1) / math.sqrt(len(row)))
          if len(fin) == len(row) and len(row) > 1 else math.inf)
    return {"best": float(np.median(row)), "se": se}


def at_default_rate(cells: dict) -> None:
    """Every method's reported loss (and accuracy) at the framework default's chosen rate,
    stored as ``cells[m]['at_default_lr']`` (None where its grid does not reach that rate)."""
    d = cells.get("default")
    if not d or "best_lr_log2" not in d:
        return
    e = d["best_lr_log2"]
    for m, r in cells.items():
        if "lr_log2" not in r:
            continue
        if e not in r["lr_log2"]:
            r["at_default_lr"] = None
            continue
        i = r["lr_log2"].index(e)
        L = np.asarray(r["losses"][r["metric"]], float)
        v = {"lr_log2": e, **at_rate(L, i)}
        acc = r["losses"].get(f"{r['metric']}_acc")
        if acc is not None:
            v["acc"] = float(np.median(np.asarray(acc, float)[i]))
        r["at_default_lr"] = v


# ---------------------------------------------------------------------------------------------
# summaries, claims, tables, plots
# ---------------------------------------------------------------------------------------------

def _num(v: Any) -> float:
    return math.inf if v is None else float(v)       # JSON keeps +inf as null


def compare(a: dict | None, b: dict | None, k: float = 2.0) -> int:
    """-1: ``a`` lower than ``b`` beyond ``k`` combined standard errors; +1 higher; 0 tie."""
    la = _num(a.get("best")) if a else math.inf
    lb = _num(b.get("best")) if b else math.inf
    if not math.isfinite(la) or not math.isfinite(lb):
        return 0 if la == lb else (1 if math.isfinite(lb) else -1)
    tol = k * math.hypot(min(_num(a.get("se")), 1e9), min(_num(b.get("se")), 1e9))
    d = la - lb
    return -1 if d < -tol else (1 if d > tol else 0)


def lr_movement(results: dict, family: dict[str, str]) -> dict:
    """Per family and optimizer and method: best log2 LR per member, and its range (octaves).
    ``family``: task name -> family string (``mlp_width+mlp_depth`` for a shared member)."""
    fams: dict[str, list[str]] = {}
    for t, fam in family.items():
        for f in fam.split("+"):
            if f.endswith("_width") or f.endswith("_depth"):
                fams.setdefault(f, []).append(t)
    out: dict = {}
    for f, ts in fams.items():
        def member(t: str) -> int:
            return int(t.split("_w")[1].split("_")[0] if f.endswith("_width")
                       else t.split("_d")[-1])
        ts = sorted(ts, key=member)
        for opt in ("sgd", "adamw"):
            for m in sorted({m for t in ts for m in results.get(t, {}).get(opt, {})}):
                rs = [results[t][opt].get(m) for t in ts if t in results]
                if any(r is None or "best" not in r for r in rs):
                    continue
                g = [r["best_lr_log2"] for r in rs]
                fit = [r["best_lr_log2_fit"] for r in rs]
                members = [member(t) for t in ts]
                ok = [x for x in fit if x is not None]
                out.setdefault(f, {}).setdefault(opt, {})[m] = {
                    "members": members, "best_lr_log2": g, "best_lr_log2_fit": fit,
                    "octaves": max(g) - min(g), "octaves_fit": (max(ok) - min(ok)) if ok else None,
                    "any_at_edge": any(r["at_edge"] for r in rs)}
    return out


def claims(results: dict, tasks: list[str], move: dict) -> dict:
    """The checks of issue 11's 'What it must show', evaluated on what was run: for precondfx's
    default (``pfx``) and for every ``pfx_std*`` variant present (candidate defaults)."""
    out: dict = {}
    cands = ["pfx"] + sorted({m for per in results.values() for cells in per.values()
                              for m in cells if m.startswith(("pfx_std", "pfx_ws", "pfx_lr",
                                                              "pfx_pool"))})
    for cand in cands:
        sfx = "" if cand == "pfx" else f"[{cand}]"
        for opt in ("sgd", "adamw"):
            worse, better, lower, n = [], [], [], 0
            for t in tasks:
                r = results.get(t, {}).get(opt, {})
                if cand not in r or "default" not in r:
                    continue
                n += 1
                c = compare(r[cand], r["default"])
                if c > 0:
                    worse.append(t)
                if c < 0:
                    better.append(t)
                if _num(r[cand]["best"]) < _num(r["default"]["best"]):
                    lower.append(t)
            if n:
                out[f"default_vs_framework_{opt}{sfx}"] = {
                    "tasks": n, "worse_beyond_noise": worse, "better_beyond_noise": better,
                    "lower": lower, "never_worse": not worse, "better_on_half": 2 * len(better) >= n}
            # at the framework default's chosen rate (the user's rate)
            worse, better, n = [], [], 0
            for t in tasks:
                r = results.get(t, {}).get(opt, {})
                if cand not in r or "default" not in r or not r[cand].get("at_default_lr"):
                    continue
                n += 1
                c = compare(r[cand]["at_default_lr"], r["default"])
                (worse if c > 0 else better if c < 0 else []).append(t)
            if n:
                out[f"at_users_rate_{opt}{sfx}"] = {
                    "tasks": n, "worse_beyond_noise": worse, "better_beyond_noise": better,
                    "never_worse": not worse}
        g = results.get("gpt2", {})
        for opt in ("sgd", "adamw"):
            c = g.get(opt, {})
            if cand in c and "default" in c:
                out[f"gpt2_{opt}{sfx}"] = {
                    "pfx": c[cand]["best"], "pfx_se": c[cand]["se"],
                    "transformers_default": c["default"]["best"],
                    "transformers_default_se": c["default"]["se"],
                    "pfx_at_least_as_low": _num(c[cand]["best"]) <= _num(c["default"]["best"])}
    lim = {"mlp_width": 1, "mlp_depth": 2}
    out["lr_transfer"] = {f: {opt: {m: {"octaves": v["octaves"], "limit": lim[f],
                                        "holds": v["octaves"] <= lim[f]}
                                    for m, v in move.get(f, {}).get(opt, {}).items()}
                              for opt in ("sgd", "adamw")}
                          for f in lim if f in move}
    return out


def fmt(r: dict | None) -> str:
    if r is None:
        return "-"
    if "skipped" in r:
        return "skipped"
    if r.get("best") is None or not math.isfinite(r["best"]):
        return "diverged"
    se = f" ± {r['se']:.3g}" if r.get("se") is not None and math.isfinite(r["se"]) else ""
    edge = "!" if r["at_edge"] else ""
    acc = f" ({100 * r['acc']:.1f}%)" if r.get("acc") is not None and r.get("metric") == "test" \
        else ""
    return f"{r['best']:.4g}{se}{acc} @2^{r['best_lr_log2']}{edge}"


def fmt_at_default(r: dict | None) -> str:
    """A method's reported loss at the framework default's chosen rate."""
    if r is None or "at_default_lr" not in r:
        return "-"
    v = r["at_default_lr"]
    if v is None:
        return "not on grid"
    if v.get("best") is None or not math.isfinite(v["best"]):
        return "diverged"
    se = f" ± {v['se']:.3g}" if v.get("se") is not None and math.isfinite(v["se"]) else ""
    acc = f" ({100 * v['acc']:.1f}%)" if v.get("acc") is not None and r.get("metric") == "test" \
        else ""
    return f"{v['best']:.4g}{se}{acc}"


def markdown(payload: dict) -> str:
    res, lines = payload["results"], []
    methods = payload["methods"]
    if payload.get("merged_from"):
        lines.append(f"Merged from {', '.join(payload['merged_from'])}; commands: "
                     + "; ".join(f"`{c}`" for c in payload["command"]) + "\n")
    nseeds = sorted({len(r["losses"][r["metric"]][0]) for per in res.values()
                     for cells in per.values() for r in cells.values() if "losses" in r})
    lines.append(f"Size `{payload['size']}`, seeds per cell {nseeds}, device "
                 f"{payload['env']['device']}, wall {payload['wall_s']:.0f} s. Cells: median "
                 f"over seeds of the reported loss (column `metric`; `test`: the test split, "
                 f"with its accuracy; `heldout`: the LM test split) at the learning rate chosen "
                 f"on the `select` split (median over seeds), ± standard error over seeds @ "
                 f"log2 of that rate (`!`: still at the grid's edge after widening).\n")
    for opt in payload["optimizers"]:
        lines.append(f"### {opt}\n")
        lines.append("| task | metric | " + " | ".join(LABELS.get(m, m) for m in methods) + " |")
        lines.append("|---|---|" + "---|" * len(methods))
        for t, per in res.items():
            r = per.get(opt, {})
            metric = next((f"{v['metric']}" + (f" @{v['select']}" if v.get("select") else "")
                           for v in r.values() if "metric" in v), "")
            lines.append(f"| {t} | {metric} | " + " | ".join(fmt(r.get(m)) for m in methods) + " |")
        lines.append("")
        if any("at_default_lr" in c for per in res.values() for c in per.get(opt, {}).values()):
            lines.append(f"#### {opt}: at the framework default's chosen rate\n")
            lines.append("| task | rate | " + " | ".join(LABELS.get(m, m) for m in methods) + " |")
            lines.append("|---|---|" + "---|" * len(methods))
            for t, per in res.items():
                r = per.get(opt, {})
                d = r.get("default", {}).get("best_lr_log2")
                lines.append(f"| {t} | 2^{d} | " + " | ".join(fmt_at_default(r.get(m))
                                                             for m in methods) + " |")
            lines.append("")
    held = [(t, o) for t, per in res.items() for o in payload["optimizers"]
            if any(c.get("select") == "val" for c in per.get(o, {}).values())]
    if held:
        lines.append("### Per task: rate chosen on validation, and at the framework default's "
                     "rate\n")
        lines.append("| task | optimizer | method | test loss ± se | acc | rate (log2) | "
                     "test loss at the default's rate ± se | acc there |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for t, o in held:
            cells = res[t][o]
            d = cells.get("default", {}).get("best_lr_log2")
            for m in methods:
                r = cells.get(m)
                if not r or "best" not in r:
                    continue
                se = f" ± {r['se']:.3g}" if r.get("se") is not None and \
                    math.isfinite(r["se"]) else ""
                acc = f"{100 * r['acc']:.1f}%" if r.get("acc") is not None and \
                    r.get("metric") == "test" else "-"
                v = r.get("at_default_lr")
                if v and v.get("best") is not None and math.isfinite(v["best"]):
                    vse = f" ± {v['se']:.3g}" if v.get("se") is not None and \
                        math.isfinite(v["se"]) else ""
                    vd = f"{v['best']:.4g}{vse} (2^{d})"
                    va = f"{100 * v['acc']:.1f}%" if v.get("acc") is not None and \
                        r.get("metric") == "test" else "-"
                else:
                    vd, va = ("not on grid" if v is None and "at_default_lr" in r else "-"), "-"
                lines.append(f"| {t} | {o} | {LABELS.get(m, m)} | {r['best']:.4g}{se} | {acc} | "
                             f"{r['best_lr_log2']}{'!' if r['at_edge'] else ''} | {vd} | {va} |")
        lines.append("")
    if payload["lr_movement"]:
        lines.append("### Best learning rate across widths and depths (octaves)\n")
        lines.append("| family | optimizer | method | members | best log2 LR | octaves (grid) | octaves (fit) |")
        lines.append("|---|---|---|---|---|---|---|")
        for f, per in payload["lr_movement"].items():
            for opt, pm in per.items():
                for m, v in pm.items():
                    fit = v["octaves_fit"]
                    lines.append(f"| {f} | {opt} | {LABELS.get(m, m)} | {v['members']} | "
                                 f"{v['best_lr_log2']} | {v['octaves']} | "
                                 f"{'-' if fit is None else f'{fit:.1f}'} |")
        lines.append("")
    lines.append("### Claims of issue 11 on these runs\n")
    for k, v in payload["claims"].items():
        lines.append(f"- `{k}`: {v}")
    if payload["notes"]:
        lines.append("\n### Notes\n")
        for k, v in payload["notes"].items():
            lines.append(f"- {k}: {v}")
    return "\n".join(lines) + "\n"


def plot(payload: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = payload["results"]
    tasks = list(res)
    opts = payload["optimizers"]
    fig, axes = plt.subplots(len(tasks), len(opts), figsize=(5.5 * len(opts), 3.2 * len(tasks)),
                             squeeze=False)
    for i, t in enumerate(tasks):
        for j, opt in enumerate(opts):
            ax = axes[i, j]
            for k, (m, r) in enumerate(res[t].get(opt, {}).items()):
                if "median" not in r:
                    continue
                med = np.array([v if v is not None else np.nan for v in r["median"]], float)
                ls = "-" if m in ("default", "pfx") or k < 10 else "--"
                ax.plot(r["lr_log2"], med, ls, marker="o", ms=2.5, lw=1.6 if m in
                        ("default", "pfx") else 0.8, label=LABELS.get(m, m))
            ax.set_yscale("log")
            ax.set_xlabel("log2 learning rate")
            ax.set_ylabel("median final loss")
            ax.set_title(f"{t} — {opt}", fontsize=9)
            ax.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_bars(payload: dict, path: str) -> None:
    """Best loss ± standard error per method, one panel per (task, optimizer), framework
    default and precondfx default highlighted, the default's level as a dashed line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = [(t, o, per[o]) for t, per in payload["results"].items() for o in payload["optimizers"]
             if per.get(o)]
    if not cells:
        return
    ncol = min(2, len(cells))
    nrow = -(-len(cells) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.5 * ncol, 0.3 * max(len(c[2]) for c in cells)
                                                 * nrow + 1.2 * nrow), squeeze=False)
    for ax in axes.flat[len(cells):]:
        ax.axis("off")
    for ax, (t, o, per) in zip(axes.flat, cells):
        ms = [m for m in per if per[m].get("best") is not None]
        v = [per[m]["best"] for m in ms]
        e = [per[m]["se"] if per[m].get("se") is not None else 0 for m in ms]
        col = ["C3" if m == "pfx" else "C0" if m == "default" else "0.6" for m in ms]
        ax.barh(range(len(ms)), v, xerr=e, color=col)
        ax.set_yticks(range(len(ms)))
        ax.set_yticklabels([f"{LABELS.get(m, m)} (2^{per[m]['best_lr_log2']})" for m in ms],
                           fontsize=7)
        if "default" in per and per["default"].get("best") is not None:
            ax.axvline(per["default"]["best"], color="C0", ls="--", lw=0.8)
        if v and min(v) > 0.5 * max(v):          # losses far from 0: zoom on the differences
            ax.set_xlim(left=0.95 * min(x - y for x, y in zip(v, e)))
        ax.invert_yaxis()
        ax.set_xlabel(f"median final {per[ms[0]]['metric'] if ms else ''} loss at the best LR")
        ax.set_title(f"{t} — {o}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def write_outputs(payload: dict, out_base: str, say: Callable[[str], None] = print) -> None:
    """The .md table and the figures of a payload (already JSON-clean)."""
    with open(out_base + ".md", "w") as f:
        f.write(markdown(payload))
    try:
        plot(payload, out_base + ".png")
        plot_bars(payload, out_base + "_bars.png")
    except Exception as e:  # the JSON is the result
        say(f"plot skipped: {e}")


def replot(path: str) -> dict:
    import json
    with open(path) as f:
        payload = json.load(f)
    fam = {t: v["family"] for t, v in payload["tasks"].items()}
    payload["lr_movement"] = lr_movement(payload["results"], fam)
    payload["claims"] = claims(payload["results"], list(fam), payload["lr_movement"])
    C.write_json(path, payload)
    write_outputs(C.clean(payload), path[:-len(".json")])
    return payload


def partial_payload(p: dict, path: str) -> dict:
    """A run's ``.partial.json`` (results and notes only: the run was stopped) completed
    into a payload ``merge`` can read: tasks, methods and optimizers from its results, the
    other fields of the ``--cpu`` size, its command marked as partial."""
    if "tasks" in p:
        return p
    res = p["results"]
    known = {t.name: t for t in all_tasks(dict(SIZES["cpu"], libsvm=False))}
    for per in res.values():
        for cells in per.values():
            at_default_rate(cells)
    methods = list(dict.fromkeys(m for per in res.values() for c in per.values() for m in c))
    opts = list(dict.fromkeys(o for per in res.values() for o in per))
    return {"size": "cpu", "config": SIZES["cpu"], "results": res, "notes": p.get("notes", {}),
            "tasks": {t: {"family": known[t].family if t in known else "", "metric":
                          known[t].metric if t in known else "", "select": "val"}
                      for t in res},
            "methods": methods, "optimizers": opts, "env": C.env_info(), "wall_s": 0.0,
            "command": f"(stopped run; partial results from {os.path.basename(path)})"}


def merge(paths: list[str], out_base: str) -> dict:
    """One result from several runs of the suite (for example the CPU-reduced runs, each with
    its own tasks and methods): results, tasks, methods and notes united (a later file's cell
    replaces an earlier one), LR movement and claims recomputed."""
    payloads = _payloads(paths)
    out = dict(payloads[0])
    out["results"], out["tasks"], out["notes"] = {}, {}, {}
    methods: list[str] = []
    opts: list[str] = []
    for p in payloads:
        for t, per in p["results"].items():
            for o, cells in per.items():
                out["results"].setdefault(t, {}).setdefault(o, {}).update(cells)
        out["tasks"].update(p["tasks"])
        out["notes"].update(p.get("notes", {}))
        methods += [m for m in p["methods"] if m not in methods]
        opts += [o for o in p["optimizers"] if o not in opts]
    out["methods"], out["optimizers"] = methods, opts
    for per in out["results"].values():         # the default's rate may come from another file
        for cells in per.values():
            at_default_rate(cells)
    out["command"] = [p.get("command") for p in payloads]
    out["wall_s"] = sum(p.get("wall_s", 0) for p in payloads)
    out["merged_from"] = [os.path.basename(p) for p in paths]
    return _finish(out, out_base)


def _finish(out: dict, out_base: str) -> dict:
    """LR movement and claims recomputed on ``out``'s results, then JSON, tables and plots."""
    fam = {t: v["family"] for t, v in out["tasks"].items()}
    out["lr_movement"] = lr_movement(out["results"], fam)
    out["claims"] = claims(out["results"], list(fam), out["lr_movement"])
    C.write_json(out_base + ".json", out)
    write_outputs(C.clean(out), out_base)
    return out


def _payloads(paths: list[str]) -> list[dict]:
    import json
    payloads = []
    for p in paths:
        with open(p) as f:
            payloads.append(partial_payload(json.load(f), p))
    return payloads


def merge_seeds(paths: list[str], out_base: str) -> dict:
    """One result from runs of the same tasks and methods on different seeds (``--first-seed``):
    each cell's per-seed losses are joined on the rates every run trained, and the rate chosen
    again on the median over all seeds (``summarize``); the rest as ``merge``."""
    payloads = _payloads(paths)
    out = merge(paths, out_base)
    for t, per in out["results"].items():
        for o, cells in per.items():
            for m in list(cells):
                runs = [q["results"][t][o][m] for q in payloads
                        if m in q["results"].get(t, {}).get(o, {})]
                if len(runs) < 2:
                    continue
                rates = sorted(set.intersection(*(set(r["lr_log2"]) for r in runs)))
                losses = {e: {k: np.concatenate([np.asarray(r["losses"][k], dtype=float)
                                                 [r["lr_log2"].index(e)] for r in runs])
                              for k in runs[0]["losses"]} for e in rates}
                c = cells[m]
                cells[m] = summarize(losses, c["select"], c["metric"],
                                     max(r.get("widened", 0) for r in runs),
                                     sorted({x for r in runs for x in r.get("engine", [])}),
                                     c.get("lr_mult"))
            at_default_rate(cells)
    out["seeds"] = sorted({s for q in payloads for s in q.get("seeds") or []})
    return _finish(out, out_base)


def select(tasks: list[Task], spec: list[str]) -> list[Task]:
    out = []
    for t in tasks:
        if any(t.name == s or t.name.startswith(s + "/") or t.family.startswith(s)
               for s in spec):
            out.append(t)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI smoke run (< 30 s)")
    ap.add_argument("--cpu", action="store_true", help="the CPU held-out configuration (every "
                    "run of it a few minutes of one core): digits MLP, the max-pool CNNs with "
                    "and without BatchNorm, the strided BatchNorm CNN, GPT-2, ViT")
    ap.add_argument("--cpu-small", action="store_true", help="the CPU-reduced configuration")
    ap.add_argument("--cpu-lr", action="store_true", help="the CPU learning-rate transfer "
                    "configuration (MLP widths 32-2048, depths 1-16)")
    ap.add_argument("--tasks", default="", help="comma list of task names or family prefixes")
    ap.add_argument("--methods", default="", help="comma list (default: main methods; "
                    "'ablation' adds ABLATIONS)")
    ap.add_argument("--optimizers", default="sgd,adamw")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--epochs", type=float, default=None, help="epochs of the classification "
                    "tasks (default: the size's)")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="seeds first_seed .. first_seed + seeds - 1 (default 0): another set "
                         "of draws and data orders")
    ap.add_argument("--lr-step", type=float, default=1.0,
                    help="the rate grid's spacing in octaves (default 1: rates 2x apart)")
    ap.add_argument("--n-lr", type=int, default=None)
    ap.add_argument("--max-widen", type=int, default=3)
    ap.add_argument("--lr-include", type=float, nargs="*", default=[], metavar="LOG2",
                    help="log2 rates every grid must reach (a grid that another run widened, "
                         "for a comparison on the same rates: a ceiling flattens the curve above "
                         "it, so the grid is not widened below it on its own)")
    ap.add_argument("--engine", default="auto", choices=["auto", "vmap", "loop"])
    ap.add_argument("--list", action="store_true", help="print the tasks and exit")
    ap.add_argument("--replot", default="", help="re-make the .md and figures of a result JSON")
    ap.add_argument("--merge-seeds", nargs="+", default=None, metavar="JSON",
                    help="join runs of the same cells on different seeds (--first-seed) and "
                         "choose each rate again over all seeds")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="unite result JSONs into OUT/train_suite_TAG.*")
    C.add_run_args(ap)
    args = C.parse_run_args(ap, argv)
    if args.replot:
        return replot(args.replot)
    if args.merge:
        return merge(args.merge, os.path.join(args.out, "train_suite_" + (args.tag or "merged")))
    if args.merge_seeds:
        return merge_seeds(args.merge_seeds,
                           os.path.join(args.out, "train_suite_" + (args.tag or "merged")))
    size = ("quick" if args.quick else "cpu_small" if args.cpu_small else
            "cpu_lr" if args.cpu_lr else "cpu" if args.cpu else "full")
    cfg = dict(SIZES[size])
    if args.epochs:
        cfg["epochs"] = args.epochs
    if args.device.startswith("cuda"):
        # full float32 matmuls: with TF32 the batched (vmap) run differs from the one-model
        # check beyond its tolerance and every sweep falls back to the slow loop (seen on an
        # H200: 20 s per MLP family without TF32, over 400 s with it)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    tag = args.tag or ("quick" if args.quick else "cpu" if args.cpu_small else
                       "heldout_cpu" if args.cpu else "")
    say = C.Progress("train_suite")
    spec = [s for s in args.tasks.split(",") if s] or DEFAULT_TASKS[size]
    need_libsvm = any(s.startswith("libsvm") for s in spec)
    tasks = select(all_tasks(dict(cfg, libsvm=need_libsvm)), spec)
    if args.list:
        for t in tasks:
            print(f"{t.name:28s} family={t.family:24s} steps={t.n_steps()} batch={t.batch}")
        return {}
    methods = [m for m in args.methods.split(",") if m] or list(MAIN_METHODS)
    if "ablation" in methods:
        methods = [m for m in methods if m != "ablation"] + ABLATIONS
    methods = list(dict.fromkeys(methods))
    if "default" in methods:       # first: every other method's grid reaches its chosen rate
        methods = ["default"] + [m for m in methods if m != "default"]
    if args.quick:
        methods = methods if args.methods else ["default", "pfx"]
        args.max_widen = min(args.max_widen, 1)
    opts = [o for o in args.optimizers.split(",") if o]
    n_seeds = args.seeds or cfg["seeds"]
    seeds = list(range(args.first_seed, args.first_seed + n_seeds))
    n_lr = args.n_lr or cfg["n_lr"]
    say(f"size {size}: {len(tasks)} tasks, methods {methods}, optimizers {opts}, seeds "
        f"{len(seeds)}, {n_lr} rates, device {args.device}")
    results: dict = {}
    notes: dict = {}
    out_base = os.path.join(args.out, "train_suite" + (f"_{tag}" if tag else ""))
    for t in tasks:
        results[t.name] = {}
        for opt in opts:
            results[t.name][opt] = {}
            for m in methods:
                inc = results[t.name][opt].get("default", {}).get("best_lr_log2")
                n = method_note(t, m)
                if n:
                    notes[f"{t.name}/{m}"] = n
                    continue
                try:
                    r = sweep(t, m, opt, seeds, n_lr, args.device, args.max_widen, say,
                              args.engine, include=[inc] + args.lr_include, step=args.lr_step)
                except Exception as e:
                    if args.quick:
                        raise
                    notes[f"{t.name}/{m}/{opt}"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
                    say(f"  {t.name} {m} {opt}: FAILED {type(e).__name__}: {str(e)[:200]}")
                    continue
                results[t.name][opt][m] = r
                say(f"  {t.name:18s} {opt:5s} {m:18s} {fmt(r)}   [{','.join(r['engine'])[:40]}]")
                at_default_rate(results[t.name][opt])
                C.write_json(out_base + ".partial.json", {"results": results, "notes": notes})
            at_default_rate(results[t.name][opt])
        C.write_json(out_base + ".partial.json", {"results": results, "notes": notes})
    move = lr_movement(results, {t.name: t.family for t in tasks})
    payload = {"size": size, "config": cfg, "tasks": {t.name: {
        "family": t.family, "steps": t.n_steps(), "batch": t.batch, "kind": t.kind,
        "metric": t.metric, "select": t.select, "hf": t.hf} for t in tasks},
        "methods": methods, "optimizers": opts, "seeds": seeds, "n_lr": n_lr,
        "hyper": {o: Hyper(o).__dict__ for o in opts}, "lr_center_log2": LR_CENTER,
        "results": results, "lr_movement": move, "notes": notes, "env": C.env_info(),
        "command": "python bench/train_suite.py " + " ".join(argv if argv is not None
                                                              else sys.argv[1:])}
    payload["claims"] = claims(results, [t.name for t in tasks], move)
    payload["wall_s"] = say.elapsed()
    C.write_json(out_base + ".json", payload)
    try:
        os.remove(out_base + ".partial.json")
    except OSError:
        pass
    clean = C.clean(payload)
    write_outputs(clean, out_base, say)
    print(markdown(clean))
    say(f"wrote {out_base}.json/.md/.png/_bars.png")
    return payload


if __name__ == "__main__":
    main()
