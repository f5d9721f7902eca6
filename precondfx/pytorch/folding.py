"""Fold precondfx's constants into the weights: a plain model of your own class, for deployment.

``precondition`` returns a model whose constants (the alphas, residual branch scales and the
output scale) are buffers read by hooks (your class) or by ``mul`` nodes (a GraphModule).
``fold(model)`` returns a new model of *your* class with every constant multiplied into the
weights of the module it acts on, so that it computes the same function (to float rounding),
has exactly the original's ``state_dict`` keys, no hooks and no extra buffers, and loads without
precondfx installed.  The preconditioned model is left as is (training goes on with it).

What folds, and where:

* a scale on the *input* of a linear map (``nn.Linear``, convolutions, transposed
  convolutions, transformers' ``Conv1D``): its weight;
* a scale on the *output* of a linear map (weight and bias), an embedding (its table), an
  affine normalization (``LayerNorm``, ``BatchNorm``, ``GroupNorm``, RMSNorm: weight and bias),
  ``nn.MultiheadAttention`` (its output projection);
* a tied weight (GPT-2's ``lm_head`` shares the token embedding) needs one factor for all its
  users: a bias-free linear user whose factor differs passes the difference to the module
  producing its input (GPT-2: the final ``ln_f``), found on the captured graph when the model
  was preconditioned and checked by a run;
* a parametrized tensor (``torch.nn.utils.parametrizations.weight_norm``): the original whose
  scaling scales the tensor (weight_norm's magnitude ``g``, ``original0``), found by a check
  on random originals; an orthogonal or spectral-norm weight has none and is refused.

One design for both back ends: the constants are first read as module input and output
scales (the eager back end stores them so, as buffers; on a GraphModule each ``mul`` by a
precondfx buffer is mapped to the linear modules reading the product, else to the module
producing its operand, up through positively homogeneous ops whether modules or functions,
``F.relu`` as ``nn.ReLU``, and through the other constants' products, such as ``lr_scale``'s
multipliers), then one resolution turns them into a factor per parameter.  The folded model
keeps each module's train/eval flag, and its tensors take the device and dtype of the
preconditioned model's.

What does not fold, reported by :func:`fold_problems` and raised by :func:`fold` as a
``PrecondError`` naming each constant and why: a scale on a module that is not linear in it
(an input scale on a normalization, a custom module), the input scale (it multiplies the
model's inputs: put it in your data pipeline), an output scale with no module producing the
main output, tied weights whose users need different factors with nowhere to pass the
difference, and structural changes a fresh instance of your class cannot reproduce (max-pools
turned into strides or strided convolutions, modules replaced by a scheme: precondition with
``maxpool='keep'`` for a foldable result).

For a GraphModule (fx back end), ``precondition`` keeps a reference to the model of your class
it traced (it shares the GraphModule's layers, so it costs no memory); fold copies it and loads
the GraphModule's weights into it.  That reference is not pickled: after ``torch.load`` of a
pickled GraphModule, pass ``source=YourModel(...)``.
"""
from __future__ import annotations

import collections
import copy
import math
import operator
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from precondfx.pytorch import ops
from precondfx.pytorch.apply import weight_side
from precondfx.pytorch.apply.common import PREFIX, scaled_operand
from precondfx.pytorch.capture.common import Act, Const, Param, build_node, leaves, target_name
from precondfx.pytorch.capture.fx_capture import _metadata_read
from precondfx.errors import PrecondError
from precondfx.core.beta import CHAIN_OPS
from precondfx.core.nodes import fixed_factor_node, gate_node

RECIPE = "_precondfx_recipe"
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm,
          nn.modules.instancenorm._InstanceNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
_HOMOGENEOUS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.ReLU, nn.LeakyReLU,
                nn.Identity, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.Flatten, nn.Unflatten)
_LINEAR = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
           nn.ConvTranspose3d)


@dataclass
class Recipe:
    """What ``precondition`` leaves on its result so that ``fold`` can undo the rewriting:
    the traced model of the user's class (fx back end), the structural changes, and for tied
    bias-free linear layers the module producing their input."""

    source: nn.Module | None = None
    structural: list[str] = field(default_factory=list)
    upstream: dict[str, str] = field(default_factory=dict)
    #: upstream candidates found on the graph of a model planned on the meta device, where
    #: the check by running cannot run: :func:`confirm_upstream` checks them once the model
    #: holds data (``precondfx.pytorch.distributed.calibrate`` calls it)
    pending: dict[str, str] = field(default_factory=dict)
    #: modules holding a parameter tied to another module's that the forward never calls
    #: (BART's and T5's ``shared`` embedding, whose copies ``embed_tokens`` run): they put no
    #: constraint on the factor the tied weight folds with; an entry ``path.name`` is one
    #: slot of a tied parameter that a called module holds but never reads itself (BERT's
    #: ``cls.predictions.bias``: only its ``decoder`` reads the tensor)
    idle: list[str] = field(default_factory=list)
    #: modules whose forward ran on weights other than their own parameters (a hypernetwork's
    #: ``torch.func.functional_call(self.target, weights, x)``): a factor multiplied into their
    #: parameters would not reach what they compute
    borrowed: list[str] = field(default_factory=list)

    def __deepcopy__(self, memo: dict) -> "Recipe":
        return Recipe(copy.deepcopy(self.source, memo), list(self.structural),
                      dict(self.upstream), dict(self.pending), list(self.idle),
                      list(self.borrowed))

    def __getstate__(self) -> dict:   # pickling drops the source (pass source= to fold)
        return {"source": None, "structural": self.structural, "upstream": self.upstream,
                "pending": self.pending, "idle": self.idle, "borrowed": self.borrowed}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({"pending": {}, "idle": [], "borrowed": [], **state})


def recipe_of(model: nn.Module) -> Recipe | None:
    """The recipe ``precondition`` attached to its result, if any."""
    r = model.__dict__.get(RECIPE)
    return r if isinstance(r, Recipe) else None


def attach(model: nn.Module, recipe: Recipe) -> None:
    """Attach a recipe as a plain attribute (not a module, buffer or state_dict entry); a
    GraphModule keeps it through deep copies in its ``meta`` (user-preserved attributes)."""
    model.__dict__[RECIPE] = recipe
    if isinstance(model, fx.GraphModule):
        meta = getattr(model, "meta", None)
        if isinstance(meta, dict):
            meta.setdefault("_user_preserved_attributes", {})[RECIPE] = recipe


# -- what a module is, for folding ----------------------------------------------------------
def kind(mod: nn.Module) -> str | None:
    """'linear' (linear in its input, weight and bias), 'embedding', 'norm' (affine output),
    'mha', or None (nothing folds into it)."""
    if isinstance(mod, _LINEAR) or (type(mod).__name__ == "Conv1D" and hasattr(mod, "nf")):
        return "linear"
    if isinstance(mod, nn.Embedding) and mod.max_norm is None:
        return "embedding"
    if isinstance(mod, nn.EmbeddingBag) and mod.max_norm is None and mod.mode in ("sum", "mean"):
        return "embedding"
    if isinstance(mod, nn.MultiheadAttention):
        return "mha"
    if isinstance(mod, nn.Bilinear):    # x1^T W x2 + b: an output scale goes into W and b, as
        return "norm"                   # for an affine norm; not linear in (x1, x2) jointly
    if isinstance(mod, _NORMS):
        return "norm" if getattr(mod, "weight", None) is not None else None
    if type(mod).__name__.endswith(("RMSNorm", "LayerNorm")) and _affine_output(mod):
        return "norm"
    if _own_linear_layer(mod):
        return "norm"
    return None


_OWN_LINEAR: dict[type, bool] = {}


def _own_linear_layer(mod: nn.Module) -> bool:
    """A layer class precondfx does not know, with no submodules and a ``weight`` of its
    own, whose output multiplying all its parameters by c multiplies by c
    (``F.linear(x, self.weight, self.bias)``, ``x @ self.weight.t() + self.bias``,
    ``F.conv2d(x, self.weight * self.scale)``): an output scale goes into its weight and
    bias.  Checked once per class on a random CPU input as wide
    as either side of the weight, with random parameters substituted (so it works on the meta
    device too)."""
    if type(mod) in _OWN_LINEAR:
        return _OWN_LINEAR[type(mod)]
    w = mod._parameters.get("weight")
    ok = False
    if w is not None and 2 <= w.dim() <= 5 and w.is_floating_point() and not mod._modules \
            and type(mod).__module__.split(".")[0] != "torch":
        g = torch.Generator().manual_seed(0)
        params = {k: torch.randn(tuple(p.shape), generator=g)
                  for k, p in mod._parameters.items() if p is not None}
        # (out, in), (in, out); a convolution's (out, in, k...) reads (batch, in, 8...)
        for width in dict.fromkeys((int(w.shape[1]), int(w.shape[0])) if w.dim() == 2
                                   else (int(w.shape[1]),)):
            x = torch.randn(3, width, *[8] * (w.dim() - 2), generator=g)
            ok = _scales_with_params(mod, params, x)
            if ok:
                break
    _OWN_LINEAR[type(mod)] = ok
    return ok


_AFFINE: dict[type, bool] = {}


