"""Which committed steps a manager keeps, and deleting the others.

Rules (all of them together; a step kept by any rule is kept):

* the latest ``max_to_keep`` committed steps (``None``: every step);
* every step that is a multiple of ``keep_every``;
* the ``keep_best`` best steps by ``best_metric`` (``best_mode`` ``"min"`` or
  ``"max"``), among the steps that recorded that metric;
* the latest committed step, always.

Deleting a step first drops it from the index (readers stop seeing it), then
removes its commit marker (so that a deletion killed half way leaves a folder
that nobody takes for a committed step), then the rest of its folder. A step whose
data objects a kept step references (an incremental save points at bytes of an
older step: the index records which steps each one references) is *retired*
instead: its commit marker goes, then everything but the objects kept steps
reference; once no kept step references it, a later deletion removes the rest.

Incremental saves still being written may use a dropped step as their base: each
process **pins** the base it chose (``step-<S>/.reshard/pins/<N>``, one small
object per step and process) before it reads the base's marker, and retention
removes a step's marker before it reads its pins. So either the save sees the
marker gone and chooses another base, or retention sees the pin and keeps every
object of the step (*held*) until that save committed or was given up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..commit.gc import delete_except, reused_objects
from ..commit.marker import read_marker
from ..format.meta import COMMIT_KEY
from ..io.storage import Storage
from .index import Index, StepRecord, step_dir, step_of


@dataclass(frozen=True)
class Retention:
    """A retention policy; see the module docstring."""

    max_to_keep: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"

    def __post_init__(self) -> None:
        for name in ("max_to_keep", "keep_every", "keep_best"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        if self.keep_best is not None and self.best_metric is None:
            raise ValueError("keep_best needs best_metric (the name of a metric recorded with each save)")

    def chosen(self, records: Iterable[StepRecord]) -> set[int]:
        """The steps the rules keep, before references are followed."""
        records = sorted(records, key=lambda r: r.step)
        if not records:
            return set()
        keep = {records[-1].step}
        if self.max_to_keep is None:
            keep.update(r.step for r in records)
        else:
            keep.update(r.step for r in records[-self.max_to_keep:])
        if self.keep_every is not None:
            keep.update(r.step for r in records if r.step % self.keep_every == 0)
        if self.keep_best is not None and self.best_metric is not None:
            # a NaN metric (a diverged step) is never best, nor is a step that recorded none
            scored = [r for r in records if not math.isnan(r.metrics.get(self.best_metric, math.nan))]
            sign = 1.0 if self.best_mode == "min" else -1.0
            scored.sort(key=lambda r: (sign * r.metrics[str(self.best_metric)], -r.step))
            keep.update(r.step for r in scored[: self.keep_best])
        return keep


def referenced(records: Iterable[StepRecord], roots: set[int]) -> set[int]:
    """``roots`` and every step they reference, transitively."""
    refs = {r.step: r.refs for r in records}
    seen, todo = set(roots), list(roots)
    while todo:
        for ref in refs.get(todo.pop(), ()):
            if ref not in seen:
                seen.add(ref)
                todo.append(ref)
    return seen


def plan(index: Index, policy: Retention) -> tuple[list[int], list[int]]:
    """``(kept, doomed)`` steps of ``index`` under ``policy``."""
    keep = policy.chosen(index.steps)
    numbers = index.numbers()
    return [s for s in numbers if s in keep], [s for s in numbers if s not in keep]


def delete_steps(root: Storage, doomed: Iterable[StepRecord], index: Index, *,
                 held: Mapping[int, StepRecord] | None = None,
                 in_flight: Callable[[int], bool] | None = None) -> dict[int, StepRecord]:
    """Delete the folders of steps dropped from the index; return the steps now *held* (see the module doc).

    ``index`` is the index *after* ``doomed`` were dropped from it. Steps that
    the doomed ones reference but the index no longer lists (retired earlier),
    and steps ``held`` before, are reconsidered too: removed once no kept step
    needs them, else retired again (keeping only what kept steps still need).
    ``in_flight(step)``: whether a save of ``step`` may still commit (incremental
    managers): a step such a save pinned keeps all its objects, and so do the
    steps it references (the save may reference what its base references); None: no pins.
    """
    records = list(doomed)
    known = {**(held or {}), **{r.step: r for r in records}}
    todo = {r.step for r in records} | {ref for r in records for ref in r.refs} | set(held or {})
    todo -= set(index.numbers())
    pinned: dict[int, StepRecord] = {}
    for step in sorted(todo):
        folder = root.child(step_dir(step))
        folder.delete(COMMIT_KEY, recursive=False)  # first: no save takes it as its base now, no reader opens it
        if in_flight is not None and any(in_flight(n) for n in pins_of(folder)):
            pinned[step] = known.get(step, StepRecord(step, 0.0))
    for_pins = referenced(known.values(), set(pinned)) & todo
    now_held = {s: known.get(s, StepRecord(s, 0.0)) for s in sorted(for_pins)}
    still = referenced(index.steps, set(index.numbers()))
    for step in sorted(todo - set(now_held)):
        if step in still:
            retire(root, step, needed_objects(root, index, step))
        else:
            root.delete(step_dir(step))
    return now_held


#: Pins of a step (``step-<S>/.reshard/pins/<N>``): saves of step N chose it as their base.
PINS_DIR = ".reshard/pins"


def pin(root: Storage, base: int, step: int) -> None:
    """Say that a save of ``step`` uses ``base`` as its base (before reading the base's marker)."""
    root.child(step_dir(base)).write(f"{PINS_DIR}/{int(step)}", b"{}")


def pins_of(folder: Storage) -> list[int]:
    """The steps whose saves pinned this step's folder (one listing)."""
    return [int(n) for n in folder.list(PINS_DIR) if n.isdigit()]


def referenced_steps(manifests: Mapping[int, Mapping[str, Any]]) -> tuple[int, ...]:
    """The older steps whose data objects a step's manifests reference (``../step-<N>/...``)."""
    steps = set()
    for manifest in manifests.values():
        for record in (manifest.get("packed") or {}).values():
            if isinstance(record, list) and record and isinstance(record[0], str) and record[0].startswith("../"):
                step = step_of(record[0].split("/")[1])
                if step is not None:
                    steps.add(step)
    return tuple(sorted(steps))


def needed_objects(root: Storage, index: Index, step: int) -> set[str]:
    """Keys (under ``step``'s folder) of the objects that kept steps' references point into."""
    prefix = f"../{step_dir(step)}/"
    needed: set[str] = set()
    for record in index.steps:
        if step in record.refs:
            folder = root.child(step_dir(record.step))
            found = read_marker(folder)
            if found is not None:
                needed |= {obj[len(prefix):] for obj in reused_objects(folder, found[0]) if obj.startswith(prefix)}
    return needed


def retire(root: Storage, step: int, keep: set[str]) -> None:
    """Make ``step`` unopenable (its marker goes first) and remove all of it but ``keep``."""
    root.child(step_dir(step)).delete(COMMIT_KEY, recursive=False)
    delete_except(root, step_dir(step), {f"{step_dir(step)}/{key}" for key in keep})
