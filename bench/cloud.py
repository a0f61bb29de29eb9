"""W1 over a shaped link (issue 38): one rank's load and a whole read, against the link's floor.

``python -m bench.cloud [--rate 400] [--rtt 5 50] [--mib 64] [--reps 3]`` builds a
:class:`reshard.store.testing.ShapedCloud` per round-trip time, saves W1-like tensors (16 float32
tensors, ``Shard(0)`` over 8 ranks) in both storage forms into the folder nginx serves (and, with
``--s3``, into its S3 bucket), and reads them back over the link from this process:

* ``load rank 3 of 7``: ``open(url).load(Shard(0) over 7, rank=3)`` (open included);
* ``read_all``: ``open(url).read_all()``.

After each reshard row, ``same GETs, one burst`` sends the GETs the relay saw in that row's last call again,
all at once, from one aiohttp session of 64 kept connections (S3 ones presigned beforehand): no dependent round
trip, no client work but the requests. Not a floor (it skips open's round trips), but what the server and the
link give those very requests.

TensorStore rows are reshard's ``engine="tensorstore"`` on the directory form (TensorStore's ``http`` and
``s3`` kvstores); DCP rows (``--dcp``) are ``dcp.load`` of the same W1 saved by 8 gloo ranks, through
``FsspecReader`` over http and, with ``--s3``, from the bucket. S3 reads keep s3fs's instance cache (one
client and pool, as a user has them).

Each row's floor is ``bytes needed / goodput + RTTs``: the goodput measured on the same link by one
plain download (``cloud.get``), the RTTs the ones no client can avoid (a new connection's handshake,
open's marker read, then the data: 3 round trips). Results go to stdout as a markdown table
(``--out FILE`` writes it too) with the load average while measuring.

The ``RTTs`` column counts round trips one after another in the last measured call, as the link
saw them (:mod:`reshard.store.testing.chain`, from the relay's request log): ``total / before
data``, handshakes of new connections included; the last level of a load is its data.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np

from bench import data


def _layouts(mesh: int, cfg: dict[str, Any]) -> dict[str, Any]:
    return {s.name: data.reshard_layout("w1", s, (mesh,)) for s in data.tensors("w1", cfg)}


def _save(url: str, cfg: dict[str, Any], form: str, options: dict[str, Any] | None = None) -> None:
    import reshard.store as rs

    lay = _layouts(8, cfg)
    specs = data.tensors("w1", cfg)
    writer = rs.create(url, lay, form=form, overwrite=True, storage_options=options)
    for rank in range(8):
        writer.write(rank, {s.name: data.fill(s.index, lay[s.name].region(rank), s.dtype) for s in specs})
    writer.commit()


def _dcp_save(path: str, cfg: dict[str, Any]) -> str | None:
    """W1 saved by 8 DCP ranks (DTensor over gloo, :mod:`bench.tasks_dcp`) into ``path``; an error or None."""
    from bench.harness import free_port, run_group

    m = run_group("bench.tasks_dcp:Save", 8, {"workload": "w1", "cfg": cfg, "url": path, "mesh": [8],
                                              "port": free_port()}, reps=1, warmup=0, timeout_s=600)
    return m.error or None


def _dcp_read_all(url: str, cfg: dict[str, Any], options: dict[str, Any] | None = None) -> dict[str, Any]:
    """DCP's whole read over the link: ``dcp.load(no_dist=True)`` through ``FsspecReader`` (fsspec's http or s3fs)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    state = {s.name: torch.empty(s.shape, dtype=torch.float32) for s in data.tensors("w1", cfg)}
    dcp.load(state, storage_reader=FsspecReader(url, **(options or {})), no_dist=True)
    s = data.tensors("w1", cfg)[5]
    assert np.array_equal(state[s.name].numpy()[:3], data.fill(s.index, (slice(0, 3), slice(0, s.shape[1])), s.dtype))
    return {}


