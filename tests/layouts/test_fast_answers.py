"""The O(ndim) answers of mesh layouts equal the block-table answers, and build no table over the ranks.

A mesh layout answers ``region``, ``local_shape``, ``replica_id``, ``owner``,
``holders``, ``is_regular``, ``boundaries`` and ``block_shape`` by integer math
on its mesh coordinates (:mod:`reshard.layouts._geometry`). The references here
are the per-placement table and the block list of :mod:`reshard.layouts._table`
(what every answer was computed from before), on random meshes, placements,
shapes (ceil and balanced splits with empty pieces, nested splits, optimizer
sharding) and rank lists (runs, permutations, scattered ids).
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reshard.layouts import Layout, LayoutError, _geometry, _table
from reshard.layouts._split import piece
from reshard.layouts.errors import RankError

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def mesh_layouts(draw):
    mesh = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    ndim = draw(st.integers(0, 3))
    owner = [draw(st.integers(-1, ndim - 1)) if ndim else -1 for _ in mesh]
    dims = tuple(tuple(draw(st.permutations([a for a in range(len(mesh)) if owner[a] == d]))) for d in range(ndim))
    split = draw(st.sampled_from(["even", "ceil", "balanced"]))
    shape = []
    for axes in dims:
        k = math.prod(mesh[a] for a in axes)
        many = draw(st.sampled_from([0, 1, 2, 3, 4, 6, 12]))
        shape.append(k * many if split == "even" else draw(st.one_of(st.integers(0, 30), st.just(k * many))))
    n = math.prod(mesh)
    kind = draw(st.sampled_from(["default", "run", "permuted", "scattered"]))
    ranks: tuple[int, ...] = ()
    if kind == "run":
        ranks = tuple(range(7, 7 + n))
    elif kind == "permuted":
        ranks = tuple(draw(st.permutations(range(n))))
    elif kind == "scattered":
        ranks = tuple(draw(st.lists(st.integers(0, 10 * n + 10), min_size=n, max_size=n, unique=True)))
    opt = draw(st.sampled_from([None, None, -1, 1, 2, 3, 4]))
    return Layout(tuple(shape), mesh, ranks, dims, split, draw(st.booleans()), opt)


@st.composite
def framework_layouts(draw):
    """Layouts as the adapters build them (DTensor, JAX, MindSpore with optimizer sharding, OneFlow)."""
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    ndim = draw(st.integers(1, 3))
    which = draw(st.sampled_from(["dtensor", "jax", "mindspore", "oneflow"]))
    split_dims = [draw(st.one_of(st.none(), st.integers(0, ndim - 1))) for _ in mesh]
    if which in ("dtensor", "oneflow"):
        shape = tuple(draw(st.integers(0, 25)) for _ in range(ndim))
        names = [f"S({d})" if d is not None else ("R" if which == "dtensor" else "B") for d in split_dims]
        if which == "dtensor":
            return Layout.from_dtensor(mesh, names, shape)
        ranks = list(range(math.prod(mesh)))
        nested: object = ranks
        for size in reversed(mesh[1:]):
            nested = [nested[i : i + size] for i in range(0, len(nested), size)]  # type: ignore[index]
        return Layout.from_oneflow(nested, names, shape)
    per = [math.prod(mesh[a] for a in range(len(mesh)) if split_dims[a] == d) for d in range(ndim)]
    shape = tuple(k * draw(st.integers(0, 5)) for k in per)
    if which == "jax":
        axes = [(f"a{i}", s) for i, s in enumerate(mesh)]
        spec = [tuple(f"a{a}" for a in range(len(mesh)) if split_dims[a] == d) or None for d in range(ndim)]
        return Layout.from_jax(axes, spec, shape)
    tmap = []
    for d in range(ndim):
        axes = [len(mesh) - 1 - a for a in range(len(mesh)) if split_dims[a] == d]
        tmap.append(-1 if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return Layout.from_mindspore(mesh, tmap, shape, opt_shard_size=draw(st.sampled_from([0, -1, 2, 4])))


def table_answers(lay: Layout):
    """Every answer, from the per-placement table and the block list (the reference)."""
    info = _table.GridInfo(lay)
    blocks = info.blocks()
    regions = {r: tuple(slice(lo, hi) for lo, hi in info.bounds(p)) for p, r in enumerate(lay.ranks)}
    replicas = {r: info.replica(p) for p, r in enumerate(lay.ranks)}
    bounds = []
    for d, size in enumerate(lay.shape):
        found = {0, size} | {x for b in blocks for x in (b.region[d].start, b.region[d].stop)}
        bounds.append(tuple(sorted(found)))
    if blocks:
        cell = blocks[0].shape
        grid = [(*range(0, n, c), n) for n, c in zip(lay.shape, cell, strict=True)]
        regular = tuple(bounds) == tuple(grid) and len(blocks) == math.prod(len(g) - 1 for g in grid)
    else:
        cell, regular = tuple(lay.shape), True
    return blocks, regions, replicas, tuple(bounds), regular, cell, info.opt


def check_against_table(lay: Layout, rnd) -> None:
    blocks, regions, replicas, bounds, regular, cell, opt = table_answers(lay)
    for r in lay.ranks:
        assert lay.has_rank(r)
        assert lay.region(r) == regions[r], (r, lay)
        assert lay.local_shape(r) == tuple(s.stop - s.start for s in regions[r])
        assert lay.replica_id(r) == replicas[r], (r, lay)
    assert not lay.has_rank(max(lay.ranks) + 1) and not lay.has_rank(-1) and not lay.has_rank("0")
    with pytest.raises(RankError):
        lay.region(max(lay.ranks) + 1)
    for b in blocks:
        corner = tuple(s.start for s in b.region)
        inside = tuple(rnd.randrange(s.start, s.stop) for s in b.region)
        last = tuple(s.stop - 1 for s in b.region)
        for point in (corner, inside, last):
            assert lay.holders(point) == b.ranks, (point, lay)
            assert lay.owner(point) == b.ranks[0]
    assert tuple(lay.boundaries(d) for d in range(lay.ndim)) == bounds
    assert lay.is_regular() == regular
    if regular:
        assert lay.block_shape() == cell
    assert lay.opt_sharded == (opt > 0) and lay.opt_group_size == max(opt, 1)
    with pytest.raises(LayoutError):
        lay.holders(tuple(lay.shape) if lay.ndim else (0,))


@SETTINGS
@given(mesh_layouts(), st.randoms(use_true_random=False))
def test_mesh_layouts_answer_as_the_table_does(lay, rnd):
    check_against_table(lay, rnd)


@SETTINGS
@given(framework_layouts(), st.randoms(use_true_random=False))
def test_framework_layouts_answer_as_the_table_does(lay, rnd):
    check_against_table(lay, rnd)


def brute_pieces(size: int, levels) -> list[tuple[int, int]]:
    spans = [(0, size)]
    for parts, split in levels:
        spans = [(lo + s, lo + e) for lo, hi in spans for s, e in (piece(hi - lo, parts, i, split)
                                                                    for i in range(parts))]
    return spans


levels_st = st.lists(st.tuples(st.integers(1, 6), st.sampled_from(["ceil", "balanced"])), max_size=3)


@SETTINGS
@given(st.integers(0, 80), levels_st)
def test_signature_cuts_and_locate_agree_with_every_piece(size, levels):
    """The summary of a dim's pieces (from a few distinct extents) equals what listing them all gives."""
    levels = tuple(levels)
    every = brute_pieces(size, levels)
    pieces = [p for p in every if p[1] > p[0]]
    sig = _geometry.signature(size, levels)
    if not pieces:
        assert sig is None and _geometry.cuts(size, levels) == ((0, size) if size else (0,))
        return
    sizes = [hi - lo for lo, hi in pieces]
    assert (sig.pieces, sig.first, sig.last, set(sig.sizes)) == (len(pieces), sizes[0], sizes[-1], set(sizes))
    assert sig.regular == (all(s == sizes[0] for s in sizes[:-1]) and sizes[-1] <= sizes[0])
    assert _geometry.cuts(size, levels) == tuple(sorted({0, size, *(x for p in pieces for x in p)}))
    index = list(itertools.product(*(range(parts) for parts, _ in levels)))
    assert [_geometry.piece_at(size, levels, i) for i in index] == every
    for x in range(size):
        lo, hi = _geometry.piece_at(size, levels, _geometry.locate(size, levels, x))
        assert lo <= x < hi


