"""CheckpointManager across real processes (random finishing order, kills) and LIST requests on S3."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout

SHAPE = (8, 6)
L = {"w": Layout.from_dtensor((2, 2), ["S(0)", "S(1)"], SHAPE), "b": Layout.from_dtensor((4,), ["R"], (6,))}


def value(step: int) -> np.ndarray:
    return np.arange(48, dtype=np.float32).reshape(SHAPE) * step


def piece(step: int, rank: int) -> dict:
    return {"w": value(step)[L["w"].region(rank)], "b": np.full(6, step, np.float32), "step": step}


def job(url: str, rank: int, steps: list[int], folder: str, seed: int, hang_at: int | None) -> None:
    """One rank's process: build the manager, wait for the start signal, save with random delays."""
    mgr = rs.CheckpointManager(url, L, rank=rank, commit_timeout=3.0, max_to_keep=2, poll_max=0.05)
    Path(folder, f"ready-{rank}").touch()
    deadline = time.monotonic() + 60
    while not Path(folder, "go").exists():  # the job's start (init_process_group in real life)
        if time.monotonic() > deadline:
            sys.exit(4)
        time.sleep(0.01)
    rng = random.Random(seed * 1000 + rank)
    try:
        for step in steps:
            if step == hang_at:
                time.sleep(120)  # killed here
            time.sleep(rng.uniform(0, 0.3))
            mgr.save(step, rank, piece(step, rank))
        mgr.wait(committed=True, timeout=8)
        mgr.close()
    except (rs.UncommittedCheckpointError, TimeoutError):
        os._exit(3)


def run_job(url: str, folder: Path, steps: list[int], seed: int, hang: tuple[int, int] | None = None) -> dict:
    """Start 4 rank processes, release them together, kill the hanging one once the others are done."""
    folder.mkdir()
    ctx = mp.get_context("spawn")
    procs = {r: ctx.Process(target=job, args=(url, r, steps, str(folder), seed,
                                                hang[1] if hang and hang[0] == r else None)) for r in range(4)}
    for r in (0, 1, 2, 3) if seed % 2 else (3, 2, 1, 0):
        procs[r].start()
    deadline = time.monotonic() + 90
    while len(list(folder.glob("ready-*"))) < 4:
        assert time.monotonic() < deadline and all(p.exitcode is None for p in procs.values())
        time.sleep(0.02)
    (folder / "go").touch()
    codes = {}
    for r, p in procs.items():
        if hang and r == hang[0]:
            continue
        p.join(60)
        codes[r] = p.exitcode
    if hang:
        os.kill(procs[hang[0]].pid, signal.SIGKILL)
        procs[hang[0]].join(30)
        codes[hang[0]] = procs[hang[0]].exitcode
    return codes


@pytest.mark.parametrize("seed", [1, 2])
def test_ranks_in_separate_processes_commit_in_any_order(tmp_path, seed):
    url = str(tmp_path / "run")
    codes = run_job(url, tmp_path / "job", [1, 2, 3], seed)
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}
    mgr = rs.CheckpointManager(url, L, rank=9)
    assert mgr.steps() == [2, 3]
    np.testing.assert_array_equal(mgr.open()["w"].read(), value(3))
    assert mgr.open(2).leaves["step"] == 2


@pytest.mark.parametrize("victim", [2, 0], ids=["rank", "committer"])
def test_a_killed_rank_leaves_the_last_commit_and_the_job_resumes(tmp_path, victim):
    url = str(tmp_path / "run")
    codes = run_job(url, tmp_path / "job1", [1, 2, 3], seed=3, hang=(victim, 2))
    assert codes[victim] == -signal.SIGKILL
    assert all(c == 3 for r, c in codes.items() if r != victim)  # waited for step 2, which never committed
    mgr = rs.CheckpointManager(url, L, rank=9)
    assert mgr.steps() == [1] and mgr.latest_step() == 1  # the step being written is invisible
    assert (tmp_path / "run" / "step-2").exists()
    resume = mgr.latest_step() + 1
    codes = run_job(url, tmp_path / "job2", list(range(resume, 5)), seed=4)
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}
    assert mgr.steps() == [3, 4]
    for step in (3, 4):
        np.testing.assert_array_equal(mgr.open(step)["w"].read(), value(step))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".reshard", "manager.json", "step-3", "step-4"]


