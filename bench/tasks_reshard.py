"""reshard's side of every phase (one rank each; see :mod:`bench.harness`).

Arguments common to the tasks: ``workload``, ``cfg`` (sizes), ``url`` (the
checkpoint), ``mesh`` (saving mesh) and ``target`` (loading mesh).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import numpy as np

from bench import data
from bench.harness import Ctx, Task, reshard_store


def _layouts(args: dict[str, Any], mesh_key: str) -> dict[str, Any]:
    mesh = tuple(args[mesh_key])
    return {s.name: data.reshard_layout(args["workload"], s, mesh)
            for s in data.tensors(args["workload"], args["cfg"])}


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        name = f"{prefix}.{k}" if prefix else k
        out.update(flat(v, name) if isinstance(v, dict) else {name: v})
    return out


def wait_written(writer: Any, ranks: list[int], poll: float, timeout: float = 600) -> None:
    """Block until every rank of ``ranks`` has written its manifest to ``writer``'s save (a GET per poll)."""
    from reshard.store.format.manifests import has_written

    deadline = time.monotonic() + timeout
    for r in ranks:
        while not has_written(writer.storage, r, writer.form):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {r} did not write {writer.root.url} within {timeout:.0f} s")
            time.sleep(poll)


class Save(Task):
    """Each rank ``create(url, layouts).write(rank, local)``; rank 0 commits once all wrote."""

    def __init__(self, ctx: Ctx) -> None:
        rs = reshard_store()
        self.rs, self.ctx, self.url = rs, ctx, ctx.args["url"]
        self.layouts = _layouts(ctx.args, "mesh")
        self.ranks = sorted(set().union(*(lay.ranks for lay in self.layouts.values())))
        self.local = {s.name: data.fill(s.index, self.layouts[s.name].region(ctx.rank), s.dtype)
                      for s in data.tensors(ctx.args["workload"], ctx.args["cfg"])
                      if ctx.rank in self.layouts[s.name].ranks}

    def prepare(self, rep: int) -> None:
        if self.ctx.rank == 0 and "://" not in self.url:
            shutil.rmtree(self.url, ignore_errors=True)

    def run(self, rep: int) -> dict[str, Any]:
        options = {"storage_options": self.ctx.args.get("storage_options"), "overwrite": True,
                   "durable": self.ctx.args.get("durable", False),
                   **({"grid": self.ctx.args["grid"]} if "grid" in self.ctx.args else {})}
        writer = self.rs.create(self.url, self.layouts, **options)
        writer.write(self.ctx.rank, self.local)
        if self.ctx.rank == 0:  # the barrier a training job has anyway: wait for the manifests
            wait_written(writer, self.ranks, poll=0.001)
            writer.commit()
        return writer.storage.stats.as_dict()


class SaveWhole(Task):
    """One process saves whole arrays with ``reshard.store.save`` (W2)."""

    def __init__(self, ctx: Ctx) -> None:
        rs = reshard_store()
        self.rs, self.url, self.form = rs, ctx.args["url"], ctx.args.get("form")
        self.durable = ctx.args.get("durable", False)
        self.state = {s.name: data.fill(s.index, data.whole(s.shape), s.dtype)
                      for s in data.tensors(ctx.args["workload"], ctx.args["cfg"])}

    def prepare(self, rep: int) -> None:
        shutil.rmtree(self.url, ignore_errors=True)

    def run(self, rep: int) -> dict[str, Any]:
        return self.rs.save(self.state, self.url, form=self.form,
                            durable=self.durable).storage.stats.as_dict()


