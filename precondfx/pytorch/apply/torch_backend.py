"""What the fx and eager back ends share of ``precondfx.core.backend.Backend``: running the
rewritten module, re-initializing it, setting a constant."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


#: the skipped line of an input the input scale leaves alone, named as a mask
_MASK_SKIP = ("not on input {!r}: a mask (its name says so), whose values mean masked or kept "
              "(scaled, keep * 0.1 < 0.5 would mask everything)")


def mask_skip(name: str, why: str | None = None) -> str:
    """The report's reason the input scale leaves input ``name`` alone: a mask by its name
    (``why`` None), or by its uses (``why``: what reads it so)."""
    if why is None:
        return _MASK_SKIP.format(name)
    return f"not on input {name!r}: a mask ({why}), whose values mean masked or kept"


class TorchBackend:
    """The shared half of the fx and eager back ends (``self.module``: the rewritten module)."""

    module: nn.Module
    rerun_after_scale = True

    def reinit(self, plan: Any, seed: int) -> list[str]:
        """``precondfx.pytorch.apply.reinit.reinit`` on the rewritten module."""
        from precondfx.pytorch.apply.reinit import reinit
        return reinit(self.module, plan, seed)

    def run(self, sample: Any, mode: str) -> Any:
        """One side-effect-free forward on the sample (a fake-tensor run on the meta device)."""
        from precondfx.pytorch import calibrate as cal
        from precondfx.pytorch.capture import meta
        if meta.on_meta(self.module):
            return meta.forward(self.module, lambda m: cal.forward(m, sample, mode),
                                "checking the model")
        return cal.forward(self.module, sample, mode)

    def output_std(self, sample: Any, mode: str, key: Any = None) -> float:
        """The main output's std on the sample; on a sharded model, over every rank's batch
        (sums all-reduced), so that every rank sets the same output scale."""
        from precondfx.pytorch import calibrate as cal
        from precondfx.pytorch.apply.shards import is_sharded
        out = cal.forward(self.module, sample, mode)
        if is_sharded(self.module):     # the -inf rule too, on the global batch
            t = cal.main_output(out, key)
            std, _, self.masked_entries = cal.global_masked_std(t)
            self.output_size = None      # the masked count is every rank's
            return std
        std, self.masked_entries = cal.masked_output_std(out, key)
        self.output_size = int(cal.main_output(out, key).numel())
        self.output_floor, self.same_rows = cal.constancy(out, key)
        return std

    def seeded_output_std(self, sample: Any, mode: str, key: Any, seed: int
                          ) -> tuple[float, bool]:
        from precondfx.pytorch import calibrate as cal
        with cal.seeded(seed) as rec:
            std = self.output_std(sample, mode, key)
        return std, rec.random

    def probe_sample(self, sample: Any, names: list[str], mode: str) -> dict[str, Any]:
        """``probe`` on one quiet, gradient-free run of the sample (dropout off, BatchNorm
        statistics restored)."""
        from precondfx.pytorch import calibrate as cal
        with cal.quiet_run(self.module, mode), cal.no_grad_for(self.module):
            return self.probe(lambda fn: sample.call(fn), names)

    def set_constant(self, name: str, value: float) -> None:
        with torch.no_grad():
            self.module.get_buffer(name).fill_(value)
