"""``reshard import ...`` and ``reshard export --format mindspore`` on real files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout, dump_strategy
from reshard.store.cli import main
from reshard.store.frontends import mindspore as ms


def test_import_and_export_mindspore_from_the_command_line(tmp_path: Path) -> None:
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
    # the long form and the spelling, `export mindspore SRC DIR`, do the same
    assert main(["export", url, str(out), "--format", "mindspore", "--strategy", str(tmp_path / "infer.json")]) == 0
    assert main(["export", "mindspore", url, str(tmp_path / "out2"), "--strategy", str(tmp_path / "infer.json")]) == 0
    for folder in (out, tmp_path / "out2"):
        for rank in range(2):
            (path,) = (folder / f"rank_{rank}").glob("*.ckpt")
            np.testing.assert_array_equal(ms.read_ckpt(path)["w"], w[target["w"].region(rank)])


def test_import_errors_are_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "reshard.store.cli", "import", "mindspore", str(tmp_path / "missing"),
         str(tmp_path / "ck"), "--strategy", str(tmp_path / "none.json")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("reshard: error:") and "Traceback" not in proc.stderr
    assert main(["export", "x", "y", "--format", "mindspore"]) == 2  # --strategy is required
    assert main(["export", "parquet", "x", "y"]) == 2  # not a format
    assert main(["export", "npz", "x", "y", "--format", "torch"]) == 2  # two formats that disagree
    assert main(["export", "x"]) == 2


def test_import_dcp_from_the_command_line(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "step": 5}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    assert main(["import", "dcp", str(tmp_path / "dcp"), str(tmp_path / "ck")]) == 0
    ckpt = rs.open(tmp_path / "ck")
    np.testing.assert_array_equal(ckpt["w"].read(), state["w"].numpy())
    assert ckpt.leaves["step"] == 5


def test_import_oneflow_seed001_from_the_command_line(tmp_path: Path) -> None:
    """seed 001's model-file folders (ranks 0 and 1), written as plain npz, imported by the CLI.

    get_sbp becomes --sbp 'S(0)' plus --sbp-for rules; the split(1) weight has 1 column
    per rank, the 5-row weight splits unevenly (3 + 2): global shapes come from the pieces.
    """
    from reshard.store.frontends.oneflow import load_oneflow, save_npz, to_local

    rng = np.random.default_rng(7)
    state = {"System-Train-TrainStep": np.array([2], np.int64),
             "module_pipeline": {"m_stage0.linear.weight": rng.standard_normal((5, 16)).astype(np.float32),
                                 "m_stage3.linear.weight": rng.standard_normal((1, 2)).astype(np.float32),
                                 "m_stage3.linear.bias": rng.standard_normal(1).astype(np.float32)},
             "lr": 0.001}

    def get_sbp(sd: Any, tensor: Any) -> str:
        if tensor is sd["System-Train-TrainStep"]:
            return "broadcast"
        if tensor is sd["module_pipeline"]["m_stage3.linear.weight"]:
            return "split(1)"
        if tensor is sd["module_pipeline"]["m_stage3.linear.bias"]:
            return "broadcast"
        return "split(0)"

    dirs = [str(save_npz(to_local(state, [0, 1], get_sbp, r), tmp_path / f"graph_save_load_global_{r}"))
            for r in (0, 1)]
    url = str(tmp_path / "ck")
    argv = ["import", "oneflow", *dirs, url, "--placement", "[0, 1]", "--sbp", "S(0)",
            "--sbp-for", "System-Train-TrainStep=B", "--sbp-for", "module_pipeline.m_stage3.linear.weight=S(1)",
            "--sbp-for", "*.bias=broadcast"]
    proc = subprocess.run([sys.executable, "-m", "reshard.store.cli", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("imported OneFlow state") and '"tensors": 4' in proc.stdout

    ckpt = rs.open(url)
    assert ckpt.leaves == {"lr": 0.001}
    assert ckpt["module_pipeline.m_stage3.linear.weight"].layout == Layout.from_oneflow([0, 1], "S(1)", (1, 2))
    for name, value in state["module_pipeline"].items():
        np.testing.assert_array_equal(ckpt[f"module_pipeline.{name}"].read(), value)
    back = load_oneflow(ckpt, 1, [0, 1], get_sbp)  # the seed's load: same placement and get_sbp
    assert back is not None
    np.testing.assert_array_equal(back["module_pipeline"]["m_stage0.linear.weight"],
                                  state["module_pipeline"]["m_stage0.linear.weight"][3:])

    assert main(argv) == 1  # committed already: one-line error, --overwrite replaces it
    assert main([*argv, "--overwrite"]) == 0
    assert main(["import", "oneflow", dirs[0], url, "--placement", "[0, 1]", "--sbp", "B"]) == 2  # 1 dir, 2 ranks
    assert main(["import", "oneflow", *dirs, url, "--placement", "[0, 1]", "--sbp", "B", "--sbp-for", "x"]) == 2
