"""Real torch.distributed jobs for tests: spawned processes, gloo on 127.0.0.1, every wait bounded.

``run(fn, world, *args)`` starts ``world`` processes calling
``fn(rank, world, port, *args)``; a worker calls :func:`init` first and
:func:`done` last. A worker's exception fails the test with its traceback; a
job that outlives ``timeout`` is killed (its processes only) and fails.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any

#: Seconds a whole job may take, and a collective may wait, unless told.
JOB_TIMEOUT = float(os.environ.get("RESHARD_TEST_JOB_TIMEOUT", "120"))
COLLECTIVE_TIMEOUT = 60.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(fn: Any, world: int, *args: Any, timeout: float = JOB_TIMEOUT) -> None:
    """Run ``fn(rank, world, port, *args)`` in ``world`` spawned processes and wait at most ``timeout`` s."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker, args=(fn, world, free_port(), *args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {world} ranks ran past {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def _worker(rank: int, fn: Any, *args: Any) -> None:
    """``fn(rank, *args)``; once it returned, the process ends at once (``os._exit(0)``).

    A worker's exception propagates as before (spawn reports it with its traceback).
    After a worker's work is done and checked, the interpreter's own exit tears down
    torch's C++ objects, and a gloo thread still joinable then aborts the process
    ("terminate called without an active exception", SIGABRT) about once in a few
    hundred jobs, even after :func:`done`'s barrier: a failure of nothing the test checks.
    """
    import sys

    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def init(rank: int, world: int, port: int) -> None:
    """Join the job's gloo process group (one CPU thread per rank; collectives time out)."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))


def done() -> None:
    """Leave the process group, once every rank is here: a rank tearing down while another still talks to
    it can abort that one (gloo), which showed as a rare SIGABRT of a worker ("terminate called without an
    active exception")."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
