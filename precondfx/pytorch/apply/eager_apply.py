"""Carry a plan out on an ordinary ``nn.Module`` (when fx could not trace it): hooks and buffers.

Each constant is a persistent buffer of the module it acts on (``conv1.precondfx_alpha``), read
by a forward (pre-)hook that is a plain module-level function, so the model keeps its class and
its parameter names, and saves, loads, deep-copies and pickles.  Constants that sit on a
functional call (no module to hook) are placed on the nearest module upstream when that is
exact (through positively homogeneous ops), and otherwise reported as not applied.
Every change is logged so that it can be undone if a later stage fails.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from precondfx.core.backend import Records
from precondfx.pytorch.apply.common import (PREFIX, first_param, like_param, replacement_pool,
                                            restore_references, scalar_buffer,
                                            swap_references, times_first)
from precondfx.pytorch.apply.eager_output import (LOSS_BEFORE_SCALE,  # noqa: F401 (used by
                                                   OutputSearch, _module_output_scale_hook,
                                                   _root_output_hook, internal_loss)  # hf)
from precondfx.pytorch.apply.torch_backend import TorchBackend, mask_skip
from precondfx.pytorch.capture.common import mask_arguments, masks_by_use
from precondfx.core.calibration import mask_named
from precondfx.core.graph import Graph
from precondfx.core.nodes import fixed_factor_node, gate_node, nonlinear_product
from precondfx.core.plan import Plan, Scale

_PASS_THROUGH = ("relu", "leaky_relu", "prelu", "dropout", "avgpool", "mean", "neg", "reshape",
                 "select", "pad", "cast")


@functools.lru_cache(maxsize=None)
def _first_input(cls: type) -> str | None:
    """The name of the first argument of ``cls.forward`` after ``self`` (``input`` for
    ``nn.Linear``): where a call by keyword (``self.fc(input=h)``) passes the input."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    if params and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                     inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return params[0].name
    return None


# Hooks: module-level functions reading buffers, so that models pickle and deep-copy.
def _scale_input_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """The module's input times its ``in_scale``, whether passed by position or by keyword
    (nothing where the module's forward puts it on the weight: :func:`_on_weight`)."""
    if _on_weight(module, args):
        return None
    return _times_input(module, args, kwargs, getattr(module, PREFIX + "in_scale"))


def _beta_input_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """App. E's ``1/beta_l`` on the module's input: a buffer of its own (``beta_scale``),
    apart from the alpha on the same input."""
    return _times_input(module, args, kwargs, getattr(module, PREFIX + "beta_scale"))


def _times_input(module: nn.Module, args: tuple, kwargs: dict, s: torch.Tensor) -> tuple:
    """``(args, kwargs)`` with the module's first input multiplied by ``s``."""
    if args and isinstance(args[0], torch.Tensor):
        return (args[0] * s,) + tuple(args[1:]), kwargs
    name = None if args else _first_input(type(module))
    if name is not None and isinstance(kwargs.get(name), torch.Tensor):
        return args, {**kwargs, name: kwargs[name] * s}
    return args, kwargs


def _scale_output_hook(module: nn.Module, args: tuple, out: Any) -> Any:
    if _on_weight(module, args):
        return None
    return times_first(out, getattr(module, PREFIX + "out_scale"))


# -- the constants on the weight side (``apply.weight_side`` for the fx back end) -------------
# A layer whose only hooks are the in/out scale hooks above (and the model's output scale,
# which stays a product on the output: the main output is exactly the layers' times it) gets a
# forward of its own (:func:`weight_side_forwards`) that, in eager runs where the weight has at
# most as many elements as the activation, computes ``F.linear(x, W * in * out, b * out)``: the
# same function and gradients without a pass over the activation; the in/out hooks then do
# nothing (under torch.compile too: a product between a ReLU and a convolution costs a slow
# boolean mask there, see ``apply.weight_side``).  With any other hook on the module (the
# user's, a measurement's) or with the input passed by keyword, the hooks scale the
# activations as before and the forward is the class's own.