def commit_and_die(url: str, before_marker: bool) -> None:
    """One process saving every rank; its committer is killed (SIGKILL) around step 2's commit marker."""
    from reshard.store.manager import committer

    real = committer.commit

    def commit(root, **kw):
        step = kw["save_id"].partition("-j")[0]  # "<step>-j<the job's fencing token>"
        if step == "2" and before_marker:
            os.kill(os.getpid(), signal.SIGKILL)
        marker = real(root, **kw)
        if step == "2":
            os.kill(os.getpid(), signal.SIGKILL)
        return marker

    committer.commit = commit
    mgr = rs.CheckpointManager(url, L, rank=0, max_to_keep=2)
    for step in (1, 2):
        for r in range(4):
            mgr.save(step, r, piece(step, r))
    mgr.wait(committed=True, timeout=30)
    sys.exit(5)  # not reached: the commit of step 2 kills the process


@pytest.mark.parametrize("before_marker", [True, False], ids=["before-marker", "after-marker"])
def test_a_committer_killed_mid_commit_never_shows_another_rank_an_older_latest_step(tmp_path, before_marker):
    """Between the commit marker and the index, every rank must already see the step (resume race)."""
    url = str(tmp_path / "run")
    p = mp.get_context("spawn").Process(target=commit_and_die, args=(url, before_marker))
    p.start()
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    latest = 1 if before_marker else 2
    other = rs.CheckpointManager(url, L, rank=3)  # a rank that resumes before the committer reconciles
    assert other.latest_step() == latest and other.steps() == list(range(1, latest + 1))
    np.testing.assert_array_equal(other.open()["w"].read(), value(latest))
    committer = rs.CheckpointManager(url, L, rank=0, max_to_keep=2)  # the restarted committer settles the record
    assert committer.steps() == list(range(1, latest + 1))
    assert (tmp_path / "run" / "step-2").exists() is not before_marker
    assert not any(r.committing for r in rs.CheckpointManager(url).committer.index.steps)
    for r in range(4):
        committer.save(latest + 1, r, piece(latest + 1, r))
    committer.wait(committed=True, timeout=30)
    committer.close()
    assert other.steps() == [latest, latest + 1]


def _lists(proxy) -> int:
    return sum(1 for r in proxy.log if r.method == "GET" and ("list-type" in r.query or "prefix=" in r.query))


def test_a_256_rank_save_on_s3_sends_no_list_request(s3_proxy, s3_bucket):
    world = 256
    lay = {"w": Layout.from_dtensor((world,), ["S(0)"], (2 * world, 4)),
           "b": Layout.from_dtensor((world,), ["R"], (4,))}
    mgr = rs.CheckpointManager(f"s3://{s3_bucket}/run", lay, storage_options=s3_proxy.storage_options())
    assert _lists(s3_proxy) <= 3  # once per job: the look for a crashed job's leftovers, and for the newest job token
    s3_proxy.reset_counters()
    for r in range(world):
        mgr.save(1, r, {"w": np.full((2, 4), r, np.float32), "b": np.ones(4, np.float32)})
    mgr.wait(committed=True, timeout=300)
    assert _lists(s3_proxy) == 0  # a save: no LIST at all, whatever the number of ranks
    gets = mgr.committer.last_poll[0]
    assert world <= gets < 2 * world  # the committer read each manifest by key, polling little
    mgr.close()
    assert mgr.steps() == [1]
    np.testing.assert_array_equal(mgr.open()["w"].read()[::2, 0], np.arange(world))


