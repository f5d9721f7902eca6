"""What every PyTorch capture method shares: sample handling and turning one call into a Node.

Each capture method walks its own representation (an fx graph, an exported ATen graph, a live
eager run) and describes every call with operand markers: :class:`Act` (an activation produced
by another node), :class:`Param` (a parameter, by name) or :class:`Const`.  :func:`build_node`
turns that description into a neutral :class:`~precondfx.core.graph.Node` the same way for all of
them.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from precondfx.core.outputs import pick_main
from precondfx.core import nodes, optable, outputs
from precondfx.core.nodes import Act, Const, Param  # noqa: F401 (the captures' operands)
from precondfx.errors import PrecondError
from precondfx.core.graph import Node


def mask_arguments(fn: Callable, n_args: int, kwargs: Mapping[str, Any],
                   used: Any = ()) -> tuple[dict[int, str], set[str]]:
    """The arguments of a call ``fn(*args, **kwargs)`` (``n_args`` positional) whose names say
    they are masks (``core.calibration.mask_named``), or that ``used`` names (positions and
    names, :func:`masks_by_use`): ``({position: name}, {keyword})``.  Positions are named by
    ``fn``'s signature (none for ``*args``, or when it has none)."""
    from precondfx.core.calibration import mask_named
    func, bound = getattr(fn, "__func__", fn), hasattr(fn, "__func__")
    pos = {i: n for i, n in _positional_masks(func, bound) if i < n_args}
    if used:
        pos.update({i: str(i) for i in used if isinstance(i, int) and i < n_args})
        pos.update({i: n for i, n in _positional_names(func, bound)
                    if i < n_args and n in used})
    return pos, {k for k in kwargs if mask_named(k) or k in used}