def _goodput(cloud: Any, nbytes: int) -> float:
    """Bytes per second one plain HTTP download gets on the link (the best of 2)."""
    import http.client

    (cloud.root / "goodput.bin").write_bytes(os.urandom(nbytes))
    conn = http.client.HTTPConnection(cloud.address, 80, timeout=60)
    cloud.get("/goodput.bin", {"Range": "bytes=0-0"}, conn=conn)
    best = 0.0
    for _ in range(2):
        t = time.perf_counter()
        cloud.get("/goodput.bin", conn=conn)
        best = max(best, nbytes / (time.perf_counter() - t - cloud.rtt))
    conn.close()
    (cloud.root / "goodput.bin").unlink()
    return best


def _time(fn: Any, reps: int, warmup: bool = True) -> tuple[float, Any, tuple[float, float]]:
    """Median wall time of ``reps`` calls after one warm-up (fsspec's HTTP session, imports, connections),
    the last call's result and its span on ``time.monotonic()``."""
    out = fn() if warmup else None
    times = []
    span = (0.0, 0.0)
    for _ in range(reps):
        t, start = time.perf_counter(), time.monotonic()
        out = fn()
        times.append(time.perf_counter() - t)
        span = (start, time.monotonic())
    return statistics.median(times), out, span


def _replay(cloud: Any, span: tuple[float, float]) -> _Burst:
    """A call that sends the GETs the relay saw in ``span`` again, all at once, on one aiohttp session of 64
    connections (S3 ones presigned beforehand): no dependent round trips, no client work but the requests, so
    its time is what the server and the link give those requests."""
    import urllib.parse

    time.sleep(0.05)  # the relay's last lines
    reqs = [r for r in cloud.requests(*span) if r.method == "GET"]
    s3_port = int(cloud.s3_endpoint.rsplit(":", 1)[1])
    client = cloud.client()

    def url(r: Any) -> str:
        if r.port != s3_port:
            return f"{cloud.http_url}{r.path}"
        bucket, key = urllib.parse.unquote(r.path).lstrip("/").split("/", 1)
        return str(client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key},
                                                 ExpiresIn=3600))

    return _Burst([(url(r), {} if r.range == "-" else {"Range": r.range}) for r in reqs])


class _Burst:
    """Calls that send ``gets`` (URL, headers) all at once on one kept session; :meth:`close` ends it."""

    def __init__(self, gets: list[tuple[str, dict[str, str]]]) -> None:
        import asyncio

        self.gets, self.loop = gets, asyncio.new_event_loop()
        self.session: Any = None

    def __call__(self) -> dict[str, Any]:
        return {"requests": len(self.gets), "bytes_fetched": self.loop.run_until_complete(self._burst())}

    async def _burst(self) -> int:
        import asyncio

        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))

        async def one(u: str, headers: dict[str, str]) -> int:
            async with self.session.get(u, headers=headers) as answer:
                answer.raise_for_status()
                return len(await answer.read())

        return sum(await asyncio.gather(*(one(u, h) for u, h in self.gets)))

    def close(self) -> None:
        if self.session is not None:
            self.loop.run_until_complete(self.session.close())
        self.loop.close()


def round_trips(cloud: Any, span: tuple[float, float], data: Any) -> tuple[int, int]:
    """Round trips one after another in ``span`` (handshakes included), and how many came before the
    first level holding a data request (``data(relayed)``), from the relay's log."""
    from reshard.store.testing import chain

    time.sleep(0.05)  # the relay's last lines
    reqs = cloud.requests(*span)
    depths = chain.depths(reqs, cloud.rtt)
    if not depths:
        return 0, 0
    first = min((d for r, d in zip(reqs, depths, strict=True) if data(r)), default=max(depths) + 1)
    return max(depths), first - 1


def is_data(r: Any) -> bool:
    """A request for chunk bytes: a data object's range (packed; not a manifest's suffix) or a shard (directory)."""
    if "/packed/" in r.path and r.path.endswith(".bin"):
        return not r.range.startswith("bytes=-")
    return "/c/" in r.path and not r.range.startswith("bytes=-")


