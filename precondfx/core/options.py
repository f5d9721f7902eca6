"""Every option of the pass, defined once: its default, its allowed values and its help text.

An option travels in three steps, the same for ``precondition``, ``analyze``,
``precondition_onnx``/``inspect_onnx`` and the command line:

1. :class:`Options` checks the user's values as given (``PrecondError`` naming the option, the
   value and what to pass instead), before any scheme or back end sees them.
2. :func:`resolve` applies the changes the scheme declares (``Scheme.overrides``) and the limits
   the back end declares (a :class:`Support`), each recorded as an :class:`OptionChange` whose note goes
   into the report.
3. The planner, the back ends and the calibration read the resolved, frozen options.

The CLI builds its flags from the field metadata here (``cli_flags``, ``from_text``), so a
default changed in this file changes everywhere.
"""
from __future__ import annotations

import difflib
import inspect
import math
import numbers
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Mapping

from precondfx.core import residual_schedule
from precondfx.errors import PrecondError

INIT_RULES = ("geometric", "fan_in", "fan_out", "xavier")
MAXPOOL_MODES = ("stride", "conv", "avgpool", "keep")
#: the strided convolution that replaces a max-pool which is not folded (precondfx.plan):
#: full C->C, depthwise (groups=C), or full C->C initialized as average pooling
POOL_CONVS = ("full", "depthwise", "avg")
BALANCE_MODES = ("auto", "none", "analytic", "hessian")
#: balance modes that measure Hessian blocks through the PyTorch model
MEASURED = ("hessian", "auto")
RESIDUAL_MODES = ("auto", "all", "none")
CALIBRATION_MODES = ("train", "eval")
CAPTURE_METHODS = ("fx", "export", "draft_export", "eager")
#: lr_scale values (precondfx.pytorch.lr_transfer): the optimizer the model will be trained with
LR_SCALE_MODES = ("sgd", "adam", "user")
#: lr_scale values taken out of the API, and why (the PrecondError says it)
LR_SCALE_REMOVED: dict[str, str] = {}
#: optimizer= values: the family whose learning rate ``lr=`` is (precondfx.pytorch.lr_target)
OPTIMIZERS = ("sgd", "adam", "adamw")
#: measured balancing keeps one statistic per sample and weight: beyond this many the standard
#: error (falling as 1/sqrt(n)) gains nothing a user needs, and the arrays grow without bound
MAX_BALANCE_SAMPLES = 4096
#: seeds are handed to torch and numpy generators: a non-negative 63-bit integer
SEED_MAX = 2 ** 63 - 1


# ---------------------------------------------------------------------------------------------
# checks: each returns the value to store (normalized) or raises PrecondError
# ---------------------------------------------------------------------------------------------
Check = Callable[[str, Any], Any]


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def scalar(v: Any) -> Any:
    """A one-element value as the Python number it holds: a 0-d torch tensor or numpy array
    (``torch.tensor(0.5)``, ``np.array(3)``) becomes ``0.5``/``3``, as numpy scalars already
    are numbers; anything else is returned as it is (the check then says what is wrong)."""
    if not isinstance(v, (str, bytes, bool, numbers.Number)) and getattr(v, "ndim", None) == 0 \
            and callable(getattr(v, "item", None)):
        try:
            return v.item()
        except (TypeError, ValueError, RuntimeError):
            return v
    return v


def word(v: Any, values: Iterable[Any]) -> Any:
    """``v`` as the word of ``values`` it names in any case (``'Fan_In'`` -> ``'fan_in'``,
    ``'AUTO'`` -> ``'auto'``): every option's words are lowercase, on the command line and in
    Python alike; anything else is returned as it is."""
    if isinstance(v, str):
        low = v.lower()
        for w in values:
            if isinstance(w, str) and w.lower() == low:
                return w
    return v


def one_of(*values: str) -> Check:
    def check(name: str, v: Any) -> str:
        v = word(v, values)
        if isinstance(v, str) and v in values:
            return v
        raise PrecondError(f"{name}={v!r} is not one of {values}: pass one of these strings"
                           f"{did_you_mean(v, values) if isinstance(v, str) else ''}")
    check.choices = values  # type: ignore[attr-defined]
    return check


def one_of_or_none(*values: str) -> Check:
    """One of ``values`` or None (the command line's 'none')."""
    def check(name: str, v: Any) -> str | None:
        v = word(v, values)
        if v is None or (isinstance(v, str) and v in values):
            return v
        raise PrecondError(f"{name}={v!r} is not one of {values} or None: pass one of these "
                           f"strings, or None")
    check.words = (None,) + values  # type: ignore[attr-defined]
    return check


