"""Flattened-range layouts (reshard.layouts.flat, .flatbuf): property tests against numpy."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reshard.layouts import FlatBuffer, FlatLayout, Layout, LayoutError, plan, range_boxes
from reshard.layouts.errors import FormatError, RankError, UnsupportedError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


def cuts(draw, numel: int, k: int) -> list[int]:
    """k + 1 sorted cut points of [0, numel] (ranges may be empty)."""
    inner = sorted(draw(st.lists(st.integers(0, numel), min_size=k - 1, max_size=k - 1)))
    return [0, *inner, numel]


@st.composite
def flat_layouts(draw, shape=None, blocks: bool = True):
    """A flat layout over a random shape: optionally a tiling into (TP-local) blocks along one dim, each block's
    flattening cut into ranges, some ranges replicated; rank ids shuffled."""
    shape = draw(shapes) if shape is None else shape
    ndim = len(shape)
    tiles = [((0,) * ndim, shape)]
    if blocks and ndim and shape[0] > 1 and draw(st.booleans()):
        k = draw(st.integers(2, min(3, shape[0])))
        c = sorted(set(draw(st.lists(st.integers(1, shape[0] - 1), min_size=k - 1, max_size=k - 1))))
        edges = [0, *c, shape[0]]
        tiles = [((a, *(0,) * (ndim - 1)), (b - a, *shape[1:])) for a, b in itertools.pairwise(edges)]
    entries = []
    for off, block in tiles:
        k = draw(st.integers(1, 4))
        c = cuts(draw, math.prod(block), k)
        copies = draw(st.integers(1, 2))
        for rid in range(copies):
            for a, b in itertools.pairwise(c):
                entries.append((off, block, a, b, rid))
    ranks = draw(st.permutations(range(len(entries))))
    return FlatLayout.from_ranges(shape, [(r, off, block, a, b, rid)
                                          for r, (off, block, a, b, rid) in zip(ranks, entries, strict=True)])


@st.composite
def block_layouts(draw, shape):
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    owner = [draw(st.integers(-1, len(shape) - 1)) if shape else -1 for _ in mesh]
    dims = tuple(tuple(a for a in range(len(mesh)) if owner[a] == d) for d in range(len(shape)))
    split = draw(st.sampled_from(["ceil", "balanced"]))
    return Layout(shape, mesh, dims=dims, split=split)


def flat_local(lay: FlatLayout, rank: int, full: np.ndarray) -> np.ndarray:
    """A rank's local array from first principles: its block's C-order flattening, sliced."""
    start, stop = lay.flat_range(rank)
    return full[lay.block_of(rank)].reshape(-1)[start:stop]


def local_of(lay: Layout, rank: int, full: np.ndarray) -> np.ndarray:
    if isinstance(lay, FlatLayout):
        return flat_local(lay, rank, full)
    return full[lay.region(rank)]


# ------------------------------------------------------------------ range_boxes


@SETTINGS
@given(shape=shapes, data=st.data())
def test_range_boxes_are_the_flat_range(shape, data):
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    boxes = range_boxes(shape, start, stop)
    full = np.arange(numel).reshape(shape)
    got = [full[tuple(slice(lo, hi) for lo, hi in box)].reshape(-1) for box in boxes]
    flat = np.concatenate(got) if got else np.arange(0)
    assert flat.tolist() == list(range(start, stop))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    assert all(hi > lo for box in boxes for lo, hi in box)  # no empty box


def test_range_boxes_worst_case_and_errors():
    assert len(range_boxes((4, 4, 4), 5, 59)) == 5  # 2 * ndim - 1
    assert range_boxes((), 0, 1) == ((),)
    with pytest.raises(LayoutError, match="outside"):
        range_boxes((2, 3), 2, 7)


# ------------------------------------------------------------------ FlatLayout


@SETTINGS
@given(lay=flat_layouts())
def test_flat_layout_facts_against_numpy(lay):
    full = np.arange(math.prod(lay.shape)).reshape(lay.shape)
    count = np.zeros(lay.shape, dtype=int)
    for block in lay.blocks():
        count[block.region] += 1
        for r in block.ranks:  # every holder's local array holds the block at offset_of
            local = flat_local(lay, r, full)
            at = lay.offset_of(block)
            assert (local[at:at + math.prod(block.shape)].reshape(block.shape) == full[block.region]).all()
    assert (count == 1).all()  # replica-0 boxes tile the tensor once
    for r in lay.ranks:
        local = flat_local(lay, r, full)
        assert lay.local_shape(r) == local.shape
        got = [full[region].reshape(-1) for _, region in lay.boxes(r)]
        assert (np.concatenate(got) if got else np.arange(0)).tolist() == local.tolist()
        assert [at for at, _ in lay.boxes(r)] == list(np.cumsum([0] + [g.size for g in got])[:-1])
        with pytest.raises(UnsupportedError):
            lay.region(r)
    for point in np.ndindex(*lay.shape):
        holders = lay.holders(point)
        for r in holders:
            assert any(all(s.start <= x < s.stop for s, x in zip(region, point, strict=True))
                       for _, region in lay.boxes(r))
        assert lay.replica_id(holders[0]) == 0 and lay.owner(point) == holders[0]
    for d in range(lay.ndim):
        b = lay.boundaries(d)
        assert b[0] == 0 and b[-1] == lay.shape[d] and list(b) == sorted(set(b))
    assert Layout.from_json(lay.to_json()) == lay
    assert Layout.from_json(json.loads(lay.to_json_text())) == lay


@SETTINGS
@given(shape=shapes.filter(lambda s: len(s) >= 1), data=st.data())
def test_plan_block_to_flat_and_back(shape, data):
    full = np.random.default_rng(0).standard_normal(shape)
    flat = data.draw(flat_layouts(shape=shape))
    block = data.draw(block_layouts(shape))
    for source, target in ((block, flat), (flat, block), (flat, data.draw(flat_layouts(shape=shape)))):
        for r in target.ranks:
            out = np.full(target.local_shape(r), np.nan)
            for p in plan(source, target, r):
                holder = p.block.ranks[data.draw(st.integers(0, len(p.block.ranks) - 1))]
                src = local_of(source, holder, full) if p.src_at is not None else full[p.block.region]
                p.target(out)[...] = p.source(src)
            assert np.array_equal(out, local_of(target, r, full))  # every element filled, and right


def test_even_single_and_megatron():
    lay = FlatLayout.even((5, 3), [4, 7, 9])  # 15 elements in ranges of 5
    assert [lay.flat_range(r) for r in lay.ranks] == [(0, 5), (5, 10), (10, 15)]
    assert FlatLayout.even((2,), 4).flat_range(3) == (2, 2)
    one = FlatLayout.single((2, 2), 3)
    assert one.local_shape(3) == (4,) and one.is_regular()
    rows = FlatLayout.from_ranges((4, 3), [(0, 0, 6), (1, 6, 12)])  # whole rows: a regular row split
    assert rows.is_regular() and rows.boundaries(0) == (0, 2, 4)
    tp = FlatLayout.from_megatron((4, 2), [(0, (0, 0), (2, 2), 0, 3, 0), (1, (0, 0), (2, 2), 3, 4, 0),
                                           (2, (2, 0), (2, 2), 0, 4, 0)])
    assert tp.describe() == "flat[3] blocks[2]" and tp.origin == {"framework": "megatron", "flattened_range": True}
    assert tp.holders((3, 1)) == (2,) and tp.holders((1, 1)) == (1,)
    with pytest.raises(RankError):
        tp.boxes(5)


@pytest.mark.parametrize("ranges, match", [
    ([(0, 0, 4), (1, 5, 6)], "gap"),
    ([(0, 0, 4), (1, 3, 6)], "overlap"),
    ([(0, 0, 4)], "end at 4"),
    ([(0, 0, 6), (1, 0, 3, 1)], "replica 1 of no"),
    ([(0, 0, 6), (1, 0, 6, 1), (2, 0, 6, 1)], "share replica id"),
    ([(0, 0, 7)], "not within"),
    ([(0, 0, 6), (0, 0, 6, 1)], "more than once"),
    ([(0, (0, 0), (1, 3), 0, 3, 0)], "cover"),
    ([(0, 1, 2, 3, 4)], "must be"),
])
def test_bad_flat_layouts(ranges, match):
    with pytest.raises(LayoutError, match=match):
        FlatLayout.from_ranges((2, 3), ranges)


def test_even_layouts_have_a_short_json_form():
    for lay in (FlatLayout.even((1000, 7), 64), FlatLayout.even((5,), [9, 3, 4]), FlatLayout.even((2,), 4)):
        doc = lay.to_json()
        assert "even" in doc and "ranges" not in doc and len(lay.to_json_text()) < 120
        assert Layout.from_json(doc) == lay and Layout.from_json(lay.to_json_text()) == lay
    odd = FlatLayout.from_ranges((6,), [(0, 0, 3), (1, 3, 6)])
    assert "even" in odd.to_json()  # the even cut, however it was built
    uneven = FlatLayout.from_ranges((6,), [(0, 0, 4), (1, 4, 6)])
    assert "ranges" in uneven.to_json() and Layout.from_json(uneven.to_json()) == uneven


@pytest.mark.parametrize("doc, match", [
    ({"version": 1, "kind": "flat", "shape": [2], "even": []}, "1 to"),
    ({"version": 1, "kind": "flat", "shape": [2], "even": {"range": [3, 1]}}, "range"),
    ({"version": 1, "kind": "flat", "shape": [2], "even": [0], "ranges": [[0, 0, 2, 0]]}, "both"),
    ({"version": 1, "kind": "flat", "shape": [2], "even": [0, 0]}, "impossible"),
    ({"version": 1, "kind": "flat", "shape": [1] * 65, "even": [0]}, "65 dims"),
    ({"version": 1, "kind": "flat", "shape": [2], "ranges": []}, "non-empty"),
    ({"version": 1, "kind": "flat", "shape": [2], "ranges": [[0, 0, 2]]}, "must be"),
    ({"version": 1, "kind": "flat", "shape": [2], "ranges": [[0, 0, 1, 0]]}, "impossible"),
    ({"version": 1, "kind": "flat", "shape": [2], "ranges": [[0, 0, True, 0]]}, "list of ints"),
    ({"version": 1, "kind": "cube", "shape": [2], "ranges": [[0, 0, 2, 0]]}, "kind"),
    ({"version": 1, "kind": "flat", "shape": [2], "ranges": [[0, 0, 2, 0]], "mesh": [1]}, "unknown"),
])
def test_bad_flat_json(doc, match):
    with pytest.raises(FormatError, match=match):
        Layout.from_json(doc)


# ------------------------------------------------------------------ FlatBuffer


def ref_partitions(shapes, n, align, pad_to):
    """Index arrays of each rank's buffer: tensor t's element e is the number t * 1000 + e, padding -1."""
    buf: list[int] = []
    for t, s in enumerate(shapes):
        buf += [-1] * (-len(buf) % align)
        buf += [t * 1000 + e for e in range(math.prod(s))]
    buf += [-1] * (-len(buf) % pad_to)
    step = -(-len(buf) // n)
    buf += [-1] * (step * n - len(buf))
    return [np.array(buf[i * step:(i + 1) * step]) for i in range(n)]


def ref_per_tensor(shapes, n):
    out: list[list[int]] = [[] for _ in range(n)]
    for t, s in enumerate(shapes):
        numel = math.prod(s)
        step = -(-numel // n)
        for i in range(n):
            piece = [t * 1000 + e for e in range(i * step, min((i + 1) * step, numel))]
            out[i] += piece + [-1] * (step - len(piece))
    return [np.array(o) for o in out]


@SETTINGS
@given(shapes=st.lists(shapes.filter(lambda s: math.prod(s) < 200), min_size=1, max_size=5),
       n=st.integers(1, 5), align=st.sampled_from([1, 2, 8]), pad=st.sampled_from([1, 2, 4]), zero3=st.booleans())
def test_flat_buffers_against_numpy(shapes, n, align, pad, zero3):
    ranks = [10 + i for i in range(n)]
    if zero3:
        buf, ref = FlatBuffer.per_tensor(shapes, ranks), ref_per_tensor(shapes, n)
    else:
        buf, ref = FlatBuffer.partitioned(shapes, ranks, align=align, pad_to=pad), ref_partitions(shapes, n, align, pad)
    for part, want in zip(buf.parts, ref, strict=True):
        assert part.size == len(want)
        got = np.full(part.size, -1)
        for off, t, start, stop in part.segments:
            got[off:off + stop - start] = t * 1000 + np.arange(start, stop)
        assert (got == want).all()
    for t, s in enumerate(shapes):
        lay = buf.layout(t)
        full = t * 1000 + np.arange(math.prod(s)).reshape(s)
        for r in lay.ranks:
            (seg,) = [g for g in buf.part(r).segments if g[1] == t] or [(0, t, 0, 0)]
            assert (flat_local(lay, r, full) == ref[ranks.index(r)][seg[0]:seg[0] + seg[3] - seg[2]]).all()
    assert FlatBuffer.from_json(json.loads(json.dumps(buf.to_json()))) == buf


def test_hsdp_replicas_and_bad_buffers():
    buf = FlatBuffer.partitioned([(3, 2), (4,)], [(0, 2), (1, 3)])
    lay = buf.layout(0)
    assert lay.holders((0, 0)) == (0, 2) and lay.replica_id(2) == 1
    with pytest.raises(LayoutError, match="repeat"):
        FlatBuffer.partitioned([(2,)], [0, 0])
    with pytest.raises(FormatError):
        FlatBuffer.from_json({"shapes": [[2]], "parts": [[0, 1, 0, [[0, 0, 0, 2]]]]})
    with pytest.raises(LayoutError, match="tensor 3"):
        buf.layout(3)
