"""Docs that cannot rot: the site builds with ``mkdocs build --strict``, the options reference is
generated from ``precondfx.Options``, and every ```python block of README.md and docs/ runs.

Blocks of one page run in order in one namespace (a page may build on its earlier blocks), in a
temporary working directory.  A block that needs a file or the network is skipped only when the
line before its fence says so: ``<!-- docs-test: skip (why) -->``; such blocks are counted and
kept few (``MAX_SKIPPED``).
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\b(.*?)-->")
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<info>[^\n`]*)$")
#: at most this many blocks may be skipped over all pages (each needs a stated reason)
MAX_SKIPPED = 6


@dataclasses.dataclass
class Block:
    path: Path
    line: int          # 1-based line of the first code line
    code: str
    skip: str | None   # the reason given in the marker, or None


def blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown file (indented fences included, dedented)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        info, indent = m["info"].strip(), len(m["indent"])
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if info.split(" ")[0] in ("python", "py"):
            prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            sk = SKIP.search(prev)
            code = "\n".join(ln[indent:] for ln in lines[i + 1:j])
            out.append(Block(path, i + 2, code, sk[1].strip(" ()") or "no reason" if sk else None))
        i = j + 1
    return out


def pages() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "results" not in p.parts)
    return [ROOT / "README.md", *docs]


def run_page(path: Path) -> tuple[int, int]:
    """Run the page's blocks in order in one namespace; return (run, skipped)."""
    import torch
    ns: dict = {"__name__": f"docs_{path.stem}"}
    ran = skipped = 0
    for b in blocks(path):
        if b.skip is not None:
            skipped += 1
            continue
        # pad with blank lines so that a traceback names the Markdown line
        code = compile("\n" * (b.line - 1) + b.code, str(b.path), "exec")
        torch.manual_seed(0)
        exec(code, ns)
        ran += 1
    return ran, skipped


@pytest.fixture()
def in_tmp(tmp_path, monkeypatch):
    import torch
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tmp_path
    torch.set_num_threads(threads)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(page: Path, in_tmp) -> None:
    t0 = time.perf_counter()
    ran, skipped = run_page(page)
    print(f"{page.relative_to(ROOT)}: {ran} block(s) run, {skipped} skipped, "
          f"{time.perf_counter() - t0:.1f} s")


def test_skipped_blocks_are_few_and_say_why() -> None:
    skipped = [b for p in pages() for b in blocks(p) if b.skip is not None]
    assert len(skipped) <= MAX_SKIPPED, [f"{b.path.name}:{b.line}" for b in skipped]
    assert all(b.skip != "no reason" for b in skipped), \
        [f"{b.path.name}:{b.line}" for b in skipped if b.skip == "no reason"]
    total = sum(len(blocks(p)) for p in pages())
    assert total >= 20, f"only {total} python blocks in the docs: is the runner finding them?"


def test_block_finder_reads_markers(tmp_path: Path) -> None:
    md = tmp_path / "x.md"
    md.write_text("text\n\n```python\na = 1\n```\n\n<!-- docs-test: skip (needs a file) -->\n"
                  "```python\nopen('missing')\n```\n\n- item\n\n    ```py\n    b = a + 1\n    ```\n"
                  "```bash\nls\n```\n")
    got = blocks(md)
    assert [(b.line, b.code, b.skip) for b in got] == [
        (4, "a = 1", None), (9, "open('missing')", "needs a file"), (15, "b = a + 1", None)]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    """``mkdocs build --strict`` (warnings are errors: broken links, missing pages, API
    references that do not resolve), and the generated options page lists every option."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": path}
    site = tmp_path / "site"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(site)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    print(f"mkdocs build --strict: rc {r.returncode}, {time.perf_counter() - t0:.1f} s")
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    from precondfx import Options
    page = (site / "reference" / "options" / "index.html").read_text(encoding="utf-8")
    for f in dataclasses.fields(Options):
        kw = f.metadata.get("keyword") or f.name
        assert f"<code>{kw}</code>" in page, f"option {kw} missing from the generated page"
        assert f.metadata["help"].split(" ")[0] in page
    api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("precondfx.precondition", "precondfx.analyze", "precondfx.fold"):
        assert name in api, f"{name} missing from the API reference"
