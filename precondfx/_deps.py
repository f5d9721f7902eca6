"""The required dependencies (``pyproject.toml``'s ``dependencies``), checked without importing
them, so that an install without them (``pip install --no-deps``) fails with what to install
instead of a raw ``ModuleNotFoundError``."""
from __future__ import annotations

import importlib.util

#: import name -> requirement, as ``pyproject.toml`` lists them
REQUIRED = {"torch": "torch>=2.4", "numpy": "numpy>=1.26", "tqdm": "tqdm>=4.66"}


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_required(names: tuple[str, ...] | None = None) -> list[str]:
    """The required dependencies (of ``names``, default all) that are not installed."""
    return [name for name in (names or tuple(REQUIRED)) if not _importable(name)]


def required_message(names: list[str]) -> str:
    """What to do when the required dependencies ``names`` are missing."""
    reqs = " ".join(f"'{REQUIRED.get(n, n)}'" for n in names)
    return (f"precondfx needs {', '.join(repr(n) for n in names)}, a required dependency not "
            f"installed (installed with --no-deps?): pip install {reqs} (or pip install "
            f"precondfx, which installs its dependencies)")
