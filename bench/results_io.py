"""Writing a bench's results: a Markdown table and its JSON rows, each written atomically
(a temporary file renamed over the target), and a measurement run in a fresh process.
Standard library only, so benches that measure
a fresh process's memory can import it before torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically, making its folder if needed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_table(out: str, lines: list[str], rows: Any) -> None:
    """``out.md`` (the lines) and ``out.json`` (the rows); the table is printed too."""
    write_text(out + ".md", "\n".join(lines) + "\n")
    write_text(out + ".json", json.dumps(rows, indent=2) + "\n")
    print("\n".join(lines))


def child_json(script: str, args: list[str], repo: str) -> dict:
    """Run ``script --child ARGS`` in a fresh Python process with ``repo`` first on the path
    (its own peak memory, the tree under test) and return the JSON its last line prints."""
    out = subprocess.run([sys.executable, os.path.abspath(script), "--child", *args],
                         capture_output=True, text=True, cwd=repo, check=False,
                         env={**os.environ, "PYTHONPATH": repo})
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} ({repo}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