def _hf_conv1d(mod: nn.Module) -> bool:
    """transformers' ``Conv1D`` (``x @ W + b`` with ``W`` of shape ``(nx, nf)``)."""
    return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and \
        getattr(mod, "weight", None) is not None and mod.weight.dim() == 2


def _stock_base(m: nn.Module) -> type | None:
    """The layer class (``nn.Linear``, a zero-padded ``nn.ConvNd``, ``nn.Embedding``,
    transformers' ``Conv1D``) whose own forward ``m``'s class runs, where the weight-side
    forward computes the same thing: also a subclass that keeps that forward (the class
    ``torch.nn.utils.parametrize`` gives a layer when a parametrization such as
    ``weight_norm`` is registered on it after precondition; before: ``KeyError:
    ParametrizedLinear`` at the next call).  None where the class overrides the forward: the
    class's forward then runs, and the hooks apply the scales."""
    fwd = type(m).forward
    for base in type(m).__mro__:
        if base is nn.Linear or base is nn.Embedding or base in _CONVS or \
                (base.__name__ == "Conv1D" and _hf_conv1d(m)):
            ok = fwd is base.forward and (base not in _CONVS or m.padding_mode == "zeros")
            return base if ok else None
    return None


def _only_scale_hooks(m: nn.Module) -> bool:
    g = nn.modules.module
    if m._backward_hooks or m._backward_pre_hooks or g._global_forward_hooks or \
            g._global_forward_pre_hooks or g._global_backward_hooks or \
            g._global_backward_pre_hooks:
        return False
    return all(h is _scale_input_hook for h in m._forward_pre_hooks.values()) and \
        all(h is _scale_output_hook or h is _lr_scale_hook or h is _module_output_scale_hook
            for h in m._forward_hooks.values())


def _on_weight(m: nn.Module, args: tuple) -> bool:
    """Whether this call of ``m`` applies its scales on the weight (the same answer in the
    pre-hook, the forward and the hook of one call)."""
    f = m.__dict__.get("forward")
    if not (isinstance(f, functools.partial) and f.func is _weight_side_forward) or \
            len(args) != 1 or not isinstance(args[0], torch.Tensor) or _stock_base(m) is None:
        return False
    x = args[0]
    act = x.numel() * m.embedding_dim if isinstance(m, nn.Embedding) else x.numel()
    # decided without a guard on the shapes (an export with a dynamic batch size, where it is
    # not known, keeps the products); under torch.jit.trace the sizes are traced tensors
    big = bool(act >= m.weight.numel()) if isinstance(act, torch.Tensor) else \
        statically_known_true(act >= m.weight.numel())
    return big and _only_scale_hooks(m)


def _weight_side_forward(m: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if not _on_weight(m, args):
        return type(m).forward(m, *args, **kwargs)
    x = args[0]
    # the model's output scale (lm_head's) stays a product on the output, applied by its hook
    hooks = list(m._forward_hooks.values())
    outs = [getattr(m, PREFIX + name) for h, name in ((_scale_output_hook, "out_scale"),
                                                      (_lr_scale_hook, "lr_scale"))
            if h in hooks]
    cout = outs[0] * outs[1] if len(outs) == 2 else outs[0] if outs else None
    cin = getattr(m, PREFIX + "in_scale") if m._forward_pre_hooks else None
    if cin is None and cout is None:
        return type(m).forward(m, *args, **kwargs)
    s = cin * cout if cin is not None and cout is not None else \
        cin if cin is not None else cout
    w = m.weight * s
    if isinstance(m, nn.Embedding):
        return F.embedding(x, w, m.padding_idx, m.max_norm, m.norm_type,
                           m.scale_grad_by_freq, m.sparse)
    b = m.bias
    if b is not None and cout is not None:
        b = b * cout
    base = _stock_base(m)
    if base is nn.Linear:
        return F.linear(x, w, b)
    if base in _CONVS:
        return _CONVS[base](x, w, b, m.stride, m.padding, m.dilation, m.groups)
    y = torch.addmm(b, x.view(-1, x.size(-1)), w)       # transformers' Conv1D
    return y.view(x.size()[:-1] + (m.nf,))


_CONVS = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}