def _affine_output(mod: nn.Module) -> bool:
    """A normalization class precondfx does not know: multiplying its parameters by c must
    multiply its output by c (checked once per class on a random CPU input with random
    parameters substituted, so it works on the meta device too; Gemma's ``1 + weight`` RMSNorm
    fails it)."""
    if type(mod) in _AFFINE:
        return _AFFINE[type(mod)]
    w = mod._parameters.get("weight")
    ok = False
    if w is not None and w.dim() == 1 and w.is_floating_point():
        g = torch.Generator().manual_seed(0)
        params = {k: torch.randn(tuple(p.shape), generator=g)
                  for k, p in mod._parameters.items() if p is not None}
        ok = _scales_with_params(mod, params, torch.randn(3, 5, w.numel(), generator=g))
    _AFFINE[type(mod)] = ok
    return ok


def _scales_with_params(mod: nn.Module, params: dict[str, torch.Tensor],
                        x: torch.Tensor) -> bool:
    """Whether ``mod`` run on ``x`` with every parameter of ``params`` multiplied by 3 gives 3
    times its output (to 1e-5 relative, 1e-6 absolute): in float64, so that a sum of many
    terms does not fail it by float32 rounding alone (a 3x3 convolution of output ~17 did, and
    as the verdict is kept per class, the first instance decided for every later one); in
    float32 where the module cannot run in float64.  False where it cannot run at all (another
    input convention, a forward that needs more)."""
    for dtype in (torch.float64, torch.float32):
        p = {k: v.to(dtype) for k, v in params.items()}
        try:
            with torch.no_grad():
                ref = torch.func.functional_call(mod, p, (x.to(dtype),))
                got = torch.func.functional_call(mod, {k: 3.0 * v for k, v in p.items()},
                                                 (x.to(dtype),))
        except Exception:
            continue
        return isinstance(ref, torch.Tensor) and ref.is_floating_point() and \
            bool(torch.allclose(got, 3.0 * ref, rtol=1e-5, atol=1e-6))
    return False


# -- collecting the constants ----------------------------------------------------------------
@dataclass
class _Scales:
    """Factors to fold, keyed by module object id, plus what cannot fold."""

    mods: dict[int, tuple[str, nn.Module]] = field(default_factory=dict)
    inp: dict[int, float] = field(default_factory=dict)
    out: dict[int, float] = field(default_factory=dict)
    problems: list[tuple[str, str]] = field(default_factory=list)
    upstream: dict[int, int] = field(default_factory=dict)
    idle: set[int] = field(default_factory=set)     # tied owners the forward never calls
    #: (module id, parameter name): a tied slot a called module never reads itself
    idle_slots: set[tuple[int, str]] = field(default_factory=set)

    #: a ParametrizationList (module id) -> the module whose tensor it computes (module id)
    #: and that tensor's name: its carrier original takes the factor the tensor needs
    plist: dict[int, tuple[int, str]] = field(default_factory=dict)
    #: a module of no known kind whose output scale moved to a module upstream (inside it or
    #: before it): the factor its own parameters take (ESM's ``lm_head.bias``)
    own: dict[int, float] = field(default_factory=dict)
    #: modules (id) whose upstream link passes a positively homogeneous op: only a positive
    #: factor may move along it
    positive: set[int] = field(default_factory=set)

    def add(self, table: dict[int, float], path: str, mod: nn.Module, v: float) -> None:
        self.mods[id(mod)] = (path, mod)
        table[id(mod)] = table.get(id(mod), 1.0) * v


def _eager_scales(model: nn.Module, recipe: Recipe | None) -> _Scales:
    sc = _Scales()
    planned = model.__dict__.get(PREFIX + "constants") or {}   # meta device: planned values
    for path, mod in model.named_modules():
        for name, buf in mod._buffers.items():
            if buf is None or not name.startswith(PREFIX):
                continue
            fqn = f"{path}.{name}" if path else name
            v = float(planned.get(fqn, 1.0)) if buf.device.type == "meta" else float(buf)
            if name in (PREFIX + "in_scale", PREFIX + "beta_scale"):
                sc.add(sc.inp, path, mod, v)
            elif name in (PREFIX + "out_scale", PREFIX + "output_scale",
                          PREFIX + "lr_scale") and path:
                sc.add(sc.out, path, mod, v)
            elif name == PREFIX + "output_scale" and _log_param(model) and v > 0:
                pass        # folds into the parameter it multiplies through exp: fold_shifts
            elif name == PREFIX + "output_scale":
                sc.problems.append((fqn, "the output scale multiplies the returned value: no "
                                    "module of the model produces the main output (DeiT's "
                                    "average of two heads); to fold, precondition with "
                                    "target_std=None (no output scale) or output_key= an "
                                    "output a module returns, or keep the preconditioned "
                                    "model itself (torch.save(model) keeps the constants)"))
            elif name == PREFIX + "input_scale":
                sc.problems.append((fqn, f"the input scale ({v:.6g}) multiplies the model's "
                                    f"inputs: multiply your inputs by it instead"))
            else:
                sc.problems.append((fqn, "a precondfx constant fold does not know"))
    _recipe_links(model, recipe, sc)
    return sc


def _recipe_links(model: nn.Module, recipe: Recipe | None, sc: _Scales) -> None:
    """What ``precondition`` recorded, for either back end: the producers of tied layers'
    inputs checked by running (eager) and the tied holders the forward never calls."""
    if recipe is not None:
        for m, u in recipe.upstream.items():
            try:
                a, b = model.get_submodule(m), model.get_submodule(u)
            except AttributeError:
                continue
            sc.mods.setdefault(id(b), (u, b))
            sc.mods.setdefault(id(a), (m, a))
            sc.upstream[id(a)] = id(b)
            sc.positive.add(id(a))      # checked by doubling, and may pass a ReLU
        for m in recipe.idle:
            try:
                sc.idle.add(id(model.get_submodule(m)))
                continue
            except AttributeError:
                pass
            path, _, pname = m.rpartition(".")     # a slot a called module never reads
            try:
                mod = model.get_submodule(path)
            except AttributeError:
                continue
            if mod._parameters.get(pname) is not None:
                sc.idle_slots.add((id(mod), pname))


_SAME_VALUES_METHODS = {"view", "reshape", "contiguous", "float", "to", "flatten", "squeeze",
                        "unsqueeze", "type_as", "double", "half", "bfloat16"}
_SAME_VALUES_FNS = {operator.getitem, torch.reshape, torch.flatten, torch.squeeze,
                    torch.unsqueeze}


def _uses(user: fx.Node, n: fx.Node) -> int:
    """How many times ``user`` reads ``n`` (in its arguments and keywords)."""
    seen: list[fx.Node] = []
    fx.node.map_arg((user.args, user.kwargs), seen.append)
    return sum(1 for a in seen if a is n)


#: products linear in their first operand when the second is a parameter
_MATMULS = (operator.matmul, torch.matmul, torch.mm, torch.bmm)
#: ... and a bias-free ``F.linear(x, W)``: products a separate ``+ bias`` may follow
_PRODUCTS = _MATMULS + (torch.nn.functional.linear,)


def _of_parameters(n: fx.Node, depth: int = 0) -> bool:
    """Whether ``n`` is computed from the model's parameters and buffers alone (a parameter,
    its transpose or reshape): no activation reaches it."""
    if n.op == "get_attr":
        return True
    if n.op not in ("call_method", "call_function") or depth > 8:
        return False
    args: list[fx.Node] = []
    fx.node.map_arg((n.args, n.kwargs), args.append)
    return bool(args) and all(_of_parameters(a, depth + 1) for a in args)


def _homogeneous_operand(n: fx.Node, gm: fx.GraphModule) -> fx.Node | None:
    """The activation operand ``x`` of a node computing ``f(x)`` with ``f(c x) = c f(x)`` for
    ``c > 0`` (the op table's positively homogeneous ops: ReLU, leaky ReLU, PReLU, dropout,
    average pooling, mean, negation, as modules, functions or methods; reshapes, casts and
    selections), else None."""
    fixed = _fixed_factor_operand(n)
    if fixed is not None:
        return fixed
    if not n.args or not isinstance(n.args[0], fx.Node):
        return None
    if n.op == "call_function" and n.target in _MATMULS and len(n.args) == 2 and \
            not n.kwargs and isinstance(n.args[1], fx.Node) and _of_parameters(n.args[1]):
        # x @ W (a tied output layer: ``h @ self.emb.weight.t()``): linear in x
        return n.args[0]
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        spec = ops.for_module(mod)
        ok = isinstance(mod, _HOMOGENEOUS) or (spec is not None and spec.homogeneous)
    elif n.op == "call_method":
        spec = ops.for_method(str(n.target))
        ok = n.target in _SAME_VALUES_METHODS or (spec is not None and spec.homogeneous)
    elif n.op == "call_function":
        spec = ops.for_function(n.target)
        ok = n.target in _SAME_VALUES_FNS or (spec is not None and spec.homogeneous)
    else:
        ok = False
    if not ok:
        return None
    others: list[fx.Node] = []
    fx.node.map_arg((n.args[1:], n.kwargs), others.append)
    if any(o.op != "get_attr" for o in others):   # a second activation operand
        return None
    return n.args[0]


