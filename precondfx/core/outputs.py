"""Which output is "the" output: the one rule every back end uses to pick the tensor that the
output scale (``target_std``) applies to and that calibration and measurements read.

Given the model's outputs as ``(key, is_floating_point_tensor[, has_several_elements])``
entries in order: the entry named ``logits`` when it is a floating-point tensor, else the first
floating-point one that is not a single number (a loss), else the first floating-point one.
Outputs nested in containers (``{"out": {"logits": ...}}``) are searched level by level.  An
explicit ``output_key`` overrides the rule (each back end checks that it selects a tensor).
PyTorch adapters: ``precondfx.pytorch.capture.common.output_path``/``main_output``; ONNX:
``precondfx.onnx.apply.OnnxApplier.main_output``.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Hashable, Iterable

MAIN_NAME = "logits"


def pick_main(entries: Iterable[tuple], name_of: Callable[[Hashable], Hashable] = lambda k: k
              ) -> Hashable | None:
    """The key of the main output among ``(key, is_float_tensor)`` or ``(key, is_float_tensor,
    has_several_elements)`` entries, or None: the floating-point entry named ``logits`` (by
    ``name_of(key)``), else the first floating-point one with several elements (a scalar loss
    returned before the logits, ``(loss, logits)``, is not the output to scale), else the
    first floating-point one."""
    entries = [(e[0], e[1], e[2] if len(e) > 2 else True) for e in entries]
    for key, is_float, _ in entries:
        if name_of(key) == MAIN_NAME and is_float:
            return key
    for key, is_float, several in entries:
        if is_float and several:
            return key
    return next((key for key, is_float, _ in entries if is_float), None)


def others_note(main: str, others: list[str], through: list[str] | None = None
                ) -> str | None:
    """The report's note for a model returning several outputs of several elements (two
    heads, a dict): the output scale acts on the main one; ``through``: the other outputs the
    model computes from the scaled value (``softmax(logits)``), which see the scale too, as
    they do in the rewritten model; ``others``: those it leaves (None when there are none of
    either)."""
    through = list(through or [])
    if not others and not through:
        return None
    parts = []
    if through:
        they = "they see" if len(through) > 1 else "it sees"
        parts.append(f"{', '.join(through)} {'are' if len(through) > 1 else 'is'} computed "
                     f"from it in the model, so {they} the scale too (e.g. the softmax of the "
                     f"scaled logits)")
    if others:
        parts.append(f"not on {', '.join(others)}: one scale per model (output_key= picks "
                     f"another output)")
    return (f"output scale on {main}, the main output ('logits', else the first "
            f"floating-point output with several elements); {'; '.join(parts)}")


#: op kinds (``precondfx.core.optable``) whose output has a fixed range or normalization, which a
#: scale after them would break: probabilities that no longer sum to 1 or exceed 1
#: (``BCELoss`` raises), log-probabilities that are no longer normalized, a tanh-bounded
#: action outside its bounds
BOUNDED = {"softmax": "softmax/log_softmax (a probability vector)",
           "saturating": "a sigmoid/tanh (a bounded range)",
           "clipped_relu": "a clipped activation (a bounded range)"}


def bounded_output(kind: str | None, target: str = "", part: bool = False) -> str | None:
    """Why the main output cannot take the output scale (None when it can): it comes out of
    an op with a fixed range or normalization (by kind, or ``F.normalize`` by name); ``part``:
    only a part of it does (one input of a concatenation)."""
    if kind in BOUNDED:
        what = BOUNDED[kind]
    elif target.rpartition(".")[2] == "normalize":
        what = "F.normalize (unit-norm vectors)"
    else:
        return None
    who = "a part of the main output (a concatenation)" if part else "the main output"
    return (f"{who} comes out of {what}: a scale after it would break that range "
            f"(probabilities above 1, log-probabilities that no longer normalize), so the "
            f"output scale is not applied. To get it, return the values before that op (the "
            f"logits) and apply the op in the loss (CrossEntropyLoss, BCEWithLogitsLoss), or "
            f"pass target_std=None to turn output scaling off")


#: op kinds the output scale moves up through, from the returned value to the node that
#: computes it: the scale sits where the main output is computed, so every use of it inside
#: the model (a softmax, a loss computed from the logits) sees it, on every back end
SCALE_THROUGH = ("reshape", "cast", "select")


def scale_moves_up(kind: str | None, n_operands: int, operand_uses: int) -> bool:
    """Whether the output scale moves from a node up to its one activation operand (the one
    rule ``fx_apply._producer`` and ``OnnxApplier.output_scale`` apply): a reshape or a cast
    (every other use of the operand reads the same values), or a selection whose operand has
    no other use (scaling the whole operand would reach values the model reads elsewhere)."""
    if kind not in SCALE_THROUGH or n_operands != 1:
        return False
    return kind != "select" or operand_uses == 1


#: op kinds that pass values through unchanged in range (a final view, a dtype cast, a slice)
PASS_THROUGH = ("reshape", "cast", "select")


def _scaled_sigmoid(graph: Any, node: Any) -> bool:
    """A sigmoid's output times a number (GLPN's ``sigmoid(x) * max_depth``): a range
    ``[0, k]``, a depth or a size in fixed units, that a scale would move.  A tanh times a
    number is left alone: ``tanh(z / c) * c`` soft-caps logits (Gemma-2), which stay logits."""
    if node.kind != "mul" or len(node.inputs) != 1 or node.params or \
            not getattr(node, "const_operands", 0):
        return False
    src = graph.get(node.inputs[0])
    return src is not None and src.kind == "saturating" and \
        "sigmoid" in str(src.target).lower()


def bounded_producer(graph: Any, name: str | None) -> str | None:
    """Why the value of ``graph`` node ``name`` cannot take the output scale (None when it can):
    ``bounded_output`` of the node, looked up through single-input reshapes, casts and
    selections (``softmax(x).view(n, -1)``, an ONNX ``Identity`` after a ``Sigmoid``), a sigmoid
    times a number (``sigmoid(x) * max_depth``) and
    through every part of a concatenation (``cat([sigmoid(rgb), softplus(sigma)])``: a scale
    would take the bounded part out of its range too).  The one rule the fx, eager and ONNX
    back ends apply to the main output's producer."""
    seen: set[str] = set()
    todo = [(name, False)] if name is not None else []
    while todo:
        at, part = todo.pop()
        node = graph.get(at)
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if node.kind in PASS_THROUGH and len(node.inputs) == 1 or node.kind == "concat" or \
                _scaled_sigmoid(graph, node):
            todo.extend((i, part or node.kind == "concat") for i in node.inputs)
            continue
        why = bounded_output(node.kind, node.target, part)
        if why is not None:
            return why
    return None


