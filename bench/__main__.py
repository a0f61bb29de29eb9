"""``python -m bench``: run the workloads, print the table, write ``bench/results.md``."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench import data
from bench.report import machine, markdown, summary
from bench.workloads import Options, Runner, available_anchors

ALL = ("w1", "w3", "w2", "w4", "gpt2", "w5", "s3sim", "scale", "async", "fresh")
#: Left out of ``--smoke`` unless named with ``--only`` (CI's smoke run stays short).
SMOKE_SKIP = {"gpt2", "w5", "s3sim"}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, reshard + np/cat only, 1 run (CI)")
    p.add_argument("--full", action="store_true", help="add the 4 GiB case of the size sweep")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(ALL)} (default all; "
                                                f"--smoke leaves out {', '.join(sorted(SMOKE_SKIP))})")
    p.add_argument("--no-anchors", action="store_true", help="skip DCP and Orbax")
    p.add_argument("--reps", type=int, default=None, help="runs kept per phase (default 3; smoke 1)")
    p.add_argument("--warmup", type=int, default=None, help="runs dropped per phase (default 1; smoke 0)")
    p.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one, removed after)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results.md"), help="markdown output")
    p.add_argument("--against", type=Path, default=None,
                   help="another reshard checkout, run beside this one in the fresh in-place load rows")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    chosen = args.only or ",".join(w for w in ALL if not (args.smoke and w in SMOKE_SKIP))
    only = {w.strip() for w in chosen.split(",") if w.strip()}
    if only - set(ALL):
        print(f"unknown workloads {sorted(only - set(ALL))}; choose from {ALL}", file=sys.stderr)
        return 2
    anchors = set() if args.smoke or args.no_anchors else available_anchors()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="reshard-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    opts = Options(cfg=data.SMOKE if args.smoke else data.FULL, workdir=work,
                   reps=args.reps or (1 if args.smoke else 3),
                   warmup=args.warmup if args.warmup is not None else (0 if args.smoke else 1),
                   full=args.full, only=only, anchors=anchors, against=args.against)
    info = machine()
    print(f"reshard benchmark: {info['machine']}; anchors: {sorted(anchors) or 'none'}; workdir {work}", flush=True)
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    try:
        rows = Runner(opts).all()
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    text = markdown(rows, opts, info, f"Total benchmark time: {time.monotonic() - t0:.0f} s; load average "
                    f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
                    "(other work on the machine shows up as spread between min and max).")
    print(text)
    Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(summary(rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
