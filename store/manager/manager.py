"""``CheckpointManager``: numbered steps under one root, async saves, retention, resume.

Layout of a root::

    root/manager.json          the index: committed steps and their metrics (committer only)
    root/.reshard/fence/       job tokens: the newest job owns the root (:mod:`reshard.store.commit.fence`)
    root/manager.lock          the owning job's liveness hint (host, pid, heartbeat): messages only
    root/step-<N>/             one ordinary reshard checkpoint per step (rs.open reads it)
    root/step-<N>/gen-<N>/...  its save (shards, manifests, metadata)

Every rank calls ``save(step, rank, local_state)``: its tensors are copied to
host staging buffers and a background thread writes them and the rank's
manifest. The committer rank's process (the lowest rank of the layouts unless
``committer=`` says otherwise) also commits each step once every rank's
manifest is there, reading them by key (see :mod:`.committer`): no barrier,
no listing. Only committed steps are in the index, so ``steps()`` and
``latest_step()`` never show a step being written or abandoned.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import numpy as np
from reshard.layouts.errors import JobSupersededError, UncommittedCheckpointError

from ..format.grid import writes_any
from ..format.manifests import read_manifest
from ..format.tree import LayoutSpec, flatten, to_json
from ..io.storage import Storage
from ..write.writer import CheckpointWriter
from .committer import JOB_LEASE, Committer, all_layout_ranks, process_ranks, refusal_key
from .index import StepRecord, committed_steps, metrics_of, read_index, step_dir
from .reads import StepReads
from .retention import Retention, pin
from .staging import StagingPool, as_host, host_dtype

#: Seconds the committer waits for every rank of a step before giving the step up.
DEFAULT_COMMIT_TIMEOUT = 600.0
#: Background threads writing saves (each write also uses the shared I/O pool).
SAVE_THREADS = 4
#: Incremental saves: how many times a base is chosen again when retention dropped the one chosen.
BASE_TRIES = 5


class CheckpointManager(StepReads):
    """Numbered checkpoints of a training run under one root.

    Parameters
    ----------
    url : str
        The root (local path or fsspec URL); created on the first save.
    layouts : mapping or callable, optional
        Saving layouts ``{name: Layout}`` (or a rule with ``shapes=``), the same
        on every rank. Without them the manager only reads (``steps``,
        ``open``, ``load``: an evaluator, a notebook) and never deletes anything.
    max_to_keep : int, optional
        Keep the latest this many committed steps (default: all).
    keep_every : int, optional
        Also keep every step that is a multiple of this.
    keep_best, best_metric, best_mode : optional
        Also keep the ``keep_best`` steps with the lowest (``best_mode="min"``)
        or highest ``best_metric``, as recorded by ``save(..., metrics=)``.
    async_save : bool
        ``save`` copies to staging buffers and returns; a background thread
        writes (default). False: ``save`` returns once this rank's data is
        written (the commit still happens in the committer's background).
    max_pending : int
        Saves per rank that may be staged at once (memory: this many copies of
        the rank's state). A save that finds them all still being written waits.
    rank : int or iterable of int, optional
        The rank(s) this process saves: the committer's process cleans up at
        startup what a crashed job left. Default: ``RANK`` from the
        environment, else ``torch.distributed``'s rank, else JAX's process
        index, else this process is taken to be the only one.
    committer : int, optional
        The rank whose process commits (default: the lowest rank of the layouts).
    commit_timeout : float
        Seconds the committer waits for every rank of a step before giving the
        step up (the failure surfaces on the committer's next ``save``/``wait``
        and on ``wait(committed=True)`` everywhere).
    poll_max : float
        Longest pause between two polls of a rank's manifest.
    incremental : bool
        Write each step in the packed form with the latest committed step as
        its base: shards whose bytes did not change are referenced, not
        written again (:mod:`reshard.store.write.incremental`). Retention keeps the
        objects a kept step references.
    storage_options : dict, optional
        fsspec options (credentials, endpoint...).
    **options
        As for :func:`reshard.store.create`: ``shapes``, ``compression``,
        ``checksums``, ``chunk_bytes``, ``engine``, ``durable`` (also for the
        index and the commit markers).

    Notes
    -----
    Construct the manager on every process before any of them saves (as at the
    start of training): the committer's constructor removes step folders that
    never committed, and would take a step being written for one of those.
    """

    def __init__(self, url: str, layouts: LayoutSpec | None = None, *, max_to_keep: int | None = None,
                 keep_every: int | None = None, keep_best: int | None = None, best_metric: str | None = None,
                 best_mode: str = "min", async_save: bool = True, max_pending: int = 1,
                 rank: int | Iterable[int] | None = None, committer: int | None = None,
                 commit_timeout: float = DEFAULT_COMMIT_TIMEOUT, poll_max: float = 1.0, incremental: bool = False,
                 storage_options: dict[str, Any] | None = None, **options: Any) -> None:
        self.url = str(url).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.root = Storage(self.url, self.storage_options, durable=options.get("durable", True))
        self.layouts = layouts
        self.options = options
        self.incremental = bool(incremental)
        if self.incremental:
            self.options = {**options, "form": "packed"}
        self.policy = Retention(max_to_keep, keep_every, keep_best, best_metric, best_mode)
        self.async_save = bool(async_save)
        self.staging = StagingPool(max_pending)
        self.expected = all_layout_ranks(layouts, options.get("shapes")) if layouts is not None else []
        self.committer_rank = int(committer) if committer is not None else (self.expected[0] if self.expected else 0)
        self._stop = threading.Event()
        self.committer = Committer(self.root, self.policy, timeout=float(commit_timeout), poll_max=poll_max,
                                   stop=self._stop, in_flight=self._in_flight if self.incremental else None)
        self._closing = threading.Event()
        # several writers: a process that saves many ranks (a simulation, a single-host job) writes them
        # side by side; one rank's saves never overlap by more than max_pending
        self._writes = ThreadPoolExecutor(SAVE_THREADS, thread_name_prefix="reshard-save")
        self._commits = ThreadPoolExecutor(1, thread_name_prefix="reshard-commit")
        self._lock = threading.Lock()
        self._pending: list[Future[None]] = []
        self._committing: dict[int, Future[StepRecord]] = {}
        self._errors: list[BaseException] = []
        self._last: dict[int, int] = {}
        self._writers: dict[int, CheckpointWriter] = {}
        self._closed = False
        self._heartbeat: threading.Thread | None = None
        #: Ranks of this process write once the committer has reconciled (another process's committer: waited for).
        self._ready = layouts is None or self.committer_rank in process_ranks(rank, self.committer_rank)
        if layouts is not None and self.committer_rank in process_ranks(rank, self.committer_rank):
            self.committer.take_job_lock()  # this job's fencing token: any earlier job on the root is superseded
            try:
                self.committer.reconcile()
                self.committer.renew_job_lock(ready=True)  # the other processes' ranks may write now
            except BaseException as e:
                self.committer.release_job_lock()
                self.committer.raise_if_superseded(e)  # a newer job's start-up removed what this one wrote?
                raise
            self._heartbeat = threading.Thread(target=self._renew_job_lock, name="reshard-job-lock", daemon=True)
            self._heartbeat.start()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.url!r})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(raise_errors=exc[0] is None)

    # -------------------------------------------------------------- saving
    def save(self, step: int, rank: int, local_state: Mapping[str, Any], *,
             metrics: Mapping[str, float] | None = None) -> None:
        """Save one rank's state as step ``step``; every rank of the layouts calls it with its own pieces.

        Parameters
        ----------
        step : int
            The training step (increasing; a step that is committed already is refused).
        rank : int
            The rank whose local pieces ``local_state`` holds.
        local_state : mapping
            Nested or dotted ``{name: local array or JSON leaf}``: numpy arrays,
            torch tensors (CPU or CUDA), jax arrays. With ``async_save`` it may
            be changed as soon as this returns.
        metrics : mapping, optional
            ``{name: number}`` recorded with the step (``keep_best``); the
            committer rank's are recorded.

        Raises
        ------
        Exception
            The failure of an earlier background write or commit of this process.
        """
        self.raise_errors()
        if self.committer.superseded is not None:  # every later save too: this job owns the root no more
            raise JobSupersededError(str(self.committer.superseded))
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self.layouts is None:
            raise ValueError(f"{self!r} was opened to read (no layouts): it cannot save")
        step = _step(step)
        found = metrics_of(metrics, step)
        tensors, leaves = flatten(local_state, self.layouts if isinstance(self.layouts, Mapping) else ())
        leaves = json.loads(json.dumps({n: to_json(v, n) for n, v in leaves.items()}))  # a copy the caller can't touch
        with self._lock:
            last = self._last.get(rank)
            if last is not None and step <= last:
                raise ValueError(f"{self.url}: rank {rank} saved step {last} already; steps must increase "
                                 f"(got {step})")
            self._last[rank] = step
        stand_ins = self._replicas(rank, tensors)  # pieces other ranks write: never copied
        tensors = {n: v for n, v in tensors.items() if n not in stand_ins}
        leaves.update(stand_ins)
        staged = self.staging.stage(rank, tensors, check=self.raise_errors) if self.async_save else None
        state = {**(staged.arrays if staged is not None else {n: as_host(v) for n, v in tensors.items()}), **leaves}
        written: Future[None] = Future()
        commit: Future[StepRecord] | None = Future() if rank == self.committer_rank else None
        with self._lock:
            self._pending = [f for f in self._pending if not f.done() or f.exception() is not None] + [written]
            if commit is not None:
                self._committing[step] = commit
        job = functools.partial(self._write_then_commit, step, rank, state, staged, written, commit, found)
        if staged is None:  # synchronous: this rank's failure is raised here
            job()
            if written.exception() is not None:
                with self._lock:
                    self._pending.remove(written)
                raise written.exception()  # type: ignore[misc]
            return
        try:
            self._writes.submit(job)  # the last thing save does: the writer thread may take the CPU at once
        except BaseException as e:
            staged.release()
            written.set_exception(e)
            raise

    def _write_then_commit(self, step: int, rank: int, state: dict[str, Any], staged: Any, written: Future[None],
                           commit: Future[StepRecord] | None, metrics: dict[str, float]) -> None:
        """Background job of a save: write, then (committer rank) hand the commit to the commit thread."""
        try:
            self._write(step, rank, state, staged)
        except BaseException as e:
            try:
                self.committer.raise_if_superseded(e)
            except JobSupersededError as superseded:
                e = superseded
            written.set_exception(e)
        else:
            written.set_result(None)
        if commit is not None:
            try:
                self._commits.submit(_settle, commit, self._commit, step, written, metrics)
            except RuntimeError as e:  # the manager was closed under us
                commit.set_exception(e)

    def refuse(self, step: int, rank: int, reason: str) -> None:
        """Say that ``rank`` writes nothing of ``step`` (its save was refused before anything was written).

        The reason goes to ``step-<N>/.reshard/refused/<rank>.json`` (one small PUT): a committer that gives
        the step up names it beside the missing rank. The committer's own rank records the failure in the
        index (after the commits queued before it), so that the other ranks' ``wait(committed=True)`` raise it
        without waiting for the commit timeout.
        """
        fence = self.committer.fence
        note = {"rank": int(rank), "step": int(step), "reason": reason, "time": time.time(),
                "job": None if fence is None else fence.token}
        try:
            self.root.write_atomic(refusal_key(step, rank), json.dumps(note).encode())
            if rank == self.committer_rank and self._ready:  # in the commit thread: it alone writes the index
                self._commits.submit(self.committer.record_failure, step, f"rank {rank} refused to save: {reason}")
        except Exception:  # the refusal itself is what the caller raises; the note only helps the message
            pass

    def _replicas(self, rank: int, tensors: dict[str, Any]) -> dict[str, np.ndarray]:
        """Zero-stride stand-ins for the pieces ``rank`` holds as a replica and writes nothing of."""
        if not isinstance(self.layouts, Mapping):
            return {}
        out = {}
        balance = self.options.get("balance", True)
        for name, value in tensors.items():
            layout = self.layouts.get(name)
            if layout is not None and layout.has_rank(rank) and not writes_any(layout, rank, balance):
                shape = tuple(int(n) for n in value.shape)
                out[name] = np.broadcast_to(np.zeros((), dtype=host_dtype(value)), shape)
        return out

    def _write(self, step: int, rank: int, state: dict[str, Any], staged: Any) -> None:
        try:
            if not self._ready:
                self.committer.wait_ready(self.committer.timeout)  # binds this process to its job's token
                self._ready = True
            else:  # one GET per step per process, in this writer thread: the caller's save sends nothing
                self.committer.check_step(step)
            if staged is not None:
                staged.ready()
            self._writer(step).write(rank, state)
        finally:
            if staged is not None:
                staged.release()

    def _writer(self, step: int) -> CheckpointWriter:
        assert self.layouts is not None  # save refuses a reading manager
        with self._lock:
            if step not in self._writers:
                for old in sorted(self._writers)[:-3]:
                    del self._writers[old]
                self._writers[step] = self._new_writer(step)
            return self._writers[step]

    def _new_writer(self, step: int) -> CheckpointWriter:
        """A writer of ``step``; incremental: on the latest committed step before it, pinned (see retention)."""
        assert self.layouts is not None  # save refuses a reading manager
        for _ in range(BASE_TRIES):
            base = self._base(step)
            try:
                fence = self.committer.fence
                return CheckpointWriter(f"{self.url}/{step_dir(step)}", self.layouts,
                                        save_id=self.committer.save_id(step), storage_options=self.storage_options,
                                        base=base, fence=None if fence is None else fence.token, **self.options)
            except UncommittedCheckpointError:
                if base is None:
                    raise
                # retention dropped that base between the index read and our pin: choose again
        raise UncommittedCheckpointError(f"{self.url}: step {step}: every base chosen was dropped by retention "
                                         f"before it could be used ({BASE_TRIES} tries)")

    def _base(self, step: int) -> str | None:
        """Incremental saves: the latest committed step before ``step`` (one GET of the index), pinned, if any.

        The pin is written before the base's marker is read (by the writer):
        retention removes a step's marker before it reads its pins, so a base
        that is dropped meanwhile is either seen gone here or kept for this save.
        """
        if not self.incremental:
            return None
        older = [r.step for r in committed_steps(self.root) if r.step < step]
        if not older:
            return None
        pin(self.root, older[-1], step)
        return f"{self.url}/{step_dir(older[-1])}"

    def _in_flight(self, step: int) -> bool:
        """Whether a save of ``step`` may still commit, as the committer's process sees it.

        The committer's rank saves every step: a step it saved whose commit is
        not done, or one it has not saved yet (other ranks may be writing it).
        """
        with self._lock:
            commit = self._committing.get(step)
            last = self._last.get(self.committer_rank)
        return (commit is not None and not commit.done()) or last is None or step > last

    def _renew_job_lock(self) -> None:
        """Heartbeat of the root's liveness hint (and a token check), until the manager closes."""
        while not self._closing.wait(JOB_LEASE / 4):
            try:
                self.committer.renew_job_lock()
            except BaseException as e:
                with self._lock:
                    self._errors.append(e)
                return

    def _commit(self, step: int, written: Future[None], metrics: dict[str, float]) -> StepRecord:
        try:
            written.result()
        except BaseException as e:
            self.committer.record_failure(step, f"the committer's own write failed: {type(e).__name__}: {e}")
            raise
        try:
            return self.committer.commit_step(step, self._expected_for(step), metrics)
        except BaseException as e:
            self.committer.raise_if_superseded(e)
            raise

    def _expected_for(self, step: int) -> list[int]:
        if self.expected:
            return self.expected
        writer = self._writer(step)  # a rule without shapes: the committer's own manifest says
        return [int(r) for r in read_manifest(writer.storage, self.committer_rank)["expected_ranks"]]

    # ------------------------------------------------------------- waiting
    def raise_errors(self) -> None:
        """Raise the first failure of a background write or commit of this process (once; later ones as a note)."""
        with self._lock:
            futures: list[Future[Any]] = [*self._pending, *self._committing.values()]
            for f in futures:
                error = f.exception() if f.done() and not f.cancelled() else None
                if error is not None:
                    self._errors.append(error)
            self._pending = [f for f in self._pending if not f.done()]
            self._committing = {s: f for s, f in self._committing.items() if not f.done()}
            if self._errors:
                first, rest = self._errors[0], self._errors[1:]
                self._errors = []
                if rest:
                    first.add_note(f"(and {len(rest)} more background failure(s) of this process: "
                                   + "; ".join(f"{type(e).__name__}: {e}" for e in rest[:3]) + ")")
                raise first

    def wait(self, committed: bool = False, timeout: float | None = None) -> None:
        """Block until this process's saves are written (and, with ``committed``, committed).

        ``committed=True`` on any rank waits until the last step this process
        saved is committed by the committer (polling the index: one GET each
        time, with backoff), so that it can be read.

        Raises
        ------
        Exception
            A failure of a background write or commit of this process.
        UncommittedCheckpointError
            The committer gave the step up (a rank did not write in time).
        TimeoutError
            ``timeout`` seconds passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            pending = list(self._pending)
            commits = dict(self._committing)
            step = max(self._last.values(), default=None)
        _wait_all(pending, deadline)
        if committed and step is not None:
            if step in commits:  # every commit this process runs: steps may finish writing out of order
                _wait_all(list(commits.values()), deadline)
            else:
                self._wait_index(step, deadline)
        self.raise_errors()

    def _wait_index(self, step: int, deadline: float | None) -> None:
        delay = 0.01
        while True:
            index = read_index(self.root)
            if any(r.step >= step for r in committed_steps(self.root, index)):
                return
            if step in index.failed:
                raise UncommittedCheckpointError(f"{self.url}: step {step} was not committed: {index.failed[step]}")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self.url}: step {step} is not committed yet")
            time.sleep(delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)

    def close(self, raise_errors: bool = True) -> None:
        """Finish this process's writes and commits, then stop the background threads."""
        if self._closed:
            return
        try:
            with self._lock:
                pending: list[Future[Any]] = [*self._pending, *self._committing.values()]
            wait_futures(pending)
        finally:
            self._closed = True
            self._writes.shutdown(wait=True)
            self._commits.shutdown(wait=True)
            self._closing.set()
            if self._heartbeat is not None:
                self._heartbeat.join(timeout=10)
                self.committer.release_job_lock()
        if raise_errors:
            self.raise_errors()


def _settle(target: Future[Any], fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` and put its result or failure in ``target``."""
    try:
        target.set_result(fn(*args))
    except BaseException as e:
        target.set_exception(e)


def _step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return int(step)


def _wait_all(futures: list[Future[Any]], deadline: float | None) -> None:
    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
    _, pending = wait_futures(futures, timeout=remaining)
    if pending:
        raise TimeoutError(f"{len(pending)} background save(s) still running")
