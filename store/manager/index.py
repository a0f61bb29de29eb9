"""The manager's index ``root/manager.json``: which steps are committed, with their metrics.

The index is written only by the committer (one process), always whole and
atomically (:meth:`Storage.write_atomic`). Committing a step writes the index
twice: first with the step's record flagged ``committing``, then the step's
own commit marker, then the index again with the flag cleared. A reader takes
a flagged record as committed only if the step's marker is there (one GET:
:func:`committed_steps`), so the index never lags the markers: a committer
killed between marker and index cannot make another process see an older
latest step (and resume from it) while the restarted committer catches up.
Reading the index is one GET; a missing index is an empty root, anything else
that fails (a missing bucket, a denied or failing request, malformed JSON)
raises.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from reshard.layouts.errors import FormatError

from ..format.meta import COMMIT_KEY
from ..format.schema import loads_json
from ..io.storage import Storage

#: The index object under the root.
INDEX_KEY = "manager.json"
#: Version of the index document (2: records may be flagged ``committing``).
INDEX_VERSION = 2
#: Step folders are ``step-<N>`` (decimal, no padding).
STEP_PREFIX = "step-"


def step_dir(step: int) -> str:
    """The folder (prefix) of one step under the root."""
    return f"{STEP_PREFIX}{int(step)}"


def step_of(name: str) -> int | None:
    """The step of a folder name, or None if ``name`` is not a step folder."""
    if not name.startswith(STEP_PREFIX):
        return None
    digits = name[len(STEP_PREFIX):]
    return int(digits) if digits.isdigit() else None


@dataclass(frozen=True)
class StepRecord:
    """One step: when, its metrics, the older steps whose bytes it references.

    ``committing`` records are written just before the step's commit marker:
    the step is committed only if the marker is there.
    """

    step: int
    time: float
    metrics: dict[str, float] = field(default_factory=dict)
    refs: tuple[int, ...] = ()
    committing: bool = False


@dataclass(frozen=True)
class Index:
    """The committed steps of a root (ascending), the failures the committer recorded."""

    steps: tuple[StepRecord, ...] = ()
    #: ``{step: message}`` of saves the committer gave up on (waiters raise with it).
    failed: dict[int, str] = field(default_factory=dict)
    time: float = 0.0

    def numbers(self) -> list[int]:
        return [s.step for s in self.steps]

    def get(self, step: int) -> StepRecord | None:
        return next((s for s in self.steps if s.step == step), None)

    def with_step(self, record: StepRecord) -> Index:
        steps = sorted([s for s in self.steps if s.step != record.step] + [record], key=lambda s: s.step)
        failed = {k: v for k, v in self.failed.items() if k != record.step}
        return replace(self, steps=tuple(steps), failed=failed, time=time.time())

    def without(self, numbers: set[int]) -> Index:
        return replace(self, steps=tuple(s for s in self.steps if s.step not in numbers), time=time.time())

    def with_failure(self, step: int, message: str) -> Index:
        return replace(self, failed={**self.failed, step: message}, time=time.time())

    def to_json(self) -> bytes:
        doc = {"manager_version": INDEX_VERSION, "time": self.time,
               "steps": [_record_json(s) for s in self.steps],
               "failed": {str(k): v for k, v in sorted(self.failed.items())}}
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def parse(cls, where: str, raw: bytes) -> Index:
        doc = loads_json(where, raw)
        try:
            if not isinstance(doc, dict) or int(doc["manager_version"]) > INDEX_VERSION:
                raise FormatError(f"{where}: not a reshard manager index of a version this reshard reads")
            steps = tuple(StepRecord(step=int(s["step"]), time=float(s.get("time", 0.0)),
                                     metrics={str(k): float(v) for k, v in (s.get("metrics") or {}).items()},
                                     refs=tuple(int(r) for r in s.get("refs", ())),
                                     committing=s.get("committing", False) is True)
                          for s in doc["steps"])
            failed = {int(k): str(v) for k, v in (doc.get("failed") or {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise FormatError(f"{where}: malformed manager index ({type(e).__name__}: {e})") from None
        return cls(steps=tuple(sorted(steps, key=lambda s: s.step)), failed=failed, time=float(doc.get("time", 0.0)))


def read_index(root: Storage) -> Index:
    """The index of ``root`` (empty if none was written yet). One GET; every failure raises."""
    raw = root.read_if_exists(INDEX_KEY)
    return Index() if raw is None else Index.parse(f"{root.url}/{INDEX_KEY}", raw)


def committed_steps(root: Storage, index: Index | None = None) -> list[StepRecord]:
    """The committed steps of ``root``, ascending: the index, its ``committing`` records confirmed by their marker.

    One GET of the index (unless ``index`` is the one just read), and one GET
    per flagged record (normally none, or the one step being committed right
    now). Every failure raises.
    """
    index = read_index(root) if index is None else index
    return [r for r in index.steps if not r.committing or is_committed(root, r.step)]


def is_committed(root: Storage, step: int) -> bool:
    """Whether a step's folder holds a commit marker (one GET)."""
    return root.child(step_dir(step)).read_if_exists(COMMIT_KEY) is not None


def write_index(root: Storage, index: Index) -> None:
    """Replace the index, atomically (readers see the old or the new one whole)."""
    root.write_atomic(INDEX_KEY, index.to_json())


def _record_json(record: StepRecord) -> dict[str, Any]:
    doc = {**asdict(record), "refs": list(record.refs)}
    if not record.committing:
        del doc["committing"]
    return doc


def metrics_of(metrics: Any, step: int) -> dict[str, float]:
    """Check the metrics recorded with a save: ``{name: number}``."""
    if metrics is None:
        return {}
    try:
        return {str(k): float(v) for k, v in dict(metrics).items()}
    except (TypeError, ValueError):
        raise TypeError(f"step {step}: metrics must be a mapping of names to numbers, got {metrics!r}") from None
