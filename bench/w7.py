"""Bench W7: Adam state of a GPT-2-small-shaped model under DeepSpeed ZeRO-2 on 4 ranks, resumed on 3.

``python -m bench.w7 --ds-python /path/to/python-with-deepspeed [--workdir DIR] [--tiny]``

Two ways to go from the 4-rank ZeRO-2 save to a 3-rank run:

* **reshard**: ``reshard import deepspeed`` (the partitions read in place, each
  parameter's fp32 copy and moments stored under its flat-range layout), then
  either each of the 3 ranks loads its new ranges straight from that checkpoint
  (``load``), or ``redivide`` to the 3-rank layouts, or ``export deepspeed --dp 3``
  and DeepSpeed's plain ``load_checkpoint`` on 3 ranks;
* **DeepSpeed**: ``ds_to_universal`` (the offline pass to per-parameter files),
  then ``load_checkpoint`` with ``checkpoint.load_universal`` on 3 ranks.

Every step runs in a process of its own; the table gives its wall time and the
peak RSS of its largest process (``wait4``'s ``ru_maxrss``: for the 3-rank loads
one rank, not their sum). Writes ``bench/results-w7.md``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RESHARD = {
    "import": ("from reshard.store.frontends.deepspeed import import_deepspeed as f; "
               "f({src!r}, {dst!r}, overwrite=True)"),
    "load": ("import reshard.store as rs\n"
             "from reshard.store.frontends.deepspeed import group_buffer\n"
             "ck = rs.open({src!r}); info = ck.leaves['deepspeed']\n"
             "for r in range(3):\n"
             "    t = {{}}\n"
             "    for g in info['groups']:\n"
             "        lays = group_buffer(2, [tuple(s) for s in g['shapes']], 3).layouts()\n"
             "        t.update({{f'optimizer.{{w}}.{{n}}': l for n, l in zip(g['names'], lays) "
             "for w in ['fp32', *g['states']] if r in l.ranks}})\n"
             "    ck.load(t, r)\n"),
    "redivide": ("import reshard.store as rs\n"
                 "from reshard.store.frontends.deepspeed import group_buffer\n"
                 "ck = rs.open({src!r}); info = ck.leaves['deepspeed']; t = {{}}\n"
                 "for g in info['groups']:\n"
                 "    lays = group_buffer(2, [tuple(s) for s in g['shapes']], 3).layouts()\n"
                 "    t.update({{f'optimizer.{{w}}.{{n}}': l for n, l in zip(g['names'], lays) "
                 "for w in ['fp32', *g['states']]}})\n"
                 "rs.redivide(ck, {dst!r}, t, overwrite=True)\n"),
    "export": ("from reshard.store.frontends.deepspeed import export_deepspeed as f; "
               "f({src!r}, {dst!r}, 3, overwrite=True)"),
}


def measure(cmd: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> tuple[float, float, str]:
    """Wall seconds, peak RSS (MiB) of the largest process, and the output of one command."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - t0
        out.seek(0)
        text = out.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-4000:]}")
    return seconds, usage.ru_maxrss / 1024, text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.w7", description=__doc__)
    p.add_argument("--ds-python", required=True, help="a Python with deepspeed (and torch) installed")
    p.add_argument("--python", default=sys.executable, help="the Python with reshard (default: this one)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--tiny", action="store_true", help="a few small tensors (checks the script)")
    p.add_argument("--reps", type=int, default=3, help="runs of each step (the table: min and max)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results-w7.md"))
    args = p.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="reshard-w7-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"W7_TINY": "1"} if args.tiny else {})}
    ds = [args.ds_python, "-m", "bench.w7_dsjob"]
    print("saving the 4-rank ZeRO-2 checkpoint with DeepSpeed...", flush=True)
    measure([*ds, "save", str(work / "ds4"), "4"], env)
    size = sum(f.stat().st_size for f in (work / "ds4" / "step").iterdir()) / 2**20
    rows = []

    def step(system: str, what: str, cmd: list[str], note: str = "") -> None:
        runs = [measure(cmd, env) for _ in range(args.reps)]
        seconds = sorted(r[0] for r in runs)
        rss = max(r[1] for r in runs)
        inner = sorted(float(line.split()[1]) for _, _, text in runs for line in text.splitlines()
                       if line.startswith("LOAD_SECONDS"))
        if inner:
            note = f"load_checkpoint itself {inner[0]:.2f} s (the rest: start-up, engine set-up)"
        rows.append((system, what, seconds[0], seconds[-1], rss, note))
        print(f"{system:10s} {what:42s} {seconds[0]:8.2f} .. {seconds[-1]:8.2f} s {rss:8.0f} MiB", flush=True)

    py = [args.python, "-c"]
    rs_ckpt, rs3, ds3 = str(work / "rs"), str(work / "rs3"), str(work / "ds3")
    step("reshard", "import deepspeed (4 ranks' files)", [*py, RESHARD["import"].format(src=str(work / "ds4"),
                                                                                          dst=rs_ckpt)])
    step("reshard", "load: 3 ranks' new ranges, in place", [*py, RESHARD["load"].format(src=rs_ckpt)],
         "fp32 + exp_avg + exp_avg_sq of every parameter, each rank's part")
    step("reshard", "redivide to the 3-rank flat layouts", [*py, RESHARD["redivide"].format(src=rs_ckpt, dst=rs3)])
    step("reshard", "export deepspeed --dp 3", [*py, RESHARD["export"].format(src=rs_ckpt, dst=ds3)])
    step("reshard", "DeepSpeed load_checkpoint, 3 ranks", [*ds, "load", ds3, "3"])
    step("DeepSpeed", "ds_to_universal", [args.ds_python, "-m", "deepspeed.checkpoint.ds_to_universal",
                                          "--input_folder", str(work / "ds4" / "step"),
                                          "--output_folder", str(work / "ds4" / "step_universal")])
    step("DeepSpeed", "load_checkpoint (load_universal), 3 ranks", [*ds, "load", str(work / "ds4"), "3",
                                                                    "universal"])
    lines = ["# Bench W7: GPT-2-small Adam state, ZeRO-2 on 4 ranks -> 3 ranks", "",
             f"Checkpoint: {size:.0f} MiB of DeepSpeed files ({'tiny' if args.tiny else '124 M parameters'}, "
             f"fp32, AdamW). Machine: {os.cpu_count()} CPUs, shared with other work while measured "
             f"(`python -m bench.w7`); {args.reps} runs of each step: min and max seconds. Peak RSS: the largest "
             "process of the step (for reshard's import most of it is the DeepSpeed files' pages, read through "
             "mmap).", "",
             "| system | step | seconds (min) | (max) | peak RSS (MiB) | note |", "|---|---|---:|---:|---:|---|"]
    lines += [f"| {s} | {w} | {t:.2f} | {u:.2f} | {r:.0f} | {n} |" for s, w, t, u, r, n in rows]
    shutil.rmtree(work, ignore_errors=True) if args.workdir is None else None
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
