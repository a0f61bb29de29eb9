"""``python -m bench.cli_start``: how fast the command line starts (issue 37 item 7), in fresh processes.

Each row runs a command ``reps`` times, each in a new process, and gives the median, min and max
wall time, beside its floors measured in the same run: ``python -c pass`` (the interpreter's own
start) and ``import torch`` (what every torch-based import pays, whatever reshard does). Targets:
``reshard --help`` under 0.3 s; a small import (a 2 MiB safetensors file) under 1.5 s.

The commands:

- ``reshard --help``: the parser only; imports neither zarr nor numpy (tests/test_cli.py checks that);
- ``reshard inspect``: opens a checkpoint (zarr, numpy, reshard's reading side);
- ``reshard import safetensors``: 2 MiB in 4 tensors, written as a reshard checkpoint (no torch);
- ``reshard import dcp``: the same tensors saved by torch DCP (pays ``import torch``).

Writes ``bench/results-cli.md`` (``--out``); ``--reps`` runs per row (default 7).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.report import machine


def _timed(cmd: list[str], reps: int) -> list[float]:
    """Wall seconds of ``reps`` fresh runs of ``cmd`` (each must succeed)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        times.append(time.perf_counter() - t0)
    return times


def _samples(work: Path) -> dict[str, Path]:
    """A 2 MiB safetensors file, the same tensors as a torch DCP save, and a reshard checkpoint."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {f"layer{i}.weight": rng.standard_normal((256, 512), dtype=np.float32) for i in range(4)}
    save_file(tensors, str(work / "small.safetensors"))
    subprocess.run([sys.executable, "-c", (
        "import sys, numpy as np, torch, torch.distributed.checkpoint as dcp\n"
        "from safetensors.numpy import load_file\n"
        "dcp.save({k: torch.from_numpy(v) for k, v in load_file(sys.argv[1]).items()}, checkpoint_id=sys.argv[2])"),
        str(work / "small.safetensors"), str(work / "dcp")], check=True, timeout=300)
    subprocess.run(["reshard", "import", "safetensors", str(work / "small.safetensors"), str(work / "ckpt")],
                   check=True, capture_output=True, timeout=300)
    return {"safetensors": work / "small.safetensors", "dcp": work / "dcp", "ckpt": work / "ckpt"}


def rows(work: Path, reps: int) -> list[tuple[str, list[float], str]]:
    """(command, seconds, target) per row."""
    files = _samples(work)
    out = work / "out"

    def fresh_import(kind: str) -> list[str]:
        shutil.rmtree(out, ignore_errors=True)
        return ["reshard", "import", kind, str(files[kind]), str(out), "--overwrite"]

    return [
        ("python -c pass (floor)", _timed([sys.executable, "-c", "pass"], reps), ""),
        ("python -c 'import torch' (floor of torch-based imports)",
         _timed([sys.executable, "-c", "import torch"], reps), ""),
        ("reshard --help", _timed(["reshard", "--help"], reps), "< 0.3 s"),
        ("reshard inspect CKPT", _timed(["reshard", "inspect", str(files["ckpt"])], reps), ""),
        ("reshard import safetensors (2 MiB)", _timed(fresh_import("safetensors"), reps), "< 1.5 s"),
        ("reshard import dcp (2 MiB)", _timed(fresh_import("dcp"), reps), ""),
    ]


def markdown(table: list[tuple[str, list[float], str]], reps: int) -> str:
    info = machine()
    lines = [f"# Command-line start ({reps} fresh processes per row)", "",
             f"{info['machine']}; load average {os.getloadavg()[0]:.1f} at the end.", "",
             "| command | median s | min s | max s | target |", "|---|---:|---:|---:|---|"]
    for name, times, target in table:
        lines.append(f"| {name} | {statistics.median(times):.3f} | {min(times):.3f} | {max(times):.3f} | "
                     f"{target} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cli_start", description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default=str(Path(__file__).parent / "results-cli.md"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="reshard-cli-") as tmp:
        text = markdown(rows(Path(tmp), args.reps), args.reps)
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
