"""How graph tasks run: fusion, the in-flight byte budget, schedulers, progress bars.

The machinery that :func:`reshard.store.read.graph.load_many`,
:func:`reshard.store.redivide` and :func:`reshard.store.read.export.export` share
(see ``docs/dask.md``): :func:`fusion_cap` and :func:`fuse` group small
operations into tasks, :class:`Budget` bounds the bytes tasks hold at once in
one process, :func:`run` computes a graph on threads, inline or on a
``dask.distributed`` cluster (bars: :mod:`reshard.store.io.progress`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("reshard")

#: Fused operations one task may carry when fusion is on by default (``RESHARD_FUSION=-1``).
DEFAULT_FUSION_CAP = 1000
#: Bytes of tensor data one fused task may carry (a larger single operation runs alone).
DEFAULT_FUSE_BYTES = 16 << 20
#: Bytes of tensor data redivide and export hold in flight per process.
DEFAULT_BUDGET = 256 << 20
_OFF = ("0", "off", "false", "no", "none")


# ------------------------------------------------------------------ fusion
def fusion_cap(fusion: int | str | None = None) -> int:
    """The effective fusion cap: fused operations per task, 0 when off.

    Parameters
    ----------
    fusion : int or str, optional
        ``None`` reads the environment variable ``RESHARD_FUSION``. Either way:
        unset or ``-1`` gives the default cap (:data:`DEFAULT_FUSION_CAP`); a
        positive int is the cap; ``0``/``off``/``false``/``no`` turns fusion
        *and* reuse off (one task per tensor region and per rank: the naive
        graph). Anything else turns them off too, with a warning.

    The effective value is logged at INFO on the ``reshard`` logger.
    """
    origin = "argument"
    if fusion is None:
        env = os.environ.get("RESHARD_FUSION")
        fusion, origin = (-1, "default") if env is None else (env, f"RESHARD_FUSION={env!r}")
    text = str(fusion).strip().lower()
    try:
        value = int(text)
    except ValueError:
        value = 0
        if text not in _OFF:
            log.warning("reshard: fusion setting %r (%s) is not -1, a positive int or off; fusion off",
                        fusion, origin)
    cap = DEFAULT_FUSION_CAP if value == -1 else max(0, value)
    if value < -1:
        log.warning("reshard: fusion setting %r (%s) is negative; fusion off", fusion, origin)
    log.info("reshard: MAX_FUSED_OPS: %d (%s)%s", cap, origin, "" if cap else ": fusion and reuse off")
    return cap


def fuse(ops: Sequence[T], nbytes: Callable[[T], int], cap: int, max_bytes: int) -> list[list[T]]:
    """Group consecutive operations into tasks of at most ``cap`` ops and ``max_bytes`` bytes.

    An operation larger than ``max_bytes`` gets a task of its own; ``cap=0``
    gives one task per operation.
    """
    if cap <= 0:
        return [[op] for op in ops]
    groups: list[list[T]] = []
    group: list[T] = []
    size = 0
    for op in ops:
        n = nbytes(op)
        if group and (len(group) >= cap or size + n > max_bytes):
            groups.append(group)
            group, size = [], 0
        group.append(op)
        size += n
    if group:
        groups.append(group)
    return groups


# ------------------------------------------------------------------ budget
class Budget:
    """A byte semaphore: at most ``limit`` bytes of task data in flight.

    A task asking for more than ``limit`` waits until nothing else is in
    flight and then runs alone. ``peak`` is the most bytes held at once.
    """

    def __init__(self, limit: int) -> None:
        self.limit = max(1, int(limit))
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        n = max(0, int(nbytes))
        with self._cond:
            self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
            self.peak = max(self.peak, self.used)
        try:
            yield
        finally:
            with self._cond:
                self.used -= n
                self._cond.notify_all()


@dataclass(frozen=True)
class BudgetRef:
    """Names one operation's :class:`Budget` in every process that runs its tasks."""

    token: str
    limit: int

    @classmethod
    def new(cls, limit: int) -> BudgetRef:
        if int(limit) < 1:
            raise ValueError(f"budget must be a positive number of bytes, got {limit!r}")
        return cls(uuid.uuid4().hex, int(limit))


_budgets: OrderedDict[str, Budget] = OrderedDict()  # token -> this process's budget
_lock = threading.Lock()


def _renew_lock() -> None:  # a forked child gets a fresh lock (a parent thread may have held it at the fork)
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_renew_lock)


def budget(ref: BudgetRef) -> Budget:
    """This process's :class:`Budget` for ``ref`` (the limit applies per process)."""
    with _lock:
        if ref.token not in _budgets:
            _budgets[ref.token] = Budget(ref.limit)
            while len(_budgets) > 64:
                _budgets.popitem(last=False)
        return _budgets[ref.token]


def release(ref: BudgetRef) -> None:
    """Forget an operation's budget in this process."""
    with _lock:
        _budgets.pop(ref.token, None)


# -------------------------------------------------------------- scheduling
def run(dsk: Mapping[Any, Any], keys: list[Any], scheduler: Any = None, bar: Any = None) -> list[Any]:
    """Compute ``keys`` of a task graph; the first failing task's exception is raised.

    Parameters
    ----------
    dsk : mapping
        ``{key: (function, record)}``.
    keys : list
        The keys to return, in order.
    scheduler : None, "threads", "sync" or dask.distributed.Client
        Threads of this process (default), inline (debugging), or a cluster.
    bar : tqdm, optional
        Advanced once per finished key.
    """
    if scheduler is None or scheduler == "threads":
        import dask.threaded

        with _bar_callback(bar, keys):
            return list(dask.threaded.get(dsk, keys))
    if scheduler in ("sync", "synchronous"):
        import dask.local

        with _bar_callback(bar, keys):
            return list(dask.local.get_sync(dsk, keys))
    if hasattr(scheduler, "get") and hasattr(scheduler, "gather"):
        return _run_client(scheduler, dsk, keys, bar)
    raise ValueError(f"scheduler must be None, 'threads', 'sync' or a dask.distributed.Client, got {scheduler!r}")


def _run_client(client: Any, dsk: Mapping[Any, Any], keys: list[Any], bar: Any) -> list[Any]:
    from distributed import as_completed

    futures = client.get(dict(dsk), keys, sync=False)
    try:
        for f in as_completed(futures):
            if f.status != "finished":
                f.result()  # raises the task's own exception at the first failure
            if bar is not None:
                bar.update(1)
        return list(client.gather(futures))
    finally:
        client.cancel(futures)  # on failure or Ctrl-C nothing keeps running; on success frees their memory


def _bar_callback(bar: Any, keys: list[Any]) -> Any:
    """A dask callback advancing ``bar`` as keys finish on a local scheduler."""
    if bar is None:
        return contextlib.nullcontext()
    from dask.callbacks import Callback

    wanted = set(keys)
    return Callback(posttask=lambda key, *_: bar.update(1) if key in wanted else None)