def test_an_incremental_step_on_s3_sends_no_list_request(s3_proxy, s3_bucket):
    """The commit checks the base's objects it reuses still exist with a GET each, never a listing."""
    world = 32
    lay = {"w": Layout.from_dtensor((world,), ["S(0)"], (2 * world, 4)),
           "frozen": Layout.from_dtensor((world,), ["S(0)"], (world, 64))}
    mgr = rs.CheckpointManager(f"s3://{s3_bucket}/run", lay, incremental=True,
                               storage_options=s3_proxy.storage_options())
    frozen = np.arange(world * 64, dtype=np.float32).reshape(world, 64)
    for step in (1, 2):
        s3_proxy.reset_counters()
        for r in range(world):
            mgr.save(step, r, {"w": np.full((2, 4), step, np.float32), "frozen": frozen[r : r + 1]})
        mgr.wait(committed=True, timeout=300)
        assert _lists(s3_proxy) == 0, step
    mgr.close()
    np.testing.assert_array_equal(mgr.open(2)["frozen"].read(), frozen)
    np.testing.assert_array_equal(mgr.open(2)["w"].read(), np.full((2 * world, 4), 2, np.float32))


def test_retention_on_s3_lists_only_the_step_it_deletes(s3_proxy, s3_bucket):
    lay = {"w": Layout.from_dtensor((8,), ["S(0)"], (16, 4))}
    mgr = rs.CheckpointManager(f"s3://{s3_bucket}/run", lay, max_to_keep=1, storage_options=s3_proxy.storage_options())
    counts = []
    for step in (1, 2, 3):
        s3_proxy.reset_counters()
        for r in range(8):
            mgr.save(step, r, {"w": np.full((2, 4), step, np.float32)})
        mgr.wait(committed=True, timeout=60)
        counts.append(_lists(s3_proxy))
    mgr.close()
    assert counts[0] == 0 and 1 <= counts[1] <= 2 and counts[2] == counts[1]
    assert mgr.steps() == [3]
    assert s3_proxy.records()  # the proxy saw the traffic


def _early_rank(url: str, flag: str) -> None:
    """Rank 1 of a 2-rank job, started before the committer's manager: saves at once."""
    lay = {"w": Layout.from_dtensor((2,), ["S(0)"], (4, 3))}
    mgr = rs.CheckpointManager(url, lay, rank=1, async_save=False, commit_timeout=60.0, poll_max=0.05)
    Path(flag).touch()
    mgr.save(1, 1, {"w": np.ones((2, 3), np.float32)})
    mgr.wait(committed=True, timeout=60)
    mgr.close()


def test_a_rank_saving_before_the_committer_starts_waits_for_its_clean_up(tmp_path):
    """The committer's start-up clean-up removes step folders it does not know: a rank that saved before it
    started lost its part (and the step). Ranks now write once the committer says it is ready."""
    url = str(tmp_path / "m")
    ctx = mp.get_context("spawn")
    early = ctx.Process(target=_early_rank, args=(url, str(tmp_path / "saving")))
    early.start()
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "saving").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the rank is saving
        assert not (tmp_path / "m" / "step-1").exists()  # it waits for the committer
        lay = {"w": Layout.from_dtensor((2,), ["S(0)"], (4, 3))}
        mgr = rs.CheckpointManager(url, lay, rank=0, async_save=False, commit_timeout=60.0, poll_max=0.05)
        mgr.save(1, 0, {"w": np.zeros((2, 3), np.float32)})
        mgr.wait(committed=True, timeout=60)
        mgr.close()
        early.join(60)
        assert early.exitcode == 0
    finally:
        if early.is_alive():
            early.kill()
            early.join(10)
    np.testing.assert_array_equal(rs.CheckpointManager(url).open(1)["w"].read(),
                                  np.array([[0] * 3] * 2 + [[1] * 3] * 2, np.float32))
