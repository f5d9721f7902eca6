"""Progress of long measurements: a bar with an ETA on stderr, and lines on the ``precondfx`` logger.

Measured balancing and ``measure=True`` run one forward/backward per sample (and, for the block
matrix, Hessian-vector products per block); on a large model that takes minutes.  The bar is
tqdm's (a small, well-kept library that estimates the rate and the time left, and redraws one
line); it goes to stderr, never stdout, and only when stderr is a terminal and the caller did not
pass ``verbose=False``.  ``PRECONDFX_PROGRESS=1`` forces it on (to capture it in a log),
``PRECONDFX_PROGRESS=0`` off.  Whatever the bar does, the ``precondfx`` logger gets a line at the
start, at most every ``log_every`` seconds with the count and the ETA, and at the end.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from types import TracebackType
from typing import Any

log = logging.getLogger("precondfx")


def showing(verbose: bool | None) -> bool:
    """Whether a bar is drawn: not with ``verbose=False``, else when forced by the environment
    or when stderr is a terminal."""
    env = os.environ.get("PRECONDFX_PROGRESS", "").strip()
    if verbose is False or env == "0":
        return False
    if env == "1":
        return True
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class Progress:
    """Count ``total`` steps of one measurement; use as a context manager, call ``step()``."""

    def __init__(self, total: int, desc: str, unit: str = "sample", *,
                 verbose: bool | None = None, log_every: float = 10.0) -> None:
        self.total, self.desc, self.unit = int(total), desc, unit
        self.done = 0
        self.log_every = log_every
        self.t0 = self._last = time.perf_counter()
        self.bar: Any = None
        if showing(verbose):
            from tqdm import tqdm
            # the terminal's size, else 100 x 20 (tqdm hides its bar on a pty of size 0)
            size = shutil.get_terminal_size((100, 20))
            self.bar = tqdm(total=self.total, desc=f"precondfx: {desc}", unit=unit,
                            file=sys.stderr, ncols=size.columns, nrows=max(size.lines, 2),
                            mininterval=0.25, leave=True)
        log.info("%s: %d %ss", desc, self.total, unit)

    def eta(self, now: float | None = None) -> float:
        """Seconds left at the mean rate so far (nan before the first step)."""
        if self.done == 0:
            return float("nan")
        now = time.perf_counter() if now is None else now
        return (now - self.t0) / self.done * max(self.total - self.done, 0)

    def step(self, n: int = 1) -> None:
        """``n`` more steps done."""
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        now = time.perf_counter()
        if now - self._last >= self.log_every and self.done < self.total:
            self._last = now
            log.info("%s: %d/%d %ss, %.1f s elapsed, ETA %.1f s", self.desc, self.done,
                     self.total, self.unit, now - self.t0, self.eta(now))

    def restart(self) -> None:
        """Back to zero steps (a measurement that starts over another way)."""
        self.done = 0
        self.t0 = self._last = time.perf_counter()
        if self.bar is not None:
            self.bar.reset(total=self.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        log.info("%s: %d/%d %ss in %.1f s", self.desc, self.done, self.total, self.unit,
                 time.perf_counter() - self.t0)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
