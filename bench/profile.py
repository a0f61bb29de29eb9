"""Where reshard's time goes: ``python -m bench.profile [--phase w1-load] [--reps 10]``.

Builds W1's checkpoint (as 8 ranks write it), then runs one phase ``reps``
times in this process while ``py-spy`` (``pip install py-spy``) samples every
thread, the I/O pool included, and prints the functions that hold the samples:
by self time (the innermost frame) and by the innermost reshard frame (which
reshard function the time is spent under). Phases: ``w1-save`` (rank 1's
create and write), ``w1-load`` (rank 0 of the 7-rank target), ``w1-read_all``,
``w1-export``, ``w3-save``, ``w3-load`` (rank 0 of tp2 x dp3), ``w2-save``,
``w2-open``, ``w2-load``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import data
from bench.harness import Ctx, Task
from bench.tasks_reshard import Export, Load, OpenInspect, ReadAll, Save, SaveWhole

OURS = ("store/", "layouts/")
#: Innermost frames of a thread that waits (py-spy does not always tell them from busy ones).
IDLE = {"_worker", "wait", "Condition.wait", "Event.wait", "acquire", "lock.acquire"}


PHASES = ["w1-save", "w1-load", "w1-read_all", "w1-export", "w3-save", "w3-load", "w2-save", "w2-open",
          "w2-load"]


def build(phase: str, cfg: dict[str, Any], tmp: Path) -> Task:
    """Write the workload's checkpoint (as its ranks would), return the task of ``phase``."""
    workload, _, step = phase.partition("-")
    url = str(tmp / "ckpt")
    mesh, target, world = ([2, 4], [3, 2], 6) if workload == "w3" else ([8], [7], 7)
    args = {"workload": workload, "cfg": cfg[workload], "url": url, "mesh": mesh, "target": target,
            "out": str(tmp / "x.st")}
    if workload == "w2":
        SaveWhole(Ctx(0, 1, args)).run(0)
        return {"save": SaveWhole, "open": OpenInspect, "load": ReadAll}[step](Ctx(0, 1, args))
    for rank in [*range(1, 8), 0]:  # as 8 ranks write it (rank 0 commits)
        Save(Ctx(rank, 8, args)).run(0)
    if step == "save":  # rank 1 writes its shards and manifest (rank 0 would also commit)
        return Save(Ctx(1, 8, {**args, "url": f"{url}-again"}))
    if step == "load":
        return Load(Ctx(0, world, args))
    return ReadAll(Ctx(0, 1, args)) if step == "read_all" else Export(Ctx(0, 1, args))


def _frame(f: str) -> str:
    """``func (path/file.py:line)`` -> ``path/file.py:func``."""
    name, _, where = f.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for root in OURS:
        if root in path:
            path = root + path.split(root, 1)[1]
            break
    else:
        path = path.rsplit("/", 1)[-1]
    return f"{path}:{name}"


def summarize(raw: str, top: int = 12) -> str:
    """Self time and time under the innermost reshard frame, from py-spy's raw (collapsed) stacks."""
    leaf: Counter[str] = Counter()
    under: Counter[str] = Counter()
    total = idle = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or ("bench/profile.py" in stack and "run_phase" not in stack):
            continue
        frames = stack.split(";")
        count = int(n)
        if _frame(frames[-1]).split(":")[-1] in IDLE:
            idle += count
            continue
        total += count
        leaf[_frame(frames[-1])] += count
        ours = [f for f in frames if any(r in f for r in OURS)]
        under[_frame(ours[-1]) if ours else "(outside reshard)"] += count
    lines = [f"{total} busy samples, all threads ({idle} more of threads waiting left out)", "",
             "self time (innermost frame):"]
    lines += [f"  {100 * c / total:5.1f}%  {name}" for name, c in leaf.most_common(top)]
    lines += ["", "time under the innermost reshard function:"]
    lines += [f"  {100 * c / total:5.1f}%  {name}" for name, c in under.most_common(top)]
    return "\n".join(lines)


def run_phase(task: Task, reps: int, tag: str) -> float:
    """Seconds per run; writing tasks write to a new place each run (no clean-up while sampled)."""
    base = {k: getattr(task, k) for k in ("url", "path") if isinstance(getattr(task, k, None), str)}
    t0 = time.monotonic()
    for i in range(reps):
        for k, v in base.items():
            setattr(task, k, f"{v}-{tag}{i}")
        task.prepare(i + 1)  # drops the last result
        task.run(i + 1)
    return (time.monotonic() - t0) / reps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    p.add_argument("--phase", choices=PHASES, default="w1-load")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny sizes")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="reshard-profile-"))
    try:
        task = build(args.phase, data.SMOKE if args.smoke else data.FULL, tmp)
        run_phase(task, 1, "warm")
        raw = tmp / "raw.txt"
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), "--format", "raw", "--rate", "250",
                                "--nonblocking",
                                "--output", str(raw)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # let py-spy attach
        took = run_phase(task, args.reps, "run")
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)
        print(f"{args.phase}: {took:.3f} s per run, {args.reps} runs (save/load: one rank's part)")
        print(summarize(raw.read_text()))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
