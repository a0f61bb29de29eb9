"""Property tests: random meshes, shapes, splits; each rule checked against an independent reference."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reshard.layouts import Layout, LayoutError, plan
from reshard.layouts.errors import RankError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------- independent references


def ref_pieces(n: int, k: int, split: str) -> list[np.ndarray]:
    """The k index arrays a dim of n elements is cut into, one framework rule each."""
    idx = np.arange(n)
    if split == "balanced":  # OneFlow BalancedSplitter == np.array_split
        return np.array_split(idx, k)
    if split == "ceil":  # torch.chunk, padded with empty chunks as DTensor does
        size = -(-n // k) if n else 0
        chunks = [idx[i : i + size] for i in range(0, n, size)] if size else []
        return chunks + [idx[:0]] * (k - len(chunks))
    return list(idx.reshape(k, n // k))  # even: reshape


def ref_dim(n: int, axes, mesh, coords, split: str, nested: bool) -> np.ndarray:
    idx = np.arange(n)
    if nested:  # each axis cuts what the previous ones left (OneFlow, DTensor)
        for a in axes:
            idx = idx[ref_pieces(len(idx), mesh[a], split)[coords[a]]] if len(idx) else idx
        return idx
    k = math.prod(mesh[a] for a in axes)  # one cut, combined index (MindSpore, JAX)
    flat = int(np.ravel_multi_index([coords[a] for a in axes], [mesh[a] for a in axes])) if axes else 0
    return idx[ref_pieces(n, k, split)[flat]] if axes else idx


def ref_indices(lay: Layout) -> dict[int, list[np.ndarray]]:
    """Per rank, the global indices of each dim, from first principles (incl. optimizer sharding)."""
    coords = {r: tuple(int(c) for c in np.unravel_index(p, lay.mesh)) for p, r in enumerate(lay.ranks)}
    out = {
        r: [
            ref_dim(n, axes, lay.mesh, coords[r], lay.split, lay.nested)
            for n, axes in zip(lay.shape, lay.dims, strict=True)
        ]
        for r in lay.ranks
    }
    if lay.opt_shard is None or not lay.shape:
        return out
    used = [a for axes in lay.dims for a in axes]
    groups = {r: sorted(q for q in lay.ranks if all(coords[q][a] == coords[r][a] for a in used)) for r in lay.ranks}
    size = len(next(iter(groups.values())))
    s = size if lay.opt_shard == -1 or lay.opt_shard >= size else lay.opt_shard
    if s <= 1 or size % s or any(len(out[r][0]) % s for r in lay.ranks):
        return out
    for r in lay.ranks:
        pos = groups[r].index(r) % s
        out[r][0] = np.split(out[r][0], s)[pos]
    return out


# ------------------------------------------------------------------ strategies


@st.composite
def layouts(draw, shape=None, split=None):
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    ndim = len(shape) if shape is not None else draw(st.integers(0, 3))
    owner = [draw(st.integers(-1, ndim - 1)) if ndim else -1 for _ in mesh]
    dims = [[a for a in range(len(mesh)) if owner[a] == d] for d in range(ndim)]
    dims = [tuple(draw(st.permutations(axes))) if axes else () for axes in dims]
    split = split or draw(st.sampled_from(["even", "ceil", "balanced"]))
    if shape is None:
        shape = []
        for axes in dims:
            k = math.prod(mesh[a] for a in axes)
            many = draw(st.sampled_from([0, 1, 2, 3, 4, 6, 12]))  # often divisible by opt groups
            shape.append(k * many if split == "even" else draw(st.one_of(st.integers(0, 9), st.just(k * many))))
    n = math.prod(mesh)
    offset = draw(st.integers(0, 50))
    ranks = [offset + p for p in range(n)]
    if draw(st.booleans()):
        ranks = draw(st.permutations(ranks))
    opt = draw(st.sampled_from([None, None, -1, 2, 3]))
    try:
        return Layout(tuple(shape), mesh, tuple(ranks), tuple(dims), split, draw(st.booleans()), opt)
    except LayoutError:  # an even split that does not divide this shape
        return Layout(tuple(shape), mesh, tuple(ranks), tuple(dims), "balanced", draw(st.booleans()), opt)


@st.composite
def pairs(draw):
    source = draw(layouts())
    target = draw(layouts(shape=source.shape))
    if draw(st.booleans()):  # the same layout written as explicit (Megatron) blocks
        source = Layout.from_blocks(
            source.shape,
            [
                (r, [s.start for s in source.region(r)], source.local_shape(r), source.replica_id(r))
                for r in source.ranks
            ],
        )
    return source, target


# ---------------------------------------------------------------- properties


@SETTINGS
@given(layouts())
def test_region_matches_reference(lay):
    ref = ref_indices(lay)
    data = np.arange(math.prod(lay.shape)).reshape(lay.shape)
    for r in lay.ranks:
        got = data[lay.region(r)]
        want = data[np.ix_(*ref[r])] if lay.shape else data
        assert got.shape == want.shape and (got == want).all(), (r, lay.region(r), ref[r])
        assert lay.local_shape(r) == got.shape
        assert all(s.step is None for s in lay.region(r))


@SETTINGS
@given(layouts())
def test_writers_tile_exactly_once_and_blocks_agree(lay):
    count = np.zeros(lay.shape, dtype=int)
    for b in lay.blocks():
        count[b.region] += 1
        assert [lay.replica_id(r) for r in b.ranks] == list(range(len(b.ranks)))
        assert all(lay.region(r) == b.region for r in b.ranks)
    assert (count == 1).all()
    writers = np.zeros(lay.shape, dtype=int)
    for r in lay.ranks:
        if lay.replica_id(r) == 0 and all(s.stop > s.start for s in lay.region(r)):
            writers[lay.region(r)] += 1
    assert (writers == 1).all()
    starts = [tuple(s.start for s in b.region) for b in lay.blocks()]
    assert starts == sorted(starts)
    assert sum(len(b.ranks) for b in lay.blocks()) <= lay.size


@SETTINGS
@given(pairs(), st.data())
def test_plan_reassembles(pair, data):
    source, target = pair
    glob = np.random.default_rng(0).standard_normal(source.shape)
    for rank in data.draw(st.lists(st.sampled_from(target.ranks), min_size=1, max_size=4, unique=True)):
        out = np.full(target.local_shape(rank), np.nan)
        filled = np.zeros(target.local_shape(rank), dtype=int)
        for p in plan(source, target, rank):
            block = glob[p.block.region]
            out[p.dst] = block[p.src]
            filled[p.dst] += 1
            assert glob[p.region].shape == block[p.src].shape
        assert (filled == 1).all()
        assert np.array_equal(out, glob[target.region(rank)])


@SETTINGS
@given(pairs())
def test_json_round_trip(pair):
    for lay in pair:
        obj = lay.to_json()
        text = json.dumps(obj)
        back = Layout.from_json(json.loads(text))
        assert back == lay and hash(back) == hash(lay)
        assert back.blocks() == lay.blocks()


@SETTINGS
@given(layouts())
def test_regular_means_grid(lay):
    blocks = lay.blocks()
    if lay.is_regular() and blocks:
        cell = blocks[0].shape
        for b in blocks:
            for s, c, n in zip(b.region, cell, lay.shape, strict=True):
                assert s.start % c == 0 and s.stop == min(s.start + c, n)
    for d in range(lay.ndim):
        cuts = lay.boundaries(d)
        assert cuts[0] == 0 and cuts[-1] == lay.shape[d] and list(cuts) == sorted(set(cuts))


@SETTINGS
@given(layouts())
def test_boundaries_and_regularity_match_the_blocks(lay):
    """The per-dim shortcut for mesh layouts agrees with the definition over every block."""
    blocks = lay.blocks()
    for d in range(lay.ndim):
        want = {0, lay.shape[d]} | {x for b in blocks for x in (b.region[d].start, b.region[d].stop)}
        assert lay.boundaries(d) == tuple(sorted(want))
    if blocks:
        cell = blocks[0].shape
        grid = [(*range(0, n, c), n) for n, c in zip(lay.shape, cell, strict=True)]
        count = math.prod(len(g) - 1 for g in grid)
        regular = all(lay.boundaries(d) == g for d, g in enumerate(grid)) and len(blocks) == count
    else:
        regular = True
    assert lay.is_regular() == regular


@SETTINGS
@given(layouts(), st.randoms(use_true_random=False))
def test_owner_is_the_writer_of_the_block(lay, rnd):
    """owner(point) is the replica-0 holder of the one block that holds the point."""
    for b in lay.blocks():
        writer = [r for r in b.ranks if lay.replica_id(r) == 0]
        assert len(writer) == 1
        corner = tuple(s.start for s in b.region)
        inside = tuple(rnd.randrange(s.start, s.stop) for s in b.region)
        assert lay.owner(corner) == writer[0] == lay.owner(inside)
    with pytest.raises(LayoutError):
        lay.owner(tuple(lay.shape) if lay.ndim else (0,))


@SETTINGS
@given(st.lists(st.integers(0, 9), max_size=4), st.integers(0, 2000))
def test_single_is_the_checked_constructor_and_answers_quickly_alike(shape, rank):
    """Layout.single builds its fields directly and whole one-rank layouts answer without the block table:
    the same layout, JSON and answers as the checked constructor's."""
    fast, checked = Layout.single(shape, rank), Layout(tuple(shape), (1,), (rank,))
    assert fast == checked and hash(fast) == hash(checked) and fast.to_json() == checked.to_json()
    fields = [f for f in vars(checked) if not f.startswith("_")]
    assert [getattr(fast, f) for f in fields] == [getattr(checked, f) for f in fields]
    want = tuple(slice(lo, hi) for lo, hi in checked._info.bounds(checked._pos(rank)))
    assert fast.region(rank) == want and fast.local_shape(rank) == tuple(s.stop - s.start for s in want)
    with pytest.raises(RankError):
        fast.region(rank + 1)
    if all(shape):
        assert fast.owner(tuple(n - 1 for n in shape)) == rank
    with pytest.raises(LayoutError):
        Layout.single([-1, *shape])
