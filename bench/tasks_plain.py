"""The physical limit: ``np.save``/``np.load`` of the same bytes, and ``cat`` of the files.

``NpSave``/``NpLoad`` move exactly the bytes each rank holds under the saving
layout (one ``.npy`` per piece, no redivision, no checksums): what any format
must at least do. bfloat16 pieces are saved as their raw 16-bit words.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import data
from bench.harness import Ctx, Task
from bench.tasks_reshard import _layouts


def _raw(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype == data.np_dtype("bfloat16") else a


class NpSave(Task):
    """Each rank ``np.save``s its pieces under ``url/r<rank>/`` (W2: one ``np.savez`` file)."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx, self.dir = ctx, Path(ctx.args["url"])
        specs = data.tensors(ctx.args["workload"], ctx.args["cfg"])
        if ctx.args["workload"] == "w2":
            self.local = {s.name: data.fill(s.index, data.whole(s.shape), s.dtype) for s in specs}
        else:
            lays = _layouts(ctx.args, "mesh")
            self.local = {s.name: data.fill(s.index, lays[s.name].region(ctx.rank), s.dtype) for s in specs
                          if ctx.rank in lays[s.name].ranks and lays[s.name].replica_id(ctx.rank) == 0}

    def prepare(self, rep: int) -> None:
        if self.ctx.rank == 0:
            shutil.rmtree(self.dir, ignore_errors=True)

    def run(self, rep: int) -> dict[str, Any]:
        mine = self.dir / f"r{self.ctx.rank}"
        mine.mkdir(parents=True, exist_ok=True)
        if self.ctx.args["workload"] == "w2":
            np.savez(str(mine / "all.npz"), **self.local)  # type: ignore[arg-type]
        else:
            for name, a in self.local.items():
                np.save(mine / f"{name}.npy", _raw(a))
        return {"bytes": sum(a.nbytes for a in self.local.values())}


class NpLoad(Task):
    """Each rank ``np.load``s back the files it saved (W2: every array of the ``.npz``)."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx, self.dir = ctx, Path(ctx.args["url"]) / f"r{ctx.rank}"
        self.got: dict[str, np.ndarray] = {}

    def run(self, rep: int) -> dict[str, Any]:
        if self.ctx.args["workload"] == "w2":
            with np.load(self.dir / "all.npz") as z:
                self.got = {k: z[k] for k in z.files}
        else:
            self.got = {p.name: np.load(p) for p in sorted(self.dir.iterdir())}
        return {"bytes": sum(a.nbytes for a in self.got.values())}


def files_under(root: str) -> list[str]:
    """Every regular file under ``root`` (sorted)."""
    out = []
    for dirpath, _, names in os.walk(root):
        out += [os.path.join(dirpath, n) for n in names]
    return sorted(out)


def time_cat(paths: list[str], reps: int = 3, warmup: int = 1, dest: str | None = None) -> list[float]:
    """Seconds of ``cat paths > /dev/null`` (or ``> dest``), ``reps`` times after ``warmup``."""
    times = []
    for i in range(warmup + reps):
        os.sync()
        with open(dest or os.devnull, "wb") as out:
            t0 = time.monotonic()
            for k in range(0, len(paths), 1000):  # argv limits
                subprocess.run(["cat", *paths[k:k + 1000]], stdout=out, check=True)
            took = time.monotonic() - t0
        if i >= warmup:
            times.append(took)
    if dest:
        os.remove(dest)
    return times
