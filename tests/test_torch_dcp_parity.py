"""The DCP plugin behaves as DCP's own ``FileSystemWriter``/``FileSystemReader`` do.

Each test runs the same calls once on DCP's file system storage and once on
reshard's plugin, and compares what comes back: bytes-like leaves (DCP's e2e
test keeps ``train_state.losses`` as ``io.BytesIO``), a second save to the same
path, and a load with no template (``_load_state_dict_from_keys``).
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import reshard.store as rs
import reshard.torch as rt
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

pytestmark = pytest.mark.torch


@pytest.fixture(autouse=True)
def _one_process():
    with warnings.catch_warnings():  # torch: "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        yield


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"layers.0.weight": torch.randn(4, 3, generator=g), "layers.0.bias": torch.randn(4, generator=g)},
        "optim": {"param_groups": [{"lr": 0.1 * seed, "params": ["layers.0.weight", "layers.0.bias"]}]},
        "train_state": {"step": seed, "losses": io.BytesIO(f"losses {seed}".encode()),
                        "blob": b"\x00\xffraw", "buf": bytearray(b"mutable")},
    }


def _writers(tmp_path: Path) -> dict[str, Any]:
    return {"dcp": (lambda p: dcp.FileSystemWriter(p), lambda p: dcp.FileSystemReader(p)),
            "reshard": (lambda p: rt.StorageWriter(p), lambda p: rt.StorageReader(p))}


def _plain(value: Any) -> Any:
    """Comparable values: tensors as lists, BytesIO as ('BytesIO', bytes)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.tolist())
    if isinstance(value, io.BytesIO):
        return ("BytesIO", value.getvalue())
    return value


@pytest.mark.parametrize("system", ["dcp", "reshard"])
def test_bytes_leaves_come_back_as_saved(tmp_path: Path, system: str) -> None:
    make_writer, make_reader = _writers(tmp_path)[system]
    dcp.save(_state(3), storage_writer=make_writer(str(tmp_path / "c")))
    target = _state(0)
    dcp.load(target, storage_reader=make_reader(str(tmp_path / "c")))
    assert _plain(target) == _plain(_state(3))
    assert type(target["train_state"]["buf"]) is bytearray and type(target["train_state"]["blob"]) is bytes


def test_bytes_leaves_are_stored_without_pickle(tmp_path: Path) -> None:
    dcp.save(_state(3), storage_writer=rt.StorageWriter(str(tmp_path / "c")))
    ckpt = rs.open(str(tmp_path / "c"))
    assert ckpt.leaves["train_state.losses"].getvalue() == b"losses 3"
    assert ckpt.leaves["train_state.blob"] == b"\x00\xffraw"
    for p in (tmp_path / "c").rglob("*"):  # JSON and zarr shards only: no pickle protocol header
        assert not (p.is_file() and p.read_bytes()[:2] in (b"\x80\x02", b"\x80\x04", b"\x80\x05")), p


def test_objects_dcp_would_pickle_are_refused_by_name(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.ones(2), "sched": {"fn": object()}}, storage_writer=rt.StorageWriter(str(tmp_path / "x")))
    assert "leaf 'sched.fn' of type object is not JSON" in repr(info.value.failures)
    assert "bytes or io.BytesIO" in repr(info.value.failures)


@pytest.mark.parametrize("system", ["dcp", "reshard"])
def test_a_second_save_to_the_same_path_overwrites(tmp_path: Path, system: str) -> None:
    make_writer, make_reader = _writers(tmp_path)[system]
    path = str(tmp_path / "c")
    dcp.save(_state(1), storage_writer=make_writer(path))
    dcp.save(_state(2), storage_writer=make_writer(path))
    target = _state(0)
    dcp.load(target, storage_reader=make_reader(path))
    assert _plain(target) == _plain(_state(2))


def test_overwrite_false_keeps_the_first_save(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    path = str(tmp_path / "c")
    dcp.save(_state(1), storage_writer=rt.StorageWriter(path))
    with pytest.raises(CheckpointException, match="CheckpointExistsError"):
        dcp.save(_state(2), storage_writer=rt.StorageWriter(path, overwrite=False))
    assert rs.open(path).leaves["train_state.step"] == 1


def test_a_load_without_template_nests_as_dcp_does(tmp_path: Path) -> None:
    state = _state(5)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")))
    dcp.save(state, storage_writer=rt.StorageWriter(str(tmp_path / "rs")))
    for keys in (None, "model", {"model", "train_state"}):
        want = _load_state_dict_from_keys(keys, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")))
        got = _load_state_dict_from_keys(keys, storage_reader=rt.StorageReader(str(tmp_path / "rs")))
        assert _plain(got) == _plain(want), keys
    assert set(got["model"]) == {"layers.0.weight", "layers.0.bias"}  # DCP's keys, dots and all


def test_a_load_without_template_nests_rs_saves_by_dots(tmp_path: Path) -> None:
    import numpy as np

    rs.save({"model": {"w": np.arange(6.0).reshape(2, 3)}, "step": 7}, str(tmp_path / "c"))
    got = _load_state_dict_from_keys(storage_reader=rt.StorageReader(str(tmp_path / "c")))
    assert got["step"] == 7 and got["model"]["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
