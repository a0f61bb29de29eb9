"""Issue 14 item 7: leaves and sub-trees by name, numpy-like lazy indexing that reads only what it needs."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
import reshard.store as rs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reshard.layouts import Layout
from reshard.store.read.subtree import SubTree

RNG = np.random.default_rng(14)
SHAPE = (12, 10, 7)
ARR = RNG.standard_normal(SHAPE).astype(np.float32)
#: Hypothesis examples per property (more with RESHARD_HYPOTHESIS_EXAMPLES=1000).
EXAMPLES = int(os.environ.get("RESHARD_HYPOTHESIS_EXAMPLES", "150"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> rs.Checkpoint:
    """A small state whose tensors have several inner chunks per dim (chunk_bytes small)."""
    url = str(tmp_path_factory.mktemp("lazy") / "ck")
    state = {"model": {"layers": {"0": {"w": ARR, "b": np.arange(10, dtype=np.float32)},
                                  "1": {"w": ARR + 1}},
                       "embed": np.arange(64, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(16, 4)},
             "optimizer": {"step": 7, "param_groups": [{"lr": 1e-3}]},
             "step": 100}
    layouts = {"model.layers.0.w": Layout.from_dtensor((2,), ["S(0)"], SHAPE)}
    rs.save(state, url, lambda n, s: layouts.get(n, Layout.single(s)), chunk_bytes=64)
    return rs.open(url)


# ------------------------------------------------------------------ leaves and sub-trees
def test_leaf_and_subtree_by_name(ckpt: rs.Checkpoint) -> None:
    assert ckpt["step"] == 100
    assert ckpt["optimizer.step"] == 7
    model = ckpt["model"]
    assert isinstance(model, SubTree)
    assert sorted(model) == ["embed", "layers.0.b", "layers.0.w", "layers.1.w"] == sorted(model.keys())
    assert len(model) == 4 and "layers.0.w" in model and "layers" not in model
    np.testing.assert_array_equal(model["layers.0.w"].read(), ARR)
    layers = model["layers"]
    assert isinstance(layers, SubTree) and sorted(layers) == ["0.b", "0.w", "1.w"]
    np.testing.assert_array_equal(layers["1"]["w"][2, ::-3].read(), (ARR + 1)[2, ::-3])
    assert dict(ckpt["optimizer"].items()) == {} and ckpt["optimizer"]["step"] == 7
    # the mapping's keys stay the tensors: leaves and groups are reachable, not listed
    assert "step" not in ckpt and "model" not in ckpt and "model.embed" in ckpt
    assert set(ckpt) == {f"model.{n}" for n in model}


def test_subtree_load_and_read_all(ckpt: rs.Checkpoint) -> None:
    layers = ckpt["model"]["layers"]
    got = layers.load({"0.w": Layout.from_dtensor((3,), ["S(1)"], SHAPE)}, rank=2)
    assert set(got) == {"0"} and set(got["0"]) == {"w"}
    np.testing.assert_array_equal(got["0"]["w"], ARR[:, 8:])
    whole = ckpt["model"].read_all()
    np.testing.assert_array_equal(whole["layers"]["1"]["w"], ARR + 1)
    assert whole["embed"].dtype == ml_dtypes.bfloat16
    rule = layers.load(lambda name, shape: Layout.from_dtensor((2,), ["S(0)"], shape), rank=1)
    np.testing.assert_array_equal(rule["0"]["b"], np.arange(5, 10, dtype=np.float32))
    opt = ckpt["optimizer"].read_all()
    assert opt == {"step": 7, "param_groups": [{"lr": 1e-3}]}
    buf = np.empty((12, 10, 7), np.float32)
    layers.load({"0.w": Layout.single(SHAPE)}, 0, out={"0": {"w": buf}})
    np.testing.assert_array_equal(buf, ARR)


def test_missing_names_suggest_close_matches(ckpt: rs.Checkpoint) -> None:
    with pytest.raises(KeyError, match=r"did you mean 'model.layers.0.w'"):
        ckpt["model.layers.0.ww"]
    with pytest.raises(rs.TensorNotFoundError, match=r"did you mean 'layers.1.w'"):
        ckpt["model"]["layers.1.x"]
    with pytest.raises(rs.TensorNotFoundError, match=r"no tensor named .nothing.$"):
        ckpt["nothing"]


# ------------------------------------------------------------------ numpy-like indexing
def _index(size: int) -> st.SearchStrategy:
    bound = st.none() | st.integers(-size - 2, size + 2)
    steps = st.none() | st.integers(-4, 4).filter(lambda s: s != 0)
    slices = st.builds(slice, bound, bound, steps)
    return st.one_of(st.integers(-size, size - 1), slices) if size else slices


def _array_index(size: int) -> st.SearchStrategy:
    ints = st.lists(st.integers(-size, size - 1), min_size=0, max_size=6) if size else st.just([])
    mask = st.lists(st.booleans(), min_size=size, max_size=size).map(np.array)
    return st.one_of(ints, ints.map(lambda v: np.array(v, dtype=np.int64)), mask)


@st.composite
def keys(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple:
    """A numpy index for ``shape``: basic parts, at most one array, maybe ``...`` and ``None``."""
    n = draw(st.integers(0, len(shape)))
    parts = [draw(_index(size)) for size in shape[:n]]
    if n and draw(st.booleans()):
        i = draw(st.integers(0, n - 1))
        parts[i] = draw(_array_index(shape[i]))
    if draw(st.booleans()):
        parts.insert(draw(st.integers(0, len(parts))), None)
    if n < len(shape) and draw(st.booleans()):
        parts.insert(draw(st.integers(0, len(parts))), Ellipsis)
    return tuple(parts)


def _numpy_or_error(arr: np.ndarray, key: tuple) -> tuple[np.ndarray | None, bool]:
    try:
        return arr[key], False
    except IndexError:
        return None, True


def _check(view_of: object, arr: np.ndarray, key: tuple) -> object:
    """``view_of[key]`` reads as ``arr[key]``; numpy's IndexErrors are ours; the view (or None)."""
    want, numpy_refuses = _numpy_or_error(arr, key)
    try:
        view = view_of[key]  # type: ignore[index]
    except IndexError as e:
        # refused: what numpy refuses too, or what numpy would not index orthogonally
        assert numpy_refuses or "integer array" in str(e), (key, e)
        return None
    assert not numpy_refuses, key
    assert want is not None and view.shape == want.shape  # type: ignore[attr-defined]
    np.testing.assert_array_equal(view.read(), want)  # type: ignore[attr-defined]
    return view


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_indexing_matches_numpy(ckpt: rs.Checkpoint, data: st.DataObject) -> None:
    t = ckpt["model.layers.0.w"]
    key = data.draw(keys(SHAPE), label="key")
    view = _check(t, ARR, key)
    if view is None or not ARR[key].ndim:
        return
    want = ARR[key]
    key2 = data.draw(keys(want.shape), label="key2")  # a view of a view
    again = _check(view, want, key2)
    if again is not None:
        np.testing.assert_array_equal(again.to_dask().compute(), want[key2])  # type: ignore[attr-defined]


