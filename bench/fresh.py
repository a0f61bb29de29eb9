"""The user's way of measuring: every save and every load in freshly spawned processes, at defaults.

The warm harness (:mod:`bench.workloads`) times the third of four runs of one
group of processes. A user compares libraries differently (issue 28): spawn 8
processes, each builds its piece, a barrier, one timed save, a barrier, rank 0
commits; once. This module measures that way, beside the warm harness:

- one fresh group of processes per measurement (no warmup run: imports done,
  but the first save or load of each process is the one timed);
- each saving process builds the *whole* tensors (:func:`bench.data.fill`) and
  keeps them, as the issue's script does: reshard gets its pieces as
  ``np.ascontiguousarray(full[region])`` (views where the region is contiguous),
  DCP as ``distribute_tensor(full, mesh, placements)`` (gloo);
- both libraries at their defaults: ``create(url, layouts).write(rank, piece)``
  (durable: fsynced), ``dcp.save(state, checkpoint_id=url)`` (``sync_files=True``);
  loads are the redivided loads of the warm harness (W1 8 -> 7 ranks, W3 tp4 x dp2
  -> tp2 x dp3), read from a warm page cache (the files are read by ``cat`` first);
- every load runs twice: with fresh memory as this VM gives it (reclaimed by its
  host's balloon: first touch at about 1 GB/s), and with *host-backed* memory
  (:data:`BACKED`: the harness touches and frees memory just before the run,
  :func:`bench.harness.back_free_memory`), as every machine without a balloon
  gives it. Saves allocate nothing in their timed window but an 8 MiB buffer;
- the W1 load runs a third time *in place* (:data:`IN_PLACE`, issue 37 item 8): each
  rank's destinations are allocated and touched before timing (a job resuming into
  its model), reshard's ``load(..., out=)`` and DCP's ``dcp.load`` into a state dict;
  beside them the floor: 7 fresh processes ``readinto`` their seventh of the same
  files (:class:`ReadInto`), the same with the crc32c of what they read
  (:class:`ReadIntoChecked`: reshard checks every chunk's), and, with ``--against DIR``,
  the same reshard load run by another checkout (``reshard before``);
- reshard and DCP alternate (A B A B ...), ``reps`` times each, every run after
  a pause of ``SETTLE_S`` (see :func:`bench.harness.run_group`); the rows give the
  median, min and max.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench import data, tasks_dcp, tasks_reshard
from bench.harness import Ctx, Measurement, Task, free_port, reshard_store, run_group
from bench.tasks_plain import files_under, time_cat

if TYPE_CHECKING:
    from bench.workloads import Runner

#: (workload, saving mesh, target mesh, save phase, load phase) of the fresh rows.
CASES = (("w1", [8], [7], "save, 8 fresh processes, defaults", "redivided load 8 -> 7, fresh processes"),
         ("w3", [2, 4], [3, 2], "save, tp4 x dp2, fresh processes, defaults", "redivided load to tp2 x dp3, fresh"))


#: Phase suffix of the loads run on host-backed memory, and how much (times the workload's bytes) is backed first.
BACKED, BACKED_TIMES = ", host-backed memory", 3

#: Phase suffix of the loads into destinations allocated (and touched) before timing; W1 only.
IN_PLACE = ", into allocated buffers"

#: Pieces :class:`ReadIntoChecked` takes the crc32c of (W1's inner chunks: 35 rows of 3744 float32).
CRC_PIECE = 35 * 3744 * 4

#: Notes of the in-place rows.
NOTES = {"readinto": "floor: 1/7 of the same files each, readinto, no format",
         "readinto + crc32c": ("the same, then the crc32c of every 512 KiB, one thread (reshard checks in its "
                               "I/O threads)"),
         "reshard before": "the --against checkout"}

#: Pause before each timed run: fresh memory costs the same whichever system ran before (harness.run_group).
SETTLE_S = 3.0


class ReshardSave(Task):
    """``create(url, layouts).write(rank, piece)`` at defaults; rank 0 commits once every rank wrote."""

    def __init__(self, ctx: Ctx) -> None:
        rs = reshard_store()
        self.rs, self.ctx, self.url = rs, ctx, ctx.args["url"]
        self.layouts = tasks_reshard._layouts(ctx.args, "mesh")
        self.ranks = sorted(set().union(*(lay.ranks for lay in self.layouts.values())))
        specs = data.tensors(ctx.args["workload"], ctx.args["cfg"])
        self.full = {s.name: data.fill(s.index, data.whole(s.shape), s.dtype) for s in specs}
        self.local = {n: np.ascontiguousarray(self.full[n][lay.region(ctx.rank)])
                      for n, lay in self.layouts.items() if ctx.rank in lay.ranks}

    def prepare(self, rep: int) -> None:
        if self.ctx.rank == 0:
            shutil.rmtree(self.url, ignore_errors=True)

    def run(self, rep: int) -> dict[str, Any]:
        writer = self.rs.create(self.url, self.layouts)
        writer.write(self.ctx.rank, self.local)
        if self.ctx.rank == 0:  # the barrier the user's script has before rank 0 commits
            tasks_reshard.wait_written(writer, self.ranks, poll=0.001)
            writer.commit()
        return writer.storage.stats.as_dict()


class DcpSave(tasks_dcp._Sharded):
    """``dcp.save(state, checkpoint_id=url)`` at defaults, of ``distribute_tensor(full, mesh, placements)``."""

    def __init__(self, ctx: Ctx) -> None:
        from torch.distributed.tensor import distribute_tensor

        super().__init__(ctx, "mesh")
        self.full = {s.name: tasks_dcp._torch_tensor(data.fill(s.index, data.whole(s.shape), s.dtype))
                     for s in self.specs}
        self.state = {s.name: distribute_tensor(self.full[s.name], self.mesh, self.placements[s.name])
                      for s in self.specs}

    def prepare(self, rep: int) -> None:
        if self.ctx.rank == 0:
            shutil.rmtree(self.ctx.args["url"], ignore_errors=True)

    def run(self, rep: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state, checkpoint_id=self.ctx.args["url"])  # ends with a collective: the ranks finish together


class ReadInto(Task):
    """The floor of an in-place load: ``readinto`` this rank's ``1/world`` of the checkpoint's bytes.

    The files under ``url`` (sorted) are taken as one run of bytes; rank ``r`` reads the
    ``r``-th of ``world`` equal parts, with unbuffered ``readinto`` into one buffer allocated
    and touched before timing: no format, no metadata, no redivision, no threads. With
    ``args["crc"]`` (:class:`ReadIntoChecked`) it also takes the crc32c of every
    ``CRC_PIECE`` bytes read, as a load that checks its data must.
    """

    crc = False

    def __init__(self, ctx: Ctx) -> None:
        paths = files_under(ctx.args["url"])
        sizes = [os.path.getsize(p) for p in paths]
        total = sum(sizes)
        lo, hi = total * ctx.rank // ctx.world, total * (ctx.rank + 1) // ctx.world
        self.parts: list[tuple[str, int, int]] = []  # (path, offset, length)
        start = 0
        for path, size in zip(paths, sizes, strict=True):
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                self.parts.append((path, a - start, b - a))
            start += size
        self.buf = np.ones(hi - lo, np.uint8)

    def run(self, rep: int) -> dict[str, Any]:
        view, pos = memoryview(self.buf), 0
        for path, offset, length in self.parts:
            with open(path, "rb", buffering=0) as f:
                f.seek(offset)
                end = pos + length
                while pos < end:
                    got = f.readinto(view[pos:end])
                    if not got:
                        raise EOFError(f"{path} ended early")
                    pos += got
        if self.crc:
            import crc32c

            for at in range(0, pos, CRC_PIECE):
                crc32c.crc32c(view[at:at + CRC_PIECE])
        return {"bytes": pos}


class ReadIntoChecked(ReadInto):
    """:class:`ReadInto`, then the crc32c of each ``CRC_PIECE`` bytes: the floor of a load that checks its data."""

    crc = True


class DcpLoadInto(tasks_dcp.Load):
    """``dcp.load`` into a state dict of DTensors allocated and touched before timing."""

    def __init__(self, ctx: Ctx) -> None:
        import torch

        super().__init__(ctx)
        self.state = {s.name: self.dtensor(s, torch.zeros(tuple(r.stop - r.start for r in self.regions[s.name]),
                                                          dtype=tasks_dcp._torch_dtype(s.dtype)))
                      for s in self.specs}

    def run(self, rep: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.state, checkpoint_id=self.ctx.args["url"])
        self.got = self.state


def run(runner: Runner) -> None:
    """The fresh rows of every case, reshard and DCP interleaved, ``runner.opts.reps`` runs each."""
    opts = runner.opts
    systems = ["reshard", *(["dcp"] if "dcp" in opts.anchors else [])]
    for workload, mesh, target, save, load in CASES:
        cfg = opts.cfg[workload]
        size = data.total_bytes(data.tensors(workload, cfg))
        label = f"{workload.upper()} fresh"
        base = {"workload": workload, "cfg": cfg, "mesh": mesh, "target": target}
        urls = {s: runner.dir(f"{label.replace(' ', '-')}-{s}") for s in systems}
        saves = {"reshard": "bench.fresh:ReshardSave", "dcp": "bench.fresh:DcpSave"}
        loads = {"reshard": "bench.tasks_reshard:Load", "dcp": "bench.tasks_dcp:Load"}
        _interleaved(runner, label, save, systems, saves, base, urls, len(_ranks(mesh)), size)
        for s in systems:  # loads read a warm page cache, every system alike (as the warm harness)
            time_cat(files_under(urls[s]), 1, 0)
        for suffix, backed in (("", 0), (BACKED, BACKED_TIMES * size)):
            _interleaved(runner, label, load + suffix, systems, loads, base, urls, len(_ranks(target)), size, backed)
        if workload == "w1":
            _in_place(runner, label, load + IN_PLACE, systems, base, urls, len(_ranks(target)), size)


def in_place_only(runner: Runner) -> None:
    """W1 only: the fresh save (each system's checkpoint) and the in-place load rows (``python -m bench.fresh``)."""
    opts = runner.opts
    systems = ["reshard", *(["dcp"] if "dcp" in opts.anchors else [])]
    workload, mesh, target, save, load = CASES[0]
    cfg = opts.cfg[workload]
    size = data.total_bytes(data.tensors(workload, cfg))
    label = f"{workload.upper()} fresh"
    base = {"workload": workload, "cfg": cfg, "mesh": mesh, "target": target}
    urls = {s: runner.dir(f"{label.replace(' ', '-')}-{s}") for s in systems}
    _interleaved(runner, label, save, systems, {"reshard": "bench.fresh:ReshardSave", "dcp": "bench.fresh:DcpSave"},
                 base, urls, len(_ranks(mesh)), size)
    for s in systems:
        time_cat(files_under(urls[s]), 1, 0)
    _in_place(runner, label, load + IN_PLACE, systems, base, urls, len(_ranks(target)), size)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.fresh [--against DIR] [--reps N] [--out FILE]``: :func:`in_place_only`, as a table."""
    import argparse
    import sys
    import tempfile
    import time

    from bench.report import machine, markdown
    from bench.workloads import Options, Runner, available_anchors

    p = argparse.ArgumentParser(prog="python -m bench.fresh", description=in_place_only.__doc__)
    p.add_argument("--against", type=Path, default=None, help="another reshard checkout, run beside this one")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-anchors", action="store_true", help="skip DCP")
    p.add_argument("--out", default=str(Path(__file__).parent / "results-fresh-inplace.md"))
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="reshard-fresh-"))
    opts = Options(cfg=data.FULL, workdir=work, reps=args.reps, only={"fresh"}, against=args.against,
                   anchors=set() if args.no_anchors else available_anchors() & {"dcp"})
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    try:
        runner = Runner(opts)
        in_place_only(runner)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = markdown(runner.rows, opts, machine(), f"Total time: {time.monotonic() - t0:.0f} s; load average "
                    f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.")
    print(text)
    Path(args.out).write_text(text)
    sys.stdout.flush()
    return 0


def _in_place(runner: Runner, label: str, phase: str, systems: list[str], base: dict[str, Any],
              urls: dict[str, str], world: int, size: int) -> None:
    """The loads into allocated buffers: the ``readinto`` floor, reshard (and ``--against``'s), DCP."""
    tasks = {"readinto": "bench.fresh:ReadInto", "readinto + crc32c": "bench.fresh:ReadIntoChecked",
             "reshard": "bench.tasks_reshard:Load", "dcp": "bench.fresh:DcpLoadInto"}
    names = ["readinto", "readinto + crc32c", "reshard", *(["reshard before"] if runner.opts.against else []),
             *systems[1:]]
    envs = {"reshard before": before_env(runner.opts.against, runner.dir("against-links"))} \
        if runner.opts.against else {}
    _interleaved(runner, label, phase, names, {**tasks, "reshard before": tasks["reshard"]},
                 {**base, "into": True}, {**urls, **{n: urls["reshard"] for n in names if n != "dcp"}},
                 world, size, envs=envs)


def before_env(checkout: Path, links: str) -> dict[str, str]:
    """Workers' environment in which ``reshard`` is the one in ``checkout`` (``bench`` stays this one)."""
    from bench.cli_start import checkout_env
    from bench.harness import ROOT

    env = checkout_env(checkout, Path(links))
    return {"PYTHONPATH": f"{ROOT}{os.pathsep}{env['PYTHONPATH']}"}


def _ranks(mesh: list[int]) -> range:
    return range(int(np.prod(mesh)))


def _interleaved(runner: Runner, label: str, phase: str, systems: list[str], tasks: dict[str, str],
                 base: dict[str, Any], urls: dict[str, str], world: int, size: int, backed: int = 0,
                 envs: dict[str, dict[str, str]] | None = None) -> None:
    """``reps`` rounds of one fresh group per system (A B A B ...); one row per system."""
    from bench.workloads import Row

    got = {s: Measurement() for s in systems}
    for _ in range(runner.opts.reps):
        for s in systems:
            args = {**base, "url": urls[s], **({"port": free_port()} if s == "dcp" else {})}
            m = run_group(tasks[s], world, args, reps=1, warmup=0, budget_s=runner.opts.budget_s,
                          settle_s=0.0 if runner.opts.cfg is data.SMOKE else SETTLE_S, backed_bytes=backed,
                          env=(envs or {}).get(s))
            into = got[s]
            into.times += m.times
            into.peak_rss, into.base_rss = max(into.peak_rss, m.peak_rss), max(into.base_rss, m.base_rss)
            into.extra = m.extra
            into.error = into.error or m.error
    for s in systems:
        m = got[s]
        note = "fresh processes, A B A B; " + ("durable=True (default)" if s == "reshard" and "save" in phase
                                               else "sync_files=True (default)" if "save" in phase
                                               else NOTES.get(s, ""))
        runner.rows.append(Row(label, phase, s, m, size, note.strip("; ")))
        print(f"  {label:<8} {phase:<34} {s:<8} " + (f"{m.median:8.3f} s {m.times}" if m.ok else f"FAILED {m.error}"),
              flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
