"""``reshard import ...`` and ``reshard export --format mindspore`` on real files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout, dump_strategy
from reshard.store.cli import main
from reshard.store.frontends import mindspore as ms


def test_import_and_export_mindspore_from_the_command_line(tmp_path: Path):
    w = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    src = {"w": Layout.from_mindspore([2, 2], [1, 0], w.shape)}
    for rank in range(4):
        ms.write_ckpt(tmp_path / "src" / f"rank_{rank}" / "net.ckpt", {"w": w[src["w"].region(rank)]})
    (tmp_path / "train.ckpt_strategy").write_bytes(dump_strategy(src, "protobuf"))
    url = str(tmp_path / "ck")
    assert main(["import", "mindspore", str(tmp_path / "src"), url,
                 "--strategy", str(tmp_path / "train.ckpt_strategy")]) == 0
    np.testing.assert_array_equal(rs.open(url)["w"].read(), w)

    target = {"w": Layout.from_mindspore([2, 1], [1, 0], w.shape)}
    (tmp_path / "infer.json").write_bytes(dump_strategy(target))
    out = tmp_path / "out"
    assert main(["export", url, str(out), "--format", "mindspore", "--strategy", str(tmp_path / "infer.json")]) == 0
    for rank in range(2):
        (path,) = (out / f"rank_{rank}").glob("*.ckpt")
        np.testing.assert_array_equal(ms.read_ckpt(path)["w"], w[target["w"].region(rank)])


def test_import_errors_are_one_line(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "reshard.store.cli", "import", "mindspore", str(tmp_path / "missing"),
         str(tmp_path / "ck"), "--strategy", str(tmp_path / "none.json")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("reshard: error:") and "Traceback" not in proc.stderr
    assert main(["export", "x", "y", "--format", "mindspore"]) == 2  # --strategy is required


def test_import_dcp_from_the_command_line(tmp_path: Path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "step": 5}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    assert main(["import", "dcp", str(tmp_path / "dcp"), str(tmp_path / "ck")]) == 0
    ckpt = rs.open(tmp_path / "ck")
    np.testing.assert_array_equal(ckpt["w"].read(), state["w"].numpy())
    assert ckpt.leaves["step"] == 5
