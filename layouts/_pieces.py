"""Ranks that hold several blocks of one tensor ("pieces"): the math behind :meth:`Layout.pieces`.

Megatron-Core gives tensor-parallel rank ``t`` of a SwiGLU ``linear_fc1``
(``[gate; up]`` rows, ``[2F, H]``) the rows ``gate[t]`` and ``up[t]``, one
after the other, as its local ``[2F / tp, H]``; of GPT-2's ``c_attn``
(Conv1D ``[H, 3H]``, columns ``[q; k; v]``) the ``t``-th slice of each. An
explicit block may then name a fifth element, its offset in the rank's local
array: ``(rank, global_offset, local_shape, replica_id, local_offset)``. A
rank listed in several blocks holds all of them; its local array is the box
their local offsets tile exactly once (no overlap, no gap), and its pieces
share one replica id. A rank listed once holds its block at local offset 0.

Pure geometry below :mod:`._blocks` (which normalises the blocks) and
:mod:`._table` (which answers per rank).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .errors import LayoutError

Region = tuple[slice, ...]
#: One rank's part: ``(global region, region of its local array)`` per piece, in block order.
Pieces = tuple[tuple[Region, Region], ...]
#: A block as :func:`._blocks.check_blocks` reads it: ``(rank, offset, shape, replica_id, local_offset or None)``.
Entry = tuple[int, tuple[int, ...], tuple[int, ...], int, "tuple[int, ...] | None"]


def _fmt(values: Sequence[int]) -> str:
    return str(list(values))


def normalise(entries: Sequence[Entry]) -> tuple[tuple[Any, ...], ...]:
    """Explicit blocks with local offsets checked: a 4-tuple for a rank's only block, 5-tuples for several.

    Raises
    ------
    LayoutError
        A rank listed once whose block does not sit at local offset 0; a rank
        listed several times with a block lacking its local offset, an empty
        block, replica ids that differ, or local offsets whose blocks overlap
        or leave a gap in its local array.
    """
    by_rank: dict[int, list[Entry]] = {}
    for e in entries:
        by_rank.setdefault(e[0], []).append(e)
    out: list[tuple[Any, ...]] = []
    for rank, off, shp, rid, local in entries:
        mine = by_rank[rank]
        if local is not None and len(local) != len(off):
            raise LayoutError(f"rank {rank}'s block at offset {_fmt(off)} has local offset {_fmt(local)}: want "
                              f"{len(off)} ints")
        if len(mine) == 1:
            if local is not None and any(local):
                raise LayoutError(f"rank {rank}'s only block (offset {_fmt(off)}) has local offset {_fmt(local)}: "
                                  "its local array is that block, at local offset 0")
            out.append((rank, off, shp, rid))
            continue
        if mine[0][:4] == (rank, off, shp, rid):  # checked once per rank, at its first block
            check_rank(rank, mine)
        out.append((rank, off, shp, rid, local))
    return tuple(out)


def check_rank(rank: int, mine: Sequence[Entry]) -> tuple[int, ...]:
    """Check the blocks of a rank listed several times; return the shape of its local array."""
    ids = sorted({e[3] for e in mine})
    if len(ids) > 1:
        raise LayoutError(f"rank {rank} holds {len(mine)} blocks with different replica ids {ids}: a rank's "
                          "blocks share one replica id")
    boxes = []
    for _, off, shp, _, local in mine:
        if local is None:
            raise LayoutError(f"rank {rank} is listed in {len(mine)} blocks but its block at offset {_fmt(off)} "
                              "gives no local offset (the fifth element: where it sits in the rank's local array)")
        if len(local) != len(shp) or min(local, default=0) < 0:
            raise LayoutError(f"rank {rank}'s block at offset {_fmt(off)} has local offset {_fmt(local)}: want "
                              f"{len(shp)} non-negative ints")
        if not all(shp):
            raise LayoutError(f"rank {rank}'s block at offset {_fmt(off)} is empty ({_fmt(shp)}): a rank "
                              "holding several blocks holds non-empty ones")
        boxes.append((local, shp, off))
    shape = tuple(max(lo[d] + s[d] for lo, s, _ in boxes) for d in range(len(boxes[0][1])))
    for i, (a, sa, oa) in enumerate(boxes):
        for b, sb, ob in boxes[:i]:
            if all(x < y + m and y < x + n for x, n, y, m in zip(a, sa, b, sb, strict=True)):
                raise LayoutError(f"rank {rank}'s blocks at offsets {_fmt(ob)} and {_fmt(oa)} overlap in its local "
                                  f"array (local offsets {_fmt(b)} and {_fmt(a)})")
    covered = sum(math.prod(s) for _, s, _ in boxes)
    if covered != math.prod(shape):
        raise LayoutError(f"rank {rank}'s {len(boxes)} blocks cover {covered} of the {math.prod(shape)} elements of "
                          f"its local array {_fmt(shape)}: their local offsets leave a gap")
    return shape


def rank_table(explicit: Sequence[tuple[Any, ...]]
               ) -> tuple[dict[int, int], list[Pieces], list[tuple[int, ...]], list[int]]:
    """Per rank (in order of first appearance): its position, pieces, local shape and replica id."""
    index: dict[int, int] = {}
    pieces: list[list[tuple[Region, Region]]] = []
    replica: list[int] = []
    for b in explicit:
        rank, off, shp, rid = b[:4]
        local = b[4] if len(b) > 4 else (0,) * len(off)
        p = index.get(rank)
        if p is None:
            p = index[rank] = len(pieces)
            pieces.append([])
            replica.append(rid)
        pieces[p].append((tuple(slice(o, o + n) for o, n in zip(off, shp, strict=True)),
                          tuple(slice(o, o + n) for o, n in zip(local, shp, strict=True))))
    shapes = [tuple(max((loc[d].stop for _, loc in mine), default=0) for d in range(len(mine[0][1])))
              for mine in pieces]
    return index, [tuple(m) for m in pieces], shapes, replica


__all__ = ["Pieces", "check_rank", "normalise", "rank_table"]
