"""The process side of :func:`bench.harness.run_group` (``python -m bench.worker SPEC``).

Protocol, one JSON message per line prefixed with ``@@BENCH`` on the original
stdout (anything else the task prints goes to stderr):

1. ``{"rss": ...}`` once the task is built;
2. per repetition: on ``prepare``, prepare and answer ``{"prepared": rep}``;
   on ``go``, run and answer ``{"t0", "t1", "extra"}``; ``stop`` ends the loop;
3. ``{"peak": ..., "finish": {...}}`` and exit.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import sys
import time
from typing import Any

from bench.harness import PREFIX, Ctx


def rss_now() -> int:
    """Current resident set size of this process (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    """Peak resident set size of this process (bytes).

    ``VmHWM`` rather than ``getrusage().ru_maxrss``: Linux carries ``ru_maxrss``
    over from the parent at fork, so a child would report the parent's size.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints of libraries must not break the protocol

    def say(msg: dict[str, Any]) -> None:
        proto.write(PREFIX + json.dumps(msg) + "\n")

    module, func = spec["task"].split(":")
    factory = getattr(importlib.import_module(module), func)
    task = factory(Ctx(rank=spec["rank"], world=spec["world"], args=spec["args"]))
    say({"rss": rss_now()})
    rep = 0
    while sys.stdin.readline().strip() == "prepare":
        task.prepare(rep)
        say({"prepared": rep})
        sys.stdin.readline()  # go
        t0 = time.monotonic()
        extra = task.run(rep)
        t1 = time.monotonic()
        say({"t0": t0, "t1": t1, "extra": extra or {}})
        rep += 1
    peak = rss_peak()  # before the checks in finish()
    say({"peak": peak, "finish": task.finish()})
    proto.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
