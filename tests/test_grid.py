"""Exact shards for uneven layouts: zarr's rectilinear chunk grid (issue 12 item 2).

Runs on zarr 3.1 (Python 3.11, the main suite) and in ``tox -e zarr-latest``:
reshard's own reader needs no zarr-python for the rectilinear grid.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout
from reshard.layouts.errors import FormatError
from reshard.store.format.consolidated import summary_seal
from reshard.store.format.encode import _encode_chunks, encode_shard
from reshard.store.format.grid import Grid, choose_grid
from reshard.store.format.meta import ArrayMeta
from reshard.store.format.schema import with_digest

#: These tests look at the shard files (the zarr-latest env runs them without conftest.py).
DIRECTORY = {"form": "directory"}

RNG = np.random.default_rng(12)


def _balanced(shape: tuple[int, ...], parts: int, dim: int = 0) -> Layout:
    dims = tuple((0,) if d == dim else () for d in range(len(shape)))
    return Layout(shape=shape, mesh=(parts,), dims=dims, split="balanced")


def _save_by_ranks(url: Path, arrays: dict[str, np.ndarray], layouts: dict[str, Layout], **options: Any) -> None:
    """Every rank writes its own blocks (as a training job does), then one commit."""
    writer = rs.create(str(url), layouts, **{**DIRECTORY, **options})
    ranks = sorted(set().union(*(lay.ranks for lay in layouts.values())))
    for r in ranks:
        writer.write(r, {n: a[layouts[n].region(r)] for n, a in arrays.items() if r in layouts[n].ranks})
    writer.commit()


def _shard_objects(url: Path, name: str) -> list[Path]:
    return sorted(p for p in (Path(rs.open(str(url)).zarr_url) / name / "c").rglob("*") if p.is_file())


# ------------------------------------------------------------------ the grid
def test_grid_json_forms() -> None:
    doc = {"name": "rectilinear", "configuration": {"kind": "inline", "chunk_shapes": [[[3, 2], 4], 4, [6]]}}
    g = Grid.from_json((10, 10, 6), doc)
    assert g.edges == ((3, 3, 4), (4, 4, 2), (6,)) and g.shard == (4, 4, 6) and g.counts == (3, 3, 1)
    assert g.to_json()["configuration"]["chunk_shapes"] == [[[3, 2], 4], [[4, 2], 2], [6]]
    assert Grid.from_json((10, 10, 6), g.to_json()) == g
    assert Grid.from_json((5,), {"name": "rectilinear", "configuration": {"kind": "inline", "chunk_shapes": [
        [4, 4, 4]]}}).edges == ((4, 4),)  # overflow past the end is dropped
    assert g.region((2, 2, 0)) == (slice(6, 10), slice(8, 10), slice(0, 6))
    assert list(g.shards_in((slice(2, 7), slice(0, 1), slice(5, 6)))) == [(0, 0, 0), (1, 0, 0), (2, 0, 0)]
    assert list(g.indices(0, 3, 6)) == [1] and list(g.indices(0, 0, 0)) == []
    assert g.divisor() == (1, 2, 6)
    regular = Grid.from_json((10,), {"name": "regular", "configuration": {"chunk_shape": [4]}})
    assert regular.counts == (3,) and regular.region((2,)) == (slice(8, 10),) and regular.extent((2,)) == (4,)
    for bad in ({"name": "rectilinear", "configuration": {"kind": "inline", "chunk_shapes": [[3, 3]]}},
                {"name": "rectilinear", "configuration": {"kind": "inline", "chunk_shapes": [[0, 10]]}},
                {"name": "rectilinear", "configuration": {"kind": "inline", "chunk_shapes": "x"}}):
        with pytest.raises((ValueError, TypeError)):
            Grid.from_json((10,), bad)
    with pytest.raises(FormatError, match="kind"):
        Grid.from_json((10,), {"name": "rectilinear", "configuration": {"kind": "file", "chunk_shapes": [[10]]}})


def test_choose_grid() -> None:
    bal = _balanced((50257, 768), 8)
    exact = choose_grid(bal)
    assert exact.edges == ((6283,) + (6282,) * 7, (768,)) and exact.counts == (8, 1)
    assert choose_grid(bal, "regular") == Grid((50257, 768), (1, 768))  # the gcd grid: one-row shards
    assert choose_grid(bal, single_writer=True) == Grid((50257, 768), (6283, 768))
    ceil = Layout.from_dtensor((4,), ["S(0)"], (33, 8))
    assert choose_grid(ceil) == Grid((33, 8), (9, 8))  # regular layouts: one block per shard
    even = _balanced((32, 8), 4)
    assert choose_grid(even).edges is None
    mega = Layout.from_megatron((10, 6), [(0, (0, 0), (4, 6), 0), (1, (4, 0), (6, 3), 0), (2, (4, 3), (6, 3), 0)])
    assert choose_grid(mega).edges == ((4, 6), (3, 3))
    with pytest.raises(ValueError, match="grid"):
        choose_grid(bal, "auto")


def test_inner_chunk_divides_every_edge(tmp_path: Path) -> None:
    arr = RNG.standard_normal((101, 3, 8)).astype(np.float32)
    lay = _balanced(arr.shape, 4)  # 26, 25, 25, 25 rows
    writer = rs.create(str(tmp_path / "x"), {"t": lay}, **DIRECTORY)
    meta = writer.meta("t", lay, "float32")
    assert meta.edges == ((26, 25, 25, 25), (3,), (8,))
    assert meta.chunk == (1, 3, 8)
    for i in range(4):
        assert meta.chunks_in((i, 0, 0)) == (meta.edges[0][i], 1, 1)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_rows_fast_path_writes_the_same_bytes(compression: str | None) -> None:
    lay = _balanced((50, 6), 4)
    meta = ArrayMeta("t", (50, 6), "float32", (13, 6), (1, 6), lay, edges=((13, 13, 12, 12), (6,)),
                     compressor=compression)
    data = RNG.standard_normal((13, 6)).astype(np.float32)
    fast = b"".join(bytes(memoryview(b)) for b in encode_shard(data, meta, (0, 0)))
    slow = b"".join(bytes(memoryview(b)) for b in _encode_chunks(data, meta, meta.chunks_in((0, 0))))
    assert fast == slow
    edge = ArrayMeta("e", (10, 6), "float32", (4, 6), (3, 6), Layout.single((10, 6)))  # padded last chunk
    part = RNG.standard_normal((2, 6)).astype(np.float32)
    assert b"".join(bytes(memoryview(b)) for b in encode_shard(part, edge, (2, 0))) == \
        b"".join(bytes(memoryview(b)) for b in _encode_chunks(part, edge, edge.chunks_per_shard))


# ------------------------------------------------------------- round trips
def test_balanced_split_is_one_shard_per_rank(tmp_path: Path) -> None:
    arr = RNG.standard_normal((1003, 24)).astype(np.float32)
    lay = _balanced(arr.shape, 8)
    _save_by_ranks(tmp_path / "ck", {"emb": arr}, {"emb": lay})
    shards = _shard_objects(tmp_path / "ck", "emb")
    assert len(shards) == 8
    ckpt = rs.open(str(tmp_path / "ck"))
    meta = ckpt.arrays["emb"]
    assert meta.edges == ((126, 126, 126, 125, 125, 125, 125, 125), (24,))
    doc = json.loads((Path(ckpt.zarr_url) / "emb" / "zarr.json").read_text())
    assert doc["chunk_grid"] == {"name": "rectilinear", "configuration": {
        "kind": "inline", "chunk_shapes": [[[126, 3], [125, 5]], [24]]}}
    np.testing.assert_array_equal(ckpt.read("emb"), arr)
    for target in (Layout.from_dtensor((3,), ["S(0)"], arr.shape), _balanced(arr.shape, 5),
                   _balanced(arr.shape, 7, dim=1), Layout.single(arr.shape)):
        for rank in target.ranks:
            np.testing.assert_array_equal(ckpt.load({"emb": target}, rank)["emb"], arr[target.region(rank)])
    np.testing.assert_array_equal(ckpt["emb"][120:260, 5:9].read(), arr[120:260, 5:9])


@pytest.mark.parametrize("options", [{"compression": "zstd"}, {"checksums": False}, {"chunk_bytes": 64}])
def test_rectilinear_round_trip_options(tmp_path: Path, options: dict[str, Any]) -> None:
    arr = RNG.integers(-1000, 1000, size=(7, 45, 5)).astype(np.int32)
    lay = Layout(shape=arr.shape, mesh=(2, 4), dims=((0,), (1,), ()), split="balanced")  # 4/3 x 12/11/11/11
    _save_by_ranks(tmp_path / "ck", {"t": arr}, {"t": lay}, **options)
    ckpt = rs.open(str(tmp_path / "ck"))
    assert ckpt.arrays["t"].edges == ((4, 3), (12, 11, 11, 11), (5,))
    assert len(_shard_objects(tmp_path / "ck", "t")) == 8
    np.testing.assert_array_equal(ckpt.read("t"), arr)
    np.testing.assert_array_equal(ckpt.read("t", (slice(3, 5), slice(10, 30), slice(1, 4))), arr[3:5, 10:30, 1:4])


def test_megatron_blocks_and_dask(tmp_path: Path) -> None:
    arr = RNG.standard_normal((10, 6)).astype(np.float32)
    lay = Layout.from_megatron(arr.shape, [(0, (0, 0), (4, 6), 0), (1, (4, 0), (6, 3), 0), (2, (4, 3), (6, 3), 0)])
    _save_by_ranks(tmp_path / "ck", {"t": arr}, {"t": lay})
    ckpt = rs.open(str(tmp_path / "ck"))
    np.testing.assert_array_equal(ckpt["t"].to_dask().compute(), arr)
    by_shard = ckpt["t"].to_dask(chunks="shard")
    assert by_shard.chunks == ((4, 6), (3, 3))
    np.testing.assert_array_equal(by_shard.compute(), arr)
    np.testing.assert_array_equal(ckpt["t"][3:8, 1:].to_dask(chunks="shard").compute(), arr[3:8, 1:])
    np.testing.assert_array_equal(ckpt.load({"t": lay}, 1)["t"], arr[4:, :3])


def test_redivide_from_rectilinear(tmp_path: Path) -> None:
    arr = RNG.standard_normal((77, 4)).astype(np.float32)
    _save_by_ranks(tmp_path / "src", {"t": arr}, {"t": _balanced(arr.shape, 6)})
    target = Layout.from_dtensor((4,), ["S(0)"], arr.shape)
    rs.redivide(str(tmp_path / "src"), str(tmp_path / "dst"), {"t": target}, **DIRECTORY)
    out = rs.open(str(tmp_path / "dst"))
    assert out.arrays["t"].edges is None
    np.testing.assert_array_equal(out.read("t"), arr)


# ------------------------------------------------------------------ choices
def test_regular_grid_on_request_and_with_tensorstore(tmp_path: Path) -> None:
    arr = RNG.standard_normal((20, 6)).astype(np.float32)
    lay = _balanced(arr.shape, 6)  # 4, 4, 3, 3, 3, 3
    _save_by_ranks(tmp_path / "gcd", {"t": arr}, {"t": lay}, grid="regular")
    assert rs.open(str(tmp_path / "gcd")).arrays["t"].shard == (1, 6)
    assert len(_shard_objects(tmp_path / "gcd", "t")) == 20
    with pytest.raises(ValueError, match="grid='exact' needs engine='fast'"):
        rs.create(str(tmp_path / "x"), {"t": lay}, grid="exact", engine="tensorstore")
    with pytest.raises(ValueError, match="grid must be"):
        rs.create(str(tmp_path / "x"), {"t": lay}, grid="rectangular")
    _save_by_ranks(tmp_path / "ts", {"t": arr}, {"t": lay}, engine="tensorstore")  # auto: the gcd grid
    ckpt = rs.open(str(tmp_path / "ts"), engine="tensorstore")
    assert ckpt.arrays["t"].edges is None
    np.testing.assert_array_equal(ckpt.read("t"), arr)


def test_tensorstore_and_old_zarr_refuse_rectilinear_clearly(tmp_path: Path) -> None:
    import zarr

    arr = RNG.standard_normal((20, 6)).astype(np.float32)
    _save_by_ranks(tmp_path / "ck", {"t": arr}, {"t": _balanced(arr.shape, 6)})
    with pytest.raises(FormatError, match=r"tensor 't' of .*ck.*rectilinear chunk grid.*TensorStore cannot read"):
        rs.open(str(tmp_path / "ck"), engine="tensorstore").read("t")
    if "rectilinear_chunks" in zarr.config.get("array", {}):  # zarr >= 3.2: the zarr engine reads it
        np.testing.assert_array_equal(rs.open(str(tmp_path / "ck"), engine="zarr").read("t"), arr)
    else:
        with pytest.raises(FormatError, match=rf"tensor 't'.*zarr-python {zarr.__version__} cannot read"):
            rs.open(str(tmp_path / "ck"), engine="zarr").read("t")


def _resign(url: Path, edit: Any) -> None:
    """Edit the committed metadata (array and root documents) and re-sign it in the marker."""
    marker_path = url / ".reshard" / "commit.json"
    marker = json.loads(marker_path.read_text())
    gen = url / marker["generation"]
    array = json.loads((gen / "t" / "zarr.json").read_text())
    edit(array)
    (gen / "t" / "zarr.json").write_text(json.dumps(array))
    root = json.loads((gen / "zarr.json").read_bytes())
    root["consolidated_metadata"]["metadata"]["t"] = array
    raw = json.dumps(root).encode()
    (gen / "zarr.json").write_bytes(raw)
    marker["metadata_sha256"] = hashlib.sha256(raw).hexdigest()
    marker.update(summary_seal(raw))
    marker.pop("sha256", None)
    marker_path.write_bytes(with_digest(marker))  # re-sealed with the marker's own digest


def test_edited_grid_is_refused_naming_tensor(tmp_path: Path) -> None:
    arr = RNG.standard_normal((20, 6)).astype(np.float32)
    _save_by_ranks(tmp_path / "ck", {"t": arr}, {"t": _balanced(arr.shape, 6)})

    def shift(doc: dict[str, Any]) -> None:
        doc["chunk_grid"]["configuration"]["chunk_shapes"][0] = [3, 5, 3, 3, 3, 3]

    _resign(tmp_path / "ck", shift)
    with pytest.raises(FormatError, match=r"tensor 't': shard grid \[\[3, 5, 3, 3, 3, 3\], \[6\]\] is not a grid"):
        rs.open(str(tmp_path / "ck")).read("t")

    def short(doc: dict[str, Any]) -> None:
        doc["chunk_grid"]["configuration"]["chunk_shapes"][0] = [4, 4, 3, 3, 3]

    _resign(tmp_path / "ck", short)
    with pytest.raises(FormatError, match=r"tensor 't'.*chunk_grid"):
        rs.open(str(tmp_path / "ck")).read("t")


def test_manifest_with_other_edges_is_refused_at_commit(tmp_path: Path) -> None:
    arr = RNG.standard_normal((20, 6)).astype(np.float32)
    lay = _balanced(arr.shape, 6)
    writer = rs.create(str(tmp_path / "ck"), {"t": lay}, **DIRECTORY)
    for r in lay.ranks:
        writer.write(r, {"t": arr[lay.region(r)]})
    path = Path(writer.storage.url) / ".reshard" / "ranks" / "0.json"
    doc = json.loads(path.read_text())
    doc["tensors"]["t"]["edges"] = [[5, 5, 5, 5], [6]]
    doc.pop("sha256", None)
    path.write_bytes(with_digest(doc))
    with pytest.raises(FormatError, match=r"tensor 't'.*shard shape"):
        writer.commit()


def test_cli_verify_and_inspect_rectilinear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from reshard.store.cli.app import main

    arr = RNG.standard_normal((1003, 24)).astype(np.float32)
    _save_by_ranks(tmp_path / "ck", {"emb": arr}, {"emb": _balanced(arr.shape, 8)})
    assert main(["verify", str(tmp_path / "ck"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["bytes_checked"] == arr.nbytes
    assert main(["inspect", str(tmp_path / "ck"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"]["emb"]["shards"] == 8
    shard = _shard_objects(tmp_path / "ck", "emb")[3]
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 0xFF
    shard.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path / "ck")]) == 1
    assert "'emb'" in capsys.readouterr().out


def test_row_planner_matches_the_general_one() -> None:
    """The one-pass planner for row chunks plans exactly what the general planner plans."""
    from reshard.store.format.shard import _plan_chunks, plan_reads

    cases = [
        (ArrayMeta("r", (50, 6), "float32", (13, 6), (1, 6), _balanced((50, 6), 4), edges=((13, 13, 12, 12), (6,))),
         [(slice(0, 50), slice(0, 6)), (slice(11, 40), slice(0, 6)), (slice(3, 4), slice(0, 6))]),
        (ArrayMeta("g", (9, 6), "float32", (4, 6), (2, 6), Layout.single((9, 6))),  # edge shard, padded chunk
         [(slice(0, 9), slice(0, 6)), (slice(5, 9), slice(0, 6))]),
        (ArrayMeta("c", (12, 8), "float32", (6, 8), (2, 8), Layout.single((12, 8))),  # columns cut: general path
         [(slice(0, 12), slice(2, 5))]),
        (ArrayMeta("v", (37,), "int16", (10,), (5,), Layout.single((37,))), [(slice(0, 37),), (slice(4, 33),)]),
    ]
    for meta, regions in cases:
        for region in regions:
            dest = np.empty(tuple(r.stop - r.start for r in region), dtype=meta.np_dtype)
            for shard in meta.shards_in(region):
                per = meta.chunks_in(shard)
                n = int(np.prod(meta.chunk)) * meta.np_dtype.itemsize + 4  # a stored chunk: data + crc32c
                index = np.stack([np.arange(int(np.prod(per))) * n, np.full(int(np.prod(per)), n)], axis=1)
                got = plan_reads(meta, region, index.astype("<u8"), shard, "k", dest)
                want = _plan_chunks(meta, region, index.tolist(), shard, "k", dest)
                assert got == want, (meta.name, region, shard)
