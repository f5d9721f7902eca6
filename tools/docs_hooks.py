"""MkDocs hook: generate the options and op-table references from the code at build time.

A page holding the marker ``<!-- options:table -->`` gets one row per option (public keyword,
default, allowed values, command-line flag, whether it shapes the plan, help text), read from the
fields of ``precondfx.Options``; ``<!-- options:call -->`` gets the keyword arguments of
``precondfx.precondition`` that are not options (``inplace``, ``verbose``, ...).  The defaults and
help texts therefore live in one place, the ``Options`` definition; nothing here repeats them.
``<!-- ops:table -->`` gets the op table (``optable.table_rows()``) the same way, and
``<!-- report:example -->`` the report of a small CNN, run when the site is built.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # build from a checkout without installing it
    sys.path.insert(0, ROOT)

#: what the call-level arguments mean (they are not options: they do not shape the plan)
CALL_ARGS = {
    "inplace": "edit your module object (hooks and buffers) instead of a copy",
    "verbose": "progress lines with elapsed time, and a progress bar with ETA on stderr during "
               "long measurements (on a terminal)",
    "forward_kwargs": "keyword arguments for the model's forward; extra keyword arguments of "
                      "the call go there too (e.g. `use_cache=False`)",
}


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _allowed(name: str, check: Any) -> str:
    """The values ``check`` accepts, read from the check itself (its choices, or the message it
    gives for a value it refuses), so that this page cannot disagree with it."""
    choices = getattr(check, "choices", None)
    if choices:
        return ", ".join(f"`{c!r}`" for c in choices)
    from precondfx import PrecondError
    try:
        check(name, object())
    except PrecondError as e:
        msg = str(e)
        if " must be " in msg:
            return msg.split(" must be ", 1)[1]
        if " is not among " in msg:
            return "one of " + msg.split(" is not among ", 1)[1].split(":")[0] + ", or a list"
    return ", ".join(f"`{w!r}`" for w in getattr(check, "words", ()))


def _flag(f: dataclasses.Field) -> str:
    if not f.metadata.get("cli"):
        return ""
    from precondfx.core.options import flag_of
    return f"`{flag_of(f)}`"


def options_table() -> str:
    """The Markdown table of every field of ``precondfx.Options``."""
    from precondfx import Options
    rows = ["| option | default | allowed | command line | in plan | meaning |",
            "|---|---|---|---|---|---|"]
    for f in dataclasses.fields(Options):
        md = f.metadata
        kw = md.get("keyword") or f.name
        rows.append(f"| `{kw}` | `{f.default!r}` | {_cell(_allowed(kw, md['check']))} | {_flag(f)} "
                    f"| {'yes' if md.get('plan') else 'no'} | {_cell(md['help'])} |")
    return "\n".join(rows)


def call_table() -> str:
    """The keyword arguments of ``precondition`` that are not options."""
    import precondfx
    from precondfx import Options
    names = {f.metadata.get("keyword") or f.name for f in dataclasses.fields(Options)}
    rows = ["| argument | default | meaning |", "|---|---|---|"]
    for p in inspect.signature(precondfx.precondition).parameters.values():
        if p.kind is not p.KEYWORD_ONLY or p.name in names:
            continue
        rows.append(f"| `{p.name}` | `{p.default!r}` | {_cell(CALL_ARGS.get(p.name, ''))} |")
    return "\n".join(rows)


def _module(*names: str) -> Any:
    """The first of ``names`` that imports (module paths move; the docs should not break)."""
    import importlib
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"none of {names} imports")


def ops_table() -> str:
    """The op table (``optable.table_rows()``): kind, status, reason and spellings."""
    optable = _module("precondfx.core.optable", "precondfx.optable")
    rows = ["| kind | status | reason | PyTorch modules | ONNX ops |", "|---|---|---|---|---|"]
    for r in optable.table_rows():
        mods = ", ".join(f"`{m}`" for m in r["modules"][:8]) + (" ..." if len(r["modules"]) > 8
                                                                else "")
        onnx = ", ".join(f"`{o}`" for o in r["onnx"][:8]) + (" ..." if len(r["onnx"]) > 8
                                                             else "")
        rows.append(f"| `{r['kind']}` | {r['status']} | {_cell(r['reason'])} | {mods} | {onnx} |")
    return "\n".join(rows)


@functools.lru_cache(maxsize=1)
def report_example() -> str:
    """The report of a small CNN (the quickstart's), printed by the installed precondfx when the
    site is built, so that the table shown is the table users get."""
    import torch
    from torch import nn

    import precondfx
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
        _, report = precondfx.precondition(model, torch.randn(64, 3, 32, 32))
        text = report.table(width=100)
    finally:
        torch.set_num_threads(threads)
    lines, skipping = [], False
    for ln in text.splitlines():      # drop the timing line (and its wrap): it varies by machine
        skipping = ln.startswith("time:") or (skipping and ln.startswith("    "))
        if not skipping:
            lines.append(ln)
    return "```text\n" + "\n".join(lines) + "\n```"


MARKERS = {"<!-- options:table -->": options_table, "<!-- options:call -->": call_table,
           "<!-- ops:table -->": ops_table, "<!-- report:example -->": report_example}


def on_page_markdown(markdown: str, **_: Any) -> str:
    for marker, make in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown


if __name__ == "__main__":
    print(options_table())
    print()
    print(call_table())
    print()
    print(ops_table())
    print()
    print(report_example())
