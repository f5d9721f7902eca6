"""The ``precondfx`` command line (also ``python -m precondfx``).

    precondfx demo [--model maxpool_cnn]
    precondfx inspect model.onnx [--all] [--report report.json]
    precondfx precondition model.onnx -o out.onnx [--calib batch.npz] [options]
    precondfx precondition mypkg.models:build --sample-shape 8x3x32x32 -o out.pt|out.onnx

Exit codes: 0 success; 2 a usage or input error (one line on stderr, no traceback); 1 an
internal error (the traceback is shown: please report it).  Progress lines go to stderr and
``--quiet`` silences them; the report table goes to stdout.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io as _io
import json
import os
import sys
import time
import traceback
import warnings
from typing import Any, Sequence

PROG = "precondfx"


class UsageError(Exception):
    """A bad command line (exit code 2)."""


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    if isinstance(e, FileNotFoundError) and getattr(e, "filename", None) and e.filename not in msg:
        msg = f"{msg}: {e.filename}"
    return msg or type(e).__name__


#: top-level module -> the extra that installs it
_EXTRAS = {"onnx": "onnx", "onnxruntime": "onnx", "onnx_ir": "onnx", "onnxscript": "onnx",
           "matplotlib": "plot", "transformers": "models"}


def _missing_extra(e: ImportError) -> str | None:
    """One line naming the extra to install for a missing optional dependency (None when the
    missing module is not an optional dependency of precondfx)."""
    from precondfx._deps import REQUIRED, required_message
    name = (getattr(e, "name", None) or "").split(".")[0]
    if name in REQUIRED:
        return required_message([name])
    if name in _EXTRAS:
        extra = _EXTRAS[name]
        return (f"this needs the optional dependency {name!r}, which is not installed: "
                f"pip install 'precondfx[{extra}]'")
    if name and not name.startswith("precondfx") and isinstance(e, ModuleNotFoundError):
        return f"module {name!r} is not installed (imported by the model's code): install it"
    return None


def _is_oom(e: BaseException) -> bool:
    """torch's allocation failures: ``torch.OutOfMemoryError`` on accelerators, a RuntimeError
    from the CPU allocator."""
    msg = str(e)
    return (type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in msg
            or "out of memory" in msg.lower())


def _out_of_memory(e: BaseException) -> str:
    detail = " ".join(str(e).split())
    detail = detail[detail.find("can't allocate"):] if "can't allocate" in detail else detail
    detail = detail[:120]
    return (f"out of memory{f' ({detail})' if detail else ''}: use a smaller --batch or "
            f"--sample-shape, or a machine with more memory")


def _err(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)


def _quiet_onnxruntime() -> None:
    """Keep onnxruntime's own (coloured) log lines out of the output: its sessions are created
    with log severity ERROR by precondfx, and the process-wide default logger (messages logged
    before a session exists, e.g. device discovery) is set to ERROR here."""
    try:
        import onnxruntime as ort
    except ImportError:
        return
    ort.set_default_logger_severity(3)


def _show_warnings() -> None:
    """precondfx's own warnings (an output scale not applied, a scale beyond 1e-4..1e4) as one
    ``precondfx: warning:`` line on stderr, without Python's file/line/source echo; other
    libraries' warnings keep Python's format."""
    default = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
             line: Any = None) -> None:
        text = str(message)
        if text.startswith(f"{PROG}: "):
            print(f"{PROG}: warning: {' '.join(text[len(PROG) + 2:].split())}",
                  file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)
    warnings.showwarning = show


def _note(msg: str) -> None:
    print(f"{PROG}: note: {msg}", file=sys.stderr)


class _Progress:
    """Stage lines with elapsed seconds on stderr (silent with --quiet)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.t0 = time.perf_counter()

    def __call__(self, stage: str, elapsed: float | None = None) -> None:
        if self.quiet:
            return
        t = time.perf_counter() - self.t0 if elapsed is None else elapsed
        print(f"[{PROG} {t:7.2f}s] {stage}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------------------------
def _shape(s: str) -> tuple[int, ...]:
    try:
        # every field a number: '16xx20' or 'x16' is a typo (a dim left out), not 16x20 or 16
        dims = tuple(int(x) for x in s.strip().lower().replace(",", "x").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a shape like 8x3x32x32, got {s!r}")
    if not dims or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"expected a shape like 8x3x32x32, got {s!r}")
    return dims


def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def _option_value(name: str, s: str) -> Any:
    """A command-line value of a pass option, parsed and checked by its definition."""
    from precondfx.errors import PrecondError
    from precondfx.core.options import from_text
    try:
        return from_text(name, s)
    except PrecondError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _plan_options(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None,
                  onnx_only: bool = False) -> None:
    """The pass options, built from their one definition (``precondfx.core.options.Options``);
    ``onnx_only``: a command that reads only ONNX files offers only the values the ONNX back
    end accepts (no ``--balance hessian``)."""
    from precondfx.core.options import cli_flags
    support = None
    if onnx_only:
        try:
            from precondfx.onnx.pipeline import ONNX as support
        except ImportError:    # without the onnx extra, the command says so when it runs
            support = None
    g = p.add_argument_group("preconditioning options (as precondfx.precondition)")
    cli_flags(g.add_argument, only, _option_value, support)


def _plan_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The pass options given on the command line, by their public keyword names."""
    from precondfx.core.options import cli_fields, cli_value, keyword_of
    return {keyword_of(f): cli_value(f, getattr(args, keyword_of(f))) for f in cli_fields()
            if hasattr(args, keyword_of(f))}


def _calib_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("calibration data")
    g.add_argument("--calib", metavar="FILE",
                   help=".npy (single-input model) or .npz (keys: input names, or arr_0, "
                        "arr_1... in input order)")
    g.add_argument("--calib-input", action="append", default=[], metavar="NAME=FILE",
                   help="one input's data from an .npy file (repeatable)")
    g.add_argument("--dim", action="append", default=[], metavar="SYMBOL=N",
                   help="size of a symbolic dim for generated inputs (repeatable)")
    g.add_argument("--batch", type=_positive, default=None, metavar="N",
                   help="size of a symbolic leading dim for generated inputs (default 32; "
                        "inspect: 1)")


def build_parser() -> argparse.ArgumentParser:
    from precondfx import __version__
    p = argparse.ArgumentParser(
        prog=PROG, description="Rewrite a neural network before training so that it starts "
        "well conditioned (Defazio & Bottou), for ONNX files and PyTorch models.",
        allow_abbrev=False)
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    d = sub.add_parser("demo", allow_abbrev=False,
                       help="precondition a built-in model and print the report",
                       description="Build a small model from precondfx.demo, run "
                                   "precondfx.precondition on it and print the report.")
    from precondfx.demo import DEMOS
    d.add_argument("--model", default="maxpool_cnn", choices=tuple(DEMOS), type=str.lower,
                   help="built-in model (default maxpool_cnn)")
    _plan_options(d, only=("seed", "balance"))
    d.add_argument("--all", action="store_true", help="show structural nodes too")
    d.add_argument("--quiet", action="store_true", help="no progress lines")
    d.set_defaults(func=cmd_demo)

    i = sub.add_parser("inspect", allow_abbrev=False,
                       help="classify an ONNX model's nodes and show the plan",
                       description="Classify every node of an ONNX model and show what "
                                   "'precondition' would do; nothing is written.")
    i.add_argument("model", metavar="IN.onnx")
    i.add_argument("--all", action="store_true", help="show structural nodes too")
    i.add_argument("--report", metavar="FILE", help="write the report as JSON")
    i.add_argument("--dim", action="append", default=[], metavar="SYMBOL=N",
                   help="size of a symbolic dim (repeatable)")
    i.add_argument("--batch", type=_positive, default=None, metavar="N",
                   help="size of a symbolic leading dim (default 1)")
    i.add_argument("--quiet", action="store_true")
    _plan_options(i, onnx_only=True)
    i.set_defaults(func=cmd_inspect)

    c = sub.add_parser("precondition", allow_abbrev=False,
                       help="rewrite an ONNX file or a PyTorch model",
                       description="Rewrite IN (an .onnx file, or module:callable building a "
                                   "PyTorch model) and write the result to -o OUT.")
    c.add_argument("model", metavar="IN", help="model.onnx, or module:callable (returns a "
                   "torch module, or (module, sample))")
    c.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="output .onnx (ONNX input or PyTorch export) or .pt (state_dict)")
    c.add_argument("--sample-shape", action="append", type=_shape, default=[], metavar="SHAPE",
                   help="PyTorch models: random sample of this shape, e.g. 8x3x32x32 "
                        "(repeat for several inputs)")
    c.add_argument("--external-data", default="auto", choices=("auto", "always", "never"),
                   help="ONNX input files: weights in OUT.data, or OUT.<hex>.data when the "
                        "file at OUT reads OUT.data (auto: as the input, or above 1.8 GB)")
    c.add_argument("--no-verify", action="store_true",
                   help="ONNX: skip the onnxruntime run of the written file (for ops onnxruntime "
                        "has no kernel for; use with --target-std none, as calibration runs it "
                        "too)")
    c.add_argument("--plot", metavar="PNG", help="PyTorch models: PNG plots of the measured per-layer Hessian "
                   "statistic (runs precondition with measure=True)")
    c.add_argument("--report", metavar="FILE", help="write the report as JSON")
    c.add_argument("--all", action="store_true", help="show structural nodes in the table")
    c.add_argument("--quiet", action="store_true", help="no progress lines, no table")
    _plan_options(c)
    _calib_options(c)
    c.set_defaults(func=cmd_precondition)
    p.set_defaults(_subparsers={"demo": d, "inspect": i, "precondition": c})
    return p


def _onnx_refusal(flag: str) -> str:
    """Why the ONNX back end refuses a pass option's flag (``--scheme``), '' when it does
    not: ``inspect`` reads ONNX files only and offers no flag whose values it would refuse."""
    from precondfx.core.options import REFUSE
    try:
        from precondfx.onnx.pipeline import ONNX
    except ImportError:
        return ""
    kw = "reinit_weights" if flag == "--no-reinit" else flag[2:].replace("-", "_")
    return next((r.why for r in ONNX.rules if r.option == kw and r.value is REFUSE), "")


def _repeated_options(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Refuse a pass option's flag given twice with different values (``--seed 3 --seed 4``):
    argparse keeps the last one and drops the other silently.  ``--scheme-option`` is
    repeatable (one KEY=VALUE each) and an on/off flag twice means the same.  Exits 2."""
    from precondfx.core.options import cli_fields, flag_of, mapping
    once = {flag_of(f) for f in cli_fields()
            if f.metadata["check"] is not mapping and not isinstance(f.default, bool)}
    given: dict[str, list[str]] = {}
    toks = argv[:argv.index("--")] if "--" in argv else argv
    for i, tok in enumerate(toks):
        name, eq, val = tok.partition("=")
        if name in once:
            given.setdefault(name, []).append(val if eq else
                                              (toks[i + 1] if i + 1 < len(toks) else ""))
    twice = [f"{k} ({' and '.join(v)})" for k, v in given.items() if len(set(v)) > 1]
    if twice:
        parser.error(f"given more than once with different values: {'; '.join(twice)}; give "
                     f"each option once (argparse would keep the last value silently)")


def _unknown_flags(parser: argparse.ArgumentParser, args: argparse.Namespace,
                   extra: list[str]) -> None:
    """Refuse the arguments no parser took, as argparse does (``unrecognized arguments: ...``),
    and say for each unknown ``--flag`` which command takes it or, failing that, the flag of
    this command it resembles (argparse's own message names neither).  Exits 2."""
    from precondfx.core.options import did_you_mean
    subs = getattr(args, "_subparsers", {})
    sub = subs.get(getattr(args, "command", None) or "", parser)
    flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    said: list[str] = []
    for tok in extra:
        name = tok.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        others = sorted(c for c, sp in subs.items() if sp is not sub and any(
            name in a.option_strings for a in sp._actions))
        if others:
            why = _onnx_refusal(name) if args.command == "inspect" else ""
            said.append(f"{name} is a flag of {', '.join(others)}, not of {args.command}"
                        + (f": {why}" if why else ""))
            continue
        hint = did_you_mean(name, flags, cutoff=0.6)
        if hint:
            said.append(f"{name}: {hint.strip()[1:-1]}")
    tail = f" ({'; '.join(said)})" if said else ""
    parser.error(f"unrecognized arguments: {' '.join(extra)}{tail}; see {sub.prog} --help")


# ---------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------
def _write_report(report: Any, path: str) -> None:
    report.save(path)


def _check_report_path(path: str | None, model: str, output: str | None = None) -> None:
    """Refuse a ``--report`` path before any work: in a missing folder, a directory, or the
    input model, one of its external data files, or the output (the JSON would replace them)."""
    if path is None:
        return
    if os.path.isdir(path):
        raise UsageError(f"--report {path}: is a directory; give a file name (report.json)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--report {path}: the folder does not exist: {folder}")
    protected = [model]
    if os.path.isfile(model):
        try:
            from precondfx.onnx import io as onnx_io
            protected = onnx_io.input_files(onnx_io.load(model), model)
        except Exception:  # unreadable input: its own error comes from the pipeline
            pass
    real = os.path.realpath(path)
    if output is not None:
        protected += [output, output + ".data"]
    for p in protected:
        same = real == os.path.realpath(p)
        if not same and os.path.exists(path) and os.path.exists(p):
            same = os.path.samefile(path, p)
        if same:
            what = "the output" if output is not None and p in (output, output + ".data") \
                else "the input model or one of its data files"
            raise UsageError(f"--report {path}: that is {what} ({p}); give the report its own "
                             f"name (report.json)")
    if output is not None:
        from precondfx.onnx.io import data_file_names
        out_real = os.path.realpath(output)
        if os.path.dirname(real) == os.path.dirname(out_real) and \
                data_file_names(out_real).fullmatch(os.path.basename(real)):
            raise UsageError(f"--report {path}: that is a name the output's weights file "
                             f"may have ({os.path.basename(out_real)}.data, or "
                             f"{os.path.basename(out_real)}.<8 hex digits>.data when the earlier "
                             f"output reads the first); give the report its own name "
                             f"(report.json)")
    _check_writable(path, "--report")


def _check_writable(path: str, flag: str) -> None:
    """Refuse a file that cannot be written (a read-only folder or file system), before any
    work: a trial write (permission bits do not tell, e.g. for root or a read-only mount); a
    file that did not exist is removed again, an existing one is opened for appending and
    left as it was."""
    existed = os.path.exists(path)
    try:
        with open(path, "ab" if existed else "xb"):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write there ({e.strerror or e}); give a file "
                         f"in a writable folder") from None
    if not existed:
        os.remove(path)


