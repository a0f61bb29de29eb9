"""The reading half of :class:`~.manager.CheckpointManager`: its committed steps, and a restore that never
returns a step older than one this process saved.

:class:`StepReads` holds no state of its own: the manager sets the attributes it names (the root, its URL and
options, the committer, and the steps this process saved) and defines :meth:`StepReads.wait`.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from reshard.layouts.errors import CheckpointNotFoundError, UncommittedCheckpointError

from ..format.tree import LayoutSpec
from ..io.storage import Storage
from ..read.checkpoint import Checkpoint
from ..read.open import open as open_checkpoint
from .committer import Committer
from .index import committed_steps, read_index, step_dir


class StepReads:
    """Committed steps of a manager's root: list, open and load them (see :class:`~.manager.CheckpointManager`)."""

    url: str
    root: Storage
    storage_options: dict[str, Any]
    committer: Committer
    _lock: threading.Lock
    #: The newest step each rank of this process saved.
    _last: dict[int, int]

    def wait(self, committed: bool = False, timeout: float | None = None) -> None:
        """Wait for this process's saves (defined by the manager)."""
        raise NotImplementedError

    def steps(self) -> list[int]:
        """The committed steps, ascending (one GET of the index; a failed read raises)."""
        return [r.step for r in committed_steps(self.root)]

    def latest_step(self) -> int | None:
        """The latest committed step, or None if none is."""
        steps = self.steps()
        return steps[-1] if steps else None

    def restorable_step(self) -> int | None:
        """The latest committed step once this process's own saves are committed: never an older one.

        A save that returned may still be committing (its commit runs in the background); a restore
        right after it waits for that commit (at most the commit timeout) instead of returning the step
        before it.

        A step of this process's that the committer gave up (a rank refused it or did not write in time) never
        commits: a :class:`RuntimeWarning` names it and why, and the newest committed step is returned.

        Raises
        ------
        TimeoutError
            Naming the step still committing when the commit timeout passes first.
        """
        with self._lock:
            mine = max(self._last.values(), default=None)
        if mine is not None:
            try:
                self.wait(committed=True, timeout=self.committer.timeout)
            except TimeoutError as e:
                raise TimeoutError(f"{self.url}: step {mine}, saved by this process, is still committing after "
                                   f"{self.committer.timeout:.0f} s (restore a step by number to read an older "
                                   "one)") from e
            except UncommittedCheckpointError as e:
                self._given_up(e)
        return self.latest_step()

    def _given_up(self, error: UncommittedCheckpointError) -> None:
        """A step this process saved was given up (it will never commit): warn, naming it and why, so that the
        restore takes the newest committed step; re-raise ``error`` if the index records no such step."""
        index = read_index(self.root)
        latest = self.latest_step()
        lost = {s: why for s, why in index.failed.items() if latest is None or s > latest}
        if not lost:
            raise error
        warnings.warn(f"{self.url}: " + "; ".join(f"step {s} was given up ({why})" for s, why in sorted(lost.items()))
                      + (f"; restoring step {latest}, the newest committed step" if latest is not None else
                         "; no step is committed"), RuntimeWarning, stacklevel=3)

    def settle(self, step: int) -> None:
        """Before reading ``step`` by number: if this process saved it and it is not committed yet, wait for this
        process's commits (at most the commit timeout), so that a load right after the save reads it rather
        than finding it "never committed". A step this process did not save, or a committed one: one GET at most.

        Raises
        ------
        UncommittedCheckpointError
            If the committer gave a step of this process up.
        TimeoutError
            Naming the step still committing when the commit timeout passes first.
        """
        with self._lock:
            mine = max(self._last.values(), default=None)
        if mine is None or step > mine or step in self.steps():
            return
        try:
            self.wait(committed=True, timeout=self.committer.timeout)
        except TimeoutError as e:
            raise TimeoutError(f"{self.url}: step {step}, saved by this process, is still committing after "
                               f"{self.committer.timeout:.0f} s") from e

    def metrics(self, step: int) -> dict[str, float]:
        """The metrics recorded with a committed step."""
        record = next((r for r in committed_steps(self.root) if r.step == step), None)
        if record is None:
            raise CheckpointNotFoundError(f"{self.url}: step {step} is not a committed step")
        return dict(record.metrics)

    def open(self, step: int | None = None, **options: Any) -> Checkpoint:
        """Open a committed step (default: the latest, see :meth:`restorable_step`) as a lazy :class:`Checkpoint`."""
        if step is None:
            step = self.restorable_step()
            if step is None:
                raise CheckpointNotFoundError(f"{self.url}: no committed step")
        else:
            self.settle(step)
        options.setdefault("storage_options", self.storage_options)
        return open_checkpoint(f"{self.url}/{step_dir(step)}", **options)

    def load(self, layouts: LayoutSpec, rank: int, *, step: int | None = None, **options: Any) -> dict[str, Any]:
        """One rank's pieces of a committed step (default: the latest) under target ``layouts``."""
        return self.open(step).load(layouts, rank, **options)

