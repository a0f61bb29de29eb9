"""Every worked example of REFERENCE.md and the seeds, pinned exactly."""

from __future__ import annotations

import numpy as np
import pytest
from reshard.layouts import Block, Layout, intersect, plan

T24 = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])


def values(layout: Layout, data: np.ndarray) -> list[list]:
    return [data[layout.region(r)].tolist() for r in layout.ranks]


def assemble(source: Layout, target: Layout, rank: int, data: np.ndarray) -> np.ndarray:
    out = np.full(target.local_shape(rank), np.nan)
    for p in plan(source, target, rank):
        out[p.dst] = data[p.block.region][p.src]
    return out


# ---------------------------------------------------------------- MindSpore


def test_example_a():
    lay = Layout.from_mindspore([2, 2], [0, 1], (2, 4))
    assert values(lay, T24) == [[[1, 2]], [[5, 6]], [[3, 4]], [[7, 8]]]
    assert [lay.replica_id(r) for r in range(4)] == [0, 0, 0, 0]


def test_example_b():
    data = np.array([[1, 2, 3], [4, 5, 6]])
    lay = Layout.from_mindspore([2, 3], [1, -1], (2, 3))
    assert values(lay, data) == [[[1, 2, 3]]] * 3 + [[[4, 5, 6]]] * 3
    assert [lay.replica_id(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert lay.blocks() == (
        Block((slice(0, 1), slice(0, 3)), (0, 1, 2)),
        Block((slice(1, 2), slice(0, 3)), (3, 4, 5)),
    )


def test_seed000_division_and_redivision():
    four = Layout.from_mindspore([2, 2], [1, 0], (2, 4))
    assert values(four, T24) == [[[1, 2]], [[3, 4]], [[5, 6]], [[7, 8]]]
    two = Layout.from_mindspore([2, 1], [1, 0], (2, 4))
    assert values(two, T24) == [[[1, 2, 3, 4]], [[5, 6, 7, 8]]]
    # integrate: 4 devices -> 1, then redivide: -> [2, 1] on 2 devices
    whole = Layout.single((2, 4))
    assert assemble(four, whole, 0, T24).tolist() == T24.tolist()
    assert assemble(four, two, 0, T24).tolist() == [[1, 2, 3, 4]]
    assert assemble(four, two, 1, T24).tolist() == [[5, 6, 7, 8]]
    assert [len(plan(four, two, r)) for r in (0, 1)] == [2, 2]


D0 = [[0.2567724, -0.07485991, 0.282002, 0.2456022, 0.454939, 0.619168, 0.18964815, 0.45714882],
      [0.25946522, 0.24344791, 0.45677605, 0.3611395, 0.23378398, 0.41439137, 0.5312468, 0.4696194]]
D1 = [[0.2417504, 0.28193963, 0.06713893, 0.21510397, 0.23380603, 0.11424308, 0.0218009, -0.11969765],
      [0.45955992, 0.22664294, 0.01990281, 0.0731914, 0.27125207, 0.27298513, -0.01716102, -0.15327111]]
D2 = [[0.03440702, 0.41419312, 0.24817684, 0.30765256, 0.48516113, 0.24904746, 0.57791173, 0.00955463],
      [0.13458519, 0.6690533, 0.49259356, 0.28319967, 0.25951773, 0.16777472, 0.45696738, 0.24933104]]
D3 = [[0.14152306, 0.5040985, 0.24455397, 0.10907605, 0.11319532, 0.19538902, 0.01208619, 0.40430856],
      [-0.7773164, -0.47611716, -0.6041424, -0.6144473, -0.2651842, -0.31909415, -0.4510405, -0.12860501]]


def test_seed000_moments_integrate_then_load_on_two_devices():
    """The seed's moments: 4 x [2, 8] slices -> [8, 8] -> 2 x [4, 8]."""
    source = Layout.from_mindspore([4], [0, -1], (8, 8))
    target = Layout.from_mindspore([2], [0, -1], (8, 8))
    integrated = np.concatenate([D0, D1, D2, D3])
    for r, d in enumerate([D0, D1, D2, D3]):
        assert integrated[source.region(r)].tolist() == d
    whole = assemble(source, Layout.single((8, 8)), 0, integrated)
    assert whole.tolist() == integrated.tolist()
    assert assemble(source, target, 0, integrated).tolist() == D0 + D1
    assert assemble(source, target, 1, integrated).tolist() == D2 + D3
    assert target.local_shape(0) == (4, 8)


def test_tuple_tensor_map_is_flat_first_listed_outermost():
    lay = Layout.from_mindspore([2, 3], [(1, 0)], (12,))
    # dev dims 1 (size 2, mesh axis 0) outer, 0 (size 3, mesh axis 1) inner
    assert [lay.region(r)[0] for r in range(6)] == [slice(2 * i, 2 * i + 2) for i in range(6)]
    swapped = Layout.from_mindspore([2, 3], [(0, 1)], (12,))
    assert [swapped.region(r)[0].start for r in range(6)] == [0, 4, 8, 2, 6, 10]


def test_stage_offsets_global_ranks():
    lay = Layout.from_mindspore([2, 2], [1, 0], (2, 4), stage=1)
    assert lay.ranks == (4, 5, 6, 7)
    assert T24[lay.region(6)].tolist() == [[5, 6]]


def test_sharded_state_dict_column_parallel():
    # ColumnParallelLinear, tp=4 on 8 ranks: shard (1, 4) -> dev [2, 1, 4], tmap [1, 0]
    lay = Layout.from_sharded_state_dict((1, 4), (16, 32), total_rank=8)
    assert lay.origin is not None
    assert lay.origin["dev_matrix"] == [2, 1, 4] and lay.origin["tensor_map"] == [1, 0]
    for r in range(8):
        assert lay.region(r) == (slice(0, 16), slice(8 * (r % 4), 8 * (r % 4) + 8))
        assert lay.replica_id(r) == r // 4
    exact = Layout.from_sharded_state_dict((4, 1), (16, 32), total_rank=4)
    assert exact.origin is not None and exact.origin["dev_matrix"] == [4, 1]


# --------------------------------------------------------- optimizer sharding


def test_opt_shard_seed003_embedding():
    lay = Layout.from_mindspore([8], [-1, -1], (80, 200), opt_shard_size=-1)
    assert lay.opt_sharded and lay.opt_group_size == 8
    assert [lay.region(r)[0] for r in range(8)] == [slice(10 * r, 10 * r + 10) for r in range(8)]
    assert all(lay.local_shape(r) == (10, 200) for r in range(8))
    assert {lay.replica_id(r) for r in range(8)} == {0}
    assert lay.describe() == "dev[8] tmap[-1,-1] opt8"


def test_opt_shard_group_is_the_replicas_of_the_slice():
    # dev [2, 4], dim 1 split by device dim 0 (mesh axis 1): group of rank 1 = {1, 5}
    lay = Layout.from_mindspore([2, 4], [-1, 0], (8, 8), opt_shard_size=-1)
    assert lay.region(1) == (slice(0, 4), slice(2, 4))
    assert lay.region(5) == (slice(4, 8), slice(2, 4))
    assert lay.opt_group_size == 2


def test_opt_shard_size_cuts_group_into_chunks():
    lay = Layout.from_mindspore([4, 2], [-1, 0], (8, 8), opt_shard_size=2)
    # group of rank 0 = {0, 2, 4, 6} -> chunks {0, 2}, {4, 6}
    assert lay.region(0) == (slice(0, 4), slice(0, 4))
    assert lay.region(2) == (slice(4, 8), slice(0, 4))
    assert lay.region(4) == (slice(0, 4), slice(0, 4))
    assert [lay.replica_id(r) for r in (0, 2, 4, 6)] == [0, 0, 1, 1]
    assert lay.blocks()[0] == Block((slice(0, 4), slice(0, 4)), (0, 4))
    assert lay.describe() == "dev[4,2] tmap[-1,0] opt2"
    # larger than the group: the whole group
    big = Layout.from_mindspore([4, 2], [-1, 0], (8, 8), opt_shard_size=8)
    assert big.opt_group_size == 4 and big.local_shape(0) == (2, 4)


def test_opt_group_order_is_global_rank_order():
    lay = Layout((8,), (4,), ranks=(3, 1, 2, 0), dims=((),), opt_shard=-1)
    assert [lay.region(r)[0] for r in range(4)] == [slice(2 * r, 2 * r + 2) for r in range(4)]
    chunks = Layout((8,), (4,), ranks=(3, 1, 2, 0), dims=((),), opt_shard=2)
    assert [chunks.replica_id(r) for r in range(4)] == [0, 0, 1, 1]
    assert chunks.blocks()[0].ranks == (0, 2)


@pytest.mark.parametrize(
    ("dev", "tmap", "shape", "size"),
    [
        ([4], [-1, -1], (6, 4), -1),  # dim 0 (6) not divisible by the group (4)
        ([4], [0, -1], (8, 4), -1),  # group of 1: nothing to shard
        ([4], [], (), -1),  # 0-d
        ([4], [-1], (12,), 3),  # shard size 3 does not divide the group of 4
    ],
)
def test_opt_shard_fallback(dev, tmap, shape, size):
    lay = Layout.from_mindspore(dev, tmap, shape, opt_shard_size=size)
    plain = Layout.from_mindspore(dev, tmap, shape)
    assert lay.opt_shard == size and not lay.opt_sharded
    assert [lay.region(r) for r in lay.ranks] == [plain.region(r) for r in plain.ranks]
    assert lay.blocks() == plain.blocks()
    assert "opt" not in lay.describe()


# ------------------------------------------------------------------- OneFlow


def test_balanced_splitter_values():
    twenty = Layout.from_oneflow(list(range(6)), "S(0)", (20,))
    assert [twenty.region(r)[0] for r in range(6)] == [
        slice(0, 4), slice(4, 8), slice(8, 11), slice(11, 14), slice(14, 17), slice(17, 20)
    ]
    two = Layout.from_oneflow([0, 1, 2], "split(0)", (2,))
    assert [two.region(r)[0] for r in range(3)] == [slice(0, 1), slice(1, 2), slice(2, 2)]
    assert len(two.blocks()) == 2 and two.local_shape(2) == (0,)
    assert two.replica_id(2) >= 0
    assert not twenty.is_regular()


def test_oneflow_2d_example():
    lay = Layout.from_oneflow([[0, 1], [2, 3]], ("split(0)", "split(1)"), (4, 6))
    for r in range(4):
        assert lay.region(r) == (slice(2 * (r // 2), 2 * (r // 2) + 2), slice(3 * (r % 2), 3 * (r % 2) + 3))
    assert lay.is_regular()


def test_oneflow_nested_differs_from_flat():
    nested = Layout.from_oneflow([[0, 1], [2, 3]], ("S(0)", "S(0)"), (6,))
    assert [nested.region(r)[0] for r in range(4)] == [slice(0, 2), slice(2, 3), slice(3, 5), slice(5, 6)]
    flat = Layout((6,), (2, 2), dims=((0, 1),), split="balanced")
    assert [flat.region(r)[0] for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 6)]


def test_oneflow_broadcast_and_placement_ranks():
    lay = Layout.from_oneflow([[4, 5], [6, 7]], ("B", "S(1)"), (2, 4))
    assert lay.ranks == (4, 5, 6, 7)
    assert lay.region(6) == (slice(0, 2), slice(0, 2))
    assert [lay.replica_id(r) for r in (4, 5, 6, 7)] == [0, 0, 1, 1]


# --------------------------------------------------------- DTensor and JAX


def test_dtensor_torch_chunk():
    lay = Layout.from_dtensor(4, ["Shard(0)"], (5, 3))
    assert [lay.region(r)[0] for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 5)]
    assert lay.is_regular() and lay.boundaries(0) == (0, 2, 4, 5)


def test_dtensor_nested_shards():
    lay = Layout.from_dtensor((2, 2), ("S(0)", "S(0)"), (5,))
    assert [lay.region(r)[0] for r in range(4)] == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5)]
    flat = Layout((5,), (2, 2), dims=((0, 1),), split="ceil")
    assert [flat.region(r)[0] for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 5)]
    mixed = Layout.from_dtensor((2, 3), ("Replicate()", "Shard(dim=1)"), (4, 9), ranks=range(10, 16))
    assert mixed.region(14) == (slice(0, 4), slice(3, 6)) and mixed.replica_id(14) == 1


