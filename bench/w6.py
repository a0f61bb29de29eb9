"""W6, data-parallel scale (issue 25): replicated state saved and loaded by 8 ranks, reshard vs DCP.

``python -m bench.w6 [--mib 1024] [--reps 2] [--s3] [--cases ddp,hsdp,tp_dp]``

1 GiB (by default) of model-shaped float32 tensors (an embedding and 4 linears per layer, as
bench W3) on 8 spawned gloo ranks, three ways:

- ``ddp``: every tensor replicated on the 8 ranks (DDP);
- ``hsdp``: 2 shard x 4 replicate (mesh (4, 2), ``[Replicate(), Shard(0)]``);
- ``tp_dp``: tensor parallel 4 x data parallel 2 with optimizer sharding: weights split over
  tp and replicated over dp, the two Adam moments split over tp and again over dp.

Both systems save DTensor state dicts at their defaults (``reshard.torch.save``: durable,
replica-balanced; ``dcp.save``: ``sync_files=True``, its planner spreading replicated items
over ranks) between two barriers, then every rank loads its own part (same topology, a
restart: ``reshard.torch.load`` with the job's process group; ``dcp.load``), checked. Local
loads read a warm page cache for both systems (rank 0 reads every file first, untimed):
reshard's durable writes go around the page cache (O_DIRECT), DCP's through it, so a load
right after the save would otherwise compare a disk read with a memory copy.
Runs alternate reshard / DCP in fresh processes. Machine-independent figures per run:
bytes the busiest rank wrote / checkpoint size (``wchar`` of ``/proc/self/io``: files or
sockets alike) and bytes the whole job read / checkpoint size (``rchar``; on S3 also the
GET bytes the counting proxy saw).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from bench import data
from bench.harness import free_port

#: case -> (mesh, placements of weights by kind, placements of optimizer moments by kind)
CASES: dict[str, tuple[tuple[int, ...], dict[str, list[str]], dict[str, list[str]]]] = {
    "ddp": ((8,), {"col": ["R"], "row": ["R"]}, {"col": ["R"], "row": ["R"]}),
    "hsdp": ((4, 2), {"col": ["R", "S(0)"], "row": ["R", "S(0)"]}, {"col": ["R", "S(0)"], "row": ["R", "S(0)"]}),
    "tp_dp": ((2, 4), {"col": ["R", "S(0)"], "row": ["R", "S(1)"]},
              {"col": ["S(0)", "S(0)"], "row": ["S(0)", "S(1)"]}),
}


def specs(mib: int) -> list[data.Spec]:
    """Weights and two Adam moments, float32, about ``mib`` MiB in all (hidden 1024, vocab 8192; hidden 64
    below 256 MiB, for smoke runs)."""
    h = 1024 if mib >= 256 else 64
    vocab = 8 * h
    per_layer = 12 * h * h * 4 * 3
    layers = max(1, (mib * 2**20 - vocab * h * 12) // per_layer)
    weights = [("embedding", (vocab, h), "col")]
    for i in range(layers):
        weights += [(f"layer{i}.qkv", (3 * h, h), "col"), (f"layer{i}.proj", (h, h), "row"),
                    (f"layer{i}.fc1", (4 * h, h), "col"), (f"layer{i}.fc2", (h, 4 * h), "row")]
    out: list[data.Spec] = []
    for group in ("model", "optim.exp_avg", "optim.exp_avg_sq"):
        out += [data.Spec(f"{group}.{n}", s, "float32", k, len(out) + j) for j, (n, s, k) in enumerate(weights)]
    return out


def _placements(case: str, spec: data.Spec) -> list[str]:
    _, weights, moments = CASES[case]
    return (weights if spec.name.startswith("model.") else moments)[spec.kind]


def _io() -> tuple[int, int]:
    with open("/proc/self/io") as f:
        got = dict(line.split(": ") for line in f.read().splitlines())
    return int(got["rchar"]), int(got["wchar"])


def _warm(folder: str) -> None:
    """Read every file under ``folder`` once (reshard's durable writes bypass the page cache, DCP's do not)."""
    for here, _, files in os.walk(folder):
        for f in files:
            with open(os.path.join(here, f), "rb") as fh:
                while fh.read(16 << 20):
                    pass


def _worker(rank: int, world: int, port: int, system: str, case: str, mib: int, url: str,
            options: dict[str, Any], out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", CASES[case][0])

    def place(p: str) -> Any:
        return Replicate() if p == "R" else Shard(int(p[2:-1]))

    state = {}
    for s in specs(mib):
        full = torch.from_numpy(data.fill(s.index, data.whole(s.shape), s.dtype))
        state[s.name] = distribute_tensor(full, mesh, [place(p) for p in _placements(case, s)])
    import reshard.torch as rt  # imports done before the clock starts
    import torch.distributed.checkpoint as dcp
    if url.startswith("s3://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    dist.barrier()
    r0, w0 = _io()
    t = time.perf_counter()
    if system == "reshard":
        rt.save(state, url, storage_options=options or None)
    elif url.startswith("s3://"):
        dcp.save(state, storage_writer=FsspecWriter(url, **options))
    else:
        dcp.save(state, checkpoint_id=url)
    dist.barrier()
    save_s = time.perf_counter() - t
    written = _io()[1] - w0
    target = {n: v.__class__.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements)
              for n, v in state.items()}
    if rank == 0 and "://" not in url:  # loads read a warm page cache, both systems alike (see the docstring)
        _warm(url)
    dist.barrier()
    r0, _ = _io()
    t = time.perf_counter()
    if system == "reshard":
        rt.load(target, url, process_group=dist.group.WORLD, storage_options=options or None)
    elif url.startswith("s3://"):
        dcp.load(target, storage_reader=FsspecReader(url, **options))
    else:
        dcp.load(target, checkpoint_id=url)
    dist.barrier()
    load_s = time.perf_counter() - t
    read = _io()[0] - r0
    bad = [n for n, v in target.items() if not torch.equal(v.to_local(), state[n].to_local())]
    out.put((rank, save_s, load_s, written, read, bad))
    dist.barrier()
    dist.destroy_process_group()


def run_once(system: str, case: str, mib: int, url: str, options: dict[str, Any]) -> dict[str, Any]:
    """One fresh group of 8 processes: save, then load; the slowest rank's times and the byte counts."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = mp.start_processes(_worker, args=(8, free_port(), system, case, mib, url, options, q), nprocs=8,
                               join=False, start_method="spawn")
    got = [q.get(timeout=900) for _ in range(8)]
    procs.join(timeout=120)
    bad = sorted({n for g in got for n in g[5]})
    if bad:
        raise AssertionError(f"{system} {case}: loaded values differ: {bad[:5]}")
    return {"save": max(g[1] for g in got), "load": max(g[2] for g in got),
            "busiest_written": max(g[3] for g in got), "read": sum(g[4] for g in got)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.w6", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--cases", default="ddp,hsdp,tp_dp")
    p.add_argument("--s3", action="store_true", help="also on the loopback S3 server (moto, counting proxy)")
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    size = data.total_bytes(specs(args.mib))
    work = args.workdir or tempfile.mkdtemp(prefix="w6-")
    stores: list[tuple[str, Any]] = [("local", None)]
    server = proxy = None
    if args.s3:
        from reshard.store.testing import LocalS3Server, S3Proxy

        server = LocalS3Server().start()
        server.make_bucket("bench-w6")
        proxy = S3Proxy(server.endpoint_url).start()
        stores.append(("s3", proxy))
    print(f"W6: {size / 2**20:.0f} MiB, 8 ranks; {args.reps} runs each, reshard and DCP alternating", flush=True)
    print("| case | storage | system | save s (median) | load s (median) | busiest rank wrote / size | "
          "job read / size | S3 GET bytes / size |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    try:
        for case in args.cases.split(","):
            for where, px in stores:
                rows: dict[str, list[dict[str, Any]]] = {"reshard": [], "dcp": []}
                for rep in range(args.reps):
                    for system in rows:
                        if px is None:
                            url, options = os.path.join(work, f"{case}-{system}-{rep}"), {}
                        else:
                            url, options = f"s3://bench-w6/{case}-{system}-{rep}", px.storage_options()
                        before = px.bytes_sent if px is not None else 0
                        m = run_once(system, case, args.mib, url, options)
                        m["gets"] = px.bytes_sent - before if px is not None else None
                        rows[system].append(m)
                        if px is None:
                            shutil.rmtree(url, ignore_errors=True)
                for system, ms in rows.items():
                    gets = ms[-1]["gets"]
                    print(f"| {case} | {where} | {system} | {statistics.median(m['save'] for m in ms):.2f} | "
                          f"{statistics.median(m['load'] for m in ms):.2f} | "
                          f"{ms[-1]['busiest_written'] / size:.3f} | {ms[-1]['read'] / size:.2f} | "
                          + (f"{gets / size:.2f} |" if gets is not None else "- |"), flush=True)
    finally:
        if proxy is not None:
            proxy.stop()
        if server is not None:
            server.stop()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
