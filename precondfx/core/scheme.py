"""The scheme interface: how an initialization method plugs into the shared pipeline.

Every scheme runs over the same capture -> classify -> plan -> apply machinery (the stages of
``precondfx.core.driver``); it may change the plan before it is applied (parameter init rules,
activation replacements, alpha sites, what the report says of a node: ``plan.reasons``) and run
data-driven steps after re-initialization (LSUV's layer-sequential scaling), through a
:class:`SchemeContext` that measures node outputs on the calibration batch.  What such a step
sets goes into ``ctx.measured`` (``precondfx.core.measured``), never into the plan; it talks to the
back end through ``precondfx.core.backend.Backend``.  The output scale (``target_std``) is
fixed after the scheme's steps, for every scheme.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from precondfx.core.graph import Graph
from precondfx.errors import PrecondError
from precondfx.core.measured import Measured
from precondfx.core.options import (Options, Override, Resolved, Support, did_you_mean,
                                    resolve)
from precondfx.core.plan import ParamInfo, Plan


@dataclass
class SchemeContext:
    """What a scheme's data-driven step can see and touch."""

    model: Any                              # the rewritten model (a back end's)
    sample: Any                             # the calibration sample, as ``backend.run`` takes it
    graph: Graph
    plan: Plan                              # as planned: read it, do not change it
    applier: Any                            # the back end (``apply.backend.Backend``)
    opts: Options
    mode: str
    site_buffers: dict[str, str]            # node name -> its alpha buffer (fully qualified)
    say: Callable[[str], None] = lambda m: None
    forwards: int = 0                       # forward passes run through ``outputs``
    notes: list[str] = field(default_factory=list)
    measured: Measured = field(default_factory=Measured)   # what the step sets

    def outputs(self, names: list[str]) -> dict[str, Any]:
        """Outputs of the named nodes on the calibration batch (no grad, no side effects)."""
        self.forwards += 1
        return self.applier.probe_sample(self.sample, names, self.mode)

    def unreplaced(self, repl: list[tuple[str, Any, str]]) -> list[str]:
        """Nodes whose planned replacement module is not in the model (the back end's skipped
        list says why); a replacement the back end reported missed at one call site but that
        is in the model (a module called at several sites) is recorded as made."""
        missing = []
        for node, mod, path in repl:
            try:
                ok = self.model.get_submodule(path) is mod
            except AttributeError:
                ok = False
            if not ok:
                missing.append(node)
            elif self.applier.missed(f"replace:{node}"):
                self.applier.made_good(f"replace:{node}", None)
        return missing

    def buffer(self, node: str) -> Any | None:
        """The alpha buffer at a node's call site (None if none could be placed)."""
        name = self.site_buffers.get(node)
        return self.model.get_buffer(name) if name else None


class Scheme:
    """Base scheme: the core method of Defazio & Bottou (``scheme="geometric"``)."""

    name = "geometric"
    #: an alpha buffer at every weighted call site (LSUV scales call sites through them)
    needs_alpha_sites = False
    #: the module being rewritten, set by the pipeline before replacements() (e.g. to copy a
    #: BatchNorm's eps/momentum into its replacement)
    model: Any = None

    def overrides(self, opts: Options) -> list[Override]:
        """Option values this scheme replaces, each with why (e.g. a scheme that brings its own
        scales turns the alphas off); ``precondfx.core.options.resolve`` applies them and notes each
        change in the report.  ``opts`` are the user's options, already checked."""
        return []

    def plan(self, graph: Graph, plan: Plan, params: dict[str, ParamInfo], opts: Options
             ) -> None:
        """Change the plan before it is applied."""

    def replacements(self, graph: Graph, plan: Plan) -> list[tuple[str, Any, str]]:
        """(node, new module, path) swaps the applier makes before re-initialization."""
        return []

    def calibrate(self, ctx: SchemeContext) -> dict[str, Any]:
        """Data-driven step after re-initialization; returns the report section."""
        return {}


_REGISTRY: dict[str, Callable[[], Scheme]] = {"geometric": Scheme}


def register(name: str) -> Callable[[type], type]:
    """Class decorator adding a scheme to the registry (names are read in any case, as
    ``scheme=`` is: stored lowercase)."""
    def deco(cls: type) -> type:
        _REGISTRY[name.lower()] = cls
        return cls
    return deco


