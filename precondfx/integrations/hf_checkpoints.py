"""transformers checkpoints that keep the preconditioned function, and the preconditioning
recorded in the model's config (the pipeline's last stage calls ``prepare``; ``reattach`` is
public through ``precondfx.integrations.hf``, which says how checkpoints work)."""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from precondfx.pytorch.apply.common import PREFIX, scalar_buffer
from precondfx.pytorch.apply.eager_output import OUTPUT_LOG_PARAM
from precondfx.errors import PrecondError
from precondfx.pytorch.folding import (Recipe, attach, fold_factors, fold_problems, fold_shifts,
                                       recipe_of)

CONFIG_KEY = "precondfx"


def is_transformers_model(model: Any) -> bool:
    """A ``transformers.PreTrainedModel`` (checked by class name, without importing it)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(model).__mro__)


def _constants(model: nn.Module) -> dict[str, float]:
    planned = model.__dict__.get(PREFIX + "constants") or {}   # meta device: planned values
    return {name: float(planned.get(name, 1.0)) if b.device.type == "meta" else float(b)
            for name, b in model.named_buffers() if name.split(".")[-1].startswith(PREFIX)}


def prepare(model: nn.Module, report: Any = None) -> None:
    """Record the preconditioning in ``model.config.precondfx`` and make checkpoints fold the
    constants (called by ``precondition`` on transformers models)."""
    from precondfx import __version__
    problems = fold_problems(model)
    rec = recipe_of(model)
    cfg = getattr(model, "config", None)
    old = getattr(cfg, CONFIG_KEY, None) if cfg is not None else None
    entry = {
        "version": __version__,
        "constants": _constants(model),
        "output_path": list(getattr(model, PREFIX + "output_path", ()) or ()),
        "output_log_param": model.__dict__.get(OUTPUT_LOG_PARAM),
        "capture": getattr(report, "capture", None),
        "upstream": dict(rec.upstream) if rec else {},
        "idle": list(rec.idle) if rec else [],
        "checkpoints": "folded" if not problems else "raw",
        "problems": [f"{w}: {why}" for w, why in problems],
    }
    if report is not None and report.plan is not None:
        entry["options"] = {k: list(v) if isinstance(v, tuple) else v   # a schedule s_l
                            for k, v in report.plan.options.items()
                            if isinstance(v, (str, int, float, bool, type(None), tuple))}
    elif isinstance(old, dict) and "options" in old:
        entry["options"] = old["options"]
    if cfg is not None:
        setattr(cfg, CONFIG_KEY, entry)
    follow_output_embeddings(model)
    on_meta = any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))
    if (rec is not None and rec.pending) or on_meta:
        # planned on the meta device: whether a tied weight's factor can move upstream is
        # checked by running once the model holds data (precondfx.pytorch.distributed.calibrate, which
        # calls prepare again); until then checkpoints are neither folded nor warned about
        # (a model with nothing to check waits too: its only problem is having no values)
        entry["checkpoints"] = "pending"
        if not (isinstance(old, dict) and old.get("checkpoints") == "pending"):
            model.register_state_dict_post_hook(_warn_pending)
        return
    if problems:
        model.register_state_dict_post_hook(_warn_raw)
    else:
        _install(model)


def _warn_pending(module: nn.Module, state_dict: dict, prefix: str, meta: Any) -> None:
    """A checkpoint of a model planned on the meta device before ``distributed.calibrate``
    ran on it: its constants are not folded yet (a no-op once calibrate set folding up)."""
    entry = getattr(getattr(module, "config", None), CONFIG_KEY, None)
    if isinstance(entry, dict) and entry.get("checkpoints") == "pending" \
            and not _live(state_dict, prefix):
        warnings.warn(
            "this transformers model was preconditioned on the meta device and "
            "precondfx.pytorch.distributed.calibrate(model, batch) has not run on it since it got its "
            "data: its state_dict keeps the constants as precondfx_* entries, which "
            "from_pretrained drops. Calibrate first (it also checks where tied weights' "
            "factors fold; without an output scale: precondfx.pytorch.distributed.settle_checkpoints("
            "model, batch)), then save", UserWarning, stacklevel=2)


def _warn_raw(module: nn.Module, state_dict: dict, prefix: str, meta: Any) -> None:
    """A checkpoint of a model whose constants cannot fold keeps them as ``precondfx_*``
    entries, which ``from_pretrained`` drops: say so when one is taken (not for the live
    variables a tracer takes)."""
    if _live(state_dict, prefix):
        return
    entry = getattr(getattr(module, "config", None), CONFIG_KEY, None) or {}
    warnings.warn(
        "this preconditioned transformers model has constants that cannot be folded into its "
        "weights (" + "; ".join(entry.get("problems", [])) + "): its state_dict keeps them as "
        "precondfx_* entries, which from_pretrained drops as unexpected. Load such a checkpoint "
        "into a model preconditioned the same way (load_state_dict), or keep it with "
        "torch.save(model)", UserWarning, stacklevel=2)


def set_output_embeddings(self: nn.Module, new: Any) -> None:
    """The model's own ``set_output_embeddings``, then the precondfx constants of the output
    embedding it replaces (buffers and hooks) moved onto the new one: ``resize_token_embeddings``
    of an untied model builds a new ``lm_head``, which would otherwise drop its input scale and
    the output scale (the function and the loss's scale would change silently)."""
    from precondfx.pytorch.apply import eager_apply as ea
    old = self.get_output_embeddings()
    type(self).set_output_embeddings(self, new)
    if not isinstance(old, nn.Module) or not isinstance(new, nn.Module) or new is old:
        return
    for name, buf in list(old._buffers.items()):
        if buf is None or not name.startswith(PREFIX) or name in new._buffers:
            continue
        new.register_buffer(name, buf, persistent=name not in old._non_persistent_buffers_set)
        if name in ea.MODULE_HOOKS:
            ea.module_hook(new, name)


class _FollowOutputEmbeddings:
    """``model.set_output_embeddings`` as an instance attribute: :func:`set_output_embeddings`
    on the model it belongs to.  A plain object (not a bound method), so that ``pickle``,
    ``torch.save`` and ``deepcopy`` of the model keep it (a bound method is pickled as
    ``getattr(model, name)``, which on loading finds the class's method instead)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, new: Any) -> None:
        set_output_embeddings(self.model, new)


def follow_output_embeddings(model: nn.Module) -> None:
    """Make the model's ``set_output_embeddings`` carry the constants over (see
    :func:`set_output_embeddings`); an instance attribute, so the class is untouched."""
    if callable(getattr(type(model), "set_output_embeddings", None)) and \
            "set_output_embeddings" not in vars(model):
        model.__dict__["set_output_embeddings"] = _FollowOutputEmbeddings(model)


def _install(model: nn.Module) -> None:
    for mod in model.modules():
        for name in mod._buffers:
            if name.startswith(PREFIX):
                mod._non_persistent_buffers_set.add(name)
    model.register_state_dict_post_hook(_fold_state_dict)
    model.register_load_state_dict_pre_hook(_unfold_state_dict)


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter (tied parameters have several), by its first name."""
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        f = first.setdefault(id(p), name)
        out.setdefault(f, []).append(name)
    return out


