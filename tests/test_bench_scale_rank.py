"""``python -m bench.scale_rank`` at a tiny size: every phase runs and reports its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_phase_reports(tmp_path: Path) -> None:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.scale_rank", "--ranks", "8", "--tensors", "5", "--procs", "2",
         "--phases", "layouts,save,build,restore", "--url", str(tmp_path / "ck")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["phase"]: row for row in map(json.loads, proc.stdout.strip().splitlines())}
    assert list(rows) == ["layouts", "save", "build", "restore"]
    assert rows["save"]["cpu_s"] >= 0 and rows["save"]["rss_mib"] >= rows["save"]["rss_before_mib"]
    assert rows["restore"]["tensors_seen"] == 5 and rows["restore"]["requests"] > 0  # it read the checkpoint
    assert all(row["ranks"] == 8 and row["tensors"] == 5 for row in rows.values())
