"""Export to one safetensors or npz file: standard files, every dtype, bounded memory."""

from __future__ import annotations

import itertools
import json
import tracemalloc
import zipfile
from pathlib import Path
from typing import Any

import fsspec
import ml_dtypes
import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout
from reshard.store.format.dtypes import numpy_dtype
from reshard.store.read.export import SAFETENSORS_DTYPES, slabs

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

NUMPY_NATIVE = ("bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                "float16", "float32", "float64")
ML = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def model() -> dict[str, Any]:
    """One tensor of every stored dtype, of assorted shapes (0-d, empty, odd sizes)."""
    rng = np.random.default_rng(1)
    out: dict[str, Any] = {}
    for i, name in enumerate(NUMPY_NATIVE + ML):
        shape = [(37, 13), (5,), (3, 4, 5), (), (0, 3), (129,)][i % 6]
        dt = numpy_dtype(name)
        if dt == np.bool_:
            arr = rng.integers(0, 2, shape).astype(bool)
        elif dt.kind in "iu":
            arr = rng.integers(0, 100, shape).astype(dt)
        else:
            arr = rng.standard_normal(shape).astype(dt)
        out[f"t.{name}"] = arr
    out["step"] = 42
    out["lr"] = 1e-4
    return out


def rule(name: str, shape: tuple[int, ...]) -> Layout:
    if not shape:
        return Layout.single(shape)
    return Layout(shape, (3,), dims=((0,),) + ((),) * (len(shape) - 1), split="ceil")


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[rs.Checkpoint, dict[str, Any]]:
    st = model()
    url = str(tmp_path / "ckpt")
    rs.save(st, url, rule, chunk_bytes=64)
    return rs.open(url), st


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def torch_to_numpy(t: Any, dtype: np.dtype[Any]) -> np.ndarray:
    """A torch tensor of any dtype as numpy of ``dtype`` (through its raw bytes)."""
    import torch

    raw = t.contiguous().view(torch.uint8).numpy() if t.dim() else t.reshape(1).view(torch.uint8).numpy()
    return raw.view(dtype).reshape(tuple(t.shape))


def read_header(path: Path) -> tuple[int, dict[str, Any], bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8:8 + n]), raw


# --------------------------------------------------------------- safetensors
def test_safetensors_round_trip_every_dtype(ckpt: tuple[rs.Checkpoint, dict[str, Any]], tmp_path: Path) -> None:
    c, st = ckpt
    path = tmp_path / "model.safetensors"
    stats = c.export(str(path), fuse_bytes=100)  # many slabs and fused tasks
    assert stats.bytes_written == path.stat().st_size and stats.writes == 1
    assert stats.bytes_delivered == sum(a.nbytes for a in st.values() if isinstance(a, np.ndarray))

    native = tmp_path / "native.safetensors"  # safetensors.numpy cannot open files holding BF16/F8
    c.export(str(native), names=[f"t.{n}" for n in NUMPY_NATIVE])
    loaded = load_file(str(native))  # the reference reader, for the dtypes numpy has
    for name in NUMPY_NATIVE:
        a = st[f"t.{name}"]
        assert loaded[f"t.{name}"].dtype == a.dtype and loaded[f"t.{name}"].shape == a.shape
        assert bits(loaded[f"t.{name}"]) == bits(a)

    n, header, raw = read_header(path)
    body = raw[8:8 + n]  # JSON padded with spaces to a multiple of 8 bytes
    assert n % 8 == 0 and body.rstrip(b" ").endswith(b"}") and len(body) - len(body.rstrip(b" ")) < 8
    assert header["__metadata__"]["format"] == "pt"
    assert json.loads(header["__metadata__"]["reshard.leaves"]) == {"step": 42, "lr": 1e-4}
    ends = sorted((v["data_offsets"] for k, v in header.items() if k != "__metadata__"))
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(ends))
    assert 8 + n + ends[-1][1] == len(raw)
    for name in ML:  # bytes at their offsets, and the dtype names safetensors uses
        entry = header[f"t.{name}"]
        assert entry["dtype"] == SAFETENSORS_DTYPES[name]
        lo, hi = entry["data_offsets"]
        assert raw[8 + n + lo: 8 + n + hi] == bits(st[f"t.{name}"])