def _size_value(a: Any, depth: int = 0) -> bool:
    """Whether fx node ``a`` computes a Python number from sizes alone (``h.shape[-1] ** 0.5``,
    ``math.sqrt(x.size(-1))``): a read of a tensor's metadata, or arithmetic on such reads and
    numbers.  The captures see these as the numbers they are (``capture.fx_capture``)."""
    if not isinstance(a, fx.Node):
        return isinstance(a, (int, float, bool))
    if _metadata_read(a):
        return True
    if a.op != "call_function" or a.target not in _SIZE_ARITHMETIC or depth > 8:
        return False
    return all(_size_value(b, depth + 1) for b in a.args) and not a.kwargs


#: arithmetic that keeps a Python number a Python number (sizes combined into a factor)
_SIZE_ARITHMETIC = (operator.getitem, operator.mul, operator.truediv, operator.floordiv,
                    operator.pow, operator.add, operator.sub, operator.neg, math.sqrt, float,
                    int)


def _value_users(n: fx.Node) -> list[fx.Node]:
    """The users of ``n`` that read its values (not only its shape)."""
    return [u for u in n.users if not _metadata_read(u)]


def _neutral(n: fx.Node) -> tuple[Any, dict[str, fx.Node]] | None:
    """A product or quotient node read as the fx capture reads it (the neutral graph's
    :class:`~precondfx.core.graph.Node`: a get_attr is a parameter, a number computed from
    sizes a constant), with its activation operands by name; None for any other node."""
    if n.op == "call_function":
        spec, target = ops.for_function(n.target), target_name(n.target)
    elif n.op == "call_method":
        spec, target = ops.for_method(str(n.target)), f"Tensor.{n.target}"
    else:
        return None
    if spec is None or spec.kind != "mul":
        return None
    acts: dict[str, fx.Node] = {}

    def mark(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(mark(x) for x in a)
        if not isinstance(a, fx.Node):
            return Const(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a
        if a.op == "get_attr":
            return Param(str(a.target))
        if _size_value(a):
            return Const()
        acts[a.name] = a
        return Act(a.name)
    node = build_node(n.name, spec, target, [mark(a) for a in n.args],
                      {k: mark(v) for k, v in n.kwargs.items()})
    return node, acts


def _fixed_factor_operand(n: fx.Node) -> fx.Node | None:
    """The activation operand ``x`` of a product ``c * x``, ``x * c`` or quotient ``x / c`` by a
    fixed factor ``c`` (a Python number, a number computed from sizes, or a parameter or
    buffer read by ``get_attr``: a branch's ``0.5 * layer(x)``, a layer scale's
    ``layer(x) * self.gamma``, in place or not, operands by position or keyword), which is
    linear in ``x``: a scale on the product is the same scale on ``x``; else None (a
    division rounding its result is not linear).  The rule is the captured graph's,
    ``core.nodes.fixed_factor_node``, on the node read as the fx capture reads it."""
    read = _neutral(n)
    if read is None or not fixed_factor_node(read[0]):
        return None
    return read[1][read[0].inputs[0]]


def _gate_operands(n: fx.Node) -> list[fx.Node]:
    """The two operands of a product of two activations (a gated branch's ``h * gate``,
    ``core.nodes.gate_node``), in order; else none."""
    read = _neutral(n)
    if read is None or not gate_node(read[0]):
        return []
    return [read[1][i] for i in read[0].inputs]


def _fx_scales(gm: fx.GraphModule) -> _Scales:
    """The fx back end's constants as module input/output scales (what the eager back end
    stores as buffers on the modules): each ``mul`` by a precondfx buffer goes to the module
    producing its operand (up through positively homogeneous ops and the other constants'
    products) or to the linear modules reading the product."""
    sc = _Scales()
    calls: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            calls[str(n.target)] = calls.get(str(n.target), 0) + 1

    def module_at(n: Any) -> tuple[str, nn.Module] | None:
        if isinstance(n, fx.Node) and n.op == "call_module" and calls[str(n.target)] == 1:
            return str(n.target), gm.get_submodule(str(n.target))
        return None

    def readers(n: fx.Node) -> list[fx.Node] | None:
        """The nodes that read ``n``'s value as their first argument, through the other
        constants' products; None when something else reads it."""
        out: list[fx.Node] = []
        for u in n.users:
            if scaled_operand(u) is n:
                more = readers(u)
                if more is None:
                    return None
                out += more
            elif u.args and u.args[0] is n and _uses(u, n) == 1:
                out.append(u)
            else:
                return None
        return out

    per_call: dict[str, list[tuple[str, float]]] = {}
    # module -> call node -> (the constants on that call's output, their product)
    out_calls: dict[str, dict[fx.Node, tuple[list[str], float]]] = {}

    def on_call_output(call: fx.Node, what: str, v: float) -> None:
        names, prod = out_calls.setdefault(str(call.target), {}).get(call, ([], 1.0))
        out_calls[str(call.target)][call] = (names + [what], prod * v)
    for n in gm.graph.nodes:
        if n.op != "get_attr" or not str(n.target).startswith(PREFIX):
            continue
        v = float(gm.get_buffer(str(n.target)))
        for mul in list(n.users):
            what = str(n.target)
            first = scaled_operand(mul)
            if first is None:
                sc.problems.append((what, f"used by {mul.name} ({mul.target}), not a plain "
                                    f"multiplication"))
                continue
            if v == 1.0:        # a product by exactly one (an lr multiplier never set): no-op
                continue
            if what.startswith(PREFIX + "lr") and first.op == "call_module" and \
                    calls[str(first.target)] > 1 and set(first.users) == {mul}:
                # an lr multiplier on the output of one call of a shared layer (lr= and
                # lr='auto' give every call site of a weight one factor)
                on_call_output(first, what, v)
                continue
            # where the eager back end puts it: the input of the linear modules reading it
            # (of each call of a module called several times), else the output of the module
            # producing it
            reads = readers(mul) or []
            users = [module_at(u) for u in reads]
            if users and all(u is not None and kind(u[1]) == "linear" for u in users):
                for u in users:
                    sc.add(sc.inp, u[0], u[1], v)
                continue
            owns = [_own_layer_call(u, gm) if u.op == "call_function" else None
                    for u in reads]
            mods = [gm.get_submodule(o) if o is not None else None for o in owns]
            if reads and all(m is not None and _bias_free(m) for m in mods):
                # the input of a bias-free layer of the user's (F.conv2d(x, self.weight * c)):
                # linear in its input and in its weight, so the weight carries the scale
                for o, m in zip(owns, mods):
                    sc.add(sc.out, o, m, v)
                continue
            shared = [str(u.target) for u in reads if u.op == "call_module"
                      and calls[str(u.target)] > 1]
            if shared and len(shared) == len(reads):
                for t in shared:
                    per_call.setdefault(t, []).append((what, v))
                continue
            src = _fx_up(first, gm, v) if set(first.users) == {mul} else first
            prod = module_at(src)
            if prod is None and src.op == "call_function" and src.target is operator.getitem \
                    and src.args[1:] == (0,) and set(src.users) == {mul}:
                owner = module_at(src.args[0])      # ``out, _ = self.attn(q, k, v)``
                if owner is not None and kind(owner[1]) == "mha":
                    sc.add(sc.out, owner[0], owner[1], v)
                    continue
            if prod is not None and (set(src.users) == {mul} or src is not first) and \
                    kind(prod[1]) is not None:
                sc.add(sc.out, prod[0], prod[1], v)
                continue
            if src.op == "call_module" and calls[str(src.target)] > 1 and \
                    (set(src.users) == {mul} or src is not first) and \
                    kind(gm.get_submodule(str(src.target))) is not None:
                # one call of a shared layer (an Euler loop's step, a residual branch scale
                # at each call): its weights carry it when every call has the same product
                on_call_output(src, what, v)
                continue
            own = _own_layer_call(src, gm) if set(src.users) == {mul} or src is not first \
                else None
            if own is not None:
                # ``F.linear(x, self.weight, self.bias)`` inside a layer class of the user's,
                # traced into its parts: the layer's weight and bias carry the scale
                sc.add(sc.out, own, gm.get_submodule(own), v)
                continue
            desc = f"{src.op} {src.target}" if src.op != "placeholder" else "a model input"
            sc.problems.append((what, f"multiplies the output of {src.name} ({desc}), which "
                                f"no module of your class can absorb exactly "
                                f"({_remedy(None, what)})"))
    def shared_calls(by: dict[str, list[tuple[str, float]]], where: dict, side: str,
                     fits: Callable[[nn.Module], bool]) -> None:
        """A module called several times, scaled on one side at each call: its weights carry
        the scale when every call has the same one."""
        for t, vals in by.items():
            mod = gm.get_submodule(t)
            if len(vals) == calls[t] and _all_close([v for _, v in vals]) and fits(mod):
                sc.add(where, t, mod, vals[0][1])
            elif any(not _close(v, 1.0) for _, v in vals):
                sc.problems.append((", ".join(w for w, _ in vals), f"module {t} is called "
                                    f"{calls[t]} times with different {side} scales "
                                    f"({', '.join(f'{v:.4g}' for _, v in vals)}): its one "
                                    f"weight cannot carry them all"))
    per_call_out = {t: [(", ".join(names), prod) for names, prod in by.values()]
                    for t, by in out_calls.items()}
    shared_calls(per_call_out, sc.out, "output", lambda m: kind(m) is not None)
    shared_calls(per_call, sc.inp, "input", lambda m: kind(m) == "linear")
    # for tied bias-free linear layers: the module producing their input (through value-
    # preserving ops and the products by other constants, which fold away)
    # and positively homogeneous ops (F.relu as nn.ReLU, as for any other scale: a positive
    # factor only)
    for n in gm.graph.nodes:
        m = module_at(n)
        if m is None or kind(m[1]) != "linear" or not n.args:
            continue
        cur = n.args[0]
        homog = False
        while isinstance(cur, fx.Node) and len(cur.users) == 1:
            if scaled_operand(cur) is not None:
                cur = scaled_operand(cur)
            elif (cur.op == "call_method" and cur.target in _SAME_VALUES_METHODS) or \
                    (cur.op == "call_function" and cur.target in _SAME_VALUES_FNS):
                cur = cur.args[0]
            elif _homogeneous_operand(cur, gm) is not None:
                cur, homog = _homogeneous_operand(cur, gm), True
            else:
                break
        up = module_at(cur)
        if up is not None and isinstance(cur, fx.Node) and len(cur.users) == 1:
            sc.mods.setdefault(id(m[1]), m)
            sc.mods.setdefault(id(up[1]), up)
            sc.upstream[id(m[1])] = id(up[1])
            if homog:
                sc.positive.add(id(m[1]))
    return sc


def _product_chain(n: fx.Node) -> tuple[list[fx.Node], fx.Node]:
    """precondfx's own products by a constant from ``n`` down, and the value under them."""
    chain = []
    while scaled_operand(n) is not None:
        chain.append(n)
        n = scaled_operand(n)
    return chain, n


def _bias_free(mod: nn.Module) -> bool:
    """A layer of the user's whose one parameter is its weight (:func:`_own_linear_layer`),
    so that a factor on its input is the same factor on its output."""
    return [k for k, p in mod._parameters.items() if p is not None] == ["weight"] and \
        _own_linear_layer(mod)


def _own_layer_call(n: fx.Node, gm: fx.GraphModule) -> str | None:
    """The path of the layer whose parameters ``n`` computes with, when ``n`` is a linear map
    or convolution of one activation by that layer's weight and bias, traced into its parts:
    ``F.linear(x, self.weight, self.bias)``, ``F.conv2d(...)``, ``x @ self.weight.t()`` or
    ``F.linear(x, self.weight * c)`` (``+ self.bias``, ``+ self.bias * lr_mul``; ``c`` a
    number or a one-element buffer of the layer), the parameters read there alone, the layer
    having no other parameter and being one whose output scales with them (``kind``): scaling
    its weight and bias scales ``n`` exactly; else None."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    spec = ops.for_function(n.target)
    region: set[fx.Node] = {n}
    if spec is not None and spec.kind in ("linear", "conv", "conv_transpose"):
        # the weight and bias operands; a convolution's stride, padding... are settings
        weights: list[Any] = list(n.args[1:3]) + [v for k, v in n.kwargs.items()
                                                  if k in ("weight", "bias")]
    else:
        prod, bias = n, []
        if n.target in (operator.add, torch.add) and len(n.args) == 2 and not n.kwargs:
            # through precondfx's own products (an lr multiplier on the product's output)
            under = {a: _product_chain(a) if isinstance(a, fx.Node) else ([], a)
                     for a in n.args}
            mm = [a for a, (_, u) in under.items() if isinstance(u, fx.Node) and
                  u.op == "call_function" and u.target in _PRODUCTS]
            if len(mm) != 1:
                return None
            chain, prod = under[mm[0]]
            bias = [a for a in n.args if a is not mm[0]]
            region |= {prod, *chain}
        if prod.target not in _PRODUCTS or len(prod.args) != 2 or prod.kwargs or \
                not isinstance(prod.args[0], fx.Node) or not isinstance(prod.args[1], fx.Node) \
                or not _of_parameters(prod.args[1]) or _of_parameters(prod.args[0]):
            return None
        weights = [prod.args[1]] + bias
    reads: list[fx.Node] = []
    todo = [a for a in weights if isinstance(a, fx.Node)]
    if len(todo) != len([a for a in weights if a is not None]):
        return None             # a number or a tensor constant beside the parameters
    while todo:
        a = todo.pop()
        region.add(a)
        if a.op == "get_attr":
            reads.append(a)
        elif a.op in ("call_method", "call_function"):
            todo += list(a.all_input_nodes)
        else:
            return None
    if not reads or any(not set(r.users) <= region for r in region if r is not n):
        return None
    paths = {str(r.target).rpartition(".")[0] for r in reads}
    if len(paths) != 1:
        return None
    path = paths.pop()
    try:
        mod = gm.get_submodule(path)
    except AttributeError:
        return None
    names = {str(r.target).rpartition(".")[2] for r in reads}
    own = {k for k, p in mod._parameters.items() if p is not None}
    gains = {k for k, b in mod._buffers.items() if b is not None and b.numel() == 1}
    # a fixed gain held in a one-element buffer (``self.weight * self.scale``) stays as it is
    if not path or names - gains != own or "weight" not in own or kind(mod) != "norm":
        return None
    return path


def _fx_up(node: fx.Node, gm: fx.GraphModule, value: float) -> fx.Node:
    """From a node whose only use is being scaled by ``value``, up through positively
    homogeneous ops (modules, functions or methods: ``F.relu`` as ``nn.ReLU``; only for
    ``value > 0``), value-preserving ops and other constants' products, each operand having
    no other use: scaling the node found scales the original exactly."""
    cur = node
    while True:
        prev = scaled_operand(cur)
        if prev is None and value > 0:
            prev = _homogeneous_operand(cur, gm)
        elif prev is None and ((cur.op == "call_method" and cur.target in _SAME_VALUES_METHODS)
                               or (cur.op == "call_function" and
                                   cur.target in _SAME_VALUES_FNS)):
            prev = cur.args[0] if cur.args and isinstance(cur.args[0], fx.Node) else None
        if prev is None:    # a gate: into the first operand, read by it alone, that leads
            prev = next((a for a in _gate_operands(cur) if len(_value_users(a)) == 1 and
                         _fx_up(a, gm, value).op == "call_module"), None)   # to a module
        if prev is None or len(_value_users(prev)) != 1 or prev.op in ("placeholder", "get_attr"):
            return cur
        cur = prev


# -- resolving factors per parameter -----------------------------------------------------------
def _param_factors(model: nn.Module, sc: _Scales) -> dict[str, float]:
    """Factor per parameter name (first name of tied parameters); problems go to ``sc``."""
    _settle_scales(sc)
    owners, names, tensors = _owners(model, sc)
    for _ in range(8):
        if not _untie(sc, owners, names):
            break
    factors: dict[str, float] = {}
    for pid, own in owners.items():
        rs = [_request(sc, mid, pn) for mid, pn in own]
        if not rs or not _all_close(rs):
            continue   # reported above
        if not _close(rs[0], 1.0):
            if not tensors[pid].is_floating_point():
                sc.problems.append((names[pid], "not a floating-point parameter"))
                continue
            factors[names[pid]] = rs[0]
    return factors


def _settle_scales(sc: _Scales) -> None:
    """Each module's input and output scale where its parameters can carry it: an output scale
    of a parameter-free module moves to the module upstream, an MHA's to its out_proj; what
    cannot move is a problem (and dropped)."""
    queue = list(dict.fromkeys(list(sc.inp) + list(sc.out)))
    while queue:
        mid = queue.pop(0)
        path, mod = sc.mods[mid]
        k = kind(mod)
        if sc.inp.get(mid, 1.0) != 1.0 and k != "linear":
            sc.problems.append((path, f"a scale on the input of {type(mod).__name__}, which is "
                                f"not linear in its input: it cannot move into its weights"))
            sc.inp.pop(mid)
        if sc.out.get(mid, 1.0) != 1.0 and k is None and mid in sc.upstream:
            upath, umod = sc.mods[sc.upstream[mid]]
            v = sc.out.pop(mid)
            sc.add(sc.out, upath, umod, v)
            sc.own[mid] = sc.own.get(mid, 1.0) * v    # its own parameters (checked so)
            queue.append(id(umod))
            continue
        if sc.out.get(mid, 1.0) != 1.0 and k is None:
            sc.problems.append((path, f"a scale on the output of {type(mod).__name__}: no "
                                f"parameter of it scales its output exactly, and no module "
                                f"inside or before it was found whose output does "
                                f"({_remedy(mod)})"))
            sc.out.pop(mid)
        if sc.out.get(mid, 1.0) != 1.0 and k == "mha":
            sc.add(sc.out, f"{path}.out_proj", mod.out_proj, sc.out.pop(mid))
        bare = [t for t in _parametrized(mod) if _carrier(mod, t) is None and
                not _close(_request(sc, mid, t), 1.0)]
        if bare:
            sc.problems.append((path, f"its {', '.join(bare)} is parametrized "
                                f"({_parametrization_names(mod, bare)}) and no original tensor "
                                f"of the parametrization scales it exactly (weight_norm's "
                                f"magnitude g does): the factor has no parameter to go into"))
            sc.inp.pop(mid, None)
            sc.out.pop(mid, None)


#: the option that leaves a constant out, by the constant's name: the eager back end's buffer
#: on a module, or the fx back end's buffer prefix (``apply.common.buffer_name``: its tag)
_REMEDIES = {PREFIX + "output_scale": "target_std=None: no output scale",
             PREFIX + "out_scale": "residual='none' for a residual branch scale",
             PREFIX + "lr_scale": "lr_scale=None: no learning-rate multipliers",
             PREFIX + "output_": "target_std=None: no output scale",
             PREFIX + "residual_": "residual='none' for a residual branch scale",
             PREFIX + "lr_": "lr_scale=None: no learning-rate multipliers"}


def _remedy(mod: nn.Module | None, constant: str = "") -> str:
    """What to do about a scale nothing can carry (the constants ``mod`` holds, or the fx
    back end's ``constant``): the option that leaves each out, or keeping the preconditioned
    model."""
    held = list(mod._buffers) if mod is not None else []
    opts = list(dict.fromkeys(r for b, r in _REMEDIES.items() if b in held or
                              (constant and constant.startswith(b) and b.endswith("_"))))
    return ("to fold, precondition with " + "; or ".join(opts) + "; " if opts else "") + \
        "or keep the preconditioned model itself (torch.save(model) keeps the constants)"


def _owners(model: nn.Module, sc: _Scales) -> tuple[dict[int, list[tuple[int, str]]],
                                                    dict[int, str], dict[int, torch.Tensor]]:
    """Per parameter (by id): the (module id, name) pairs that hold it, its first name, the
    tensor."""
    owners: dict[int, list[tuple[int, str]]] = {}
    names: dict[int, str] = {}
    tensors: dict[int, torch.Tensor] = {}
    for path, mod in model.named_modules():
        sc.mods.setdefault(id(mod), (path, mod))
        for t in _parametrized(mod):
            sc.plist[id(mod.parametrizations[t])] = (id(mod), t)
        for pname, p in mod._parameters.items():
            if p is None:
                continue
            owners.setdefault(id(p), [])
            idle = (id(mod) in sc.idle or (id(mod), pname) in sc.idle_slots) and \
                id(mod) not in sc.inp and id(mod) not in sc.out
            if not idle and (id(mod), pname) not in owners[id(p)]:
                owners[id(p)].append((id(mod), pname))
            names.setdefault(id(p), f"{path}.{pname}" if path else pname)
            tensors[id(p)] = p
    return owners, names, tensors


def _request(sc: _Scales, mid: int, pname: str) -> float:
    """The factor module ``mid`` needs on its parameter ``pname`` (for a parametrization's
    original: the factor of the tensor it computes when it carries one, else 1)."""
    if mid in sc.plist:
        owner, tensor = sc.plist[mid]
        omod = sc.mods[owner][1]
        return _request(sc, owner, tensor) if _carrier(omod, tensor) == pname else 1.0
    i, o = sc.inp.get(mid, 1.0), sc.out.get(mid, 1.0) * sc.own.get(mid, 1.0)
    if kind(sc.mods[mid][1]) == "linear":
        return i * o if pname == "weight" else o
    return o


def _movable(sc: _Scales, mid: int, pname: str) -> bool:
    """Can a different factor on this (tied) weight move upstream (a bias-free linear with a
    known producer of its input)?"""
    mod = sc.mods[mid][1]
    return kind(mod) == "linear" and pname == "weight" and mid in sc.upstream


def _untie(sc: _Scales, owners: dict[int, list[tuple[int, str]]], names: dict[int, str]
           ) -> bool:
    """One pass over tied parameters whose users need different factors: move the difference
    upstream where it can go, else report it; True when anything changed."""
    moved = False
    for pid, own in owners.items():
        reqs = [(mid, pn, _request(sc, mid, pn)) for mid, pn in own]
        if len(own) < 2 or _all_close([r for *_, r in reqs]):
            continue
        fixed = [r for mid, pn, r in reqs if not _movable(sc, mid, pn)]
        if not _all_close(fixed):
            users = ", ".join(f"{sc.mods[m][0] or 'model'} x{r:.6g}" for m, _, r in reqs)
            sc.problems.append((names[pid], f"a tied weight whose users need different "
                                f"scales ({users}): one tensor cannot carry both"))
            for mid, _pn, _r in reqs:
                sc.inp.pop(mid, None)
                sc.out.pop(mid, None)
            return True
        f = fixed[0] if fixed else reqs[0][2]
        for mid, pn, r in reqs:
            if _close(r, f):
                continue
            upath, umod = sc.mods[sc.upstream[mid]]
            if kind(umod) not in ("linear", "norm", "embedding") or \
                    (mid in sc.positive and not r / f > 0):
                sc.problems.append((names[pid], f"tied weight: the difference of scale "
                                    f"(x{r / f:.6g}) cannot pass to {upath} "
                                    f"({type(umod).__name__})"))
                sc.inp.pop(mid, None)
                sc.out.pop(mid, None)
            else:
                sc.add(sc.out, upath, umod, r / f)
                sc.inp[mid] = sc.inp.get(mid, 1.0) * f / r
            moved = True
    return moved



def _parametrized(mod: nn.Module) -> list[str]:
    """The names of ``mod``'s parametrized tensors (``torch.nn.utils.parametrize``)."""
    plists = getattr(mod, "parametrizations", None)
    return list(plists.keys()) if isinstance(plists, nn.ModuleDict) else []


def _parametrization_names(mod: nn.Module, names: list[str]) -> str:
    return ", ".join(type(p).__name__ for t in names for p in mod.parametrizations[t])


_CARRIERS: dict[int, tuple[Any, str | None]] = {}


def _carrier(mod: nn.Module, tensor: str) -> str | None:
    """Which original of ``mod``'s parametrized ``tensor`` carries a factor: the name
    (``original0``: weight_norm's magnitude g) such that multiplying it by c multiplies the
    computed tensor by c, checked on random CPU originals (so it works on the meta device);
    None when no original does (an orthogonal or spectral-norm parametrization)."""
    plist = mod.parametrizations[tensor]
    hit = _CARRIERS.get(id(plist))
    if hit is not None and hit[0]() is plist:
        return hit[1]
    names = [n for n in plist._parameters if n.startswith("original")]
    found = None
    g = torch.Generator().manual_seed(0)
    base = {n: torch.randn(tuple(plist._parameters[n].shape), generator=g,
                           dtype=torch.float64) for n in names}
    for name in names:
        try:
            with torch.no_grad():
                ref = torch.func.functional_call(plist, base, ())
                got = torch.func.functional_call(plist, {**base, name: 3.0 * base[name]}, ())
            if isinstance(ref, torch.Tensor) and torch.allclose(got, 3.0 * ref, rtol=1e-9,
                                                                atol=1e-12):
                found = name
                break
        except Exception:   # a parametrization that needs its own buffers or device
            continue
    _CARRIERS[id(plist)] = (weakref.ref(plist), found)
    return found


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 * max(abs(a), abs(b), 1.0)


def _all_close(xs: list[float]) -> bool:
    return all(_close(x, xs[0]) for x in xs)


# -- the plain model -----------------------------------------------------------------------------
def _structural(model: nn.Module, recipe: Recipe | None, same_objects: bool = True
                ) -> list[tuple[str, str]]:
    """Changes a fresh instance of the user's class would not have.  For a GraphModule, each
    called module must be the traced model's own (the same object; the same class when the
    source was passed by the caller)."""
    out = [(s, "a structural change a fresh instance of your class does not have (precondition "
            "with maxpool='keep' and the default scheme for a foldable result)")
           for s in (recipe.structural if recipe else [])]
    if isinstance(model, fx.GraphModule) and recipe is not None and recipe.source is not None:
        for n in model.graph.nodes:
            if n.op != "call_module":
                continue
            t = str(n.target)
            try:
                orig = recipe.source.get_submodule(t)
            except AttributeError:
                out.append((t, "a module precondfx added: your class does not have it"))
                continue
            mine = model.get_submodule(t)
            if (orig is not mine) if same_objects else (type(orig) is not type(mine)):
                out.append((t, f"replaced by {type(model.get_submodule(t)).__name__}: your class "
                            f"has {type(orig).__name__}"))
    return out


def _plan(model: nn.Module, source: nn.Module | None) -> tuple[dict[str, float],
                                                              list[tuple[str, str]],
                                                              nn.Module | None]:
    if any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers())):
        return {}, [("model", "it is on the meta device (shapes, no values): materialize it "
                     "first (model.to_empty(device=...), precondfx.reinit(model, report.plan, "
                     "seed), precondfx.distributed.calibrate(model, batch)), then fold")], None
    recipe = recipe_of(model)
    if isinstance(model, fx.GraphModule):
        src = source if source is not None else (recipe.source if recipe else None)
        if src is None:
            return {}, [("model", "a GraphModule without the model of your class it was traced "
                         "from (a pickled GraphModule drops it): pass source=YourModel(...)")], None
        same = source is None
        if recipe is not None and recipe.source is not src:
            recipe = Recipe(src, recipe.structural, recipe.upstream, idle=recipe.idle)
        elif recipe is None:
            recipe = Recipe(src)
        # read in the module-call form (constants multiplying activations), which the
        # result computes in only where precondition did not move them onto the weights
        view = weight_side.module_call_view(model)
        sc = _fx_scales(view)
        _recipe_links(model, recipe, sc)
    else:
        src, same, view = None, True, model
        sc = _eager_scales(model, recipe)
    problems = _structural(view, recipe, same)
    factors = _param_factors(model, sc)
    borrowed = set(recipe.borrowed) if recipe is not None else set()
    for name, f in factors.items():
        path = name.rpartition(".")[0]
        if path in borrowed and not _close(f, 1.0):
            problems.append((name, f"{path or 'the model'} runs on weights passed in at call "
                             f"time (torch.func.functional_call or a stateless call), not on "
                             f"its own {name}: the factor {f:.6g} multiplied into {name} would "
                             f"not reach what it computes; keep the preconditioned model itself "
                             f"(torch.save(model) keeps the constants)"))
    return factors, problems + sc.problems, src


def fold_problems(model: nn.Module, *, source: nn.Module | None = None) -> list[tuple[str, str]]:
    """``(constant, why)`` for every constant of a preconditioned model that cannot be folded
    into its weights; empty when :func:`fold` will succeed (a model precondition never
    returned is one problem: there is nothing to fold)."""
    if isinstance(model, nn.Module) and _untouched(model):
        return [("model", _NOTHING.format(type(model).__name__))]
    return _plan(model, source)[1]


def fold_factors(model: nn.Module) -> dict[str, float]:
    """The factor each parameter is multiplied by when the model is folded (parameters with
    factor 1 omitted); raises ``PrecondError`` when something cannot fold."""
    factors, problems, _ = _plan(model, None)
    if problems:
        raise PrecondError(_message(problems))
    return factors


def _log_param(model: nn.Module) -> str | None:
    """The root parameter whose exponential multiplies the main output (CLIP's
    ``logit_scale``), recorded where the output scale sits on the returned value."""
    from precondfx.pytorch.apply.eager_output import OUTPUT_LOG_PARAM
    name = model.__dict__.get(OUTPUT_LOG_PARAM)
    return name if isinstance(name, str) and name in model._parameters else None


def fold_shifts(model: nn.Module) -> dict[str, float]:
    """What folding adds to a parameter (besides :func:`fold_factors`' products): ``log s``
    to the one whose exponential multiplies the main output (CLIP's ``logit_scale``), for
    the output scale ``s`` on the returned value: ``exp(a + log s) = s * exp(a)``."""
    name, buf = _log_param(model), model._buffers.get(PREFIX + "output_scale")
    if name is None or buf is None:
        return {}
    planned = model.__dict__.get(PREFIX + "constants") or {}
    v = float(planned.get(PREFIX + "output_scale", 1.0)) if buf.device.type == "meta" \
        else float(buf)
    return {name: math.log(v)} if v > 0 and v != 1.0 else {}


def _message(problems: list[tuple[str, str]]) -> str:
    lines = "; ".join(f"{w}: {why}" for w, why in problems)
    return (f"cannot fold {len(problems)} precondfx constant(s) into the weights: {lines}. "
            f"fold_problems(model) lists them; the preconditioned model itself still works")


@torch.no_grad()
def fold(model: nn.Module, *, source: nn.Module | None = None) -> nn.Module:
    """A plain model of your class computing what ``model`` (a ``precondition`` result)
    computes, with every constant folded into the weights: same ``state_dict`` keys as the
    original, no hooks, no extra buffers.  Raises ``PrecondError`` naming each constant that
    cannot fold, and why.  ``source`` is a model of your class, needed only for a GraphModule
    that was pickled (the reference ``precondition`` keeps is not)."""
    if not isinstance(model, nn.Module):
        pair = isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], nn.Module)
        raise PrecondError(f"fold takes the model precondition returned, got "
                           f"{type(model).__name__}"
                           + (": the (model, report) pair; pass its model, "
                              "fold(result.model) or model, report = precondition(...); "
                              "fold(model)" if pair else ""))
    if _untouched(model):
        raise PrecondError(_NOTHING.format(type(model).__name__))
    factors, problems, src = _plan(model, source)
    if problems:
        raise PrecondError(_message(problems))
    if isinstance(model, fx.GraphModule):
        plain = copy.deepcopy(src)
        strip(plain)    # the checkpoint hooks on the modules the result shares with it
        state = {k: v for k, v in model.state_dict().items() if PREFIX not in k}
        _place_like(plain, state)
        res = plain.load_state_dict(state, strict=False)
        if res.missing_keys or res.unexpected_keys:
            raise PrecondError(f"the GraphModule's weights do not match the source model "
                               f"(missing {res.missing_keys[:5]}, unexpected "
                               f"{res.unexpected_keys[:5]})")
        _check_placed(plain, state)
    else:
        plain = copy.deepcopy(model)
        strip(plain)
    named = dict(plain.named_parameters(remove_duplicate=False))   # a tied weight by any name
    for name, f in factors.items():
        named[name].mul_(f)
    for name, d in fold_shifts(model).items():
        named[name].add_(d)
    copy_modes(model, plain)
    return plain



