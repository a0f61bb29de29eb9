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

import threading
import time
from dataclasses import replace
from typing import Any

from reshard.layouts.errors import UncommittedCheckpointError

from ..commit.protocol import commit, generation_of, read_marker
from ..format.manifests import describe_missing, has_written, read_manifest
from ..io.storage import Storage
from .index import INDEX_KEY, Index, StepRecord, is_committed, read_index, step_dir, step_of, write_index
from .retention import Retention, delete_steps, plan, referenced, referenced_steps

#: First and longest pause between two polls of a missing manifest (seconds).
POLL_MIN = 0.005
POLL_MAX = 1.0


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
                 stop: threading.Event | None = None) -> None:
        self.root = root
        self.policy = policy
        self.timeout = timeout
        self.poll_max = poll_max
        self.stop = stop or threading.Event()
        self._index: Index | None = None
        self._abandoned: set[int] = set()
        #: Requests of the last poll: ``(gets, waits)`` (for tests and benchmarks).
        self.last_poll = (0, 0)

    @property
    def index(self) -> Index:
        """The index as this committer last wrote it (read once; nobody else writes it)."""
        if self._index is None:
            self._index = read_index(self.root)
        return self._index

    # ------------------------------------------------------------ startup
    def reconcile(self) -> Index:
        """At startup: settle what a crashed committer left, remove uncommitted step folders.

        A record flagged ``committing`` is confirmed if its marker is there, else
        dropped with its folder; a step folder the index does not know is indexed
        if it holds a marker (written by an older reshard), else removed; the
        temporary of an index write that was killed is removed. One
        LIST of the root (per job, not per save), one GET per flagged record and
        per unknown folder. Call it before any rank saves (a step folder being
        written now would be taken for a crashed job's leftover).
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
        delete_steps(self.root, [r for r in index.steps if r.step in doomed], kept)
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

