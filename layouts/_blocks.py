"""Explicit blocks ``(rank, global_offset, local_shape, replica_id[, local_offset])``: normalised, numbered and
checked to tile (a rank listed in several blocks holds them all: :mod:`._pieces`).

Pure geometry below :mod:`.core` (which checks an explicit layout's blocks), :mod:`.flat` (which checks that
flat ranges tile their blocks) and :mod:`.adapters` (``from_blocks``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from . import _pieces
from .errors import LayoutError, ShapeMismatchError

#: Normalised explicit blocks: ``(rank, global_offset, local_shape, replica_id)``, and a fifth element, the
#: block's offset in the rank's local array, for a rank listed in several blocks.
Explicit = tuple[tuple[Any, ...], ...]


def check_blocks(shape: tuple[int, ...], blocks: Sequence[Sequence[Any]]) -> Explicit:
    """Normalise and validate explicit blocks: replica-0 blocks tile `shape` exactly once.

    Replica ``k > 0`` blocks must repeat a replica-0 region, each id once. A
    rank listed in several blocks gives each its offset in the rank's local
    array (:func:`._pieces.normalise` checks they tile it).
    """
    out = []
    entries: list[_pieces.Entry] = []
    for b in blocks:
        try:
            rank, off, shp, rid, *local = b
            if len(local) > 1:
                raise ValueError
            item = (int(rank), tuple(int(v) for v in off), tuple(int(v) for v in shp), int(rid))
            at = tuple(int(v) for v in local[0]) if local else None
        except (TypeError, ValueError):
            raise LayoutError(f"block {b!r} is not (rank, global_offset, local_shape, replica_id[, "
                              "local_offset])") from None
        _, off, shp, rid = item
        entries.append((*item, at))
        if len(off) != len(shape) or len(shp) != len(shape):
            raise ShapeMismatchError(f"block {b!r} does not have the {len(shape)} dims of shape {list(shape)}")
        if rid < 0 or any(o < 0 or s < 0 or o + s > size for o, s, size in zip(off, shp, shape, strict=True)):
            raise LayoutError(f"block {b!r} lies outside shape {list(shape)} or has a negative value")
        out.append(item)
    if not out:
        raise LayoutError("an explicit layout needs at least one block")
    primary = {(o, s) for _, o, s, rid in out if rid == 0 and all(s)}
    copies: set[tuple[Any, ...]] = set()
    for _, off, shp, rid in out:
        if all(shp) and (off, shp, rid) in copies:
            raise LayoutError(f"two blocks at offset {list(off)} shape {list(shp)} share replica id {rid}")
        copies.add((off, shp, rid))
        if rid and all(shp) and (off, shp) not in primary:
            raise LayoutError(f"block at offset {list(off)} is replica {rid} of no replica-0 block")
    check_tiling(shape, sorted(primary))
    return _pieces.normalise(entries)


def check_tiling(shape: tuple[int, ...], primary: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    if math.prod(shape) == 0:
        return
    cuts = [sorted({0, size} | {o[d] for o, _ in primary} | {o[d] + s[d] for o, s in primary})
            for d, size in enumerate(shape)]
    index = [{v: i for i, v in enumerate(c)} for c in cuts]
    covered: set[tuple[int, ...]] = set()
    for off, shp in primary:
        ranges = [range(index[d][off[d]], index[d][off[d] + shp[d]]) for d in range(len(shape))]
        cells = [()]  # type: list[tuple[int, ...]]
        for r in ranges:
            cells = [(*c, i) for c in cells for i in r]
        for c in cells:
            if c in covered:
                raise LayoutError(f"replica-0 block at offset {list(off)} overlaps another block")
            covered.add(c)
    want = math.prod(len(c) - 1 for c in cuts)
    if len(covered) != want:
        raise LayoutError(f"replica-0 blocks cover {len(covered)} of {want} cells: shape {list(shape)} is not tiled")


def number_replicas(blocks: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
    """Megatron replica ids may be tuples (main replica: all zeros): number them 0, 1, 2... per region."""
    if not any(isinstance(b[3], (tuple, list)) for b in blocks):
        return [tuple(b) for b in blocks]
    same: dict[tuple[Any, ...], list[tuple[tuple[int, ...], int]]] = {}
    for i, (_, off, shp, rid, *_local) in enumerate(blocks):
        key = (tuple(off), tuple(shp))
        rid = tuple(rid) if isinstance(rid, (tuple, list)) else (rid,)
        same.setdefault(key, []).append((rid, i))
    number = {i: n for group in same.values() for n, (_, i) in enumerate(sorted(group))}
    return [(b[0], b[1], b[2], number[i], *b[4:]) for i, b in enumerate(blocks)]
