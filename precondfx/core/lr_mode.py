"""What ``lr_scale="auto"`` (the default) resolves to, decided from the plan and the init the
model declares.

Geometric-mean initialization stores weights at ``sqrt(2 / (k^2 sqrt(n_in n_out)))``.  A
pipeline's learning rate is tuned for the weights the user's model starts with, and an Adam
step does not scale with the weight: when precondfx stores a weight ``R`` times larger than
the user's init did, the same rate is a step ``R`` times smaller relative to the weight, and the
best rate moves up.  ``R`` decides:

* PyTorch's default init (``1/sqrt(3 fan_in)``) gives ``R = sqrt(6) (n_in/n_out)^(1/4)``: about
  2.4 on square layers (2.2-3.1 over the suite's MLPs and CNNs).  There, storing halfway
  (``lr_scale="user"``) lost at the user's rate on the max-pool CNNs and won on others.
* transformers' ``_init_weights`` (std ``config.initializer_range`` = 0.02) at widths 32-128
  gives ``R`` = 9-13 (median over layers).  There, storing halfway moved the best AdamW rate
  back to the transformers init's and won at that rate (docs/results/heldout_cpu.md).  At
  GPT-2's own width 768 the same std gives 3.0, PyTorch's default's ratio: no change.

Under SGD the same storage moves a layer's rate by ``c^2``, not always the right way: at the
transformers init's SGD rate the result diverged on BERT and the ViT (both GPT-2 sizes were
better).  Transformers are trained with Adam-family optimizers almost always; with SGD, pass
your rate as ``lr=`` with ``optimizer="sgd"`` (:mod:`precondfx.pytorch.lr_target`: the
curvature's suggested SGD rate is put on it; ``precondition_trainer`` does this for a Trainer
whose optimizer is SGD).

So ``"auto"`` is ``"user"`` when the median ``R`` over the re-drawn weighted layers is at least
``AUTO_RATIO`` = 4, with the user's scale of each weight taken from what the model *declares*
(``ParamInfo.user_scale``: a transformers config's ``initializer_range``, set by
``precondfx.pytorch.lr_transfer.declared_stds``), not from its values: a model on the meta
device, a sharded one and the same model with its values decide alike and get the same
factors (each rounded to a power of two, ``lr_transfer.power_of_two``, so that they are exact
in every float format).  A model that declares no init (plain PyTorch modules) is left as it
was before ``"auto"`` (no lr scales; ``lr_scale="user"`` compares with the measured rms
instead).  Also off when the weights are kept (``reinit=False``) and for schemes other than
``geometric``, which set their own constants from data; ONNX files declare no init std.
"""
from __future__ import annotations

import math
import statistics
from typing import Any

from precondfx.core.fans import INIT_RULES

#: "auto" -> "user" when precondfx would store the median re-drawn weight at least this many
#: times larger (std) than the init std the model declares
AUTO_RATIO = 4.0


def ratios(plan: Any, params: dict[str, Any]) -> dict[str, float]:
    """Per re-drawn layer weight: planned std / its scale in the user's model
    (``ParamInfo.user_scale``: the init std the model declares; weights without one are left
    out)."""
    out: dict[str, float] = {}
    for lay in plan.layers:
        w = lay.weight
        if not w or w in out:
            continue
        pi, info = plan.inits.get(w), params.get(w)
        rms = getattr(info, "user_scale", None)
        if pi is None or pi.rule not in INIT_RULES or not pi.std or not rms:
            continue
        if math.isfinite(rms) and rms > 0:
            out[w] = float(pi.std) / float(rms)
    return out


def resolve(plan: Any, params: dict[str, Any], opts: Any, mode: str | None = None
            ) -> tuple[str | None, str | None]:
    """The lr_scale mode the pass applies (``None``: off) and, for ``"auto"`` where the model
    declares its init, why (a plan note; None: nothing to say).  ``mode``: decide for this
    value instead of ``opts.lr_scale``."""
    mode = mode or getattr(opts, "lr_scale", None)
    if mode == "adam":      # "adam" stores on top of what "auto" would (see declared_base)
        base, why = resolve(plan, params, opts, "auto")
        return mode, (why.replace("lr_scale='auto'", "lr_scale='adam', on top of 'auto'", 1)
                      if why and base == "user" else None)
    if mode != "auto":
        return mode, None
    if not any(getattr(params.get(lay.weight or ""), "user_scale", None)
               for lay in plan.layers):
        return None, None       # the model declares no init std: off, as before "auto"
    if getattr(opts, "scheme", "geometric") != "geometric":
        return None, f"lr_scale='auto': off (scheme={opts.scheme!r} sets its own constants)"
    if not getattr(opts, "reinit", True):
        return None, "lr_scale='auto': off (reinit_weights=False keeps your weights)"
    r = ratios(plan, params)
    if not r:
        return None, "lr_scale='auto': off (no re-drawn weight has a declared init std)"
    med = math.exp(statistics.median(math.log(v) for v in r.values()))
    what = (f"median planned std / your model's init std {med:.3g} over {len(r)} layers "
            f"(threshold {AUTO_RATIO:g})")
    if med >= AUTO_RATIO:
        return "user", (f"lr_scale='auto' -> 'user': {what}: a learning rate tuned for your "
                        f"init meets weights that much larger, so each weight is stored near the "
                        f"geometric mean of the two scales (a power-of-two factor), its layer's "
                        f"output scaled to match: the same function (for Adam-family "
                        f"optimizers; with SGD, whose rate it moves by c^2, pass your rate as "
                        f"lr= with optimizer='sgd')")
    return None, f"lr_scale='auto': off ({what})"


def declared_base(plan: Any, params: dict[str, Any], opts: Any) -> bool:
    """Whether ``lr_scale="adam"`` multiplies its factors onto the declared-init storage
    ``"auto"`` would choose for this model (a transformers model at the suite's widths: the
    storage under which its Adam rate lands at the transformers init's)."""
    return resolve(plan, params, opts, "auto")[0] == "user"


__all__ = ["AUTO_RATIO", "declared_base", "ratios", "resolve"]
