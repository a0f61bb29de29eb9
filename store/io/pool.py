"""The shared I/O thread pools.

File reads, writes and crc32c release the GIL, so a few threads keep a disk or
a network link busy. Local files get ``max(2, cores)`` threads: reads from the
page cache are memory copies, and more threads than cores only contend
(measured on 2 cores, 1 GiB: 2 threads 0.21 s, 8 threads 0.29 s). Remote
stores get 16 more, to keep requests in flight across their latency.
``RESHARD_IO_THREADS`` overrides both.

Many small local jobs (5,000 tensors of a few KiB) are batched: a job costs
tens of microseconds of Python, and handing each to a thread (a future, a
wake-up, the GIL changing hands) costs more than the job itself.

The pools are per process: a child made by ``fork`` (Linux's default start
method up to Python 3.13) inherits the parent's pool objects but not their
threads, so jobs submitted there would wait forever. ``os.register_at_fork``
drops them (and renews the lock, which a parent thread may have held at the
fork) in the child, which then makes its own on first use.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
_pools: dict[bool, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def _forget_after_fork() -> None:
    """In a forked child: the inherited pools have no threads; start afresh."""
    global _lock
    _pools.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def io_threads(local: bool = True) -> int:
    """Size of the pool for local files (``local=True``) or remote stores."""
    env = os.environ.get("RESHARD_IO_THREADS")
    if env:
        return max(1, int(env))
    cores = max(2, os.cpu_count() or 2)
    return cores if local else cores + 16


def pool(local: bool = True) -> ThreadPoolExecutor:
    with _lock:
        if local not in _pools:
            _pools[local] = ThreadPoolExecutor(io_threads(local), thread_name_prefix="reshard-io")
        return _pools[local]


def run_all(jobs: Iterable[Callable[[], T]], local: bool = True) -> list[T]:
    """Run jobs on a pool; the first failure cancels the rest and is raised.

    Called from inside a pool thread, the jobs run inline (no nested waiting).
    """
    jobs = list(jobs)
    if len(jobs) <= 1 or threading.current_thread().name.startswith("reshard-io"):
        return [job() for job in jobs]
    futures: list[Future[T]] = [pool(local).submit(job) for job in jobs]
    _, pending = wait(futures, return_when=FIRST_EXCEPTION)
    for f in pending:
        f.cancel()
    for f in futures:
        if f.done() and not f.cancelled() and f.exception() is not None:
            wait(pending)
            raise f.exception()  # type: ignore[misc]
    return [f.result() for f in futures]


#: Local jobs are grouped into batches of at least this many bytes (one pool job each);
#: a job counts its bytes plus ``JOB_BYTES`` for its fixed cost (so at most 16 jobs a batch).
BATCH_BYTES = 1 << 20
JOB_BYTES = 64 << 10


def run_batched(jobs: Iterable[Callable[[], T]], sizes: Iterable[int], local: bool = True) -> list[T]:
    """:func:`run_all`, with local jobs grouped in order into batches of ``BATCH_BYTES``.

    ``sizes`` gives each job's bytes. Remote jobs are never batched: each is a
    request whose latency other requests should overlap.
    """
    jobs = list(jobs)
    if not local:
        return run_all(jobs, local)
    batches: list[list[Callable[[], T]]] = [[]]
    filled = 0
    for job, n in zip(jobs, sizes, strict=True):
        if filled >= BATCH_BYTES:
            batches.append([])
            filled = 0
        batches[-1].append(job)
        filled += n + JOB_BYTES
    done = run_all([functools.partial(_run_batch, b) for b in batches if b], local)
    return [r for batch in done for r in batch]


def _run_batch(jobs: list[Callable[[], T]]) -> list[T]:
    return [job() for job in jobs]
