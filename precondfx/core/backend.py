"""The back-end contract: what the driver (``precondfx.pytorch.pipeline``) asks of every back end.

Three back ends carry a plan out, each on its own kind of model:

- ``apply.fx_apply.FxApplier``: graph surgery on a ``torch.fx.GraphModule`` (constants are
  buffers read by ``get_attr`` nodes);
- ``apply.eager_apply.EagerApplier``: the user's own module, through hooks and buffers (undone
  by ``rollback``);
- ``onnx.apply.OnnxApplier``: an onnx-ir graph (constants are 0-d initializers).

The driver calls them in this order, whatever the back end::

    pools(plan); replace(node, module, path)*; scale(sc)* ; input_scale(v); output_scale(path)
    finish(); reinit(plan, seed); input_module(name, module) (a scheme's step)
    run(sample, mode) / output_std(...) / probe(...) / set_constant(name, v)   (measurements)
    rollback()                                                                 (on failure)

Every planned change ends as one :class:`Outcome` in ``outcomes``, keyed by the plan entry it
carries out (:func:`key_of` for a scale, ``pool:<node>``, ``replace:<node>``, ``input``,
``output``): whether it was applied, the constant that holds its value, and why not.  The
report's ``applied`` lines and ``skipped`` (what, why) pairs are the same records in words; code
that needs to know what happened reads ``outcomes`` (``placed``), never the words.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from precondfx.core.plan import Plan, Scale

#: the prefix of every constant a back end inserts (buffers, initializers): ``precondfx_alpha_...``
PREFIX = "precondfx_"


def key_of(sc: Scale) -> str:
    """The key of a planned scale in the back ends' ``outcomes`` (and the measured record):
    ``Scale.key``."""
    return sc.key()


@dataclass
class Outcome:
    """What a back end did with one planned change."""

    key: str                        # the plan entry (see the module docstring)
    done: bool
    constant: str | None = None     # buffer / initializer holding the value (scales)
    line: Any = None                # its ``applied`` line, or its ``skipped`` (what, why) pair


class Records:
    """Bookkeeping every back end shares: ``applied``/``skipped`` for the report and the
    structured ``outcomes`` for the driver and the schemes."""

    applied: list[str]
    skipped: list[tuple[str, str]]
    outcomes: dict[str, Outcome]
    #: planned pool changes left undone: pool node -> a short why for the plan's record
    pool_notes: dict[str, str]

    def _records(self) -> None:
        self.applied, self.skipped, self.outcomes, self.pool_notes = [], [], {}, {}

    def _done(self, key: str | None, line: str | None, constant: str | None = None) -> None:
        if line is not None:
            self.applied.append(line)
        if key is not None:
            self.outcomes[key] = Outcome(key, True, constant, line)

    def _skip(self, key: str | None, what: str, why: str) -> None:
        self.skipped.append((what, why))
        if key is not None:
            self.outcomes[key] = Outcome(key, False, None, (what, why))

    def _scale_node(self, nodes: Any, sc: Any, missing: str) -> tuple[Any, str, str]:
        """The node that scale ``sc`` acts on (looked up in ``nodes``; None, with a skipped
        entry saying ``missing``, where it is not there), its plan key, and what the report
        calls it."""
        node, key, what = nodes.get(sc.node), key_of(sc), f"{sc.tag} at {sc.where} of {sc.node}"
        if node is None:
            self._skip(key, what, missing)
        return node, key, what

    def placed(self, key: str) -> str | None:
        """The constant that carries plan entry ``key`` (None where it was not applied)."""
        o = self.outcomes.get(key)
        return o.constant if o is not None and o.done else None

    def missed(self, key: str) -> bool:
        """Whether plan entry ``key`` was tried and not applied."""
        o = self.outcomes.get(key)
        return o is not None and not o.done

    def made_good(self, key: str, line: str | None, constant: str | None = None) -> None:
        """A change that could not be applied as planned was carried out another way (a scheme
        put an equivalent constant elsewhere): its ``skipped`` entry goes, ``line`` is
        applied."""
        o = self.outcomes.get(key)
        if o is not None and not o.done and o.line in self.skipped:
            self.skipped.remove(o.line)
        self._done(key, line, constant)


@runtime_checkable
class Backend(Protocol):
    """What every back end implements (see the module docstring for the order of calls)."""

    #: short name for the report and the progress lines ("fx", "eager", "onnx")
    name: str
    applied: list[str]
    skipped: list[tuple[str, str]]
    outcomes: dict[str, Outcome]
    pool_notes: dict[str, str]
    #: False when the output std is exactly proportional to the output constant (the driver
    #: then computes the calibrated std instead of running the model again)
    rerun_after_scale: bool

    def pools(self, plan: Plan) -> None:
        """Fold or replace the max-pools as ``plan.pools`` says; a pool that cannot be changed
        stays, with an outcome ``pool:<node>`` saying why."""

    def replace(self, name: str, mod: Any, path: str | None = None,
                all_calls: bool = False) -> bool:
        """Make node ``name`` a call of module ``mod`` (a scheme's replacement); False (and a
        ``skipped`` entry) when it cannot."""

    def scale(self, sc: Scale) -> str | None:
        """Place one planned scale; the name of the constant holding its value, or None."""

    def input_scale(self, value: float) -> list[str]:
        """Multiply the floating-point model inputs by ``value``; the constants' names."""

    def output_scale(self, path: list) -> str | None:
        """Multiply the main output (``path`` into the output structure; [] = the rule of
        ``precondfx.core.outputs``) by a constant set to 1, which calibration sets later."""

    def input_module(self, name: str, mod: Any) -> bool:
        """Run module ``mod`` (a submodule ``name`` of the result) on the model's
        floating-point input before everything else (a scheme's input normalization); False,
        with a ``skipped`` entry, where the back end cannot."""

    def finish(self) -> None:
        """Make the edited model runnable (recompile a graph; nothing for hooks)."""

    def reinit(self, plan: Plan, seed: int) -> list[str]:
        """Re-initialize the parameters as ``plan.inits`` says; the names changed."""

    def run(self, sample: Any, mode: str) -> Any:
        """Run the model on the sample (calibration mode ``mode``, no side effects)."""

    def output_std(self, sample: Any, mode: str, key: Any = None) -> float:
        """Std of the main output on the sample (``key``: the ``output_key`` option)."""

    def seeded_output_std(self, sample: Any, mode: str, key: Any, seed: int
                          ) -> tuple[float, bool]:
        """:meth:`output_std` with the model's random ops (inline stochastic depth, noise)
        drawn from generators seeded with ``seed``, the user's random state left as it was;
        and whether the forward drew random numbers (then its std varies from draw to draw)."""

    def set_constant(self, name: str, value: float) -> None:
        """Set the value of a constant placed by ``scale``/``input_scale``/``output_scale``."""

    def probe(self, run: Callable[[Callable[..., Any]], Any], names: list[str]
              ) -> dict[str, Any]:
        """Values of the named graph nodes while ``run(fn)`` calls the model function ``fn``
        on the sample."""

    def probe_sample(self, sample: Any, names: list[str], mode: str) -> dict[str, Any]:
        """Values of the named graph nodes on ``sample`` in calibration mode ``mode``, without
        gradients or side effects (a scheme's data-driven step)."""

    def rollback(self) -> None:
        """Undo every change to the user's model (the eager back end edits it in place)."""

    def placed(self, key: str) -> str | None:
        """The constant carrying plan entry ``key`` (see :class:`Records`)."""

    def made_good(self, key: str, line: str | None, constant: str | None = None) -> None:
        """Record that entry ``key`` was carried out another way (see :class:`Records`)."""


