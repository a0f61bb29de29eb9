"""The lifecycle around saves: gc, retention and concurrent jobs against saves and readers (issue 23).

* ``gc`` runs in a loop (``min_age=0``: take everything it may) while a thread saves
  and readers read snapshots (``check_current=False``) and the current checkpoint;
* a process running retention (a manager saving with ``max_to_keep=1``) or ``gc`` is
  killed with SIGKILL at a random moment, and the restarted job lists and reads;
* (two jobs on one manager root: ``test_fence.py``, where the second takes the root over);
* incremental managers saving steps back to back, async, with retention.

Every outcome is counted: **intact** (the data read is what was saved under that
name), **clear error** (a :class:`~reshard.store.ReshardError`), **wrong data**
and **hang** (the last two fail the test). ``RESHARD_SOAK=1`` runs more trials.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
import reshard.store as rs
from harness import RANKS, Backend, Tally, attempt, fork, make_state, read_back, reap, rng_for, same, save, trials
from reshard.layouts import Layout

#: A thread or process of a trial that runs longer than this is a hang.
HANG_S = 120.0


def _read_outcome(fn: Any, wants: list[dict[str, Any]]) -> tuple[str, str | None]:
    """``intact`` if ``fn()`` gives one of ``wants`` exactly, ``clear error`` for a ReshardError, else bad."""
    how, got = attempt(fn)
    if how == "refused":
        return "clear error", None
    if how == "crash":
        return "unclear error", f"{type(got).__name__}: {got}"
    if any(same(got, w) for w in wants):
        return "intact", None
    return "wrong data", "read data that no save wrote under that name"


# ---------------------------------------------------------- gc vs saves and readers
def test_gc_concurrent_with_saves_and_readers(backend: Backend, form: str) -> None:
    rng = rng_for("lifecycle-gc", backend.name, form)
    tally = Tally(f"lifecycle-gc[{backend.name}-{form}]")
    states: dict[str, dict[str, Any]] = {}
    first = make_state(rng)
    save(first, backend, form, "s0")
    states["s0"] = first
    count = trials(ci=3, soak=60) if backend.name == "s3" else trials(ci=8, soak=200)
    stop = threading.Event()
    gc_runs = [0]

    def collect() -> None:
        while not stop.is_set():
            how, err = attempt(lambda: rs.gc(backend.url, min_age=0, storage_options=backend.storage_options))
            if how == "crash":
                tally.add("gc: unclear error", bad=f"gc: {type(err).__name__}: {err}")
            gc_runs[0] += 1
            time.sleep(0.002)

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    try:
        for trial in range(count):
            snapshot = attempt(lambda: rs.open(backend.url, check_current=False,
                                               storage_options=backend.storage_options))
            sid = f"s{trial + 1}"
            state = make_state(rng)
            how, err = attempt(lambda: save(state, backend, form, sid))  # noqa: B023
            if how == "ok":
                tally.add("save committed")
                states[sid] = state
            elif how == "refused":
                tally.add("save refused (gc took it), clear error")
            else:
                tally.add("save: unclear error", bad=f"trial {trial}: save: {type(err).__name__}: {err}")
            if snapshot[0] == "ok":  # a snapshot opened before: its own save's bytes, or gone (clear)
                ckpt = snapshot[1]
                opened = states[json.loads(ckpt.marker)["save_id"]]

                def read_snapshot(c: Any = ckpt) -> dict[str, Any]:
                    out = {name: c.read(name) for name in c}
                    out.update(c.leaves)
                    return out

                outcome, bad = _read_outcome(read_snapshot, [opened])
                tally.add(f"snapshot read: {outcome}", bad=None if bad is None else f"trial {trial}: snapshot: {bad}")
            outcome, bad = _read_outcome(lambda: read_back(backend), list(states.values()))
            tally.add(f"current read: {outcome}", bad=None if bad is None else f"trial {trial}: current: {bad}")
    finally:
        stop.set()
        collector.join(HANG_S)
    if collector.is_alive():
        tally.add("hang", bad="gc did not stop")
    # the last committed save is what the checkpoint holds, whole
    outcome, bad = _read_outcome(lambda: read_back(backend), list(states.values()))
    if outcome != "intact":
        tally.add("final", bad=f"after the trials the checkpoint reads {outcome}: {bad}")
    tally.counts["gc runs"] += gc_runs[0]
    tally.check()


# --------------------------------------------------------- kill -9 during retention
STEP_LAYOUTS = {"w": Layout.from_dtensor((RANKS,), ["S(0)"], (64, 48)),
                "frozen": Layout.from_dtensor((RANKS,), ["S(0)"], (64, 256))}


def _step_state(step: int) -> dict[str, np.ndarray]:
    """What step ``step`` saves (a function of the step: a restarted job can check any listed step)."""
    g = np.random.default_rng(step)
    return {"w": g.standard_normal((64, 48)).astype(np.float32),
            "frozen": np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)}


def _save_step(mgr: rs.CheckpointManager, step: int) -> None:
    full = _step_state(step)
    for rank in range(RANKS):
        mgr.save(step, rank, {n: a[STEP_LAYOUTS[n].region(rank)] for n, a in full.items()})


def _check_steps(url: str, opts: dict[str, Any] | None, tally: Tally, trial: int) -> None:
    """The restarted job: every listed step reads back exactly (or the listing is refused clearly)."""
    how, listed = attempt(lambda: rs.CheckpointManager(url, storage_options=opts).steps())
    if how != "ok":
        tally.add(f"listing: {'clear error' if how == 'refused' else 'unclear error'}",
                  bad=None if how == "refused" else f"trial {trial}: steps(): {listed!r}")
        return
    for step in listed:
        def read(s: int = step) -> dict[str, Any]:
            ckpt = rs.open(f"{url}/step-{s}", storage_options=opts)
            return {n: ckpt.read(n) for n in ckpt}

        outcome, bad = _read_outcome(read, [_step_state(step)])
        if outcome == "clear error":
            bad = f"trial {trial}: listed step {step} does not read: a half-deleted step listed again"
        tally.add(f"listed step: {outcome}", bad=None if bad is None else f"trial {trial}, step {step}: {bad}")


@pytest.mark.parametrize("incremental", [False, True], ids=["whole", "incremental"])
def test_kill_9_during_retention(backend: Backend, incremental: bool) -> None:
    if not backend.shared:
        pytest.skip(f"{backend.name}: other processes cannot see this backend")
    rng = rng_for("lifecycle-retention", backend.name, incremental)
    tally = Tally(f"lifecycle-kill-retention[{backend.name}-{'incremental' if incremental else 'whole'}]")
    opts = backend.storage_options
    count = trials(ci=1, soak=30) if backend.name == "s3" else trials(ci=5, soak=100)
    step = 0
    t0 = time.perf_counter()
    with rs.CheckpointManager(backend.url, STEP_LAYOUTS, max_to_keep=1, incremental=incremental,
                              storage_options=opts) as mgr:
        for _ in range(2):
            step += 1
            _save_step(mgr, step)
        mgr.wait(committed=True, timeout=HANG_S)
    duration = (time.perf_counter() - t0) / 2  # one step, retention included

    for trial in range(count):
        first = step + 1

        def job(first: int = first) -> None:
            with rs.CheckpointManager(backend.url, STEP_LAYOUTS, max_to_keep=1, incremental=incremental,
                                      storage_options=opts) as mgr:
                for s in range(first, first + 3):
                    _save_step(mgr, s)
                    mgr.wait(committed=True, timeout=HANG_S)

        pid = fork(job)
        time.sleep(rng.uniform(0.3, 3.5) * duration)
        os.kill(pid, signal.SIGKILL)
        if reap(pid, HANG_S) is None:
            tally.add("hang", bad=f"trial {trial}: the killed job did not end")
        step = first + 3
        _check_steps(backend.url, opts, tally, trial)
        # the restarted job saves on: its steps commit and read back, retention settles what the kill left
        how, err = attempt(lambda: _restart(backend.url, opts, incremental, step))  # noqa: B023
        if how != "ok":
            tally.add("restart", bad=f"trial {trial}: the restarted job failed: {type(err).__name__}: {err}")
            continue
        _check_steps(backend.url, opts, tally, trial)
        tally.add("trial")
    tally.check()


def _restart(url: str, opts: dict[str, Any] | None, incremental: bool, step: int) -> None:
    with rs.CheckpointManager(url, STEP_LAYOUTS, max_to_keep=1, incremental=incremental,
                              storage_options=opts) as mgr:
        _save_step(mgr, step)
        mgr.wait(committed=True, timeout=HANG_S)
        assert mgr.steps() == [step]


# ------------------------------------------------------------------ kill -9 during gc
def test_kill_9_during_gc(backend: Backend, form: str) -> None:
    if not backend.shared:
        pytest.skip(f"{backend.name}: other processes cannot see this backend")
    rng = rng_for("lifecycle-kill-gc", backend.name, form)
    tally = Tally(f"lifecycle-kill-gc[{backend.name}-{form}]")
    opts = backend.storage_options
    count = trials(ci=2, soak=30) if backend.name == "s3" else trials(ci=5, soak=100)
    for trial in range(count):
        for k in range(3):  # three replaced saves for gc to delete, then the committed one
            save(make_state(rng), backend, form, f"t{trial}-{k}")
        state = make_state(rng)
        save(state, backend, form, f"t{trial}-kept")
        t0 = time.perf_counter()
        pid = fork(lambda: rs.gc(backend.url, min_age=0, storage_options=opts))
        time.sleep(rng.uniform(0, 0.05 if backend.name == "file" else 0.5))
        os.kill(pid, signal.SIGKILL)
        if reap(pid, HANG_S) is None:
            tally.add("hang", bad=f"trial {trial}: gc did not end")
        outcome, bad = _read_outcome(lambda: read_back(backend), [state])
        tally.add(f"after the kill: {outcome}", bad=None if outcome == "intact" else f"trial {trial}: {outcome} {bad}")
        how, err = attempt(lambda: rs.gc(backend.url, min_age=0, storage_options=opts))
        if how != "ok":
            tally.add("gc rerun", bad=f"trial {trial}: gc after the kill: {type(err).__name__}: {err}")
        outcome, bad = _read_outcome(lambda: read_back(backend), [state])
        tally.add(f"after gc again: {outcome}", bad=None if outcome == "intact" else f"trial {trial}: {outcome}")
        tally.counts["ms in the killed gc"] += int(1000 * (time.perf_counter() - t0))
    tally.check()


# --------------------------------------------------- incremental + async + retention back to back
def test_incremental_async_retention_back_to_back(backend: Backend) -> None:
    tally = Tally(f"lifecycle-incremental[{backend.name}]")
    opts = backend.storage_options
    count = trials(ci=1, soak=20) if backend.name != "file" else trials(ci=2, soak=30)
    steps = 8
    for trial in range(count):
        url = f"{backend.url}/t{trial}"
        how, err = attempt(lambda: _back_to_back(url, opts, steps))  # noqa: B023
        if how != "ok":
            tally.add("run failed", bad=f"trial {trial}: {type(err).__name__}: {err}")
            continue
        tally.add("run committed every step")
        tally.counts["steps saved"] += steps - 1
        _check_steps(url, opts, tally, trial)
    tally.check()


def _back_to_back(url: str, opts: dict[str, Any] | None, steps: int) -> None:
    with rs.CheckpointManager(url, STEP_LAYOUTS, max_to_keep=2, incremental=True, storage_options=opts) as mgr:
        for s in range(1, steps + 1):
            _save_step(mgr, s)
        mgr.wait(committed=True, timeout=HANG_S)
        assert mgr.steps() == [steps - 1, steps], mgr.steps()

