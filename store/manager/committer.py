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

A rank that refuses a step (:meth:`CheckpointManager.refuse`: its save was
refused before it wrote anything) says so beside the step; while the committer
waits for that rank's manifest it also reads that note (once it has waited a
few tenths of a second), and gives the step up at once, with the rank's reason.

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
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import numpy as np
from reshard.layouts import all_ranks
from reshard.layouts.errors import CommitConflictError, JobSupersededError, UncommittedCheckpointError

from ..commit import fence as fencing
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
#: Once a rank's manifest has been awaited this long (seconds), the committer also reads that rank's refusal note
#: (:func:`refusal_key`, one GET), then again at most once per poll and this often: a rank that refused the step
#: fails it at once, not at the commit timeout. Ranks that write promptly cost no extra request.
REFUSAL_POLL = 0.16
#: The root's job liveness hint (host, pid, heartbeat, fencing token): written by the committer's process of the
#: job that owns the root, for messages and warnings only (who may save is decided by :mod:`..commit.fence`).
JOB_LOCK_KEY = "manager.lock"
#: Seconds after which a hint not renewed reads as a dead job's (a live job renews it every quarter).
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
        #: This job's liveness hint in ``manager.lock`` (its content), once written.
        self._job: bytes | None = None
        #: This job's fencing token: taken by the committer's process, bound to by the others' at their first write.
        self.fence: fencing.Fence | None = None
        #: Set once a newer job took the root (the error saying so): this job writes neither the index nor a marker
        #: any more, and every later save of this process raises it.
        self.superseded: JobSupersededError | None = None
        #: Per step, this process's check that its job still owns the root (:meth:`check_step`).
        self._checks: dict[int, Future[None]] = {}
        self._checks_lock = threading.Lock()
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
        """Open the root for writing: take this job's fencing token (:mod:`reshard.store.commit.fence`).

        Never refused and never waits: a restarted job (same host in a fresh PID
        namespace, another host, any clock) takes the root at once, and any job
        that saved to it before is superseded (its next save or commit raises
        :class:`~reshard.store.JobSupersededError`; a commit never mixes the ranks
        of two jobs). The root's ``manager.lock`` is only a hint now (host, pid,
        heartbeat): a holder that still looks alive gives a warning, not a decision.
        """
        holder = self._job_holder()
        self.fence = fencing.take(self.root)
        if isinstance(holder, dict) and not lock_is_stale(holder, time.time()):
            warnings.warn(
                f"{self.root.url}: taking this root over from a job that may still be alive ({holder.get('host')} pid "
                f"{holder.get('pid')}, heartbeat {time.time() - float(holder['time']):.0f} s ago by this host's "
                f"clock): it is fenced (job {self.fence.token} supersedes it) and stops at its next save or commit",
                RuntimeWarning, stacklevel=3)
        self._job = lock_body(JOB_LEASE)
        self._write_hint()

    def renew_job_lock(self, ready: bool = False) -> None:
        """Refresh the job's liveness hint ``manager.lock`` (a heartbeat) if the job is still the newest;
        ``ready``: also say that :meth:`reconcile` is done, so the job's other ranks may write (:meth:`wait_ready`).

        Raises
        ------
        JobSupersededError
            If a newer job took the root meanwhile.
        """
        if self._job is None or self.fence is None:
            return
        self.check_current()
        if ready:
            fencing.mark_ready(self.root, self.fence)
        self._job = json.dumps({**json.loads(self._job), "time": time.time(), **({"ready": True} if ready else {})
                                }).encode()
        self._write_hint()

    def _write_hint(self) -> None:
        assert self._job is not None and self.fence is not None
        self._job = json.dumps({**json.loads(self._job), "fence": self.fence.token}).encode()
        self.root.write_atomic(JOB_LOCK_KEY, self._job)

    def check_current(self) -> None:
        """Refuse to go on if a newer job took the root (one GET; nothing to check without a token).

        Raises
        ------
        JobSupersededError
            Naming both jobs; from then on this committer writes neither the index nor a marker.
        """
        if self.fence is None:
            return
        try:
            fencing.check_current(self.root, self.fence)
        except JobSupersededError as e:
            self.superseded = e
            raise

    def check_step(self, step: int) -> None:
        """Before a write of ``step``: :meth:`check_current`, once per step per process (one GET); the process's
        other writes of the step wait for its answer.

        Raises
        ------
        JobSupersededError
            If a newer job took the root.
        """
        with self._checks_lock:
            check = self._checks.get(step)
            mine = check is None
            if check is None:
                check = self._checks[step] = Future()
                for old in sorted(self._checks)[:-4]:
                    del self._checks[old]
        if mine:
            try:
                self.check_current()
            except BaseException as e:
                check.set_exception(e)
            else:
                check.set_result(None)
        check.result()

    def raise_if_superseded(self, error: BaseException) -> None:
        """After a failure of this job: raise :class:`JobSupersededError` (from ``error``) if a newer job took the
        root (its start-up clean-up may be what made this job's request fail); else return. One GET, on failures
        only.
        """
        if isinstance(error, JobSupersededError) or self.fence is None:
            return
        try:
            self.check_current()
        except JobSupersededError as e:
            raise e from error
        except Exception:  # the storage fails: the original failure says more
            return

    def wait_ready(self, timeout: float) -> None:
        """Bind this process to its job's token: the newest one whose job is ready (ranks other than the
        committer's, before their first write: the committer's start-up clean-up removes step folders it does
        not know). Run after the committer's manager was constructed (as the manager's notes ask), the newest
        ready token is this job's own.

        Raises
        ------
        UncommittedCheckpointError
            If no ready token appears within ``timeout`` seconds.
        """
        self.fence = fencing.wait_ready(self.root, timeout, self.stop)

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
        per unknown folder, and a check of the job's token (one GET) after the LIST
        and before the deletes: a job superseded while it starts deletes nothing the
        newer job made (storage is linearizable: what the newer job made after its
        token is in no listing made before a check that saw no newer token). Ranks of
        other processes wait for it before their first write (:meth:`wait_ready`): a
        step folder being written now would be taken for a crashed job's leftover.
        """
        index = read_index(self.root)
        changed = False
        for record in [r for r in index.steps if r.committing]:
            if is_committed(self.root, record.step):
                index = index.with_step(replace(record, committing=False))
            else:
                index = index.without({record.step})
                self.check_current()  # before any delete: a job superseded while it starts removes nothing
                self.root.delete(step_dir(record.step))
            changed = True
        known = set(index.numbers())
        needed = referenced(index.steps, known)  # retired steps whose objects kept steps reference
        listed = self.root.list("")
        self.check_current()  # after the listing, before the deletes: nothing the newer job made since is listed
        for name in listed:
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
            self.check_current()
            write_index(self.root, index)
        self._index = index
        return index

    # ------------------------------------------------------------- commit
    def save_id(self, step: int) -> str:
        """The save id of this job's ``step``: ``"<step>-j<token>"`` (its folder ``step-<step>/gen-<step>-j<token>``).

        Each job writes a step into a folder of its own, so a superseded job's late writes (shards in the
        directory form, a rank's object in parts) never land in the folder of the job that took over.
        Without a token (a reading manager), ``"<step>"``.
        """
        return str(step) if self.fence is None else f"{step}-j{self.fence.token}"

    def poll(self, step: int, expected: list[int]) -> dict[int, dict[str, Any]]:
        """Every expected rank's manifest of ``step``, read by key as each appears.

        Raises
        ------
        UncommittedCheckpointError
            If some rank has not written within the timeout (or the manager closes).
        """
        sid = self.save_id(step)
        gen = self.root.child(step_dir(step)).child(generation_of(sid))
        pending = sorted(expected)
        got: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.timeout
        delay, gets, waits = POLL_MIN, 0, 0
        refusal_check = time.monotonic() + REFUSAL_POLL  # when to look for the awaited rank's refusal next
        while pending:
            rank = pending[0]
            try:
                doc = read_manifest(gen, rank)  # one GET; checked (schema, digest) like every manifest read
            except FileNotFoundError:
                doc = None
            gets += 1
            if doc is not None and doc.get("save_id") == sid:  # else a stale manifest of an earlier attempt
                self._check_token(step, rank, doc)
                got[rank] = doc
                pending.pop(0)
                delay = POLL_MIN
                refusal_check = time.monotonic() + REFUSAL_POLL
                continue
            if time.monotonic() >= deadline or self.stop.is_set():
                self.last_poll = (gets, waits)
                pending = [r for r in pending if not has_written(gen, r)]  # name only the absent
                why = "the manager was closed" if self.stop.is_set() else f"after {self.timeout:.0f} s"
                raise UncommittedCheckpointError(
                    describe_missing(self.root.child(step_dir(step)).url, pending, got)
                    + f" (gave up {why}; step {step} is abandoned)" + self._refusals(step, pending))
            if time.monotonic() >= refusal_check:  # one GET: did the awaited rank refuse the step?
                gets += 1
                said = self._refusals(step, [rank])
                if said:
                    self.last_poll = (gets, waits)
                    waited = self.timeout - (deadline - time.monotonic())
                    raise UncommittedCheckpointError(
                        describe_missing(self.root.child(step_dir(step)).url, [rank], got)
                        + f" (gave up after {waited:.1f} s, not waiting for the {self.timeout:.0f} s timeout: rank "
                        f"{rank} refused this step, so it cannot commit; step {step} is abandoned)" + said)
                refusal_check = time.monotonic() + max(REFUSAL_POLL, delay)
            waits += 1
            self.stop.wait(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, self.poll_max)
        self.last_poll = (gets, waits)
        return got

    def _refusals(self, step: int, missing: list[int]) -> str:
        """Why missing ranks wrote nothing, as they said (:meth:`CheckpointManager.refuse`); failures only: one GET
        per missing rank, at most 8."""
        said = []
        for rank in missing[:8]:
            try:
                raw = self.root.read_if_exists(refusal_key(step, rank))
                note = json.loads(raw) if raw is not None else None
            except Exception:
                continue
            job = note.get("job") if isinstance(note, dict) else None
            if isinstance(note, dict) and (job is None or self.fence is None or job == self.fence.token):
                said.append(f"rank {rank} refused to save: {note.get('reason')}")
        return "; " + "; ".join(said) if said else ""

    def _check_token(self, step: int, rank: int, doc: dict[str, Any]) -> None:
        """Refuse a manifest written by another job than this one (its fencing token says).

        Raises
        ------
        JobSupersededError
            If a newer job wrote it (this job is superseded).
        CommitConflictError
            If an older job (superseded, still running) wrote it: the step is not committed, naming both jobs.
        """
        if self.fence is None:
            return
        token = fencing.manifest_token(doc)
        if token == self.fence.token:
            return
        if token is not None and token > self.fence.token:
            self.check_current()  # raises, naming the newer job
        where = self.root.child(step_dir(step)).url
        raise CommitConflictError(
            f"{where}: rank {rank}'s manifest was written by {fencing.describe_token(self.root, token)}, not by this "
            f"job, {self.fence.describe()}: a superseded job still saves this step; step {step} is not committed "
            "(a step never holds ranks of two jobs)")

    def commit_step(self, step: int, expected: list[int], metrics: dict[str, float] | None = None) -> StepRecord:
        """Wait for the ranks of ``step``, commit it, index it, apply retention."""
        try:
            manifests = self.poll(step, expected)
            self.check_current()  # one GET: a superseded job writes neither the index nor a marker
            record = StepRecord(step=step, time=time.time(), metrics=dict(metrics or {}),
                                refs=referenced_steps(manifests), committing=True)
            self._index = self.index.with_step(record)
            write_index(self.root, self._index)  # before the marker: readers confirm it by the marker
            marker = commit(self.root.child(step_dir(step)), save_id=self.save_id(step), manifests=manifests,
                            before_marker=self.check_current)  # and again last: the window is one request
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
        if self.superseded or (found is not None and not found.committing):  # the index is a newer job's now
            return  # committed already (e.g. a repeated save of it was refused): nothing was abandoned
        self._abandoned.add(step)
        try:
            self.check_current()  # one GET, on failures only: a newer job's index is not this job's to write
            self._index = self.index.without({step}).with_failure(step, message)
            write_index(self.root, self._index)
        except Exception:  # the original failure is what the caller raises (superseded: explained by the manager)
            pass


def refusal_key(step: int, rank: int) -> str:
    """Where a rank says why it writes nothing of ``step`` (beside the step's pins)."""
    return f"{step_dir(step)}/.reshard/refused/{int(rank)}.json"


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
