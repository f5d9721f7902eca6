"""Module paths of ONNX nodes, recovered from the exporters' metadata (dynamo: ``name_scopes`` and
``class_hierarchy``; TorchScript: ``/layer1/layer1.0/conv1/Conv`` node names; else the weight's
name), so plans name the same parameters as on the PyTorch path."""
from __future__ import annotations

import ast

import onnx_ir as ir

from precondfx.core import optable


def _meta_list(node: ir.Node, key: str) -> list[str] | None:
    raw = node.metadata_props.get(key)
    if not raw:
        return None
    try:
        val = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return None
    return [str(x) for x in val] if isinstance(val, (list, tuple)) else None


def _legacy_scope(name: str | None) -> list[str] | None:
    """``/layer1/layer1.0/conv1/Conv`` -> full module path parts of the innermost scope."""
    if not name or not name.startswith("/"):
        return None
    segs = [s for s in name.split("/")[1:-1] if s]
    paths: list[str] = []
    for s in segs:
        atoms = s.split(".")
        if paths and atoms[0] == paths[-1].split(".")[-1] and len(atoms) > 1:
            paths.append(paths[-1] + "." + ".".join(atoms[1:]))
        else:
            paths.append((paths[-1] + "." + s) if paths else s)
    return paths


class _Modules:
    """Recovers the leaf module path of a node from exporter metadata or names."""

    def __init__(self, model: ir.Model) -> None:
        self.inits = model.graph.initializers
        scope_count: dict[str, int] = {}
        deeper: set[str] = set()
        for node in model.graph:
            if node.op_type == "Constant":
                continue
            paths = _legacy_scope(node.name)
            if not paths:
                continue
            scope_count[paths[-1]] = scope_count.get(paths[-1], 0) + 1
            deeper.update(paths[:-1])
        self.scope_count, self.deeper = scope_count, deeper

    def of(self, node: ir.Node, kind: str, weight: str | None) -> str | None:
        cls = _meta_list(node, "pkg.torch.onnx.class_hierarchy")
        scopes = _meta_list(node, "pkg.torch.onnx.name_scopes")
        if cls and scopes and len(cls) >= 2 and len(scopes) >= 2:
            spec = optable.for_module_class_name(cls[-2])
            if spec is not None and scopes[-2] and (
                    spec.kind == kind or (kind == "matmul" and spec.kind == "linear")):
                return scopes[-2]
        if weight and weight.endswith(".weight") and not weight.startswith("onnx::"):
            return weight[: -len(".weight")]
        paths = _legacy_scope(node.name)
        if paths:
            p = paths[-1]
            if weight and weight.startswith(p + "."):
                return p
            if self.scope_count.get(p, 0) == 1 and p not in self.deeper:
                return p
        return None

