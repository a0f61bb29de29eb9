"""The workloads: which worker groups run, in which order, and the rows they give.

W1 1 GiB float32 (save by 8, redivided load by 7, integration, export), W3
bfloat16 weights + fp32 Adam moments (tp4 x dp2 optimizer-sharded -> tp2 x dp3),
W2 5,000 small tensors (open + inspect, full load), W4 partial load from S3,
and the scaling runs. Loads always run right after ``cat`` of the files, so
every system reads from a warm page cache (dropping caches needs privileges
that the benchmark machine does not grant).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import data
from bench.harness import Measurement, free_port, run_group
from bench.tasks_orbax import XLA_FLAGS
from bench.tasks_plain import files_under, time_cat

MiB = 1 << 20


@dataclass
class Options:
    """How to run: sizes, repetitions, where, which workloads and systems."""

    cfg: dict[str, Any]
    workdir: Path
    reps: int = 3
    warmup: int = 1
    full: bool = False
    only: set[str] = field(default_factory=lambda: {"w1", "w2", "w3", "w4", "gpt2", "w5", "s3sim", "scale", "async",
                                                    "fresh"})
    anchors: set[str] = field(default_factory=set)
    budget_s: float = 60.0
    #: Another reshard checkout, run beside this one in the fresh in-place load rows (``--against``).
    against: Path | None = None


@dataclass
class Row:
    """One line of the results table."""

    workload: str
    phase: str
    system: str
    m: Measurement
    nbytes: int = 0
    note: str = ""


def available_anchors() -> set[str]:
    """The anchors whose frameworks are installed (``dcp``, ``orbax``)."""
    found = set()
    if importlib.util.find_spec("torch"):
        found.add("dcp")
    if importlib.util.find_spec("jax") and importlib.util.find_spec("orbax"):
        found.add("orbax")
    return found


def has_export() -> bool:
    """Whether ``reshard.store.read.export`` (safetensors export) is installed."""
    return importlib.util.find_spec("reshard.store.read.export") is not None


class Runner:
    """Runs groups and collects rows."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.rows: list[Row] = []

    def dir(self, name: str) -> str:
        return str(self.opts.workdir / name)

    def group(self, workload: str, phase: str, system: str, task: str, world: int, args: dict[str, Any],
              nbytes: int, note: str = "", reps: int | None = None, warmup: int | None = None,
              ranks: list[int] | None = None) -> Measurement:
        env = {"XLA_FLAGS": XLA_FLAGS} if "orbax" in task else None
        if "dcp" in task and world > 1:
            args = {**args, "port": free_port()}
        m = run_group(task, world, args, reps=self.opts.reps if reps is None else reps,
                      warmup=self.opts.warmup if warmup is None else warmup,
                      budget_s=self.opts.budget_s, env=env, ranks=ranks)
        self.rows.append(Row(workload, phase, system, m, nbytes, note))
        print(f"  {workload:<8} {phase:<34} {system:<8} "
              + (f"{m.median:8.3f} s" if m.ok else f"FAILED {m.error}"), flush=True)
        return m

    def cat(self, workload: str, phase: str, root: str, nbytes: int, dest: str | None = None) -> None:
        paths = files_under(root)
        times = time_cat(paths, self.opts.reps, self.opts.warmup, dest)
        note = "cat files > one file" if dest else "cat files > /dev/null"
        self.rows.append(Row(workload, phase, "cat", Measurement(times=times), nbytes, note))
        print(f"  {workload:<8} {phase:<34} {'cat':<8} {Measurement(times=times).median:8.3f} s", flush=True)

    # ------------------------------------------------------------------ W1
    def w1(self, cfg: dict[str, Any], label: str = "W1", anchors: bool = True, export: bool = True) -> None:
        specs = data.tensors("w1", cfg)
        size = data.total_bytes(specs)
        base: dict[str, Any] = {"workload": "w1", "cfg": cfg, "mesh": [8], "target": [7]}
        ckpt = {**base, "url": self.dir(f"{label}-reshard")}
        systems = [s for s in ("dcp", "orbax") if anchors and s in self.opts.anchors]
        save = "save, 8 ranks"
        load = "redivided load 8 -> 7 ranks"
        self.group(label, save, "reshard", "bench.tasks_reshard:Save", 8, ckpt, size)
        self.group(label, save, "np.save", "bench.tasks_plain:NpSave", 8, {**base, "url": self.dir(f"{label}-np")},
                   size, "same bytes, no format")
        for s in systems:
            world = 8 if s == "dcp" else 1
            self.group(label, save, s, f"bench.tasks_{s}:Save", world, {**base, "url": self.dir(f"{label}-{s}")},
                       size, "" if s == "dcp" else "1 process, 8 CPU devices (fsyncs: TensorStore's default)")
        if anchors:  # durable saves side by side: reshard's default, DCP's default (Orbax's is the row above)
            durable = "save, 8 ranks, fsynced"
            self.group(label, durable, "reshard", "bench.tasks_reshard:Save", 8, {**ckpt, "durable": True}, size,
                       "durable=True (the default)")
            if "dcp" in systems:
                self.group(label, durable, "dcp", "bench.tasks_dcp:Save", 8,
                           {**base, "url": self.dir(f"{label}-dcp"), "durable": True}, size,
                           "sync_files=True (the default)")
        self.cat(label, load, ckpt["url"], size)
        self.group(label, load, "reshard", "bench.tasks_reshard:Load", 7, ckpt, size)
        self.group(label, load, "reshard out=", "bench.tasks_reshard:Load", 7, {**ckpt, "into": True}, size,
                   "into buffers allocated before timing")
        self.group(label, load, "np.load", "bench.tasks_plain:NpLoad", 8, {**base, "url": self.dir(f"{label}-np")},
                   size, "8 ranks read back their own files")
        for s in systems:
            world = 7 if s == "dcp" else 1
            self.group(label, load, s, f"bench.tasks_{s}:Load", world, {**base, "url": self.dir(f"{label}-{s}")},
                       size, "" if s == "dcp" else "1 process, 7 CPU devices")
        if not anchors:
            return
        whole = "integration 8 -> 1 (read_all)"
        self.cat(label, whole, ckpt["url"], size)
        self.group(label, whole, "reshard", "bench.tasks_reshard:ReadAll", 1, ckpt, size)
        import reshard.store as rs

        if rs.open(ckpt["url"]).form != "directory":  # TensorStore reads the directory form (untimed convert)
            rs.convert(ckpt["url"], self.dir(f"{label}-directory"), "directory")
        for engine in ("tensorstore", "zarr"):  # the general engines over the same bytes
            url = self.dir(f"{label}-directory") if engine == "tensorstore" and os.path.exists(
                self.dir(f"{label}-directory")) else ckpt["url"]
            self.group(label, whole, f"reshard/{engine}", "bench.tasks_reshard:ReadAll", 1,
                       {**ckpt, "url": url, "engine": engine}, size, f"open(engine={engine!r})",
                       reps=1 if engine == "zarr" else None)
        for s in systems:
            self.group(label, whole, s, f"bench.tasks_{s}:ReadAll", 1, {**base, "url": self.dir(f"{label}-{s}")}, size)
        if not export:
            return
        out = self.dir(f"{label}.safetensors")
        phase = "export to one safetensors file"
        self.cat(label, phase, ckpt["url"], size, dest=out)
        if has_export():
            self.group(label, phase, "reshard", "bench.tasks_reshard:Export", 1, {**ckpt, "out": out}, size,
                       f"largest tensor {max(s.nbytes for s in specs) // MiB} MiB")
        else:
            self.rows.append(Row(label, phase, "reshard", Measurement(error="store/read/export.py not available yet")))
        for s in systems:
            self.group(label, phase, s, f"bench.tasks_{s}:Export", 1,
                       {**base, "url": self.dir(f"{label}-{s}"), "out": out}, size, "whole load, then save_file")
        if os.path.exists(out):
            os.remove(out)

    # ------------------------------------------------------------------ W3
    def w3(self) -> None:
        cfg = self.opts.cfg["w3"]
        size = data.total_bytes(data.tensors("w3", cfg))
        base: dict[str, Any] = {"workload": "w3", "cfg": cfg, "mesh": [2, 4], "target": [3, 2]}
        ckpt = {**base, "url": self.dir("W3-reshard")}
        systems = [s for s in ("dcp", "orbax") if s in self.opts.anchors]
        save, load = "save, tp4 x dp2, opt-sharded", "redivided load to tp2 x dp3"
        self.group("W3", save, "reshard", "bench.tasks_reshard:Save", 8, ckpt, size)
        self.group("W3", save, "np.save", "bench.tasks_plain:NpSave", 8, {**base, "url": self.dir("W3-np")}, size,
                   "same bytes, no format")
        for s in systems:
            self.group("W3", save, s, f"bench.tasks_{s}:Save", 8 if s == "dcp" else 1,
                       {**base, "url": self.dir(f"W3-{s}")}, size)
        self.cat("W3", load, ckpt["url"], size)
        self.group("W3", load, "reshard", "bench.tasks_reshard:Load", 6, ckpt, size)
        self.group("W3", load, "reshard out=", "bench.tasks_reshard:Load", 6, {**ckpt, "into": True}, size,
                   "into buffers allocated before timing")
        for s in systems:
            self.group("W3", load, s, f"bench.tasks_{s}:Load", 6 if s == "dcp" else 1,
                       {**base, "url": self.dir(f"W3-{s}")}, size)

    # ------------------------------------------------------------------ W2
    def w2(self) -> None:
        cfg = self.opts.cfg["w2"]
        size = data.total_bytes(data.tensors("w2", cfg))
        base = {"workload": "w2", "cfg": cfg}
        systems = ["reshard", "np", *[s for s in ("dcp", "orbax") if s in self.opts.anchors]]
        urls = {s: self.dir(f"W2-{s}") for s in systems}
        tasks = {"reshard": "bench.tasks_reshard:SaveWhole", "np": "bench.tasks_plain:NpSave",
                 "dcp": "bench.tasks_dcp:SaveWhole", "orbax": "bench.tasks_orbax:Save"}
        name = f"W2 {cfg['count']} tensors"
        for s in systems:
            self.group(name, "save, 1 process", "np.savez" if s == "np" else s, tasks[s], 1,
                       {**base, "url": urls[s]}, size)
        for form in ("packed", "directory"):  # both storage forms side by side
            self.group(name, "save, 1 process", f"reshard {form}", tasks["reshard"], 1,
                       {**base, "url": self.dir(f"W2-{form}"), "form": form}, size)
        for s in ("reshard", "dcp", "orbax"):
            if s in systems:
                self.group(name, "open + inspect metadata", s, f"bench.tasks_{s}:OpenInspect", 1,
                           {**base, "url": urls[s]}, 0, "names, shapes, dtypes")
        self.group(name, "open + inspect, layouts too", "reshard", "bench.tasks_reshard:OpenInspect", 1,
                   {**base, "url": urls["reshard"], "layouts": True}, 0, "parses every array's metadata")
        self.cat(name, "full load", urls["reshard"], size)
        for s in systems:
            task = "bench.tasks_plain:NpLoad" if s == "np" else f"bench.tasks_{s}:ReadAll"
            self.group(name, "full load", "np.load" if s == "np" else s, task, 1, {**base, "url": urls[s]}, size)

    # ------------------------------------------------------------------ W4
    def w4(self) -> None:
        from reshard.store.testing import LocalS3Server, S3Proxy

        cfg = self.opts.cfg["w4"]
        size = data.total_bytes(data.tensors("w4", cfg))
        base = {"workload": "w1", "cfg": cfg, "mesh": [8], "target": [7]}
        label, phase = "W4 S3", "partial load: rank 0 of 7"
        with LocalS3Server() as server:
            bucket = server.make_bucket("bench")
            s3 = {**base, "url": f"s3://{bucket}/reshard", "storage_options": server.storage_options()}
            self.group(label, "save to S3, 8 ranks", "reshard", "bench.tasks_reshard:Save", 8, s3, size,
                       "moto on loopback", reps=1, warmup=0)
            with S3Proxy(server.endpoint_url) as proxy:
                m = self.group(label, phase, "reshard", "bench.tasks_reshard:Load", 7,
                               {**s3, "storage_options": proxy.storage_options()}, size // 7, ranks=[0])
                self._wire(m, proxy)
            if "dcp" in self.opts.anchors:
                local = self.dir("W4-dcp")
                self.group(label, "save (local), then upload", "dcp", "bench.tasks_dcp:Save", 8,
                           {**base, "url": local}, size, "the local save only: the upload is the next row",
                           reps=1, warmup=0)
                import time

                import s3fs

                # Timed too (issue 38): without it the row above read as DCP's whole save to S3, 0.39 s against
                # reshard's 2.9 s, while moto ingests 256 MiB in ~4 s whoever sends it.
                t0 = time.perf_counter()
                s3fs.S3FileSystem(**server.storage_options()).put(local, f"{bucket}/dcp", recursive=True)
                upload = Measurement(times=[time.perf_counter() - t0])
                self.rows.append(Row(label, "upload of that save (s3fs put)", "dcp", upload, size,
                                     "moto on loopback; DCP's save to S3 = the two rows"))
                proxies = [S3Proxy(server.endpoint_url).start() for _ in range(7)]
                try:
                    m = self.group(label, phase, "dcp", "bench.tasks_dcp:Load", 7,
                                   {**base, "url": f"s3://{bucket}/dcp",
                                    "storage_options_per_rank": [p.storage_options() for p in proxies]},
                                   size // 7, "FsspecReader (s3fs); all 7 ranks run, rank 0 counted")
                    self._wire(m, proxies[0])
                finally:
                    for p in proxies:
                        p.stop()

    def _wire(self, m: Measurement, proxy: Any) -> None:
        """Per-run GET requests and bytes the proxy saw (warmup runs included in the count), less the first
        open's 1-byte reads of the marker that open the connection pool (``wire_warm_ups``; reshard's own
        counters leave them out too)."""
        from reshard.store.read.open import is_warm_up

        runs = max(1, len(m.times) + self.opts.warmup)
        if m.per_rank:
            m.extra["needed"] = m.per_rank[0].get("needed", 0)
        every = proxy.records("GET")
        gets = [r for r in every if not is_warm_up(r.path, r.range)]
        m.extra["wire_warm_ups"] = len(every) - len(gets)
        m.extra["wire_requests"] = len(gets) / runs
        m.extra["wire_bytes"] = sum(r.bytes_sent for r in gets) / runs

    # ---------------------------------------------------------------- GPT-2
    def gpt2(self) -> None:
        """GPT-2's embedding saved by 8 ranks: OneFlow's balanced split (exact shards on the rectilinear
        grid, and the gcd grid of ``grid="regular"``) against DTensor's ceil split (a regular grid)."""
        cfg = self.opts.cfg["gpt2"]
        size = cfg["rows"] * cfg["cols"] * 4
        label, phase = f"GPT-2 embedding {cfg['rows']}x{cfg['cols']}", "save, 8 ranks"
        # a save takes 0.05-0.1 s, where the machine's noise is as large as the difference measured: 11 runs each
        runs = [("reshard", "gpt2-balanced", {}, "balanced split, exact shards (rectilinear grid)", 11),
                ("reshard ceil", "gpt2", {}, "ceil split (torch.chunk), regular grid", 11),
                ("reshard gcd", "gpt2-balanced", {"grid": "regular"}, "balanced split, gcd grid", 1)]
        for system, workload, extra, note, reps in runs:
            url = self.dir(f"gpt2-{system.replace(' ', '-')}")
            args = {"workload": workload, "cfg": cfg, "mesh": [8], "url": url, **extra}
            m = self.group(label, phase, system, "bench.tasks_reshard:Save", 8, args, size, note, reps=reps,
                           warmup=0 if reps == 1 else None)
            files = files_under(url)
            m.extra["objects"] = len(files)
            # data objects: shard files (directory form) or rank objects (packed form, the default)
            m.extra["shard_objects"] = sum(f"{os.sep}wte{os.sep}c{os.sep}" in f or f"{os.sep}packed{os.sep}" in f
                                           for f in files)
            self.rows[-1].note += (f"; {len(files)} objects, {m.extra['shard_objects']} of them data; "
                                   f"{len(m.times)} runs")
            shutil.rmtree(url, ignore_errors=True)

    # --------------------------------------------------------------- async
    def async_save(self) -> None:
        """Time blocked in ``save`` for one rank's W1 piece (W1 cut 8 ways: 128 MiB), every system side by side."""
        w1 = self.opts.cfg["w1"]
        cfg = {**w1, "rows": w1["rows"] // 8}
        size = data.total_bytes(data.tensors("w1", cfg))
        label, phase = "async", "save of one rank's W1 piece, blocked"
        self.group(label, phase, "np.copyto", "bench.tasks_async:CopyTo", 1,
                   {"cfg": cfg, "url": self.dir("async-copyto")}, size,
                   "the same bytes into buffers allocated before timing; the same bytes written before each run")
        runs = [("reshard", "async", True, "returns once staged"),
                ("reshard sync", "sync", True, "returns once written and fsynced"),
                ("reshard sync, no fsync", "sync", False, "returns once written (durable=False)"),
                ("reshard+wait", "async+wait", True, "save, then wait() until written")]
        for system, mode, durable, note in runs:
            self.group(label, phase, system, "bench.tasks_async:ManagerSave", 1,
                       {"cfg": cfg, "mode": mode, "durable": durable, "url": self.dir(f"async-{mode}-{durable}")},
                       size, note)
        anchors = {"dcp": ("bench.tasks_async:DcpSave", "async_save"), "orbax": ("bench.tasks_async:OrbaxSave",
                                                                                 "AsyncCheckpointer.save")}
        for anchor, (task, call) in anchors.items():
            if anchor in self.opts.anchors:
                self.group(label, phase, anchor, task, 1, {"cfg": cfg, "mode": "async", "url": self.dir(anchor)},
                           size, f"{call}, returns before writing")
                self.group(label, phase, f"{anchor} sync", task, 1,
                           {"cfg": cfg, "mode": "sync", "url": self.dir(f"{anchor}-sync")}, size,
                           "save until written and fsynced")

    # ------------------------------------------------------------------ W5
    def w5(self) -> None:
        """873 tensors (7B-shaped, scaled) x 64 ranks: objects, save vs DCP, one-rank load requests and bytes."""
        from bench.tasks_packed import count_objects

        cfg = self.opts.cfg["w5"]
        size = data.total_bytes(data.tensors("w5", cfg))
        base: dict[str, Any] = {"workload": "w5", "cfg": cfg}
        label, save = "W5 873 x 64", "save, 64 rank writes (8 processes)"
        first = "first save of fresh processes (no warmup)"
        for form in ("packed", "directory"):  # the target's rows get 3 runs: one run swung by 20% (1.17-1.43 s)
            url = self.dir(f"W5-{form}")
            m = self.group(label, save, f"reshard {form}", "bench.tasks_packed:SaveRanks", 8,
                           {**base, "url": url, "ranks": 64, "form": form}, size, reps=3 if form == "packed" else 1)
            m.extra["objects"] = count_objects(url)
            self.rows[-1].note = f"{m.extra['objects']} objects"
        self.group(label, first, "reshard packed", "bench.tasks_packed:SaveRanks", 8,
                   {**base, "url": self.dir("W5-packed"), "ranks": 64, "form": "packed"}, size, reps=1, warmup=0,
                   note="64 rank writes (8 processes): the per-process plans are built here")
        if "dcp" in self.opts.anchors:
            m = self.group(label, "save, DCP's largest world here", "dcp", "bench.tasks_dcp:Save", 8,
                           {**base, "mesh": [8], "url": self.dir("W5-dcp")}, size, reps=3)
            m.extra["objects"] = count_objects(self.dir("W5-dcp"))
            self.rows[-1].note = f"8 processes, {m.extra['objects']} objects"
            self.group(label, first, "dcp", "bench.tasks_dcp:Save", 8,
                       {**base, "mesh": [8], "url": self.dir("W5-dcp")}, size, reps=1, warmup=0, note="8 processes")
        load = "load rank 5 of 56"
        for form in ("packed", "directory"):
            m = self.group(label, load, f"reshard {form}", "bench.tasks_reshard:Load", 56,
                           {**base, "url": self.dir(f"W5-{form}"), "mesh": [64], "target": [56]}, size // 56,
                           ranks=[5])
            needed = m.per_rank[0].get("needed", 0) if m.per_rank else 0
            self.rows[-1].note = (f"{m.extra.get('requests', 0)} requests (open and the after-read check "
                                  f"included), {m.extra.get('bytes_fetched', 0) / max(needed, 1):.2f}x the "
                                  "bytes needed")

    # ------------------------------------------------------------ S3 sim
    def s3sim(self) -> None:
        """1024 simulated ranks on the S3 test server: PUTs per save, GETs of one rank's load."""
        from reshard.store.testing import LocalS3Server, S3Proxy

        cfg = self.opts.cfg["s3sim"]
        n, procs = int(cfg["ranks"]), int(cfg["procs"])
        size = data.total_bytes(data.tensors("s3sim", cfg))
        base: dict[str, Any] = {"workload": "s3sim", "cfg": cfg}
        label = f"S3 {n} ranks"
        with LocalS3Server() as server, S3Proxy(server.endpoint_url) as proxy:
            bucket = server.make_bucket("bench")
            for form in ("packed", "directory"):
                url = f"s3://{bucket}/{form}"
                proxy.reset_counters()
                m = self.group(label, f"save, {n} rank writes ({procs} processes)", f"reshard {form}",
                               "bench.tasks_packed:SaveRanks", procs,
                               {**base, "url": url, "ranks": n, "form": form,
                                "storage_options": proxy.storage_options()}, size, reps=1, warmup=0)
                puts = len(proxy.records("PUT"))
                m.extra["puts"] = puts
                self.rows[-1].note = f"{puts} PUTs ({n} ranks)"
                proxy.reset_counters()
                m = self.group(label, f"load rank 3 of {n}", f"reshard {form}", "bench.tasks_reshard:Load", n,
                               {**base, "url": url, "mesh": [n], "target": [n],
                                "storage_options": proxy.storage_options()}, size // n, ranks=[3],
                               reps=1, warmup=0)
                gets = len(proxy.records("GET"))
                m.extra["gets"] = gets
                self.rows[-1].note = f"{gets} GETs, 1 source object touched"

    # ------------------------------------------------------------- scaling
    def scale_ranks(self) -> None:
        cfg = self.opts.cfg
        for n in cfg["scale_ranks"]:
            m = n * 7 // 8
            args = {"url": self.dir(f"scale-{n}"), "shape": cfg["scale_shape"], "count": cfg["scale_count"],
                    "n": n, "m": m}
            size = cfg["scale_count"] * cfg["scale_shape"][0] * cfg["scale_shape"][1] * 4
            label = f"ranks {n} -> {m}"
            self.group("scaling", f"{label}: save (1 process)", "reshard", "bench.tasks_scale:SaveSim", 1, args,
                       size, f"{n} simulated ranks", reps=min(self.opts.reps, 2))
            self.group("scaling", f"{label}: plan, all ranks", "reshard", "bench.tasks_scale:Plan", 1, args, 0,
                       f"{cfg['scale_count']} tensors x {m} ranks")
            self.group("scaling", f"{label}: load, all ranks", "reshard", "bench.tasks_scale:LoadAll", 1, args,
                       size, f"{m} loads in 1 process")
            shutil.rmtree(args["url"], ignore_errors=True)

    def scale_metadata(self) -> None:
        """Issue 26's table: N simulated ranks x T tiny tensors (:mod:`bench.scale`); also bench/results-scale.md."""
        from bench import scale

        cfg = self.opts.cfg["scale_meta"]
        lines = [scale.HEADER]
        for n in cfg["ranks"]:
            row = scale.measure(n, cfg["tensors"], cfg.get("procs", 2), str(self.opts.workdir))
            lines.append(scale.markdown_row(row))
            print(lines[-1], flush=True)
            label = f"{n} ranks x {cfg['tensors']} tiny tensors"
            for phase, key, note in (("commit", "commit", f"refs.json {row['refs_json']} B"),
                                     ("open + load one rank of N-8", "load", ""), ("verify", "verify", ""),
                                     ("plain zarr: open + one tensor", "zarr", "")):
                got = row[key]
                m = Measurement(times=[got["wall"]], peak_rss=got.get("peak", 0)) if "wall" in got else \
                    Measurement(error=str(got.get("error")))
                self.rows.append(Row("metadata", f"{label}: {phase}", "reshard", m, 0, note))
        if self.opts.cfg is data.FULL:
            (Path(__file__).parent / "results-scale.md").write_text("\n".join(lines) + "\n")

    def scale_size(self) -> None:
        sizes = dict(self.opts.cfg["sizes"])
        if self.opts.full:
            sizes.update(self.opts.cfg["sizes_full"])
        for label, cols in sizes.items():
            if cols == self.opts.cfg["w1"]["cols"] and "w1" in self.opts.only:
                continue  # the same as W1
            cfg = {**self.opts.cfg["w1"], "cols": cols}
            self.w1(cfg, label=f"size {label}", anchors=False)
            shutil.rmtree(self.dir(f"size {label}-reshard"), ignore_errors=True)
            shutil.rmtree(self.dir(f"size {label}-np"), ignore_errors=True)

    def fresh(self) -> None:
        """W1 and W3 the user's way: fresh processes per save and load, defaults (:mod:`bench.fresh`)."""
        from bench import fresh

        fresh.run(self)

    def all(self) -> list[Row]:
        only = self.opts.only
        steps = [("w1", lambda: self.w1(self.opts.cfg["w1"])), ("w3", self.w3), ("w2", self.w2), ("w4", self.w4),
                 ("gpt2", self.gpt2), ("w5", self.w5), ("s3sim", self.s3sim),
                 ("scale", self.scale_ranks), ("scale", self.scale_metadata), ("scale", self.scale_size),
                 ("async", self.async_save), ("fresh", self.fresh)]
        for key, step in steps:
            if key in only:
                print(f"[{key}]", flush=True)
                step()
                for d in self.opts.workdir.iterdir():  # free the disk and the page cache
                    shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink()
        return self.rows
