"""The eager back end's output-scale search: which module's output carries the main output.

With no graph surgery, the output scale must sit on a module whose output *is* the main
output (or is scaled into it exactly): the root, a unique module producing a tensor of the
output's shape, found by running the model with a doubling hook on each candidate.  A mixin of
:class:`~precondfx.pytorch.apply.eager_apply.EagerApplier`, which holds the state it reads.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from precondfx.core import optable
from precondfx.core.outputs import bounded_producer, skip_bounded
from precondfx.errors import PrecondError
from precondfx.pytorch.apply.common import PREFIX, scale_at_path, times_first
from precondfx.pytorch.capture.common import _items, at_path, child, leaves, \
    output_path


def _module_output_scale_hook(module: nn.Module, args: tuple, out: Any) -> Any:
    """The output scale on the module that produces the main output (e.g. ``lm_head``), so
    that everything the model computes from it inside forward (its own loss) sees it."""
    return times_first(out, getattr(module, PREFIX + "output_scale"))


def fits(out: Any, path: list) -> bool:
    """Whether ``path`` leads through ``out``'s containers to a tensor (not into a tensor: on
    a plain tensor output, ``[0]`` would select its first row)."""
    for k in path:
        if isinstance(out, torch.Tensor):
            return False
        try:
            out = child(out, k)
        except (KeyError, IndexError, TypeError, AttributeError):
            return False
    return isinstance(out, torch.Tensor)


def mode_path(out: Any, path: list) -> list | None:
    """The main output's path in this call's output: ``path`` (found in the calibration mode)
    where it fits, else the rule applied to this output (a model returning ``(logits, aux)``
    in train mode and ``logits`` in eval: there the whole tensor); None where this output has
    no floating-point tensor to scale."""
    if fits(out, path):
        return path
    try:
        return output_path(out)
    except PrecondError:
        return None


def _root_output_hook(module: nn.Module, args: tuple, out: Any) -> Any:
    path = mode_path(out, list(getattr(module, PREFIX + "output_path")))
    if path is None:        # no floating-point output in this call: nothing to scale
        return out
    if internal_loss(out, path):
        raise PrecondError(LOSS_BEFORE_SCALE)
    scale = getattr(module, PREFIX + "output_scale")
    twins = [list(w) for w in getattr(module, PREFIX + "output_twins", ()) if fits(out, list(w))]
    for p in [path] + views_of(out, path) + [w for w in twins if w != path]:
        out = scale_at_path(out, p, scale)
    return out


def _leaf_paths(out: Any, where: list | None = None) -> list[list]:
    """Paths of the floating-point tensors in ``out``'s containers."""
    found: list[list] = []
    for k, v in _items(out):
        if isinstance(v, torch.Tensor):
            if v.is_floating_point():
                found.append((where or []) + [k])
        elif not isinstance(v, torch.distributions.Distribution):
            found += _leaf_paths(v, (where or []) + [k])
    return found


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def views_of(out: Any, path: list) -> list[list]:
    """Paths of the other tensors in ``out`` that hold the main output's own numbers (views of
    the same tensor: CLIP's ``logits_per_text`` is ``logits_per_image.t()``): the scale on the
    returned value multiplies them too, or the two would disagree.  Outputs inside a
    ``torch.distributions`` object are left out (their parameters are not views to rescale)."""
    try:
        target = at_path(out, path)
    except (KeyError, IndexError, TypeError, AttributeError):
        return []
    if not isinstance(target, torch.Tensor) or not path:
        return []
    base, found = _root(target), []

    def walk(o: Any, where: list) -> None:
        if isinstance(o, torch.distributions.Distribution):
            return
        for k, v in _items(o):
            if isinstance(v, torch.Tensor):
                if where + [k] != path and v.is_floating_point() and _root(v) is base:
                    found.append(where + [k])
            else:
                walk(v, where + [k])
    walk(out, [])
    return found


