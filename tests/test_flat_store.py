"""Flattened-range layouts through real checkpoints: per-rank saves, loads, redivides, plain zarr."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import FlatBuffer, FlatLayout, Layout
from reshard.store.ops.redivide import local_part

RNG = np.random.default_rng(27)


def zero_layouts(shapes: dict[str, tuple[int, ...]], dp: int, zero3: bool = False) -> dict[str, FlatLayout]:
    """Per-tensor flat layouts of a ZeRO flat buffer over ``dp`` ranks."""
    names = list(shapes)
    buf = (FlatBuffer.per_tensor(list(shapes.values()), range(dp)) if zero3
           else FlatBuffer.partitioned(list(shapes.values()), range(dp), pad_to=2 * dp))
    return dict(zip(names, buf.layouts(), strict=True))


SHAPES = {"emb": (37, 12), "w": (7, 12), "b": (7,), "k": (3, 4, 5), "s": ()}


def full_state() -> dict[str, np.ndarray]:
    return {n: RNG.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def check_rank(ckpt: rs.Checkpoint, full: dict[str, np.ndarray], target: dict[str, Layout], rank: int) -> None:
    got = ckpt.load(target, rank)
    for name, lay in target.items():
        if rank in lay.ranks:
            np.testing.assert_array_equal(got[name], local_part(lay, rank, full[name]), err_msg=f"{name} {rank}")
        else:
            assert name not in got


@pytest.mark.parametrize("form", ["packed", "directory"])
@pytest.mark.parametrize("zero3", [False, True])
def test_per_rank_flat_save_reads_every_way(tmp_path, form, zero3):
    full = full_state()
    saved = zero_layouts(SHAPES, 4, zero3)
    url = str(tmp_path / "ck")
    pieces = {r: {n: local_part(lay, r, full[n]) for n, lay in saved.items() if r in lay.ranks} for r in range(4)}
    writer = rs.create(url, saved, form=form)
    for r, local in pieces.items():
        writer.write(r, local)
    writer.commit()
    ckpt = rs.open(url)
    for name, arr in full.items():  # integrate: every tensor whole
        np.testing.assert_array_equal(ckpt[name].read(), arr)
        assert ckpt.tensor(name).layout == saved[name]
    for target in (zero_layouts(SHAPES, 3, zero3), zero_layouts(SHAPES, 3, not zero3),
                   {n: Layout.from_dtensor((2,), ["S(0)"] if s else ["R"], s) for n, s in SHAPES.items()}):
        for rank in range(3):
            check_rank(ckpt, full, target, rank)
    assert rs.verify(url).ok
    as_torch = ckpt.load(zero_layouts(SHAPES, 3, zero3), 1, as_="torch")
    for name, lay in zero_layouts(SHAPES, 3, zero3).items():
        if 1 in lay.ranks:
            np.testing.assert_array_equal(as_torch[name].numpy(), local_part(lay, 1, full[name]))
    got = ckpt.load_many(zero_layouts(SHAPES, 3, zero3), range(3))
    for rank in range(3):
        for name, lay in zero_layouts(SHAPES, 3, zero3).items():
            if rank in lay.ranks:
                np.testing.assert_array_equal(got[rank][name], local_part(lay, rank, full[name]))


def test_redivide_block_to_flat_and_flat_to_block(tmp_path):
    full = full_state()
    rs.save(full, str(tmp_path / "block"), {n: Layout.from_dtensor((2,), ["S(0)"] if s else ["R"], s)
                                           for n, s in SHAPES.items()})
    flat3 = zero_layouts(SHAPES, 3)
    rs.redivide(str(tmp_path / "block"), str(tmp_path / "flat"), flat3)
    ckpt = rs.open(str(tmp_path / "flat"))
    for name, lay in flat3.items():
        meta = ckpt.tensor(name)
        assert meta.layout == lay
        if len(meta.shape) > 1:  # one process wrote it: whole rows a shard, not the ranges' column cuts
            assert meta.edges is None and meta.shard[1:] == meta.shape[1:]
        np.testing.assert_array_equal(ckpt[name].read(), full[name])
    for rank in range(3):
        check_rank(ckpt, full, flat3, rank)
    rows = {n: Layout.from_dtensor((4,), ["S(0)"] if s else ["R"], s) for n, s in SHAPES.items()}
    rs.redivide(str(tmp_path / "flat"), str(tmp_path / "back"), rows)
    for rank in range(4):
        check_rank(rs.open(str(tmp_path / "back")), full, rows, rank)


def test_flat_layouts_pickle_and_copy():
    import copy
    import pickle

    for lay in zero_layouts(SHAPES, 3).values():
        lay.blocks()  # the cached tables are not pickled
        for other in (pickle.loads(pickle.dumps(lay)), copy.deepcopy(lay)):
            assert other == lay and type(other) is FlatLayout and other.blocks() == lay.blocks()


def test_per_rank_grid_keeps_one_writer_per_shard(tmp_path):
    lay = FlatLayout.from_ranges((6, 10), [(0, 0, 23), (1, 23, 41), (2, 41, 60)])
    meta = rs.create(str(tmp_path / "g"), {"w": lay}).meta("w", lay, "float32")
    assert meta.edges is not None
    for idx in meta.chunk_grid.shards_in((slice(0, 6), slice(0, 10))):
        region = meta.shard_region(idx)
        holders = {lay.owner(p) for p in np.ndindex(*(r.stop - r.start for r in region))
                   for p in [tuple(x + r.start for x, r in zip(p, region, strict=True))]}
        assert len(holders) == 1 and meta.writer(idx) in holders


def test_flat_target_into_given_buffers(tmp_path):
    full = full_state()
    rs.save(full, str(tmp_path / "c"))
    lay = zero_layouts(SHAPES, 2)["emb"]
    n = lay.local_shape(1)[0]
    strided = np.zeros(2 * n, np.float32)[::2]  # a strided 1-d view: filled in place
    got = rs.open(str(tmp_path / "c")).load({"emb": lay}, 1, out={"emb": strided})
    assert got["emb"] is strided and n > 0
    np.testing.assert_array_equal(strided, local_part(lay, 1, full["emb"]))
    with pytest.raises(rs.ShapeMismatchError):
        rs.open(str(tmp_path / "c")).load({"emb": lay}, 1, out={"emb": np.zeros((n, 1), np.float32)})


def test_plain_zarr_reads_an_imported_flat_checkpoint(tmp_path):
    import zarr

    full = full_state()
    rs.save(full, str(tmp_path / "src"))
    flat = zero_layouts(SHAPES, 4)
    rs.redivide(str(tmp_path / "src"), str(tmp_path / "dir"), flat, form="directory")
    ckpt = rs.open(str(tmp_path / "dir"))
    group = zarr.open_group(ckpt.zarr_url, mode="r")
    for name, arr in full.items():
        np.testing.assert_array_equal(group[name][...], arr)  # the parameter's own shape, regular grid
        assert group[name].attrs["reshard"]["layout"]["kind"] == "flat"
    assert rs.verify(str(tmp_path / "dir")).ok


def test_stored_flat_layouts_are_bounded():
    from reshard.store.format.schema import MAX_RANKS, layout_of

    with pytest.raises(rs.FormatError, match="over the limit"):
        layout_of({"version": 1, "kind": "flat", "shape": [4], "even": {"range": [0, MAX_RANKS + 1]}}, "here")
    with pytest.raises(rs.FormatError, match="over the limit"):
        layout_of({"version": 1, "kind": "flat", "shape": [4], "ranges": [[0, 0, 0, 0]] * (MAX_RANKS + 1)}, "here")
    lay = zero_layouts(SHAPES, 3)["emb"]
    assert layout_of(lay.to_json(), "here", lay.shape) == lay


def test_per_rank_flat_cells_are_chunks_without_sharding(tmp_path):
    """Ranges cutting rows at arbitrary columns: every cell of the per-rank grid is one zarr chunk (no sharding
    codec, so no inner chunk has to divide every cell), cells bounded by FLAT_CELL_ELEMENTS."""
    from reshard.store.format.grid import FLAT_CELL_ELEMENTS

    lay = FlatLayout.even((4096, 4096), 3)  # cuts at columns 2731 and 1366: a sharded grid's chunks would be 1 x 2
    meta = rs.create(str(tmp_path / "w"), {"w": lay}).meta("w", lay, "float32")
    assert not meta.sharded and meta.chunk == meta.shard and meta.edges is not None
    assert max(math.prod(meta.chunk_grid.extent(i)) for i in meta.shards_in((slice(0, 4096), slice(0, 4096)))) \
        <= FLAT_CELL_ELEMENTS
    doc = meta.to_zarr_json()
    assert [c["name"] for c in doc["codecs"]] == ["bytes", "crc32c"]
    for idx in meta.shards_in((slice(0, 4096), slice(0, 4096))):  # one writer per cell
        region = meta.shard_region(idx)
        corners = {lay.owner((r0, c0)) for r0 in (region[0].start, region[0].stop - 1)
                   for c0 in (region[1].start, region[1].stop - 1)}
        assert corners == {meta.writer(idx)}
    rows = rs.create(str(tmp_path / "w"), {"w": lay}).meta("w", lay, "float32", single_writer=True)
    assert rows.sharded and rows.edges is None and rows.chunk[1:] == (4096,)


def test_per_rank_cells_round_trip_and_detect_damage(tmp_path):
    shape = (301, 70)  # ranges of 7024: cut rows mid-way
    lay = FlatLayout.even(shape, 3)
    full = RNG.standard_normal(shape).astype(np.float32)
    url = str(tmp_path / "d")
    writer = rs.create(url, {"w": lay}, form="directory", compression="zstd")
    for r in lay.ranks:
        writer.write(r, {"w": local_part(lay, r, full)})
    writer.commit()
    ckpt = rs.open(url)
    assert not ckpt.tensor("w").sharded
    np.testing.assert_array_equal(ckpt["w"].read(), full)
    np.testing.assert_array_equal(ckpt["w"][10:20, 5:9].read(), full[10:20, 5:9])
    key = ckpt.tensor("w").shard_key((0, 1))
    path = Path(ckpt.storage.url) / key
    raw = bytearray(path.read_bytes())
    raw[3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises((rs.ChecksumError, rs.FormatError)):
        rs.open(url)["w"].read()
    assert not rs.verify(url).ok