def unfold(model: nn.Module, state_dict: dict[str, Any], *, prefix: str = "") -> dict[str, Any]:
    """Plain weights as ``model`` (a ``precondition`` result) stores them: the inverse of
    :func:`fold`, for writing your model's weights (pretrained ones, a checkpoint saved before
    precondition, :func:`fold`'s model) into the result.  ``state_dict`` is keyed as your
    model's, or, with ``prefix`` (``"encoder."``), as the part ``model.encoder``'s.  Each
    parameter is divided by the factor :func:`fold` multiplies it by (and the shift it adds
    subtracted); the result's constants under ``prefix`` are added where missing; other
    entries stay as they are.  ``model.load_state_dict(precondfx.unfold(model, sd))`` (or a
    part's, or ``p.copy_(...)`` of one entry: an in-place copy is not seen by precondfx, so
    copy the unfolded tensor) then computes what your model computes with those weights.
    Raises ``PrecondError`` where :func:`fold` would (a constant that cannot fold)."""
    from precondfx.pytorch.apply.user_class import _stored
    if not isinstance(state_dict, dict):
        raise PrecondError(f"unfold takes a state dict (a dict of tensors keyed as your "
                           f"model's), got {type(state_dict).__name__}")
    if _untouched(model):
        raise PrecondError(_NOTHING.format(type(model).__name__))
    factors, problems, _ = _plan(model, None)
    if problems:
        raise PrecondError(_message(problems))
    shifts = fold_shifts(model)
    out: dict[str, Any] = {}
    with torch.no_grad():
        for k, v in state_dict.items():
            f, d = factors.get(prefix + k, 1.0), shifts.get(prefix + k, 0.0)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and (f != 1.0 or d):
                v = ((v - d) / f).to(v.dtype)
            out[k] = v
        for k, v in model.state_dict().items():       # the constants the result loads with
            if k.startswith(prefix) and PREFIX in k and k[len(prefix):] not in out:
                out[k[len(prefix):]] = v
    for v in out.values():      # the result's storage: a part loads it without a warning
        if isinstance(v, torch.Tensor):
            _stored(v)
    if hasattr(state_dict, "_metadata"):
        out = collections.OrderedDict(out)
    return out

