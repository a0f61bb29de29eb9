"""One process of a training job saving to a manager root, as tests/reliability/test_fence.py starts it.

Run as ``python fencejob.py '<spec JSON>'``, possibly inside ``unshare --pid --fork --uts --mount-proc``
(a restarted container: fresh PID namespace, its own hostname). The spec:

* ``url``, ``storage_options``: the root;
* ``ranks``: the ranks this process saves (rank 0's process commits); ``job``: a number tagging every
  value it saves (``tag(job, step, rank)``), so that a test reads which job wrote each rank of a step;
* ``first``, ``steps``: it saves steps ``first .. first + steps - 1`` (``"resume"``: from the latest committed
  step on, as its manager says once constructed); ``pause``: seconds between them;
  ``hang_after``: after that many steps it sleeps (to be killed);
* ``hostname``: set in its UTS namespace; ``skew``: seconds added to ``time.time`` (this process only);
* ``log``: a file it appends JSON events to (``started``, ``constructed``, ``saved``, ``committed``, ``superseded``).

Exit status: 0 all saved (and, for the committer, committed), 17 superseded by another job, 1 another error.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

#: The exit status of a process whose job was superseded.
SUPERSEDED = 17
#: Two ranks, a sharded tensor and a replicated one.
WORLD = 2
SHAPE = (4, 3)


def layouts() -> dict[str, Any]:
    from reshard.layouts import Layout

    return {"w": Layout.from_dtensor((WORLD,), ["S(0)"], SHAPE), "b": Layout.from_dtensor((WORLD,), ["R"], (3,))}


def tag(job: int, step: int, rank: int) -> float:
    """What rank ``rank`` of job ``job`` saves at ``step`` (exact in float32)."""
    return float(job * 100_000 + step * 10 + rank)


def piece(job: int, step: int, rank: int) -> dict[str, Any]:
    return {"w": np.full((SHAPE[0] // WORLD, SHAPE[1]), tag(job, step, rank), np.float32),
            "b": np.full(3, tag(job, step, 0), np.float32), "job": job}


def main(spec: dict[str, Any]) -> int:
    log = Path(spec["log"])

    def event(name: str, **fields: Any) -> None:
        with log.open("a") as f:
            f.write(json.dumps({"event": name, "t": time.monotonic(), "pid": os.getpid(),
                                "host": socket.gethostname(), **fields}) + "\n")

    if spec.get("hostname"):
        socket.sethostname(spec["hostname"])
    if spec.get("skew"):
        real = time.time
        time.time = lambda: real() + float(spec["skew"])  # this process's wall clock only
    import reshard.store as rs

    event("started")  # after the imports: from here on, what the manager takes

    ranks = list(spec["ranks"])
    try:
        mgr = rs.CheckpointManager(spec["url"], layouts(), rank=ranks, committer=0, commit_timeout=20.0,
                                   poll_max=0.05, storage_options=spec.get("storage_options"))
        first = spec["first"] if spec["first"] != "resume" else (mgr.latest_step() or 0) + 1
        event("constructed", first=first, token=None if mgr.committer.fence is None else mgr.committer.fence.token)
        for i in range(spec["steps"]):
            if i == spec.get("hang_after"):
                event("hanging")
                time.sleep(600)
            step = first + i
            for rank in ranks:
                mgr.save(step, rank, piece(spec["job"], step, rank))
            mgr.wait(committed=0 in ranks, timeout=60)
            event("committed" if 0 in ranks else "saved", step=step)
            time.sleep(spec.get("pause", 0.0))
        mgr.close()
        event("done")
        return 0
    except rs.JobSupersededError as e:
        event("superseded", message=str(e))
        return SUPERSEDED
    except Exception as e:
        event("error", message=f"{type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    code = main(json.loads(sys.argv[1]))
    os._exit(code)  # not waiting for a superseded job's commit thread to give up