@functools.lru_cache(maxsize=256)
def _positional_names(func: Callable, bound: bool) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of ``func``'s positional parameters (``bound``: ``self`` not
    counted)."""
    import inspect
    try:
        params = list(inspect.signature(func).parameters.values())[int(bound):]
    except (TypeError, ValueError):
        return ()
    out = []
    for i, p in enumerate(params):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        out.append((i, p.name))
    return tuple(out)


def masks_by_use(graph: Any, fn: Callable) -> dict[int | str, str]:
    """The top-level arguments of ``fn`` (a model's forward) that the captured neutral
    ``graph`` (export or eager) reads as masks by their uses (``core.calibration.
    graph_mask_use``, the rule fx and ONNX apply): ``{position or name: why}`` (a position
    where the eager capture names inputs ``arg0``, ``arg1``; a parameter or keyword name
    otherwise).  Refuses a mask it cannot match with an argument (a part of a nested input),
    which the input scale would multiply."""
    import inspect
    from precondfx.core.calibration import graph_mask_use
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = set()
    out: dict[int | str, str] = {}
    for n in graph:
        if n.kind != "input" or n.attrs.get("integer"):
            continue
        why = graph_mask_use(graph, n.name)
        if not why:
            continue
        label = str(n.target).removeprefix("input ")
        if graph.method == "eager" and label[:3] == "arg" and label[3:].isdigit():
            out[int(label[3:])] = why
        elif label in names:
            out[label] = why
        else:
            raise PrecondError(
                f"input_scale: the model input {label!r} reads as a mask ({why}), but it is "
                f"not a top-level argument of forward, so the input scale would multiply it "
                f"(keep * 0.1 < 0.5 masks everything); pass it as its own argument named as a "
                f"mask (attention_mask), or pass input_scale=None")
    return out


@functools.lru_cache(maxsize=256)
def _positional_masks(func: Callable, bound: bool) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of ``func``'s positional parameters named as masks (``bound``:
    called as a method, ``self`` not counted); read once per function (the input scale's hook
    asks at every call)."""
    from precondfx.core.calibration import mask_named
    return tuple((i, n) for i, n in _positional_names(func, bound) if mask_named(n))


def placeholder_values(graph: "torch.fx.Graph", args: tuple, kwargs: Mapping[str, Any]
                       ) -> list:
    """The values an ``fx.Interpreter`` run of ``graph`` takes for one call ``(*args,
    **kwargs)``: positional arguments in order, then each remaining placeholder by name, and for
    one the call leaves out, the default the trace recorded from the user's ``forward`` (a
    ``None`` there would turn ``is_causal=False`` into ``None``), else ``None``."""
    out = list(args)
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    for p in phs[len(args):]:
        name = str(p.target).lstrip("*")
        out.append(kwargs[name] if name in kwargs else (p.args[0] if p.args else None))
    return out


@dataclass
class Sample:
    """A normalized sample: positional args and keyword args for ``model(*args, **kwargs)``.

    ``batched`` names the inputs that carry the batch dimension (``"arg0"``, ``"arg1"``... for
    positional inputs, the keyword for keyword inputs, ``"arg0.x"``/``"arg1.0"`` for a part of a
    nested one); ``None`` (default) infers it from how the tensors' shapes relate
    (:func:`batch_layout`).  ``batch_dim`` is the dimension those inputs carry the batch in:
    1 for sequence-first inputs (``nn.LSTM``, ``nn.Transformer(batch_first=False)``: ``(T, B,
    ...)``); ``None`` (default) is dim 0, and lets measured balancing find dim 1 where slicing
    dim 0 would cut the sequence (``precondfx.pytorch.measure.batchdim``).  Only per-sample
    measurements use them.
    """

    args: tuple
    kwargs: dict
    batched: tuple[str, ...] | None = None
    batch_dim: int | None = None

    @property
    def dim(self) -> int:
        """The batch dimension of the batched inputs (0 unless ``batch_dim`` says)."""
        return self.batch_dim or 0

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor in the sample (nested tuples/lists/dicts included)."""
        out: list[torch.Tensor] = []
        _collect_tensors((self.args, self.kwargs), out)
        return out

    def call(self, model: Callable, *, copy: bool = True) -> Any:
        """``model(*args, **kwargs)`` on a fresh copy of every tensor (``copy=True``), so a
        forward that changes its inputs in place (``x.div_(2)``) changes neither the user's
        tensors nor later runs."""
        s = self.copy() if copy else self
        return model(*s.args, **s.kwargs)

    def copy(self) -> "Sample":
        """A copy with every tensor cloned (the containers rebuilt with their own types)."""
        return self.map(lambda t: t.detach().clone() if not t.requires_grad else t.clone())

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Sample":
        """A copy with ``fn`` applied to every tensor."""
        return Sample(_map_tensors(self.args, fn), _map_tensors(self.kwargs, fn), self.batched,
                      self.batch_dim)

    def inputs(self) -> list[tuple[str, Any]]:
        """(name, value) of every top-level input: ``arg0``, ``arg1``, ... then keywords."""
        return [(f"arg{i}", a) for i, a in enumerate(self.args)] + list(self.kwargs.items())

    def batch_size(self) -> int:
        """The batch size (see :func:`batch_layout`; PrecondError when it cannot be told)."""
        return batch_layout(self)[0]

    def take(self, lo: int, hi: int | None = None) -> "Sample":
        """Samples ``lo:hi`` (``hi`` defaults to ``lo + 1``) of every batched input; inputs
        without the batch dimension (an attention mask shared by the batch, offsets...) are
        passed whole.  A PackedSequence is unpacked, sliced and packed again."""
        hi = lo + 1 if hi is None else hi
        b, paths = batch_layout(self)
        if not 0 <= lo < hi <= b:
            raise PrecondError(f"samples {lo}:{hi} are outside the batch of {b}")
        d = self.dim

        def cut(path: str, t: Any) -> Any:
            if path not in paths:
                return t
            if _is_packed(t):
                return _take_packed(t, lo, hi)
            if t.layout != torch.strided:  # sparse tensors cannot be viewed by slicing
                return t.index_select(d, torch.arange(lo, hi, device=t.device))
            return t.narrow(d, lo, hi - lo)
        return Sample(_map_leaves(self.args, cut, "arg"), _map_leaves(self.kwargs, cut, ""),
                      self.batched, self.batch_dim)


def batch_layout(sample: Sample) -> tuple[int, frozenset[str]]:
    """The batch size and the paths of the inputs that carry it (along dim 0, or
    ``sample.batch_dim``: below, "leading" means that dimension).

    With ``sample.batched`` set, those inputs (and their parts) are batched and must agree on
    their leading size.  Otherwise each leading size ``B`` of the tensors is a candidate: the
    tensors whose leading size is ``B`` are batched, and ``B`` is consistent when every other
    tensor is explained as shared by the whole batch, i.e. each of its sizes is 1 or a
    non-leading size of a batched tensor (an ``(T, T)`` attention mask next to ``(B, T, D)``
    inputs).  The consistent candidate with the most batched tensors wins; when none is
    consistent or two tie (``EmbeddingBag(ids, offsets)``), a PrecondError names the inputs and
    says how to pass ``batched``.
    """
    d = sample.dim
    found = _batch_leaves(sample, d)
    if not found:
        raise PrecondError("the sample holds no tensor with a batch dimension (every tensor is a "
                           "scalar): per-sample measurement needs inputs batched along dim 0")
    if sample.batched is not None:
        want = tuple(sample.batched)
        known = {p for p, _ in found}
        for w in want:
            if not any(p == w or p.startswith(w + ".") for p in known):
                raise PrecondError(f"batched={list(want)}: no input {w!r} in the sample (its "
                                   f"tensor inputs: {sorted(known)})")
        paths = frozenset(p for p, _ in found
                          if any(p == w or p.startswith(w + ".") for w in want))
        sizes = {_lead(v, d) for p, v in found if p in paths}
        if not paths:
            return 1, frozenset()
        if len(sizes) != 1:
            raise PrecondError(f"batched={list(want)}: these inputs have different leading "
                               f"sizes {sorted(sizes)}; name only inputs that share the batch "
                               f"dimension along dim {d}")
        return sizes.pop(), paths
    cands = sorted({_lead(v, d) for _, v in found}, key=lambda b: -sum(_lead(v, d) == b
                                                                       for _, v in found))
    good = []
    for b in cands:
        inside = [v for _, v in found if _lead(v, d) == b]
        dims = {n for v in inside for i, n in enumerate(_shape(v)) if i != d}
        outside = [v for _, v in found if _lead(v, d) != b]
        if all(n == 1 or n in dims for v in outside for n in _shape(v)):
            good.append((len(inside), b))
    good.sort(reverse=True)
    if good and (len(good) == 1 or good[0][0] > good[1][0]):
        b = good[0][1]
        return b, frozenset(p for p, v in found if _lead(v, d) == b)
    desc = ", ".join(f"{p} {tuple(_shape(v))}" for p, v in found)
    raise PrecondError(f"cannot tell which inputs carry the batch dimension ({desc}): their "
                       f"leading sizes do not relate as batch and shared inputs. Say which are "
                       f"batched along dim 0: pass the sample as precondfx.Sample(args, kwargs, "
                       f"batched=[{', '.join(repr(p) for p, _ in found[:1])}, ...]) (an empty "
                       f"list measures the whole batch as one sample)")


def _lead(v: Any, d: int = 0) -> int:
    """The size along the batch dimension ``d`` (a PackedSequence: its batch)."""
    return _shape(v)[0] if _is_packed(v) else _shape(v)[d]


def _shape(v: Any) -> tuple[int, ...]:
    if _is_packed(v):
        return (int(v.batch_sizes[0]),) + tuple(v.data.shape[1:])
    return tuple(v.shape)


def _is_packed(v: Any) -> bool:
    return isinstance(v, torch.nn.utils.rnn.PackedSequence)


def _take_packed(p: Any, lo: int, hi: int) -> Any:
    """Sequences ``lo:hi`` (in the caller's order) of a PackedSequence, packed again."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
    padded, lengths = pad_packed_sequence(p, batch_first=True)
    return pack_padded_sequence(padded[lo:hi], lengths[lo:hi], batch_first=True,
                                enforce_sorted=False)


def _batch_leaves(sample: Sample, d: int = 0) -> list[tuple[str, Any]]:
    """(path, value) of every tensor with a dimension ``d`` or PackedSequence in the sample."""
    out: list[tuple[str, Any]] = []

    def visit(path: str, v: Any) -> Any:
        if _is_packed(v) or (isinstance(v, torch.Tensor) and v.dim() > d):
            out.append((path, v))
        return v
    _map_leaves(sample.args, visit, "arg")
    _map_leaves(sample.kwargs, visit, "")
    return out


def _map_leaves(obj: Any, fn: Callable[[str, Any], Any], path: str) -> Any:
    """Rebuild ``obj`` with ``fn(path, leaf)`` applied to every tensor and PackedSequence leaf.
    Top level: ``path='arg'`` names positional items ``arg0``..., ``path=''`` names keywords."""
    def join(k: Any) -> str:
        if path == "arg":
            return f"arg{k}"
        return f"{path}.{k}" if path else str(k)
    if isinstance(obj, torch.Tensor) or _is_packed(obj):
        return fn(path, obj)
    if isinstance(obj, tuple):
        items = [_map_leaves(x, fn, join(i)) for i, x in enumerate(obj)]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_map_leaves(x, fn, join(i)) for i, x in enumerate(obj)]
    if isinstance(obj, Mapping):
        d = {k: _map_leaves(v, fn, join(k)) for k, v in obj.items()}
        if type(obj) is dict:
            return d
        try:
            return type(obj)(d)
        except Exception:  # a mapping type that cannot be rebuilt from a dict
            return d
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        ch = {f.name: _map_leaves(getattr(obj, f.name), fn, join(f.name))
              for f in dataclasses.fields(obj) if f.init}
        try:
            return dataclasses.replace(obj, **ch)
        except Exception:
            return obj
    return obj


def leaves(obj: Any) -> list:
    """Every leaf of a nested structure: lists, tuples, mappings (transformers ModelOutputs
    included), dataclasses and other objects with ``values()`` are walked; anything else is a
    leaf.  Shared by the capture methods to find tensors, graph nodes and outputs."""
    out: list = []

    def walk(o: Any) -> None:
        if isinstance(o, (list, tuple)):
            for x in o:
                walk(x)
        elif isinstance(o, Mapping) or (hasattr(o, "values") and callable(o.values)
                                        and not isinstance(o, torch.Tensor)):
            try:
                vals = list(o.values())
            except TypeError:
                out.append(o)
                return
            for x in vals:
                walk(x)
        elif hasattr(o, "__dataclass_fields__"):
            for x in vars(o).values():
                walk(x)
        elif isinstance(o, torch.distributions.Distribution):
            for _, x in _dist_items(o) or []:
                walk(x)
        else:
            out.append(o)

    walk(obj)
    return out


def _collect_tensors(obj: Any, out: list) -> None:
    out.extend(t for t in leaves(obj) if isinstance(t, torch.Tensor))


def _map_tensors(obj: Any, fn: Callable) -> Any:
    """``obj`` rebuilt (namedtuples, PackedSequences and mapping types kept) with ``fn`` on
    every tensor; a PackedSequence's ``data`` is mapped, its index tensors copied as they are."""
    def leaf(path: str, t: Any) -> Any:
        if _is_packed(t):
            return type(t)(fn(t.data), t.batch_sizes.clone(),
                           *(None if x is None else x.clone()
                             for x in (t.sorted_indices, t.unsorted_indices)))
        return fn(t)
    return _map_leaves(obj, leaf, "")


def as_sample(sample: Any, forward_kwargs: Mapping | None = None) -> Sample:
    """A Sample from what measurement functions accept: a Sample (kept), or a tensor / tuple of
    positional inputs / dict of keyword inputs (see :func:`make_sample`)."""
    return make_sample(sample, forward_kwargs)


def make_sample(sample: Any, forward_kwargs: Mapping | None = None) -> Sample:
    """Normalize a user sample: a tensor, a PackedSequence, a namedtuple or a dataclass
    instance is one positional input; a plain tuple or list holds the positional inputs (wrap a single list or dict input
    in a tuple: ``(batch,)``); a dict holds keyword inputs.  ``forward_kwargs`` must be a dict
    with string keys (PrecondError otherwise)."""
    from precondfx.core.options import mapping
    extra = mapping("forward_kwargs", forward_kwargs)
    if isinstance(sample, Sample):
        return Sample(sample.args, {**sample.kwargs, **extra}, sample.batched, sample.batch_dim)
    if isinstance(sample, torch.Tensor) or _is_packed(sample) or (
            isinstance(sample, tuple) and hasattr(sample, "_fields")) or (
            dataclasses.is_dataclass(sample) and not isinstance(sample, type)):
        return Sample((sample,), extra)
    if isinstance(sample, (tuple, list)):
        return Sample(tuple(sample), extra)
    if isinstance(sample, Mapping):
        both = sorted(k for k in extra if k in sample)
        if both:    # one would silently win over the other
            raise PrecondError(
                f"the keyword(s) {both} are both in the sample dict and in forward_kwargs (or "
                f"given as extra keywords) with their own values: pass each once, in the "
                f"sample dict or in forward_kwargs")
        return Sample((), {**dict(sample), **extra})
    if hasattr(sample, "__array__") or hasattr(sample, "__array_interface__"):
        raise PrecondError(
            f"sample is a {type(sample).__name__} (an array, not a torch tensor): pass it as a "
            f"tensor, precondition(model, torch.as_tensor(x)) (images often also need "
            f".float())")
    if not isinstance(sample, (str, bytes)) and (hasattr(sample, "__iter__") or
                                                 hasattr(sample, "__getitem__")):
        raise PrecondError(
            f"sample is a {type(sample).__name__} (a source of batches, not a batch): "
            f"precondition calls the model once with the sample, so pass one batch of the "
            f"model's inputs, e.g. x, y = next(iter(loader)); precondition(model, x) (the "
            f"inputs only, not the labels); a single input of this type goes in a tuple, "
            f"precondition(model, (batch,))")
    raise PrecondError(
        f"sample must be a tensor, a tuple of positional inputs or a dict of keyword inputs, "
        f"got {type(sample).__name__}: pass what you would call the model with, e.g. "
        f"precondition(model, torch.randn(8, 3, 32, 32)); a single input of another type goes "
        f"in a tuple, precondition(model, (batch,))")


class MainPath(tuple):
    """The main output's path (:func:`output_path`) picked on the whole calibration batch, passed
    as ``output_key`` to the per-sample (batch size 1) measurements.  The rule skips outputs
    of one element (a loss); at batch size 1 a main output with one element per sample (CLIP's
    ``logits_per_image``, a regression head's ``(B, 1)``) has one, and the rule re-applied
    there would measure another output (CLIP's ``text_embeds``: the vision tower's Hessian
    statistic 0, left unbalanced)."""

    def __repr__(self) -> str:
        return ".".join(str(k) for k in self) or "the output"


def main_path_of(out: Any, key: str | int | None = None) -> "MainPath":
    """:func:`output_path` of a whole batch's output, as a :class:`MainPath`."""
    return MainPath(output_path(out, key))


def output_path(out: Any, key: str | int | None = None) -> list:
    """Keys/indices leading from the model's output to its main output (``precondfx.core.outputs``'
    rule: ``out[key]``; ``out`` itself; ``logits`` or the first floating-point tensor of a
    tuple, list, dict or transformers ModelOutput).  ``key`` may be a :class:`MainPath`: the
    path as picked on the whole batch, kept for per-sample passes."""
    if isinstance(key, MainPath):
        return list(key)
    if key is not None:
        if isinstance(out, torch.Tensor):   # out[key] would be a slice of it (a row)
            raise PrecondError(f"output_key={key!r} names an output, but the model returns a "
                               f"single tensor of shape {tuple(out.shape)}, which has no named "
                               f"or numbered outputs. {_key_advice(out)}")
        try:
            val = child(out, key)
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise PrecondError(f"output_key={key!r} does not select an output of the model "
                               f"({type(out).__name__}): {e}. {_key_advice(out)}") from None
        if not isinstance(val, torch.Tensor):
            raise PrecondError(f"output_key={key!r} selects a {type(val).__name__}, not a "
                               f"tensor. {_key_advice(out)}")
        return [key]
    if isinstance(out, torch.Tensor):
        return []
    level: list[tuple[list, Any]] = [([], out)]
    while level:  # outputs nested in containers: one level at a time, the rule at each
        items = [(path + [k], v) for path, o in level for k, v in _items(o)]
        k = pick_main(((i, isinstance(v, torch.Tensor) and v.is_floating_point(),
                        isinstance(v, torch.Tensor) and v.numel() > 1)
                       for i, (_, v) in enumerate(items)), lambda i: items[i][0][-1])
        if k is not None:
            return items[k][0]
        level = [(p, v) for p, v in items if _items(v)]
    raise PrecondError(
        f"cannot find a floating-point tensor in the model's output ({type(out).__name__}); "
        f"pass output_key= to name the output to scale, or target_std=None to skip output "
        f"scaling")


def other_outputs(out: Any, main_path: list) -> dict[Any, torch.Tensor]:
    """The floating-point outputs of several elements returned beside the main one, at the
    top level of the output (two heads, a dict's other entries; a loss is a single number),
    by key."""
    return {k: v for k, v in _items(out) if [k] != main_path[:1] and
            isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1}


def others_note(out: Any, main_path: list, through: Any = ()) -> str | None:
    """``core.outputs.others_note`` for :func:`other_outputs`; ``through``: the keys of
    those the model computes from the scaled value (``softmax(logits)``), which see the
    scale too (measured: :func:`precondfx.pytorch.pipeline.verify`)."""
    if not main_path:
        return None

    def label(path: list) -> str:
        return "output" + "".join(f".{k}" if is_dataclass_output(out) and
                                  not hasattr(out, "__getitem__") else f"[{k!r}]"
                                  for k in path)
    keys = list(other_outputs(out, main_path))
    return outputs.others_note(label(main_path), [label([k]) for k in keys if k not in through],
                               [label([k]) for k in keys if k in through])


def _key_advice(out: Any) -> str:
    """What to pass instead of an ``output_key`` that selects nothing usable."""
    if isinstance(out, torch.Tensor):
        return ("Drop output_key= (that tensor is the one scaled), "
                "or pass target_std=None to skip output scaling")
    keys = [k for k, v in _items(out) if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return (f"Pass the key or index of a floating-point output ({keys[:8]} here), or "
            f"target_std=None to skip output scaling")


#: attributes of torch.distributions wrappers that hold the distribution they wrap
_DIST_WRAPPED = ("base_dist", "mixture_distribution", "component_distribution")


def _dist_items(d: Any) -> list[tuple[str, Any]] | None:
    """(name, value) of a ``torch.distributions.Distribution`` output: the parameters it was
    built from (``arg_constraints`` names set on it: ``loc``/``scale``, ``logits`` or
    ``probs``), then any distribution it wraps (``Independent``, ``TransformedDistribution``,
    ``MixtureSameFamily``); None for anything that is not a distribution."""
    if not isinstance(d, torch.distributions.Distribution):
        return None
    own = vars(d)
    try:
        names = list(d.arg_constraints)
    except NotImplementedError:     # a user subclass that declares no constraints
        names = []
    found = [(n, own[n]) for n in names if n in own]
    found += [(n, own.get(n, own.get("_" + n))) for n in _DIST_WRAPPED
              if isinstance(own.get(n, own.get("_" + n)), torch.distributions.Distribution)]
    return found


def rebuild_distribution(d: Any, name: str, value: Any) -> Any:
    """A new distribution like ``d`` with its parameter (or wrapped distribution) ``name``
    replaced by ``value``: built anew from its constructor's parameters (torch.distributions
    names them as ``arg_constraints`` does), so what it derives from them (a Categorical's
    normalized logits) follows.  Wrappers: ``Independent``, ``TransformedDistribution`` and
    ``MixtureSameFamily``.  PrecondError for a distribution that cannot be rebuilt that way."""
    D = torch.distributions
    kw = {"validate_args": getattr(d, "_validate_args", None)}
    own = dict(_dist_items(d) or [])
    try:
        if type(d) is D.Independent and name == "base_dist":
            return D.Independent(value, d.reinterpreted_batch_ndims, **kw)
        if type(d) is D.TransformedDistribution and name == "base_dist":
            return D.TransformedDistribution(value, d.transforms, **kw)
        if type(d) is D.MixtureSameFamily and name in ("mixture_distribution",
                                                       "component_distribution"):
            parts = {"mixture_distribution": d.mixture_distribution,
                     "component_distribution": d.component_distribution, name: value}
            return D.MixtureSameFamily(**parts, **kw)
        if name in own and not any(n in _DIST_WRAPPED for n in own):
            return type(d)(**{**own, name: value}, **kw)
    except (TypeError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
    else:
        why = "it is not one precondfx knows how to rebuild"
    raise PrecondError(
        f"the main output is {name!r} of the {type(d).__name__} the model returns, and the "
        f"output scale would have to rebuild that distribution around the scaled value ({why}). "
        f"Return the tensor (the logits or the mean) and build the distribution outside "
        f"forward, or pass target_std=None to skip output scaling")


def _items(out: Any) -> list[tuple[Any, Any]]:
    """(key, value) of a dict, ModelOutput, tuple, list, dataclass or
    ``torch.distributions`` output; [] for anything else."""
    if isinstance(out, torch.Tensor):
        return []
    dist = _dist_items(out)
    if dist is not None:
        return dist
    if is_dataclass_output(out) and not hasattr(out, "__getitem__"):
        return [(f.name, getattr(out, f.name)) for f in dataclasses.fields(out)]
    if isinstance(out, Mapping) or (hasattr(out, "keys") and hasattr(out, "__getitem__")):
        return [(k, out[k]) for k in out.keys()]
    if isinstance(out, (tuple, list)):
        return list(enumerate(out))
    return []


def main_output(out: Any, key: str | int | None = None) -> torch.Tensor:
    """The tensor the output scale applies to (the one at :func:`output_path`)."""
    return at_path(out, output_path(out, key))


def at_path(out: Any, path: list) -> Any:
    """The value at ``path`` (keys, indices, dataclass fields) inside a nested output."""
    for k in path:
        out = child(out, k)
    return out


def is_dataclass_output(out: Any) -> bool:
    """An output that is an instance of a user's ``@dataclass`` (its fields are the outputs)."""
    return dataclasses.is_dataclass(out) and not isinstance(out, type)


def child(out: Any, k: Any) -> Any:
    """``out[k]``, field ``k`` of a dataclass output, or parameter ``k`` of a distribution."""
    if is_dataclass_output(out) and isinstance(k, str) and not hasattr(out, "__getitem__"):
        return getattr(out, k)
    if isinstance(out, torch.distributions.Distribution) and isinstance(k, str):
        found = dict(_dist_items(out) or [])
        if k not in found:
            raise KeyError(f"{k!r} is not a parameter of this {type(out).__name__} "
                           f"({sorted(found)})")
        return found[k]
    return out[k]


def module_attrs(mod: nn.Module) -> dict[str, Any]:
    """Attributes of a leaf module that the planner needs (geometry, slopes, sizes)."""
    a: dict[str, Any] = {"class": type(mod).__name__}
    for name in ("kernel_size", "stride", "padding", "dilation", "groups", "in_channels",
                 "out_channels", "in_features", "out_features", "ceil_mode", "return_indices",
                 "transposed", "padding_mode", "num_embeddings", "embedding_dim",
                 "negative_slope", "output_size", "embed_dim", "num_heads", "hidden_size",
                 "num_layers", "input_size", "count_include_pad",
                 # activation parameters (ELU/CELU alpha, Softplus beta and threshold, GELU's
                 # approximation): the schemes' activation maths depends on them
                 "alpha", "beta", "threshold", "approximate"):
        if hasattr(mod, name):
            v = getattr(mod, name)
            if isinstance(v, (int, float, bool, str, tuple, list)) or v is None:
                a[name] = v
    if isinstance(mod, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)):
        a["dims"] = int(type(mod).__name__[-2])
    return a


def build_node(name: str, spec: optable.OpSpec | None, target: str, args: list, kwargs: dict,
               *, module: str | None = None, module_obj: nn.Module | None = None,
               **rest: Any) -> Node:
    """:func:`precondfx.core.nodes.build_node` for a call that may be a module's: the module's
    parameter names and attributes are read here."""
    if module_obj is None:
        return nodes.build_node(name, spec, target, args, kwargs, module=module, **rest)
    names = [n for n, _ in module_obj.named_parameters(remove_duplicate=False)]
    return nodes.build_node(name, spec, target, args, kwargs, module=module,
                            module_params=names, module_attrs=module_attrs(module_obj), **rest)


def target_name(fn: Any) -> str:
    """A readable name for a callable target."""
    if isinstance(fn, str):
        return fn
    mod = getattr(fn, "__module__", None) or ""
    qn = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    if mod.startswith("torch._ops") or type(fn).__name__ == "OpOverload":
        return f"aten.{fn.__name__}" if not str(fn).startswith("aten") else str(fn)
    return f"{mod}.{qn}" if mod else qn


def input_attrs(v: Any) -> dict[str, Any]:
    """Facts about a model input for the planner: ``integer`` for an input that holds ids,
    masks or flags rather than data (an integer or bool tensor: token ids, an attention mask).
    Tensors computed from such inputs and constants alone are masks and position tables, not
    activations (``plan._plan_residuals``)."""
    dt = getattr(v, "dtype", None)
    if isinstance(dt, torch.dtype) and not (dt.is_floating_point or dt.is_complex):
        return {"integer": True}
    return {}


def shape_of(v: Any) -> tuple[int, ...] | None:
    """Static shape of a tensor-like value (real, fake, or fx TensorMetadata), else None."""
    shape = getattr(v, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        return None


def prod(xs: Any) -> int:
    """Product of an int or a sequence of ints."""
    if isinstance(xs, int):
        return xs
    return math.prod(int(x) for x in xs)