#: fold of a model that holds nothing of precondfx (``_untouched``)
_NOTHING = ("fold found nothing of precondfx in this {}: no constant, no record of a "
            "precondition run (a model never preconditioned, or one fold already returned), so "
            "there is nothing to fold and its weights are not a folded preconditioned model's. "
            "Pass the model precondfx.precondition returned (fold multiplies its constants into "
            "the weights); to load preconditioned weights into a fresh model of your class, "
            "precondition it with the same options first")


def _untouched(model: nn.Module) -> bool:
    """Whether ``model`` holds nothing precondfx put there: no recipe, no precondfx buffer,
    parameter or attribute on any module (a GraphModule is judged by ``_plan``)."""
    if isinstance(model, fx.GraphModule) or recipe_of(model) is not None:
        return False
    for mod in model.modules():
        names = [*mod._buffers, *mod._parameters, *vars(mod)]
        if any(n.startswith(PREFIX) or n == RECIPE for n in names):
            return False
    return True


def copy_modes(model: nn.Module, plain: nn.Module) -> None:
    """Each module of ``plain`` in the train/eval mode of the module at the same path in
    ``model`` (a BatchNorm the user froze in eval stays frozen); a path ``model`` lacks (a
    container the GraphModule never calls) takes its nearest ancestor's mode, as ``train()``
    would have set it."""
    flags = {p: m.training for p, m in model.named_modules(remove_duplicate=False)}
    for path, mod in plain.named_modules(remove_duplicate=False):
        cur = path
        while cur not in flags:
            cur = cur.rpartition(".")[0]
        mod.training = flags[cur]


