"""The op table (``precondfx.core.optable``) resolved against this torch version.

The core table names PyTorch spellings as strings (``"Conv2d"``, ``"F.relu"``, ``"T.view"``);
this module turns them into the objects the PyTorch captures meet (module classes, callables,
Tensor method names) and answers the lookups fx, torch.export and the eager tracer make.
"""
from __future__ import annotations

import builtins
import operator

import torch
import torch.nn.functional as F
from torch import nn

from precondfx.core.optable import BY_CLASS_NAME, BY_KIND, OPS, OpSpec, stochastic_layer

_ROOTS = {"F": F, "torch": torch, "operator": operator, "T": torch.Tensor, "builtins": builtins}


def _resolve(name: str) -> object | None:
    """The callable a dotted name spells in this torch version, or None."""
    root, _, attr = name.partition(".")
    obj: object | None = _ROOTS[root]
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


_BY_MODULE: dict[type, OpSpec] = {getattr(nn, m): s for s in OPS for m in s.modules
                                  if hasattr(nn, m)}
_BY_FUNCTION: dict[object, OpSpec] = {}
_BY_METHOD: dict[str, OpSpec] = {m: s for s in OPS for m in s.methods}
_FUNCTIONS = [(f, s) for s in OPS for f in map(_resolve, s.functions) if f is not None]
for _f, _s in _FUNCTIONS:
    try:
        _BY_FUNCTION.setdefault(_f, _s)
    except TypeError:  # unhashable callables cannot be keys
        pass
# Names of Tensor methods that name the same thing as a listed function (Tensor.relu -> "relu").
for _f, _s in _FUNCTIONS:
    _name = getattr(_f, "__name__", None)
    if _name and _name not in _BY_METHOD and _name.isidentifier():
        _BY_METHOD.setdefault(_name, _s)


def for_module(module: nn.Module) -> OpSpec | None:
    """The spec of a leaf module, by its class or the nearest listed base class."""
    for cls in type(module).__mro__:
        spec = _BY_MODULE.get(cls)
        if spec is not None:
            return spec
    kind = BY_CLASS_NAME.get(type(module).__name__)
    if kind is None and stochastic_leaf(module):
        kind = "dropout"    # a user's MyDropPath, or a class holding drop_prob
    return BY_KIND[kind] if kind else None


def stochastic_leaf(module: nn.Module) -> bool:
    """A parameter-free module without children that ``optable.stochastic_layer`` calls
    stochastic by its class name or attributes (``MyDropPath``, ``SD(drop_prob=0.1)``)."""
    return next(module.parameters(), None) is None and next(module.children(), None) is None \
        and stochastic_layer(type(module).__name__, vars(module))


def for_function(fn: object) -> OpSpec | None:
    """The spec of a Python callable (``F.relu``, ``operator.add``, ``Tensor.view``...)."""
    try:
        spec = _BY_FUNCTION.get(fn)
    except TypeError:
        spec = None
    if spec is None:
        name = getattr(fn, "__name__", None)
        objclass = getattr(fn, "__objclass__", None) or getattr(fn, "__self__", None)
        if name and (objclass is torch.Tensor or objclass is torch._C.TensorBase):
            spec = _BY_METHOD.get(name)
        elif name and getattr(fn, "__qualname__", None) == f"Tensor.{name}" and \
                getattr(fn, "__module__", None) == "torch._tensor":
            # methods torch defines in Python (Tensor.split, .norm, .unflatten): a plain
            # function, no __objclass__
            spec = _BY_METHOD.get(name)
    return spec


def for_method(name: str) -> OpSpec | None:
    """The spec of a Tensor method called by name (fx ``call_method``)."""
    return _BY_METHOD.get(name)