def _check_plot_available(path: str | None, onnx_model: bool) -> None:
    """Refuse --plot before any work when it cannot be honoured."""
    if path is None:
        return
    from precondfx.core.report import Report
    if not callable(getattr(Report, "plot", None)):
        raise UsageError("--plot: plotting is not available in this version of precondfx "
                         "(Report.plot is missing)")
    if onnx_model:
        raise UsageError("--plot: plotting is not available for ONNX models: the plots show "
                         "per-layer Hessian measurements, which need the PyTorch model "
                         "(precondition module:callable --plot ...)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot: plotting needs matplotlib (pip install matplotlib)") from None


def _plot(report: Any, path: str) -> list[str]:
    paths = report.plot(path)
    return list(paths or [path])


def cmd_demo(args: argparse.Namespace) -> int:
    progress = _Progress(args.quiet)
    progress(f"building demo model {args.model!r}")
    import precondfx
    from precondfx import demo
    try:
        model, sample = demo.build(args.model)
    except KeyError as e:
        raise UsageError(str(e.args[0]) if e.args else str(e)) from None
    progress("preconditioning")
    _, report = precondfx.precondition(model, sample, **_plan_kwargs(args))
    progress("done")
    print(report.table(all_nodes=args.all))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from precondfx.onnx import inspect_onnx
    from precondfx.onnx.io import parse_dims
    if _is_torch_spec(args.model):
        raise UsageError(f"inspect reads ONNX files; {args.model} looks like a PyTorch "
                         f"module:callable: call precondfx.analyze(model, sample) from Python")
    _check_report_path(args.report, args.model)
    progress = _Progress(args.quiet)
    progress(f"reading {args.model}")
    report = inspect_onnx(args.model, dims=parse_dims(args.dim), batch=args.batch,
                          **_plan_kwargs(args))
    if args.report:      # before the table: a closed stdout (| head) must not lose it
        _write_report(report, args.report)
    print(report.table(all_nodes=args.all))
    return 0