def lr_scale_check() -> Check:
    """``lr_scale``: "auto", one of LR_SCALE_MODES or None; a removed value says why it was
    removed."""
    base = one_of_or_none("auto", *LR_SCALE_MODES)

    def check(name: str, v: Any) -> str | None:
        v = word(v, LR_SCALE_REMOVED)
        if isinstance(v, str) and v in LR_SCALE_REMOVED:
            raise PrecondError(f"{name}={v!r}: {LR_SCALE_REMOVED[v]} (or lr_scale='sgd' with "
                               f"SGD)")
        return base(name, v)
    check.words = base.words  # type: ignore[attr-defined]
    return check


def optimizer_family(name: str, v: Any) -> str | None:
    """``optimizer=``: one of OPTIMIZERS in any case, or a torch optimizer class or instance
    (SGD and its subclasses: 'sgd'; Adam, AdamW and their subclasses: 'adam'); stored as the
    string."""
    if v is None:
        return None
    if isinstance(v, str) and v.lower() in OPTIMIZERS:
        return v.lower()
    cls = v if isinstance(v, type) else type(v) if hasattr(v, "param_groups") else None
    if cls is not None:           # by name along the MRO: the core imports no framework
        for c in cls.__mro__:
            if c.__module__.startswith("torch.optim"):
                fam = {"SGD": "sgd", "Adam": "adam", "AdamW": "adam"}.get(c.__name__)
                if fam:
                    return fam
    shown = f"a {cls.__name__} optimizer" if cls is not None and cls is not v else repr(v)
    raise PrecondError(f"{name}={shown} is not an optimizer family lr= knows: pass 'sgd' "
                       f"(momentum included) or 'adam'/'adamw', or torch.optim.SGD / Adam / "
                       f"AdamW (the class or your optimizer); another optimizer's rate moves "
                       f"in its own way with the stored weight scale, so drop lr= and "
                       f"optimizer= for it")


optimizer_family.words = (None,) + OPTIMIZERS  # type: ignore[attr-defined]


def number(what: str, ok: Callable[[float], bool], words: tuple[Any, ...] = ()) -> Check:
    """A real number (not a bool, not a string) satisfying ``ok``, or one of ``words``."""
    def check(name: str, v: Any) -> Any:
        v = scalar(word(v, words))
        if (v is None and None in words) or (isinstance(v, str) and v in words):
            return v
        if _is_number(v) and math.isfinite(float(v)) and ok(float(v)):
            return float(v)
        alt = " or ".join(repr(w) for w in words)
        hint = (" (a string: pass the number itself)" if isinstance(v, str) else
                " (a bool is not a number)" if isinstance(v, bool) else "")
        raise PrecondError(f"{name}={v!r} must be {what}{' or ' + alt if alt else ''}{hint}")
    check.words = words  # type: ignore[attr-defined]
    return check


def integer(lo: int, hi: int | None = None) -> Check:
    def check(name: str, v: Any) -> int:
        v = scalar(v)
        if _is_int(v) and int(v) >= lo and (hi is None or int(v) <= hi):
            return int(v)
        rng = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        hint = (" (a bool is not an integer)" if isinstance(v, bool) else
                " (got a float: pass an int)" if isinstance(v, float) else "")
        raise PrecondError(f"{name}={v!r} must be {rng}{hint}")
    return check


