"""Metadata at scale: N simulated ranks x T tiny tensors (issue 26's table).

``python -m bench.scale --ranks 256 --tensors 873 [--procs 2] [--verify-timeout 600]``
saves a checkpoint of ``T`` tensors of shape ``(2N, 8)`` float32 under DTensor
``Shard(0)`` over ``N`` ranks in the packed form, the ranks written by ``procs``
processes (each runs ``create(...).write(rank, ...)`` for its ranks, as training
ranks would), then measures, each in a fresh child process:

* the commit (wall s, CPU s, peak RSS);
* the references' size (``refs.json``; the parquet references too, when written);
* a rank's trailer (the bytes after its shards in ``packed/<rank>.bin``: records,
  manifest, footer) and its shard locations alone;
* one rank's load under ``N - 8`` ranks (open + load);
* ``reshard verify`` (whole, data included);
* a plain zarr-python reader (the documented ``reference://`` recipe, no reshard
  code imported) opening the checkpoint and reading one tensor: wall s, peak RSS,
  and the bytes of references it read.

Tensors are tiny so that metadata dominates; CPU times are steadier than wall
times on a shared machine. ``python -m bench --only scale`` runs a small case of it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def names(count: int) -> list[str]:
    """``count`` tensor names shaped like a Llama state (weights, then two Adam moments), as W5's."""
    per_layer = [f"self_attn.{n}_proj.weight" for n in "qkvo"] + [
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight"]
    layers = max(1, -(-(count // 3 - 3) // len(per_layer)))
    weights = ["embed_tokens.weight"] + [f"layers.{i}.{p}" for i in range(layers) for p in per_layer]
    weights += ["norm.weight", "lm_head.weight"]
    out = [f"{g}.{w}" for g in ("model", "optim.exp_avg", "optim.exp_avg_sq") for w in weights]
    return out[:count] if len(out) >= count else out + [f"extra.t{i}" for i in range(count - len(out))]


def layouts(ranks: int, tensors: int, rows: int | None = None) -> dict[str, Any]:
    """Every tensor ``(2 * rows, 8)`` float32 (rows: the saving ranks) under ``Shard(0)`` over ``ranks``."""
    from reshard.layouts import Layout

    shape = (2 * (rows or ranks), 8)
    return {n: Layout.from_dtensor(ranks, ["Shard(0)"], shape) for n in names(tensors)}


def usage() -> dict[str, float]:
    """This process's CPU seconds and peak RSS (``VmHWM``, bytes: fork does not carry it over)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    peak = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return {"cpu": ru.ru_utime + ru.ru_stime, "peak": peak}


# --------------------------------------------------------------- child steps
def step_save(url: str, n: int, t: int, procs: int, proc: int) -> dict[str, Any]:
    """Write ranks ``proc, proc + procs, ...`` (one writer, a write per rank)."""
    import numpy as np
    import reshard.store as rs

    t0 = time.perf_counter()
    lay = layouts(n, t)
    built = time.perf_counter() - t0
    writer = rs.create(url, lay, save_id="s", durable=False, overwrite=True)
    piece = np.arange(16, dtype=np.float32).reshape(2, 8)
    for r in range(proc, n, procs):
        writer.write(r, {name: piece + r for name in lay})
    return {"layouts_s": built, "wall": time.perf_counter() - t0}


def step_commit(url: str, n: int, t: int) -> dict[str, Any]:
    import reshard.store as rs

    t0 = time.perf_counter()
    rs.commit(url, save_id="s", ranks=list(range(n)), form="packed")
    return {"wall": time.perf_counter() - t0}


def step_load(url: str, n: int, t: int) -> dict[str, Any]:
    import reshard.store as rs

    lay = layouts(target(n), t, rows=n)
    t0, c0 = time.perf_counter(), usage()["cpu"]
    ckpt = rs.open(url)
    got = ckpt.load(lay, 3)
    assert len(got) > 0
    return {"wall": time.perf_counter() - t0, "cpu_load": usage()["cpu"] - c0, "requests": ckpt.stats.requests}


def step_verify(url: str, n: int, t: int) -> dict[str, Any]:
    import reshard.store as rs

    t0 = time.perf_counter()
    report = rs.verify(url)
    return {"wall": time.perf_counter() - t0, "ok": report.ok, "problems": report.problems[:3]}


def step_zarr(url: str, n: int, t: int) -> dict[str, Any]:
    """The documented recipe, no reshard import: open the group through fsspec's reference://, read one tensor."""
    import fsspec.implementations.local
    import zarr

    marker = json.loads(Path(url, ".reshard", "commit.json").read_text())
    gen = marker["generation"]
    read = {"bytes": 0}
    orig = fsspec.implementations.local.LocalFileOpener.read

    def counting(self: Any, *args: Any) -> Any:  # count the bytes of references read (the data is a few KB)
        out = orig(self, *args)
        if "/refs" in str(self.path):
            read["bytes"] += len(out)
        return out

    fsspec.implementations.local.LocalFileOpener.read = counting  # type: ignore[method-assign]
    t0 = time.perf_counter()
    parquet = Path(url, gen, "refs.parq")
    if parquet.is_dir():  # docs/format.md's parquet recipe
        from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

        objects = AsyncFileSystemWrapper(fsspec.filesystem("dir", path=url), asynchronous=True)
        opts: dict[str, Any] = {"fo": str(parquet), "fs": objects}
    else:
        opts = {"fo": f"{url}/{gen}/refs.json", "template_overrides": {"root": url}}
    store = zarr.storage.FsspecStore.from_url("reference://", read_only=True, storage_options=opts)
    group = zarr.open_group(store, mode="r")
    opened = time.perf_counter() - t0
    value = group["model/layers/0/self_attn/q_proj/weight"][...]
    assert value.shape == (2 * n, 8)
    return {"wall": time.perf_counter() - t0, "open_s": opened, "refs_read": read["bytes"],
            "form": "parquet" if parquet.is_dir() else "json"}


def target(n: int) -> int:
    """The ranks a one-rank load redivides to: N - 8 (the issue's), 7/8 of N for small N."""
    return n - 8 if n > 16 else max(1, n * 7 // 8)


STEPS = {"save": step_save, "commit": step_commit, "load": step_load, "verify": step_verify, "zarr": step_zarr}


def child(argv: list[str]) -> int:
    step, url, n, t, *rest = argv
    out = STEPS[step](url, int(n), int(t), *map(int, rest))
    out.update(usage())
    print("@@SCALE " + json.dumps(out), flush=True)
    return 0


def run_child(step: str, url: str, n: int, t: int, *rest: int, timeout: float = 900.0,
              env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "bench.scale", "--child", step, url, str(n), str(t), *map(str, rest)]
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if p)
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": path, **(env or {})},
                            stdout=subprocess.PIPE, text=True)


def collect(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"error": f"killed at {timeout:.0f} s"}
    for line in out.splitlines():
        if line.startswith("@@SCALE "):
            return dict(json.loads(line[8:]))
    return {"error": f"exit status {proc.returncode}"}


def trailer_sizes(url: str, rank: int) -> dict[str, int]:
    """A rank's trailer bytes (records it carries + shard table + manifest + footer), the records alone, and
    its shard locations in the keyed JSON form (``{key: [object, offset, length]}``) for scale."""
    marker = json.loads(Path(url, ".reshard", "commit.json").read_text())
    path = Path(url, marker["generation"], "packed", f"{rank}.bin")
    with open(path, "rb") as f:
        f.seek(-32, os.SEEK_END)
        foot = f.read(32)
        magic, table = foot[-8:], 0
        if magic == b"RSHDMAN3":
            records, table, manifest = (int.from_bytes(foot[i : i + 8], "little") for i in (0, 8, 16))
            footer = 32
        elif magic == b"RSHDMAN2":
            records, manifest, footer = int.from_bytes(foot[8:16], "little"), int.from_bytes(foot[16:24], "little"), 24
        else:
            records, manifest, footer = 0, int.from_bytes(foot[16:24], "little"), 16
        f.seek(-(footer + manifest + table), os.SEEK_END)
        raw_table = f.read(table)
        doc = json.loads(f.read(manifest))
    if table:
        from reshard.store.format.table import Table

        located = Table(str(path), raw_table).expand()[0]
    else:
        located = doc.get("packed", {})
    locations = len(json.dumps(located, separators=(",", ":")))
    return {"trailer": records + table + manifest + footer, "locations": locations, "records": records}


def du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def measure(n: int, t: int, procs: int = 2, workdir: str | None = None, verify_timeout: float = 600.0,
            zarr_timeout: float = 600.0, keep: bool = False) -> dict[str, Any]:
    """Save, then measure every quantity of the table; one dict of figures."""
    work = Path(workdir or tempfile.mkdtemp(prefix="reshard-scale-"))
    url = str(work / f"ckpt-{n}x{t}")
    shutil.rmtree(url, ignore_errors=True)
    row: dict[str, Any] = {"ranks": n, "tensors": t}
    try:
        t0 = time.perf_counter()
        saves = [collect(p, 3600) for p in [run_child("save", url, n, t, procs, i) for i in range(procs)]]
        row["save"] = {"wall": time.perf_counter() - t0, "cpu": sum(s.get("cpu", 0) for s in saves),
                       "peak": max(s.get("peak", 0) for s in saves),
                       "error": next((s["error"] for s in saves if "error" in s), None)}
        row["commit"] = collect(run_child("commit", url, n, t), 1800)
        gen = json.loads(Path(url, ".reshard", "commit.json").read_text())["generation"]
        row["refs_json"] = du(Path(url, gen, "refs.json"))
        row["refs_parquet"] = du(Path(url, gen, "refs.parq"))
        row["trailer"] = {r: trailer_sizes(url, r) for r in sorted({0, n // 2, n - 1})}
        row["load"] = collect(run_child("load", url, n, t), 900)
        row["verify"] = collect(run_child("verify", url, n, t), verify_timeout)
        row["zarr"] = collect(run_child("zarr", url, n, t), zarr_timeout)
    finally:
        if not keep:
            shutil.rmtree(url, ignore_errors=True)
            if workdir is None:
                shutil.rmtree(work, ignore_errors=True)
    return row


def _mib(b: float) -> str:
    return f"{b / (1 << 20):.0f} MiB" if b < (1 << 30) else f"{b / (1 << 30):.2f} GiB"


def _size(b: float) -> str:
    return f"{b / 1e3:.0f} KB" if b < 1e6 else f"{b / 1e6:.1f} MB"


def _timed(d: dict[str, Any], cpu: str = "cpu") -> str:
    if "error" in d and d.get("error"):
        return str(d["error"])
    return f"{d['wall']:.1f} ({d[cpu]:.1f})"


HEADER = ("| ranks x tensors | save: wall s (CPU s, all ranks) | commit s (CPU) / peak RSS | refs.json | "
          "refs.parq | rank trailer (its locations) | one-rank load of N-8: s (CPU), RSS | `verify`: s (CPU), RSS "
          "| plain zarr open + one tensor: s, RSS, refs read |\n|---|---|---|---:|---:|---|---|---|---|")


def markdown_row(row: dict[str, Any]) -> str:
    c, ld, v, z = row["commit"], row["load"], row["verify"], row["zarr"]
    mid = row["trailer"][max(row["trailer"])] if row["trailer"] else {}
    first = row["trailer"].get(0, {})
    trailer = f"{_size(mid.get('trailer', 0))} ({_size(mid.get('locations', 0))})"
    if first.get("trailer", 0) > 2 * mid.get("trailer", 1):
        trailer += f"; rank 0 {_size(first['trailer'])}"
    cells = [
        f"{row['ranks']:,} x {row['tensors']:,}",
        f"{row['save']['wall']:.0f} ({row['save']['cpu']:.0f})",
        f"{_timed(c)} / {_mib(c.get('peak', 0))}" if "error" not in c else c["error"],
        _size(row["refs_json"]),
        _size(row["refs_parquet"]) if row["refs_parquet"] else "-",
        trailer,
        f"{_timed(ld, 'cpu_load')}, {_mib(ld.get('peak', 0))}" if "error" not in ld else ld["error"],
        f"{_timed(v)}, {_mib(v.get('peak', 0))}" if "error" not in v else v["error"],
        f"{z['wall']:.1f}, {_mib(z['peak'])}, {_size(z['refs_read'])} {z['form']}" if "error" not in z
        else z["error"],
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[64])
    p.add_argument("--tensors", type=int, default=873)
    p.add_argument("--procs", type=int, default=2, help="processes writing the ranks")
    p.add_argument("--workdir", default=None)
    p.add_argument("--verify-timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, help="append each row as one JSON line here")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint (needs --workdir)")
    args = p.parse_args(argv)
    print(HEADER, flush=True)
    for n in args.ranks:
        row = measure(n, args.tensors, args.procs, args.workdir, args.verify_timeout, keep=args.keep)
        print(markdown_row(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
