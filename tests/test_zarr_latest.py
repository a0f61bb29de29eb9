"""Plain zarr-python >= 3.2 reads reshard's exact (rectilinear) shards with no reshard code.

Skipped where zarr-python is older (3.1 on Python 3.11, the main suite); run by
``tox -e zarr-latest`` (Python 3.12, the newest zarr 3.x), which ``.ci/run``
runs when Python 3.12 is installed. zarr-python still calls its rectilinear
grid experimental: reading needs ``zarr.config.set({"array.rectilinear_chunks": True})``
(or ``ZARR_ARRAY__RECTILINEAR_CHUNKS=True``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout

zarr = pytest.importorskip("zarr")
if "rectilinear_chunks" not in zarr.config.get("array", {}):
    pytest.skip(f"zarr-python {zarr.__version__} has no rectilinear chunk grid (3.2 or newer has)",
                allow_module_level=True)

RNG = np.random.default_rng(32)


def _save_by_ranks(url: Path, arrays: dict[str, np.ndarray], layouts: dict[str, Layout], **options: object) -> str:
    writer = rs.create(str(url), layouts, form="directory", **options)  # plain zarr opens the folder
    for r in sorted(set().union(*(lay.ranks for lay in layouts.values()))):
        writer.write(r, {n: a[layouts[n].region(r)] for n, a in arrays.items() if r in layouts[n].ranks})
    writer.commit()
    return rs.open(str(url)).zarr_url


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, np.ndarray]]:
    arrays = {
        "emb": RNG.standard_normal((1003, 24)).astype(np.float32),  # balanced over 8: 126 x 3, 125 x 5
        "t3": RNG.integers(-9, 9, size=(7, 45, 5)).astype(np.int16),  # balanced over 2 x 4
        "mega": RNG.standard_normal((10, 6)).astype(np.float64),  # Megatron blocks, not a product grid
        "vec": RNG.standard_normal(50).astype(np.float32),  # balanced over 4: 13, 13, 12, 12
    }
    layouts = {
        "emb": Layout(shape=(1003, 24), mesh=(8,), dims=((0,), ()), split="balanced"),
        "t3": Layout(shape=(7, 45, 5), mesh=(2, 4), dims=((0,), (1,), ()), split="balanced"),
        "mega": Layout.from_megatron((10, 6), [(0, (0, 0), (4, 6), 0), (1, (4, 0), (6, 3), 0),
                                               (2, (4, 3), (6, 3), 0)]),
        "vec": Layout(shape=(50,), mesh=(4,), dims=((0,),), split="balanced"),
    }
    root = tmp_path_factory.mktemp("latest") / "ck"
    return _save_by_ranks(root, arrays, layouts), arrays


def test_every_tensor_is_rectilinear_sharded(saved: tuple[str, dict[str, np.ndarray]]) -> None:
    url, arrays = saved
    import json

    for name in arrays:
        doc = json.loads((Path(url) / name / "zarr.json").read_text())
        assert doc["chunk_grid"]["name"] == "rectilinear"
        assert doc["codecs"][0]["name"] == "sharding_indexed"  # rectilinear outer shards, regular inner chunks


def test_plain_zarr_python_reads_rectilinear_shards(saved: tuple[str, dict[str, np.ndarray]]) -> None:
    url, arrays = saved
    with zarr.config.set({"array.rectilinear_chunks": True}):
        group = zarr.open_group(url, mode="r")
        assert sorted(group.array_keys()) == sorted(arrays)
        for name, arr in arrays.items():
            z = group[name]
            np.testing.assert_array_equal(z[...], arr)
            region = tuple(slice(n // 3, n - n // 4) for n in arr.shape)  # cuts across shards
            np.testing.assert_array_equal(z[region], arr[region])


def test_plain_zarr_python_consolidated_and_reshard_dask(saved: tuple[str, dict[str, np.ndarray]]) -> None:
    """zarr's consolidated metadata opens the group; dask reads through reshard's ``to_dask``
    (``dask.array.from_zarr`` asks a zarr array for ``.shards``, which zarr-python refuses on a
    rectilinear grid)."""
    url, arrays = saved
    with zarr.config.set({"array.rectilinear_chunks": True}):
        group = zarr.open_consolidated(url, mode="r")
        ckpt = rs.open(str(Path(url).parent))
        for name, arr in arrays.items():
            np.testing.assert_array_equal(group[name][...], arr)
            d = ckpt[name].to_dask(chunks="shard")
            assert d.chunks == group[name].write_chunk_sizes  # one dask chunk per stored shard
            np.testing.assert_array_equal(d.compute(), arr)


def test_reshard_zarr_engine_and_fast_reader_agree(saved: tuple[str, dict[str, np.ndarray]]) -> None:
    url, arrays = saved
    root = str(Path(url).parent)
    for engine in ("fast", "zarr"):
        ckpt = rs.open(root, engine=engine)
        for name, arr in arrays.items():
            np.testing.assert_array_equal(ckpt.read(name), arr)


def test_reshard_reads_shards_zarr_python_rewrites(tmp_path: Path) -> None:
    """zarr-python re-encodes every rectilinear shard; reshard's own reader reads the result."""
    arr = RNG.standard_normal((103, 8)).astype(np.float32)
    lay = {"x": Layout(shape=arr.shape, mesh=(4,), dims=((0,), ()), split="balanced")}
    url = _save_by_ranks(tmp_path / "ck", {"x": np.zeros_like(arr)}, lay)
    with zarr.config.set({"array.rectilinear_chunks": True}):
        z = zarr.open_array(str(Path(url) / "x"), mode="r+")
        z[...] = arr
    np.testing.assert_array_equal(rs.open(str(tmp_path / "ck")).read("x"), arr)