def weight_side_forwards(model: nn.Module) -> list[str]:
    """Give each layer of ``model`` scaled only by the in/out scale hooks the weight-side
    forward (:func:`_weight_side_forward`, an instance attribute: ``fold`` and ``strip``
    remove it); returns their paths.  A weight another module shares (a tied embedding) is
    scaled at this use only, as the hooks scale this use's activations."""
    out = []
    for path, m in model.named_modules():
        if not (m._forward_pre_hooks or _scale_output_hook in m._forward_hooks.values() or
                _lr_scale_hook in m._forward_hooks.values()) or \
                not _only_scale_hooks(m) or "forward" in m.__dict__:
            continue
        if isinstance(m, nn.Embedding):
            ok = type(m) is nn.Embedding and m.max_norm is None and not m._forward_pre_hooks
        else:
            ok = type(m) is nn.Linear or _hf_conv1d(m) or \
                (type(m) in _CONVS and m.padding_mode == "zeros")
        params = [p for p in (getattr(m, "weight", None), getattr(m, "bias", None))
                  if p is not None]
        if not ok or any(type(p) is not nn.Parameter for p in params):
            continue
        m.forward = functools.partial(_weight_side_forward, m)
        out.append(path)
    return out


def _lr_scale_hook(module: nn.Module, args: tuple, out: Any) -> Any:
    """lr_scale's multiplier on a layer's output (its weight and bias are stored divided by
    it); a buffer of its own, apart from a residual branch scale on the same module (nothing
    where the module's forward puts it on the weight: :func:`_on_weight`)."""
    if _on_weight(module, args):
        return None
    return times_first(out, getattr(module, PREFIX + "lr_scale"))


#: a module's own constant (buffer name) -> its hook: (is a forward pre-hook, the hook); the one
#: place that says it, for placing the constants here and for ``hf_checkpoints.reattach``
MODULE_HOOKS: dict[str, tuple[bool, Callable[..., Any]]] = {
    PREFIX + "in_scale": (True, _scale_input_hook),
    PREFIX + "beta_scale": (True, _beta_input_hook),
    PREFIX + "out_scale": (False, _scale_output_hook),
    PREFIX + "lr_scale": (False, _lr_scale_hook),
    PREFIX + "output_scale": (False, _module_output_scale_hook),
}


def module_hook(mod: nn.Module, bname: str) -> Any:
    """Register the hook of constant ``bname`` (a key of :data:`MODULE_HOOKS`) on ``mod``;
    returns the handle."""
    pre, hook = MODULE_HOOKS[bname]
    return mod.register_forward_pre_hook(hook, with_kwargs=True) if pre else \
        mod.register_forward_hook(hook)