def _place_like(plain: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Give each tensor of ``plain`` (a copy of the traced model) the device and dtype of the
    GraphModule's tensor of the same name, before loading the values.  The GraphModule shares
    the traced model's submodules but holds its own copy of what the root module itself holds:
    ``to_empty`` after planning on meta, ``.to(device)`` or ``.double()`` on the result did not
    reach the traced root's tensors.  Tied tensors stay tied."""
    done: dict[int, torch.Tensor] = {}
    for path, mod in plain.named_modules(remove_duplicate=False):
        for table in (mod._parameters, mod._buffers):
            for name, t in list(table.items()):
                want = state.get(f"{path}.{name}" if path else name)
                if t is None or want is None or (t.device == want.device and
                                                 t.dtype == want.dtype):
                    continue
                if id(t) not in done:
                    new = torch.empty_like(want, device=want.device)
                    done[id(t)] = nn.Parameter(new, t.requires_grad) \
                        if isinstance(t, nn.Parameter) else new
                table[name] = done[id(t)]


def _check_placed(plain: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every tensor of the folded model where the GraphModule's is (never a parameter left on
    the meta device without a word)."""
    have = dict(plain.state_dict(keep_vars=True))
    off = [f"{k} ({have[k].device}, not {v.device})" for k, v in state.items()
           if k in have and have[k].device != v.device]
    if off:
        raise PrecondError(f"fold could not place {len(off)} tensor(s) of your class where the "
                           f"preconditioned model holds them: {', '.join(off[:5])}. Materialize "
                           f"the model (to_empty, then precondfx.reinit) before fold, or pass "
                           f"source=YourModel(...) on the right device")


def strip(model: nn.Module) -> None:
    """Remove every precondfx buffer, hook and attribute from an eager-back-end model (in
    place; the weights are not touched)."""
    from precondfx.pytorch.first_step import ATTR
    model.__dict__.pop(ATTR, None)      # lr='auto''s pending first step: a plain model has none
    for mod in model.modules():
        for name in [b for b in mod._buffers if b.startswith(PREFIX)]:
            del mod._buffers[name]
            mod._non_persistent_buffers_set.discard(name)
        for name in [a for a in vars(mod) if a.startswith(PREFIX) or a == RECIPE]:
            delattr(mod, name)
        fwd = vars(mod).get("forward")     # the weight-side forward (apply.eager_apply)
        if fwd is not None and _ours(getattr(fwd, "func", fwd)):
            del mod.__dict__["forward"]
        seo = vars(mod).get("set_output_embeddings")   # integrations.hf_checkpoints
        if seo is not None and _ours(getattr(seo, "__func__", seo)):
            del mod.__dict__["set_output_embeddings"]
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_state_dict_hooks",
                     "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks"):
            hooks = getattr(mod, attr, None)
            if not hooks:
                continue
            for hid in [h for h, fn in hooks.items() if _ours(fn)]:
                del hooks[hid]
                for aux in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                            "_forward_pre_hooks_with_kwargs"):
                    getattr(mod, aux, {}).pop(hid, None)
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "precondfx"):
        try:
            delattr(cfg, "precondfx")
        except AttributeError:
            pass


def _ours(fn: Any) -> bool:
    fn = getattr(fn, "hook", fn)   # load_state_dict pre-hooks are wrapped
    return str(getattr(fn, "__module__", "")).startswith("precondfx")


# -- recipe at precondition time (eager back end) ------------------------------------------------
def tied_upstream(model: nn.Module, graph: Any, run: Callable[[nn.Module], Any],
                  pending: dict[str, str] | None = None) -> dict[str, str]:
    """Where a constant that cannot stay on its module can go: for each bias-free linear
    module whose weight is tied to another module's, and each parameterless module carrying a
    constant (a residual scale on a dropout), the module producing its input, when the graph
    shows one through value-preserving ops and doubling that module's output doubles this
    module's output (checked by running).  With ``pending`` (a model on the meta device, which
    cannot run with values) the graph's candidates go there unchecked."""
    shared: dict[int, int] = {}
    for _, mod in model.named_modules():
        for p in mod._parameters.values():
            if p is not None:
                shared[id(p)] = shared.get(id(p), 0) + 1
    # an export's dtype assertions read a value without using it
    users = {k: [u for u in v if not _assertion(graph.get(u))]
             for k, v in graph.users().items()}
    calls: dict[str, int] = {}
    for n in graph:
        if n.module:
            calls[n.module] = calls.get(n.module, 0) + 1
    out: dict[str, str] = {}
    for n in graph:
        if not n.module or calls[n.module] != 1 or len(n.inputs) < 1:
            continue
        mod = model.get_submodule(n.module)
        w = mod._parameters.get("weight")
        tied = kind(mod) == "linear" and w is not None and shared.get(id(w), 0) >= 2
        bare = kind(mod) is None and any(b.startswith(PREFIX) for b in mod._buffers)
        if not (tied or bare):
            continue
        cur = graph.get(n.inputs[0])
        # through value-preserving ops, an elementwise positively homogeneous op (ReLU,
        # leaky ReLU, PReLU, dropout: f(c x) = c f(x), c > 0), a product with a fixed factor
        # (T5 scales by d_model ** -0.5 before its tied head; a learned temperature) unless
        # that factor is a normalization's or linear map's own weight (LlamaRMSNorm's
        # ``weight * x``: that module takes the factor); the run check below confirms
        while cur is not None and len(cur.inputs) == 1 and \
                len(users.get(cur.inputs[0], [])) == 1 and \
                ((not cur.module and cur.kind in ("reshape", "cast", "select")) or
                 cur.kind in CHAIN_OPS or
                 (fixed_factor_node(cur) and
                  _norm_owner(model, cur, ("norm", "linear"), graph) is None)):
            cur = graph.get(cur.inputs[0])
        if cur is None or len(users.get(cur.name, [])) != 1:
            continue
        up = cur.module or _norm_owner(model, cur, ("norm", "linear"), graph)
        if up and not cur.module and sum(
                1 for m in graph if not _assertion(m) and
                any(q.rpartition(".")[0] == up for q in m.params.values())) != 1:
            continue    # a module captured as ops, called more than once
        if not up or (cur.module and calls.get(cur.module) != 1):
            continue
        if pending is not None:
            pending[n.module] = up
        elif _doubles(model, up, n.module, run, inputs=tied, own=not tied):
            out[n.module] = up
    if pending is None:
        out.update(_inner_upstream(model, out, run))
    else:       # the inner-module search runs once the model holds data (confirm_upstream)
        pending.update({p: INNER for p in _inner_candidates(model, pending)})
    return out


