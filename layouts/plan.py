"""Read plans: which source blocks fill one target rank's array.

``plan(source, target, rank)`` is pure: it lists :class:`Piece` records that
copy ``block[src]`` into ``local[dst]`` (``piece.target(local)[...] =
piece.source(block_or_holder_local)``: flat-range layouts, :mod:`.flat`, keep
a rank's boxes in one 1-d array, and the piece says where). Source layouts whose blocks form a
grid (every layout except irregular explicit ones) are searched per dim with
``bisect`` on the block boundaries, so the cost is the number of pieces, not
the number of blocks.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from functools import lru_cache

from .core import Layout
from .errors import ShapeMismatchError
from .flat import FlatLayout
from .records import Block, Piece, intersect

__all__ = ["Piece", "intersect", "plan"]


@dataclass(frozen=True)
class _Grid:
    cuts: tuple[tuple[int, ...], ...]  # per dim: sorted boundaries
    cells: dict[tuple[int, ...], Block] | None  # grid index -> block; None if not a grid


@lru_cache(maxsize=4096)
def _grid(layout: Layout) -> _Grid:
    blocks = layout.blocks()
    cuts = tuple(
        tuple(sorted({b.region[d].start for b in blocks} | {b.region[d].stop for b in blocks}))
        for d in range(layout.ndim)
    )
    where = [{v: i for i, v in enumerate(c)} for c in cuts]
    cells: dict[tuple[int, ...], Block] | None = {}
    for b in blocks:
        key = []
        for d, s in enumerate(b.region):
            i = where[d][s.start]
            if where[d][s.stop] != i + 1:
                cells = None
                break
            key.append(i)
        if cells is None:
            break
        cells[tuple(key)] = b
    if cells is not None and len(cells) != len(blocks):
        cells = None
    return _Grid(cuts, cells)


def _candidates(source: Layout, want: tuple[slice, ...]) -> list[Block]:
    grid = _grid(source)
    if grid.cells is None:
        return list(source.blocks())
    spans = []
    for c, s in zip(grid.cuts, want, strict=True):
        lo = max(bisect_right(c, s.start) - 1, 0)
        hi = min(bisect_left(c, s.stop), len(c) - 1)
        spans.append(range(lo, hi))
    out = []
    for key in itertools.product(*spans):
        b = grid.cells.get(key)
        if b is not None:
            out.append(b)
    return out


def plan(source: Layout, target: Layout, rank: int) -> tuple[Piece, ...]:
    """Pieces of `source`'s blocks that fill `target.region(rank)`.

    Parameters
    ----------
    source : Layout
        Layout the data was saved with.
    target : Layout
        Layout to load into.
    rank : int
        A rank of `target`.

    Returns
    -------
    tuple of Piece
        In C order of the source blocks; together their ``dst`` regions cover
        the rank's local array exactly once (empty for an empty region). For a
        flat-range target, box by box in flat order, ``dst`` relative to the box
        (``dst_box``); for a flat-range source, ``src_at`` places the block in its
        holders' arrays. :meth:`Piece.source` and :meth:`Piece.target` apply both.
        A rank holding several blocks (:meth:`Layout.pieces`): a target's
        ``dst`` is relative to its whole local array; a source's ``src`` to the
        local array of the block's writer (replica 0), where the block sits at
        its local offset.

    Raises
    ------
    ShapeMismatchError
        If the global shapes differ.
    RankError
        If `rank` is not in `target`.
    """
    if source.shape != target.shape:
        raise ShapeMismatchError(
            f"source shape {list(source.shape)} differs from target shape {list(target.shape)}"
        )
    if isinstance(target, FlatLayout):
        return tuple(p for at, box in target.boxes(rank)
                     for p in _pieces(source, box, (at, tuple(s.stop - s.start for s in box))))
    if target.multi_piece:
        return tuple(p for want, local in target.pieces(rank)
                     for p in _pieces(source, want, None, tuple(s.start for s in local)))
    return _pieces(source, target.region(rank), None)


def _local_at(source: Layout, block: Block) -> tuple[int, ...] | None:
    """Where `block` sits in its writer's local array, for a source whose ranks may hold several blocks."""
    if not source.multi_piece:
        return None
    for region, local in source.pieces(block.writer):
        if region == block.region:
            return tuple(s.start for s in local)
    return None  # pragma: no cover (every block is a piece of its writer)


def _pieces(source: Layout, want: tuple[slice, ...], box: tuple[int, tuple[int, ...]] | None,
            at: tuple[int, ...] | None = None) -> tuple[Piece, ...]:
    if any(s.start >= s.stop for s in want):
        return ()
    flat = source if isinstance(source, FlatLayout) else None
    at = at or (0,) * len(want)
    pieces = []
    for block in _candidates(source, want):
        region = intersect(block.region, want)
        if region is None:
            continue
        shift = _local_at(source, block) or (0,) * len(want)
        src = tuple(slice(r.start - b.start + k, r.stop - b.start + k)
                    for r, b, k in zip(region, block.region, shift, strict=True))
        dst = tuple(slice(r.start - w.start + k, r.stop - w.start + k)
                    for r, w, k in zip(region, want, at, strict=True))
        pieces.append(Piece(block, src, dst, region, flat.offset_of(block) if flat is not None else None, box))
    return tuple(pieces)
