"""Fencing, not liveness (issue 35): jobs restarted as containers are, racing restarts, two live jobs, skewed clocks.

Every job is real processes (``fencejob.py``), on local files and on the loopback S3 server:

* **restart in fresh namespaces**: a job runs in ``unshare --pid --fork --uts --mount-proc`` (its committer is
  pid 1 on host ``trainer-0``), is killed with SIGKILL mid-training, and is restarted the same way (pid 1 on
  ``trainer-0`` again, the dead job's lock looking alive), once with its clock 700 s behind: it must take the
  root at once and commit;
* **two restarts racing** over the dead job's stale lock: the one with the newer token finishes, the other is
  superseded (or finished before it was);
* **two live jobs** (two processes each) on one root, with either job's clock 700 s behind or none: the second
  takes over, the first gets ``JobSupersededError`` at its next save, in every process.

After each trial every committed step is read: its manifests must carry one token and its data one job's
values (a **mix** fails the test). Figures: restart waits (ms), outcomes, mixes.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import fencejob
import numpy as np
import pytest
import reshard.store as rs
from harness import Backend, Tally, step_manifests, trials
from reshard.store.io.storage import Storage

JOB = str(Path(__file__).with_name("fencejob.py"))
#: The hostname of every job started in a namespace (a restarted container keeps its hostname).
HOST = "trainer-0"
#: Longest wait for anything a job does (a step, an exit): past it, the trial fails as a hang.
HANG_S = 120.0


@functools.cache
def namespaces_unavailable() -> str | None:
    """Why jobs cannot run in fresh PID and UTS namespaces here (None: they can)."""
    if shutil.which("unshare") is None:
        return "no unshare(1) here"
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "--uts", "--mount-proc", "--kill-child", "hostname",
                               HOST], capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "unshare did not answer within 30 s"
    if done.returncode != 0:
        return f"unshare --pid --uts is refused here (needs root or user namespaces): {done.stderr.decode()[:200]}"
    return None


def needs_shared(backend: Backend) -> None:
    if not backend.shared:
        pytest.skip(f"{backend.name}: other processes cannot see this backend")


def needs_namespaces() -> None:
    why = namespaces_unavailable()
    if why is not None:
        pytest.skip(why)


class Job:
    """One process of a job (``fencejob.py``), optionally in fresh PID + UTS namespaces."""

    def __init__(self, backend: Backend, folder: Path, name: str, *, namespaced: bool = False, **spec: Any) -> None:
        self.log = folder / f"{name}.log"
        self.name = name
        spec = {"url": backend.url, "storage_options": backend.storage_options, "log": str(self.log), **spec}
        if namespaced:
            spec["hostname"] = HOST
        command = [sys.executable, JOB, json.dumps(spec)]
        if namespaced:  # SIGKILL to unshare kills its child (pid 1 there), and so the namespace
            command = ["unshare", "--pid", "--fork", "--uts", "--mount-proc", "--kill-child", *command]
        self.stderr = (folder / f"{name}.err").open("wb")
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.stderr)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        found = [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]
        return [e for e in found if kind is None or e["event"] == kind]

    def wait_for(self, kind: str, count: int = 1, timeout: float = HANG_S) -> dict[str, Any]:
        """The ``count``-th event ``kind`` of this process, waiting at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.events(kind)
            if len(found) >= count:
                return found[count - 1]
            code = self.proc.poll()
            assert code is None, f"{self.name} ended ({code}) before its event {kind!r}: {self.why()}"
            assert time.monotonic() < deadline, f"{self.name}: no {kind!r} within {timeout:.0f} s: {self.why()}"
            time.sleep(0.02)

    def finish(self, timeout: float = HANG_S) -> int:
        """Its exit status (waiting at most ``timeout`` seconds; a hang is killed and fails the test)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} hung: {self.why()}") from None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)
        self.stderr.close()

    def why(self) -> str:
        return "; ".join(e.get("message", "") for e in self.events() if "message" in e) or \
            Path(self.stderr.name).read_bytes()[-2000:].decode(errors="replace")

    def wait_ms(self) -> int:
        """Milliseconds from the process's start (after its imports) to its manager's construction."""
        return int(1000 * (self.wait_for("constructed", timeout=0)["t"] - self.wait_for("started", timeout=0)["t"]))


def check_steps(backend: Backend, tally: Tally, trial: int) -> list[int]:
    """Every committed step holds the ranks of one job (tokens and values agree): mixes counted. The steps."""
    opts = backend.storage_options
    steps = rs.CheckpointManager(backend.url, storage_options=opts).steps()
    for step in steps:
        url = f"{backend.url}/step-{step}"
        tokens = {m.get("fence") for m in step_manifests(url, opts)}
        w = rs.open(url, storage_options=opts)["w"].read()
        tags = [float(w[0, 0]), float(w[2, 0])]
        jobs = {int(t) // 100_000 for t in tags}
        right = tags == [fencejob.tag(min(jobs), step, r) for r in range(2)] and np.all(w[:2] == tags[0])
        if len(tokens) != 1 or None in tokens or len(jobs) != 1 or not right:
            tally.add("mixed step", bad=f"trial {trial}: step {step} holds tokens {tokens}, values {tags}")
        else:
            tally.add("step of one job")
    return steps


def kill_running_job(backend: Backend, folder: Path, job: int, first: int) -> Job:
    """A namespaced job (committer pid 1 on :data:`HOST`) that committed two steps, then killed -9."""
    dead = Job(backend, folder, f"job{job}", namespaced=True, ranks=[0, 1], job=job, first=first, steps=1000,
               pause=0.05)
    dead.wait_for("committed", count=2)
    dead.kill()  # SIGKILL to the namespace: no close(), its lock stays
    return dead


# ------------------------------------------------------------------ restart in fresh namespaces
def test_restart_in_fresh_pid_and_uts_namespaces(backend: Backend, tmp_path: Path) -> None:
    needs_shared(backend)
    needs_namespaces()
    tally = Tally(f"fence-restart[{backend.name}]")
    for trial in range(trials(ci=2, soak=20)):
        folder = tmp_path / f"t{trial}"
        folder.mkdir()
        done = rs.CheckpointManager(backend.url, storage_options=backend.storage_options).latest_step() or 0
        dead = kill_running_job(backend, folder, 10 * trial + 1, done + 1)
        hint = json.loads(Storage(backend.url, backend.storage_options).read("manager.lock"))
        assert (hint["host"], hint["pid"]) == (HOST, 1), hint  # the dead job's lock names what the restart is
        skew = -700.0 if trial % 2 else 0.0
        restart = Job(backend, folder, f"job{10 * trial + 2}", namespaced=True, ranks=[0, 1], job=10 * trial + 2,
                      first="resume", steps=3, skew=skew)
        code = restart.finish()
        if code != 0:
            tally.add("restart failed", bad=f"trial {trial}: the restart ended {code}: {restart.why()}")
            continue
        started, committed = restart.wait_for("started", timeout=0), restart.wait_for("committed", timeout=0)
        assert restart.wait_for("constructed", timeout=0)["pid"] == 1 and started["host"] == HOST
        waited = restart.wait_ms()
        tally.add(f"restart took the root{' (clock 700 s behind)' if skew else ''}")
        tally.counts["restart wait ms, max"] = max(tally.counts["restart wait ms, max"], waited)
        tally.counts["ms to the first commit, max"] = max(tally.counts["ms to the first commit, max"],
                                                         int(1000 * (committed["t"] - started["t"])))
        if waited > 30_000:  # the old lease was 600 s; a take-over is a LIST and a few small writes
            tally.add("slow restart", bad=f"trial {trial}: the restart waited {waited} ms for the root")
        assert dead.events("committed")
        check_steps(backend, tally, trial)
    tally.check()


# ------------------------------------------------------------------ two restarts racing
def test_two_restarts_race_over_a_stale_lock(backend: Backend, tmp_path: Path) -> None:
    needs_shared(backend)
    needs_namespaces()
    tally = Tally(f"fence-racing-restarts[{backend.name}]")
    opts = backend.storage_options
    for trial in range(trials(ci=1, soak=10)):
        folder = tmp_path / f"t{trial}"
        folder.mkdir()
        done = rs.CheckpointManager(backend.url, storage_options=opts).latest_step() or 0
        kill_running_job(backend, folder, 10 * trial + 1, done + 1)
        racers = [Job(backend, folder, f"job{10 * trial + k}", namespaced=True, ranks=[0, 1], job=10 * trial + k,
                      first="resume", steps=6, pause=0.1) for k in (2, 3)]
        codes = [r.finish() for r in racers]
        # a racer superseded during its own start-up raises from its manager's constructor (no token logged)
        tokens = [(r.events("constructed") or [{"token": 0}])[0]["token"] for r in racers]
        newest = max(range(2), key=lambda k: tokens[k])
        if codes[newest] != 0:
            tally.add("newest failed", bad=f"trial {trial}: the newest restart ended {codes[newest]}: "
                      f"{racers[newest].why()}")
        older = racers[1 - newest]
        if codes[1 - newest] == fencejob.SUPERSEDED:
            message = older.wait_for("superseded", timeout=0)["message"]
            assert f"superseded by job {tokens[newest]} " in message, message
            tally.add("older restart superseded, clear error"
                      + (" (while it started)" if not older.events("constructed") else ""))
        elif codes[1 - newest] == 0:
            tally.add("older restart finished before the newer took the root")
        else:
            tally.add("older failed", bad=f"trial {trial}: the older restart ended {codes[1 - newest]}: {older.why()}")
        tally.counts["restart wait ms, max"] = max(tally.counts["restart wait ms, max"], racers[newest].wait_ms())
        steps = check_steps(backend, tally, trial)
        last = racers[newest].wait_for("constructed", timeout=0)["first"] + 5
        assert steps[-1] == last, (steps, last)  # the newest restart's last step is the latest
    tally.check()


# ------------------------------------------------------------------ two live jobs, skewed clocks
@pytest.mark.parametrize("skewed", ["none", "first", "second"], ids=["clocks-agree", "first-700s-behind",
                                                                     "second-700s-behind"])
def test_two_live_jobs_on_one_root(backend: Backend, tmp_path: Path, skewed: str) -> None:
    needs_shared(backend)
    tally = Tally(f"fence-two-live-jobs[{backend.name}-{skewed}]")
    for trial in range(trials(ci=1, soak=10)):
        folder = tmp_path / f"t{trial}"
        folder.mkdir()
        jobs = []
        for k, name in enumerate(("first", "second"), 1):
            job, skew = 10 * trial + k, -700.0 if skewed == name else 0.0
            steps = 1000 if k == 1 else 5
            committer = Job(backend, folder, f"job{job}-rank0", ranks=[0], job=job, first="resume", steps=steps,
                            pause=0.1, skew=skew)
            first = committer.wait_for("constructed")["first"]  # its other process starts once its committer is up
            other = Job(backend, folder, f"job{job}-rank1", ranks=[1], job=job, first=first, steps=steps, pause=0.1,
                        skew=skew)
            jobs.append((committer, other))
            if k == 1:
                committer.wait_for("committed", count=3)
        taken = jobs[1][0].wait_for("constructed")
        for proc in jobs[1]:
            code = proc.finish()
            if code != 0:
                tally.add("second job failed", bad=f"trial {trial}: {proc.name} ended {code}: {proc.why()}")
        for proc in jobs[0]:
            code = proc.finish()
            if code == fencejob.SUPERSEDED:
                message = proc.wait_for("superseded", timeout=0)["message"]
                assert f"superseded by job {taken['token']} " in message, message
                tally.add("first job's process superseded at its next save, clear error")
            else:
                tally.add("first job went on", bad=f"trial {trial}: {proc.name} ended {code}: {proc.why()}")
        late = [e for e in jobs[0][0].events("committed") if e["t"] > taken["t"]]
        if len(late) > 1:  # one commit may have checked the root just before the second job took it
            tally.add("first job committed on", bad=f"trial {trial}: the first job committed {len(late)} steps "
                      "after the second took the root")
        tally.counts["steps the first job committed after the take-over"] += len(late)
        check_steps(backend, tally, trial)
    tally.check()
