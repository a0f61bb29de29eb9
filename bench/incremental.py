"""``python -m bench.incremental``: incremental saves on a LoRA-style state (issue 13 item 3).

A state where 95% of the bytes (frozen base weights) do not change between
steps, saved by 8 simulated ranks (``Shard(0)``) into a manager-like root:
step 1 whole, step 2 with step 1 as its base. Reports the bytes and time of
step 2 as ratios of step 1's, beside a non-incremental step 2, all measured
side by side in one run (median of ``--reps``), at reshard's default
(``durable=True``: fsync) and with ``durable=False`` (the page cache absorbs
the writes), and the throughput of the candidate shard hashes on this
machine. Writes ``bench/results-incremental.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import reshard.store as rs
from reshard.layouts import Layout

RANKS = 8


def state(total_mib: int, step: int) -> tuple[dict[str, Layout], dict[str, np.ndarray]]:
    """Frozen ``base.*`` (95% of the bytes) and trained ``lora.*`` tensors, fp32."""
    rows = RANKS * 64
    frozen_cols = max(1, int(total_mib * 0.95 * (1 << 20) / 4 / rows / 8))
    lora_cols = max(1, int(total_mib * 0.05 * (1 << 20) / 4 / rows / 2))
    rng = np.random.default_rng(0)
    full = {f"base.w{i}": rng.standard_normal((rows, frozen_cols), dtype=np.float32) for i in range(8)}
    full |= {f"lora.{n}": np.full((rows, lora_cols), step, np.float32) for n in ("a", "b")}
    return {n: Layout.from_dtensor((RANKS,), ["S(0)"], a.shape) for n, a in full.items()}, full


def save(url: str, layouts: dict[str, Layout], full: dict[str, np.ndarray], base: str | None, durable: bool) -> float:
    t0 = time.perf_counter()
    writer = rs.create(url, layouts, form="packed", base=base, durable=durable)
    for rank in range(RANKS):
        writer.write(rank, {n: a[layouts[n].region(rank)] for n, a in full.items()})
    writer.commit()
    return time.perf_counter() - t0


def data_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.bin"))


def hash_rates(nbytes: int = 256 << 20) -> dict[str, float]:
    """MB/s of each candidate hash over ``nbytes`` of random data."""
    buf = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    rates = {}
    candidates = {"sha256": lambda b: hashlib.sha256(b).digest(), "blake2b": lambda b: hashlib.blake2b(b).digest()}
    try:
        import xxhash

        candidates["xxh3_128"] = lambda b: xxhash.xxh3_128(b).digest()
    except ImportError:
        pass
    for name, fn in candidates.items():
        t0 = time.perf_counter()
        fn(buf)
        rates[name] = nbytes / (time.perf_counter() - t0) / 1e6
    return rates


def measure(layouts: dict[str, Layout], step1: dict[str, np.ndarray], step2: dict[str, np.ndarray], reps: int,
            durable: bool) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Times (one per repetition) and data bytes of step 1, step 2 incremental and step 2 whole."""
    work = Path(tempfile.mkdtemp(prefix="reshard-bench-incr-"))
    times: dict[str, list[float]] = {"step 1 (whole)": [], "step 2 incremental": [], "step 2 whole": []}
    sizes: dict[str, int] = {}
    try:
        for rep in range(reps):
            root = work / f"run-{rep}"
            times["step 1 (whole)"].append(save(str(root / "step-1"), layouts, step1, None, durable))
            times["step 2 incremental"].append(save(str(root / "step-2"), layouts, step2, str(root / "step-1"),
                                                    durable))
            times["step 2 whole"].append(save(str(root / "step-2b"), layouts, step2, None, durable))
            sizes = {k: data_bytes(root / d) for k, d in zip(times, ("step-1", "step-2", "step-2b"), strict=True)}
            shutil.rmtree(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return times, sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.incremental", description=__doc__)
    p.add_argument("--mib", type=int, default=512, help="state size in MiB (all ranks)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results-incremental.md"))
    args = p.parse_args(argv)
    layouts, step1 = state(args.mib, 1)
    _, step2 = state(args.mib, 2)
    lines = ["# Incremental saves (`python -m bench.incremental`)", "",
             f"LoRA-style state, {args.mib} MiB over {RANKS} simulated ranks, 95% frozen; packed form, local disk; "
             f"median of {args.reps} runs, side by side.", ""]
    for durable in (True, False):
        times, sizes = measure(layouts, step1, step2, args.reps, durable)
        med = {k: statistics.median(v) for k, v in times.items()}
        first_t, first_b = med["step 1 (whole)"], sizes["step 1 (whole)"]
        lines += [f"`durable={durable}`{' (the default: fsync)' if durable else ' (no fsync)'}:", "",
                  "| save | data bytes | x step 1 | time (s) | x step 1 |", "|---|---|---|---|---|"]
        for k in times:
            lines.append(f"| {k} | {sizes[k]:,} | {sizes[k] / first_b:.3f} | {med[k]:.3f} | {med[k] / first_t:.3f} |")
        lines.append("")
    rates = hash_rates()
    lines += ["Targets: step 2 writes <= 0.10 x and takes <= 0.25 x of step 1.", "",
              "Shard hash throughput here (MB/s, one core): "
              + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items()), ""]
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
