"""kill -9 during saves: the committed checkpoint survives whole, and a retry commits.

Each trial forks a real process that overwrites the checkpoint (every rank's
shards and manifest, then the commit) and kills it with SIGKILL after a random
delay drawn over the length of a whole save, so kills land in shard uploads,
manifest writes, the lock, the metadata and the marker. After each kill the
checkpoint must read back bit for bit as the last committed state, or as the
killed save's state if its marker landed; then the save is finished (a commit
retry when every rank had written, breaking the dead committer's lock) or saved
anew, and must read back exactly.
"""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest
import reshard.store as rs
from harness import RANKS, Backend, Tally, attempt, fork, make_state, read_back, reap, rng_for, same, save, trials


def test_kill_9_during_saves(backend: Backend, form: str) -> None:
    if not backend.shared:
        pytest.skip(f"{backend.name}: other processes cannot see this backend")
    rng = rng_for("kill", backend.name, form)
    tally = Tally(f"kill[{backend.name}-{form}]")
    committed = make_state(rng)
    save(committed, backend, form, "base")
    t0 = time.perf_counter()
    save(make_state(rng), backend, form, "calibrate")  # how long one whole save takes here
    duration = time.perf_counter() - t0
    committed = read_back(backend)
    count = trials(ci=3, soak=40) if backend.name == "s3" else trials(ci=20, soak=200)
    for trial in range(count):
        state = make_state(rng)
        sid = f"t{trial}"
        pid = fork(functools.partial(save, state, backend, form, sid))
        time.sleep(rng.uniform(0, 1.1 * duration))
        os.kill(pid, signal.SIGKILL)
        status = reap(pid, 30.0)
        assert status is not None, f"save process {pid} did not end within 30 s"
        killed = os.WIFSIGNALED(status)
        outcome, got = attempt(lambda: read_back(backend))
        if outcome != "ok" or not (same(got, committed) or same(got, state)):
            tally.add("broken", bad=f"trial {trial}: after the kill the checkpoint reads {outcome}: {got!r:.300}")
            continue
        if same(got, state) and not same(got, committed):
            tally.add("commit landed before the kill" if killed else "finished before the kill")
            committed = state
            continue
        # the old checkpoint is intact; finish the killed save, or save it anew
        how, err = attempt(functools.partial(rs.commit, backend.url, save_id=sid, ranks=list(range(RANKS)),
                                             storage_options=backend.storage_options))
        if how == "ok":
            tally.add("intact; commit retried")
        elif isinstance(err, rs.UncommittedCheckpointError):
            save(state, backend, form, f"{sid}-again")
            tally.add("intact; saved again")
        else:
            tally.add("retry failed", bad=f"trial {trial}: commit retry: {type(err).__name__}: {err}")
            continue
        if not same(read_back(backend), state):
            tally.add("retry wrong", bad=f"trial {trial}: the retried save does not read back exactly")
        committed = state
    tally.check()
    assert sum(tally.counts.values()) == count