class Load(Task):
    """``open(url).load(layouts_target, rank)``: one rank of the target layout reads its part.

    With ``args["into"]`` the rank's buffers are allocated (and touched) once, before
    timing, and every run loads into them (``out=``): a training job resuming into an
    allocated model, and the like-for-like comparison with ``cat``, which allocates nothing.
    """

    def __init__(self, ctx: Ctx) -> None:
        rs = reshard_store()
        self.rs, self.ctx = rs, ctx
        self.layouts = _layouts(ctx.args, "target")
        self.got: dict[str, Any] = {}
        self.options = ctx.args.get("storage_options")
        self.out = None
        if ctx.args.get("into"):
            specs = {s.name: s for s in data.tensors(ctx.args["workload"], ctx.args["cfg"])}
            self.out = {n: np.empty(lay.local_shape(ctx.rank), data.np_dtype(specs[n].dtype))
                        for n, lay in self.layouts.items() if ctx.rank in lay.ranks}
            for a in self.out.values():  # touched: np.zeros of this size maps pages the first write faults in
                a.reshape(-1).view(np.uint8).fill(0)

    def run(self, rep: int) -> dict[str, Any]:
        ckpt = self.rs.open(self.ctx.args["url"], storage_options=self.options)
        self.got = flat(ckpt.load(self.layouts, self.ctx.rank, out=self.out))
        return ckpt.stats.as_dict()

    def finish(self) -> dict[str, Any]:
        specs = data.tensors(self.ctx.args["workload"], self.ctx.args["cfg"])
        needed = sum(a.nbytes for a in self.got.values() if isinstance(a, np.ndarray))
        regions = {n: lay.region(self.ctx.rank) for n, lay in self.layouts.items()}
        return {"checked": data.check(specs, regions, self.got), "needed": needed}


class ReadAll(Task):
    """Integration onto one host: ``open(url, engine=...).read_all()`` (engine ``fast`` by default)."""

    def __init__(self, ctx: Ctx) -> None:
        rs = reshard_store()
        self.rs, self.ctx = rs, ctx
        self.got: dict[str, Any] = {}

    def run(self, rep: int) -> dict[str, Any]:
        ckpt = self.rs.open(self.ctx.args["url"], engine=self.ctx.args.get("engine", "fast"))
        self.got = flat(ckpt.read_all())
        return ckpt.stats.as_dict()

    def finish(self) -> dict[str, Any]:
        specs = data.tensors(self.ctx.args["workload"], self.ctx.args["cfg"])
        return {"checked": data.check(specs, {s.name: data.whole(s.shape) for s in specs}, self.got)}


class OpenInspect(Task):
    """``open(url)``, its names and every tensor's shape and dtype (what DCP's metadata read gives: the
    dtype object is fetched, not formatted, as DCP's task does); with ``args["layouts"]`` every tensor's
    saving layout too (parses every array's metadata)."""

    def __init__(self, ctx: Ctx) -> None:
        rs = reshard_store()
        self.rs, self.ctx, self.count = rs, ctx, 0

    def run(self, rep: int) -> dict[str, Any]:
        ckpt = self.rs.open(self.ctx.args["url"])
        layouts = bool(self.ctx.args.get("layouts"))
        seen = 0
        for name in ckpt:
            t = ckpt[name]
            seen += len(t.shape) >= 0 and t.dtype is not None and (len(t.layout.ranks) if layouts else 1) > 0
        self.count = seen
        return {"tensors": seen}


class Export(Task):
    """``open(url).export(path, "safetensors")``: one file, streamed."""

    def __init__(self, ctx: Ctx) -> None:
        rs = reshard_store()
        self.rs, self.ctx = rs, ctx
        self.path = ctx.args["out"]

    def prepare(self, rep: int) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)

    def run(self, rep: int) -> dict[str, Any]:
        ckpt = self.rs.open(self.ctx.args["url"])
        ckpt.export(self.path, "safetensors")
        return ckpt.stats.as_dict()

    def finish(self) -> dict[str, Any]:
        from safetensors import safe_open

        specs = data.tensors(self.ctx.args["workload"], self.ctx.args["cfg"])
        with safe_open(self.path, framework="numpy") as f:
            s = specs[-1]
            ok = np.array_equal(f.get_tensor(s.name), data.fill(s.index, data.whole(s.shape), s.dtype))
        return {"file_bytes": os.path.getsize(self.path), "checked_last": bool(ok)}
