"""The zoo's registry: ``ZOO`` (name -> builder), ``TAGS``, and the helpers that build,
name and call entries (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from precondfx import demo

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