def _factors(model: nn.Module) -> dict[str, float]:
    problems = fold_problems(model)
    if problems:
        raise PrecondError(
            "this preconditioned transformers model has constants that cannot be folded into "
            "its weights, so a checkpoint (state_dict, save_pretrained, Trainer) would lose "
            "them when reloaded: " + "; ".join(f"{w}: {why}" for w, why in problems) +
            ". Save it with torch.save(model) (pickle keeps the constants), or precondition "
            "without the constants listed")
    return fold_factors(model)


def _live(state_dict: dict, prefix: str) -> bool:
    """Whether ``state_dict`` holds the live parameters (``state_dict(keep_vars=True)``, as
    ``torch.jit.trace`` and the TorchScript ONNX exporter take it), not a checkpoint."""
    return any(isinstance(v, nn.Parameter) for k, v in state_dict.items()
               if k.startswith(prefix))


def _rescale_state_dict(module: nn.Module, state_dict: dict, prefix: str, fold: bool) -> None:
    """Multiply (``fold``) or divide every entry of a folded parameter (and its aliases) by
    its factor, in place.

    An entry that is an ``nn.Parameter`` is a live variable (``keep_vars=True``): it is left
    as it is both ways.  Folding it would hand a computed tensor to whoever asked for the
    variables themselves (a tracer records those as the model's inputs: the real parameters
    would then be constants that require grad, which ``torch.onnx.export(dynamo=False)`` and
    ``torch.jit.trace`` refuse), and a state of live variables was never folded."""
    factors = _factors(module)
    for first, names in _aliases(module).items():
        f = factors.get(first)
        if f is None:
            continue
        for n in names:
            k = prefix + n
            if k in state_dict and not isinstance(state_dict[k], nn.Parameter):
                state_dict[k] = state_dict[k] * f if fold else state_dict[k] / f
    for name, d in fold_shifts(module).items():    # CLIP's logit_scale: + log(output scale)
        k = prefix + name
        if k in state_dict and not isinstance(state_dict[k], nn.Parameter):
            state_dict[k] = state_dict[k] + d if fold else state_dict[k] - d