def _is_torch_spec(s: str) -> bool:
    if s.lower().endswith(".onnx") or os.path.exists(s):
        return False
    mod, sep, attr = s.partition(":")
    return bool(sep and mod and attr and all(p.isidentifier() for p in mod.split("."))
                and all(p.isidentifier() for p in attr.split(".")))


def _onnx_flags(args: argparse.Namespace) -> None:
    """Refuse, by its flag, a pass option the ONNX back end refuses (``--measure``, ``--lr``,
    ``--capture``...: they need the PyTorch model), before the file is read; the same rules
    (``precondfx.onnx.pipeline.ONNX``) check the API's keywords."""
    from precondfx.core.options import DEFAULTS, REFUSE, cli_fields, flag_of, keyword_of
    try:
        from precondfx.onnx.pipeline import ONNX
    except ImportError:         # without the onnx extra: the pipeline's import says so
        return
    for f in cli_fields():
        kw = keyword_of(f)
        v = getattr(args, kw, getattr(DEFAULTS, f.name))
        if v == getattr(DEFAULTS, f.name) and type(v) is type(getattr(DEFAULTS, f.name)):
            continue
        why = next((r.why for r in ONNX.rules if r.option == kw and r.value is REFUSE
                    and r.applies(v)), None)
        if why:
            shown = "" if isinstance(f.default, bool) else f" {_shown(v)}"
            raise UsageError(f"{flag_of(f)}{shown} applies to PyTorch models "
                             f"(precondition module:callable ...), not to the ONNX file "
                             f"{args.model}: {why}")