LOSS_BEFORE_SCALE = (
    "this preconditioned model computed a loss inside its forward (the output has a 'loss'), but "
    "its output scale sits on the returned value, after that loss: the loss would not see the "
    "scale.  precondfx found no module producing the main output to carry the scale.  Compute "
    "the loss outside the model from the returned output (leave out what makes it compute "
    "one: labels, return_loss=True for CLIP-style models, future_values for time-series "
    "forecasters), or precondition "
    "with target_std=None")


def internal_loss(out: Any, path: list) -> bool:
    """Whether a model output carries a loss computed inside forward (transformers models with
    ``labels``), other than the main output itself."""
    if not (isinstance(out, Mapping) or hasattr(out, "keys")) or isinstance(out, torch.Tensor):
        return False
    try:
        loss = out["loss"] if "loss" in out.keys() else None
    except (KeyError, TypeError):
        return False
    return isinstance(loss, torch.Tensor) and (not path or path[0] != "loss")


def _version(t: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place op); None where it has none
    (inference-mode tensors)."""
    try:
        return t._version
    except (RuntimeError, AttributeError):
        return None


class OutputSearch:
    """The output-scale half of the eager back end (``EagerApplier`` mixes it in)."""

    def output_scale(self, path: list, run: Callable[[nn.Module], Any] | None = None
                     ) -> str | None:
        """The output scale, on the module whose output *is* the main output (found by running
        ``run(model)``), so that a loss the model computes from it inside forward sees the
        scale; on the returned value otherwise (refused when the model returns a loss).
        ``run`` defaults to the one given to the constructor."""
        run = run or self.runner
        self.split_outputs: set[str] = set()
        self.unchecked: list[list[str]] = []     # candidates a model on meta cannot run
        self.twin_paths: list[list] = []    # other returned values of the output module's calls
        found, out = self._output_module(path, run) if run is not None else (None, None)
        if found is not None and self.train_runner is not None and \
                self._output_module(path, self.train_runner)[0] != found:
            found = None    # another module produces it in train mode (a self.training branch)
        bounded = self._bounded(found, out, path)
        if bounded is not None:
            skip_bounded(self, bounded)
            return None
        if found is not None:
            mod = self.model.get_submodule(found)
            self._register(mod, PREFIX + "output_scale", 1.0)
            from precondfx.pytorch.apply.eager_apply import module_hook   # imports this module
            self._hook(module_hook(mod, PREFIX + "output_scale"))
            self.output_module = found
            also = (" and the outputs split from it alongside (a question-answering head's "
                    "end logits)") if found in self.split_outputs else ""
            self._done("output", f"output scale on the output of {found} (the main output"
                       f"{also}): everything forward computes from it, its own loss included, "
                       f"sees the scale", f"{found}.{PREFIX}output_scale")
            return f"{found}.{PREFIX}output_scale"
        heads = self._summed_heads(path, run, out) if found is None and run is not None \
            and bounded is None else []
        if heads:
            from precondfx.pytorch.apply.eager_apply import module_hook   # imports this module
            names = [f"{h}.{PREFIX}output_scale" for h in heads]
            for h in heads:
                mod = self.model.get_submodule(h)
                self._register(mod, PREFIX + "output_scale", 1.0)
                self._hook(module_hook(mod, PREFIX + "output_scale"))
            self.output_twins[names[0]] = names[1:]
            self.output_module = heads[0]
            self._done("output", f"output scale on the outputs of {', '.join(heads)}, which the "
                       f"main output is a sum or average of (DeiT's class and distillation "
                       f"heads): the main output and each head's own output see the scale",
                       names[0])
            return names[0]
        if out is not None and internal_loss(out, path) and self.unchecked:
            mods = " or ".join("+".join(g) for g in self.unchecked)
            raise PrecondError(
                f"the model computes a loss inside its forward (the output has a 'loss'), and "
                f"on the meta device precondfx cannot check by running whether {mods} can "
                f"carry the output scale so that the loss sees it (until then it sits on the "
                f"returned value, after that loss).  Plan without what makes the model compute "
                f"the loss (leave labels out of the sample); after to_empty and reinit, "
                f"precondfx.pytorch.distributed.calibrate(model, batch) checks {mods} and moves "
                f"the scale there, and labels work from then on.  Or precondition with "
                f"target_std=None")
        if out is not None and internal_loss(out, path):
            raise PrecondError(LOSS_BEFORE_SCALE.replace("this preconditioned model computed",
                                                         "the model computes"))
        log_param = self._log_param(path, run, out) if run is not None else None
        self._register(self.model, PREFIX + "output_scale", 1.0)
        setattr(self.model, PREFIX + "output_path", tuple(path))
        self.undo.append(("attrdel", self.model, PREFIX + "output_path"))
        twins = tuple(tuple(w) for w in self.twin_paths)
        if twins:
            setattr(self.model, PREFIX + "output_twins", twins)
            self.undo.append(("attrdel", self.model, PREFIX + "output_twins"))
        if log_param is not None:   # CLIP's logit_scale: checkpoints fold the scale into it
            setattr(self.model, OUTPUT_LOG_PARAM, log_param)
            self.undo.append(("attrdel", self.model, OUTPUT_LOG_PARAM))
        if self.unchecked:      # on the meta device: checked when the model holds data
            setattr(self.model, OUTPUT_CANDIDATES, tuple(tuple(g) for g in self.unchecked))
            self.undo.append(("attrdel", self.model, OUTPUT_CANDIDATES))
        self._hook(self.model.register_forward_hook(_root_output_hook))
        self._done("output", None, PREFIX + "output_scale")
        return PREFIX + "output_scale"

    def _output_module(self, path: list, run: Callable[[nn.Module], Any]
                       ) -> tuple[str | None, Any]:
        """The innermost submodule, called once per forward, whose returned tensor is the main
        output itself (forward hooks run innermost first and see earlier hooks' results)."""
        # tensor id -> (module, the tensor's version counter when the module returned it),
        # innermost first: a tensor changed in place afterwards (``self.head(h).add_(1)``,
        # ``out += bias``) is not that module's output any more
        seen: dict[int, list[tuple[str, int | None]]] = {}
        calls: dict[str, int] = {}
        keep: list[torch.Tensor] = []
        handles = []
        for name, m in self.model.named_modules():
            if not name:
                continue

            def hook(mod: nn.Module, args: tuple, out: Any, name: str = name) -> None:
                calls[name] = calls.get(name, 0) + 1
                t = out[0] if isinstance(out, tuple) and out else out
                if isinstance(t, torch.Tensor):
                    seen.setdefault(id(t), []).append((name, _version(t)))
                    keep.append(t)
            handles.append(m.register_forward_hook(hook))
        try:
            out = run(self.model)
        finally:
            for h in handles:
                h.remove()
        path = mode_path(out, path) or path
        try:
            target = at_path(out, path)
        except (KeyError, IndexError, TypeError, AttributeError):
            return None, out
        name = None
        if isinstance(target, torch.Tensor):
            now = _version(target)
            name = next((n for n, v in seen.get(id(target), []) if v == now), None)
        if not isinstance(target, torch.Tensor):
            return None, out
        if name is not None and calls.get(name, 0) > 1:
            # a module called more than once (a triplet net's one encoder): the other values
            # returned from its calls take the scale on the returned value too
            self.twin_paths = [w for w in _leaf_paths(out) if w != path and any(
                n == name and v == _version(at_path(out, w)) for n, v in
                seen.get(id(at_path(out, w)), []))]
        cands = self._graph_candidates(tuple(target.shape))
        if name is not None and calls.get(name, 0) == 1 and self._unique(name):
            # a head module returning ``self.proj(h).squeeze(-1)`` (ELECTRA's discriminator):
            # its own layer inside, whose output the main output is a reshape of, carries the
            # scale in its weight, so checkpoints fold
            inner = [c for c in cands if c.startswith(name + ".")]
            for cand in inner:
                if calls.get(cand, 0) == 1 and self._unique(cand) and \
                        self._scales_output(cand, path, run, target):
                    return cand, out
            return name, out
        for cand in cands:
            if calls.get(cand, 0) == 1 and self._unique(cand) and \
                    self._scales_output(cand, path, run, target):
                return cand, out
        return None, out

    def _summed_heads(self, path: list, run: Callable[[nn.Module], Any], out: Any
                      ) -> list[str]:
        """Modules, each called once, whose outputs the main output is a sum, difference or
        average of (``(cls_head(h0) + distill_head(h1)) / 2``), checked by running: doubling
        all of their outputs doubles the main output (in train mode too).  [] if none."""
        try:
            target = at_path(out, mode_path(out, path) or path)
        except (KeyError, IndexError, TypeError, AttributeError):
            return []
        if not isinstance(target, torch.Tensor):
            return []
        for o in self.graph.outputs:
            node = self.graph.get(o)
            if node is None or node.out_shape is None or \
                    tuple(node.out_shape) != tuple(target.shape):
                continue
            heads = self._sum_leaves(node)
            if not heads or len(heads) < 2 or len(set(heads)) != len(heads) or \
                    any(a.startswith(b + ".") for a in heads for b in heads) or \
                    not all(self.calls.get(h, 0) == 1 and self._unique(h) for h in heads):
                continue
            runs = [run] + ([self.train_runner] if self.train_runner is not None else [])
            if all(self._scales_output(heads, path, r, at_path(r(self.model), path))
                   for r in runs[1:]) and self._scales_output(heads, path, run, target):
                return heads
        return []

    def _sum_leaves(self, node: Any) -> list[str] | None:
        """The modules whose outputs ``node`` adds up, through reshapes, casts and products
        with constants; None where anything else enters."""
        while node is not None and node.module is None:
            live = [i for i in node.inputs if not self._frozen(i)]
            if node.kind in ("add", "sub") and len(live) == len(node.inputs) >= 2 and \
                    not node.params:
                heads: list[str] = []
                for i in live:
                    sub = self._sum_leaves(self.graph.get(i))
                    if not sub:
                        return None
                    heads += sub
                return heads
            if node.kind == "mul" and len(live) == 1 and self._frozen_params(node):
                node = self.graph.get(live[0])
            elif node.kind in ("reshape", "cast") and len(node.inputs) == 1:
                node = self.graph.get(node.inputs[0])
            else:
                return None
        return [node.module] if node is not None else None

    def _bounded(self, found: str | None, out: Any, path: list) -> str | None:
        """Why the main output cannot take a scale (``outputs.bounded_output``): the op of the
        module that produces it, or of the graph node the model's output comes from."""
        if found is not None:
            nodes = [n for n in self.graph if n.module == found]
            why = bounded_producer(self.graph, nodes[-1].name) if nodes else None
            if why is not None:
                return why
            # and the graph node the output comes from: a module whose forward ends in
            # functions (GLPN's head: ``(sigmoid(conv(h)) * max_depth).squeeze(1)``)
        try:
            target = at_path(out, path) if out is not None else None
        except (KeyError, IndexError, TypeError, AttributeError):
            return None
        if not isinstance(target, torch.Tensor):
            return None
        same = [self.graph.get(o) for o in self.graph.outputs]
        same = [n for n in same if n is not None and n.out_shape is not None and
                tuple(n.out_shape) == tuple(target.shape)]
        if len(same) > 1:       # several of its shape: the graph's outputs in leaf order
            same = [n for n in [self._output_node(out, target)] if n is not None]
        if len(same) != 1:      # which output is the main one cannot be told from the graph
            return None
        return bounded_producer(self.graph, same[0].name)

    def _output_node(self, out: Any, target: torch.Tensor) -> Any:
        """The graph node producing ``target``, one of the model's returned tensors, by its
        place among them (the captures list the outputs in leaf order, each once): when there
        are as many distinct tensors as graph outputs, each of its output's shape; else None."""
        ts: list[torch.Tensor] = []
        for t in leaves(out):
            if isinstance(t, torch.Tensor) and not any(t is u for u in ts):
                ts.append(t)
        nodes = [self.graph.get(o) for o in self.graph.outputs]
        if len(ts) != len(nodes) or any(n is None or n.out_shape is None or
                                        tuple(n.out_shape) != tuple(t.shape)
                                        for n, t in zip(nodes, ts)):
            return None
        return next((n for n, t in zip(nodes, ts) if t is target), None)

    def _unique(self, path: str) -> bool:
        mod = self.model.get_submodule(path)
        return sum(m is mod for m in self.model.modules()) == 1 and \
            sum(1 for n, m in self.model.named_modules(remove_duplicate=False)
                if m is mod) == 1

    def _graph_candidates(self, shape: tuple) -> list[str]:
        """Modules whose output the main output is a reshape, cast or sole selection of (walking
        up the captured graph from the model outputs of the same shape)."""
        found = []
        for o in self.graph.outputs:
            node = self.graph.get(o)
            if node is None or node.out_shape is None or tuple(node.out_shape) != shape:
                continue
            split = False
            while node is not None and node.module is None:
                live = [i for i in node.inputs if not self._frozen(i)]
                if node.kind in ("add", "sub", "mul") and len(live) == 1 and \
                        self._frozen_params(node):
                    # plus a zero buffer (BART's final_logits_bias), times a constant
                    # (Granite's / logits_scaling): exact only when the run check says so
                    src = live[0]
                    node = self.graph.get(src)
                    continue
                if len(live) == 1 and len(node.inputs) == 1 and not node.params and \
                        optable.BY_KIND.get(node.kind, optable.UNKNOWN_SPEC).homogeneous and \
                        len(self.users.get(live[0], [])) == 1:
                    # a positively homogeneous op (``torch.relu(self.b(h))``, returned and read
                    # by a head): the module before it carries the scale, so every use inside
                    # forward sees it as on the fx back end (exact when the run check says so)
                    node = self.graph.get(live[0])
                    continue
                # a selection reads its data first, then any index tensors (the pooled last
                # token of a decoder's sequence classifier: logits[arange(b), last])
                if node.kind not in ("reshape", "cast", "select") or not node.inputs or \
                        (len(node.inputs) != 1 and node.kind != "select"):
                    node = None
                    break
                src = node.inputs[0]
                if node.kind == "select" and len(self.users.get(src, [])) != 1:
                    if not self._partitioned(src, shape):
                        node = None
                        break
                    split = True
                node = self.graph.get(src)
            if node is not None and node.module and node.module not in found:
                found.append(node.module)
                if split:
                    self.split_outputs.add(node.module)
        return found

    def _partitioned(self, src: str, shape: tuple) -> bool:
        """Whether ``src`` is only cut into parts of the main output's size (a question-answering
        head's start and end logits): its every reader a selection of that many elements."""
        n = math.prod(shape)
        for u in self.users.get(src, []):
            node = self.graph.get(u)
            if node is None or node.kind != "select" or node.out_shape is None or \
                    math.prod(node.out_shape) != n:
                return False
        return True

    def _frozen_params(self, node: Any) -> bool:
        """Whether every parameter-like operand ``node`` reads is a buffer of the model (no
        trainable parameter: it does not change in training)."""
        bufs = getattr(self, "_buffer_names", None)
        if bufs is None:
            bufs = self._buffer_names = {n for n, _ in self.model.named_buffers()}
        return all(v in bufs for v in node.params.values())

    def _frozen(self, name: str) -> bool:
        """Whether node ``name`` computes from the model's buffers alone (no model input, no
        trainable parameter): a constant of the forward, such as an added logits bias."""
        node = self.graph.get(name)
        if node is None or not self._frozen_params(node) or \
                len(node.params) + len(node.inputs) < len(node.in_shapes):
            return False
        return all(self._frozen(i) for i in node.inputs)

    def _log_param(self, path: list, run: Callable[[nn.Module], Any], out: Any) -> str | None:
        """A one-element parameter of the model itself whose exponential multiplies the main
        output (:func:`log_param`).  On the meta device, where it cannot be checked, the model
        is marked so that :func:`settle_output_scale` checks once it holds data."""
        try:
            target = at_path(out, mode_path(out, path) or path) if out is not None else None
        except (KeyError, IndexError, TypeError, AttributeError):
            return None
        if not isinstance(target, torch.Tensor):
            return None
        if target.device.type == "meta":
            setattr(self.model, OUTPUT_LOG_UNCHECKED, True)
            self.undo.append(("attrdel", self.model, OUTPUT_LOG_UNCHECKED))
            return None
        runs = [run] + ([self.train_runner] if self.train_runner is not None else [])
        return log_param(self.model, path, runs, target)

    def _scales_output(self, path: str | list[str], out_path: list,
                       run: Callable[[nn.Module], Any], before: torch.Tensor) -> bool:
        """Check, by running, that doubling ``path``'s output (every one of a list's) doubles
        the main output."""
        if any(p.device.type == "meta" for p in self.model.parameters()):
            group = [path] if isinstance(path, str) else list(path)
            if group not in self.unchecked:
                self.unchecked.append(group)
            return False        # no values to run on: settle_output_scale checks it later
        return doubles_output(self.model, path, out_path, run, before)


#: the model attribute naming the one-element parameter whose exponential multiplies the main
#: output (CLIP's ``logit_scale``), when the output scale sits on the returned value: folding
#: adds ``log(scale)`` to it (:meth:`OutputSearch._log_param`)
OUTPUT_LOG_PARAM = PREFIX + "output_log_param"

@torch.no_grad()
def log_param(model: nn.Module, path: list, runs: list[Callable[[nn.Module], Any]],
              target: torch.Tensor | None = None) -> str | None:
    """A one-element parameter of ``model`` itself whose exponential multiplies the main
    output (CLIP's and SigLIP's ``logit_scale.exp() * text @ image.T``), checked by running
    each of ``runs`` (``target``: the first run's main output, if already computed): adding
    ``log 2`` to it doubles the main output.  The output scale ``s`` on the returned value
    then folds exactly into it (``+ log s``).  None where there is none."""
    for name, p in model._parameters.items():
        if p is None or p.numel() != 1 or not p.is_floating_point() or \
                p.device.type == "meta" or sum(q is p for q in model.parameters()) != 1:
            continue
        ok = True
        for i, r in enumerate(runs):
            before = target if i == 0 and target is not None else at_path(r(model), path)
            saved = p.detach().clone()
            p.add_(math.log(2.0))
            try:
                ok = isinstance(before, torch.Tensor) and _doubled(at_path(r(model), path),
                                                                  before)
            except Exception:   # the model does not run that way
                ok = False
            finally:
                p.copy_(saved)      # bit for bit (a + log 2 - log 2 may round)
            if not ok:
                break
        if ok:
            return name
    return None


#: set on a model planned on the meta device whose output scale sits on the returned value:
#: whether a parameter's exponential multiplies the main output (CLIP's ``logit_scale``) is
#: checked by :func:`settle_output_scale` once the model holds data
OUTPUT_LOG_UNCHECKED = PREFIX + "output_log_unchecked"

#: the model attribute listing, on a model planned on the meta device whose output scale went
#: on the returned value, the module groups that may carry it instead (checked by running)
OUTPUT_CANDIDATES = PREFIX + "output_candidates"


def doubles_output(model: nn.Module, path: str | list[str], out_path: list,
                   run: Callable[[nn.Module], Any], before: torch.Tensor) -> bool:
    """Whether doubling ``path``'s output (every one of a list's) doubles the main output
    ``before`` (at ``out_path`` of ``run(model)``), checked by running."""
    def double(mod: nn.Module, args: tuple, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return out * 2
        return out
    hs = [model.get_submodule(p).register_forward_hook(double)
          for p in ([path] if isinstance(path, str) else path)]
    try:
        return _doubled(at_path(run(model), out_path), before)
    except Exception:   # the model does not run that way, or has no data (meta device)
        return False
    finally:
        for h in hs:
            h.remove()


def _doubled(after: Any, before: torch.Tensor) -> bool:
    """Whether ``after`` is ``before`` doubled (the check of every doubling run)."""
    return isinstance(after, torch.Tensor) and after.shape == before.shape and \
        bool(torch.allclose(after, before * 2, rtol=1e-5, atol=1e-30))


@torch.no_grad()
def settle_output_scale(model: nn.Module, run: Callable[[nn.Module], Any]) -> list[str]:
    """On a model planned on the meta device, now that it holds data: move the output scale
    from the returned value onto the modules recorded as able to carry it (BART's ``lm_head``
    before ``+ final_logits_bias``, DeiT's two heads), the first group that passes the
    doubling check by running (as precondition does with data), so that the model's own loss
    sees it and checkpoints fold.  Returns the modules that took it ([] if none)."""
    from precondfx.pytorch.apply.eager_apply import module_hook   # imports this module
    groups = model.__dict__.pop(OUTPUT_CANDIDATES, None)
    unchecked_log = model.__dict__.pop(OUTPUT_LOG_UNCHECKED, False)
    name = PREFIX + "output_scale"
    path = list(getattr(model, PREFIX + "output_path", ()) or ())
    if not (groups or unchecked_log) or name not in model._buffers:
        return []
    roots = [k for k, h in model._forward_hooks.items() if h is _root_output_hook]
    for k in roots:     # checked without the scale: a loss from labels, no value set yet
        model._forward_hooks[k] = _pass_through
    try:
        group = _first_doubling(model, groups, path, run) if groups else None
        if group is None and unchecked_log and not model.__dict__.get(OUTPUT_LOG_PARAM):
            # the scale stays on the returned value: CLIP's logit_scale carries it in
            # checkpoints (+ log s), as planned with data
            found = log_param(model, path, [run])
            if found is not None:
                setattr(model, OUTPUT_LOG_PARAM, found)
    finally:
        for k in roots:
            model._forward_hooks[k] = _root_output_hook
    if group is None:
        return []
    buf = model._buffers.pop(name)
    model._non_persistent_buffers_set.discard(name)
    for k, h in list(model._forward_hooks.items()):
        if h is _root_output_hook:
            del model._forward_hooks[k]
            model._forward_hooks_always_called.pop(k, None)
    model.__dict__.pop(PREFIX + "output_path", None)
    planned = model.__dict__.get(PREFIX + "constants")
    for m in group:
        mod = model.get_submodule(m)
        mod.register_buffer(name, buf.detach().clone())
        module_hook(mod, name)
        if isinstance(planned, dict) and name in planned:
            planned[f"{m}.{name}"] = planned[name]
    if isinstance(planned, dict):
        planned.pop(name, None)
    return list(group)


def _pass_through(module: nn.Module, args: tuple, out: Any) -> None:
    """A forward hook that leaves the output as it is."""
    return None


def _first_doubling(model: nn.Module, groups: Any, path: list,
                    run: Callable[[nn.Module], Any]) -> tuple | None:
    """The first group of modules whose doubled outputs double the main output."""
    out = run(model)
    try:
        before = at_path(out, mode_path(out, path) or path)
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    if not isinstance(before, torch.Tensor):
        return None
    return next((g for g in groups if doubles_output(model, list(g), path, run, before)), None)
