"""The committer: one designated rank's process commits each step, with no barrier and no listing.

Every rank writes its shards and then, atomically, its manifest
``step-N/gen-N/.reshard/ranks/<rank>.json``. The committer (by default the
lowest rank of the layouts) knows which ranks must write (the layouts say),
and in a background thread reads their manifests **by key**, in rank order:
one GET per manifest that is there, and while the first missing one is not,
one GET per poll with exponential backoff. Then it commits the step as an
ordinary reshard checkpoint (:func:`reshard.store.commit.protocol.commit`, with the
manifests it read) between two atomic writes of the index
``root/manager.json`` (the step flagged ``committing``, then confirmed: see
:mod:`.index`) and applies retention. A save costs no LIST request at all;
deleting a step that retention drops lists that step's folder once.

A read that fails raises (after the storage layer's retries): a missing
manifest is "not yet", a missing bucket or a refused request is an error,
never "nothing there". A save whose ranks do not all write within
``timeout`` seconds is given up: the failure is recorded in the index (so
ranks waiting for the commit raise instead of hanging) and the step's folder
is removed after the next successful commit.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np
from reshard.layouts import all_ranks
from reshard.layouts.errors import CheckpointExistsError, CommitConflictError, UncommittedCheckpointError

from ..commit.locks import lock_body, lock_is_stale
from ..commit.marker import generation_of, read_marker
from ..commit.protocol import commit
from ..format.manifests import describe_missing, has_written, read_manifest
from ..format.tree import LayoutSpec, resolve_layout
from ..io.storage import Storage
from .index import INDEX_KEY, Index, StepRecord, is_committed, read_index, step_dir, step_of, write_index
from .retention import Retention, delete_steps, plan, referenced, referenced_steps

#: First and longest pause between two polls of a missing manifest (seconds).
POLL_MIN = 0.005
POLL_MAX = 1.0
#: The root's job lock: held by the committer's process of the one job that saves to the root.
JOB_LOCK_KEY = "manager.lock"
#: Seconds after which a job lock not renewed is broken by another job (a live job renews it every quarter).
JOB_LEASE = 600.0


class Committer:
    """Commits steps of one manager root and keeps its index; runs in the committer rank's process.

    Parameters
    ----------
    root : Storage
        The manager's root.
    policy : Retention
        What to keep.
    timeout : float
        Seconds to wait for every rank's manifest before giving a step up.
    poll_max : float
        Longest pause between two polls of a missing manifest.
    stop : threading.Event, optional
        Set to abandon waiting (the manager is closing).
    """

    def __init__(self, root: Storage, policy: Retention, *, timeout: float, poll_max: float = POLL_MAX,
                 stop: threading.Event | None = None, in_flight: Callable[[int], bool] | None = None) -> None:
        self.root = root
        self.policy = policy
        self.timeout = timeout
        self.poll_max = poll_max
        self.stop = stop or threading.Event()
        #: Incremental managers: whether a save of a step may still commit (retention holds the steps it pinned).
        self.in_flight = in_flight
        self._index: Index | None = None
        self._abandoned: set[int] = set()
        #: Dropped steps whose objects a save still being written may reference (see :mod:`.retention`).
        self._held: dict[int, StepRecord] = {}
        #: This job's lock of the root (its content), once taken.
        self._job: bytes | None = None
        #: Requests of the last poll: ``(gets, waits)`` (for tests and benchmarks).
        self.last_poll = (0, 0)

    @property
    def index(self) -> Index:
        """The index as this committer last wrote it (read once; nobody else writes it)."""
        if self._index is None:
            self._index = read_index(self.root)
        return self._index

    # ----------------------------------------------------------- job lock
    def take_job_lock(self) -> None:
        """Take the root's job lock (``manager.lock``): one job saves to a root at a time.

        Two jobs saving to one root would mix their steps (the same step's shards
        from both) and overwrite each other's index. The lock is renewed by
        :meth:`renew_job_lock`; one whose holder is a dead process of this host,
        or that was not renewed for :data:`JOB_LEASE` seconds, is broken.

        Raises
        ------
        CommitConflictError
            If a live job holds it; the message names its host and process.
        """
        body = lock_body(JOB_LEASE)
        try:
            self.root.write_new(JOB_LOCK_KEY, body)
        except CheckpointExistsError:
            holder = self._job_holder()
            if holder is not None and not lock_is_stale(holder, time.time()):
                raise CommitConflictError(
                    f"{self.root.url}: another job saves to this root ({holder.get('host')} pid {holder.get('pid')}, "
                    f"lock renewed {time.time() - float(holder['time']):.0f} s ago): two jobs on one root would mix "
                    "their steps. Stop it or use another root; a job that died without closing its manager leaves "
                    f"a lock that is broken once its process is gone or after {JOB_LEASE:.0f} s "
                    f"(or delete {self.root.url}/{JOB_LOCK_KEY})") from None
            self.root.delete(JOB_LOCK_KEY, recursive=False)
            try:
                self.root.write_new(JOB_LOCK_KEY, body)
            except CheckpointExistsError:
                raise CommitConflictError(f"{self.root.url}: another job took this root's lock just now") from None
        self._job = body

    def renew_job_lock(self, ready: bool = False) -> None:
        """Rewrite this job's lock with the current time (a heartbeat); ``ready``: also say that
        :meth:`reconcile` is done, so the job's other ranks may write (:meth:`wait_ready`).

        Raises
        ------
        CommitConflictError
            If another job broke it meanwhile (this one was taken for dead).
        """
        if self._job is None:
            return
        holder = self._job_holder()
        theirs = holder.get("token") if isinstance(holder, dict) else None
        if theirs != json.loads(self._job)["token"]:
            self._job = None
            raise CommitConflictError(f"{self.root.url}: this job's lock of the root was taken by another job "
                                      "(this one looked dead for longer than its lease): saves stop here")
        self._job = json.dumps({**json.loads(self._job), "time": time.time(), **({"ready": True} if ready else {})
                                }).encode()
        self.root.write_atomic(JOB_LOCK_KEY, self._job)

    def wait_ready(self, timeout: float) -> None:
        """Wait until a live job holds the root's lock and has reconciled (ranks other than the committer's,
        before their first write: the committer's startup clean-up removes step folders it does not know).

        Raises
        ------
        UncommittedCheckpointError
            If no live, ready job lock appears within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        delay = POLL_MIN
        while True:
            holder = self._job_holder()
            if isinstance(holder, dict) and holder.get("ready") is True and not lock_is_stale(holder, time.time()):
                return
            if time.monotonic() >= deadline or self.stop.is_set():
                raise UncommittedCheckpointError(
                    f"{self.root.url}: the job's committer has not started its manager here within {timeout:.0f} s "
                    f"(no live, ready {JOB_LOCK_KEY}): a rank writes only once it has, so that the committer's "
                    "start-up clean-up of unknown step folders never removes a save in progress")
            self.stop.wait(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, self.poll_max)

    def _job_holder(self) -> Any:
        """The root's job lock as JSON (None if absent or not JSON)."""
        raw = self.root.read_if_exists(JOB_LOCK_KEY)
        try:
            return json.loads(raw) if raw is not None else None
        except ValueError:
            return None

    def release_job_lock(self) -> None:
        """Give the root's job lock back (the manager is closed), if this job still holds it."""
        if self._job is None:
            return
        raw = self.root.read_if_exists(JOB_LOCK_KEY)
        if raw is not None and raw == self._job:
            self.root.delete(JOB_LOCK_KEY, recursive=False)
        self._job = None

    # ------------------------------------------------------------ startup
    def reconcile(self) -> Index:
        """At startup: settle what a crashed committer left, remove uncommitted step folders.

        A record flagged ``committing`` is confirmed if its marker is there, else
        dropped with its folder; a step folder the index does not know is indexed
        if it holds a marker (written by an older reshard), else removed; the
        temporary of an index write that was killed is removed. One
        LIST of the root (per job, not per save), one GET per flagged record and
        per unknown folder. Ranks of other processes wait for it before their first
        write (:meth:`wait_ready`): a step folder being written now would be taken
        for a crashed job's leftover.
        """
        index = read_index(self.root)
        changed = False
        for record in [r for r in index.steps if r.committing]:
            if is_committed(self.root, record.step):
                index = index.with_step(replace(record, committing=False))
            else:
                index = index.without({record.step})
                self.root.delete(step_dir(record.step))
            changed = True
        known = set(index.numbers())
        needed = referenced(index.steps, known)  # retired steps whose objects kept steps reference
        for name in self.root.list(""):
            if name.startswith(f"{INDEX_KEY}.") and name.endswith(".tmp"):  # a crashed index write's temporary
                self.root.delete(name)
                continue
            step = step_of(name)
            if step is None or step in needed:
                continue
            found = read_marker(self.root.child(name))
            if found is not None:  # committed, but the committer died before indexing it
                index = index.with_step(StepRecord(step=step, time=found[0].time))
                changed = True
            else:
                self.root.delete(name)
        if changed:
            write_index(self.root, index)
        self._index = index
        return index

    # ------------------------------------------------------------- commit
    def poll(self, step: int, expected: list[int]) -> dict[int, dict[str, Any]]:
        """Every expected rank's manifest of ``step``, read by key as each appears.

        Raises
        ------
        UncommittedCheckpointError
            If some rank has not written within the timeout (or the manager closes).
        """
        sid = str(step)
        gen = self.root.child(step_dir(step)).child(generation_of(sid))
        pending = sorted(expected)
        got: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.timeout
        delay, gets, waits = POLL_MIN, 0, 0
        while pending:
            rank = pending[0]
            try:
                doc = read_manifest(gen, rank)  # one GET; checked (schema, digest) like every manifest read
            except FileNotFoundError:
                doc = None
            gets += 1
            if doc is not None and doc.get("save_id") == sid:  # else a stale manifest of an earlier attempt
                got[rank] = doc
                pending.pop(0)
                delay = POLL_MIN
                continue
            if time.monotonic() >= deadline or self.stop.is_set():
                self.last_poll = (gets, waits)
                pending = [r for r in pending if not has_written(gen, r)]  # name only the absent
                why = "the manager was closed" if self.stop.is_set() else f"after {self.timeout:.0f} s"
                raise UncommittedCheckpointError(
                    describe_missing(self.root.child(step_dir(step)).url, pending, got)
                    + f" (gave up {why}; step {step} is abandoned)")
            waits += 1
            self.stop.wait(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, self.poll_max)
        self.last_poll = (gets, waits)
        return got

    def commit_step(self, step: int, expected: list[int], metrics: dict[str, float] | None = None) -> StepRecord:
        """Wait for the ranks of ``step``, commit it, index it, apply retention."""
        try:
            manifests = self.poll(step, expected)
            record = StepRecord(step=step, time=time.time(), metrics=dict(metrics or {}),
                                refs=referenced_steps(manifests), committing=True)
            self._index = self.index.with_step(record)
            write_index(self.root, self._index)  # before the marker: readers confirm it by the marker
            marker = commit(self.root.child(step_dir(step)), save_id=str(step), manifests=manifests)
        except BaseException as e:
            self.record_failure(step, f"{type(e).__name__}: {e}")
            raise
        record = replace(record, time=marker.time, committing=False)
        index = self.index.with_step(record)
        _, doomed = plan(index, self.policy)
        kept = index.without(set(doomed))
        write_index(self.root, kept)
        self._index = kept
        check = self.in_flight
        in_flight = None if check is None else (lambda n: n != step and check(n))
        self._held = delete_steps(self.root, [r for r in index.steps if r.step in doomed], kept, held=self._held,
                                  in_flight=in_flight)
        for old in sorted(s for s in self._abandoned if s < step and s not in kept.numbers()):
            self.root.delete(step_dir(old))
            self._abandoned.discard(old)
        return record

    def record_failure(self, step: int, message: str) -> None:
        """Say in the index that ``step`` was given up (waiting ranks raise with ``message``)."""
        found = self.index.get(step)
        if found is not None and not found.committing:
            return  # committed already (e.g. a repeated save of it was refused): nothing was abandoned
        self._abandoned.add(step)
        try:
            self._index = self.index.without({step}).with_failure(step, message)
            write_index(self.root, self._index)
        except Exception:  # the original failure is what the caller raises
            pass


def all_layout_ranks(layouts: LayoutSpec, shapes: Mapping[str, tuple[int, ...]] | None) -> list[int]:
    """Every rank the layouts name (``layouts`` a mapping, or a rule resolved over ``shapes``; else none)."""
    if isinstance(layouts, Mapping):
        found = list(layouts.values())
    elif shapes:
        found = [resolve_layout(layouts, n, tuple(s)) for n, s in shapes.items()]
    else:
        return []
    return sorted(all_ranks(found))


def process_ranks(rank: int | Iterable[int] | None, committer: int) -> set[int]:
    """The ranks this process saves, as far as it can tell."""
    if rank is not None:
        return {int(rank)} if isinstance(rank, int | np.integer) else {int(r) for r in rank}
    if os.environ.get("RANK", "").isdigit():
        return {int(os.environ["RANK"])}
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return {int(dist.get_rank())}
    jax = sys.modules.get("jax")
    if jax is not None and jax.process_count() > 1:
        return {committer} if jax.process_index() == 0 else set()
    return {committer}  # no distributed job in sight: this process is the only one
