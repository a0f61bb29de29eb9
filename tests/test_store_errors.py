"""Hostile and wrong input gets a clear error, and nothing saved is lost."""

from __future__ import annotations

import pathlib
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout
from reshard.store.format.meta import tensor_name, tensor_path


@pytest.mark.parametrize("name", ["a..b", ".a", "a.", "", "../../etc/passwd", "a/../../b"])
def test_empty_name_components_are_refused(tmp_path, name):
    with pytest.raises(rs.BadNameError, match="empty"):
        rs.save({name: np.zeros(2)}, tmp_path / "ck")
    assert not (tmp_path / "ck" / ".reshard" / "commit.json").exists()


@pytest.mark.parametrize("name", ["/abs/path", "a/b/c", "~7E", "__reserved", "x y:z", "名字", "c", "zarr"])
def test_hostile_names_cannot_escape_the_root(tmp_path, name):
    root = tmp_path / "ck"
    rs.save({name: np.arange(3.0)}, root)
    path = tensor_path(name)
    assert tensor_name(path) == name
    written = {p.resolve() for p in tmp_path.rglob("*") if p.is_file()}
    assert all(root.resolve() in p.parents for p in written), "a file was written outside the checkpoint"
    ckpt = rs.open(root)
    np.testing.assert_array_equal(ckpt[name].read(), np.arange(3.0))
    assert not any(part.startswith("__") or part in ("..", ".") for part in path.split("/"))


def test_shape_and_dtype_mismatch_on_write(tmp_path):
    lay = {"w": Layout.from_dtensor((2,), ["S(0)"], (4, 3))}
    writer = rs.create(tmp_path / "ck", lay)
    with pytest.raises(rs.ShapeMismatchError, match=r"'w' on rank 1.*\(3, 3\).*\(2, 3\)"):
        writer.write(1, {"w": np.zeros((3, 3))})
    with pytest.raises(rs.DTypeMismatchError, match="complex128"):
        writer.write(0, {"w": np.zeros((2, 3), dtype=complex)})
    writer.write(0, {"w": np.zeros((2, 3), dtype=np.float32)})
    writer.write(1, {"w": np.zeros((2, 3), dtype=np.float64)})
    with pytest.raises(rs.DTypeMismatchError, match=r"'w' is float32 on rank 0 but float64 on rank 1"):
        writer.commit()


def test_wrong_ranks_and_missing_tensors(tmp_path):
    lay = {"w": Layout.from_dtensor((2,), ["S(0)"], (4, 3)), "b": Layout.from_dtensor((2,), ["R"], (3,))}
    writer = rs.create(tmp_path / "ck", lay)
    with pytest.raises(rs.RankError, match="rank 5"):
        writer.write(5, {"w": np.zeros((2, 3)), "b": np.zeros(3)})
    with pytest.raises(rs.LayoutError, match=r"\['b'\]"):
        writer.write(0, {"w": np.zeros((2, 3))})
    with pytest.raises(rs.LayoutError, match="no layout given for tensor 'c'"):
        writer.write(0, {"w": np.zeros((2, 3)), "b": np.zeros(3), "c": np.zeros(1)})
    with pytest.raises(TypeError, match=r"leaf 'obj'"):
        writer.write(0, {"w": np.zeros((2, 3)), "b": np.zeros(3), "obj": object()})
    assert not list((tmp_path / "ck").rglob("c/*")), "a refused write left data behind"


def test_load_with_wrong_global_shape(tmp_path):
    rs.save({"w": np.zeros((4, 3))}, tmp_path / "ck")
    ckpt = rs.open(tmp_path / "ck")
    with pytest.raises(rs.ShapeMismatchError, match=r"'w'.*\(5, 3\).*\(4, 3\)"):
        ckpt.load({"w": Layout.from_dtensor((2,), ["S(0)"], (5, 3))}, 0)
    with pytest.raises(rs.TensorNotFoundError, match="no tensor named 'nope'"):
        ckpt["nope"]
    with pytest.raises(rs.RankError):
        Layout.from_dtensor((2,), ["S(0)"], (4, 3)).region(7)


@pytest.mark.directory_form
def test_corrupted_chunk_names_the_tensor(tmp_path):
    arr = np.arange(4096, dtype=np.float32).reshape(64, 64)
    rs.save({"layer.w": arr, "layer.ok": arr}, tmp_path / "ck", chunk_bytes=2048)
    shard = next((pathlib.Path(rs.open(tmp_path / "ck").zarr_url) / "layer" / "w").rglob("c/0/0"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # flip bits inside the first chunk
    shard.write_bytes(bytes(data))
    ckpt = rs.open(tmp_path / "ck")
    with pytest.raises(rs.ChecksumError, match=r"'layer\.w'.*crc32c"):
        ckpt["layer.w"].read()
    np.testing.assert_array_equal(ckpt["layer.w"][40:].read(), arr[40:])  # other chunks are fine
    np.testing.assert_array_equal(ckpt["layer.ok"].read(), arr)


@pytest.mark.directory_form
def test_truncated_shard_and_garbage_metadata(tmp_path):
    rs.save({"w": np.ones((8, 8))}, tmp_path / "ck")
    shard = next((pathlib.Path(rs.open(tmp_path / "ck").zarr_url) / "w").rglob("c/0/0"))
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises((rs.ChecksumError, rs.StorageError, rs.FormatError)):
        rs.open(tmp_path / "ck")["w"].read()
    Path(rs.open(tmp_path / "ck").zarr_url, "zarr.json").write_text("{not json")
    with pytest.raises(ValueError):
        rs.open(tmp_path / "ck")


def test_layout_refusals_are_clear():
    with pytest.raises(rs.LayoutError, match="10"):
        Layout.from_mindspore([4], [0], (10,))
    with pytest.raises(rs.LayoutError):
        Layout.from_mindspore([2, 2], [5, -1], (4, 4))
    with pytest.raises(rs.LayoutError, match="partial"):
        Layout.from_oneflow([0, 1], "P", (4,))


@pytest.mark.parametrize("url", ["file", "memory"])
@pytest.mark.parametrize("form", ["directory", "packed"])
def test_a_snapshot_whose_save_is_gone_says_so(tmp_path, form, url):
    """A view opened with check_current=False reads its save while it exists; once an object of it is gone (gc
    after a newer save, an incomplete copy) a read is a FormatError naming what is missing, not a bare OSError,
    also where the view already holds the shard indexes (the objects vanish between two reads)."""
    import fsspec

    root = str(tmp_path / "ck") if url == "file" else f"memory://{tmp_path.name}/ck"
    value = np.arange(2.0**17).reshape(512, 256)  # past the end a packed reader keeps with the manifest
    rs.save({"w": value}, root, form=form)
    ckpt = rs.open(root, check_current=False)
    np.testing.assert_array_equal(ckpt.read("w"), value)  # the view now holds the shard indexes
    fs, path = fsspec.core.url_to_fs(root)
    for p in fs.find(path):
        if "/packed/" in p or "/w/c/" in p:
            fs.rm(p)
    with pytest.raises(rs.FormatError, match="missing"):
        ckpt.read("w")