@pytest.mark.parametrize("make", [
    lambda: Layout.from_dtensor(4096, ["Shard(0)"], (8192, 8)),
    lambda: Layout.from_dtensor((32, 128), ["Replicate()", "Shard(0)"], (1000, 8)),
    lambda: Layout.from_dtensor((64, 64), ["Shard(0)", "Shard(0)"], (10_000, 3)),
    lambda: Layout.from_jax({"data": 512, "model": 8}, ["data", "model"], (4096, 64)),
    lambda: Layout.from_mindspore([512, 8], [1, 0], (4096, 64), opt_shard_size=-1),
    lambda: Layout.from_mindspore([64, 8, 8], [1, -1], (4096, 64), opt_shard_size=4),
    lambda: Layout.from_oneflow([list(range(i * 64, i * 64 + 64)) for i in range(64)], ["S(0)", "B"], (1001, 8)),
], ids=["dtensor", "hsdp", "nested", "jax", "mindspore-opt", "mindspore-opt4", "oneflow"])
def test_answers_build_no_table_over_the_ranks(make):
    """4,096 ranks: every per-rank and per-point question is answered without the per-placement table."""
    lay = make()
    before = _table.mesh_info.cache_info().currsize
    for r in (0, 1, 2047, 4095):
        lay.region(r), lay.local_shape(r), lay.replica_id(r), lay.coords(r)
        assert lay.has_rank(r)
    lay.is_regular(), lay.block_shape(), lay.opt_sharded
    point = tuple(n - 1 for n in lay.shape)
    lay.owner(point), lay.holders(point), lay.owner((0,) * lay.ndim)
    if lay.is_regular():
        lay.boundaries(0)
    again = Layout.from_json(lay.to_json())
    assert again.ranks is lay.ranks  # one checked rank list shared, not 4,096 ints per layout
    again.region(7), again.holders(point)
    assert "_info" not in vars(lay) and "_info" not in vars(again)
    assert _table.mesh_info.cache_info().currsize == before


