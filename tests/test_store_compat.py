"""The files are standard zarr v3: plain TensorStore, zarr-python and dask read them,
and reshard reads what those libraries write. Also: a rank reads only what it needs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import reshard.store as rs
from paths import zarr_root
from reshard.layouts import Layout

pytestmark = pytest.mark.directory_form  # these tests look at or damage the directory form's files

RNG = np.random.default_rng(3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat") / "ck"
    state = {
        "w": RNG.standard_normal((48, 20)).astype(np.float32),
        "emb": RNG.standard_normal((33, 8)).astype(ml_dtypes.bfloat16),
        "f8": RNG.standard_normal((16, 4)).astype(ml_dtypes.float8_e4m3fn),
        "bal": RNG.integers(-100, 100, size=(20, 6)).astype(np.int16),
    }
    lay = {
        "w": Layout.from_mindspore([2, 2], [1, 0], (48, 20)),
        "emb": Layout.from_dtensor((4,), ["S(0)"], (33, 8)),  # ceil: 9, 9, 9, 6
        "f8": Layout.from_jax({"x": 2, "y": 2}, ["x", "y"], (16, 4)),
        "bal": Layout.from_oneflow([0, 1, 2, 3, 4, 5], "S(0)", (20, 6)),  # balanced: not a regular grid
    }
    rs.save(state, root, lay, compression=None, grid="regular", form="directory")  # "bal": gcd grid
    return root, state


def u(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.dtype(f"u{a.dtype.itemsize}"))


def test_plain_tensorstore_reads_every_tensor(saved):
    import tensorstore as ts

    root, state = saved
    for name, arr in state.items():
        path = str(zarr_root(root) / name)
        t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}).result()
        assert t.dtype.name == rs.open(root)[name].meta.dtype
        np.testing.assert_array_equal(u(np.asarray(t.read().result())), u(arr))


def test_plain_zarr_and_dask_read_every_tensor(saved):
    import dask.array as da
    import zarr

    url, state = saved
    root = zarr_root(url)
    group = zarr.open_group(str(root), mode="r")
    assert sorted(group.array_keys()) == sorted(state)
    for name, arr in state.items():
        z = zarr.open_array(str(root / name), mode="r")
        np.testing.assert_array_equal(u(z[:]), u(arr))
        d = da.from_zarr(z)
        np.testing.assert_array_equal(u(d.compute()), u(arr))
    assert group.attrs["reshard"]["leaves"] == {}


@pytest.mark.parametrize("engine", ["fast", "tensorstore", "zarr"])
def test_engines_agree(saved, engine):
    root, state = saved
    ckpt = rs.open(root, engine=engine)
    target = {n: Layout.from_dtensor((3,), ["S(1)"], a.shape) for n, a in state.items()}
    for rank in range(3):
        got = ckpt.load(target, rank)
        for name, arr in state.items():
            np.testing.assert_array_equal(u(got[name]), u(arr[target[name].region(rank)]))


def test_reshard_reads_what_tensorstore_writes(tmp_path):
    arr = RNG.standard_normal((40, 12)).astype(ml_dtypes.bfloat16)
    lay = {"x": Layout.from_dtensor((4,), ["S(0)"], arr.shape)}
    rs.save({"x": arr}, tmp_path / "ck", lay, engine="tensorstore", compression="zstd")
    np.testing.assert_array_equal(u(rs.open(tmp_path / "ck")["x"].read()), u(arr))


def test_reshard_reads_what_zarr_python_writes(tmp_path):
    """Write shards with zarr-python's own writer into reshard's metadata, then read with reshard."""
    import json

    import zarr

    arr = RNG.standard_normal((32, 16)).astype(np.float32)
    rs.save({"x": np.zeros_like(arr)}, tmp_path / "ck", {"x": Layout.from_dtensor((2,), ["S(0)"], arr.shape)})
    z = zarr.open_array(str(zarr_root(tmp_path / "ck") / "x"), mode="r+")
    z[:] = arr  # zarr-python re-encodes every shard
    doc = json.loads((zarr_root(tmp_path / "ck") / "x" / "zarr.json").read_text())
    assert doc["codecs"][0]["name"] == "sharding_indexed"
    np.testing.assert_array_equal(rs.open(tmp_path / "ck")["x"].read(), arr)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def test_one_rank_reads_only_what_it_needs(tmp_path):
    """Bytes read by the process (kernel's rchar, not our own counter) for one rank of 7."""
    arr = RNG.standard_normal((4096, 1024)).astype(np.float32)  # 16 MiB
    rs.save({"t": arr}, tmp_path / "ck", {"t": Layout.from_dtensor((8,), ["S(0)"], arr.shape)})
    ckpt = rs.open(tmp_path / "ck")
    target = {"t": Layout.from_dtensor((7,), ["S(0)"], arr.shape)}
    start = _rchar()
    got = ckpt.load(target, 3)["t"]
    read = _rchar() - start
    needed = got.nbytes
    np.testing.assert_array_equal(got, arr[target["t"].region(3)])
    assert needed <= read <= 1.25 * needed, (read, needed)
    assert ckpt.last_stats.bytes_fetched <= 1.25 * needed
    assert ckpt.last_stats.bytes_delivered == needed


def test_redivide_onto_irregular_layouts_writes_a_coarse_grid(saved, tmp_path):
    """One process writes every shard of a redivided tensor, so a balanced split of 256
    over 7 ranks is 7 shards of up to 37 (not 256 shards of 1, the per-rank gcd grid);
    plain zarr reads it and every rank still loads exactly its part."""
    import json

    import zarr

    vec = RNG.standard_normal(256).astype(np.float32)
    src = tmp_path / "src"
    bal = saved[1]["bal"]
    rs.save({"v": vec, "bal": bal}, src, {"v": Layout.from_dtensor((2,), ["S(0)"], vec.shape),
                                          "bal": Layout.from_dtensor((2,), ["S(0)"], bal.shape)})
    target = {"v": Layout.from_oneflow(list(range(7)), "S(0)", vec.shape),  # 37, 37, 37, 37, 36, 36, 36
              "bal": Layout.from_oneflow(list(range(4)), "S(1)", (20, 6))}  # 2, 2, 1, 1 columns
    per_rank = tmp_path / "per-rank"
    rs.save({"v": vec}, per_rank, {"v": target["v"]})
    assert rs.open(per_rank)["v"].meta.edges == ((37,) * 4 + (36,) * 3,)  # ranks write their own blocks, exactly
    rs.redivide(str(src), str(tmp_path / "dst"), target)
    ckpt = rs.open(tmp_path / "dst")
    assert ckpt["v"].meta.shard == (37,) and ckpt["bal"].meta.shard == (20, 2)
    assert len(list((zarr_root(tmp_path / "dst") / "v" / "c").iterdir())) == 7
    np.testing.assert_array_equal(zarr.open_array(str(zarr_root(tmp_path / "dst") / "v"), mode="r")[:], vec)
    for name, arr in {"v": vec, "bal": bal}.items():
        for rank in target[name].ranks:
            np.testing.assert_array_equal(ckpt.load(target, rank)[name], arr[target[name].region(rank)])
    gen = zarr_root(tmp_path / "dst")
    manifest = gen / ".reshard" / "ranks" / "0.json"
    doc = json.loads(manifest.read_text())
    doc["tensors"]["v"]["shard"] = [5]  # neither grid of the layout
    del doc["sha256"]  # as an older writer (no self-digest) left it: the layout check must catch the edit
    manifest.write_text(json.dumps(doc))
    for key in (tmp_path / "dst" / ".reshard" / "commit.json", gen / ".reshard" / "commit.lock"):
        key.unlink()  # committing again merges the manifests
    with pytest.raises(rs.FormatError, match=r"'v'.*shard( shape)? \[5\]"):
        rs.commit(str(tmp_path / "dst"), save_id=ckpt.save_id)