def flag(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise PrecondError(f"{name}={v!r} must be True or False")


def output_key(name: str, v: Any) -> str | int | None:
    if v is None or isinstance(v, str) or _is_int(v):
        return v if v is None or isinstance(v, str) else int(v)
    raise PrecondError(f"{name}={v!r} must be None, an output name (str) or an index (int)")


def capture_methods(name: str, v: Any) -> tuple[str, ...]:
    v = word(v, CAPTURE_METHODS) if isinstance(v, str) else \
        [word(m, CAPTURE_METHODS) for m in v] if isinstance(v, (list, tuple)) else v
    ms = (v,) if isinstance(v, str) else tuple(v) if isinstance(v, (list, tuple)) else None
    if ms == ():
        raise PrecondError(f"{name}={v!r} is empty: pass one method of {CAPTURE_METHODS} or a "
                           f"list of them (or drop {name}= to try them all in turn)")
    bad = [m for m in ms or (v,) if m not in CAPTURE_METHODS]
    if ms is None or bad or not ms:
        raise PrecondError(f"{name}={bad or v!r} is not among {CAPTURE_METHODS}: pass one "
                           f"method or a list of them")
    twice = sorted({m for m in ms if ms.count(m) > 1})
    if twice:
        raise PrecondError(f"{name}={v!r} names {twice} more than once: each method is tried "
                           f"once, in the order given; list each one once")
    return ms


capture_methods.from_text = (  # type: ignore[attr-defined]
    lambda s: [w.strip() for w in s.split(",")] if "," in s else s.strip())


def text(name: str, v: Any) -> str:
    """A string (names checked against a registry later, e.g. the scheme's)."""
    if isinstance(v, str) and v:
        return v
    raise PrecondError(f"{name}={v!r} must be a name (a non-empty string)")


def scheme_name(name: str, v: Any) -> str:
    """A scheme's name, in any case (registered names are lowercase: ``'LSUV'`` is
    ``'lsuv'``); the registry checks it later (``precondfx.core.scheme.get_scheme``)."""
    return text(name, v).lower()


def mapping(name: str, v: Any) -> dict:
    if v is None:
        return {}
    if isinstance(v, Mapping) and all(isinstance(k, str) for k in v):
        return dict(v)
    raise PrecondError(f"{name}={v!r} must be a dict of keyword arguments (or None)")


def _text_value(s: str) -> Any:
    """A command-line value as Python reads it: true/false (any case) a bool, none None, an
    integer an int, a number a float, anything else the string."""
    low = s.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    return s


def key_value(name: str, s: str) -> tuple[str, Any]:
    """One ``KEY=VALUE`` item of a repeatable mapping flag (``--scheme-option eta=0.5``), the
    value read by :func:`_text_value`; the keys are checked where the API checks them."""
    key, eq, val = s.partition("=")
    if not eq or not key.strip() or not val.strip():
        raise PrecondError(f"{name} {s!r} must be KEY=VALUE (e.g. eta=0.5, delta=false): give "
                           f"one option per flag, repeating the flag for several")
    return key.strip(), _text_value(val.strip())


def from_pairs(name: str, pairs: Iterable[tuple[str, Any]] | None) -> dict | None:
    """The dict of a repeatable ``KEY=VALUE`` flag (None when not given); a key given twice is
    refused rather than one value silently winning."""
    if pairs is None:
        return None
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise PrecondError(f"{name} {k}= is given twice ({out[k]!r} and {v!r}): give each "
                               f"key once")
        out[k] = v
    return out


mapping.from_pairs = from_pairs  # type: ignore[attr-defined]


def _opt(default: Any, check: Check, help: str, *, cli: bool | str = False, plan: bool = True,
         keyword: str | None = None, cli_help: str | None = None,
         part_of: str | None = None) -> Any:
    """A field of :class:`Options`: ``plan`` (it shapes the plan and is stored in
    ``plan.options``), ``cli`` (the command line has a flag for it; a string is the flag's
    metavar), ``keyword`` (the public
    keyword argument, when it differs from the field name), ``cli_help`` (the flag's help when
    it must read differently, e.g. a ``--no-...`` flag says what turning it off does),
    ``part_of`` (the option it belongs to: no flag where that option has none)."""
    return field(default=default, metadata={"check": check, "help": help, "cli": cli,
                                            "plan": plan, "keyword": keyword,
                                            "cli_help": cli_help, "part_of": part_of})


# ---------------------------------------------------------------------------------------------
def fixed_lr(opts: Any) -> float | None:
    """The rate ``lr=`` names (a number), or None (``'auto'`` or off)."""
    v = getattr(opts, "lr", None)
    return None if v is None or v == "auto" else float(v)


def lr_auto(opts: Any) -> bool:
    """Whether ``lr='auto'`` acts: the geometric scheme (the others set their own constants
    from data), re-drawn weights (``reinit_weights=False`` keeps your weights, and your rate
    with them, as ``lr_scale='auto'`` does), and not ``lr_scale='sgd'`` (whose one SGD factor
    it would replace)."""
    return getattr(opts, "lr", None) == "auto" and getattr(opts, "scheme", None) == \
        "geometric" and getattr(opts, "lr_scale", None) != "sgd" and \
        getattr(opts, "reinit", True) is not False


@dataclass(frozen=True)
class Options:
    """Options of the pass (the public keyword arguments of ``precondition``); checked when
    built, frozen afterwards (use :func:`resolve` or ``dataclasses.replace`` to change one)."""

    init: str = _opt("geometric", one_of(*INIT_RULES, "keep"),
                     "weight initialization rule (Sec. 6; keep: leave the weight matrices; "
                     "biases still start at 0 and norm gains at 1, Sec. 6: "
                     "reinit_weights=False keeps every value)", cli=True)
    maxpool: str = _opt("stride", one_of(*MAXPOOL_MODES),
                        "max-pool replacement: fold the stride into the conv before it when "
                        "possible, else a strided conv (stride); always a conv; average pool; "
                        "keep", cli=True)
    pool_conv: str = _opt("full", one_of(*POOL_CONVS),
                          "the strided convolution that replaces a max-pool which is not "
                          "folded (maxpool='stride' or 'conv'): full (C->C, re-initialized by "
                          "the init rule), depthwise (one filter per channel, re-initialized), "
                          "avg (C->C, initialized as average pooling of the pool's geometry, "
                          "trained)", cli=True)
    balance: str = _opt("auto", one_of(*BALANCE_MODES),
                        "alpha constants: auto (PyTorch: measured where layers are out of "
                        "balance; ONNX: analytic), none, analytic (Sec. 5, App. E), hessian "
                        "(measured; PyTorch models only)", cli=True)
    balance_threshold: float = _opt(2.0, number("a number >= 1", lambda x: x >= 1.0),
                                    "balance='auto' changes the alphas only when the measured "
                                    "spread is significantly above this factor", cli="X")
    residual: str = _opt("auto", one_of(*RESIDUAL_MODES),
                         "branch scale s on residual joins (auto: branches without "
                         "normalization)", cli=True)
    residual_scale: float | str | tuple[float, ...] = _opt(
        "auto", residual_schedule.check,
        "branch scale s: a number in (0, 1], auto (1/sqrt(number of joins)), a named schedule "
        "('nf' or 'nf:<a>': s_l = a/sqrt(1+(l-1)a^2), the NF-ResNet schedule of Brock et al. "
        "2021, a=0.2 by default), or one value per residual join in execution order (on the "
        "command line comma-separated); a non-flat s adds App. E's per-block beta",
        cli="S")
    target_std: float | None = _opt(1.0, number("a positive number", lambda x: x > 0, (None,)),
                                    "output std after calibration (None, on the command "
                                    "line 'none': no output scale)", cli="STD")
    input_scale: float | str | None = _opt(None, number("a positive number", lambda x: x > 0,
                                                        (None, "auto")),
                                           "multiply the inputs by this, or 'auto' (Sec. 6.3)",
                                           cli="X")
    output_key: str | int | None = _opt(None, output_key,
                                        "output to scale (name or index; default 'logits' or "
                                        "the first floating-point output)", cli="KEY")
    lr_scale: str | None = _opt("auto", lr_scale_check(),
                                "function-preserving per-layer scales (output x c, weight and "
                                "bias / c): 'auto' (default: 'user' where the model declares "
                                "its init std, as a transformers config's initializer_range, "
                                "and precondfx would store the median weight at least 4x larger "
                                "than that; else off; precondfx.core.lr_mode), 'user' (for a "
                                "learning rate tuned for "
                                "your model's own init: every stored weight at the geometric "
                                "mean of precondfx's rms and the rms it had in your model), "
                                "'sgd' (every stored weight x 3/L, L the main-path depth: one "
                                "SGD rate across depths), 'adam' (every stored weight x "
                                "(128/width)^0.5 (3/L)^1.5 on top of 'auto', width the median "
                                "of the layers' fan-ins (fan-out where a layer reads the input): "
                                "one AdamW rate across widths and depths); None (on the command line 'none'): off "
                                "(precondfx.pytorch.lr_transfer, docs/results/lr_transfer_cpu.md)",
                                cli="OPT")
    lr: float | str | None = _opt(
        "auto", number("a positive learning rate", lambda x: x > 0, (None, "auto")),
        "the learning rate your training uses (with optimizer=): every re-drawn layer's stored "
        "weight and bias are divided by one factor c, its output multiplied by c (the same "
        "function), so that the rewritten model's curvature-suggested rate for that optimizer "
        "is this rate (precondfx.pytorch.lr_target; report.conditioning['lr_target']); "
        "measured on the sample: not on the meta device.  'auto' (default): a ceiling read "
        "from your optimizer at its first step() when it is torch.optim.SGD: above the "
        "suggested SGD rate, what lr= does with its peak rate; at or below it, and for "
        "Adam-family optimizers, the storage lr_scale chose (precondfx.pytorch.first_step); "
        "None: off", cli="RATE",
        cli_help="the learning rate your training uses, with --optimizer (PyTorch models: each "
        "re-drawn layer's stored weight and bias / c, its output x c, so that the suggested "
        "rate for that optimizer is this rate); 'auto': set at a torch.optim.SGD "
        "optimizer's first step(), which a saved file has not reached; 'none': off")
    optimizer: str | None = _opt(None, optimizer_family,
                                 "the optimizer family lr= is a rate of: 'sgd' (momentum "
                                 "included) or 'adam'/'adamw'; required with lr=, read only "
                                 "with it", cli="NAME", part_of="lr")
    seed: int = _opt(0, integer(0, SEED_MAX), "seed of the re-initialization", cli="N")
    reinit: bool = _opt(True, flag, "re-initialize the weights; reinit_weights=False "
                        "(--no-reinit) keeps them, divided by their alpha, and only inserts "
                        "constants", cli=True, keyword="reinit_weights",
                        cli_help="keep the model's weights instead of re-initializing them: "
                        "each is divided by its alpha (the function is unchanged) and only the "
                        "constants are inserted (reinit_weights=False)")
    scheme: str = _opt("geometric", scheme_name, "initialization scheme (geometric, lsuv, gne, wn, "
                       "tat, dks); its name and scheme_options are checked by the scheme "
                       "registry (precondfx.core.scheme.get_scheme)", cli="NAME")
    scheme_options: dict | None = _opt(None, mapping, "keyword arguments of the scheme (on the "
                                       "command line --scheme-option KEY=VALUE, repeated: "
                                       "true/false, none and numbers are read as such)",
                                       plan=False, cli="KEY=VALUE", part_of="scheme")
    balance_samples: int = _opt(16, integer(1, MAX_BALANCE_SAMPLES),
                                "samples measured by measured balancing and measure=True (at "
                                "most 4096)", plan=False, cli="N")
    measure: bool = _opt(False, flag, "measure the conditioning before and after",
                         plan=False, cli=True)
    suggest_lr: bool = _opt(False, flag, "suggest SGD and Adam learning rates from the "
                            "rewritten model's curvature on the sample (report.suggested_lr; "
                            "precondfx.pytorch.measure.suggest)", plan=False, cli=True)
    calibration: str = _opt("train", one_of(*CALIBRATION_MODES),
                            "mode the model runs in for calibration", plan=False, cli=True)
    capture: tuple[str, ...] = _opt(CAPTURE_METHODS, capture_methods,
                                    "capture methods, tried in order (on the command line "
                                    "comma-separated: fx,eager)", plan=False, cli="METHODS")

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](keyword_of(f), getattr(self,
                                                                                     f.name)))
        if self.lr == "auto" and self.optimizer is not None:
            raise PrecondError(
                f"optimizer={self.optimizer!r} without lr=: optimizer= says which optimizer's "
                f"rate lr= is; pass lr= your rate with it, or drop optimizer= (by default, "
                f"lr='auto' reads both from your optimizer at its first step)")
        if self.lr == "auto":
            pass
        elif (self.lr is None) != (self.optimizer is None):
            raise PrecondError(
                "lr= and optimizer= go together: lr= is the learning rate your training uses "
                "and optimizer= ('sgd' or 'adam') says which optimizer's rate it is (an SGD "
                "rate and an Adam rate move differently with the stored weight scale); got "
                f"lr={self.lr!r}, optimizer={self.optimizer!r}")
        if fixed_lr(self) is not None and self.scheme != "geometric":
            raise PrecondError(f"lr= works with scheme='geometric' (scheme={self.scheme!r} "
                               f"sets its own per-layer constants from data after the plan): "
                               f"drop lr= or use the geometric scheme")
        if fixed_lr(self) is not None and self.lr_scale == "sgd":
            raise PrecondError(
                "lr_scale='sgd' with lr=: both set the one factor every layer's stored weights "
                "share (lr_scale='sgd': 3/depth; lr=: the factor that puts the suggested rate on "
                "your rate), and lr= decides it, so lr_scale='sgd' would change nothing: drop "
                "lr_scale (or drop lr= and optimizer= to train at a rate of your own)")
        if self.lr_scale not in (None, "auto") and self.scheme != "geometric":
            raise PrecondError(f"lr_scale= works with scheme='geometric' (scheme={self.scheme!r} "
                               f"sets its own per-layer constants from data after the plan): "
                               f"drop lr_scale or use the geometric scheme")

    @classmethod
    def from_keywords(cls, **kwargs: Any) -> "Options":
        """Options from the public keyword names (``reinit_weights`` for ``reinit``)."""
        names = {keyword_of(f): f.name for f in fields(cls)}
        bad = sorted(k for k in kwargs if k not in names)
        if bad:
            hints = "; ".join(f"{k!r}{did_you_mean(k, names)}" for k in bad)
            raise PrecondError(f"unknown option(s) {hints}: the options are {sorted(names)}")
        return cls(**{names[k]: v for k, v in kwargs.items()})

    def validate(self) -> None:
        """Kept for callers of the old API: the values were checked when built."""

    def planned(self) -> dict[str, Any]:
        """The options that shape the plan (stored in ``plan.options``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["plan"]}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def keyword_of(f: Any) -> str:
    return f.metadata["keyword"] or f.name


def option_names() -> list[str]:
    """The public keyword names of the options."""
    return [keyword_of(f) for f in fields(Options)]


def did_you_mean(word: str, names: Iterable[str], cutoff: float = 0.75) -> str:
    """' (did you mean 'balance'?)' for the name closest to ``word`` (difflib), '' when none
    is close; an option's field name whose keyword differs names that keyword (``reinit`` ->
    ``reinit_weights``, not the closer ``init``)."""
    names = list(names)
    alias = {f.name: keyword_of(f) for f in fields(Options) if keyword_of(f) != f.name}
    if alias.get(word) in names:
        return f" (did you mean {alias[word]!r}?)"
    close = difflib.get_close_matches(word, list(names), n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _forward_parameters(model: Any) -> tuple[set[str], bool, str]:
    """The keyword names the model's forward takes, whether it takes ``**kwargs``, and how to
    call it in a message (``Net.forward(x, mask=None)``).  A forward without a readable
    signature takes anything."""
    fwd = getattr(model, "forward", None)
    what = f"{type(model).__name__}.forward"
    try:
        sig = inspect.signature(fwd)
    except (TypeError, ValueError):
        return set(), True, what
    names = {n for n, p in sig.parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    return names, var, f"{what}{sig}"


def split_keywords(model: Any, keywords: Mapping[str, Any], forward_kwargs: Any,
                   options: Iterable[str], entry: str = "precondition"
                   ) -> dict[str, Any]:
    """The forward keywords of a public call: ``forward_kwargs`` (a dict, given explicitly,
    passed as they are) and the extra ``keywords`` that name a parameter of the model's
    forward.  An extra keyword that is not a parameter of the forward, or that is close to an
    option's name (``balnce``, ``targetstd``) when the forward only takes ``**kwargs``, is a
    PrecondError saying which option was meant; a forward keyword spelled like an option goes
    in ``forward_kwargs={...}``."""
    explicit = mapping("forward_kwargs", forward_kwargs)
    names, var, sig = _forward_parameters(getattr(model, "_orig_mod", model))
    opts = list(options)
    out = dict(explicit)
    for k, v in keywords.items():
        hint = did_you_mean(k, opts)
        if k in explicit:
            raise PrecondError(
                f"{entry}() got the forward keyword {k!r} twice, as {k}= and in "
                f"forward_kwargs: pass it once, in either place")
        if k in names or (var and not hint):
            out[k] = v
            continue
        if hint:
            raise PrecondError(
                f"{entry}() got an unknown option {k!r}{hint}: fix the option's name (the "
                f"options are {sorted(opts)}); a keyword meant for the model's forward goes in "
                f"forward_kwargs={{{k!r}: ...}}")
        raise PrecondError(
            f"{entry}() got an unknown keyword {k!r}: it is not an option (the options are "
            f"{sorted(opts)}) and not a parameter of {sig}; fix its name, or give keywords "
            f"for the model's forward in forward_kwargs={{...}}")
    return out


#: the defaults, for the signatures of the public functions (one place holds them)
DEFAULTS = Options.__new__(Options)
for _f in fields(Options):
    object.__setattr__(DEFAULTS, _f.name, _f.default)


# ---------------------------------------------------------------------------------------------
# resolution: scheme overrides and back-end limits, each a recorded change
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OptionChange:
    """One option changed during resolution, and why (a note in the report)."""

    option: str
    old: Any
    new: Any
    by: str
    why: str

    def note(self) -> str:
        return f"{self.option}={self.old!r} -> {self.new!r} ({self.by}): {self.why}"


@dataclass(frozen=True)
class Override:
    """What a scheme or a back end declares: set ``option`` to ``value`` (``REFUSE``: raise a
    PrecondError with ``why`` instead)."""

    option: str
    value: Any
    why: str


REFUSE = object()


@dataclass(frozen=True)
class Rule:
    """A back-end limit: when ``applies(value)`` of ``option``, use ``value`` or refuse."""

    option: str
    applies: Callable[[Any], bool]
    value: Any
    why: str


@dataclass(frozen=True)
class Support:
    """What a back end can do, as rules on option values (everything else is supported)."""

    name: str
    rules: tuple[Rule, ...] = ()

    def refuses(self, option: str, value: Any) -> bool:
        """Whether this back end refuses ``value`` for ``option``."""
        return any(r.option == option and r.value is REFUSE and r.applies(value)
                   for r in self.rules)

    def overrides(self, opts: Options) -> list[Override]:
        return [Override(r.option, r.value, r.why) for r in self.rules
                if r.applies(getattr(opts, r.option))]


@dataclass(frozen=True)
class Resolved:
    """The options the pipeline runs with, the user's as given, and every change made."""

    options: Options
    user: Options
    changes: tuple[OptionChange, ...]
    scheme: Any = None

    def notes(self) -> list[str]:
        """The changes worth saying (a rule with no why turns off a default that cannot apply
        and is not news: ``lr='auto'`` for an ONNX file, which precondfx does not train)."""
        return [c.note() for c in self.changes if c.why]


