"""Bring an ONNX graph into the form the capture stage expects, or refuse it with a reason.

* refuse training artifacts (gradient and optimizer ops): precondfx belongs before artifact
  generation; and quantized models (QDQ pairs, QLinear/integer kernels): their fixed scales
  would not fit the re-initialized weights;
* refuse control flow (If/Loop/Scan) whose subgraphs hold weights: they cannot be re-initialized
  or scaled consistently;
* inline model-local functions;
* lift ``Constant`` nodes into initializers (weights sometimes arrive that way);
* un-share initializers re-shared through ``Identity`` (the legacy exporter deduplicates equal
  tensors, e.g. the zero biases of BN-folded convolutions): one initializer per use, so each
  layer gets its own weights.  Exporter deduplication cannot be told apart from weight tying the
  user meant; tying by direct reuse of one initializer is kept;
* sort the nodes topologically when the file lists them out of order;
* give every node a unique name (plans are keyed by node names).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

from precondfx.errors import PrecondError
from precondfx.onnx.io import FLOAT_TYPES

TRAINING_DOMAINS = ("ai.onnx.preview.training",)
TRAINING_OPS = {
    "Gradient", "Adagrad", "Adam", "Momentum", "AdamW", "AdamOptimizer", "AdamWOptimizer",
    "LambOptimizer", "SGDOptimizer", "SGDOptimizerV2", "ZeroGradient", "InPlaceAccumulator",
    "InPlaceAccumulatorV2", "YieldOp", "PassThrough", "GradientAccumulator",
}
CONTROL_FLOW = ("If", "Loop", "Scan", "SequenceMap")
#: quantization ops (QDQ pairs, integer kernels): their scales and zero points are fixed for
#: the trained weights and activations, which re-initialization and the inserted constants
#: change
QUANT_OPS = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv",
             "QLinearMatMul", "ConvInteger", "MatMulInteger"}
QUANT_MS = {"QGemm", "QAttention", "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
            "MatMulNBits", "MatMulBnb4", "GatherBlockQuantized", "DynamicQuantizeLSTM",
            "QEmbedLayerNormalization"}


@dataclass
class NormalizeInfo:
    """What normalization did (for the report's notes)."""

    lifted: set[str] = field(default_factory=set)      # initializers lifted from Constant nodes
    unshared: int = 0                                  # initializer copies made from Identity
    inlined: int = 0
    renamed: int = 0
    notes: list[str] = field(default_factory=list)


def _is_quantized_op(node: ir.Node) -> bool:
    if node.domain in ("", "ai.onnx"):
        return node.op_type in QUANT_OPS
    if node.domain.startswith("com.microsoft"):
        return node.op_type in QUANT_OPS or node.op_type in QUANT_MS or \
            node.op_type.startswith(("QLinear", "QOrdered"))
    return False


def _is_training_op(node: ir.Node) -> bool:
    if node.domain in TRAINING_DOMAINS:
        return True
    if node.domain in ("com.microsoft", "com.microsoft.nchwc") and (
            node.op_type in TRAINING_OPS or node.op_type.endswith("Grad")):
        return True
    return False


def check_supported(model: ir.Model) -> None:
    """Refuse training artifacts, quantized models and control flow that holds weights."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if _is_training_op(node):
            raise PrecondError(
                f"node {node.name or node.op_type!r} is a training op ({node.domain}::"
                f"{node.op_type}): this file is an ONNX Runtime training artifact; precondition "
                f"the inference model before generating training artifacts")
        if _is_quantized_op(node):
            raise PrecondError(
                f"node {node.name or node.op_type!r} ({node.op_type}) makes this a quantized "
                f"model: its quantization scales and zero points are fixed for the trained "
                f"weights and activations, which precondfx would re-initialize and rescale; "
                f"precondition the float model, and quantize after training")
    inits = model.graph.initializers
    for index, node in enumerate(model.graph):
        if node.op_type not in CONTROL_FLOW:
            continue
        for attr in node.attributes.values():
            graphs = []
            if attr.type == ir.AttributeType.GRAPH:
                graphs = [attr.as_graph()]
            elif attr.type == ir.AttributeType.GRAPHS:
                graphs = list(attr.as_graphs())
            for g in graphs:
                why = _weights_in(g, inits)
                if why:
                    name = repr(node.name) if node.name else f"(unnamed, node #{index})"
                    fix = ("export the model with the branch fixed (e.g. torch.export "
                           "specializes data-dependent branches)") if node.op_type == "If" else \
                        ("export the model with the loop unrolled (a fixed number of steps: "
                         "torch.export and torch.jit.trace unroll Python loops)")
                    raise PrecondError(
                        f"{node.op_type} node {name} holds weights in its subgraph ({why}): "
                        f"control flow with weights inside is not supported; {fix}")


def _weights_in(g: ir.Graph, outer_inits: dict) -> str | None:
    for name, v in g.initializers.items():
        t = v.const_value
        if v.dtype in FLOAT_TYPES and t is not None and t.size not in (0, 1):
            return f"initializer {name}"
    for node in ir.traversal.RecursiveGraphIterator(g):
        if node.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul", "LSTM", "GRU", "RNN"):
            for inp in node.inputs[1:]:
                if inp is not None and (inp.is_initializer() or inp.name in outer_inits
                                        or inp.const_value is not None):
                    return f"{node.op_type} reading {inp.name}"
            if node.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and node.inputs:
                first = node.inputs[0]
                if first is not None and first.name in outer_inits:
                    return f"{node.op_type} reading {first.name}"
        if node.op_type == "Constant":
            for a in node.attributes.values():
                if a.type == ir.AttributeType.TENSOR:
                    t = a.as_tensor()
                    if t.dtype in FLOAT_TYPES and t.size > 16:
                        return f"a constant weight tensor in {node.name or 'a Constant node'}"
    return None


def normalize(model: ir.Model) -> NormalizeInfo:
    """Run the clean-ups in place; returns what was done."""
    info = NormalizeInfo()
    check_supported(model)
    if not _sorted(model.graph):
        model.graph.sort()
        info.notes.append("the graph's nodes were not in topological order (ONNX requires "
                          "it); they were sorted")
    if model.functions:
        n_before = len(model.functions)
        common_passes.InlinePass()(model)
        info.inlined = n_before - len(model.functions)
        if info.inlined:
            info.notes.append(f"inlined {info.inlined} model-local function(s)")
    before = set(model.graph.initializers)
    common_passes.LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=0)(model)
    info.lifted = set(model.graph.initializers) - before
    info.unshared = _unshare_identity(model)
    if info.unshared:
        info.notes.append(f"{info.unshared} initializer use(s) re-shared through Identity nodes "
                          f"(exporter deduplication) were given their own copy, so each layer "
                          f"is re-initialized on its own")
    info.renamed = _unique_names(model)
    return info


#: value_ties reads at most this many bytes of weights (beyond it, no tie is looked for)
TIE_SCAN_BYTES = 1 << 30


def value_ties(model: ir.Model) -> list[tuple[str, str]]:
    """Pairs of 2-D float initializers of the main graph, the second the transpose of the
    first: a weight tied in the exported model that the exporter stored twice
    (``torch.onnx.export`` folds ``emb.weight.T`` of a tied output layer into a constant).
    Equal values without a transpose are not listed: exporters keep such a tie as one
    initializer, and equal copies are layers cloned before training (``copy.deepcopy``), not
    tied.  Values that are all equal (zeros, ones) are no evidence either.  Returns
    ``(first, second)`` in initializer order, ``second`` the transpose of ``first``."""
    inits = [v for v in model.graph.initializers.values()
             if v.const_value is not None and v.dtype in FLOAT_TYPES and v.shape is not None
             and len(v.shape) == 2 and all(isinstance(d, int) for d in v.shape)
             and v.const_value.size > 1]
    shapes = [tuple(sorted(v.shape)) for v in inits]
    cands = [v for v, sh in zip(inits, shapes) if shapes.count(sh) > 1]
    if sum(int(v.const_value.nbytes) for v in cands) > TIE_SCAN_BYTES:
        return []
    arrays, groups = {}, {}
    for v in cands:
        a = v.const_value.numpy()
        if a.min() == a.max():
            continue
        arrays[v.name] = a
        key = (tuple(sorted(a.shape)), float(a.sum(dtype="float64")),
               float((a.astype("float64") ** 2).sum()))
        groups.setdefault(key, []).append(v.name)
    ties = []
    for names in groups.values():
        for i, x in enumerate(names):
            for y in names[i + 1:]:
                ax, ay = arrays[x], arrays[y]
                if ax.shape == ay.shape[::-1] and (ax.T == ay).all() and \
                        not (ax.shape == ay.shape and (ax == ay).all()):
                    ties.append((x, y))
    return ties


def _sorted(g: ir.Graph) -> bool:
    """Whether every node comes after the nodes producing its inputs (the capture reads the
    graph in order: a layer listed before its input would look like a constant)."""
    seen: set[int] = set()
    for node in g:
        for v in node.inputs:
            p = v.producer() if v is not None else None
            if p is not None and p.graph is g and id(p) not in seen:
                return False
        seen.add(id(node))
    return True


def _unshare_identity(model: ir.Model) -> int:
    """Identity(initializer) -> one initializer per use of the Identity's output; an
    initializer left without a reader is dropped (the file would keep the old values, unused,
    and onnxruntime warns about them at every load)."""
    g = model.graph
    count = 0
    taken = set(g.initializers)
    copied: list[ir.Value] = []
    for node in list(g):
        if node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
            continue
        src = node.inputs[0] if node.inputs else None
        if src is None or not src.is_initializer() or src.is_graph_input():
            continue
        out = node.outputs[0]
        if out.is_graph_output():
            continue
        uses = list(out.uses())
        base = out.name or f"{src.name}_identity"
        for k, use in enumerate(uses):
            name = base if k == 0 and base not in taken else _fresh(f"{base}__{k}", taken)
            taken.add(name)
            v = ir.Value(name=name, shape=src.shape, type=src.type, const_value=src.const_value)
            if k == 0:
                out.name = None
            g.register_initializer(v)
            use.node.replace_input_with(use.idx, v)
            count += 1
        g.remove(node, safe=True)
        copied.append(src)
    for src in copied:     # read only through Identity nodes: every reader has its copy now
        if src.name in g.initializers and not list(src.uses()) and not src.is_graph_output():
            g.initializers.pop(src.name)
    return count


def _fresh(name: str, taken: set[str]) -> str:
    if name not in taken:
        return name
    i = 1
    while f"{name}_{i}" in taken:
        i += 1
    return f"{name}_{i}"


def _unique_names(model: ir.Model) -> int:
    """Name unnamed nodes and de-duplicate names (plans are keyed by node names)."""
    seen: set[str] = set()
    renamed = 0
    for i, node in enumerate(model.graph):
        name = node.name
        if not name or name in seen:
            base = name or f"{node.op_type}_{i}"
            node.name = _fresh(base, seen)
            renamed += 1
        seen.add(node.name)
    return renamed
