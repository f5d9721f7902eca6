"""A zoo of small PyTorch models for precondfx's tests and benchmarks (not shipped: the
demo's own models are in ``precondfx.demo``, registered here too).

Every builder is a function ``builder(seed: int = 0, **options) -> (model, sample)``:

* ``model`` is a freshly initialised ``nn.Module`` (left in training mode);
* ``sample`` is what the model is called with: a tensor (``model(sample)``), a
  tuple of positional inputs (``model(*sample)``) or a dict of keyword inputs
  (``model(**sample)``).  A dict sample may also carry non-tensor keyword
  arguments the call needs (e.g. ``use_cache=False`` for GPT-2).  Use
  :func:`call` to run a model on its sample and :func:`main_tensor` to pick
  the main output tensor (logits) out of whatever the model returns.

Builders are deterministic for a given ``seed`` (parameters and sample) and do
not disturb the caller's global RNG state.  The defaults are tiny: a forward and
backward pass on CPU takes a few milliseconds to tens of milliseconds.

The models are written in plain PyTorch (no torchvision / timm) and cover the
patterns the preconditioning pass has to deal with: max pools that can and
cannot be folded into a strided conv, BatchNorm and other normalisations,
residual adds, concatenations, transposed convs, depthwise convs, attention
(hand-written and ``nn.MultiheadAttention``), recurrent layers, tied and shared
weights, several inputs, keyword inputs, dict outputs and data-dependent
control flow.  Hugging Face ``transformers`` models (built from tiny configs,
no downloads) are registered only when ``transformers`` can be imported.

>>> from tests import zoo
>>> model, sample = zoo.build("mlp")
>>> zoo.main_tensor(zoo.call(model, sample)).shape
torch.Size([32, 10])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from precondfx import demo

__all__ = [
    "ZOO",
    "TAGS",
    "build",
    "names",
    "describe",
    "call",
    "main_tensor",
    "resnet50",
    "HAS_TRANSFORMERS",
]

Builder = Callable[..., tuple[nn.Module, Any]]

#: name -> builder.  Every builder takes ``seed`` plus keyword options and
#: returns ``(model, sample)``.
ZOO: dict[str, Builder] = {}

#: name -> tags describing the entry (e.g. ``"maxpool"``, ``"batchnorm"``,
#: ``"transformers"``, ``"data_dependent"``).
TAGS: dict[str, frozenset[str]] = {}

try:  # transformers' top-level import is lazy (about 0.5 s); models load on use.
    import transformers  # noqa: F401

    HAS_TRANSFORMERS = True
except ImportError:  # pragma: no cover - depends on the environment
    HAS_TRANSFORMERS = False


def _register(name: str, *tags: str) -> Callable[[Builder], Builder]:
    def deco(fn: Builder) -> Builder:
        if name in ZOO:
            raise ValueError(f"duplicate zoo entry {name!r}")
        ZOO[name] = fn
        TAGS[name] = frozenset(tags)
        return fn

    return deco


_seeded = demo._seeded


# ---------------------------------------------------------------------------
# public helpers
# ---------------------------------------------------------------------------


def names(include_transformers: bool = True) -> list[str]:
    """Names of the zoo entries, in registration order."""
    return [n for n in ZOO if include_transformers or "transformers" not in TAGS[n]]


def build(name: str, **kw: Any) -> tuple[nn.Module, Any]:
    """Build zoo entry ``name``; keyword options (``seed``, sizes) go to its builder."""
    try:
        builder = ZOO[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(ZOO)}") from None
    return builder(**kw)


def describe(name: str) -> str:
    """One-line description of zoo entry ``name`` (first line of its docstring)."""
    doc = ZOO[name].__doc__ or ""
    return doc.strip().splitlines()[0] if doc.strip() else name


def call(model: nn.Module, sample: Any) -> Any:
    """Call ``model`` on a zoo sample (tensor, tuple of positional inputs or kwargs dict)."""
    if isinstance(sample, dict):
        return model(**sample)
    if isinstance(sample, (tuple, list)):
        return model(*sample)
    return model(sample)


def main_tensor(out: Any) -> torch.Tensor:
    """The main output tensor: the tensor itself, ``out["logits"]`` / ``out.logits``
    for dicts and Hugging Face outputs, or the first tensor of a tuple/list/dict."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):  # includes transformers' ModelOutput
        if "logits" in out and isinstance(out["logits"], torch.Tensor):
            return out["logits"]
        values = list(out.values())
    elif isinstance(out, (tuple, list)):
        values = list(out)
    else:
        logits = getattr(out, "logits", None)
        if isinstance(logits, torch.Tensor):
            return logits
        raise TypeError(f"cannot find a main tensor in {type(out).__name__}")
    for v in values:
        try:
            return main_tensor(v)
        except TypeError:
            continue
    raise TypeError(f"cannot find a main tensor in {type(out).__name__}")