def scheme_class(name: str) -> Callable[..., Scheme]:
    """The registered scheme class of ``name`` (scheme modules register themselves when
    ``precondfx.schemes`` is imported: each front end imports it)."""
    key = name.lower() if isinstance(name, str) else name
    if key not in _REGISTRY:
        hint = did_you_mean(key, _REGISTRY, cutoff=0.6) if isinstance(key, str) else ""
        raise PrecondError(f"scheme={name!r} is not one of {sorted(_REGISTRY)}: pass one of "
                           f"these names{hint}")
    return _REGISTRY[key]


def get_scheme(name: str, **kwargs: Any) -> Scheme:
    """Instantiate a registered scheme by name: unknown ``scheme_options`` are refused here,
    their values by the scheme itself."""
    cls = scheme_class(name)
    init = getattr(cls, "__init__", object.__init__)
    params = {} if init is object.__init__ else inspect.signature(init).parameters
    known = [p for p in params if p != "self"]
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        bad = sorted(k for k in kwargs if k not in known)
        if bad:
            has = (f"its options are {known}" if known else
                   "it takes none (pass scheme_options=None)")
            hints = "".join(_option_hint(k, known, name) for k in bad)
            raise PrecondError(f"scheme_options {bad} are not options of scheme={name!r}: "
                               f"{has}{hints}")
    kwargs = {k: _as_default_kind(v, params[k].default if k in params else None)
              for k, v in kwargs.items()}
    for k, v in kwargs.items():
        p = params.get(k)
        if p is not None:
            _check_type(name, k, v, p.default)
    try:
        return cls(**kwargs)
    except PrecondError as e:               # the scheme's own check: it says what to pass
        raise PrecondError(f"scheme_options of scheme={name!r}: {e}") from e
    except (TypeError, ValueError) as e:    # a value the scheme cannot use
        raise PrecondError(f"scheme_options of scheme={name!r}: {type(e).__name__}: {e}; "
                           f"check the values' types against the scheme's options "
                           f"{known}") from e


def _option_hint(key: str, known: list[str], scheme: str) -> str:
    """What a refused scheme option ``key`` resembles: the closest option of ``scheme``, else
    the other schemes that take an option of that name."""
    others = []
    for other, cls in sorted(_REGISTRY.items()):
        init = getattr(cls, "__init__", object.__init__)
        if other != scheme and init is not object.__init__ and \
                key in inspect.signature(init).parameters:
            others.append(other)
    if others:
        return (f"; {key!r} is an option of scheme={others[0]!r}" if len(others) == 1 else
                f"; {key!r} is an option of the schemes {others}")
    close = did_you_mean(key, known) or did_you_mean(
        key, [k for k in known if key.startswith(k) or k.startswith(key)], cutoff=0.0)
    return f"; {key!r}{close}" if close else ""


def _as_default_kind(v: Any, default: Any) -> Any:
    """A scheme option's value read as the pass's options are: a 0-d tensor or array is the
    number it holds (``scalar``), a word of a lowercase string option in any case (``'Keep'``
    for ``alphas='none'``) is lowercase."""
    from precondfx.core.options import scalar
    v = scalar(v)
    if isinstance(v, str) and isinstance(default, str) and default == default.lower():
        return v.lower()
    return v


def _check_type(scheme: str, key: str, v: Any, default: Any) -> None:
    """A scheme option's value of the kind its default has (a number for a number, a bool for
    a bool, a string for a string); options defaulting to None take anything."""
    import numbers
    if default is inspect.Parameter.empty or default is None or v is None:
        return
    if isinstance(default, bool):
        ok, what = isinstance(v, bool), "True or False"
    elif isinstance(default, numbers.Integral):
        ok, what = isinstance(v, numbers.Integral) and not isinstance(v, bool), "an integer"
    elif isinstance(default, numbers.Real):
        ok, what = isinstance(v, numbers.Real) and not isinstance(v, bool), "a number"
    elif isinstance(default, str):
        ok, what = isinstance(v, str), "a string"
    else:
        return
    if not ok:
        raise PrecondError(f"scheme_options[{key!r}]={v!r} of scheme={scheme!r} must be {what} "
                           f"(its default is {default!r})")


def resolve_options(user: Options, *supports: Support) -> Resolved:
    """The user's options resolved once: the scheme they name (``get_scheme``) declares its
    overrides, then each back end its limits (``precondfx.core.options.resolve``)."""
    return resolve(user, *supports, scheme=get_scheme(user.scheme, **(user.scheme_options or {})))


def names() -> list[str]:
    """The registered scheme names."""
    return sorted(_REGISTRY)