def apply_overrides(opts: Options, overrides: Iterable[Override], by: str
                    ) -> tuple[Options, list[OptionChange]]:
    """``opts`` with ``overrides`` applied (a refusal raises), and the changes made."""
    changes = []
    for o in overrides:
        old = getattr(opts, o.option)
        if o.value is REFUSE:
            raise PrecondError(o.why)
        if old == o.value and type(old) is type(o.value):
            continue
        opts = replace(opts, **{o.option: o.value})
        changes.append(OptionChange(o.option, old, o.value, by, o.why))
    return opts, changes


def resolve(user: Options, *supports: Support, scheme: Any = None) -> Resolved:
    """The one resolution step: the declared overrides of ``scheme`` (an object with
    ``overrides(opts)``, see ``precondfx.core.scheme.resolve_options``), then each back end's
    limits, in order."""
    overrides = scheme.overrides(user) if scheme is not None else []
    opts, changes = apply_overrides(user, overrides, f"scheme {user.scheme}")
    for sup in supports:
        opts, more = apply_overrides(opts, sup.overrides(opts), sup.name)
        changes += more
    return Resolved(opts, user, tuple(changes), scheme)


def moot(user: Options, opts: Options) -> list[str]:
    """A note for each option the user set (a value other than the default) that the other
    resolved options leave without effect, so that no option is ignored silently (e.g.
    ``pool_conv`` with ``maxpool='keep'``, ``balance_threshold`` with ``balance='none'``)."""
    rules = (
        ("pool_conv", opts.maxpool in ("keep", "avgpool"),
         f"maxpool={opts.maxpool!r} replaces no max-pool by a convolution"),
        ("balance_threshold", opts.balance not in MEASURED,
         f"it is read by measured balancing (balance='auto' or 'hessian') only "
         f"(balance={opts.balance!r})"),
        ("residual_scale", opts.residual == "none",
         "residual='none' scales no residual branch"),
        ("init", opts.init == "keep" and not opts.reinit,
         "reinit_weights=False keeps every value as it is, biases and normalization gains "
         "included (init='keep' alone would start those at 0 and 1): drop init='keep', or "
         "drop reinit_weights=False to keep only the weight matrices"),
        ("balance_samples", opts.balance not in MEASURED and not opts.measure,
         f"it is read by measured balancing (balance='auto' or 'hessian') and measure=True "
         f"only (balance={opts.balance!r})"),
        ("output_key", opts.target_std is None and not _output_read(opts),
         f"target_std=None places no output scale, and nothing else here reads the main "
         f"output (measured balancing, measure=True, suggest_lr=True, lr=; "
         f"balance={opts.balance!r}): pass target_std= to scale the output it names, or "
         f"drop output_key"),
    )
    out = []
    for name, idle, why in rules:
        f = next(f for f in fields(Options) if f.name == name)
        given = getattr(user, name)
        if idle and given != f.default:
            out.append(f"{keyword_of(f)}={given!r} has no effect: {why}")
    if opts.target_std is None and user.output_key is not None and _output_read(opts):
        out.append(f"output_key={user.output_key!r} scales no output (target_std=None): it "
                   f"only picks the output that the measurements (measured balancing, "
                   f"measure=, suggest_lr=, lr=) differentiate; pass target_std= to scale it")
    return out