def _shown(v: Any) -> str:
    """A flag's value as it is typed (``fx,eager``, ``none``)."""
    if isinstance(v, (tuple, list)):
        return ",".join(map(str, v))
    return "none" if v is None else str(v)


def cmd_precondition(args: argparse.Namespace) -> int:
    torch_model = _is_torch_spec(args.model)
    _check_plot_available(args.plot, onnx_model=not torch_model)
    _check_report_path(args.report, args.model, args.output)
    if torch_model:
        return _precondition_torch(args)
    if args.sample_shape:
        raise UsageError("--sample-shape applies to PyTorch models (module:callable); for an "
                         "ONNX file use --calib, --calib-input, --dim or --batch")
    if not os.path.exists(args.model):
        raise FileNotFoundError(f"no such file: {args.model}")
    _onnx_flags(args)
    from precondfx.onnx import precondition_onnx
    from precondfx.onnx.io import parse_dims
    _quiet_onnxruntime()
    progress = _Progress(args.quiet)
    report = precondition_onnx(
        args.model, args.output, calib=args.calib, calib_inputs=args.calib_input,
        dims=parse_dims(args.dim), batch=args.batch, **_plan_kwargs(args),
        external_data=args.external_data, verify=not args.no_verify,
        progress=lambda stage, t: progress(stage, t))
    for note in report.capture_notes:
        # made-up calibration data (random inputs, ones for masks) and feedable weights
        if "random N(0,1)" in note or "calibration used ones" in note or \
                "are also graph inputs" in note:
            _note(note)
    progress(f"wrote {args.output} ({report.stage_seconds.get('total', 0):.2f} s)")
    if args.report:
        _write_report(report, args.report)
    if not args.quiet:
        print(report.table(all_nodes=args.all))
    return 0


