"""The shared I/O thread pool.

File reads, writes and crc32c release the GIL, so a few threads keep a disk
or a network link busy. ``RESHARD_IO_THREADS`` sets the size (default 8).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def io_threads() -> int:
    return max(1, int(os.environ.get("RESHARD_IO_THREADS", "8")))


def pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(io_threads(), thread_name_prefix="reshard-io")
        return _pool


def run_all(jobs: Iterable[Callable[[], T]]) -> list[T]:
    """Run jobs on the pool; the first failure cancels the rest and is raised."""
    jobs = list(jobs)
    if len(jobs) <= 1 or threading.current_thread().name.startswith("reshard-io"):
        return [job() for job in jobs]
    futures: list[Future[T]] = [pool().submit(job) for job in jobs]
    done, pending = wait(futures, return_when=FIRST_EXCEPTION)
    for f in pending:
        f.cancel()
    for f in futures:
        if f.done() and not f.cancelled() and f.exception() is not None:
            wait(pending)
            raise f.exception()  # type: ignore[misc]
    return [f.result() for f in futures]