def _output_read(opts: Options) -> bool:
    """Whether a stage other than the output scale reads the main output (``output_key``)."""
    return opts.balance in MEASURED or opts.measure or opts.suggest_lr or \
        fixed_lr(opts) is not None or lr_auto(opts)


# ---------------------------------------------------------------------------------------------
# the command line: flags built from the same fields
# ---------------------------------------------------------------------------------------------
_TEXT_WORDS = {"none": None, "off": None}


def from_text(name: str, s: str) -> Any:
    """Parse a command-line value of option ``name`` and check it (PrecondError if bad); a
    mapping option's flag gives one ``(key, value)`` item (:func:`cli_value` makes the dict)."""
    f = next(f for f in fields(Options) if f.name == name)
    check = f.metadata["check"]
    if check is mapping:                                  # one KEY=VALUE item of its flag
        return key_value(flag_of(f), s)
    if getattr(check, "from_text", None) is not None:     # the option parses its own text
        return check(keyword_of(f), check.from_text(s))
    v: Any = s
    if s.lower() in _TEXT_WORDS and None in getattr(check, "words", ()):
        v = None
    elif getattr(check, "choices", None) is None and s.lower() not in getattr(check, "words", ()):
        for conv in (int, float):
            try:
                v = conv(s)
                break
            except ValueError:
                pass
    elif s.lower() in getattr(check, "words", ()):
        v = s.lower()
    return check(keyword_of(f), v)


