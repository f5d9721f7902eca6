"""The residual branch scales ``s_l`` (App. E): what ``residual_scale`` accepts, and the value
of ``s`` at each residual join.

``residual_scale`` is one of

* a number in (0, 1]: the same ``s`` at every join (flat);
* ``"auto"``: flat ``s = 1/sqrt(N)``, N the number of residual joins (the stream's variance
  growth ``(1+s^2)^N`` stays below e);
* ``"nf"`` or ``"nf:<a>"`` (a > 0, default 0.2): the depth-decaying schedule of
  normalization-free ResNets (Brock, De & Smith, "Characterizing signal propagation to close
  the performance gap in unnormalized ResNets", ICLR 2021, Sec. 3).  An NF-ResNet block computes
  ``h_{l+1} = h_l + a f_l(h_l / beta_l)`` with ``beta_l = sqrt(Var h_l)`` and
  ``Var h_l = 1 + (l-1) a^2``, so its branch enters the stream at
  ``s_l = a / sqrt(1 + (l-1) a^2)`` relative to the stream; here (branch variance preserving,
  geometric init) that is the same schedule, and ``prod (1 + s_l^2) = 1 + N a^2`` is the
  NF-ResNet's linear variance growth.  ``nf:1`` gives ``s_l = 1/sqrt(l)``;
* a sequence of numbers in (0, 1], one per residual join in execution order.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

from precondfx.errors import PrecondError

#: the named schedules and their parameter's default
NAMED = {"nf": 0.2}
WORDS = ("auto",) + tuple(NAMED)


def _real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))


def _named(v: str) -> tuple[str, float] | None:
    """``("nf", a)`` for ``"nf"`` / ``"nf:<a>"`` (a > 0), else None."""
    name, _, arg = v.partition(":")
    if name not in NAMED:
        return None
    if not arg:
        return name, NAMED[name]
    try:
        a = float(arg)
    except ValueError:
        return None
    return (name, a) if math.isfinite(a) and a > 0 else None


def check(name: str, v: Any) -> Any:
    """The ``residual_scale`` option's check: the value to store (a float, 'auto', a named
    schedule string, or a tuple of floats), else a PrecondError saying what to pass.  Words are
    read in any case ('AUTO', 'NF:0.3'), as every option's words are."""
    if isinstance(v, str) and (v.lower() == "auto" or _named(v.lower())):
        v = v.lower()
    if isinstance(v, str) and (v == "auto" or _named(v)):
        return v
    if not isinstance(v, (str, bytes)) and callable(getattr(v, "tolist", None)) and \
            getattr(v, "ndim", 1) <= 1:
        v = v.tolist()          # a numpy array or tensor of values: the same as a list
    if _real(v) and 0 < float(v) <= 1:
        return float(v)
    if isinstance(v, (list, tuple)) and v and all(_real(x) and 0 < float(x) <= 1 for x in v):
        return tuple(float(x) for x in v)
    hint = (" (in 'nf:<a>', a must be a positive number, e.g. 'nf:0.2')"
            if isinstance(v, str) and v.lower().startswith("nf") else
            " (a string: pass the number itself)" if isinstance(v, str) else
            " (a bool is not a number)" if isinstance(v, bool) else
            " (a sequence needs one value in (0, 1] per residual join)"
            if isinstance(v, (list, tuple)) else "")
    raise PrecondError(f"{name}={v!r} must be a number in (0, 1], 'auto', a named schedule "
                       f"('nf' or 'nf:<a>', a > 0), or a sequence of numbers in (0, 1] with one "
                       f"value per residual join{hint}")


def from_text(s: str) -> Any:
    """A command-line value: a number, a word, or comma-separated numbers (a sequence)."""
    parts = [p.strip() for p in s.split(",")]
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        return s.lower()
    return nums[0] if len(nums) == 1 else tuple(nums)


check.words = WORDS  # type: ignore[attr-defined]
check.from_text = from_text  # type: ignore[attr-defined]


def is_flat(spec: Any) -> bool:
    """Whether ``spec`` gives every join the same ``s`` (a number or 'auto')."""
    return not isinstance(spec, (str, tuple, list)) or spec == "auto"


def values(spec: Any, n_joins: int, joins: Sequence[str] = ()) -> list[float]:
    """``s`` at each of the ``n_joins`` residual joins (execution order); a sequence of the
    wrong length is a PrecondError naming the joins (``joins``)."""
    if isinstance(spec, (tuple, list)):
        if not n_joins:     # no join to scale: said as for one number (has no effect)
            return []
        if len(spec) != n_joins:
            shown = ", ".join(joins[:8]) + (", ..." if len(joins) > 8 else "")
            raise PrecondError(f"residual_scale has {len(spec)} values, but the model has "
                               f"{n_joins} residual joins ({shown}): pass {n_joins} values, "
                               f"one per join in execution order, or one number")
        return [float(x) for x in spec]
    if spec == "auto":
        return [1.0 / math.sqrt(n_joins)] * n_joins if n_joins else []
    if isinstance(spec, str):
        _, a = _named(spec) or ("nf", NAMED["nf"])
        return [a / math.sqrt(1.0 + (l - 1) * a * a) for l in range(1, n_joins + 1)]
    return [float(spec)] * n_joins


def describe(spec: Any, n_joins: int) -> str:
    """Where the ``s`` values come from, for the plan's reasons."""
    if isinstance(spec, (tuple, list)):
        return "branch scale s_l from the residual_scale sequence (App. E)"
    if spec == "auto":
        return (f"branch scale s = 1/sqrt({n_joins} residual joins) keeps the stream's variance "
                f"growth (1+s^2)^N below e (App. E)")
    if isinstance(spec, str):
        a = (_named(spec) or ("nf", NAMED["nf"]))[1]
        return (f"branch scale s_l = a/sqrt(1+(l-1)a^2), a={a:g}: the NF-ResNet schedule "
                f"(Brock et al. 2021), variance growth 1+N a^2 (App. E)")
    return "branch scale s from residual_scale (App. E)"
