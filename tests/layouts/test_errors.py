"""Validation: every bad layout raises a clear error naming the bad value."""

from __future__ import annotations

import pytest
from reshard.layouts import FormatError, Layout, LayoutError, RankError, ShapeMismatchError, plan


def test_even_split_not_dividing_names_dim_size_and_k():
    with pytest.raises(LayoutError, match=r"dim 1 of size 7 .* 4 pieces"):
        Layout.from_mindspore([4], [-1, 0], (8, 7))


def test_tensor_map_naming_a_missing_device_dim():
    with pytest.raises(LayoutError, match=r"device dim 2.*dev_matrix \[2, 2\]"):
        Layout.from_mindspore([2, 2], [2, -1], (4, 4))


def test_mesh_axis_used_twice():
    with pytest.raises(LayoutError, match=r"mesh axis 0 splits both dim 0 and dim 1"):
        Layout((4, 4), (2,), dims=((0,), (0,)))
    with pytest.raises(LayoutError, match=r"mesh axis 'x'"):
        Layout.from_jax({"x": 2}, ["x", "x"], (4, 4))


def test_dims_length_mismatch_names_both():
    with pytest.raises(ShapeMismatchError, match=r"2 entries .* shape \[4\]"):
        Layout((4,), (2,), dims=((0,), ()))
    with pytest.raises(ShapeMismatchError, match=r"tensor_map \[0\] .* shape \[4, 4\]"):
        Layout.from_mindspore([2], [0], (4, 4))


def test_ranks_length_and_duplicates():
    with pytest.raises(LayoutError, match=r"4 positions but 3 ranks"):
        Layout((4,), (2, 2), ranks=(0, 1, 2))
    with pytest.raises(LayoutError, match=r"ranks \[1\] appear more than once"):
        Layout((4,), (2, 2), ranks=(0, 1, 1, 3))


def test_rank_not_in_mesh():
    lay = Layout.from_mindspore([2, 2], [1, 0], (2, 4), stage=1)
    with pytest.raises(RankError, match=r"rank 3 is not in the layout's ranks 4..7"):
        lay.region(3)
    with pytest.raises(RankError, match="rank 9"):
        lay.replica_id(9)


def test_partial_refused():
    with pytest.raises(LayoutError, match=r"partial_sum.*cannot be saved"):
        Layout.from_oneflow([0, 1], "P", (4,))
    with pytest.raises(LayoutError, match=r"Partial.*cannot be saved"):
        Layout.from_dtensor(2, ["Partial(sum)"], (4,))


def test_negative_sizes():
    with pytest.raises(LayoutError, match=r"shape \[4, -1\] holds -1"):
        Layout((4, -1), (1,))
    with pytest.raises(LayoutError, match=r"mesh \[2, 0\] holds 0"):
        Layout((4,), (2, 0))


def test_other_bad_values():
    with pytest.raises(LayoutError, match="split 'round'"):
        Layout((4,), (2,), split="round")
    with pytest.raises(LayoutError, match="opt_shard -3"):
        Layout((4,), (2,), opt_shard=-3)
    with pytest.raises(LayoutError, match="dim 0 names mesh axis 3"):
        Layout((4,), (2,), dims=((3,),))
    with pytest.raises(LayoutError, match="unknown DTensor placement 'Foo'"):
        Layout.from_dtensor(2, ["Foo"], (4,))
    with pytest.raises(LayoutError, match=r"splits dim 2 of a 1-d tensor"):
        Layout.from_oneflow([0, 1], "S(2)", (4,))
    with pytest.raises(LayoutError, match=r"mesh axis 'z'"):
        Layout.from_jax({"x": 2}, ["z"], (4,))
    with pytest.raises(LayoutError, match=r"sbp .* 1 entries for a 2-d mesh"):
        Layout.from_oneflow([[0, 1], [2, 3]], "S(0)", (4,))
    with pytest.raises(LayoutError, match=r"ragged"):
        Layout.from_oneflow([[0, 1], [2]], ("S(0)", "B"), (4,))
    with pytest.raises(LayoutError, match=r"shard \[3, 1\] requires 3 devices"):
        Layout.from_sharded_state_dict((3, 1), (6, 4), total_rank=8)


def test_explicit_blocks_must_tile():
    with pytest.raises(LayoutError, match="overlaps"):
        Layout.from_blocks((4,), [(0, (0,), (3,), 0), (1, (2,), (2,), 0)])
    with pytest.raises(LayoutError, match="not tiled"):
        Layout.from_blocks((4,), [(0, (0,), (2,), 0)])
    with pytest.raises(LayoutError, match="outside shape"):
        Layout.from_blocks((4,), [(0, (0,), (5,), 0)])
    with pytest.raises(LayoutError, match="replica 1 of no replica-0 block"):
        Layout.from_blocks((4,), [(0, (0,), (4,), 0), (1, (0,), (2,), 1)])
    with pytest.raises(LayoutError, match="share replica id 0"):
        Layout.from_blocks((4,), [(0, (0,), (4,), 0), (1, (0,), (4,), 0)])


def test_plan_shape_mismatch_names_both():
    with pytest.raises(ShapeMismatchError, match=r"\[4, 4\] .* \[4, 5\]"):
        plan(Layout.single((4, 4)), Layout.single((4, 5)), 0)


@pytest.mark.parametrize(
    "bad",
    [
        [],
        "not json",
        {"version": 2, "shape": [4], "mesh": [1]},
        {"version": 1, "shape": "4", "mesh": [1]},
        {"version": 1, "shape": [4], "mesh": [2], "dims": [[0]], "split": "even", "bogus": 1},
        {"version": 1, "shape": [5], "mesh": [2], "dims": [[0]], "split": "even"},
        {"version": 1, "shape": [4], "mesh": [1], "explicit": [[0, [0], 4, 0]]},
    ],
)
def test_from_json_garbage(bad):
    with pytest.raises(FormatError):
        Layout.from_json(bad)
