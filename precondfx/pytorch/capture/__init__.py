"""Capture stage: model + sample -> neutral graph (see ``ladder`` for the order of methods)."""
