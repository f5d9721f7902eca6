"""The inputs of a measurement: layer specs resolved to parameters, the batch cut into samples
(batch size 1), the main output, and the model state kept while measuring."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from precondfx.errors import PrecondError
from precondfx.pytorch.capture.common import Sample, as_sample
from precondfx.pytorch.measure.conditioning.results import LayerRef


def default_output_fn(out: Any) -> torch.Tensor:
    """The main output (the rule of ``precondfx.core.outputs``, as the output scale uses it)."""
    from precondfx.pytorch.capture.common import main_output
    try:
        return main_output(out)
    except PrecondError:
        raise PrecondError(
            f"cannot find the main output tensor in a model output of type "
            f"{type(out).__name__}; pass output_fn=lambda out: <the tensor> to "
            f"measure_conditioning") from None


def whole_batch_output_fn(model: nn.Module, smp: Sample, params: Sequence[torch.Tensor]
                          ) -> Callable[[Any], torch.Tensor]:
    """:func:`default_output_fn` with the main output picked once, on the whole batch: the
    rule skips one-element outputs (a loss), and at batch size 1 a main output with one
    element per sample (CLIP's ``logits_per_image``) has one, so re-applying it per sample
    would measure another output.  One forward of the batch, without dropout, the model's
    buffers restored; where it fails, the rule per sample as before."""
    from precondfx.pytorch.capture.common import main_output, main_path_of
    try:
        with measurement_state(model, params), torch.no_grad():
            path = main_path_of(smp.call(model))
    except Exception:  # noqa: BLE001 - the per-sample passes report what fails
        return default_output_fn
    return lambda out: main_output(out, path)


def _spec_get(spec: Any, keys: Sequence[str]) -> Any:
    for k in keys:
        v = spec.get(k) if isinstance(spec, Mapping) else getattr(spec, k, None)
        if isinstance(v, str) or (v is not None and k == "alpha"):
            return v
    return None


def _module_of(weight: str) -> str:
    """Path of the module that owns a parameter (parametrizations unwrapped)."""
    path = weight.rsplit(".", 1)[0] if "." in weight else ""
    marker = ".parametrizations."
    if marker in "." + path + ".":
        path = ("." + path).split(marker)[0].lstrip(".")
    return path


def resolve_layers(model: nn.Module, layers: Sequence[Any] | None = None) -> list[LayerRef]:
    """Normalize layer specs into :class:`LayerRef` and check the parameters exist.

    A spec is a :class:`LayerRef`, a weight parameter name, a dict or any object with a name and
    a weight parameter name (keys/attributes ``weight_name``/``weight``/``param``, ``bias_name``/
    ``bias``, ``name``, ``module``, ``alpha``; a ``params`` role->name dict is also read).
    ``None`` means every ``Linear``/``ConvNd``/``ConvTransposeNd`` module, in definition order.
    """
    if layers is None:
        refs = []
        for path, mod in model.named_modules():
            if isinstance(mod, (nn.Linear, nn.modules.conv._ConvNd)) and \
                    isinstance(getattr(mod, "weight", None), torch.Tensor):
                pre = path + "." if path else ""
                refs.append(LayerRef(path or "model", pre + "weight",
                                     pre + "bias" if mod.bias is not None else None, path))
        if not refs:
            raise PrecondError("the model has no Linear/Conv layers; pass layers=[...] explicitly")
        return refs
    refs: list[LayerRef] = []
    for spec in layers:
        if isinstance(spec, LayerRef):
            ref = LayerRef(spec.name, spec.weight, spec.bias, spec.module, float(spec.alpha))
        elif isinstance(spec, str):
            ref = LayerRef(spec.removesuffix(".weight"), spec)
        else:
            params = spec.get("params") if isinstance(spec, Mapping) else getattr(spec, "params", None)
            params = params if isinstance(params, Mapping) else {}
            weight = _spec_get(spec, ("weight_name", "weight_param", "weight", "param")) \
                or params.get("weight")
            if weight is None:
                raise PrecondError(f"layer spec {spec!r} names no weight parameter "
                                   "(give 'weight': '<parameter name>')")
            bias = _spec_get(spec, ("bias_name", "bias_param", "bias")) or params.get("bias")
            name = _spec_get(spec, ("name",)) or weight.removesuffix(".weight")
            alpha = _spec_get(spec, ("alpha",))
            ref = LayerRef(name, weight, bias, _spec_get(spec, ("module",)),
                           1.0 if alpha is None else float(alpha))
        if ref.module is None:
            ref.module = _module_of(ref.weight)
        for pname in (ref.weight, ref.bias):
            if pname is None:
                continue
            try:
                model.get_parameter(pname)
            except AttributeError as e:
                names = [n for n, _ in model.named_parameters()][:12]
                raise PrecondError(f"layer {ref.name!r}: no parameter {pname!r} in the model "
                                   f"(some parameters: {names})") from e
        refs.append(ref)
    seen = [r.weight for r in refs] + [r.bias for r in refs if r.bias]
    if len(seen) != len(set(seen)):
        raise PrecondError("a parameter appears in two layer specs; list each layer once")
    return refs


def per_sample(sample: Any, forward_kwargs: Mapping[str, Any] | None = None
               ) -> tuple[Sample, int]:
    """The sample as a :class:`Sample` and its batch size: per-sample passes call
    ``s.take(i).call(model)``, which slices only the inputs that carry the batch dimension
    (see :func:`precondfx.pytorch.capture.common.batch_layout`)."""
    s = as_sample(sample, forward_kwargs)
    return s, s.batch_size()


def sample_failed(e: Exception, s: Sample) -> PrecondError:
    """The error for a model that raised on one sample (batch size 1), with what to do."""
    from precondfx.pytorch.checks import is_out_of_memory, out_of_memory
    if is_out_of_memory(e):
        return out_of_memory(e)
    parts = ", ".join(f"{n} {tuple(t.shape)}" for n, t in s.inputs()
                      if isinstance(t, torch.Tensor))
    return PrecondError(
        f"the model failed on one sample (batch size 1): {type(e).__name__}: {e}. Inputs: "
        f"{parts}. Train-mode BatchNorm1d cannot run on one sample (measure in eval mode); if an "
        f"input was wrongly sliced or not sliced along dim 0, say which inputs are batched with "
        f"precondfx.Sample(args, kwargs, batched=[...])")


def run_sample(model: nn.Module, smp: Sample, i: int, output_fn: Callable[[Any], Any]) -> Any:
    """``output_fn`` of the model run on sample ``i`` alone; a failure becomes
    :func:`sample_failed`'s error (a PrecondError passes through)."""
    try:
        return output_fn(smp.take(i).call(model))
    except PrecondError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with advice
        raise sample_failed(e, smp) from e



def _is_dropout(m: nn.Module) -> bool:
    from precondfx.pytorch.calibrate import is_stochastic
    return is_stochastic(m)


@contextmanager
def measurement_state(model: nn.Module, params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Dropout off, parameters differentiable; restore flags, buffers and requires_grad after."""
    from precondfx.pytorch.calibrate import NoDropout, checkpoint_as_call, preserved
    req = [(p, p.requires_grad) for p in params]
    try:   # NoDropout: functional dropout too; reentrant checkpoints differentiable by grad()
        with preserved(model), checkpoint_as_call():
            for m in model.modules():
                if _is_dropout(m):
                    m.training = False
            for p in params:
                p.requires_grad_(True)
            with NoDropout():
                yield
    finally:
        for p, r in req:
            p.requires_grad_(r)