#: a ``Recipe.pending`` entry whose module's upstream is searched among its inner modules
#: (:func:`_inner_upstream`) once the model holds data
INNER = ""

_OUTS = (PREFIX + "out_scale", PREFIX + "output_scale", PREFIX + "lr_scale")


def _inner_candidates(model: nn.Module, found: dict[str, str]) -> list[str]:
    """Modules of no known kind carrying an output constant, not in ``found``: those
    :func:`_inner_upstream` searches."""
    return [path for path, mod in model.named_modules()
            if path and path not in found and kind(mod) is None and
            any(b in mod._buffers for b in _OUTS)]


#: at most this many inner modules are tried per module, and this many in all (each try runs
#: the model twice): a module left over stays a fold problem, reported as before
_INNER_TRIES = 4
_INNER_BUDGET = 32


def _inner_upstream(model: nn.Module, found: dict[str, str],
                    run: Callable[[nn.Module], Any]) -> dict[str, str]:
    """For a module nothing folds into (no known kind) carrying an output scale, not found on
    the graph (a module the capture did not keep as one call, such as ESM's ``EsmLMHead``:
    ``self.decoder(x) + self.bias``): an inner module of it whose output, doubled together
    with the module's own parameters, doubles the module's output (checked by running; the
    last registered weighted inner modules first).  Fold then scales that inner module's
    output and the module's own parameters."""
    res: dict[str, str] = {}
    budget = _INNER_BUDGET
    for path in _inner_candidates(model, found):
        mod = model.get_submodule(path)
        inner = [(p, m) for p, m in mod.named_modules(prefix=path) if p != path and
                 kind(m) is not None]
        for p, _ in list(reversed(inner))[:min(_INNER_TRIES, budget)]:
            budget -= 1
            if _doubles(model, p, path, run, own=True):
                res[path] = p
                break
    return res


def idle_tied(model: nn.Module, run: Callable[[nn.Module], Any]) -> list[str]:
    """Modules holding a parameter tied to another module's that the forward does not call
    (found by running with hooks; none on the meta device): their factor is free, see
    :class:`Recipe`."""
    holders: dict[int, list[str]] = {}
    for path, mod in model.named_modules():
        for p in mod._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append(path)
    cands = sorted({m for ms in holders.values() if len(ms) > 1 for m in ms})
    if not cands or any(p.device.type == "meta" for p in model.parameters()):
        return []
    seen: set[str] = set()
    handles = [model.get_submodule(m).register_forward_pre_hook(
        lambda mod, args, m=m: seen.add(m)) for m in cands]
    try:
        run(model)
    except Exception:   # the model does not run that way: treat every holder as called
        return []
    finally:
        for h in handles:
            h.remove()
    idle = [m for m in cands if m not in seen]
    return idle + _idle_slots(model, holders, idle, run)