def measure(rate: float, rtt_ms: float, cfg: dict[str, Any], reps: int, s3: bool,
            conn: float | None = None, dcp: bool = False) -> list[dict[str, Any]]:
    """Rows of one cloud (rate Mbit/s, RTT ms)."""
    import reshard.store as rs
    from reshard.store.testing import ShapedCloud

    rows: list[dict[str, Any]] = []
    specs = data.tensors("w1", cfg)
    total = data.total_bytes(specs)
    target = _layouts(7, cfg)
    need_rank = sum(int(np.prod([r.stop - r.start for r in target[s.name].region(3)])) * 4 for s in specs)
    with ShapedCloud(rate_mbit=rate, rtt=rtt_ms / 1000, conn_mbit=conn) as cloud:
        bw = _goodput(cloud, 16 << 20) if conn is None else rate * 1e6 / 8 * 0.95
        urls = {}
        for form in ("packed", "directory"):
            _save(str(cloud.root / form), cfg, form)
            urls[("http", form)] = (f"{cloud.http_url}/{form}", None)
        if s3:
            bucket = cloud.make_bucket()
            # s3fs's instance cache on, as a user has it: one client (made once, 0.15-0.3 s of botocore) and its
            # pool for every open, as http's rows keep fsspec's one HTTP filesystem
            opts = cloud.storage_options(skip_instance_cache=False)
            tensorstore_s3_key(opts)
            for form in ("packed", "directory"):
                _save(f"s3://{bucket}/{form}", cfg, form, opts)
                urls[("s3", form)] = (f"s3://{bucket}/{form}", opts)
        dcp_error = _dcp_save(str(cloud.root / "dcp"), cfg) if dcp else "not asked (--dcp)"
        for (scheme, form), (url, opts) in urls.items():
            def load(url: str = url, opts: Any = opts) -> Any:
                ckpt = rs.open(url, storage_options=opts)
                ckpt.load(target, 3)
                return ckpt.stats.as_dict()

            def read_all(url: str = url, opts: Any = opts) -> Any:
                ckpt = rs.open(url, storage_options=opts)
                ckpt.read_all()
                return ckpt.stats.as_dict()

            def ts_load(url: str = url, opts: Any = opts) -> Any:
                rs.open(url, storage_options=opts, engine="tensorstore").load(target, 3)
                return {}

            def ts_read_all(url: str = url, opts: Any = opts) -> Any:
                rs.open(url, storage_options=opts, engine="tensorstore").read_all()
                return {}

            cases = [("reshard", "load rank 3 of 7", load, need_rank), ("reshard", "read_all", read_all, total)]
            if form == "directory":
                cases += [("TensorStore", "load rank 3 of 7", ts_load, need_rank),
                          ("TensorStore", "read_all", ts_read_all, total)]
            for system, what, fn, need in cases:
                rows.append(_measure(fn, reps, True, need, bw, rtt_ms, system=system, scheme=scheme, form=form,
                                     what=what, cloud=cloud))
                if system == "reshard":  # the server's and the link's own speed for those requests
                    burst = _replay(cloud, rows[-1]["span"])
                    rows.append(_measure(burst, reps, True, need, bw, rtt_ms, system="same GETs, one burst",
                                         scheme=scheme, form=form, what=what))
                    burst.close()
        if dcp_error is None:
            dcp_urls = [("http", f"{cloud.http_url}/dcp", None)]
            if s3:  # the same files, uploaded to the bucket
                import s3fs

                s3fs.S3FileSystem(**opts).put(str(cloud.root / "dcp"), f"{bucket}/dcp", recursive=True)
                dcp_urls.append(("s3", f"s3://{bucket}/dcp", opts))
            for scheme, url, opts_ in dcp_urls:
                rows.append(_measure(lambda url=url, o=opts_: _dcp_read_all(url, cfg, o), 1, False, total, bw, rtt_ms,
                                     system="DCP", scheme=scheme, form="DCP (8 files)", what="read_all"))
        else:
            print(f"DCP rows skipped: {dcp_error[-400:]}", flush=True)
    return rows