def test_jax_named_sharding():
    lay = Layout.from_jax({"x": 2, "y": 4}, ["y", None], (8, 6))
    assert lay.region(5) == (slice(2, 4), slice(0, 6)) and lay.replica_id(5) == 1
    multi = Layout.from_jax([("x", 2), ("y", 4)], [("y", "x")], (16, 3))
    # y outer, x inner: rank at coords (x=1, y=2) -> piece 2 * 2 + 1 = 5
    assert multi.region(1 * 4 + 2) == (slice(10, 12), slice(0, 3))
    assert Layout.from_jax({"x": 2}, [], (3,)).region(1) == (slice(0, 3),)


# -------------------------------------------------------------- Megatron


def test_megatron_blocks():
    blocks = [(0, (0, 0), (2, 4), 0), (1, (2, 0), (2, 4), 0), (2, (0, 0), (2, 4), 1), (3, (2, 0), (2, 4), 1)]
    lay = Layout.from_megatron((4, 4), blocks)
    assert lay.region(3) == (slice(2, 4), slice(0, 4)) and lay.replica_id(3) == 1
    assert lay.blocks() == (
        Block((slice(0, 2), slice(0, 4)), (0, 2)),
        Block((slice(2, 4), slice(0, 4)), (1, 3)),
    )
    assert lay.is_regular() and lay.describe() == "blocks[4] explicit"


