"""One rank's metadata costs at N ranks x T tensors (issue 26, the per-rank part).

Tiny tensors so that metadata dominates: T tensors of shape ``(2N, 8)`` float32
under ``Shard(0)`` over N ranks (every rank holds 2 rows of each), packed form.
Each phase runs in a fresh process and reports its CPU seconds
(``time.process_time``) and peak RSS (``resource.getrusage``):

* ``layouts``: build the T layouts (``Layout.from_dtensor``) and ask each one
  ``is_regular``, ``region``, ``owner`` and ``holders`` of one rank;
* ``save``: ``reshard.store.create(url, layouts).write(rank, local)`` for one
  rank (its first save in the process; the layouts are built before the clock starts);
* ``build``: write every rank (``--procs`` processes) and commit, for ``restore``;
* ``restore``: ``reshard.store.open(url)`` and ``keys()``, then
  ``load(layouts, rank)`` of one rank's part of every tensor (needs ``build`` first).

The commit side (``commit``, ``verify``, references) is measured by bench's ``scale``
workload; this script measures only what every rank pays. Usage::

    python -m bench.scale_rank --ranks 4096 --tensors 10000 --phases layouts,save
    python -m bench.scale_rank --ranks 1024 --tensors 2000 --phases build,restore --url /tmp/ck

Run it with the library of interest importable (``PYTHONPATH``) to compare two trees.
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
from typing import Any

import numpy as np

PHASES = ("layouts", "save", "build", "restore")


def _layouts(n: int, t: int) -> dict[str, Any]:
    from reshard.layouts import Layout

    return {f"layer{i}.w": Layout.from_dtensor(n, ["Shard(0)"], (2 * n, 8)) for i in range(t)}


def _local(n: int, t: int, rank: int) -> dict[str, np.ndarray]:
    return {f"layer{i}.w": np.full((2, 8), rank + i / t, dtype=np.float32) for i in range(t)}


def _usage() -> tuple[float, float]:
    """CPU seconds of this process so far, and its peak RSS in MiB."""
    return time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def phase(name: str, n: int, t: int, rank: int, url: str, procs: int) -> dict[str, Any]:
    """Run one phase here; return its figures."""
    import reshard.store as rs

    out: dict[str, Any] = {"phase": name, "ranks": n, "tensors": t}
    _, rss0 = _usage()
    out["rss_start_mib"] = round(rss0)
    if name == "layouts":
        c0 = time.process_time()
        lays = _layouts(n, t)
        c1 = time.process_time()
        for lay in lays.values():
            lay.is_regular()
            lay.region(rank)
            lay.owner((2 * rank, 0))
            lay.holders((2 * rank, 0))
        c2, rss = _usage()
        out.update(build_s=round(c1 - c0, 3), ask_s=round(c2 - c1, 3), rss_mib=round(rss))
    elif name == "save":
        lays = _layouts(n, t)
        local = _local(n, t, rank)
        shutil.rmtree(url, ignore_errors=True)
        _, rss1 = _usage()
        c0 = time.process_time()
        writer = rs.create(url, lays, durable=False, form="packed")
        writer.write(rank, local)
        c1, rss = _usage()
        out.update(cpu_s=round(c1 - c0, 3), rss_mib=round(rss), rss_before_mib=round(rss1))
    elif name == "build":
        shutil.rmtree(url, ignore_errors=True)
        c0 = time.process_time()
        w0 = time.monotonic()
        kids = [subprocess.Popen([sys.executable, "-m", "bench.scale_rank", "--ranks", str(n), "--tensors", str(t),
                                  "--url", url, "--write-ranks", f"{i}:{procs}"]) for i in range(procs)]
        for k in kids:
            if k.wait(timeout=36000) != 0:
                raise SystemExit(f"a writer failed ({k.returncode})")
        w1 = time.monotonic()
        rs.create(url, _layouts(n, t), durable=False, form="packed").commit()
        c1, rss = _usage()
        out.update(write_wall_s=round(w1 - w0, 1), commit_cpu_s=round(c1 - c0, 3),
                   commit_wall_s=round(time.monotonic() - w1, 1), rss_mib=round(rss))
    elif name == "restore":
        lays = _layouts(n, t)
        _, rss1 = _usage()
        c0 = time.process_time()
        ckpt = rs.open(url)
        names = list(ckpt.keys())
        c1 = time.process_time()
        got = ckpt.load(lays, rank)
        c2, rss = _usage()
        flat = [got["layer0"]["w"], got[f"layer{t - 1}"]["w"]]
        want = _local(n, t, rank)
        assert np.array_equal(flat[0], want["layer0.w"]) and np.array_equal(flat[1], want[f"layer{t - 1}.w"])
        out.update(open_keys_s=round(c1 - c0, 3), load_s=round(c2 - c1, 3), cpu_s=round(c2 - c0, 3),
                   rss_mib=round(rss), rss_before_mib=round(rss1), tensors_seen=len(names),
                   requests=ckpt.stats.requests)
    else:
        raise SystemExit(f"unknown phase {name!r}; choose from {PHASES}")
    return out


def _write_ranks(n: int, t: int, url: str, part: str) -> None:
    import reshard.store as rs

    i, procs = map(int, part.split(":"))
    writer = rs.create(url, _layouts(n, t), durable=False, form="packed")
    for r in range(i, n, procs):
        writer.write(r, _local(n, t, r))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale_rank", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--tensors", type=int, default=2000)
    p.add_argument("--rank", type=int, default=None, help="the rank measured (default: N // 2 + 1)")
    p.add_argument("--phases", default="layouts,save", help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--url", default=None, help="checkpoint folder (default: a temporary one; build/restore need it)")
    p.add_argument("--procs", type=int, default=2, help="build: writer processes")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run one phase here, print JSON
    p.add_argument("--write-ranks", default=None, help=argparse.SUPPRESS)  # build's writers: "i:procs"
    args = p.parse_args(argv)
    n, t = args.ranks, args.tensors
    rank = args.rank if args.rank is not None else n // 2 + 1
    url = args.url or os.path.join(tempfile.gettempdir(), f"reshard-scale-rank-{n}x{t}")
    if args.write_ranks:
        _write_ranks(n, t, url, args.write_ranks)
        return 0
    if args.one:
        print(json.dumps(phase(args.one, n, t, rank, url, args.procs)))
        return 0
    for name in args.phases.split(","):
        cmd = [sys.executable, "-m", "bench.scale_rank", "--ranks", str(n), "--tensors", str(t), "--rank", str(rank),
               "--url", url, "--procs", str(args.procs), "--one", name]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=36000)
        if done.returncode:
            print(done.stderr, file=sys.stderr)
            return done.returncode
        print(done.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