# ---------------------------------------------------------------------------------------------
# PyTorch models from the command line
# ---------------------------------------------------------------------------------------------
def _load_callable(spec: str) -> Any:
    mod_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise UsageError(f"cannot import module {mod_name!r} ({e})") from None
    except Exception as e:  # the user's module fails to import: their code, not ours
        raise UsageError(f"importing module {mod_name!r} raised {_user_error(e)}") from None
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{spec} is not callable")
    return obj


def _user_error(e: BaseException) -> str:
    """``Type: message (file:line)`` of an exception raised by the user's code, the line
    being the innermost frame of the traceback (where their code failed)."""
    where = ""
    tb = traceback.extract_tb(e.__traceback__)
    here = os.path.dirname(os.path.abspath(__file__))
    if tb and not isinstance(e, SyntaxError) and not tb[-1].filename.startswith(here):
        where = f" ({tb[-1].filename}:{tb[-1].lineno})"
    return f"{type(e).__name__}: {_one_line(e)}{where}"


def _build(spec: str) -> Any:
    """Call the user's ``module:callable``; an exception it raises is a usage error (exit 2)
    naming where their code failed, not an internal error of precondfx."""
    fn = _load_callable(spec)
    try:
        return fn()
    except MemoryError:
        raise
    except Exception as e:
        if _is_oom(e):
            raise
        raise UsageError(f"{spec}() raised {_user_error(e)}") from None