def borrowed_weights(model: nn.Module, run: Callable[[nn.Module], Any]) -> list[str]:
    """Modules that, when the forward calls them, hold tensors other than their own parameters
    in their parameter slots (``torch.func.functional_call`` swaps them in for the call), found
    by running with hooks; none on the meta device."""
    own = {path: dict(mod._parameters) for path, mod in model.named_modules()
           if any(p is not None for p in mod._parameters.values())}
    if not own or any(p.device.type == "meta" for p in model.parameters()):
        return []
    seen: set[str] = set()

    def hook(mod: nn.Module, args: Any, path: str) -> None:
        if any(mod._parameters.get(k) is not p for k, p in own[path].items()):
            seen.add(path)
    handles = [model.get_submodule(path).register_forward_pre_hook(
        lambda mod, args, path=path: hook(mod, args, path)) for path in own]
    try:
        run(model)
    except Exception:   # the model does not run that way: nothing found
        return []
    finally:
        for h in handles:
            h.remove()
    return sorted(seen)


def _leaves(out: Any) -> list[torch.Tensor]:
    """The tensors of a model output (nested tuples, lists, dicts, ModelOutputs)."""
    return [t for t in leaves(out) if isinstance(t, torch.Tensor)]


def _idle_slots(model: nn.Module, holders: dict[int, list[str]], idle: list[str],
                run: Callable[[nn.Module], Any]) -> list[str]:
    """Slots ``path.name`` of a tied parameter that a called module holds but never reads
    itself (BERT's ``cls.predictions.bias``, which only its ``decoder`` reads): found by
    running with that slot alone set to NaN, the output unchanged.  They put no constraint on
    the factor the tied tensor folds with."""
    try:
        with torch.no_grad():
            ref = _leaves(run(model))
    except Exception:
        return []
    found = []
    for pid, paths in holders.items():
        if len(paths) < 2:
            continue
        for path in paths:
            if path in idle:
                continue
            mod = model.get_submodule(path)
            for pname, p in list(mod._parameters.items()):
                if p is None or id(p) != pid or not p.is_floating_point():
                    continue
                mod._parameters[pname] = nn.Parameter(torch.full_like(p, float("nan")),
                                                      p.requires_grad)
                try:
                    with torch.no_grad():
                        got = _leaves(run(model))
                    same = len(got) == len(ref) and all(
                        a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, ref))
                except Exception:
                    same = False
                finally:
                    mod._parameters[pname] = p
                if same:
                    found.append(f"{path}.{pname}" if path else pname)
    return found


def _assertion(node: Any) -> bool:
    """An export's runtime check (``aten._assert_tensor_metadata`` after a ``.to(dtype)``):
    it reads a value and computes nothing from it."""
    return node is not None and str(node.target).rpartition(".")[2].startswith("_assert")


def _norm_owner(model: nn.Module, node: Any, kinds: tuple[str, ...] = ("norm",),
                graph: Any = None) -> str | None:
    """The normalization module whose weight a captured op reads, for a normalization the
    capture left as separate ops (transformers' LlamaRMSNorm ends in ``weight * x``), or with
    ``kinds`` another module, such as a linear map captured as its ``addmm`` (transformers'
    ``Conv1D``); the check by running then says whether its output carries the factor.
    With ``graph``, also a weight read through a cast of its own (CohereLayerNorm's
    ``weight.to(float32) * x``)."""
    params = list(node.params.values())
    if graph is not None:
        for i in node.inputs:
            src = graph.get(i)
            if src is not None and not src.inputs and src.kind in ("reshape", "cast"):
                params += list(src.params.values())
    for p in params:
        path = p.rpartition(".")[0]
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            continue
        if kind(mod) in kinds:
            return path
    return None


def confirm_upstream(model: nn.Module, run: Callable[[nn.Module], Any]) -> list[str]:
    """Check by running the upstream candidates recorded on the meta device (see
    :class:`Recipe`), now that the model holds data; those that pass become usable by
    ``fold`` and checkpoints.  Returns the modules confirmed."""
    rec = recipe_of(model)
    if rec is None or not rec.pending:
        return []
    done = [m for m, u in rec.pending.items()
            if u != INNER and
            _doubles(model, u, m, run, inputs=kind(model.get_submodule(m)) == "linear",
                     own=kind(model.get_submodule(m)) is None)]
    rec.upstream.update({m: rec.pending[m] for m in done})
    inner = _inner_upstream(model, rec.upstream, run)       # ESM's EsmLMHead
    rec.upstream.update(inner)
    rec.pending.clear()
    return done + list(inner)


def _doubles(model: nn.Module, up: str, down: str, run: Callable[[nn.Module], Any],
             inputs: bool = False, own: bool = False) -> bool:
    """Whether doubling ``up``'s output doubles ``down``'s output (``inputs``: its input, for a
    linear ``down`` whose weight takes the factor as an input scale, bias or not; ``own``:
    with ``down``'s own parameters doubled too, as fold scales those of a module of no known
    kind whose output scale it moves to ``up``).  An ``up`` the forward reads without calling
    it (WavLM's ``out_proj``, whose weights ``F.multi_head_attention_forward`` takes) is
    doubled through its weight and bias, as fold would, when it is linear or a norm."""
    seen: list[torch.Tensor] = []
    called: list[int] = []

    def grab(m: nn.Module, a: tuple, o: Any = None) -> None:
        t = (a[0] if a else None) if inputs else o
        seen.append(t if isinstance(t, torch.Tensor) else torch.empty(0))

    def double(m: nn.Module, a: tuple, o: Any) -> Any:
        if isinstance(o, tuple) and o and isinstance(o[0], torch.Tensor):
            return (o[0] * 2, *o[1:])     # nn.MultiheadAttention: (output, weights)
        return o * 2 if isinstance(o, torch.Tensor) else o
    mod = model.get_submodule(down)
    umod = model.get_submodule(up)
    h = mod.register_forward_pre_hook(grab) if inputs else mod.register_forward_hook(grab)
    hc = umod.register_forward_pre_hook(lambda m, a: called.append(1))
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        if own:
            _unzero(mod, saved)
        run(model)
        hc.remove()
        scaled = [p for p in mod._parameters.values() if own and p is not None]
        if not called:
            if kind(umod) not in ("linear", "norm"):
                return False
            scaled += [p for n, p in umod._parameters.items()
                       if n in ("weight", "bias") and p is not None]
        with torch.no_grad():
            for p in {id(p): p for p in scaled}.values():
                if not p.is_floating_point():
                    return False
                saved.append((p, p.detach().clone()))
                p.mul_(2)
        h2 = umod.register_forward_hook(double) if called else None
        try:
            run(model)
        finally:
            if h2 is not None:
                h2.remove()
        return len(seen) == 2 and seen[0].shape == seen[1].shape and seen[0].numel() > 0 and \
            bool(torch.allclose(seen[1], 2 * seen[0], rtol=1e-5, atol=1e-30))
    except Exception:   # the model does not run that way, or has no data (meta device)
        return False
    finally:
        with torch.no_grad():
            for p, v in reversed(saved):
                p.copy_(v)
        h.remove()
        hc.remove()


@torch.no_grad()
def _unzero(mod: nn.Module, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give every all-zero floating-point parameter of ``mod`` (and its inner modules) random
    values for a check by running (the originals go to ``saved``): a zero-initialized tensor
    (a LoRA adapter's ``B``, a zero bias) contributes nothing at init, so a check that scaling
    some tensors scales the output would pass whatever the tensor's role, and fold would be
    wrong once training moves it."""
    g = torch.Generator().manual_seed(0)
    for p in {id(p): p for p in mod.parameters()}.values():
        if p.is_floating_point() and p.numel() and p.device.type != "meta" and \
                not bool(p.detach().any()):
            saved.append((p, p.detach().clone()))
            p.copy_(0.1 * torch.randn(tuple(p.shape), generator=g, dtype=torch.float32))


def record(result: nn.Module, traced: nn.Module, applier: Any, graph: Any,
           run: Callable[[nn.Module], Any]) -> Recipe:
    """Attach to a ``precondition`` result what ``fold`` needs (called by ``precondition``):
    the traced model of the user's class (fx), the structural changes, the producers of tied
    layers' inputs (eager)."""
    structural = [a for a in applier.applied if " replaced by " in a or " folded into " in a]
    if isinstance(result, fx.GraphModule):
        rec = Recipe(traced, structural, idle=idle_tied(result, run),
                     borrowed=borrowed_weights(result, run))
    else:
        on_meta = any(p.device.type == "meta" for p in result.parameters())
        pending: dict[str, str] | None = {} if on_meta else None
        rec = Recipe(None, structural, tied_upstream(result, graph, run, pending),
                     pending or {}, idle_tied(result, run), borrowed_weights(result, run))
    attach(result, rec)
    return rec
