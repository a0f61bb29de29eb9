"""Layouts giving a rank several blocks (Megatron's GLU ``linear_fc1`` halves, GPT-2's fused q/k/v)."""

from __future__ import annotations

import numpy as np
import pytest
from reshard.layouts import FormatError, Layout, LayoutError, plan


def glu(f: int, h: int, tp: int, dp: int = 1) -> Layout:
    """[2F, H] rows [gate; up]: tp rank t holds gate[t] then up[t]; dp replicas (rank = d * tp + t)."""
    step = f // tp
    return Layout.from_blocks((2 * f, h), [(d * tp + t, (j * f + t * step, 0), (step, h), d, (j * step, 0))
                                            for d in range(dp) for t in range(tp) for j in range(2)])


def qkv_conv1d(h: int, tp: int) -> Layout:
    """GPT-2 c_attn [H, 3H] columns [q; k; v]: tp rank t holds the t-th slice of each, side by side."""
    step = h // tp
    return Layout.from_blocks((h, 3 * h), [(t, (0, j * h + t * step), (h, step), 0, (0, j * step))
                                           for t in range(tp) for j in range(3)])


def megatron_glu_local(full: np.ndarray, tp: int, t: int) -> np.ndarray:
    gate, up = np.split(full, 2, axis=0)
    return np.concatenate([np.split(gate, tp, axis=0)[t], np.split(up, tp, axis=0)[t]], axis=0)


def test_pieces_local_shape_and_blocks():
    lay = glu(8, 3, 2, dp=2)
    assert lay.multi_piece and lay.ranks == (0, 1, 2, 3) and lay.mesh == (4,)
    assert lay.local_shape(1) == (8, 3)
    assert lay.pieces(1) == (((slice(4, 8), slice(0, 3)), (slice(0, 4), slice(0, 3))),
                             ((slice(12, 16), slice(0, 3)), (slice(4, 8), slice(0, 3))))
    assert [b.ranks for b in lay.blocks()] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert lay.is_regular() and lay.block_shape() == (4, 3) and lay.boundaries(0) == (0, 4, 8, 12, 16)
    assert lay.replica_id(3) == 1 and lay.holders((13, 0)) == (1, 3) and lay.owner((9, 2)) == 0
    assert "pieces[2]" in lay.describe()
    one = Layout((8, 3), (2,), dims=((0,), ()))
    assert not one.multi_piece and one.pieces(1) == ((one.region(1), (slice(0, 4), slice(0, 3))),)


def test_region_refused_for_a_rank_with_several_blocks():
    with pytest.raises(LayoutError, match=r"rank 0 holds 2 blocks .*Layout.pieces\(rank\)"):
        glu(4, 2, 2).region(0)


def test_json_round_trip_and_old_json_still_reads():
    for lay in (glu(8, 3, 2, dp=2), qkv_conv1d(4, 2)):
        again = Layout.from_json(lay.to_json_text())
        assert again == lay and again.pieces(1) == lay.pieces(1) and hash(again) == hash(lay)
    old = {"version": 1, "shape": [4], "mesh": [2], "ranks": [0, 1], "dims": [[]], "split": "even",
           "nested": False, "opt_shard": None, "explicit": [[0, [0], [2], 0], [1, [2], [2], 0]], "origin": None}
    lay = Layout.from_json(old)
    assert lay.region(1) == (slice(2, 4),) and lay.to_json()["explicit"] == old["explicit"]


@pytest.mark.parametrize(("tp", "t"), [(2, 0), (2, 1), (4, 3)])
def test_plan_fills_megatron_local_arrays_and_back(tp: int, t: int):
    full = np.arange(16 * 6).reshape(16, 6)
    lay = glu(8, 6, tp)
    local = np.zeros(lay.local_shape(t), full.dtype)
    for p in plan(Layout.single(full.shape), lay, t):
        p.target(local)[...] = p.source(full)
    np.testing.assert_array_equal(local, megatron_glu_local(full, tp, t))
    locals_ = {r: megatron_glu_local(full, tp, r) for r in range(tp)}
    back = np.zeros_like(full)  # a multi-piece source read into a column split
    col = Layout(full.shape, (3,), dims=((), (0,)))
    for r in col.ranks:
        for p in plan(lay, col, r):
            p.target(back[col.region(r)])[...] = p.source(locals_[p.block.writer])
    np.testing.assert_array_equal(back, full)


def test_fused_qkv_columns():
    full = np.arange(4 * 12).reshape(4, 12)
    lay = qkv_conv1d(4, 2)
    for t in range(2):
        local = np.zeros(lay.local_shape(t), full.dtype)
        for p in plan(Layout.single(full.shape), lay, t):
            p.target(local)[...] = p.source(full)
        want = np.concatenate([np.split(part, 2, axis=1)[t] for part in np.split(full, 3, axis=1)], axis=1)
        np.testing.assert_array_equal(local, want)


@pytest.mark.parametrize(("blocks", "match"), [
    ([(0, (0,), (2,), 0, (0,)), (0, (2,), (2,), 0, (1,))], r"rank 0's blocks at offsets \[0\] and \[2\] overlap"),
    ([(0, (0,), (2,), 0, (0,)), (0, (2,), (2,), 0, (3,))], r"cover 4 of the 5 elements .* leave a gap"),
    ([(0, (0,), (2,), 0), (0, (2,), (2,), 0, (2,))], r"gives no local offset"),
    ([(0, (0,), (2,), 0, (0,)), (0, (2,), (2,), 1, (2,)), (1, (2,), (2,), 0)], r"different replica ids \[0, 1\]"),
    ([(0, (0,), (4,), 0, (1,))], r"only block .* local offset \[1\]"),
    ([(0, (0,), (2,), 0, (0,)), (0, (2,), (2,), 0, (-2,))], r"local offset \[-2\]"),
    ([(0, (0,), (2,), 0, (0, 0)), (0, (2,), (2,), 0, (2,))], r"local offset \[0, 0\]: want 1 ints"),
])
def test_hostile_pieces_refused(blocks, match):
    with pytest.raises(LayoutError, match=match):
        Layout.from_blocks((4,), blocks)
    text = {"version": 1, "shape": [4], "mesh": [len({b[0] for b in blocks})],
            "ranks": list(dict.fromkeys(b[0] for b in blocks)), "dims": [[]], "explicit":
            [[b[0], list(b[1]), list(b[2]), b[3], *([list(b[4])] if len(b) > 4 else [])] for b in blocks]}
    with pytest.raises(FormatError, match=match):
        Layout.from_json(text)


def test_hostile_json_shapes():
    bad = {"version": 1, "shape": [4], "mesh": [1], "ranks": [0], "dims": [[]],
           "explicit": [[0, [0], [4], 0, [0], 7]]}
    with pytest.raises(FormatError, match=r"local_offset\]"):
        Layout.from_json(bad)
    bad["explicit"] = [[0, [0], [4], 0, "x"]]
    with pytest.raises(FormatError, match=r"'local_offset' must be a list of ints"):
        Layout.from_json(bad)
