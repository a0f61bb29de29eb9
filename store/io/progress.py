"""Progress on long work: tqdm bars, drawn on a terminal or in a notebook, never in a pipe or under ``--quiet``.

Two kinds:

- :func:`progress_bar`: a bar over a known number of units (graph tasks, bytes) that its caller
  updates (``redivide``, ``load_many``, ``verify``, ``diff``, ``export``);
- :func:`tracking`: the bar of one whole command whose work is spread over many places (a framework
  import writing blocks, an export reading tensors). While it is open, the writer's
  :meth:`~reshard.store.write.writer.CheckpointWriter.write_block` and the reader's
  ``read_regions`` report to it (:func:`advance`), and it shows bytes, tensors, rate and ETA.

Whether bars are drawn: ``progress=True``/``False`` where a function takes it; else ``False``
inside :func:`quiet` (the command line's ``--quiet``); else when stderr is a terminal or the
process is a Jupyter kernel (tqdm.auto then draws a notebook widget).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("reshard")

_quiet: contextvars.ContextVar[bool] = contextvars.ContextVar("reshard_quiet", default=False)
#: The open :func:`tracking` bar: one per process (a command), reported to from any thread.
_current: Tracker | None = None


@contextlib.contextmanager
def quiet(on: bool = True) -> Iterator[None]:
    """No progress bars inside this block (unless a call asks with ``progress=True``)."""
    token = _quiet.set(on)
    try:
        yield
    finally:
        _quiet.reset(token)


def shown(progress: bool | None = None) -> bool:
    """Whether to draw a bar: ``progress`` if given, else not under :func:`quiet`, else on a terminal or notebook."""
    if progress is not None:
        return progress
    if _quiet.get():
        return False
    return sys.stderr.isatty() or type(sys.stderr).__module__.startswith("ipykernel")


def _tqdm(**kwargs: Any) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress is a nicety: never fail for it
        log.info("reshard: install tqdm for progress bars")
        return None
    return tqdm(leave=False, **kwargs)


@contextlib.contextmanager
def progress_bar(total: int, desc: str, progress: bool | None = None, unit: str = "task") -> Iterator[Any]:
    """``with progress_bar(...) as bar``: a tqdm bar over ``total`` units, or None; closed on exit.

    Parameters
    ----------
    total : int
        Units to come; no bar for 0.
    desc : str
        The bar's label.
    progress : bool, optional
        Draw it; ``None``: as :func:`shown` decides. Never while a :func:`tracking` bar is open.
    unit : str
        ``"task"`` (graphs) or ``"B"`` (bytes, shown as kB, MB...).
    """
    drawn = total and shown(progress) and _current is None  # inside tracking(): the command's bar shows it
    bar = _tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B") if drawn else None
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()


class Tracker:
    """One command's bar: bytes done of bytes expected (rate, ETA), and tensors done, as the work reports them."""

    def __init__(self, desc: str) -> None:
        self.bar = _tqdm(total=0, desc=desc, unit="B", unit_scale=True)
        self.tensors = [0, 0]  # done, expected
        self._drawn = 0.0

    def expect(self, nbytes: int = 0, tensors: int = 0) -> None:
        """More work to come."""
        self.tensors[1] += tensors
        if self.bar is not None and nbytes:
            self.bar.total += nbytes
            self.bar.refresh()

    def advance(self, nbytes: int = 0, tensors: int = 0) -> None:
        """Work done."""
        self.tensors[0] += tensors
        if self.bar is None:
            return
        self.bar.update(nbytes)
        now = time.monotonic()
        if tensors and now - self._drawn > 0.1:  # the postfix redraws the bar: not for every block
            self._drawn = now
            self.bar.set_postfix_str(f"{self.tensors[0]}/{self.tensors[1]} tensors")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()




@contextlib.contextmanager
def tracking(desc: str, progress: bool | None = None) -> Iterator[Tracker | None]:
    """Draw one bar for the work done inside this block (see the module); None when no bar is drawn."""
    global _current
    if not shown(progress) or _current is not None:
        yield None
        return
    tracker = _current = Tracker(desc)
    try:
        yield tracker
    finally:
        _current = None
        tracker.close()


def expect(nbytes: int = 0, tensors: int = 0) -> None:
    """Report work to come to the open :func:`tracking` bar, if any."""
    if _current is not None:
        _current.expect(nbytes, tensors)


def advance(nbytes: int = 0, tensors: int = 0) -> None:
    """Report work done to the open :func:`tracking` bar, if any."""
    if _current is not None:
        _current.advance(nbytes, tensors)


__all__ = ["Tracker", "advance", "expect", "progress_bar", "quiet", "shown", "tracking"]
