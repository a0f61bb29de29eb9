"""Worker groups: one fresh process per rank, a barrier per repetition, peak RSS.

A *task* is ``"module:function"``; the function takes a :class:`Ctx` and returns
a :class:`Task`. :func:`run_group` starts ``world`` processes
(``python -m bench.worker``), each builds its task (imports, data: untimed),
then for every repetition: ``prepare`` (untimed), all ranks report ready, the
parent flushes dirty pages (``os.sync``) and releases them together, each rank
times ``run``. A repetition's time is ``max(end) - min(start)`` over the ranks
(``CLOCK_MONOTONIC`` is one clock for all processes). The first ``warmup``
repetitions are dropped. Each worker finally reports its peak RSS
(``VmHWM``) and its RSS once its task is built.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "@@BENCH "
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Ctx:
    """What a task factory gets: its rank, the group size and the arguments."""

    rank: int
    world: int
    args: dict[str, Any]


class Task:
    """One rank's part of a phase; subclasses override what they need.

    A task that keeps what it loaded (for ``finish`` to check) keeps it in ``got``.
    """

    got: dict[str, Any]

    def prepare(self, rep: int) -> None:
        """Untimed work before repetition ``rep``: drop the last run's result (freeing
        memory is not loading), remove the last run's output."""
        if hasattr(self, "got"):
            self.got = {}

    def run(self, rep: int) -> dict[str, Any] | None:
        """The timed work of one repetition; may return counters (JSON)."""
        return None

    def finish(self) -> dict[str, Any]:
        """Untimed checks after the last repetition (e.g. verify loaded values)."""
        return {}


@dataclass
class Measurement:
    """What one group gave: per-repetition times, peak RSS, counters.

    Attributes
    ----------
    times : list of float
        Seconds per kept repetition.
    peak_rss : int
        Largest peak RSS of any one rank (bytes).
    base_rss : int
        Largest RSS of any one rank once its task is built: imports and input data (bytes).
    extra : dict
        Counters of the last ``run`` and of ``finish``, summed over the ranks.
    per_rank : list of dict
        Each rank's ``finish`` counters.
    error : str or None
        Why the group failed (then the other fields may be empty).
    """

    times: list[float] = field(default_factory=list)
    peak_rss: int = 0
    base_rss: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    per_rank: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")


def reshard_store() -> Any:
    """``reshard.store`` with its public names imported, as a job has them before it saves or loads.

    The package imports its names on first use (a fast command line); a task calls this in its
    constructor so that no timed run pays for imports (DCP's and Orbax's tasks import theirs there too).
    """
    import reshard.store as rs

    for name in rs.__all__:
        getattr(rs, name)
    return rs


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _send(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _recv(proc: subprocess.Popen[str], deadline: float) -> dict[str, Any]:
    """Next protocol message of a worker (its other stdout is sent to stderr)."""
    assert proc.stdout is not None
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("worker did not answer in time")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited (rc={proc.wait()})")
        if line.startswith(PREFIX):
            return dict(json.loads(line[len(PREFIX):]))


def run_group(task: str, world: int, args: dict[str, Any], *, reps: int = 3, warmup: int = 1,
              budget_s: float = 120.0, timeout_s: float = 900.0, env: dict[str, str] | None = None,
              ranks: list[int] | None = None, settle_s: float = 0.0, backed_bytes: int = 0) -> Measurement:
    """Run ``task`` in ``world`` fresh processes and time it.

    Parameters
    ----------
    task : str
        ``"module:function"`` of a task factory.
    world : int
        Number of processes (ranks ``0..world-1`` unless ``ranks`` is given).
    args : dict
        JSON arguments passed to every rank.
    reps, warmup : int
        Kept and dropped repetitions. After the warmup, ``reps`` is lowered (to
        at least 1) when ``reps`` more runs would exceed ``budget_s``.
    timeout_s : float
        The whole group is killed after this long.
    env : dict, optional
        Extra environment variables for the workers.
    ranks : list of int, optional
        Run only these ranks of a ``world``-rank group.
    settle_s : float
        Pause before each timed run (after ``os.sync``): memory the last group freed
        goes back to a VM's host meanwhile (free page reporting, about 2 s), so a run
        does not get cheaper fresh memory for following another (docs/performance.md).
    backed_bytes : int
        After the pause, touch and free this much memory (:func:`back_free_memory`):
        the ranks' new memory is then backed by the VM's host, as all memory is on a
        host without a balloon.
    """
    deadline = time.monotonic() + timeout_s
    run_env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "PYTHONUNBUFFERED": "1", **(env or {})}
    out = Measurement()
    procs: list[subprocess.Popen[str]] = []
    logs = []
    try:
        for rank in ranks if ranks is not None else range(world):
            spec = json.dumps({"task": task, "rank": rank, "world": world, "args": args})
            log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in the finally below)
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "bench.worker", spec], cwd=ROOT, env=run_env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True))
        out.base_rss = max(int(_recv(p, deadline)["rss"]) for p in procs)
        total = warmup + reps
        rep = 0
        while rep < total:
            for p in procs:
                _send(p, "prepare")
            for p in procs:
                _recv(p, deadline)
            os.sync()
            time.sleep(settle_s)
            back_free_memory(backed_bytes)
            for p in procs:
                _send(p, "go")
            msgs = [_recv(p, deadline) for p in procs]
            took = max(m["t1"] for m in msgs) - min(m["t0"] for m in msgs)
            out.extra.update(_sum(m.get("extra", {}) for m in msgs))
            if rep >= warmup:
                out.times.append(took)
            elif rep == warmup - 1 and took * reps > budget_s:
                total = warmup + max(1, int(budget_s / max(took, 1e-9)))
            rep += 1
        for p in procs:
            _send(p, "stop")
        dones = [_recv(p, deadline) for p in procs]
        out.peak_rss = max(int(d["peak"]) for d in dones)
        out.per_rank = [d.get("finish", {}) for d in dones]
        out.extra.update(_sum(out.per_rank))
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except Exception as e:  # a failing anchor must not stop the benchmark
        out.error = f"{type(e).__name__}: {e}; " + _tail(logs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    return out


def back_free_memory(nbytes: int) -> None:
    """Write one byte per page of ``nbytes`` of new memory, then free it.

    On this bench's VM (Firecracker, free page reporting) memory the guest left free
    for about 2 s is returned to the host, and the guest's next first touch of it
    faults in the host at about 1 GB/s (docs/performance.md, issue 28). Memory freed
    a moment ago is still backed: processes that start right after this get their
    fresh memory at the guest kernel's own cost, as on a machine without a balloon.
    """
    if nbytes > 0:
        import numpy as np

        buf = np.empty(nbytes, np.uint8)
        buf[::4096] = 1
        del buf


def _sum(dicts: Any) -> dict[str, Any]:
    """Add up the ranks' counters (numbers are summed, other values kept from rank 0)."""
    out: dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, int | float) and not isinstance(v, bool) and k in out:
                out[k] += v
            else:
                out.setdefault(k, v)
    return out


def _tail(logs: list[Any], n: int = 600) -> str:
    text = ""
    for log in logs:
        log.seek(0)
        t = log.read()
        if "Error" in t or "Traceback" in t:
            text = t
            break
    return " ".join(text[-n:].split())
