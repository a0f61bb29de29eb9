"""Issue 14 item 8: the command line's rough edges, each one line and helpful."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout, dump_strategy
from reshard.store.cli import main
from reshard.store.frontends import mindspore as ms


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reshard.store.cli", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_a_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    for command in ("verify", "inspect"):
        p = cli(command, str(f))
        assert p.returncode == 1
        (line,) = p.stderr.strip().splitlines()
        assert line.startswith(f"reshard: error: {f} is a file, not a checkpoint"), line
        assert "reshard import safetensors" in line and "NotADirectoryError" not in line
    with pytest.raises(rs.CheckpointNotFoundError, match="is a file"):
        rs.open(str(f))


def test_import_names_the_overwrite_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    ms.write_ckpt(tmp_path / "src" / "rank_0" / "net.ckpt", {"w": w})
    strategy = tmp_path / "s.json"
    strategy.write_bytes(dump_strategy({"w": Layout.from_mindspore([1], [-1, -1], w.shape)}))
    argv = ["import", "mindspore", str(tmp_path / "src"), str(tmp_path / "ck"), "--strategy", str(strategy)]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err and len(err.strip().splitlines()) == 1
    assert main([*argv, "--overwrite"]) == 0


def test_inspect_summarizes_long_leaves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    groups = [{"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": wd, "amsgrad": False,
               "params": list(range(i * 40, i * 40 + 40))} for i, wd in enumerate((0.1, 0.0))]
    url = str(tmp_path / "ck")
    rs.save({"w": np.zeros(4, np.float32), "optimizer": {"param_groups": groups}, "step": 3}, url)
    assert main(["inspect", url]) == 0
    footer = capsys.readouterr().out.strip().splitlines()[-1]
    assert footer.startswith("total: 1 tensors") and "step=3" in footer
    assert "optimizer.param_groups=[2 groups: lr=0.001, betas=[0.9, 0.999], eps=1e-08" in footer
    assert "weight_decay" in footer and "params" in footer and "39" not in footer and len(footer) < 200
    assert main(["inspect", url, "--json"]) == 0  # the whole value stays available
    assert json.loads(capsys.readouterr().out)["leaves"]["optimizer.param_groups"] == groups


def test_inspect_uncommitted_describes_a_dtype_conflict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "ck")
    lay = Layout.from_dtensor((2,), ["S(0)"], (4, 3))
    writer = rs.create(url, {"w": lay})
    writer.write(0, {"w": np.zeros((2, 3), np.float32)})
    writer.write(1, {"w": np.zeros((2, 3), np.float16)})  # rank 1 saved another dtype
    with pytest.raises(rs.DTypeMismatchError):
        writer.commit()
    assert main(["inspect", url]) == 1
    assert "never committed" in capsys.readouterr().err
    assert main(["inspect", url, "--uncommitted"]) == 0
    out = capsys.readouterr().out
    assert "UNCOMMITTED" in out
    assert "conflict: tensor 'w' is float32 on rank 0 but float16 on rank 1" in out


def test_close_matches_for_tensors_and_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "ck")
    rs.save({"model": {"embed": {"weight": np.zeros((4, 2), np.float32)}}, "step": 1}, url)
    assert main(["show", url, "model.embed.wieght"]) == 1
    assert "did you mean 'model.embed.weight'" in capsys.readouterr().err
    assert main(["inspect", url, "model.embd"]) == 1
    assert "did you mean" in capsys.readouterr().err
    assert main(["show", url, "model"]) == 1
    assert "is a group of 1 tensors" in capsys.readouterr().err
    assert main(["inspekt", url]) == 2
    assert "did you mean 'inspect'?" in capsys.readouterr().err
    assert main(["import", "mindspor", "a", "b"]) == 2
    assert "did you mean 'mindspore'?" in capsys.readouterr().err
