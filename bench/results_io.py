"""Writing a bench's results: a Markdown table and its JSON rows, each written atomically
(a temporary file renamed over the target). Standard library only, so benches that measure
a fresh process's memory can import it before torch."""
from __future__ import annotations

import json
import os
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
