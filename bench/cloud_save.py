"""W1 saved to S3 over a shaped link (issue 38): reshard, DCP's FsspecWriter and moto's own PUT speed side by side.

``python -m bench.cloud_save [--rate 400] [--rtt 5 50] [--mib 256] [--reps 2] [--out FILE]`` builds a
:class:`reshard.store.testing.ShapedCloud` per round-trip time and, into its moto S3 server over the link:

* ``raw PUT``: each rank's bytes (as many as reshard's rank object holds) uploaded by s3fs itself,
  8 objects side by side, each a multipart upload of 8 MiB parts (``x raw PUT`` is to this row), then
  each one PUT: what moto takes on this link;
* ``reshard save``: 8 rank processes, each ``create(url).write(rank, local)`` (a rank's packed
  object: a multipart upload straight from its buffers), rank 0 commits once all wrote (a barrier of
  local files, as a job's own barrier goes over its network, not the bucket);
* ``reshard commit``: the commit alone (8 ranks written beforehand, this process), its requests;
* ``TensorStore save``: the same 8 rank processes with ``create(url, engine="tensorstore", form="directory")``:
  each rank's regions written by TensorStore's zarr3 driver through its ``s3`` kvstore, rank 0 commits;
* ``DCP save``: 8 gloo ranks, ``dcp.save`` with ``FsspecWriter(s3://..., sync_files=False)``
  (s3fs's buffered file: one PUT per rank's file up to 50 MiB, parts of 50 MiB beyond).

Each row's floor is ``bytes / (0.95 x rate) + 3 RTTs`` (the rate less TCP/IP headers; a new
connection's handshake, the data, the commit marker). ``peak RSS +`` is the largest growth of a rank
process's peak RSS over its RSS once its tensors were made (``ru_maxrss``, bench.harness): a joined
copy of a rank's object would show as its size. ``moto CPU`` is the CPU seconds moto's server process
used per run (warm-up included, averaged): near the row's time, moto (one Python process) is what
caps it. Results go to stdout as a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import data
from bench.cloud import tensorstore_s3_key, w1_config
from bench.harness import Ctx, free_port, run_group
from bench.tasks_dcp import Save as _DcpLocalSave
from bench.tasks_reshard import Save as _ReshardSave


class ReshardS3Save(_ReshardSave):
    """:class:`bench.tasks_reshard.Save` into ``s3://``, each repetition a new step (save_id) of the same URL."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)
        self.step = 0

    def run(self, rep: int) -> dict[str, Any]:
        self.step += 1  # every rank counts alike
        engine = self.ctx.args.get("engine", "fast")  # tensorstore: the directory form through TensorStore's s3 kvstore
        writer = self.rs.create(self.url, self.layouts, storage_options=self.ctx.args["storage_options"],
                                overwrite=True, save_id=self.step, engine=engine,
                                form="directory" if engine == "tensorstore" else None)
        writer.write(self.ctx.rank, self.local)
        # the barrier a training job has anyway, over its own network as DCP's gloo collectives are, not the bucket:
        # polled over the link, one rank after another, it took a round trip per rank after the last object was in
        barrier = Path(self.ctx.args["barrier"])  # a folder of this group's own
        barrier.mkdir(exist_ok=True)
        (barrier / f"{self.step}.{self.ctx.rank}").touch()
        if self.ctx.rank == 0:
            deadline = time.monotonic() + 600
            while not all((barrier / f"{self.step}.{r}").exists() for r in self.ranks):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the ranks of step {self.step} did not all write within 600 s")
                time.sleep(0.001)
            writer.commit()
        return writer.storage.stats.as_dict()