def _root_input_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """Every floating-point input times the input scale, but those named as masks or read
    as masks by their uses in the captured graph (``PREFIX + "input_masks"``: positions and
    names, set by ``EagerApplier.input_scale``)."""
    s = getattr(module, PREFIX + "input_scale")
    pos, kws = mask_arguments(module.forward, len(args), kwargs,
                              getattr(module, PREFIX + "input_masks", ()))

    def f(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x * s
        return x
    return tuple(a if i in pos else f(a) for i, a in enumerate(args)), \
        {k: v if k in kws else f(v) for k, v in kwargs.items()}


def _input_module_hook(module: nn.Module, args: tuple, kwargs: dict, name: str = "") -> tuple:
    """Run the submodule ``name`` on every floating-point positional input."""
    m = getattr(module, name)
    return tuple(m(a) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args), kwargs


class EagerApplier(TorchBackend, Records, OutputSearch):
    """The eager back end (``precondfx.core.backend.Backend``): applies pools and scales to a
    live module through hooks and module replacement, every change undoable (``rollback``).
    ``run(model)`` runs the model on the sample (to find the module producing the main
    output)."""

    name = "eager"

    def __init__(self, model: nn.Module, graph: Graph,
                 run: Callable[[nn.Module], Any] | None = None,
                 run_train: Callable[[nn.Module], Any] | None = None) -> None:
        self.model = self.module = model
        self.graph = graph
        self.runner = run
        self.train_runner = run_train   # the same run in train mode (where it differs)
        self._records()
        self.undo: list[Any] = []
        self.calls: dict[str, int] = {}
        for n in graph:
            if n.module:
                self.calls[n.module] = self.calls.get(n.module, 0) + 1
        self.users = graph.users()
        self._done_modules: dict[tuple[str, str], float] = {}
        self._swapped: set[str] = set()
        self.output_module: str | None = None
        # the output scale's constant -> the other heads' constants set with it
        self.output_twins: dict[str, list[str]] = {}

    def set_constant(self, name: str, value: float) -> None:
        """The constant ``name`` set to ``value`` (an output scale on several summed heads:
        each head's)."""
        for n in [name] + self.output_twins.get(name, []):
            super().set_constant(n, value)

    def _register(self, mod: nn.Module, name: str, value: float) -> None:
        mod.register_buffer(name, scalar_buffer(value, like_param(self.model)))
        self.undo.append(("buffer", mod, name))

    def _hook(self, handle: Any) -> None:
        self.undo.append(("hook", handle))

    def _module_scale(self, path: str, where: str, value: float, what: str,
                      skey: str | None = None, tag: str | None = None) -> str | None:
        """A constant on module ``path``'s input or output (one buffer per module and place;
        ``tag="lr"``: lr_scale's output multiplier, ``tag="beta"``: App. E's 1/beta on the
        input, each its own buffer and hook)."""
        lr = tag == "lr" and where == "output"
        beta = tag == "beta" and where == "input"
        key = (path, "lr" if lr else "beta" if beta else where)
        bname = PREFIX + ("lr_scale" if lr else "beta_scale" if beta else
                          "in_scale" if where == "input" else "out_scale")
        fqn = f"{path}.{bname}" if path else bname
        if key in self._done_modules:
            if abs(self._done_modules[key] - value) > 1e-12 * max(1.0, abs(value)):
                self._skip(skey, what, f"module {path} already carries a different {where} "
                           f"scale from another call site")
                return None
            return fqn
        mod = self.model.get_submodule(path)
        self._register(mod, bname, value)
        self._hook(module_hook(mod, bname))
        self._done_modules[key] = value
        return fqn

    def _upstream_chain(self, name: str) -> Iterator[Any]:
        """The nodes from ``name`` upstream that a scale on ``name`` passes: through single-user
        homogeneous ops (a positive residual scale), products by a fixed factor (any scale:
        ``self.fc(x) * self.gamma``, a layer scale), each with one input read by it alone, and
        products of two activations (a gated branch's ``self.fc(h) * gate``) into the first
        operand read by it alone that leads to a module called once."""
        cur = self.graph.get(name)
        while cur is not None:
            yield cur
            if gate_node(cur):
                nxt = next((i for i in cur.inputs if len(self.users.get(i, [])) == 1 and
                            self._upstream_module(i) is not None), None)
                if nxt is None:
                    return
                cur = self.graph.get(nxt)
                continue
            if (cur.kind not in _PASS_THROUGH and not fixed_factor_node(cur)) or \
                    len(cur.inputs) != 1 or len(self.users.get(cur.inputs[0], [])) != 1:
                return
            cur = self.graph.get(cur.inputs[0])

    def _upstream_module(self, name: str) -> str | None:
        """Nearest module called once on :meth:`_upstream_chain`.  A block of the user's
        ending in a functional op (``x + self.mlp(x)`` with ``F.gelu`` last) is not taken: a
        scale on its output would keep a transformers checkpoint from folding (the MoE blocks
        of Mixtral and Qwen2-MoE, wav2vec2's positional convolution), so that branch scale is
        skipped and reported, as before."""
        return next((n.module for n in self._upstream_chain(name)
                     if n.module and self.calls.get(n.module, 0) == 1), None)

    def _linear_owner(self, node: Any) -> str | None:
        """The module owning a functional linear op's weight, when scaling that module's input
        (output) is exactly scaling the op's: transformers' ``Conv1D`` (GPT-2), whose forward is
        ``view -> addmm(bias, x, weight) -> view``, called once (one graph node uses the weight).
        Its ops are traced as ``addmm`` with no module of their own; the module itself can
        still carry a hook."""
        w = node.params.get("weight")
        if node.kind != "linear" or not w or not w.endswith(".weight"):
            return None
        path = w.rpartition(".")[0]
        try:
            mod = self.model.get_submodule(path)
        except AttributeError:
            return None
        cls = type(mod)
        if not (cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")
                and isinstance(getattr(mod, "nf", None), int)
                and getattr(mod, "weight", None) is not None
                and tuple(mod.weight.shape)[-1:] == (mod.nf,)):
            return None
        uses = sum(1 for n in self.graph if n.params.get("weight") == w)
        return path if uses == 1 and self.calls.get(path, 0) == 0 else None

    def scale(self, sc: Scale) -> str | None:
        node, key, what = self._scale_node(self.graph, sc, "node not in the captured graph")
        if node is None:
            return None
        if sc.where == "operand":
            src = node.inputs[sc.index] if sc.index < len(node.inputs) else None
            path = self._upstream_module(src) if src else None
            if path is None or len(self.users.get(src, [])) != 1:
                self._skip(key, what, self._no_hook_why(sc.tag, src))
                return None
            fqn = self._module_scale(path, "output", sc.value, what, key)
        elif node.module is None and sc.where in ("input", "output") and \
                self._linear_owner(node) is not None:
            fqn = self._module_scale(self._linear_owner(node), sc.where, sc.value, what, key,
                                     sc.tag)
        elif node.module is None:
            self._skip(key, what, f"functional call: no module to hook and no editable "
                       f"graph (capture: {self.graph.method})")
            return None
        else:
            fqn = self._module_scale(node.module, sc.where, sc.value, what, key, sc.tag)
        if fqn is not None:
            self._done(key, f"{what}: {sc.value:.4g}", fqn)
        return fqn

    def _no_hook_why(self, tag: str, src: str | None) -> str:
        """Why no hook can carry a scale on operand ``src``: it is read elsewhere too, its
        producer is a module called more than once (each call would take it), or a
        functional op."""
        cap = f"(capture: {self.graph.method})"
        if src is not None and len(self.users.get(src, [])) > 1:
            return (f"the {tag} operand {src} is also read elsewhere in forward "
                    f"({len(self.users[src])} uses): a hook on what produces it would scale "
                    f"those uses too {cap}")
        mod = next((n.module for n in self._upstream_chain(src) if n.module), None) \
            if src else None
        if mod is not None and self.calls.get(mod, 0) > 1:
            return (f"the {tag} operand is the output of {mod}, which forward calls "
                    f"{self.calls[mod]} times: a hook on it would scale every call, not this "
                    f"branch alone {cap}")
        last = list(self._upstream_chain(src))[-1:] if src else []
        if last and last[0].kind == "mul" and nonlinear_product(last[0]):
            return (f"the {tag} operand is produced by {last[0].name}, which "
                    f"{nonlinear_product(last[0])}: a hook scaling what feeds it would not "
                    f"scale its result by the same factor {cap}")
        return f"the {tag} operand is produced by a functional op with no module to hook {cap}"

    def upstream_module(self, node: str) -> str | None:
        """The module whose output is node ``node``'s value up to a positive factor (the
        nearest single-call module upstream through homogeneous single-user ops): a scale on
        its output is a scale on the node's (None when there is none)."""
        return self._upstream_module(node)

    def pools(self, plan: Plan) -> None:
        for pc in plan.pools:
            if pc.action == "keep":
                continue
            node = self.graph.get(pc.node)
            if node is None or node.module is None:
                self._skip(f"pool:{pc.node}", f"maxpool {pc.node}", "functional max-pool: no "
                           f"module to replace and no editable graph (capture: "
                           f"{self.graph.method})")
                self.pool_notes[pc.node] = "NOT APPLIED: functional call"
                continue
            if self.calls.get(node.module, 0) > 1 and pc.action != "avgpool" and \
                    not self._every_call_folds(plan, node.module):
                self._skip(f"pool:{pc.node}", f"maxpool {pc.node}", "the pool module is called "
                           "more than once and not every call folds into the stride of the "
                           "convolution before it (one module cannot be a different "
                           "convolution at each call; capture='fx' replaces each call)")
                self.pool_notes[pc.node] = "NOT APPLIED: module called twice"
                continue
            if pc.action == "fold":
                conv_node = self.graph[pc.into]
                conv = self.model.get_submodule(conv_node.module)
                self.undo.append(("attr", conv, "stride", conv.stride))
                conv.stride = tuple(pc.geometry["conv_stride"])
                if not isinstance(self.model.get_submodule(node.module), nn.Identity):
                    self._replace(node.module, nn.Identity())
                self._done(f"pool:{pc.node}", f"maxpool {pc.node} folded into {conv_node.module}")
            else:
                mod = replacement_pool(pc, first_param(self.model))
                self._replace(node.module, mod)
                self._done(f"pool:{pc.node}",
                           f"maxpool {pc.node} replaced by {type(mod).__name__}")

    def _every_call_folds(self, plan: Plan, module: str) -> bool:
        """Whether every call of the pool module ``module`` folds into the stride of its own
        convolution (one ``Identity`` then stands for all of them, as on the fx back end)."""
        at = [pc for pc in plan.pools if (n := self.graph.get(pc.node)) is not None and
              n.module == module]
        return len(at) == self.calls.get(module, 0) and \
            all(pc.action == "fold" for pc in at)

    def replace(self, name: str, mod: nn.Module, path: str | None = None,
                all_calls: bool = False) -> bool:
        """Swap the module called at node ``name`` for ``mod``.  Only a module called once can
        be swapped, unless ``all_calls`` says every call of it gets the same replacement."""
        node = self.graph.get(name)
        if node is None or node.module is None:
            self._skip(f"replace:{name}", name, f"replacement: functional call, no module to swap "
                       f"and no editable graph (capture: {self.graph.method})")
            return False
        if self.calls.get(node.module, 0) > 1 and not all_calls:
            self._skip(f"replace:{name}", name, f"replacement: module {node.module} is called "
                       f"more than once")
            return False
        if node.module not in self._swapped:
            self._replace(node.module, mod)
            self._swapped.add(node.module)
        self._done(f"replace:{name}", None)
        return True

    def _replace(self, path: str, mod: nn.Module) -> None:
        parent, _, leaf = path.rpartition(".")
        p = self.model.get_submodule(parent) if parent else self.model
        previous = getattr(p, leaf)
        self.undo.append(("module", p, leaf, previous))
        setattr(p, leaf, mod)
        # the forward or a method may reach the module by another name or through a plain
        # list or dict (``for s in self.stages``): those references follow
        self.undo.append(("refs", swap_references(self.model, previous, mod)))

    def input_scale(self, value: float) -> list[str]:
        try:
            params = inspect.signature(self.model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        for name in params:         # the hook leaves them alone (_root_input_hook)
            if mask_named(name):
                self._skip(None, "input scale", mask_skip(name))
        used = masks_by_use(self.graph, self.model.forward)
        for where, why in used.items():
            what = where if not isinstance(where, int) else \
                list(params)[where] if where < len(params) else f"argument {where}"
            if mask_named(what):
                continue                    # said above, by its name
            self._skip(None, "input scale", mask_skip(what, why))
        if used:
            setattr(self.model, PREFIX + "input_masks", frozenset(used))
            self.undo.append(("attrdel", self.model, PREFIX + "input_masks"))
        self._register(self.model, PREFIX + "input_scale", value)
        self._hook(self.model.register_forward_pre_hook(_root_input_hook, with_kwargs=True,
                                                        prepend=True))
        self._done("input", None, PREFIX + "input_scale")
        return [PREFIX + "input_scale"]

    def probe(self, run: Callable[[nn.Module], Any], names: list[str]
              ) -> dict[str, torch.Tensor]:
        """Outputs of the named module-call nodes during ``run(model)`` (forward hooks), copied
        when produced: a later in-place op (``ReLU(inplace=True)``, ``mul_``) cannot change
        them."""
        want: dict[str, dict[int, str]] = {}
        for n in names:
            node = self.graph.get(n)
            if node is not None and node.module:
                want.setdefault(node.module, {})[node.call_index] = n
        got: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        handles = []
        for path, idx in want.items():
            def hook(mod: nn.Module, args: tuple, out: Any, path: str = path,
                     idx: dict = idx) -> None:
                k = counts.get(path, 0)
                counts[path] = k + 1
                if k in idx:
                    got[idx[k]] = _snapshot(out)
            handles.append(self.model.get_submodule(path).register_forward_hook(hook))
        try:
            run(self.model)
        finally:
            for h in handles:
                h.remove()
        return got

    def input_module(self, name: str, mod: nn.Module) -> bool:
        """``mod`` becomes submodule ``name`` of the model, run on its floating-point
        positional inputs by a forward pre-hook (undone by ``rollback``).  Refused for a
        container whose forward runs every child in turn (``nn.Sequential``): the module
        would run on the output too."""
        if isinstance(self.model, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            self._skip(f"module:{name}", name, f"the model is an {type(self.model).__name__}, "
                       f"whose forward runs every child: a module added at the input would run "
                       f"at the end too (wrap the model in a module of your own)")
            return False
        self.model.add_module(name, mod)
        self._hook(self.model.register_forward_pre_hook(
            functools.partial(_input_module_hook, name=name), with_kwargs=True, prepend=True))
        self.undo.append(("attrdel", self.model, name))
        self._done(f"module:{name}", f"{type(mod).__name__} applied at the input ({name}, "
                   f"pre-hook)")
        return True

    def finish(self) -> None:
        pass

    def rollback(self) -> None:
        """Undo every change, newest first (used when a later stage fails on inplace=True)."""
        for item in reversed(self.undo):
            kind = item[0]
            if kind == "hook":
                item[1].remove()
            elif kind == "buffer":
                mod, name = item[1], item[2]
                mod._buffers.pop(name, None)
            elif kind == "attr":
                setattr(item[1], item[2], item[3])
            elif kind == "module":
                setattr(item[1], item[2], item[3])
            elif kind == "refs":
                restore_references(item[1])
            elif kind == "attrdel":
                if hasattr(item[1], item[2]):
                    delattr(item[1], item[2])
        self.undo.clear()


def _snapshot(out: Any) -> Any:
    """A detached copy of a node's (first) output tensor, taken when it is produced."""
    t = out[0] if isinstance(out, (tuple, list)) and out else out
    return t.detach().clone() if isinstance(t, torch.Tensor) else t
