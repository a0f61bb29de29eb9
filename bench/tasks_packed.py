"""Rank-parallel saves of many ranks from a pool of processes (W5, the S3 1024-rank simulation).

Process ``p`` of ``world`` writes ranks ``p, p + world, ...`` of a ``ranks``-rank
``Shard(0)`` layout, each with its own ``create(...).write(rank, local)`` as a
training rank would; process 0 commits once every process's last rank is there.
Arguments: ``workload``, ``cfg``, ``url``, ``ranks``, ``form``, ``storage_options``.
"""

from __future__ import annotations

import shutil
from typing import Any

from bench import data
from bench.harness import Ctx, Task, reshard_store
from bench.tasks_reshard import wait_written


class SaveRanks(Task):
    """``ranks`` rank writes from ``world`` processes, then one commit."""

    def __init__(self, ctx: Ctx) -> None:
        rs = reshard_store()
        self.rs, self.ctx, self.url = rs, ctx, ctx.args["url"]
        n = int(ctx.args["ranks"])
        specs = data.tensors(ctx.args["workload"], ctx.args["cfg"])
        self.layouts = {s.name: data.reshard_layout(ctx.args["workload"], s, (n,)) for s in specs}
        self.mine = list(range(ctx.rank, n, ctx.world))
        self.lasts = [max(range(p, n, ctx.world)) for p in range(min(ctx.world, n))]
        self.local = {r: {s.name: data.fill(s.index, self.layouts[s.name].region(r), s.dtype) for s in specs}
                      for r in self.mine}
        self.options = {"storage_options": ctx.args.get("storage_options"), "overwrite": True,
                        "form": ctx.args.get("form", "packed"), "durable": False}

    def prepare(self, rep: int) -> None:
        if self.ctx.rank == 0 and "://" not in self.url:
            shutil.rmtree(self.url, ignore_errors=True)

    def run(self, rep: int) -> dict[str, Any]:
        sid = f"r{rep}"  # every repetition a new save of the same URL, as a training job's steps
        writer = None
        for r in self.mine:
            writer = self.rs.create(self.url, self.layouts, save_id=sid, **self.options)
            writer.write(r, self.local[r])
        assert writer is not None
        if self.ctx.rank == 0:  # the barrier a training job has anyway: wait for each process's last rank
            wait_written(writer, self.lasts, poll=0.05)  # a poll every 50 ms: each is a GET
            writer.commit()
        return writer.storage.stats.as_dict()


def count_objects(root: str) -> int:
    """Files under a local checkpoint (every object of every kind)."""
    import os

    return sum(len(files) for _, _, files in os.walk(root))
