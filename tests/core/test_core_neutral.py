"""The core (``precondfx/core``) is framework-neutral: it imports neither torch nor onnx.

Two checks, independent of each other: a static walk of every import statement in the core's
source (function-level imports included), and a fresh interpreter in which ``torch``, ``onnx``,
``onnx_ir`` and ``onnxruntime`` cannot be imported at all, importing every core module.
"""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

CORE = pathlib.Path(__file__).resolve().parents[2] / "precondfx" / "core"
FORBIDDEN = ("torch", "onnx", "onnx_ir", "onnxruntime", "onnxscript", "precondfx.pytorch",
             "precondfx.onnx", "precondfx.schemes", "precondfx.integrations")


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_core_source_imports_no_framework():
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 15, files          # the core is where the layout says it is
    bad = [f"{p.name}:{line} imports {name}" for p in files for line, name in _imports(p)
           if _forbidden(name)]
    assert bad == []


def test_core_modules_import_without_torch_or_onnx():
    names = sorted(p.stem for p in CORE.glob("*.py") if p.stem != "__init__")
    code = (
        "import sys\n"
        f"for m in {FORBIDDEN[:5]!r}:\n"
        "    sys.modules[m] = None\n"          # any import of them raises ImportError
        "import importlib\n"
        f"for n in {names!r}:\n"
        "    importlib.import_module('precondfx.core.' + n)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'onnx', 'onnx_ir', "
        "'onnxruntime') and sys.modules[m] is not None]\n"
        "print(len(bad), len([m for m in sys.modules if m.startswith('precondfx.core.')]))\n")
    # import the core package without running precondfx/__init__ (which imports torch): put a
    # bare namespace in sys.modules first
    code = ("import sys, types, pathlib\n"
            f"pkg = types.ModuleType('precondfx'); pkg.__path__ = [{str(CORE.parent)!r}]\n"
            "sys.modules['precondfx'] = pkg\n") + code
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded_frameworks, loaded_core = map(int, out.stdout.split())
    assert loaded_frameworks == 0
    assert loaded_core == len(names)
