"""Describe one call as a graph :class:`~precondfx.core.graph.Node`: what every capture shares.

A capture (fx, torch.export, the eager tracer, ONNX) names each operand of a call as an
activation (:class:`Act`), a parameter (:class:`Param`) or a constant (:class:`Const`) and hands
the call to :func:`build_node`, which reads the op's arguments the planner needs (stride, padding,
which operand is the weight) from the op table's spelling of it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from precondfx.core import optable
from precondfx.core.graph import Graph, Node


@dataclass(frozen=True)
class Act:
    """An activation operand produced by node ``src``."""

    src: str


@dataclass(frozen=True)
class Param:
    """A parameter (or buffer) operand, by fully qualified name."""

    name: str


@dataclass(frozen=True)
class Const:
    """A constant operand (a Python number, or a tensor that is neither activation nor parameter)."""

    value: Any = None


# Positional argument names of the functional spellings of ops whose arguments the planner needs.
_ARGS: dict[str, tuple[str, ...]] = {
    "conv": ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
    "convolution": ("input", "weight", "bias", "stride", "padding", "dilation", "transposed",
                    "output_padding", "groups"),
    "conv_transpose": ("input", "weight", "bias", "stride", "padding", "output_padding",
                       "groups", "dilation"),
    "linear": ("input", "weight", "bias"),
    "addmm": ("bias", "input", "weight"),
    "matmul": ("input", "other"),
    "embedding": ("input", "weight", "padding_idx"),
    "aten_embedding": ("weight", "input", "padding_idx"),
    "maxpool": ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode",
                "return_indices"),
    "avgpool": ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad"),
    "leaky_relu": ("input", "negative_slope"),
    # F.elu(input, alpha, inplace), aten.elu(self, alpha, ...), F.celu / aten.celu likewise,
    # F.softplus / aten.softplus(input, beta, threshold): positional parameters by name
    "elu": ("input", "alpha"),
    "softplus": ("input", "beta", "threshold"),
}


def _parse_call(family: str, args: list, kwargs: dict) -> dict[str, Any]:
    names = _ARGS.get(family, ())
    out = {names[i]: a for i, a in enumerate(args) if i < len(names)}
    out.update(kwargs)
    return out


def _unconst(v: Any) -> Any:
    if isinstance(v, Const):
        return v.value
    if isinstance(v, (list, tuple)):
        return type(v)(_unconst(x) for x in v)
    return v


def _einsum_weight(target: str, args: list) -> tuple[str, int, str] | None:
    """``(equation, operand index, parameter name)`` of an einsum of one activation and one
    parameter (``torch.einsum("bi,ih->bh", x, self.w)``, ``aten.einsum(eq, [x, w])``, ONNX
    ``Einsum``): a linear layer whose fans the equation gives (``fans.einsum_fans``); None
    for any other einsum (a product of two activations, three operands, an elementwise
    product with a parameter such as ``"bi,i->bi"``)."""
    if not target.rsplit(".", 1)[-1].lower().startswith("einsum") or not args:
        return None
    eq = _unconst(args[0])
    if not isinstance(eq, str):
        return None
    ops = list(args[1]) if len(args) >= 2 and isinstance(args[1], (list, tuple)) \
        else list(args[1:])
    if len(ops) != 2:
        return None
    kinds = [type(o) for o in ops]
    if sorted(k.__name__ for k in kinds) != ["Act", "Param"]:
        return None
    i = kinds.index(Param)
    lhs, arrow, out = eq.replace(" ", "").partition("->")
    subs = lhs.split(",")
    if arrow and len(subs) == 2 and "." not in eq and all(c in out for c in subs[i]):
        return None     # sums over none of the weight's indices: an elementwise product
    return eq, i, ops[i].name


def _plain(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_plain(x) for x in v)
    return isinstance(v, (int, float, bool, str)) or v is None


def _family(kind: str, target: str) -> str:
    if kind == "conv" and ("convolution" in target):
        return "convolution"
    if kind == "linear" and "addmm" in target:
        return "addmm"
    if kind == "embedding" and target.startswith("aten."):
        return "aten_embedding"
    name = target.rsplit(".", 1)[-1]
    if kind == "exp_linear" and name in ("elu", "elu_", "celu", "celu_"):
        return "elu"
    if kind == "smooth_gate" and name == "softplus":
        return "softplus"
    return kind


def build_node(name: str, spec: optable.OpSpec | None, target: str, args: list, kwargs: dict,
               *, module: str | None = None, module_params: list[str] | None = None,
               module_attrs: dict[str, Any] | None = None, call_index: int = 0,
               out_shape: tuple | None = None, in_shapes: list | None = None) -> Node:
    """Describe one call as a neutral Node (shared by every capture method).  A call of a
    module gives ``module_params`` (its parameter names, relative) and ``module_attrs``."""
    spec = spec or optable.UNKNOWN_SPEC
    inputs: list[str] = []
    params: dict[str, str] = {}
    nconst = 0
    flat: list[tuple[str | None, Any]] = []

    def walk(role: str | None, a: Any) -> None:
        if isinstance(a, (list, tuple)):
            for x in a:
                walk(role, x)
        elif isinstance(a, dict):
            for k, x in a.items():
                walk(role, x)
        else:
            flat.append((role, a))

    if module_params is not None:
        for a in list(args) + list(kwargs.values()):
            walk(None, a)
        for pname in module_params:
            params[pname] = f"{module}.{pname}" if module else pname
        attrs = dict(module_attrs or {})
    else:
        parsed = _parse_call(_family(spec.kind, target), list(args), dict(kwargs))
        for i, a in enumerate(args):
            walk(None, a)
        for k, a in kwargs.items():
            walk(k, a)
        attrs = {}
        for k, v in parsed.items():
            v = _unconst(v)
            if k not in ("input", "weight", "bias", "other") and _plain(v):
                attrs[k] = v
        for role in ("weight", "bias"):
            if isinstance(parsed.get(role), Param):
                params[role] = parsed[role].name
        einsum = _einsum_weight(target, list(args)) if spec.kind == "matmul" else None
        if einsum is not None:
            attrs["einsum"], attrs["weight_operand"], params["weight"] = einsum
        elif spec.kind == "matmul":
            if isinstance(parsed.get("other"), Param):
                params["weight"] = parsed["other"].name
                attrs["weight_side"] = "right"
            elif isinstance(parsed.get("input"), Param):
                params["weight"] = parsed["input"].name
                attrs["weight_side"] = "left"
    for role, a in flat:
        if isinstance(a, Act):
            if a.src not in inputs:
                inputs.append(a.src)
        elif isinstance(a, Param):      # also a parameter passed into a module call
            if a.name not in params.values():   # (self.norm(self.latents)): it is read here
                params[f"operand{len(params)}"] = a.name
        elif isinstance(a, Const) or isinstance(a, (int, float)):
            nconst += 1
    if spec.kind == "mul" and "div" in target.lower() and args and not isinstance(args[0], Act):
        attrs["divides_by_activation"] = True       # c / x: not linear in x
    factor = _param_factor(spec.kind, target, list(args), flat)
    if factor is not None:
        attrs["factor"] = factor
    return Node(name=name, kind=spec.kind, target=target, inputs=inputs, params=params,
                attrs=attrs, module=module, call_index=call_index,
                out_shape=tuple(out_shape) if out_shape is not None else None,
                in_shapes=list(in_shapes or []), const_operands=nconst)


def _param_factor(kind: str, target: str, args: list, flat: list) -> float | None:
    """The number ``c`` of a call ``W * c``, ``c * W`` or ``W / c`` (``1 / c``) of one
    parameter by one Python number, outside any module call: the fixed gain of a weight
    written as ``F.linear(x, self.weight * self.scale)`` (an equalized-learning-rate layer,
    :func:`weight_gains`); None for anything else."""
    if kind != "mul" or len(flat) != 2 or "div" in target.lower() and \
            (not args or not isinstance(args[0], Param)):
        return None
    ps = [a for _, a in flat if isinstance(a, Param)]
    cs = [v for v in (_unconst(a) for _, a in flat)
          if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(ps) != 1 or len(cs) != 1 or not math.isfinite(float(cs[0])) or cs[0] == 0:
        return None
    return 1.0 / float(cs[0]) if "div" in target.lower() else float(cs[0])


def weight_gains(graph: Graph, scalars: Mapping[str, float] | None = None) -> Graph:
    """``F.linear(x, self.weight * c)``, ``F.conv2d(x, self.weight * c)``, ``x @ (W * c)``
    (an equalized-learning-rate layer: the weight stored at unit scale, a fixed gain applied
    in the forward) read as the weighted layer it is, its parameter with the gain c in
    ``graph.gains`` (the ONNX capture's Gemm ``alpha`` and ``Mul(W, c)`` go there too): the
    product node, which reads the parameter and a Python number alone and is read by that
    layer alone as its weight, is dropped and the layer takes the parameter as its weight; the
    plan divides the draw by the gain (``core.plan.divide_gains``) so that the layer's
    effective weight has the rule's std.  A bias written the same way (``self.bias *
    lr_mul``) becomes the layer's bias.  ``scalars``: the values of the model's one-element
    buffers (``self.register_buffer("scale", torch.tensor(c))``), a gain held as a buffer
    (``self.weight * self.scale``, ``self.weight / self.scale``) read as the number it holds.
    One rule for every capture, after :func:`weight_transposes`."""
    users = graph.users()
    drop: set[str] = set()
    gains = dict(graph.gains)
    scalars = scalars or {}

    def gain_of(name: str) -> tuple[str, float] | None:
        n = graph.get(name)
        if n is None or n.kind != "mul" or n.inputs or len(users.get(name, ())) != 1 or \
                "rounding_mode" in n.attrs:
            return None
        ps = [n.params[k] for k in ("operand0", "operand1") if k in n.params]
        if len(ps) != len(n.params):
            return None
        if len(ps) == 1 and "factor" in n.attrs:
            return ps[0], float(n.attrs["factor"])
        if len(ps) != 2 or n.const_operands or (ps[0] in scalars) == (ps[1] in scalars):
            return None
        if ps[1] in scalars:        # W * s, W / s
            c = scalars[ps[1]]
            return ps[0], 1.0 / c if "div" in n.target.lower() else c
        if "div" in n.target.lower():
            return None             # s / W: not linear in W
        return ps[1], scalars[ps[0]]

    for r in graph:
        if r.kind not in ("linear", "conv", "matmul") or len(r.inputs) < 2 or \
                "weight" in r.params or "einsum" in r.attrs or \
                r.kind == "matmul" and len(r.inputs) != 2:
            continue
        w = gain_of(r.inputs[1])
        if w is None or r.inputs[0] == r.inputs[1]:
            continue
        rest = r.inputs[2:]
        b = gain_of(rest[0]) if len(rest) == 1 and "bias" not in r.params else None
        if rest and b is None:
            continue                # a bias computed otherwise: left as it was
        drop.add(r.inputs[1])
        r.params["weight"] = w[0]
        gains.setdefault(w[0], w[1])        # one parameter read with two gains: the first
        if r.kind == "matmul":
            r.attrs["weight_side"] = "right"
        if b is not None:
            drop.add(rest[0])
            r.params["bias"] = b[0]
            gains.setdefault(b[0], b[1])
        r.inputs = [r.inputs[0]]
    return _without(graph, drop, gains)


def _without(graph: Graph, drop: set[str], gains: dict[str, float] | None = None) -> Graph:
    """``graph`` less the nodes ``drop`` (and with ``gains``), a new Graph where anything
    changes."""
    gains = graph.gains if gains is None else gains
    if not drop and gains == graph.gains:
        return graph
    return Graph([n for n in graph if n.name not in drop], graph.method, notes=graph.notes,
                 outputs=[o for o in graph.outputs if o not in drop], gains=gains)


def fixed_factor_node(node: Node) -> bool:
    """A product ``c * x``, ``x * c`` or quotient ``x / c``, outside any module call, of one
    activation ``x`` by one fixed factor ``c`` (a Python number, or a parameter or buffer):
    linear in ``x``, so a scale on ``x`` is the same scale on the result.  The one rule for
    the captured graph (fold's walks and the hooks' back end's placements); fold's reading
    of an fx GraphModule states it on fx nodes (``pytorch.folding._fixed_factor_operand``)."""
    return not node.module and node.kind == "mul" and len(node.inputs) == 1 and \
        node.const_operands + len(node.params) == 1 and nonlinear_product(node) is None


def gate_node(node: Node) -> bool:
    """A product ``a * b`` of two activations and nothing else, outside any module call (a
    gated branch's ``h * gate``): linear in each operand, so a scale on either one is the
    same scale on the result (a quotient ``a / b`` is not linear in ``b``: not a gate)."""
    return not node.module and node.kind == "mul" and len(node.inputs) == 2 and \
        node.const_operands + len(node.params) == 0 and nonlinear_product(node) is None and \
        not any(w in node.target.lower() for w in ("div", "addcmul"))


def nonlinear_product(node: Node) -> str | None:
    """Why a ``mul``-kind node is not linear in its activation operand (``c / x``; a division
    rounding its result, ``torch.div(x, c, rounding_mode="floor")``), or None."""
    if node.attrs.get("divides_by_activation"):
        return "divides a constant by the activation (c / x)"
    mode = node.attrs.get("rounding_mode")
    if mode is not None:
        return f"divides with rounding_mode={mode!r}, which rounds its result"
    return None


#: the spellings of a 2-D transpose (``W.t()``, ``W.transpose(0, 1)``, ``torch.t(W)``,
#: ``aten.t``, ``aten.numpy_T``; ``W.H``, ``W.mH``, ``torch.adjoint(W)``: the conjugate
#: transpose, the transpose of a real weight): the last part of a node's target
_TRANSPOSES = frozenset({"t", "transpose", "swapaxes", "permute", "numpy_T", "mT", "T",
                         "H", "mH", "matrix_H", "adjoint"})


def weight_transposes(graph: Graph) -> Graph:
    """``x @ self.weight.t()``, ``x @ self.weight.T`` (a matrix product with a 2-D parameter's
    transpose) read as the
    linear layer it is: the transpose node, which reads the parameter alone, is dropped and
    every matrix product reading it as its right operand takes the parameter as its weight,
    stored (out, in) as a Linear's (``weight_side='right_t'``: the fans of ``F.linear``).  A
    transpose read by anything else stays as it was.  One rule for every capture."""
    users = graph.users()
    drop: set[str] = set()
    for n in graph:
        if n.kind != "reshape" or n.inputs or list(n.params) != ["operand0"] or \
                n.target.rsplit(".", 1)[-1] not in _TRANSPOSES or \
                n.out_shape is None or len(n.out_shape) != 2 or not users.get(n.name):
            continue
        readers = [graph[u] for u in users[n.name]]
        if not all(r.kind == "matmul" and len(r.inputs) == 2 and r.inputs[1] == n.name and
                   r.inputs[0] != n.name and not r.params and "einsum" not in r.attrs
                   for r in readers):
            continue
        for r in readers:
            r.inputs = [r.inputs[0]]
            r.params["weight"] = n.params["operand0"]
            r.attrs["weight_side"] = "right_t"
        drop.add(n.name)
    return _without(graph, drop)
