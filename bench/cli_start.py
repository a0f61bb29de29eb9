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

Writes ``bench/results-cli.md`` (``--out``); ``--reps`` runs per row (default 7). ``--against DIR``
adds, per reshard row, the same command run by another checkout of reshard (e.g. a git worktree of
an earlier commit, imported through a ``PYTHONPATH`` folder of links), alternating with this one in
the same run, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.report import machine


def _timed(cmd: list[str], reps: int, env: dict[str, str] | None = None) -> list[float]:
    """Wall seconds of ``reps`` fresh runs of ``cmd`` (each must succeed)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, timeout=300, env=env)
        times.append(time.perf_counter() - t0)
    return times


def checkout_env(checkout: Path, links: Path) -> dict[str, str]:
    """The environment in which ``reshard`` (the command and ``import reshard``) is the one in ``checkout``."""
    pkg = links / "reshard"
    pkg.mkdir(parents=True, exist_ok=True)
    for name, target in (("layouts", "layouts"), ("store", "store"), ("torch", "store/frontends/torch_namespace")):
        (pkg / name).symlink_to(checkout.resolve() / target)
    return {**os.environ, "PYTHONPATH": str(links)}


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


def rows(work: Path, reps: int, against: Path | None = None) -> list[tuple[str, list[float], str]]:
    """(command, seconds, target) per row; with ``against``, each reshard row also run by that checkout."""
    files = _samples(work)
    out = work / "out"
    commands = [
        ("reshard --help", ["reshard", "--help"], "< 0.3 s"),
        ("reshard inspect CKPT", ["reshard", "inspect", str(files["ckpt"])], ""),
        ("reshard import safetensors (2 MiB)", ["reshard", "import", "safetensors", str(files["safetensors"]),
                                                str(out), "--overwrite"], "< 1.5 s"),
        ("reshard import dcp (2 MiB)", ["reshard", "import", "dcp", str(files["dcp"]), str(out), "--overwrite"], ""),
    ]
    table = [("python -c pass (floor)", _timed([sys.executable, "-c", "pass"], reps), ""),
             ("python -c 'import torch' (floor of torch-based imports)",
              _timed([sys.executable, "-c", "import torch"], reps), "")]
    other = checkout_env(against, work / "links") if against else None
    for name, cmd, target in commands:
        mine: list[float] = []
        theirs: list[float] = []
        for _ in range(reps):  # alternating, so that both see the same machine
            mine += _timed(cmd, 1)
            if other is not None:
                theirs += _timed(cmd, 1, other)
        table.append((name, mine, target))
        if other is not None:
            ratio = statistics.median(theirs) / statistics.median(mine)
            table.append((f"{name}, {against.name} ({ratio:.1f}x this one)", theirs, ""))
    return table


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
    p.add_argument("--against", type=Path, default=None, help="another reshard checkout to run side by side")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="reshard-cli-") as tmp:
        text = markdown(rows(Path(tmp), args.reps, args.against), args.reps)
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
