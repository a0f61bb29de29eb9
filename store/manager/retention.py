"""Which committed steps a manager keeps, and deleting the others.

Rules (all of them together; a step kept by any rule is kept):

* the latest ``max_to_keep`` committed steps (``None``: every step);
* every step that is a multiple of ``keep_every``;
* the ``keep_best`` best steps by ``best_metric`` (``best_mode`` ``"min"`` or
  ``"max"``), among the steps that recorded that metric;
* the latest committed step, always;
* every step that a kept step references (its ``refs``, transitively): a step
  may point at bytes of an older one (incremental saves), and those bytes must
  outlive it.

Deleting a step first drops it from the index (readers stop seeing it), then
removes its folder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..io.storage import Storage
from .index import Index, StepRecord, step_dir


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
            scored = [r for r in records if self.best_metric in r.metrics]
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
    """``(kept, doomed)`` steps of ``index`` under ``policy``; references of kept steps are kept."""
    keep = referenced(index.steps, policy.chosen(index.steps))
    numbers = index.numbers()
    return [s for s in numbers if s in keep], [s for s in numbers if s not in keep]


def delete_steps(root: Storage, steps: Iterable[int], index: Index,
                 remove: Callable[[Storage, int], None] | None = None) -> list[int]:
    """Delete step folders that no step still in ``index`` references; return those deleted.

    ``index`` is the index *after* the steps were dropped from it. ``remove``
    deletes one step (default: its whole folder); a step whose bytes another
    kept step references is skipped, whatever the caller asked.
    """
    still = referenced(index.steps, set(index.numbers()))
    gone = []
    for step in steps:
        if step in still:
            continue
        (remove or _remove_folder)(root, step)
        gone.append(step)
    return gone


def _remove_folder(root: Storage, step: int) -> None:
    root.delete(step_dir(step))