def skip_bounded(backend: Any, why: str) -> None:
    """The output scale is not applied (``why`` from ``bounded_output``): a ``RuntimeWarning``
    and a ``report.skipped`` line, the same on every back end."""
    warnings.warn(f"precondfx: {why}", RuntimeWarning, stacklevel=3)
    backend._skip("output", "output scale", why)


#: op kinds whose output holds its features in dim 1 (channels first): a main output that
#: comes out of one of them, through ops that keep dim 1 (an activation, an upsampling, a
#: residual add), holds its classes there (a segmentation net's ``(B, C, H, W)`` logits)
CHANNELS_FIRST = ("conv", "conv_transpose")


def class_dim(graph: Any, shape: tuple[int, ...]) -> int:
    """The dimension of the main output (shaped ``shape``) that holds its classes: 1 where it
    comes out of a convolution through ops that keep dim 1 at the convolution's channel
    count (``F.cross_entropy`` reads classes in dim 1: a segmentation net's ``(B, C, H, W)``);
    else -1, the last (a language model's ``(B, T, V)``, a classifier's ``(B, C)``, a
    convolution's output permuted channels-last).  -1 without a graph or below 3 dims."""
    if graph is None or len(shape) < 3:
        return -1
    todo = [i for n in graph if n.kind == "output" for i in n.inputs
            for m in [graph.get(i)] if m is not None and m.out_shape is not None and
            tuple(m.out_shape)[1:] == tuple(shape)[1:]]     # the main output's producers
    seen: set[str] = set()
    while todo:
        node = graph.get(todo.pop())
        if node is None or node.name in seen or node.out_shape is None:
            continue
        seen.add(node.name)
        out = tuple(node.out_shape)
        if len(out) != len(shape) or out[1] != shape[1]:
            continue        # a path that changes dim 1 (a permute, a view) says nothing
        if node.kind in CHANNELS_FIRST:
            return 1
        if node.params or node.kind in ("input", "reshape", "select"):
            continue        # another weighted layer (features last), or a layout change
        todo.extend(node.inputs)
    return -1