def _lower(s: str) -> str:
    """A command-line word in any case, as ``Options`` reads it (``--init Fan_In``)."""
    return s.lower()


def flag_of(f: Any) -> str:
    """The command-line flag of field ``f`` (``--balance-threshold``, ``--no-reinit``; a
    mapping is given one item per flag: ``--scheme-option KEY=VALUE``)."""
    dashed = f.name.replace("_", "-")
    if isinstance(f.default, bool):
        return f"--{'no-' if f.default else ''}{dashed}"
    if f.metadata["check"] is mapping:
        return f"--{dashed.removesuffix('s')}"
    return f"--{dashed}"


def cli_value(f: Any, v: Any) -> Any:
    """A parsed flag's value as the option takes it (a mapping flag's KEY=VALUE items as a
    dict)."""
    conv = getattr(f.metadata["check"], "from_pairs", None)
    return conv(flag_of(f), v) if conv is not None else v


def cli_fields() -> list[Any]:
    """The fields the command line has flags for, in definition order."""
    return [f for f in fields(Options) if f.metadata["cli"]]


def _only_default(f: Any, support: Support) -> bool:
    """Whether ``support`` refuses every value of field ``f`` but its default: any value
    outside the option's words (a value no rule names) and each of its words."""
    check, kw = f.metadata["check"], keyword_of(f)
    if isinstance(f.default, bool):
        return support.refuses(kw, not f.default)
    # the default, and what the back end turns it into (lr='auto' -> None for ONNX files)
    same = [f.default] + [r.value for r in support.rules if r.option == kw and
                          r.value is not REFUSE and r.applies(f.default)]
    words = [w for w in (getattr(check, "choices", None) or getattr(check, "words", ()))
             if not any(w == d and type(w) is type(d) for d in same)]
    other = None if getattr(check, "choices", None) else object()
    try:
        return (other is None or support.refuses(kw, other)) and \
            all(support.refuses(kw, w) for w in words)
    except Exception:      # a rule that cannot read an unknown value: keep the flag
        return False


