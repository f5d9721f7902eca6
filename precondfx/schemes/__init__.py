"""Initialization schemes over the shared pipeline (the protocol: ``precondfx.core.scheme``); importing this package
registers every scheme module listed here."""
import importlib

for _mod in ("lsuv", "gne", "wn", "tat"):
    try:
        importlib.import_module(f"precondfx.schemes.{_mod}")
    except ModuleNotFoundError as _e:  # a scheme module not written yet
        if _e.name != f"precondfx.schemes.{_mod}":
            raise
