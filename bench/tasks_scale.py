"""Scaling with the number of ranks: many simulated ranks in one process.

A checkpoint of ``count`` tensors of ``shape`` saved by N ranks (``Shard(0)``)
is redivided to M ranks. ``SaveSim`` writes all N ranks' pieces from one
process; ``Plan`` computes ``reshard.layouts.plan`` for every tensor and every
target rank (layouts built afresh each time, so their tables are too);
``LoadAll`` calls ``Checkpoint.load`` for every target rank in turn. Time per
rank staying flat as N grows means near-linear total cost.

Arguments: ``url``, ``shape``, ``count``, ``n`` (saving ranks), ``m`` (target ranks).
"""

from __future__ import annotations

import shutil
from typing import Any

from bench import data
from bench.harness import Ctx, Task, reshard_store
from bench.tasks_reshard import flat


def _specs(args: dict[str, Any]) -> list[data.Spec]:
    rows, cols = args["shape"]
    return data.tensors("scale", {"rows": rows, "cols": cols, "count": args["count"]})


def _layouts(args: dict[str, Any], n: int) -> dict[str, Any]:
    from reshard.layouts import Layout

    return {s.name: Layout.from_dtensor(n, ["Shard(0)"], s.shape) for s in _specs(args)}


class SaveSim(Task):
    """One process writes the pieces of all N ranks, then commits."""

    def __init__(self, ctx: Ctx) -> None:
        rs = reshard_store()
        self.rs, self.args = rs, ctx.args
        self.specs = _specs(ctx.args)
        self.layouts = _layouts(ctx.args, ctx.args["n"])
        self.pieces = {r: {s.name: data.fill(s.index, self.layouts[s.name].region(r), s.dtype) for s in self.specs}
                       for r in range(ctx.args["n"])}

    def prepare(self, rep: int) -> None:
        shutil.rmtree(self.args["url"], ignore_errors=True)

    def run(self, rep: int) -> dict[str, Any]:
        writer = self.rs.create(self.args["url"], self.layouts, durable=False)
        for r, local in self.pieces.items():
            writer.write(r, local)
        writer.commit()
        return {"writes": writer.storage.stats.writes}


class Plan(Task):
    """``plan(source, target, rank)`` for every tensor and target rank."""

    def __init__(self, ctx: Ctx) -> None:
        self.args = ctx.args

    def run(self, rep: int) -> dict[str, Any]:
        from reshard.layouts import plan

        src, dst = _layouts(self.args, self.args["n"]), _layouts(self.args, self.args["m"])
        pieces = sum(len(plan(src[name], dst[name], r)) for name in src for r in range(self.args["m"]))
        return {"pieces": pieces}


class LoadAll(Task):
    """``open`` once, then ``load(target, rank)`` for every target rank."""

    def __init__(self, ctx: Ctx) -> None:
        rs = reshard_store()
        self.rs, self.args = rs, ctx.args
        self.checked = 0

    def run(self, rep: int) -> dict[str, Any]:
        ckpt = self.rs.open(self.args["url"])
        layouts = _layouts(self.args, self.args["m"])
        got = 0
        for r in range(self.args["m"]):
            got += sum(a.nbytes for a in flat(ckpt.load(layouts, r)).values())
        self.checked = got
        return {"bytes": got, "requests": ckpt.stats.requests}
