"""Round trips through real zarr v3 files: any saving layout -> any loading layout."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import reshard.store as rs
from paths import shard_keys
from reshard.layouts import Layout
from reshard.store.format.dtypes import numpy_dtype

RNG = np.random.default_rng(7)


def bits(a: np.ndarray) -> np.ndarray:
    """A bit-exact view (NaN-safe, works for bfloat16/float8)."""
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype != bool else a


def check_every_rank(ckpt: rs.Checkpoint, full: dict[str, np.ndarray], target: dict[str, Layout]) -> None:
    ranks = sorted(set().union(*(lay.ranks for lay in target.values())))
    for rank in ranks:
        got = ckpt.load(target, rank)
        for name, lay in target.items():
            if rank not in lay.ranks:
                continue
            node = got
            for part in name.split("."):
                node = node[part]
            np.testing.assert_array_equal(bits(node), bits(full[name][lay.region(rank)]), err_msg=f"{name} rank {rank}")


@pytest.mark.parametrize(
    ("source", "target"),
    [
        # 8 -> 7: row split, the 7-way split is uneven (ceil)
        (lambda s: Layout.from_dtensor((8,), ["S(0)"], s), lambda s: Layout.from_dtensor((7,), ["S(0)"], s)),
        # seed 000 scenario 2: 4 devices [2,2] -> 2 devices [2,1]
        (lambda s: Layout.from_mindspore([2, 2], [1, 0], s), lambda s: Layout.from_mindspore([2, 1], [1, 0], s)),
        # 64 -> 1 (integration) and 64 -> 56
        (lambda s: Layout.from_mindspore([8, 8], [1, 0], s), lambda s: Layout.single(s)),
        (lambda s: Layout.from_mindspore([8, 8], [1, 0], s),
         lambda s: Layout.from_dtensor((7, 8), ["S(1)", "S(0)"], s)),
        # OneFlow balanced 2-d (nested) -> JAX-like even
        (lambda s: Layout.from_oneflow([[0, 1, 2], [3, 4, 5]], ("S(0)", "S(1)"), s),
         lambda s: Layout.from_dtensor((2, 2), ["R", "S(1)"], s)),
        # DTensor ceil with empty pieces (dim 0 of 5 rows over 4 -> 2,2,1,0; nested with 3 on dim 1)
        (lambda s: Layout.from_dtensor((4, 3), ["S(0)", "S(1)"], s),
         lambda s: Layout.from_oneflow([0, 1, 2], "S(0)", s)),
    ],
    ids=["8to7", "seed000-4to2", "64to1", "64to56", "oneflow-balanced", "dtensor-ceil-empty"],
)
def test_redivision_round_trip(tmp_path, source, target, form):
    shapes = {"a.w": (40, 56), "a.b": (56,), "emb": (5, 24)}
    shapes_ok = {}
    for name, shape in shapes.items():
        try:
            source(shape), target(shape)
            shapes_ok[name] = shape
        except (rs.LayoutError, rs.ShapeMismatchError):
            continue  # an even split that does not divide, or a map for another rank
    assert shapes_ok, "every shape was refused"
    full = {n: RNG.standard_normal(s).astype(np.float32) for n, s in shapes_ok.items()}
    rs.save(full, tmp_path / "ck", {n: source(s) for n, s in shapes_ok.items()}, form=form)
    ckpt = rs.open(tmp_path / "ck")
    assert ckpt.form == form
    check_every_rank(ckpt, full, {n: target(s) for n, s in shapes_ok.items()})
    # the same through redivide(): a new checkpoint whose shards follow the target
    rs.redivide(ckpt, tmp_path / "re", {n: target(s) for n, s in shapes_ok.items()}, form=form)
    again = rs.open(tmp_path / "re")
    assert again.form == form
    for name in shapes_ok:
        np.testing.assert_array_equal(again[name].read(), full[name])
        assert again[name].layout == target(shapes_ok[name])


def test_mindspore_opt_sharded_moments(tmp_path):
    """Weights and Adam moments under MindSpore optimizer parallel, loaded onto tp2 x dp3."""
    shape = (48, 32)
    w = RNG.standard_normal(shape).astype(ml_dtypes.bfloat16)
    m = RNG.standard_normal(shape).astype(np.float32)
    v = RNG.random(shape).astype(np.float32)
    src = Layout.from_mindspore([2, 4], [-1, 0], shape, opt_shard_size=-1)  # tp4 on dim 1, dp2
    assert src.opt_sharded
    assert len({str(src.region(r)) for r in range(8)}) == 8  # every rank holds a distinct piece
    state = {"model.w": w, "moments.model.w": m, "adam_v.model.w": v, "step": 3}
    rs.save(state, tmp_path / "ck", lambda n, s: Layout.from_mindspore([2, 4], [-1, 0], s, opt_shard_size=-1))
    ckpt = rs.open(tmp_path / "ck")
    assert ckpt.leaves == {"step": 3}
    target = Layout.from_mindspore([3, 2], [-1, 0], shape)
    check_every_rank(ckpt, {"model.w": w, "moments.model.w": m, "adam_v.model.w": v},
                     {"model.w": target, "moments.model.w": target, "adam_v.model.w": target})


@pytest.mark.parametrize("dtype", rs.SUPPORTED_DTYPES)
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_every_dtype_bit_exact(tmp_path, dtype, compression, form):
    np_dtype = numpy_dtype(dtype)
    raw = RNG.integers(0, 256, size=(6, 10 * np_dtype.itemsize), dtype=np.uint8)
    arr = raw.view(np_dtype) if dtype != "bool" else raw.astype(bool)
    lay = Layout.from_dtensor((3,), ["S(0)"], arr.shape)
    rs.save({"t": arr, "scalar": arr[0, :1].reshape(())}, tmp_path / "ck",
            {"t": lay, "scalar": Layout.single(())}, compression=compression, form=form)
    ckpt = rs.open(tmp_path / "ck")
    assert ckpt["t"].dtype == np_dtype
    np.testing.assert_array_equal(bits(ckpt["t"].read()), bits(arr))
    np.testing.assert_array_equal(bits(ckpt["scalar"].read()), bits(arr[0, :1].reshape(())))


def test_leaves_nested_and_dotted_names(tmp_path):
    state = {
        "model": {"layer0": {"weight": np.arange(12.0).reshape(3, 4)}},
        "optimizer": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "name": "adamw"}], "step": np.int64(7)},
        "epoch": 2,
        "note": "hello",
    }
    rs.save(state, tmp_path / "ck")
    ckpt = rs.open(tmp_path / "ck")
    assert list(ckpt) == ["model.layer0.weight"]
    assert ckpt.leaves["optimizer.param_groups"] == [{"lr": 1e-3, "betas": [0.9, 0.95], "name": "adamw"}]
    assert ckpt.leaves["optimizer.step"] == 7 and ckpt.leaves["note"] == "hello"
    whole = ckpt.read_all()
    np.testing.assert_array_equal(whole["model"]["layer0"]["weight"], state["model"]["layer0"]["weight"])
    assert whole["epoch"] == 2
    # dotted names address the same tensor as nested dicts
    lay = {"model.layer0.weight": Layout.from_dtensor((2,), ["S(1)"], (3, 4))}
    part = ckpt.load(lay, 1)
    np.testing.assert_array_equal(part["model"]["layer0"]["weight"], state["model"]["layer0"]["weight"][:, 2:])


def test_lazy_views_read_only_what_they_need(tmp_path):
    arr = RNG.standard_normal((256, 64)).astype(np.float32)
    rs.save({"x": arr}, tmp_path / "ck", {"x": Layout.from_dtensor((4,), ["S(0)"], arr.shape)}, chunk_bytes=4096)
    ckpt = rs.open(tmp_path / "ck")
    opened = ckpt.stats.requests  # the commit marker and the root zarr.json
    x = ckpt["x"]
    view = x[10:20, 5]
    assert view.shape == (10,) and ckpt.stats.requests == opened == 2  # slicing did no I/O
    np.testing.assert_array_equal(view.read(), arr[10:20, 5])
    np.testing.assert_array_equal(np.asarray(x[..., -3:]), arr[:, -3:])
    np.testing.assert_array_equal(x[-1].read(), arr[-1])
    before = ckpt.stats.snapshot()
    x[100:104].read()
    fetched = (ckpt.stats - before).bytes_fetched
    marker = len((tmp_path / "ck" / ".reshard" / "commit.json").read_bytes())  # the after-read check
    assert fetched <= 4096 + 4 + x.meta.index_nbytes() + marker  # one 16-row chunk (+crc), no more
    np.testing.assert_array_equal(x[::2].read(), arr[::2])  # steps are lazy too (tests/test_lazy_access.py)


def test_many_ranks_small_tensors(tmp_path):
    """512 ranks, balanced splits: planning and writing stay correct at scale."""
    shape = (1030, 3)
    arr = RNG.standard_normal(shape).astype(np.float32)
    src = Layout.from_oneflow(list(range(512)), "S(0)", shape)
    rs.save({"t": arr}, tmp_path / "ck", {"t": src})
    ckpt = rs.open(tmp_path / "ck")
    np.testing.assert_array_equal(ckpt["t"].read(), arr)
    tgt = Layout.from_dtensor((56,), ["S(0)"], shape)
    for rank in (0, 17, 55):
        np.testing.assert_array_equal(ckpt.load({"t": tgt}, rank)["t"], arr[tgt.region(rank)])


def test_load_into_given_buffers(tmp_path):
    arr = RNG.standard_normal((12, 4)).astype(np.float32)
    rs.save({"m": {"x": arr}}, tmp_path / "ck", {"m.x": Layout.from_dtensor((2,), ["S(0)"], arr.shape)})
    ckpt = rs.open(tmp_path / "ck")
    target = {"m.x": Layout.from_dtensor((3,), ["S(0)"], arr.shape)}
    buf = np.zeros((4, 4), np.float32)
    got = ckpt.load(target, 2, out={"m": {"x": buf}})
    assert got["m"]["x"] is buf
    np.testing.assert_array_equal(buf, arr[8:12])
    with pytest.raises(rs.ShapeMismatchError, match="out buffer"):
        ckpt.load(target, 2, out={"m.x": np.zeros((3, 4), np.float32)})


def test_megatron_explicit_blocks_and_save_pieces(tmp_path):
    """Explicit (rank, offset, shape, replica) blocks that form no regular grid."""
    arr = RNG.standard_normal((10, 6)).astype(np.float32)
    blocks = [(0, (0, 0), (4, 6), 0), (1, (4, 0), (6, 3), 0), (2, (4, 3), (6, 3), 0), (3, (0, 0), (4, 6), 1)]
    lay = Layout.from_megatron(arr.shape, blocks)
    assert not lay.is_regular()
    pieces = {r: {"t": arr[lay.region(r)]} for r in lay.ranks}
    rs.save_pieces(pieces, tmp_path / "ck", {"t": lay})
    ckpt = rs.open(tmp_path / "ck")
    assert ckpt.arrays["t"].edges == ((4, 6), (3, 3))  # the rectilinear grid of the block boundaries
    np.testing.assert_array_equal(ckpt["t"].read(), arr)
    assert len(shard_keys(tmp_path / "ck")) == 4  # rank 0: two cells, ranks 1 and 2: one each; the replica none
    rs.save_pieces(pieces, tmp_path / "gcd", {"t": lay}, grid="regular")
    ckpt = rs.open(tmp_path / "gcd")
    assert ckpt.arrays["t"].shard == (2, 3) and ckpt.arrays["t"].edges is None  # gcd of the block boundaries
    np.testing.assert_array_equal(ckpt["t"].read(), arr)
    assert len(shard_keys(tmp_path / "gcd")) == 10  # every 2x3 cell once


def test_rule_layouts_need_shapes_per_rank(tmp_path):
    def rule(name: str, shape: tuple[int, ...]) -> Layout:
        return Layout.single(shape) if not shape else Layout.from_dtensor((2,), ["S(0)"], shape)

    with pytest.raises(rs.LayoutError, match="shapes="):
        rs.create(tmp_path / "a", rule).write(0, {"w": np.zeros((2, 2))})
    writer = rs.create(tmp_path / "b", rule, shapes={"w": (4, 2), "s": ()})
    writer.write(0, {"w": np.zeros((2, 2)), "s": np.float32(1.5)})
    writer.write(1, {"w": np.ones((2, 2))})
    writer.commit()
    ckpt = rs.open(tmp_path / "b")
    np.testing.assert_array_equal(ckpt["w"].read(), np.repeat([[0.0], [1.0]], 2, axis=0).repeat(2, axis=1))
    assert ckpt["s"].read() == np.float32(1.5)
    with pytest.raises(rs.LayoutError, match=r"\['w'\]"):
        rs.create(tmp_path / "c", rule, shapes={"w": (4, 2)}).write(1, {})