def _torch_sample(args: argparse.Namespace, given: Any) -> Any:
    import torch
    if given is not None and (args.calib or args.calib_input or args.sample_shape):
        _note(f"the sample {args.model} returned is not used: "
              f"{'--calib' if args.calib or args.calib_input else '--sample-shape'} replaces "
              f"it as the calibration batch")
    if args.calib or args.calib_input:
        if args.calib_input:
            raise UsageError("--calib-input applies to ONNX models; for a PyTorch model use "
                             "--calib FILE.npy, or an .npz (arr_0, arr_1...: positional inputs; "
                             "other keys: the forward's argument names), or --sample-shape")
        if args.calib.endswith(".npz"):
            return _npz_sample(args.calib)
        from precondfx.core.arrays import read_npy
        arr = read_npy(args.calib)
        return torch.from_numpy(arr)
    if args.sample_shape:
        gen = torch.Generator().manual_seed(args.seed)
        ts = tuple(torch.randn(*s, generator=gen) for s in args.sample_shape)
        _note("calibration uses random N(0,1) inputs of shape " +
              ", ".join("x".join(map(str, s)) for s in args.sample_shape) +
              " (pass --calib for real data)")
        return ts[0] if len(ts) == 1 else ts
    if given is None:
        raise UsageError("the callable returned a module without a sample: give "
                         "--sample-shape (e.g. 8x3x32x32) or --calib FILE.npy")
    return given


def _npz_sample(path: str) -> Any:
    """A PyTorch sample from an .npz: ``arr_0, arr_1...`` are positional inputs in that
    order; other keys are keyword inputs by the forward's argument names."""
    import torch
    from precondfx.core.arrays import positional_keys, read_npz
    from precondfx.errors import PrecondError
    z = read_npz(path)
    keys = list(z)
    order = positional_keys(keys)
    if order is None and any(k.startswith("arr_") and k[4:].isdigit() for k in keys):
        raise PrecondError(f"{path}: keys {keys} mix positional (arr_0, arr_1...) and "
                           f"named inputs; use one or the other")
    if order is not None:
        return tuple(torch.from_numpy(z[k]) for k in order)
    return {k: torch.from_numpy(z[k]) for k in keys}


def _precondition_torch(args: argparse.Namespace) -> int:
    progress = _Progress(args.quiet)
    out = args.output
    ext = os.path.splitext(out)[1].lower()
    if ext not in (".pt", ".pth", ".onnx"):
        raise UsageError(f"-o {out}: the output must end in .pt/.pth (state_dict) or .onnx "
                         f"(export)")
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise FileNotFoundError(f"the output's folder does not exist: {out_dir}")
    if args.dim or args.batch:
        raise UsageError("--dim/--batch apply to ONNX models; use --sample-shape for a PyTorch "
                         "model")
    if args.no_verify:
        raise UsageError("--no-verify applies to ONNX models (it skips the onnxruntime run of "
                         "the written file); a PyTorch model is checked in PyTorch")
    if args.external_data != "auto":
        raise UsageError(f"--external-data {args.external_data} applies to ONNX input files "
                         f"(it places the rewritten ONNX file's weights); a PyTorch model's "
                         f"-o .pt holds its state_dict and its -o .onnx is written by "
                         f"torch.onnx.export as it decides: drop --external-data")
    progress(f"importing {args.model}")
    import torch
    from torch import nn

    import precondfx
    built = _build(args.model)
    model, sample = built, None
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module):
        model, sample = built
    if not isinstance(model, nn.Module):
        raise UsageError(f"{args.model} returned {type(model).__name__}, not a torch.nn.Module "
                         f"or (module, sample)")
    sample = _torch_sample(args, sample)
    progress("preconditioning")
    kwargs = _plan_kwargs(args)
    if args.plot:
        kwargs["measure"] = True      # the plots show measured Hessian blocks (--measure too)
    result, report = precondfx.precondition(model, sample, **kwargs)
    progress(f"writing {out}")
    from precondfx.onnx.io import Staging, no_room
    with Staging(out) as st:
        try:
            if ext == ".onnx":
                _export_onnx(result, sample, st.path, args.quiet, out)
                st.adopt()
            else:
                # a Python file: a full disk reaches torch.save's RuntimeError as its OSError
                with open(st.path, "wb") as f:
                    torch.save(result.state_dict(), f)
        except Exception as e:
            no_room(e, out, weights=True)
            raise
        st.commit()
    progress("done")
    if ext != ".onnx" and not args.quiet:
        _note(_load_hint(out, args.model, type(result).__name__))
    pending = _pending_rate(result, ext)
    if pending:
        _note(pending)
    if ext == ".onnx" and not args.quiet:
        drift = _eval_drift(result, sample, report, args)
        if drift:
            _note(drift)
    if args.report:
        _write_report(report, args.report)
    if not args.quiet:
        print(report.table(all_nodes=args.all))
    if args.plot:
        for p in _plot(report, args.plot):
            progress(f"wrote {p}")
    return 0


