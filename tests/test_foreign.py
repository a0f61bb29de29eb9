"""A folder in another framework's format, opened as a reshard checkpoint, is named with the command that reads it.

Each folder is the framework's own (written by torch DCP, Orbax, safetensors, or the real Megatron-Core,
MindSpore and OneFlow samples under tests/data; DeepSpeed's as tests/test_deepspeed.py builds it). The test
runs the command the error names, as a user would, and opens what it wrote.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.store.cli import main

DATA = Path(__file__).parent / "data"


def _dcp(tmp: Path) -> Path:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=str(tmp / "dcp"), no_dist=True)
    return tmp / "dcp"


def _deepspeed(tmp: Path) -> Path:
    from dssaves import build_save

    build_save(tmp / "ds", 2, 2)
    return tmp / "ds"


def _orbax(tmp: Path) -> Path:
    ocp = pytest.importorskip("orbax.checkpoint")
    import jax.numpy as jnp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp / "orbax", {"w": jnp.arange(6.0)})
    checkpointer.wait_until_finished()
    return tmp / "orbax"


def _safetensors(tmp: Path) -> Path:
    from safetensors.numpy import save_file

    (tmp / "hf").mkdir()
    save_file({"w": np.arange(6, dtype=np.float32)}, str(tmp / "hf" / "model.safetensors"))
    return tmp / "hf"


FOLDERS = {
    "dcp": _dcp,
    "megatron": lambda tmp: DATA / "megatron" / "tp2dp2",
    "deepspeed": _deepspeed,
    "orbax": _orbax,
    "safetensors": _safetensors,
    "mindspore": lambda tmp: DATA / "mindspore" / "single",
    "oneflow": lambda tmp: DATA / "oneflow" / "rank_0",
}


@pytest.mark.parametrize("framework", sorted(FOLDERS))
def test_open_names_the_import_that_reads_a_foreign_folder(framework: str, tmp_path: Path, capsys) -> None:
    folder = FOLDERS[framework](tmp_path)
    with pytest.raises(rs.CheckpointNotFoundError) as e:
        rs.open(str(folder))
    command = re.search(r"`(reshard import [^`]+)`", str(e.value))
    assert command is not None, str(e.value)
    assert command.group(1) == f"reshard import {framework} {folder} DST"
    assert main(["inspect", str(folder)]) == 1
    assert command.group(1) in capsys.readouterr().err
    # the command, as the user is told it
    assert main(shlex.split(command.group(1).replace("DST", str(tmp_path / "dst")))[1:]) == 0
    assert rs.open(str(tmp_path / "dst")).arrays


def test_mindspore_rank_folders_name_the_strategy(tmp_path: Path) -> None:
    with pytest.raises(rs.CheckpointNotFoundError, match=r"reshard import mindspore \S+ DST --strategy STRATEGY_FILE"):
        rs.open(str(DATA / "mindspore" / "redundant"))


def test_an_import_of_the_wrong_framework_names_the_right_one(tmp_path: Path, capsys) -> None:
    folder = _safetensors(tmp_path)
    assert main(["import", "deepspeed", str(folder), str(tmp_path / "x")]) == 1
    assert f"`reshard import safetensors {folder} DST`" in capsys.readouterr().err
    assert main(["import", "dcp", str(DATA / "megatron" / "tp2dp2"), str(tmp_path / "y")]) == 1
    err = capsys.readouterr().err
    assert "Megatron-Core torch_dist" in err and "`reshard import megatron " in err
    assert main(["import", "safetensors", str(DATA / "megatron" / "tp2dp2"), str(tmp_path / "z")]) == 1
    assert "`reshard import megatron " in capsys.readouterr().err  # a folder of no .safetensors file
    assert not any((tmp_path / d).exists() for d in "xyz")


def test_an_empty_or_unknown_folder_gets_no_hint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(rs.CheckpointNotFoundError) as e:
        rs.open(str(tmp_path))
    assert "reshard import" not in str(e.value)


def test_dcp_plugin_reader_names_dcp_own_reader(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from reshard.torch import StorageReader

    folder = _dcp(tmp_path)
    state = {"w": torch.zeros(2, 3)}
    with pytest.raises(BaseException, match="no checkpoint at") as e:  # DCP wraps it in a CheckpointException
        dcp.load(state, storage_reader=StorageReader(str(folder)), no_dist=True)
    told = re.search(r"storage_reader=(torch\.distributed\.checkpoint\.FileSystemReader\('[^']+'\))", str(e.value))
    assert told is not None, str(e.value)
    dcp.load(state, storage_reader=eval(told.group(1), {"torch": torch}), no_dist=True)  # as the user is told
    np.testing.assert_array_equal(state["w"].numpy(), np.arange(6.0).reshape(2, 3))


def test_every_hint_names_an_import_the_command_line_has() -> None:
    from reshard.store.cli.frameworks import FRAMEWORKS
    from reshard.store.read import foreign

    told = {v.command for v in vars(foreign).values() if isinstance(v, foreign.Foreign)}
    assert told == {name for name, row in FRAMEWORKS.items() if row.run_import is not None}
