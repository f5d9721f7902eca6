"""The front-end neutral graph every stage works on.

A capture method (torch.fx, torch.export, the eager tracer, or the ONNX reader) turns a model
into a :class:`Graph`: nodes in execution order, each with a *kind* from the op table, the names
of the nodes whose activations it reads, the parameters it reads (by fully qualified name) and
the attributes the planner needs (kernel size, stride, groups...).  Classification, planning and
reporting only ever see this structure, which is what lets one plan serve PyTorch and ONNX.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class Node:
    """One operation, or one call of a leaf module (a module called twice is two nodes).

    Besides the op's own attributes, ``attrs`` carries facts a front end states for the
    planner: ``keep_reason`` (a max-pool that must stay, and why), ``no_fold_reason`` (a
    convolution a pool's stride must not be folded into, and why) and ``symbolic_spatial``
    (the input's spatial size varies, so effective kernel taps are not defined)."""

    name: str
    kind: str
    target: str                                     # the original op, for humans
    inputs: list[str] = field(default_factory=list)  # producer nodes of activation operands
    params: dict[str, str] = field(default_factory=dict)  # role -> parameter name
    attrs: dict[str, Any] = field(default_factory=dict)
    module: str | None = None       # owning leaf module path, if the node is a module call
    call_index: int = 0             # which call of that module (0 = first)
    out_shape: tuple[int, ...] | None = None
    in_shapes: list[tuple[int, ...] | None] = field(default_factory=list)
    const_operands: int = 0         # operands that are Python numbers or constant tensors
    status: str = ""
    reason: str = ""

    def to_dict(self) -> dict:
        """Plain-data form for JSON."""
        return {
            "name": self.name, "kind": self.kind, "target": self.target,
            "inputs": list(self.inputs), "params": dict(self.params),
            "module": self.module, "call_index": self.call_index,
            "out_shape": list(self.out_shape) if self.out_shape is not None else None,
            "status": self.status, "reason": self.reason,
            "attrs": {k: _jsonable(v) for k, v in self.attrs.items()},
        }


def _jsonable(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


@dataclass
class Graph:
    """Nodes in execution order plus the capture's provenance."""

    nodes: list[Node]
    method: str                                  # "fx", "export", "draft_export", "eager", "onnx"
    notes: list[str] = field(default_factory=list)  # why earlier capture methods failed, etc.
    outputs: list[str] = field(default_factory=list)  # nodes whose values the model returns
    #: parameter -> the fixed factor the forward multiplies it by before a layer reads it
    #: (``F.linear(x, self.weight * c)``, a Gemm's ``alpha``, ``Mul(W, 3)``): the plan stores
    #: it at the planned value divided by that factor (``core.plan.divide_gains``), so that
    #: the value the layer applies is the planned one
    gains: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_name = {n.name: n for n in self.nodes}

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, name: str) -> Node:
        return self._by_name[name]

    def get(self, name: str) -> Node | None:
        return self._by_name.get(name)

    def users(self) -> dict[str, list[str]]:
        """Consumers of each node's value."""
        out: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                if i in out:
                    out[i].append(n.name)
        return out

    def weighted(self) -> list[Node]:
        """The weighted nodes (status ``weighted``), in execution order."""
        return [n for n in self.nodes if n.status == "weighted"]

    def ancestor_masks(self) -> tuple[dict[str, int], list[int]]:
        """Each node's execution index, and per index the set of its ancestors as a bitmask
        of indices (bit ``i``: node ``i`` is upstream).  The same sets as :meth:`ancestors`,
        in N bits per node and C-speed unions: a 200-block transformer has about 6000 nodes,
        where frozensets of names took most of the planning time."""
        idx = {n.name: i for i, n in enumerate(self.nodes)}
        masks: list[int] = []
        for n in self.nodes:
            m = 0
            for i in n.inputs:
                j = idx.get(i)
                if j is not None and j < len(masks):
                    m |= masks[j] | (1 << j)
            masks.append(m)
        return idx, masks

    def upstream_of(self, name: str) -> set[str]:
        """Every node upstream of ``name`` (one node's :meth:`ancestors` entry, by a walk)."""
        seen: set[str] = set()
        todo = list(self._by_name[name].inputs) if name in self._by_name else []
        while todo:
            i = todo.pop()
            if i in seen or i not in self._by_name:
                continue
            seen.add(i)
            todo.extend(self._by_name[i].inputs)
        return seen

    def ancestors(self) -> dict[str, frozenset[str]]:
        """For each node, every node upstream of it (used to find residual forks)."""
        anc: dict[str, frozenset[str]] = {}
        for n in self.nodes:
            s: set[str] = set()
            for i in n.inputs:
                if i in anc:
                    s.add(i)
                    s |= anc[i]
            anc[n.name] = frozenset(s)
        return anc
