"""The graph pass, per node: the element of the architecture expression each classified node
becomes (an ``Act``/``Affine`` leaf, ``None`` when the C map passes through it, a join marker),
and what the method refuses, with the reason and what to do (spec §3.1, §5)."""
from __future__ import annotations

from typing import Any

from precondfx.core import optable
from precondfx.core.graph import Node
from precondfx.errors import PrecondError
from precondfx.schemes.activations import activation_of, activation_params
from precondfx.schemes.tat.arch import Act, Affine

RELU_FAMILY = ("relu", "leaky_relu", "prelu")
# base name (module class or function name, lower case) -> the activation's name in the maths
# (precondfx.schemes.activations)
_SMOOTH = {"tanh": "tanh", "sigmoid": "sigmoid", "softplus": "softplus", "gelu": "gelu_exact",
           "silu": "swish", "swish": "swish", "elu": "elu", "celu": "elu", "selu": "selu",
           "softsign": "softsign"}
_ACT_KINDS = ("relu", "leaky_relu", "prelu", "smooth_gate", "saturating", "exp_linear",
              "clipped_relu")


def _act_name(n: Node) -> str | None:
    """The maths' name of an activation node (relu / leaky_relu / prelu or a smooth one), or
    None when no transform exists for it here (the node is recognized by the shared
    ``activation_of``)."""
    base, _ = activation_of(n)
    if base in RELU_FAMILY:
        return base
    if base == "gelu":
        return "gelu" if n.attrs.get("approximate") == "tanh" else "gelu_exact"
    return _SMOOTH.get(base)


_REFUSE_HELP = {
    "normalization": "TAT and DKS shape the kernel of networks *without* normalization layers (the "
                     "reference implementation raises 'DKS and TAT are not compatible with the use "
                     "of BN layers'; spec §5): remove them (TAT is meant to replace them), or use "
                     "scheme='geometric' or scheme='lsuv'",
    "multiplicative": "attention, softmax, gating and other products of activations are outside "
                      "the kernel theory of TAT/DKS (spec §5): use scheme='geometric' or "
                      "scheme='lsuv' for this model",
    "maxpool": "max pooling is not covered by TAT/DKS (spec §5): let precondfx replace it first "
               "with maxpool='stride' (default), 'conv' or 'avgpool'",
    "activation": "no TAT/DKS transform is available for this activation here (ReLU family: "
                  "relu, leaky_relu, prelu; smooth: tanh, sigmoid, softplus, gelu, silu, elu, "
                  "selu (dks only), softsign; kinked functions such as relu6, hardtanh, hardswish "
                  "have an infinite C''(1)): replace it by one of these in the model",
    "act_params": "the transforms are solved for and applied to the activation at torch's "
                  "default parameters (ELU/CELU alpha=1, Softplus beta=1, threshold=20); this "
                  "one has others, so the rewritten network would compute a different "
                  "activation: use the defaults, or scheme='geometric', 'lsuv' or 'gne'",
    "elementwise": "a non-linear elementwise function or reduction without a TAT/DKS transform: "
                   "its C map is unknown (spec §3.1)",
    "unknown": "an op not in precondfx's op table: its C map is unknown; rewrite it with "
               "supported ops or use scheme='geometric'",
    "embedding": "embedding layers read indices, not vectors with q = 1 per location: not covered "
                 "by the kernel theory (spec §5); use scheme='geometric'",
    "recurrent": "recurrent cells share weights over time steps: not covered by the kernel theory "
                 "(spec §5); use scheme='geometric'",
    "inputs": "the per-location kernel theory describes a network with one input (spec §3.2): "
              "models with several data inputs are not covered",
}

#: a node the method does not cover (it gets no element)
_REFUSED = object()