def test_ranks_are_checked_once_and_shared():
    a = Layout.from_dtensor(4096, ["Shard(0)"], (8192, 8))
    b = Layout.from_dtensor(4096, ["Shard(0)"], (4096, 2))
    assert a.ranks is b.ranks
    given = tuple(range(4096, 0, -1))
    c, d = Layout((8,), (4096,), given), Layout((8,), (4096,), list(given))
    assert c.ranks is d.ranks and c.ranks == given
    with pytest.raises(LayoutError, match="more than once"):
        Layout((8,), (4096,), (1, *range(1, 4096)))
    with pytest.raises(LayoutError, match="below the minimum"):
        Layout((8,), (4096,), (-1, *range(1, 4096)))
    with pytest.raises(LayoutError, match="sequence of ints"):
        Layout((8,), (2,), ("a", "b"))


def test_all_ranks_reads_each_list_once_and_misses_none():
    from reshard.layouts import all_ranks

    many = [Layout.from_dtensor(64, ["Shard(0)"], (128, i + 1)) for i in range(50)]
    other = [Layout.from_jax({"x": 4}, ["x"], (8,), ranks=[100, 90, 80, 70]), Layout.single((3,), 7)]
    assert all_ranks(many + other) == set(range(64)) | {100, 90, 80, 70, 7}
    assert all_ranks([]) == set()
