"""docs/examples: the training loops of docs/training.md run, crash, and resume to the same result."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"


def run(script: str, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None)
    return subprocess.run([sys.executable, str(EXAMPLES / script), str(root), *args], capture_output=True,
                          text=True, timeout=600, env=env, cwd=ROOT)


def committed(root: Path) -> list[int]:
    index = root / "manager.json"
    return [s["step"] for s in json.loads(index.read_text())["steps"]] if index.exists() else []


def marked(root: Path) -> list[int]:
    """Steps whose commit marker is written: committed, even if the crash came before the index was updated
    (the next run's manager indexes them: ``Committer.reconcile``)."""
    return sorted(int(p.parent.parent.name.removeprefix("step-")) for p in root.glob("step-*/.reshard/commit.json"))


def final_loss(out: str) -> str:
    found = re.search(r"final loss (\S+)", out)
    assert found, out
    return found.group(1)


@pytest.mark.jax
def test_jax_loop_resumes_after_a_crash_to_the_same_result(tmp_path):
    pytest.importorskip("jax")
    clean = run("jax_train.py", tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr[-3000:]
    crashed = run("jax_train.py", tmp_path / "run", "--crash-at", "8")
    assert crashed.returncode == 1
    before = marked(tmp_path / "run")
    assert set(before) <= {3, 6}  # an async save not committed before the crash is invisible
    resumed = run("jax_train.py", tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (f"resumed from step {before[-1]}" in resumed.stdout) if before else ("resumed" not in resumed.stdout)
    assert final_loss(resumed.stdout) == final_loss(clean.stdout)
    assert committed(tmp_path / "run") == [9, 12]


@pytest.mark.torch
def test_torch_fsdp2_loop_resumes_after_a_crash(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    crashed = run("torch_train.py", tmp_path / "run", "--crash-at", "8")
    assert crashed.returncode != 0
    before = marked(tmp_path / "run")
    assert set(before) <= {3, 6}
    resumed = run("torch_train.py", tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (f"resumed from step {before[-1]}" in resumed.stdout) if before else ("resumed" not in resumed.stdout)
    assert "steps kept: [6, 9, 12]" in resumed.stdout  # keep_every=6 keeps 6, max_to_keep=2 the last two
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".reshard", "manager.json", "step-12", "step-6",
                                                                    "step-9"]