def contract() -> dict[str, inspect.Signature]:
    """The methods of :class:`Backend` and their signatures (for checks and tests)."""
    return {name: inspect.signature(fn) for name, fn in vars(Backend).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


def conforms(cls: type) -> list[str]:
    """What ``cls`` lacks to implement :class:`Backend`: a missing method, or a parameter of
    the contract missing, renamed or reordered (extra parameters need a default)."""
    problems = []
    for name, want in contract().items():
        fn = getattr(cls, name, None)
        if not callable(fn):
            problems.append(f"{cls.__name__}.{name} is missing")
            continue
        got = list(inspect.signature(fn).parameters.values())
        exp = list(want.parameters.values())
        if [p.name for p in got[:len(exp)]] != [p.name for p in exp]:
            problems.append(f"{cls.__name__}.{name}{inspect.signature(fn)} does not match "
                            f"{name}{want}")
            continue
        for p, q in zip(got, exp):
            if (q.default is inspect.Parameter.empty) != (p.default is inspect.Parameter.empty):
                problems.append(f"{cls.__name__}.{name}: parameter {p.name} default differs")
        for p in got[len(exp):]:
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL,
                                                                       p.VAR_KEYWORD):
                problems.append(f"{cls.__name__}.{name}: extra parameter {p.name} has no "
                                f"default")
    return problems