def cli_flags(add_argument: Callable[..., Any], only: Iterable[str] | None = None,
              parse: Callable[[str, str], Any] = from_text,
              support: Support | None = None) -> None:
    """Add a flag per CLI option through ``add_argument`` (argparse's); each flag's dest is the
    public keyword name and its default is :data:`DEFAULTS`'s value.  ``parse(name, text)``
    converts a value (raise ``argparse.ArgumentTypeError`` for a bad one).  ``support``: the
    only back end the command runs on; the choices it refuses are not offered, nor a flag
    whose every value but the default it refuses (``inspect``'s ``--scheme``)."""
    hidden: set[str] = set()
    for f in cli_fields():
        if only is not None and f.name not in only:
            continue
        kw, default = keyword_of(f), f.default
        if support is not None and _only_default(f, support) or \
                f.metadata["part_of"] in hidden:
            hidden.add(f.name)
            continue
        help = f.metadata.get("cli_help") or f.metadata["help"]
        if isinstance(default, bool):
            add_argument(flag_of(f), dest=kw, action="store_false" if default else "store_true",
                         default=default, help=help)
            continue
        if f.metadata["check"] is mapping:
            add_argument(flag_of(f), dest=kw, action="append", default=None,
                         metavar=f.metadata["cli"], help=f"{help} (repeatable)",
                         type=lambda s, _n=f.name: parse(_n, s))
            continue
        choices = getattr(f.metadata["check"], "choices", None)
        if choices and support is not None:
            choices = tuple(c for c in choices if not support.refuses(kw, c))
        meta = f.metadata["cli"]
        extra: dict[str, Any] = {"choices": choices, "type": _lower} if choices else {
            "type": (lambda s, _n=f.name: parse(_n, s)),
            "metavar": meta if isinstance(meta, str) else f.name.upper()}
        add_argument(flag_of(f), dest=kw, default=default,
                     help=f"{help} (default {default!r})", **extra)

