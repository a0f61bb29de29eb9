"""Pausing Python's cyclic garbage collector while reshard builds or parses metadata.

A save or a load of thousands of tensors allocates hundreds of thousands of
small containers (layouts, records, JSON documents) that hold no reference
cycles. CPython (up to 3.13) runs a full collection each time the long-lived
heap has grown by a quarter, and every full collection walks every live object:
on W2 (5,000 tensors, one process) that was a quarter of the save and a third
of the load (docs/performance.md). Nothing reshard allocates needs the cyclic
collector (reference counting frees it), so the public entry points run under
:func:`gc_paused`; the collector resumes when the outermost one returns, and
a collection then reclaims any cycles the caller's own code made meanwhile.

Nested and concurrent entries (the async saver's thread and a load in the
training thread) share one count: the collector is switched back on when the
last one leaves, and only if it was on when the first one came in.
``RESHARD_GC_PAUSE=0`` leaves the collector alone. A child made by ``fork``
while another thread was inside starts with the collector on and the count at zero.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_paused = False  # whether the outermost entry switched the collector off


def _reset_after_fork() -> None:
    """In a forked child: the threads inside a pause did not come along; nor does the pause."""
    global _lock, _depth, _paused
    _lock = threading.Lock()
    if _paused:
        gc.enable()
    _depth, _paused = 0, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Run a block (or, as a decorator, a function) with the cyclic collector off."""
    global _depth, _paused
    with _lock:
        if _depth == 0:
            _paused = gc.isenabled() and os.environ.get("RESHARD_GC_PAUSE", "1") != "0"
            if _paused:
                gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth = max(0, _depth - 1)  # never below zero: a forked child's reset count
            if _depth == 0 and _paused:
                _paused = False
                gc.enable()