class _Findings:
    """What the pass finds on its way: notes (each once) and the nodes it refuses, grouped by
    reason; ``raise_refusals`` turns the refusals into one PrecondError."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self._noted: set[str] = set()
        self.problems: dict[str, list[str]] = {}

    def note(self, key: str, text: str) -> None:
        if key not in self._noted:
            self._noted.add(key)
            self.notes.append(text)

    def refuse(self, cat: str, n: Node, what: str) -> Any:
        self.problems.setdefault(cat, []).append(f"{n.name} ({what})")
        return _REFUSED

    def raise_refusals(self) -> None:
        if not self.problems:
            return
        lines = []
        for cat, items in self.problems.items():
            shown = ", ".join(items[:8]) + (f" and {len(items) - 8} more" if len(items) > 8
                                             else "")
            lines.append(f"  - {shown}: {_REFUSE_HELP[cat]}")
        raise PrecondError("TAT/DKS cannot handle this model; it contains what the method does "
                           "not cover:\n" + "\n".join(lines))


def _affine_element(n: Node, f: _Findings) -> Any:
    """A weighted layer: an affine map (its weight must be a parameter)."""
    k, v = n.kind, n.name
    e: Any = Affine()
    if n.status != optable.WEIGHTED:
        e = f.refuse("multiplicative", n, f"{k} whose weight is an activation")
    elif k == "conv" and int(n.attrs.get("groups", 1) or 1) > 1:
        f.note("groups", "grouped/depthwise convolutions: their Delta init makes the channel "
               "maps near-deterministic, so the random-feature assumption is weak (spec §5); "
               "treated as affine")
    if k == "conv_transpose" and any(int(s) > 1 for s in _as_tuple(n.attrs.get("stride", 1))):
        f.note("convT", f"{v}: a strided transposed convolution with a Delta kernel leaves "
               f"zeros between its outputs (q = 0 there): the per-location theory is "
               f"approximate after it")
    return e


def _maxpool_element(n: Node, pc: Any, f: _Findings) -> Any:
    """A max-pool: what the plan turns it into (a convolution, a fold, an average)."""
    action = pc.action if pc is not None else "keep"
    if action == "conv":
        return Affine()
    if action in ("fold", "avgpool"):
        return None
    return f.refuse("maxpool", n, f"kept: {pc.reason}" if pc is not None else "not replaced")


#: kinds the C map passes through unchanged, with the note that says it is an approximation
#: (None: exact, no note)
_TRANSPARENT = {
    "avgpool": ("avgpool", "average pooling / means over positions were treated as the identity "
                "(approximate: they mix locations; the reference does the same, spec §5)"),
    "resize": ("resize", "upsampling copies locations: treated as the identity in the C map"),
    **{k: None for k in ("dropout", "reshape", "select", "pad", "cast", "constant", "output")},
}
_TRANSPARENT["mean"] = _TRANSPARENT["avgpool"]
#: kinds refused outright: the reason's category
_REFUSED_KINDS = {"normalization": "normalization", "softmax": "multiplicative",
                  "sdpa": "multiplicative", "attention": "multiplicative",
                  "gating": "multiplicative", "embedding": "embedding",
                  "recurrent": "recurrent", "elementwise": "elementwise",
                  "reduce_other": "elementwise"}


def _other_element(n: Node, nin: int, what: str, f: _Findings) -> Any:
    """Joins, transparent ops and refused ones."""
    k, v = n.kind, n.name
    if k in ("add", "sub", "concat"):
        return ("join", "concat" if k == "concat" else "sum") if nin >= 2 else None
    if k == "mul":
        if nin >= 2:
            return f.refuse("multiplicative", n, "product of two activations (gating)")
        f.note("mul", "a multiplication by a constant or learned scalar was treated as the "
               "identity in the C map (exact for cosines; it changes q, which matters for "
               "smooth activations and for the weights of a following sum)")
        return None
    if k in _TRANSPARENT:
        if _TRANSPARENT[k] is not None:
            f.note(*_TRANSPARENT[k])
        return None
    if k == "neg":
        abs_ = "abs" in n.target.rsplit(".", 1)[-1]
        return f.refuse("elementwise", n, "abs") if abs_ else None
    if k == "sum":
        f.note("sum", f"{v}: a sum over elements was treated as the identity in the C map")
        return None
    if k in _REFUSED_KINDS:
        return f.refuse(_REFUSED_KINDS[k], n, what)
    return f.refuse("unknown", n, f"{k}: {n.target}")


def _element(n: Node, nin: int, pc: Any, f: _Findings) -> Any:
    """The element of node ``n`` (``nin`` inputs on the data path; ``pc`` its pool plan)."""
    k = n.kind
    what = n.attrs.get("class") or n.target.rsplit(".", 1)[-1]
    if k in ("conv", "conv_transpose", "linear") or (k == "matmul" and "weight" in n.params):
        e = _affine_element(n, f)
    elif k == "matmul":
        e = f.refuse("multiplicative", n, "product of two activations (attention scores)")
    elif k == "maxpool":
        e = _maxpool_element(n, pc, f)
    elif k == "adaptive_maxpool":
        e = f.refuse("maxpool", n, "adaptive max pooling has no stride to fold")
    elif k in _ACT_KINDS:
        name = _act_name(n)
        params = {p: v for p, v in activation_params(n).items() if p != "approximate"}
        if name is None:
            e = f.refuse("activation", n, what)
        elif params:
            e = f.refuse("act_params", n, f"{what}: " + ", ".join(f"{p}={v:g}"
                                                                  for p, v in params.items()))
        else:
            e = Act(name)
    else:
        e = _other_element(n, nin, what, f)
    if e is not _REFUSED and not isinstance(e, tuple) and nin > 1 and \
            (e is not None or k != "output"):
        f.refuse("elementwise", n, f"{what} combines {nin} activations")
    return e


def _as_tuple(v: Any) -> tuple:
    return tuple(v) if isinstance(v, (list, tuple)) else (v,)