def test_indexing_errors_are_index_errors(ckpt: rs.Checkpoint) -> None:
    t = ckpt["model.layers.0.w"]
    for key in [12, -13, (0, 10), (0, 0, 0, 0), ([0, 12],), (..., ...), ([[0, 1]],), (1.5,), ([0.5],)]:
        with pytest.raises(IndexError):
            t[key]
    with pytest.raises(IndexError, match="chain"):
        t[[0, 1], [0, 1]]  # numpy pairs them element-wise: refused rather than guessed
    with pytest.raises(IndexError, match="two steps"):
        t[0, :, [1, 2]]  # numpy moves the array's axis first here
    np.testing.assert_array_equal(t[[0, 1]][:, [0, 1]].read(), ARR[[0, 1]][:, [0, 1]])


def test_sparse_selections_read_only_their_chunks(ckpt: rs.Checkpoint) -> None:
    t = ckpt["model.layers.0.w"]  # chunks of 64 bytes: 16 floats, i.e. 2 rows of 7 along dim 1
    chunk = t.meta.chunk
    assert t.meta.shape[1] // chunk[1] >= 3, chunk
    before = ckpt.stats.snapshot()
    got = t[[0, -1]][:, [0, -1]]
    np.testing.assert_array_equal(got.read(), ARR[[0, -1]][:, [0, -1]])
    delivered = (ckpt.stats - before).bytes_delivered
    item = 4 * 7  # one row of the last dim
    # runs: rows {0} and {11}, columns {0} and {9}, each with its whole chunk at most
    assert delivered <= 2 * 2 * chunk[0] * chunk[1] * item, delivered
    assert delivered < ARR.nbytes / 4
    # and a step reads within its bounds only
    before = ckpt.stats.snapshot()
    np.testing.assert_array_equal(t[2:6, ::-4, 3].read(), ARR[2:6, ::-4, 3])
    assert (ckpt.stats - before).bytes_delivered <= 4 * 10 * 4


def test_bf16_views(ckpt: rs.Checkpoint) -> None:
    e = ckpt["model.embed"]
    want = np.arange(64, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(16, 4)
    np.testing.assert_array_equal(e[::-5, [3, 0]].read(), want[::-5, [3, 0]])
    np.testing.assert_array_equal(np.asarray(e[None, -1, ..., None]), want[None, -1, ..., None])