# ---------------------------------------------------------------------------
# 1. MLP (LIBSVM experiments of the paper)
# ---------------------------------------------------------------------------


MLP = demo.MLP
mlp = _register("mlp", "linear")(demo.mlp)


# ---------------------------------------------------------------------------
# 2. strided CNN
# ---------------------------------------------------------------------------


class StridedCNN(nn.Module):
    def __init__(self, in_ch: int = 3, widths: Sequence[int] = (16, 32, 64), num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        prev = in_ch
        for w in widths:
            layers += [nn.Conv2d(prev, w, 3, stride=2, padding=1), nn.ReLU()]
            prev = w
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


@_register("strided_cnn", "conv")
def strided_cnn(seed: int = 0, *, image: int = 32, batch: int = 4, num_classes: int = 10) -> tuple[nn.Module, Any]:
    """CNN of stride-2 3x3 convs with ReLU, global average pool and a linear head."""

    def make() -> tuple[nn.Module, Any]:
        return StridedCNN(num_classes=num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 3. max-pool CNN
# ---------------------------------------------------------------------------


MaxPoolCNN = demo.MaxPoolCNN
maxpool_cnn = _register("maxpool_cnn", "conv", "maxpool")(demo.maxpool_cnn)


# ---------------------------------------------------------------------------
# 4. VGG with BatchNorm
# ---------------------------------------------------------------------------


class VGG(nn.Module):
    def __init__(
        self,
        cfg: Sequence[int | str] = (16, "M", 32, "M", 64, 64, "M"),
        in_ch: int = 3,
        hidden: int = 128,
        num_classes: int = 10,
        batch_norm: bool = True,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        prev = in_ch
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                assert isinstance(v, int)
                layers.append(nn.Conv2d(prev, v, 3, padding=1, bias=not batch_norm))
                if batch_norm:
                    layers.append(nn.BatchNorm2d(v))
                layers.append(nn.ReLU(inplace=True))
                prev = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Linear(prev * 4, hidden),
            nn.ReLU(True),
            nn.Dropout(0.5),
            nn.Linear(hidden, hidden),
            nn.ReLU(True),
            nn.Dropout(0.5),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


@_register("vgg_bn", "conv", "maxpool", "batchnorm", "dropout")
def vgg_bn(seed: int = 0, *, image: int = 32, batch: int = 4, num_classes: int = 10) -> tuple[nn.Module, Any]:
    """Small VGG: Conv-BatchNorm-ReLU blocks, MaxPool2d(2), classifier with Dropout."""

    def make() -> tuple[nn.Module, Any]:
        return VGG(num_classes=num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 5. bottleneck ResNet (ResNet-50 layout)
# ---------------------------------------------------------------------------


def _norm2d(norm: bool, ch: int) -> nn.Module:
    return nn.BatchNorm2d(ch) if norm else nn.Identity()


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride, as in torchvision's v1.5), 1x1 expand."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, norm: bool = True) -> None:
        super().__init__()
        out = planes * self.expansion
        bias = not norm
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=bias)
        self.bn1 = _norm2d(norm, planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=bias)
        self.bn2 = _norm2d(norm, planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=bias)
        self.bn3 = _norm2d(norm, out)
        self.relu = nn.ReLU(inplace=True)  # shared, as in torchvision
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, out, 1, stride=stride, bias=bias), _norm2d(norm, out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        branch = self.relu(self.bn1(self.conv1(x)))
        branch = self.relu(self.bn2(self.conv2(branch)))
        branch = self.bn3(self.conv3(branch))
        return self.relu(branch + shortcut)


class BottleneckResNet(nn.Module):
    def __init__(
        self,
        layers: Sequence[int] = (3, 4, 6, 3),
        width: int = 64,
        num_classes: int = 1000,
        norm: bool = True,
        in_ch: int = 3,
    ) -> None:
        super().__init__()
        bias = not norm
        self.conv1 = nn.Conv2d(in_ch, width, 7, stride=2, padding=3, bias=bias)
        self.bn1 = _norm2d(norm, width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        inplanes = width
        stages: list[nn.Module] = []
        for i, n in enumerate(layers):
            planes = width * 2**i
            blocks: list[nn.Module] = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(Bottleneck(inplanes, planes, stride, norm))
                inplanes = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        if len(stages) != 4:
            raise ValueError("layers must have 4 entries")
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(
    norm: bool = True,
    width: int = 64,
    layers: Sequence[int] = (3, 4, 6, 3),
    image: int = 224,
    batch: int = 2,
    num_classes: int = 1000,
    seed: int = 0,
) -> tuple[nn.Module, Any]:
    """Bottleneck ResNet; the defaults give torchvision's ResNet-50 (25,557,032 params with BN).

    ``norm=False`` drops BatchNorm (convs then get biases).  Works under
    ``with torch.device("meta"):`` for cheap parameter counting.
    """

    def make() -> tuple[nn.Module, Any]:
        model = BottleneckResNet(layers, width, num_classes, norm)
        return model, torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


@_register("resnet_bottleneck_bn", "conv", "residual", "maxpool", "batchnorm")
def resnet_bottleneck_bn(
    seed: int = 0,
    *,
    width: int = 8,
    layers: Sequence[int] = (1, 1, 1, 1),
    image: int = 32,
    batch: int = 2,
    num_classes: int = 10,
) -> tuple[nn.Module, Any]:
    """Tiny bottleneck ResNet with BatchNorm (ResNet-50 layout via resnet50())."""
    return resnet50(True, width, layers, image, batch, num_classes, seed)


@_register("resnet_bottleneck", "conv", "residual", "maxpool")
def resnet_bottleneck(
    seed: int = 0,
    *,
    width: int = 8,
    layers: Sequence[int] = (1, 1, 1, 1),
    image: int = 32,
    batch: int = 2,
    num_classes: int = 10,
) -> tuple[nn.Module, Any]:
    """Tiny bottleneck ResNet without normalization (convs with bias)."""
    return resnet50(False, width, layers, image, batch, num_classes, seed)


# ---------------------------------------------------------------------------
# 6. DenseNet
# ---------------------------------------------------------------------------


class DenseLayer(nn.Module):
    def __init__(self, in_ch: int, growth: int, bn_size: int = 2) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(in_ch)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(in_ch, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.relu2 = nn.ReLU()
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        x = self.conv1(self.relu1(self.norm1(x)))
        return self.conv2(self.relu2(self.norm2(x)))


class DenseBlock(nn.Module):
    def __init__(self, n_layers: int, in_ch: int, growth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(in_ch + i * growth, growth) for i in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__(
            nn.BatchNorm2d(in_ch),
            nn.ReLU(),
            nn.Conv2d(in_ch, out_ch, 1, bias=False),
            nn.AvgPool2d(2, stride=2),
        )


class DenseNet(nn.Module):
    def __init__(self, growth: int = 8, blocks: Sequence[int] = (3, 3), stem: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, stem, 3, padding=1, bias=False)
        parts: list[nn.Module] = []
        ch = stem
        for i, n in enumerate(blocks):
            parts.append(DenseBlock(n, ch, growth))
            ch += n * growth
            if i != len(blocks) - 1:
                parts.append(Transition(ch, ch // 2))
                ch //= 2
        self.features = nn.Sequential(*parts)
        self.norm = nn.BatchNorm2d(ch)
        self.fc = nn.Linear(ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.features(self.stem(x))))
        x = F.adaptive_avg_pool2d(x, 1)
        return self.fc(torch.flatten(x, 1))


@_register("densenet", "conv", "concat", "batchnorm")
def densenet(seed: int = 0, *, image: int = 16, batch: int = 4, num_classes: int = 10) -> tuple[nn.Module, Any]:
    """DenseNet-style net: dense blocks with torch.cat, transition (1x1 conv + avg pool)."""

    def make() -> tuple[nn.Module, Any]:
        return DenseNet(num_classes=num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 7. U-Net
# ---------------------------------------------------------------------------


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU()
    )


class UNet(nn.Module):
    def __init__(self, in_ch: int = 3, base: int = 8, num_classes: int = 2) -> None:
        super().__init__()
        b = base
        self.enc1 = _double_conv(in_ch, b)
        self.pool1 = nn.MaxPool2d(2)
        self.enc2 = _double_conv(b, 2 * b)
        self.pool2 = nn.MaxPool2d(2)
        self.bottom = _double_conv(2 * b, 4 * b)
        self.up2 = nn.ConvTranspose2d(4 * b, 2 * b, 2, stride=2)
        self.dec2 = _double_conv(4 * b, 2 * b)
        self.up1_conv = nn.Conv2d(2 * b, b, 1)  # after F.interpolate
        self.dec1 = _double_conv(2 * b, b)
        self.head = nn.Conv2d(b, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool1(e1))
        m = self.bottom(self.pool2(e2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], dim=1))
        u1 = self.up1_conv(F.interpolate(d2, scale_factor=2, mode="bilinear", align_corners=False))
        d1 = self.dec1(torch.cat([u1, e1], dim=1))
        return self.head(d1)


@_register("unet", "conv", "maxpool", "concat", "conv_transpose", "upsample")
def unet(seed: int = 0, *, image: int = 32, batch: int = 2, num_classes: int = 2) -> tuple[nn.Module, Any]:
    """Small U-Net: ConvTranspose2d and F.interpolate upsampling, skip concatenations."""

    def make() -> tuple[nn.Module, Any]:
        return UNet(num_classes=num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 8. depthwise-separable (MobileNet-style)
# ---------------------------------------------------------------------------


class DepthwiseSeparable(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, act: type[nn.Module]) -> None:
        super().__init__()
        self.dw = nn.Conv2d(cin, cin, 3, stride=stride, padding=1, groups=cin, bias=False)
        self.bn1 = nn.BatchNorm2d(cin)
        self.act1 = nn.ReLU6()
        self.pw = nn.Conv2d(cin, cout, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.act2 = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act2(self.bn2(self.pw(self.act1(self.bn1(self.dw(x))))))


class MobileNetish(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.Hardswish())
        self.blocks = nn.Sequential(
            DepthwiseSeparable(16, 32, 1, nn.ReLU6),
            DepthwiseSeparable(32, 64, 2, nn.Hardswish),
            DepthwiseSeparable(64, 64, 1, nn.Hardswish),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


@_register("depthwise_separable", "conv", "depthwise", "batchnorm")
def depthwise_separable(seed: int = 0, *, image: int = 32, batch: int = 4, num_classes: int = 10) -> tuple[nn.Module, Any]:
    """MobileNet-style net: depthwise (groups=C) + pointwise convs, ReLU6 and Hardswish."""

    def make() -> tuple[nn.Module, Any]:
        return MobileNetish(num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 9/10. ViT (hand-written attention and nn.MultiheadAttention)
# ---------------------------------------------------------------------------


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class MHAWrapper(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_dim: int, use_mha: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = MHAWrapper(dim, heads) if use_mha else SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(
        self,
        image: int = 32,
        patch: int = 8,
        dim: int = 32,
        depth: int = 2,
        heads: int = 4,
        mlp_dim: int = 64,
        num_classes: int = 10,
        use_mha: bool = False,
    ) -> None:
        super().__init__()
        n_tokens = (image // patch) ** 2
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, n_tokens + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(ViTBlock(dim, heads, mlp_dim, use_mha) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


@_register("vit", "attention", "layernorm", "transformer")
def vit(seed: int = 0, *, image: int = 32, patch: int = 8, dim: int = 32, depth: int = 2, batch: int = 4,
        num_classes: int = 10) -> tuple[nn.Module, Any]:
    """Small ViT with hand-written attention (Linear qkv + F.scaled_dot_product_attention)."""

    def make() -> tuple[nn.Module, Any]:
        model = ViT(image, patch, dim, depth, num_classes=num_classes, use_mha=False)
        return model, torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


@_register("vit_mha", "attention", "layernorm", "transformer", "mha")
def vit_mha(seed: int = 0, *, image: int = 32, patch: int = 8, dim: int = 32, depth: int = 2, batch: int = 4,
            num_classes: int = 10) -> tuple[nn.Module, Any]:
    """Small ViT using nn.MultiheadAttention(batch_first=True)."""

    def make() -> tuple[nn.Module, Any]:
        model = ViT(image, patch, dim, depth, num_classes=num_classes, use_mha=True)
        return model, torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 11. MLP-Mixer
# ---------------------------------------------------------------------------


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, token_hidden), nn.GELU(), nn.Linear(token_hidden, tokens))
        self.norm2 = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(nn.Linear(dim, channel_hidden), nn.GELU(), nn.Linear(channel_hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x).transpose(1, 2)
        x = x + self.token_mlp(y).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, image: int = 32, patch: int = 8, dim: int = 32, depth: int = 2, num_classes: int = 10) -> None:
        super().__init__()
        tokens = (image // patch) ** 2
        self.stem = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*(MixerBlock(tokens, dim, 32, 64) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)
        x = self.norm(self.blocks(x))
        return self.head(x.mean(dim=1))


@_register("mixer", "layernorm", "linear")
def mixer(seed: int = 0, *, image: int = 32, batch: int = 4, num_classes: int = 10) -> tuple[nn.Module, Any]:
    """MLP-Mixer: token-mixing and channel-mixing MLPs with transposes, LayerNorm, GELU."""

    def make() -> tuple[nn.Module, Any]:
        return Mixer(image, num_classes=num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 12. 1-D conv net
# ---------------------------------------------------------------------------


class Conv1dNet(nn.Module):
    def __init__(self, in_ch: int = 4, num_classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(in_ch, 16, 5, padding=2)
        self.act1 = nn.ELU()
        self.conv2 = nn.Conv1d(16, 32, 3, padding=2, dilation=2)
        self.act2 = nn.SiLU()
        self.conv3 = nn.Conv1d(32, 32, 3, stride=2, padding=1)
        self.act3 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool1d(1)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.conv1(x))
        x = self.act2(self.conv2(x))
        x = self.act3(self.conv3(x))
        return self.fc(torch.flatten(self.pool(x), 1))


@_register("conv1d", "conv")
def conv1d(seed: int = 0, *, length: int = 64, batch: int = 4, in_ch: int = 4, num_classes: int = 5) -> tuple[nn.Module, Any]:
    """1-D conv net over sequences: dilated Conv1d, ELU, SiLU, AdaptiveAvgPool1d."""

    def make() -> tuple[nn.Module, Any]:
        return Conv1dNet(in_ch, num_classes), torch.randn(batch, in_ch, length)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 13/14. recurrent models
# ---------------------------------------------------------------------------


class LSTMLM(nn.Module):
    def __init__(self, vocab: int = 100, dim: int = 32, num_layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=num_layers, batch_first=True)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.embedding.weight  # tied weights

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embedding(tokens))
        return self.decoder(h)


@_register("lstm_lm", "recurrent", "embedding", "tied")
def lstm_lm(seed: int = 0, *, vocab: int = 100, dim: int = 32, seq: int = 12, batch: int = 4) -> tuple[nn.Module, Any]:
    """LSTM language model: Embedding + LSTM + Linear decoder tied to the embedding weight."""

    def make() -> tuple[nn.Module, Any]:
        return LSTMLM(vocab, dim), torch.randint(0, vocab, (batch, seq))

    return _seeded(make, seed)


class GRUClassifier(nn.Module):
    def __init__(self, vocab: int = 100, dim: int = 32, num_classes: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.gru = nn.GRU(dim, dim, batch_first=True)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.embedding(tokens))
        return self.fc(h[:, -1])


@_register("gru_classifier", "recurrent", "embedding")
def gru_classifier(seed: int = 0, *, vocab: int = 100, seq: int = 12, batch: int = 4, num_classes: int = 4) -> tuple[nn.Module, Any]:
    """Embedding + GRU(batch_first) + Linear on the last time step."""

    def make() -> tuple[nn.Module, Any]:
        return GRUClassifier(vocab, num_classes=num_classes), torch.randint(0, vocab, (batch, seq))

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 15/16. several inputs, dict output, keyword inputs
# ---------------------------------------------------------------------------


class TwoInputs(nn.Module):
    def __init__(self, n_features: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.conv_act = nn.ReLU()
        self.feat = nn.Linear(n_features, 16)
        self.feat_act = nn.ReLU()
        self.fc = nn.Linear(8 + 16, num_classes)
        self.aux = nn.Linear(16, 1)

    def forward(self, image: torch.Tensor, features: torch.Tensor) -> dict[str, torch.Tensor]:
        a = self.conv_act(self.conv(image)).mean(dim=(2, 3))
        f = self.feat_act(self.feat(features))
        return {"logits": self.fc(torch.cat([a, f], dim=1)), "aux": self.aux(f)}


@_register("two_inputs_dict_out", "conv", "multi_input", "dict_output")
def two_inputs_dict_out(seed: int = 0, *, image: int = 16, batch: int = 4) -> tuple[nn.Module, Any]:
    """forward(image, features) -> {"logits", "aux"}; sample is a tuple of two tensors."""

    def make() -> tuple[nn.Module, Any]:
        return TwoInputs(), (torch.randn(batch, 3, image, image), torch.randn(batch, 8))

    return _seeded(make, seed)


class KwargsModel(nn.Module):
    def __init__(self, dim: int = 16, num_classes: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.act(self.fc1(x))
        if mask is None:
            pooled = h.mean(dim=1)
        else:
            m = mask.to(h.dtype).unsqueeze(-1)
            pooled = (h * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)
        return self.fc2(pooled)


@_register("kwargs_model", "linear", "kwargs")
def kwargs_model(seed: int = 0, *, seq: int = 6, dim: int = 16, batch: int = 4) -> tuple[nn.Module, Any]:
    """forward(x, *, mask=None): masked mean pooling; sample is a dict {"x", "mask"}."""

    def make() -> tuple[nn.Module, Any]:
        mask = torch.ones(batch, seq, dtype=torch.bool)
        mask[:, seq // 2 :] = torch.rand(batch, seq - seq // 2) > 0.5
        return KwargsModel(dim), {"x": torch.randn(batch, seq, dim), "mask": mask}

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 17. data-dependent control flow
# ---------------------------------------------------------------------------


class DataDependent(nn.Module):
    def __init__(self, dim: int = 16, num_classes: int = 4) -> None:
        super().__init__()
        self.path_a = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, num_classes))
        self.path_b = nn.Sequential(nn.Linear(dim, 32), nn.Tanh(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:  # data-dependent Python branch: defeats fx and plain export
            return self.path_a(x)
        return self.path_b(x)


@_register("data_dependent", "linear", "data_dependent")
def data_dependent(seed: int = 0, *, dim: int = 16, batch: int = 8, shift: float = 0.5) -> tuple[nn.Module, Any]:
    """`if x.mean() > 0:` chooses between two MLP paths (defeats fx and plain torch.export).

    The sample is shifted by ``shift`` so that path_a is taken (use a negative
    shift for path_b).
    """

    def make() -> tuple[nn.Module, Any]:
        return DataDependent(dim), torch.randn(batch, dim) + shift

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 18. 3-D conv net
# ---------------------------------------------------------------------------


class Conv3dNet(nn.Module):
    def __init__(self, in_ch: int = 1, num_classes: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv3d(in_ch, 8, 3, padding=1, bias=False),
            nn.BatchNorm3d(8),
            nn.ReLU(),
            nn.AvgPool3d(2),
            nn.Conv3d(8, 16, 3, padding=1, bias=False),
            nn.BatchNorm3d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool3d(1),
        )
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))


@_register("conv3d", "conv", "batchnorm")
def conv3d(seed: int = 0, *, size: int = 8, batch: int = 2, num_classes: int = 3) -> tuple[nn.Module, Any]:
    """Small Conv3d net with BatchNorm3d and AvgPool3d."""

    def make() -> tuple[nn.Module, Any]:
        return Conv3dNet(num_classes=num_classes), torch.randn(batch, 1, size, size, size)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 19. mixed activations / norms / tensor ops
# ---------------------------------------------------------------------------


class MixedActivations(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.prelu = nn.PReLU(8)
        self.conv2 = nn.Conv2d(8, 8, 3)  # "same" size thanks to the F.pad before it
        self.inorm = nn.InstanceNorm2d(8, affine=True)
        self.lrelu = nn.LeakyReLU(0.1)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(16, 32)
        self.fc3 = nn.Linear(32, 32)
        self.rms = nn.RMSNorm(32)
        self.mish = nn.Mish()
        self.fc4 = nn.Linear(32, 32)
        self.selu = nn.SELU()
        self.out = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.prelu(self.gn(self.conv1(x)))
        h = F.pad(h, (1, 1, 1, 1))
        h = self.lrelu(self.inorm(self.conv2(h)))
        h = h[:, :, ::2, ::2]  # strided slicing
        a = h.mean(dim=(2, 3))  # mean reduction
        b = h[..., 0, :].mean(-1)  # indexing
        z = torch.stack([a, b], dim=1).flatten(1)
        u = torch.tanh(self.fc1(z))
        v = torch.sigmoid(self.fc2(z))
        w = u * v  # mul of two tensors
        w = w - self.fc3(F.softplus(w))  # sub of two tensors
        w = self.mish(self.rms(w))
        w = self.selu(self.fc4(w))
        return self.out(w)


@_register("mixed_activations", "conv", "linear", "groupnorm", "instancenorm", "rmsnorm")
def mixed_activations(seed: int = 0, *, image: int = 16, batch: int = 4, num_classes: int = 10) -> tuple[nn.Module, Any]:
    """tanh/sigmoid/softplus/Mish/PReLU/SELU/LeakyReLU, Group/Instance/RMSNorm, stack, pad, slicing, mul, sub."""

    def make() -> tuple[nn.Module, Any]:
        return MixedActivations(num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 20. shared module
# ---------------------------------------------------------------------------


class SharedModule(nn.Module):
    def __init__(self, image: int = 16, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.conv_act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc_in = nn.Linear(8 * (image // 2) ** 2, 32)
        self.shared = nn.Linear(32, 32)  # called twice in forward
        self.head = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.conv_act(self.conv(x)))
        h = F.relu(self.fc_in(torch.flatten(x, 1)))
        h = F.relu(self.shared(h))
        h = F.relu(self.shared(h))
        return self.head(h)


@_register("shared_module", "conv", "linear", "maxpool", "shared")
def shared_module(seed: int = 0, *, image: int = 16, batch: int = 8, num_classes: int = 10) -> tuple[nn.Module, Any]:
    """Calls the same Linear twice in forward; conv + MaxPool2d(2) front end."""

    def make() -> tuple[nn.Module, Any]:
        return SharedModule(image, num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 21. strided AlexNet (paper, App. F)
# ---------------------------------------------------------------------------


class StridedAlexNet(nn.Module):
    def __init__(self, width_div: int = 1, num_classes: int = 10, in_ch: int = 3) -> None:
        super().__init__()

        def w(c: int) -> int:
            return max(1, c // width_div)

        specs = [  # (out, kernel, stride)
            (w(64), 11, 1),
            (w(192), 5, 2),
            (w(384), 3, 2),
            (w(256), 3, 1),
            (w(256), 3, 1),
        ]
        layers: list[nn.Module] = []
        prev = in_ch
        for out, k, s in specs:
            layers += [nn.Conv2d(prev, out, k, stride=s, padding=k // 2, padding_mode="circular"), nn.ReLU()]
            prev = out
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(prev, w(4096)),
            nn.ReLU(),
            nn.Linear(w(4096), w(4096)),
            nn.ReLU(),
            nn.Linear(w(4096), num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


@_register("alexnet_strided", "conv", "linear", "circular_padding")
def alexnet_strided(seed: int = 0, *, width_div: int = 4, image: int = 32, batch: int = 2,
                    num_classes: int = 10) -> tuple[nn.Module, Any]:
    """Paper's App. F strided AlexNet (circular padding); widths divided by width_div (1 = full)."""

    def make() -> tuple[nn.Module, Any]:
        return StridedAlexNet(width_div, num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 22. plain deep CNN
# ---------------------------------------------------------------------------


class PlainDeepCNN(nn.Module):
    def __init__(self, depth: int = 30, width: int = 16, in_ch: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        prev = in_ch
        for _ in range(depth):
            layers += [nn.Conv2d(prev, width, 3, padding=1), nn.ReLU()]
            prev = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


@_register("plain_deep_cnn", "conv", "deep")
def plain_deep_cnn(seed: int = 0, *, depth: int = 30, width: int = 16, image: int = 16, batch: int = 4,
                   num_classes: int = 10) -> tuple[nn.Module, Any]:
    """Plain deep CNN: `depth` 3x3 conv+ReLU layers, no normalization or skips, avg pool + linear."""

    def make() -> tuple[nn.Module, Any]:
        return PlainDeepCNN(depth, width, 3, num_classes), torch.randn(batch, 3, image, image)

    return _seeded(make, seed)


# ---------------------------------------------------------------------------
# 23. Hugging Face transformers (tiny configs, no downloads)
# ---------------------------------------------------------------------------

if HAS_TRANSFORMERS:

    @_register("hf_bert", "transformers", "attention", "layernorm", "embedding")
    def hf_bert(seed: int = 0, *, seq: int = 8, batch: int = 2, vocab: int = 100, num_labels: int = 2) -> tuple[nn.Module, Any]:
        """transformers BertForSequenceClassification (hidden 32, 2 layers); sample {input_ids, attention_mask}."""
        from transformers import BertConfig, BertForSequenceClassification

        def make() -> tuple[nn.Module, Any]:
            cfg = BertConfig(
                vocab_size=vocab,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                max_position_embeddings=64,
                type_vocab_size=2,
                num_labels=num_labels,
                attn_implementation="eager",
            )
            model = BertForSequenceClassification(cfg)
            sample = {
                "input_ids": torch.randint(0, vocab, (batch, seq)),
                "attention_mask": torch.ones(batch, seq, dtype=torch.long),
            }
            return model, sample

        return _seeded(make, seed)

    @_register("hf_gpt2", "transformers", "attention", "layernorm", "embedding", "tied")
    def hf_gpt2(seed: int = 0, *, seq: int = 8, batch: int = 2, vocab: int = 100) -> tuple[nn.Module, Any]:
        """transformers GPT2LMHeadModel (n_embd 32, 2 layers); sample {input_ids, use_cache=False}."""
        from transformers import GPT2Config, GPT2LMHeadModel

        def make() -> tuple[nn.Module, Any]:
            cfg = GPT2Config(
                vocab_size=vocab,
                n_positions=64,
                n_embd=32,
                n_layer=2,
                n_head=2,
                bos_token_id=vocab - 1,
                eos_token_id=vocab - 1,
                attn_implementation="eager",
            )
            model = GPT2LMHeadModel(cfg)
            sample = {"input_ids": torch.randint(0, vocab, (batch, seq)), "use_cache": False}
            return model, sample

        return _seeded(make, seed)

    @_register("hf_vit", "transformers", "attention", "layernorm", "conv")
    def hf_vit(seed: int = 0, *, image: int = 32, batch: int = 2, num_labels: int = 10) -> tuple[nn.Module, Any]:
        """transformers ViTForImageClassification (hidden 32, 2 layers, patch 8); sample {pixel_values}."""
        from transformers import ViTConfig, ViTForImageClassification

        def make() -> tuple[nn.Module, Any]:
            cfg = ViTConfig(
                image_size=image,
                patch_size=8,
                num_channels=3,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                num_labels=num_labels,
                attn_implementation="eager",
            )
            model = ViTForImageClassification(cfg)
            return model, {"pixel_values": torch.randn(batch, 3, image, image)}

        return _seeded(make, seed)

    @_register("hf_resnet", "transformers", "conv", "residual", "maxpool", "batchnorm")
    def hf_resnet(seed: int = 0, *, image: int = 32, batch: int = 2, num_labels: int = 10) -> tuple[nn.Module, Any]:
        """transformers ResNetForImageClassification (bottleneck, stem 8, 2 stages of 16/32); sample {pixel_values}."""
        from transformers import ResNetConfig, ResNetForImageClassification

        def make() -> tuple[nn.Module, Any]:
            cfg = ResNetConfig(
                num_channels=3,
                embedding_size=8,
                hidden_sizes=[16, 32],
                depths=[1, 1],
                layer_type="bottleneck",
                num_labels=num_labels,
            )
            model = ResNetForImageClassification(cfg)
            return model, {"pixel_values": torch.randn(batch, 3, image, image)}

        return _seeded(make, seed)

    @_register("hf_convnext", "transformers", "conv", "depthwise", "layernorm", "residual")
    def hf_convnext(seed: int = 0, *, image: int = 32, batch: int = 2, num_labels: int = 10) -> tuple[nn.Module, Any]:
        """transformers ConvNextForImageClassification (2 stages, width 8-16); sample {pixel_values}."""
        from transformers import ConvNextConfig, ConvNextForImageClassification

        def make() -> tuple[nn.Module, Any]:
            cfg = ConvNextConfig(
                num_channels=3,
                patch_size=4,
                num_stages=2,
                hidden_sizes=[8, 16],
                depths=[1, 1],
                num_labels=num_labels,
            )
            model = ConvNextForImageClassification(cfg)
            return model, {"pixel_values": torch.randn(batch, 3, image, image)}

        return _seeded(make, seed)