class DcpS3Save(_DcpLocalSave):
    """``dcp.save`` of each rank's DTensors through ``FsspecWriter`` into ``s3://`` (``storage_options``)."""

    def __init__(self, ctx: Ctx) -> None:
        super().__init__(ctx)

    def prepare(self, rep: int) -> None:
        pass  # FsspecWriter(overwrite=True) replaces the files

    def run(self, rep: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(self.ctx.args["url"], sync_files=False, **self.ctx.args["storage_options"])
        dcp.save(self.state, storage_writer=writer)


def _layouts(cfg: dict[str, Any]) -> dict[str, Any]:
    return {s.name: data.reshard_layout("w1", s, (8,)) for s in data.tensors("w1", cfg)}


def _rank_bytes(cfg: dict[str, Any]) -> list[int]:
    lay = _layouts(cfg)
    return [sum(int(np.prod([r.stop - r.start for r in lay[s.name].region(rank)])) * 4 for s in data.tensors("w1", cfg))
            for rank in range(8)]


def _raw_put(opts: dict[str, Any], bucket: str, blobs: list[bytes], chunksize: int) -> None:
    """s3fs's own upload of ``blobs`` side by side: multipart in ``chunksize`` parts, one PUT each if that is
    over half an object."""
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    fs.pipe({f"{bucket}/raw/{r}.bin": b for r, b in enumerate(blobs)}, chunksize=chunksize)


def _server_cpu(cloud: Any) -> float:
    """CPU seconds moto's server process has used so far (``/proc/<pid>/stat``: user + system)."""
    for proc in cloud._procs:
        if any("motoserve" in str(a) for a in proc.args):
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return float("nan")


def _commit_alone(url: str, opts: dict[str, Any], cfg: dict[str, Any], save_id: int) -> Any:
    """A save of 8 ranks written here, then its commit timed alone: (seconds, its requests)."""
    import reshard.store as rs

    lay = _layouts(cfg)
    writer = rs.create(url, lay, storage_options=opts, overwrite=True, save_id=save_id)
    for rank in range(8):
        writer.write(rank, {s.name: data.fill(s.index, lay[s.name].region(rank), s.dtype)
                            for s in data.tensors("w1", cfg)})
    before = writer.root.stats.as_dict()
    t = time.perf_counter()
    writer.commit()
    took = time.perf_counter() - t
    after = writer.root.stats.as_dict()
    return took, {k: after[k] - before.get(k, 0) for k in ("requests", "writes") if k in after}


def measure(rate: float, rtt_ms: float, cfg: dict[str, Any], reps: int, conn: float | None,
            dcp: bool = True) -> list[dict[str, Any]]:
    """Rows of one cloud (rate Mbit/s, RTT ms)."""
    from reshard.store.testing import ShapedCloud

    rows: list[dict[str, Any]] = []
    sizes = _rank_bytes(cfg)
    total = sum(sizes)
    bw = rate * 1e6 / 8 * 0.95
    floor = total / bw + 3 * rtt_ms / 1000
    with ShapedCloud(rate_mbit=rate, rtt=rtt_ms / 1000, conn_mbit=conn) as cloud:
        bucket = cloud.make_bucket()
        opts = cloud.storage_options()
        blobs = [os.urandom(n) for n in sizes]
        raws = []
        for chunk, what in ((8 << 20, "raw PUT (8 objects side by side, multipart, 8 MiB parts)"),
                            (1 << 30, "raw PUT (8 objects side by side, one PUT each)")):
            times = []
            cpu = _server_cpu(cloud)
            for _ in range(reps + 1):  # the first: warm-up (the client's session and connections)
                t = time.perf_counter()
                _raw_put(opts, bucket, blobs, chunk)
                times.append(time.perf_counter() - t)
            raws.append(statistics.median(times[1:]))
            rows.append(_row(rtt_ms, "s3fs", what, raws[-1], floor, raws[0], total,
                             moto=(_server_cpu(cloud) - cpu) / (reps + 1)))
        raw = raws[0]
        del blobs
        barriers = tempfile.TemporaryDirectory(prefix="reshard-barrier-")
        args = {"workload": "w1", "cfg": cfg, "mesh": [8], "url": f"s3://{bucket}/reshard",
                "storage_options": opts, "barrier": f"{barriers.name}/reshard"}
        cpu = _server_cpu(cloud)
        m = run_group("bench.cloud_save:ReshardS3Save", 8, args, reps=reps, warmup=1, timeout_s=900)
        if m.error:
            print(f"reshard save failed: {m.error[-600:]}", flush=True)
        else:
            rows.append(_row(rtt_ms, "reshard", "save (8 ranks + commit)", statistics.median(m.times), floor, raw,
                             total, rss=m.peak_rss - m.base_rss, moto=(_server_cpu(cloud) - cpu) / (reps + 1)))
        tensorstore_s3_key(opts)
        ts_args = {**args, "url": f"s3://{bucket}/ts", "engine": "tensorstore", "barrier": f"{barriers.name}/ts"}
        m = run_group("bench.cloud_save:ReshardS3Save", 8, ts_args, reps=reps, warmup=1, timeout_s=900)
        if m.error:
            print(f"TensorStore save failed: {m.error[-600:]}", flush=True)
        else:
            rows.append(_row(rtt_ms, "TensorStore", "save (8 ranks + commit, directory form)",
                             statistics.median(m.times), floor, raw, total, rss=m.peak_rss - m.base_rss))
        barriers.cleanup()
        took, counts = _commit_alone(f"s3://{bucket}/alone", opts, cfg, 1)
        rows.append(_row(rtt_ms, "reshard", "commit alone (8 ranks)", took, 3 * rtt_ms / 1000, None, 0,
                         requests=counts.get("requests", 0) + counts.get("writes", 0)))
        if dcp:
            cpu = _server_cpu(cloud)
            m = run_group("bench.cloud_save:DcpS3Save", 8, {**args, "url": f"s3://{bucket}/dcp", "port": free_port()},
                          reps=reps, warmup=1, timeout_s=900)
            if m.error:
                print(f"DCP save failed: {m.error[-600:]}", flush=True)
            else:
                rows.append(_row(rtt_ms, "DCP", "save (FsspecWriter, 8 ranks)", statistics.median(m.times), floor,
                                 raw, total, rss=m.peak_rss - m.base_rss, moto=(_server_cpu(cloud) - cpu) / (reps + 1)))
    return rows


def _row(rtt_ms: float, system: str, what: str, t: float, floor: float, raw: float | None, nbytes: int,
         rss: int | None = None, requests: int | None = None, moto: float | None = None) -> dict[str, Any]:
    out = {"moto": moto, "rtt_ms": rtt_ms, "system": system, "what": what, "time": t, "floor": floor,
           "ratio": t / floor, "raw": t / raw if raw else None, "mib": nbytes / 2**20, "rss": rss, "requests": requests,
           "load": os.getloadavg()[0]}
    print(_line(out), flush=True)
    return out


HEADER = ("| RTT | system | what | MiB | time (s) | floor (s) | x floor | x raw PUT | moto CPU (s) | peak RSS + (MiB) "
          "| requests | load avg |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def _line(r: dict[str, Any]) -> str:
    raw = f"{r['raw']:.2f}" if r["raw"] is not None else ""
    rss = f"{r['rss'] / 2**20:.0f}" if r["rss"] is not None else ""
    req = r["requests"] if r["requests"] is not None else ""
    moto = f"{r['moto']:.1f}" if r.get("moto") is not None else ""
    return (f"| {r['rtt_ms']:g} ms | {r['system']} | {r['what']} | {r['mib']:.0f} | {r['time']:.3f} | "
            f"{r['floor']:.3f} | {r['ratio']:.2f} | {raw} | {moto} | {rss} | {req} | {r['load']:.1f} |")


def main(argv: list[str] | None = None) -> None:
    """Run the rows and print the table."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rate", type=float, default=400.0, help="link rate, Mbit/s")
    p.add_argument("--rtt", type=float, nargs="+", default=[5.0, 50.0], help="round-trip times, ms")
    p.add_argument("--mib", type=int, default=256, help="W1 size in MiB (16 tensors, 8 ranks)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--conn", type=float, help="cap per connection, Mbit/s (default: none)")
    p.add_argument("--no-dcp", action="store_true", help="leave DCP out")
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args(argv)
    cfg = w1_config(args.mib)
    rows_per, cols = cfg["rows"], cfg["cols"]
    print(f"W1: 16 x {rows_per} x {cols} float32 = {16 * rows_per * cols * 4 / 2**20:.0f} MiB, saved by 8 ranks "
          f"to S3 (moto); link {args.rate:g} Mbit/s", flush=True)
    print(HEADER, flush=True)
    rows = []
    for rtt in args.rtt:
        rows += measure(args.rate, rtt, cfg, args.reps, args.conn, not args.no_dcp)
    if args.out:
        with open(args.out, "w") as f:
            f.write(HEADER + "\n" + "\n".join(_line(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
