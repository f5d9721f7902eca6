"""Plots of the conditioning statistics: the paper's Fig. 1 heat map and before/after bars.

matplotlib is optional: it is imported when a plot is drawn, and its absence raises a
:class:`~precondfx.errors.PrecondError` that says how to install it.  The figures are drawn on a
``matplotlib.figure.Figure`` with the Agg canvas (no pyplot, no global backend change), saved at
exactly ``figsize * dpi`` pixels.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from precondfx.errors import PrecondError

__all__ = ["plot_heatmap", "plot_bars"]


def _figure(figsize: tuple[float, float], dpi: int) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise PrecondError("plotting needs matplotlib: pip install matplotlib "
                           "(or pip install 'precondfx[plot]')") from e
    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | os.PathLike, dpi: int) -> str:
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


def plot_heatmap(block_matrix: Any, names: Sequence[str] | None, path: str | os.PathLike, *,
                 title: str = "Hessian block statistic E[(H_ml r_l)^2]",
                 figsize: tuple[float, float] = (6.0, 5.0), dpi: int = 100) -> str:
    """Write a log-scale heat map of ``block_matrix[m, l]`` (rows m, columns l) to ``path``.

    ``block_matrix`` is a 2-D array or a :class:`~precondfx.pytorch.measure.conditioning.BlockMatrix`
    (whose names are used when ``names`` is None).  Zero blocks are drawn at the smallest
    positive value.  The PNG is ``figsize * dpi`` pixels.  Returns the path.
    """
    mat = block_matrix
    if not isinstance(block_matrix, np.ndarray) and hasattr(block_matrix, "names"):
        mat = block_matrix.mean  # a BlockMatrix
        if names is None:
            names = block_matrix.names
    mat = np.asarray(mat, dtype=float)
    if mat.ndim != 2 or mat.shape[0] != mat.shape[1]:
        raise PrecondError(f"block_matrix must be square 2-D, got shape {mat.shape}")
    names = list(names) if names is not None else [str(i) for i in range(mat.shape[0])]
    if len(names) != mat.shape[0]:
        raise PrecondError(f"{len(names)} names for a {mat.shape[0]}x{mat.shape[0]} matrix")
    pos = np.abs(mat[np.isfinite(mat)])
    pos = pos[pos > 0]
    floor = float(pos.min()) if pos.size else 1.0
    logm = np.log10(np.clip(np.abs(np.nan_to_num(mat, nan=floor)), floor, None))
    fig = _figure(figsize, dpi)
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(logm, cmap="viridis", interpolation="nearest")
    n = len(names)
    ticks = range(n)
    fs = max(4.0, min(9.0, 200.0 / max(n, 1)))
    ax.set_xticks(list(ticks))
    ax.set_yticks(list(ticks))
    ax.set_xticklabels(names, rotation=90, fontsize=fs)
    ax.set_yticklabels(names, fontsize=fs)
    ax.set_xlabel("probed block l")
    ax.set_ylabel("block m")
    ax.set_title(title, fontsize=9)
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("log10")
    fig.subplots_adjust(left=0.25, bottom=0.25, right=0.95, top=0.92)
    return _save(fig, path, dpi)


def plot_bars(before: Mapping[str, float], after: Mapping[str, float] | None,
              path: str | os.PathLike, title: str = "", *, log: bool = True,
              figsize: tuple[float, float] = (7.0, 4.0), dpi: int = 100) -> str:
    """Write per-layer bars of a statistic before and after (log scale by default) to ``path``.

    ``before``/``after`` map layer names to values (e.g. ``result.values("hessian")``); layers
    are shown in ``before``'s order, then any only in ``after``.  The legend gives each side's
    spread (max/min).  The PNG is ``figsize * dpi`` pixels.  Returns the path.
    """
    after = dict(after or {})
    names = list(before) + [k for k in after if k not in before]
    if not names:
        raise PrecondError("plot_bars needs at least one layer value")

    def _spread(d: Mapping[str, float]) -> float:
        v = np.array([x for x in d.values() if x is not None and math.isfinite(x) and x > 0])
        return float(v.max() / v.min()) if v.size else float("nan")

    fig = _figure(figsize, dpi)
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(names))
    width = 0.4 if after else 0.8
    b = [float(before.get(k, np.nan)) for k in names]
    ax.bar(x - (width / 2 if after else 0), b, width, label=f"before (spread {_spread(before):.3g}x)")
    if after:
        a = [float(after.get(k, np.nan)) for k in names]
        ax.bar(x + width / 2, a, width, label=f"after (spread {_spread(after):.3g}x)")
    if log:
        ax.set_yscale("log")
    fs = max(4.0, min(9.0, 200.0 / max(len(names), 1)))
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=60, ha="right", fontsize=fs)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.12, bottom=0.3, right=0.97, top=0.9)
    return _save(fig, path, dpi)


def plot_report(conditioning: dict[str, Any], path: str) -> list[str]:
    """Write the PNGs for a report's measurements; returns the paths written."""
    m = conditioning.get("measure")
    bal = conditioning.get("hessian")
    paths: list[str] = []
    if m and "before" in m:
        paths.append(plot_bars(m["before"]["values"], m["after"]["values"], path,
                               "Hessian-block statistic per layer: original vs precondfx"))
    elif bal and bal.get("applied"):
        paths.append(plot_bars(bal["before"], bal["after_fit"], path,
                               "Hessian-block statistic before and after balancing (balancing "
                               "samples; measure=True for held-out data)"))
    else:
        raise PrecondError("the report holds no measurements to plot: call precondition(..., "
                           "measure=True) (or balance='hessian')")
    stem = path[:-4] if path.lower().endswith(".png") else path
    if m and "blocks" in m:
        paths.append(plot_heatmap(np.array(m["blocks"]["mean"]),
                                  m["blocks"]["names"], stem + "_blocks.png",
                                  title="Hessian blocks E[(H_ml r_l)^2] after precondfx "
                                        "(Fig. 1)"))
    if m and m.get("gr_over_hessian"):
        paths.append(_plot_ratio_hist(m["gr_over_hessian"], stem + "_gr_ratio.png"))
    return paths


def _plot_ratio_hist(ratios: dict[str, float], path: str) -> str:
    fig = _figure((6.0, 4.0), 100)
    ax = fig.add_subplot(1, 1, 1)
    vals = [math.log10(v) for v in ratios.values() if v > 0]
    ax.hist(vals, bins=max(5, min(30, len(vals))))
    ax.set_xlabel("log10(GR formula / measured Hessian statistic)")
    ax.set_ylabel("layers")
    ax.set_title("Theory vs measurement per layer (Fig. 2)", fontsize=9)
    return _save(fig, path, 100)