def test_safetensors_bfloat16_and_float8_through_torch(ckpt: tuple[rs.Checkpoint, dict[str, Any]],
                                                       tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch

    c, st = ckpt
    path = tmp_path / "model.safetensors"
    c.export(str(path))
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == {k for k in st if k.startswith("t.")}
        for name in NUMPY_NATIVE + ML:
            t = f.get_tensor(f"t.{name}")
            a = st[f"t.{name}"]
            assert tuple(t.shape) == a.shape
            if name == "bfloat16":
                assert t.dtype == torch.bfloat16
            assert bits(torch_to_numpy(t, a.dtype)) == bits(a)


def test_names_select_and_order(ckpt: tuple[rs.Checkpoint, dict[str, Any]], tmp_path: Path) -> None:
    c, st = ckpt
    path = tmp_path / "two.safetensors"
    c.export(str(path), names=["t.float32", "t.int8"], metadata={"note": "hi"})
    _, header, _ = read_header(path)
    assert [k for k in header if k != "__metadata__"] == ["t.float32", "t.int8"]
    assert header["t.float32"]["data_offsets"][0] == 0 and header["__metadata__"]["note"] == "hi"
    assert bits(load_file(str(path))["t.int8"]) == bits(st["t.int8"])
    with pytest.raises(rs.TensorNotFoundError):
        c.export(str(path), names=["nope"])
    with pytest.raises(ValueError, match="format"):
        c.export(str(path), format="pickle")


def test_safetensors_to_an_fsspec_url(ckpt: tuple[rs.Checkpoint, dict[str, Any]], tmp_path: Path) -> None:
    c, st = ckpt
    url = f"memory://export-{tmp_path.name}/m.safetensors"
    stats = c.export(url, names=["t.float32", "t.uint16"], budget=256)  # several ordered waves
    data = fsspec.open(url, "rb").open().read()
    local = tmp_path / "copy.safetensors"
    local.write_bytes(data)
    assert stats.bytes_written == len(data)
    got = load_file(str(local))
    assert bits(got["t.float32"]) == bits(st["t.float32"]) and bits(got["t.uint16"]) == bits(st["t.uint16"])
    with pytest.raises(rs.CheckpointExistsError, match=rf"^{url} already exists; overwrite=True"):
        c.export(url, names=["t.uint16"])  # an object that exists is refused, as a local file is
    assert fsspec.open(url, "rb").open().read() == data
    c.export(url, names=["t.uint16"], overwrite=True)
    local.write_bytes(fsspec.open(url, "rb").open().read())
    assert list(load_file(str(local))) == ["t.uint16"]


# ---------------------------------------------------------------------- npz
def test_npz_round_trip_every_dtype(ckpt: tuple[rs.Checkpoint, dict[str, Any]], tmp_path: Path) -> None:
    c, st = ckpt
    path = tmp_path / "model.npz"
    stats = c.export(str(path), format="npz", budget=512)
    assert stats.bytes_written == path.stat().st_size
    note = json.loads(zipfile.ZipFile(path).comment)["reshard"]
    assert note["dtypes"] == {f"t.{n}": n for n in ML} and note["leaves"] == {"step": 42, "lr": 1e-4}
    with np.load(path) as z:
        assert sorted(z.files) == sorted(k for k in st if k.startswith("t."))
        for name in NUMPY_NATIVE + ML:
            got = z[f"t.{name}"]
            a = st[f"t.{name}"]
            if name in ML:  # numpy has no bfloat16/float8: their bit patterns as unsigned ints
                assert got.dtype == np.dtype("u2" if name == "bfloat16" else "u1")
                got = got.view(getattr(ml_dtypes, name))
            assert got.dtype == a.dtype and got.shape == a.shape and bits(got) == bits(a)


def test_npz_note_too_long_for_a_zip_comment(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    rs.save({"w": np.ones(3, dtype=ml_dtypes.bfloat16), "notes": "x" * 70_000}, url)
    path = tmp_path / "m.npz"
    rs.open(url).export(str(path), format="npz")
    with zipfile.ZipFile(path) as z:
        member = json.loads(z.comment)["reshard"]["member"]
        note = json.loads(z.read(member))["reshard"]
    assert note["dtypes"] == {"w": "bfloat16"} and len(note["leaves"]["notes"]) == 70_000
    with np.load(path) as z:
        assert z["w"].view(ml_dtypes.bfloat16).tolist() == [1, 1, 1]


# ------------------------------------------------------------------- memory
def test_export_peak_memory_is_bounded(tmp_path: Path) -> None:
    url = str(tmp_path / "big")
    shape = (1024, 8192)  # 32 MiB each, 256 MiB in all
    rs.save({f"layer{i}.w": np.full(shape, i, dtype=np.float32) for i in range(8)}, url)
    ckpt = rs.open(url)
    for fmt in ("safetensors", "npz"):
        path = tmp_path / f"m.{fmt}"
        tracemalloc.start()
        try:
            ckpt.export(str(path), format=fmt, budget=32 << 20)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 64 << 20, f"{fmt}: peak {peak >> 20} MiB exporting 256 MiB with a 32 MiB budget"
        assert path.stat().st_size >= 256 << 20
    with np.load(tmp_path / "m.npz") as z:
        assert float(z["layer7.w"][-1, -1]) == 7.0
    with safe_open(str(tmp_path / "m.safetensors"), framework="np") as f:
        assert float(f.get_slice("layer5.w")[1023:1024, 8191:8192][0, 0]) == 5.0


def test_slabs_are_contiguous_and_chunk_aligned() -> None:
    from reshard.store.format.meta import ArrayMeta

    meta = ArrayMeta("x", (10, 6, 4), "float32", (10, 6, 4), (2, 6, 4), Layout.single((10, 6, 4)))
    regions = slabs(meta, 200)  # a row of 96 B: 2 rows fit, cut on the chunk grid (2 rows)
    assert [r[0] for r in regions] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8), slice(8, 10)]
    small = slabs(meta, 40)  # under a row: cut dim 1 (2 x 16 B), each slab one C-contiguous run
    assert len(small) == 10 * 3 and all(r[0].stop - r[0].start == 1 for r in small)
    assert slabs(meta, 1)[0] == (slice(0, 1), slice(0, 1), slice(0, 1))  # an element is the least
    flat = np.zeros(240, dtype=bool)
    for r in small:
        lo = np.ravel_multi_index(tuple(s.start for s in r), meta.shape)
        n = int(np.prod([s.stop - s.start for s in r]))
        assert not flat[lo:lo + n].any()
        flat[lo:lo + n] = True
    assert flat.all()