def _measure(fn: Any, reps: int, warmup: bool, need: int, bw: float, rtt_ms: float, cloud: Any = None,
             **row: Any) -> dict[str, Any]:
    load1 = os.getloadavg()[0]
    t, stats, span = _time(fn, reps, warmup)
    trips = round_trips(cloud, span, is_data) if cloud is not None else None
    floor = need / bw + 3 * rtt_ms / 1000
    out = {**row, "rtt_ms": rtt_ms, "time": t, "floor": floor, "ratio": t / floor, "trips": trips, "span": span,
           "requests": (stats or {}).get("requests", ""), "bytes": (stats or {}).get("bytes_fetched"), "need": need,
           "goodput_mbit": bw * 8 / 1e6, "load": (load1 + os.getloadavg()[0]) / 2}
    print(_row(out), flush=True)
    return out


HEADER = ("| RTT | system | scheme | form | what | time (s) | floor (s) | x floor | RTTs (all / before data) "
          "| requests | fetched / needed | load avg |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def _row(r: dict[str, Any]) -> str:
    ratio = f"{r['bytes'] / r['need']:.2f}" if r.get("bytes") else ""
    trips = f"{r['trips'][0]} / {r['trips'][1]}" if r.get("trips") else ""
    return (f"| {r['rtt_ms']:g} ms | {r['system']} | {r['scheme']} | {r['form']} | {r['what']} | {r['time']:.3f} | "
            f"{r['floor']:.3f} | {r['ratio']:.2f} | {trips} | {r['requests']} | {ratio} | {r['load']:.1f} |")


def tensorstore_s3_key(opts: dict[str, Any]) -> None:
    """Put the test key of ``opts`` in the environment (unless one is there): TensorStore's s3 kvstore signs with
    the environment's key, it takes none inline, and moto wants a signature. Rank processes inherit it."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", opts["key"])
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", opts["secret"])


def w1_config(mib: float) -> dict[str, int]:
    """W1 of about ``mib`` MiB for the cloud benches: 16 float32 tensors of 936 columns, rows a multiple of 56
    (so 8 saving ranks and 7 loading ranks divide them)."""
    cols = 936
    return {"rows": max(8 * 7, int(mib * (1 << 20) / 16 / cols / 4) // 56 * 56), "cols": cols, "count": 16}


def main(argv: list[str] | None = None) -> None:
    """Run the rows and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=400.0, help="link rate, Mbit/s")
    p.add_argument("--rtt", type=float, nargs="+", default=[5.0, 50.0], help="round-trip times, ms")
    p.add_argument("--mib", type=int, default=64, help="W1 size in MiB (16 tensors)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--conn", type=float, help="cap per connection, Mbit/s (default: none)")
    p.add_argument("--dcp", action="store_true", help="also DCP: saved by 8 gloo ranks, read whole over http")
    p.add_argument("--s3", action="store_true", help="also through moto's S3 (slow: moto reads whole objects)")
    p.add_argument("--out", help="also write the table to this file")
    args = p.parse_args(argv)
    cfg = w1_config(args.mib)
    rows_per, cols = cfg["rows"], cfg["cols"]
    print(f"W1: 16 x {rows_per} x {cols} float32 = {16 * rows_per * cols * 4 / 2**20:.0f} MiB, saved by 8 ranks; "
          f"link {args.rate:g} Mbit/s, {args.conn or args.rate:g} Mbit/s per connection", flush=True)
    print(HEADER, flush=True)
    rows = []
    for rtt in args.rtt:
        rows += measure(args.rate, rtt, cfg, args.reps, args.s3, args.conn, args.dcp)
    if args.out:
        with open(args.out, "w") as f:
            f.write(HEADER + "\n" + "\n".join(_row(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