def _eval_drift(model: Any, sample: Any, report: Any, args: argparse.Namespace) -> str | None:
    """The .onnx file is the eval-mode graph (BatchNorm's running statistics, no dropout);
    calibrated in train mode (the default), its output std on the sample can be far from the
    target (ShuffleNetV2: 3.9 for 1.0): say so, and how to calibrate for the file."""
    import torch

    from precondfx.pytorch.capture.common import main_output
    target = getattr(report, "target_std", None)
    if args.calibration != "train" or not target or report.output_std_after is None:
        return None
    try:
        with torch.no_grad():
            was = model.training
            model.eval()
            y = model(**sample) if isinstance(sample, dict) else \
                model(*sample) if isinstance(sample, tuple) else model(sample)
            model.train(was)
            std = float(main_output(y, getattr(args, "output_key", None)).double().std(correction=0))
    except Exception:      # the note is a courtesy: the file was written and verified
        return None
    if abs(std - target) <= 1e-2 * target:
        return None
    return (f"the .onnx file is the model in eval mode, whose output std on the sample is "
            f"{std:.4g}, not {target:g}: the output scale was calibrated in train mode "
            f"(--calibration train, the default: batch statistics); pass --calibration eval to "
            f"calibrate the graph the file holds")


def _pending_rate(model: Any, ext: str) -> str | None:
    """What the file holds when ``lr='auto'`` (the default) is still pending on ``model``: it
    acts at a torch.optim optimizer's first ``step()``, which the command line never reaches,
    so the file holds the storage before it (None when it is off or settled)."""
    from precondfx.pytorch.first_step import ATTR
    if getattr(model, "__dict__", {}).get(ATTR) is None:
        return None
    how = ("loaded into the same rewrite (precondfx.precondition with the same options), the "
           "rewrite's own lr='auto' acts at your torch.optim.SGD optimizer's first step (when "
           "its rate is above the suggested SGD rate), as on a fresh result" if ext != ".onnx"
           else
           "an ONNX file has no optimizer step, so lr='auto' never acts on it (the report's "
           "lr='auto' line is about the PyTorch result)")
    return (f"lr='auto' (the default) has not acted: it sets the storage at a torch.optim "
            f"optimizer's first step, so the file holds the storage before it; {how}. To "
            f"write the storage for your rate, pass --lr RATE --optimizer sgd|adam; --lr none "
            f"turns it off")


def _load_hint(out: str, spec: str, cls: str) -> str:
    """How to load the .pt the CLI writes: a state_dict (safe under torch.load's default
    weights_only=True), not a pickled GraphModule (which that default refuses)."""
    return (f"{out} holds the state_dict of the rewritten model ({cls}), with its constants "
            f"(precondfx_* buffers); load it into the same rewrite: model, _ = "
            f"precondfx.precondition({spec.split(':')[-1]}(), sample, <same options>); "
            f"model.load_state_dict(torch.load({out!r})). A pickled GraphModule "
            f"(torch.save(model)) needs torch.load(path, weights_only=False): trusted files only")