def test_irregular_explicit_plan():
    blocks = [(0, (0, 0), (2, 4), 0), (1, (2, 0), (2, 1), 0), (2, (2, 1), (2, 3), 0)]
    source = Layout.from_blocks((4, 4), blocks)
    assert not source.is_regular() and source.boundaries(1) == (0, 1, 4)
    data = np.arange(16.0).reshape(4, 4)
    target = Layout.from_dtensor(2, ["S(1)"], (4, 4))
    for r in (0, 1):
        assert assemble(source, target, r, data).tolist() == data[target.region(r)].tolist()


# ---------------------------------------------------------------- the rest


def test_single_and_scalar():
    lay = Layout.single((3, 2), rank=7)
    assert lay.region(7) == (slice(0, 3), slice(0, 2)) and lay.size == 1 and lay.ndim == 2
    scalar = Layout.from_mindspore([4], [], ())
    assert scalar.region(2) == () and scalar.replica_id(2) == 2
    (piece,) = plan(scalar, Layout.single(()), 0)
    assert piece.region == () and piece.block.ranks == (0, 1, 2, 3)


def test_describe_and_repr():
    assert Layout.from_mindspore([2, 4], [-1, 0], (8, 8)).describe() == "dev[2,4] tmap[-1,0]"
    assert Layout.from_mindspore([2, 2], [(1, 0), -1], (8, 8)).describe() == "dev[2,2] tmap[(1,0),-1]"
    lay = Layout((8, 6), (2, 4), dims=((0,), ()), split="ceil")
    assert lay.describe() == "mesh[2,4] dims[0,-] ceil"
    assert Layout.from_dtensor((2, 2), ("S(0)", "S(0)"), (5,)).describe() == "mesh[2,2] dims[0.1] ceil nested"
    assert "ranks=0..7" in repr(lay)