def _fold_state_dict(module: nn.Module, state_dict: dict, prefix: str, meta: Any) -> None:
    from precondfx.pytorch.first_step import is_pending
    if is_pending(module) and not _live(state_dict, prefix):
        warnings.warn(
            "precondfx: this checkpoint of a result whose lr='auto' first step is pending "
            "(no optimizer has stepped it) holds no pending step: from_pretrained (and "
            "reattach) gives a model that keeps this storage at any SGD rate, where this one "
            "sets it at its first SGD step (the kept calibration batch is not saved). Call "
            "precondfx.settle_rate(model, lr) before saving, or pass lr= and optimizer='sgd' "
            "to precondition (loading the state_dict into this same result keeps the step)",
            RuntimeWarning, stacklevel=2)
    entry = getattr(getattr(module, "config", None), CONFIG_KEY, None)
    if isinstance(entry, dict):   # constants set after precondition (meta-device calibration)
        entry["constants"] = _constants(module)
    _rescale_state_dict(module, state_dict, prefix, fold=True)


def _unfold_state_dict(module: nn.Module, state_dict: dict, prefix: str, meta: Any,
                       strict: bool, missing: list, unexpected: list, errors: list) -> None:
    _rescale_state_dict(module, state_dict, prefix, fold=False)


@torch.no_grad()
def reattach(model: nn.Module) -> nn.Module:
    """Put back the preconditioning recorded in ``model.config.precondfx`` on a model loaded
    with ``from_pretrained`` from a folded checkpoint: the constants as buffers with their
    hooks, and the weights divided by what folding multiplied them by, so that the function is
    unchanged and training goes on in the preconditioned parametrization.  In place; returns
    the model."""
    from precondfx.pytorch.apply import eager_apply as ea
    entry = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if not isinstance(entry, dict) or "constants" not in entry:
        raise PrecondError("the model's config records no preconditioning (config.precondfx): "
                           "it was not saved from a precondition result")
    if any(PREFIX in n for n, _ in model.named_buffers()):
        raise PrecondError("the model already carries precondfx constants: nothing to reattach")
    if entry.get("checkpoints") != "folded":
        raise PrecondError("the checkpoint was saved unfolded (" +
                           "; ".join(entry.get("problems", [])) + "): from_pretrained dropped "
                           "its constants; load it with load_state_dict into a model "
                           "preconditioned the same way")
    # every constant checked before anything changes: one this function cannot put back
    # (a constant of an fx result's traced forward) would leave the model half reattached
    unknown = [f for f in entry["constants"]
               if f.rpartition(".")[2] not in (PREFIX + "input_scale", *ea.MODULE_HOOKS)]
    if unknown and entry.get("capture") == "fx":
        raise PrecondError(
            f"config.precondfx records {unknown[0]}, a constant of the traced forward of an fx "
            f"result: reattach puts back the constants of the eager and export captures "
            f"(buffers with hooks), not a traced graph. The model from_pretrained loaded is "
            f"the folded one, the same function: train it as it is, or precondition it again "
            f"with capture='eager' to train on in the preconditioned form")
    if unknown:
        raise PrecondError(f"config.precondfx records an unknown constant {unknown[0]}")
    like = next(iter(model.parameters()), None)
    for fqn, value in entry["constants"].items():
        path, _, name = fqn.rpartition(".")
        mod = model.get_submodule(path) if path else model
        mod.register_buffer(name, scalar_buffer(value, like))
        if name == PREFIX + "output_scale" and not path:        # on the returned value
            setattr(model, PREFIX + "output_path", tuple(entry.get("output_path", ())))
            if entry.get("output_log_param"):
                setattr(model, OUTPUT_LOG_PARAM, entry["output_log_param"])
            model.register_forward_hook(ea._root_output_hook)
        elif name == PREFIX + "input_scale":
            model.register_forward_pre_hook(ea._root_input_hook, with_kwargs=True, prepend=True)
        else:                                   # a module's constant (checked above)
            ea.module_hook(mod, name)
    attach(model, Recipe(None, [], dict(entry.get("upstream", {})),
                         idle=list(entry.get("idle", []))))
    follow_output_embeddings(model)
    factors = fold_factors(model)
    named = dict(model.named_parameters())
    for name, f in factors.items():
        named[name].div_(f)
    for name, d in fold_shifts(model).items():
        named[name].sub_(d)
    _install(model)
    return model
