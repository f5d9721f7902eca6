"""Layout metrics of the package (issue 13's before/after table).

    python bench/layout_metrics.py [--repo DIR]

Prints: the 10 longest functions (lines), how many places spell each option's default or
choices, import cycles between package modules, the `duplicates` pair count (package only),
and the package modules that only the tests import.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys

OPTIONS = ("init", "maxpool", "balance", "balance_threshold", "residual", "residual_scale",
           "target_std", "input_scale", "output_key", "seed", "reinit_weights",
           "balance_samples", "scheme", "calibration", "measure")


def py_files(root: str) -> list[str]:
    out = []
    for d, _, fs in os.walk(os.path.join(root, "precondfx")):
        out += [os.path.join(d, f) for f in fs if f.endswith(".py")]
    return sorted(out)


def longest(files: list[str], root: str, n: int = 10) -> list[tuple[int, str]]:
    rows = []
    for f in files:
        tree = ast.parse(open(f).read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                rows.append((node.end_lineno - node.lineno + 1,
                             f"{os.path.relpath(f, root)}:{node.name}"))
    return sorted(rows, reverse=True)[:n]


def option_spellings(files: list[str]) -> dict[str, int]:
    """Places that spell an option's default: a keyword parameter with a literal default in a
    signature that spells three or more options, an argparse ``--name`` with a default, or a
    field of an ``*Options`` class."""
    counts = {o: 0 for o in OPTIONS}
    for f in files:
        tree = ast.parse(open(f).read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                pairs = list(zip(a.args[len(a.args) - len(a.defaults):], a.defaults)) + \
                    [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                # a default spelled as a literal (not read from the one definition, D.x)
                given = [x.arg for x, d in pairs if not isinstance(d, ast.Attribute)]
                opts = [x for x in given if x in counts]
                if len(opts) >= 3:       # a function that spells an option set
                    for x in opts:
                        counts[x] += 1
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                for c in node.args:
                    if isinstance(c, ast.Constant) and isinstance(c.value, str):
                        k = c.value.lstrip("-").replace("-", "_")
                        k = "reinit_weights" if k == "no_reinit" else k
                        if k in counts and any(kw.arg == "default" for kw in node.keywords):
                            counts[k] += 1
            elif isinstance(node, ast.ClassDef):
                for st in node.body:
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) \
                            and st.value is not None:
                        k = "reinit_weights" if st.target.id == "reinit" else st.target.id
                        if k in counts and node.name.endswith("Options"):
                            counts[k] += 1
    return counts


def module_of(f: str, root: str) -> str:
    m = os.path.relpath(f, root)[:-3].replace(os.sep, ".")
    return m[:-9] if m.endswith(".__init__") else m


def imports(files: list[str], root: str, top_only: bool) -> dict[str, set[str]]:
    mods = {module_of(f, root): f for f in files}
    g: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        tree = ast.parse(open(f).read())
        nodes = tree.body if top_only else list(ast.walk(tree))
        for node in nodes:
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for nm in names:
                if nm in mods and nm != m and not m.startswith(nm + "."):
                    g[m].add(nm)
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in g:
        if v not in index:
            visit(v)
    return out


def test_only(files: list[str], root: str) -> list[str]:
    """Package modules imported by tests/ but by nothing in the package, the CLI or bench."""
    mods = [module_of(f, root) for f in files]
    text_pkg = {f: open(f).read() for f in files}
    others = ""
    for sub in ("bench", "examples"):
        for d, _, fs in os.walk(os.path.join(root, sub)):
            others += "".join(open(os.path.join(d, f)).read() for f in fs if f.endswith(".py"))
    tests = ""
    for d, _, fs in os.walk(os.path.join(root, "tests")):
        tests += "".join(open(os.path.join(d, f)).read() for f in fs if f.endswith(".py"))
    out = []
    for m in mods:
        if m.count(".") == 0 or m.endswith("__main__"):
            continue
        leaf = m.rsplit(".", 1)
        pat = re.compile(rf"({re.escape(m)}\b|from {re.escape(leaf[0])} import [^\n]*\b"
                         rf"{re.escape(leaf[1])}\b)")
        used_pkg = any(pat.search(t) for f, t in text_pkg.items() if module_of(f, root) != m)
        if not used_pkg and not pat.search(others) and pat.search(tests):
            out.append(m)
    return out


def top_level(root: str) -> list[str]:
    """The modules directly in ``precondfx/`` (what a newcomer sees first)."""
    return sorted(f[:-3] for f in os.listdir(os.path.join(root, "precondfx"))
                  if f.endswith(".py") and f != "__init__.py")


def largest(files: list[str], root: str, n: int = 3) -> tuple[list, list]:
    """The ``n`` longest files and classes (lines)."""
    fl, cl = [], []
    for f in files:
        src = open(f).read()
        fl.append((src.count("\n"), os.path.relpath(f, root)))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ClassDef):
                cl.append((node.end_lineno - node.lineno + 1,
                           f"{os.path.relpath(f, root)}:{node.name}"))
    return sorted(fl, reverse=True)[:n], sorted(cl, reverse=True)[:n]


def framework_imports(root: str) -> list[str]:
    """Imports of torch/onnx (any level) in ``precondfx/core`` (empty where it is neutral)."""
    core = os.path.join(root, "precondfx", "core")
    if not os.path.isdir(core):
        return ["(no precondfx/core)"]
    out = []
    for f in sorted(os.listdir(core)):
        if not f.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(open(os.path.join(core, f)).read())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            out += [f"{f}: {m}" for m in names if m.split(".")[0] in
                    ("torch", "onnx", "onnx_ir", "onnxruntime")]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    a = p.parse_args()
    root = a.repo
    files = py_files(root)
    print("longest functions (lines):")
    for n, name in longest(files, root):
        print(f"  {n:4d}  {name}")
    sp = option_spellings(files)
    print("places each option's default is spelled:",
          ", ".join(f"{k} {v}" for k, v in sp.items()), f"(total {sum(sp.values())})")
    for kind, top in (("module-level", True), ("any (incl. function-level)", False)):
        cyc = cycles(imports(files, root, top))
        print(f"import cycles, {kind}: {len(cyc)}", *(" <-> ".join(c) for c in cyc), sep="\n  ")
    dup = subprocess.run(["duplicates", "--repo", os.path.join(root, "precondfx"), "--most", "1",
                          "--seconds", "120"], capture_output=True, text=True).stdout
    print("duplicates (package):", dup.splitlines()[0] if dup else "n/a")
    print("package modules only tests import:", test_only(files, root))
    tops = top_level(root)
    print(f"top-level modules of precondfx/: {len(tops)}:", " ".join(tops))
    lf, lc = largest(files, root)
    print("largest files:", "; ".join(f"{n} {name}" for n, name in lf))
    print("largest classes:", "; ".join(f"{n} {name}" for n, name in lc))
    print("torch/onnx imports in precondfx/core:", framework_imports(root) or "none")


if __name__ == "__main__":
    main()