def _export_onnx(model: Any, sample: Any, path: str, quiet: bool,
                 out: str | None = None) -> None:
    """torch.onnx.export (dynamo exporter) with a dynamic leading dim; static if that fails.
    A write that finds no room is said as such (``out``: the output the messages name)."""
    import warnings

    import torch

    from precondfx.onnx.io import no_room
    args = sample if isinstance(sample, tuple) else (sample,)
    kwargs = sample if isinstance(sample, dict) else None
    if kwargs is not None:
        args = ()
    import logging
    model.eval()
    sink = _io.StringIO()
    tlog = logging.getLogger("torch.onnx")
    level = tlog.level
    tlog.setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink if quiet else sys.stderr):
        warnings.simplefilter("ignore")
        batch = torch.export.Dim("batch", min=1, max=65536)
        tensors = list(kwargs.values()) if kwargs is not None else list(args)
        shapes = [({0: batch} if isinstance(t, torch.Tensor) and t.ndim > 0 else None)
                  for t in tensors]
        dyn = (dict(zip(kwargs, shapes)) if kwargs is not None else tuple(shapes))
        try:
            torch.onnx.export(model, args, path, kwargs=kwargs, dynamo=True,
                              dynamic_shapes=dyn)
        except Exception as first:
            no_room(first, out or path, weights=True)
            try:
                torch.onnx.export(model, args, path, kwargs=kwargs, dynamo=True)
            except Exception as e:     # the model's forward, not precondfx: exit 2
                no_room(e, out or path, weights=True)
                import re
                text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))      # the exporter's colours
                first = next((ln for ln in text.splitlines() if ln.strip()), "")
                raise UsageError(f"torch.onnx.export could not export the preconditioned model "
                                 f"({type(e).__name__}: {first.strip()[:200]}); write its "
                                 f"state_dict instead (-o model.pt)") from None
        finally:
            tlog.setLevel(level)


# ---------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 2 usage/input error, 1 internal error)."""
    shown = warnings.showwarning
    _show_warnings()
    try:
        return _main(argv)
    finally:
        warnings.showwarning = shown


def _main(argv: Sequence[str] | None) -> int:
    from precondfx._deps import missing_required, required_message
    missing = missing_required(("torch", "numpy"))
    if missing:         # pip install --no-deps: say what to install, not a traceback
        _err(required_message(missing))
        return 2
    parser = build_parser()
    try:
        argv = list(argv) if argv is not None else sys.argv[1:]
        args, extra = parser.parse_known_args(argv)
        if extra:
            _unknown_flags(parser, args, extra)
        _repeated_options(parser, argv)
    except SystemExit as e:  # argparse: --help/--version (0) or a usage error (2)
        return int(e.code) if isinstance(e.code, int) else (0 if e.code is None else 2)
    if not getattr(args, "command", None):
        parser.print_usage(sys.stderr)
        _err("give a command: demo, inspect or precondition (see --help)")
        return 2
    from precondfx.errors import PrecondError
    expected: tuple[type[BaseException], ...] = (UsageError, PrecondError, FileNotFoundError,
                                                 IsADirectoryError, NotADirectoryError,
                                                 PermissionError)
    try:
        from google.protobuf.message import DecodeError
        expected += (DecodeError,)
    except ImportError:  # pragma: no cover
        pass
    try:
        return int(args.func(args) or 0)
    except expected as e:
        _err(_one_line(e))
        return 2
    except ImportError as e:
        hint = _missing_extra(e)
        if hint is None:
            traceback.print_exc()
            _err("internal error (a bug in precondfx): please report it with the traceback "
                 "above")
            return 1
        _err(hint)
        return 2
    except MemoryError as e:
        _err(_out_of_memory(e))
        return 2
    except RuntimeError as e:
        if not _is_oom(e):
            traceback.print_exc()
            _err("internal error (a bug in precondfx): please report it with the traceback "
                 "above")
            return 1
        _err(_out_of_memory(e))
        return 2
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:      # stdout closed by the reader (precondfx inspect m.onnx | head)
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except Exception:  # not a real file (tests): nothing left to flush
            pass
        return 0
    except Exception:
        traceback.print_exc()
        _err("internal error (a bug in precondfx): please report it with the traceback above")
        return 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