def test_intersect_and_plan_records():
    a = (slice(0, 4), slice(2, 6))
    assert intersect(a, (slice(2, 8), slice(0, 3))) == (slice(2, 4), slice(2, 3))
    assert intersect(a, (slice(4, 8), slice(0, 3))) is None
    source = Layout.from_mindspore([2], [0, -1], (4, 4))
    target = Layout.from_mindspore([2], [-1, 0], (4, 4))
    pieces = plan(source, target, 1)
    assert [p.region for p in pieces] == [(slice(0, 2), slice(2, 4)), (slice(2, 4), slice(2, 4))]
    assert [p.src for p in pieces] == [(slice(0, 2), slice(2, 4))] * 2
    assert [p.dst for p in pieces] == [(slice(0, 2), slice(0, 2)), (slice(2, 4), slice(0, 2))]
    assert "src=[0:2, 2:4]" in repr(pieces[0])


def test_boundaries_and_regularity():
    lay = Layout.from_mindspore([2, 4], [1, 0], (8, 12), opt_shard_size=None)
    assert lay.boundaries(0) == (0, 4, 8) and lay.boundaries(1) == (0, 3, 6, 9, 12)
    assert lay.is_regular()
    uneven = Layout((10,), (3,), dims=((0,),), split="ceil")  # 4, 4, 2
    assert uneven.is_regular()
    balanced = Layout((10,), (3,), dims=((0,),), split="balanced")  # 4, 3, 3
    assert not balanced.is_regular() and balanced.boundaries(0) == (0, 4, 7, 10)


def test_many_ranks_are_fast():
    import time

    t = time.perf_counter()
    source = Layout.from_mindspore([4, 8, 16], [2, 1], (4096, 4096), opt_shard_size=-1)
    target = Layout.from_dtensor((7, 8), ("S(0)", "S(1)"), (4096, 4096))
    for r in range(512):
        source.region(r)
        source.replica_id(r)
    pieces = [plan(source, target, r) for r in range(56)]
    assert time.perf_counter() - t < 2.0
    assert all(pieces)


def test_megatron_tuple_replica_ids():
    blocks = [(0, (0, 0), (2, 4), (0, 0, 1)), (1, (2, 0), (2, 4), (0, 0, 0)),
              (2, (0, 0), (2, 4), (0, 0, 0)), (3, (2, 0), (2, 4), (0, 1, 0))]
    lay = Layout.from_megatron((4, 4), blocks)
    assert [lay.replica_id(r) for r in range(4)] == [1, 0, 0, 1]
    assert [b.writer for b in lay.blocks()] == [2, 1]


def test_pickle_drops_cached_tables():
    import pickle

    lay = Layout.from_mindspore([2, 4], [1, -1], (8, 6), opt_shard_size=2)
    lay.region(0)
    back = pickle.loads(pickle.dumps(lay))
    assert back == lay and back.origin == lay.origin and back.region(3) == lay.region(3)
    assert hash(back) == hash(lay)
