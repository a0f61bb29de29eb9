"""Flattened-range layouts: each rank holds ``[start, stop)`` of the row-major flattening of a block.

Megatron-Core's distributed optimizer gives each data-parallel rank a
``flattened_range`` of every (tensor-parallel local) parameter; DeepSpeed ZeRO
and FSDP1 ``FlatParameter`` partition the concatenation of many parameters
(:mod:`.flatbuf` turns such a buffer into one :class:`FlatLayout` per tensor).

A rank's local array is one-dimensional, ``stop - start`` elements. Its part of
the tensor is a small set of boxes (:func:`range_boxes`: at most ``2 * ndim - 1``),
each a contiguous run of the local array, so the rest of reshard sees a flat
layout through its boxes: :meth:`FlatLayout.blocks` are the boxes with their
holders, :meth:`FlatLayout.boxes` one rank's boxes with their offsets in its
local array, and :func:`reshard.layouts.plan` reads between flat and block
layouts both ways. ``region(rank)`` is refused: no single box describes a range.

Pure math, no I/O, no framework import.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from . import jsonform
from ._blocks import check_tiling
from .core import Layout
from .errors import LayoutError, RankError, ShapeMismatchError, UnsupportedError
from .records import Block

#: One rank's range: ``(rank, block offset, block shape, start, stop, replica id)``; the block is the
#: (tensor-parallel local) part of the tensor whose row-major flattening the range indexes.
FlatRange = tuple[int, tuple[int, ...], tuple[int, ...], int, int, int]
Bounds = tuple[tuple[int, int], ...]


def range_boxes(shape: Sequence[int], start: int, stop: int) -> tuple[Bounds, ...]:
    """The boxes of a row-major flat range ``[start, stop)`` of an array of ``shape``, in flat order.

    Each box is ``((lo, hi), ...)`` per dim; concatenated in the order given,
    their C-order elements are exactly the range. At most ``2 * ndim - 1`` boxes
    (one for a 0-d array): a partial run at each level on the way in, one
    slab of whole rows, a partial run at each level on the way out.

    Raises
    ------
    LayoutError
        If the range does not lie within ``[0, prod(shape)]``.
    """
    shape = tuple(int(n) for n in shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise LayoutError(f"flat range [{start}, {stop}) lies outside the {math.prod(shape)} elements of "
                          f"shape {list(shape)}")
    out: list[Bounds] = []
    _boxes(shape, start, stop, (), out)
    return tuple(out)


def _boxes(shape: tuple[int, ...], a: int, b: int, prefix: Bounds, out: list[Bounds]) -> None:
    if a >= b:
        return
    if not shape:
        out.append(prefix)
        return
    inner = math.prod(shape[1:])  # > 0: the range is not empty
    (i0, r0), (i1, r1) = divmod(a, inner), divmod(b, inner)
    if i0 == i1:
        _boxes(shape[1:], r0, r1, (*prefix, (i0, i0 + 1)), out)
        return
    if r0:
        _boxes(shape[1:], r0, inner, (*prefix, (i0, i0 + 1)), out)
        i0 += 1
    if i1 > i0:
        out.append((*prefix, (i0, i1), *((0, n) for n in shape[1:])))
    if r1:
        _boxes(shape[1:], 0, r1, (*prefix, (i1, i1 + 1)), out)


def _ints(value: Any, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise LayoutError(f"{what} must be a sequence of ints, got {value!r}") from None
    if any(v < 0 for v in out):
        raise LayoutError(f"{what} {list(out)} holds a negative value")
    return out


def _normalise(shape: tuple[int, ...], entry: Any) -> FlatRange:
    """One range as given (``(rank, start, stop[, replica])`` over the whole tensor, or the six fields)."""
    try:
        items = tuple(entry)
    except TypeError:
        raise LayoutError(f"flat range {entry!r} is not a sequence") from None
    if len(items) in (3, 4):
        rank, start, stop, *rid = items
        off: Any = (0,) * len(shape)
        block: Any = shape
        replica = rid[0] if rid else 0
    elif len(items) == 6:
        rank, off, block, start, stop, replica = items
    else:
        raise LayoutError(f"flat range {entry!r} must be (rank, start, stop[, replica]) or "
                          "(rank, block offset, block shape, start, stop, replica)")
    off, block = _ints(off, "flat range block offset"), _ints(block, "flat range block shape")
    (rank, start, stop, replica) = _ints((rank, start, stop, replica), f"flat range {entry!r}")
    if len(off) != len(shape) or len(block) != len(shape):
        raise ShapeMismatchError(f"flat range {entry!r} does not have the {len(shape)} dims of shape {list(shape)}")
    if any(o + n > s for o, n, s in zip(off, block, shape, strict=True)):
        raise LayoutError(f"flat range {entry!r}: block at {list(off)} of shape {list(block)} lies outside "
                          f"shape {list(shape)}")
    if start > stop or stop > math.prod(block):
        raise LayoutError(f"flat range {entry!r}: [{start}, {stop}) is not within the {math.prod(block)} elements "
                          f"of its block {list(block)}")
    return (rank, off, block, start, stop, replica)


@dataclass(frozen=True)
class FlatLayout(Layout, kind="flat"):
    """A tensor of global ``shape`` whose ranks each hold one flat range of a block.

    Build with :meth:`from_ranges` (or :meth:`even`, :meth:`from_megatron`).
    The mesh is ``(len(ranges),)`` and its ranks the ranges' ranks, in order.

    Parameters
    ----------
    ranges : tuple of FlatRange
        ``(rank, block offset, block shape, start, stop, replica id)`` per rank:
        the rank holds elements ``[start, stop)`` of the row-major flattening of
        the block ``shape[offset : offset + block shape]``. Replica-0 ranges of
        one block tile its elements exactly once, and the blocks tile the
        tensor; a replica ``k > 0`` range repeats a replica-0 range. Empty
        ranges (``start == stop``) hold nothing.
    """

    ranges: tuple[FlatRange, ...] = ()

    def __post_init__(self) -> None:
        shape = _ints(self.shape, "shape")
        object.__setattr__(self, "shape", shape)
        ranges = tuple(_normalise(shape, r) for r in self.ranges)
        if not ranges:
            raise LayoutError("a flat layout needs at least one range")
        object.__setattr__(self, "ranges", ranges)
        object.__setattr__(self, "mesh", (len(ranges),))
        object.__setattr__(self, "ranks", tuple(r[0] for r in ranges))
        object.__setattr__(self, "dims", ())
        super().__post_init__()
        if self.explicit is not None or self.opt_shard is not None or self.split != "even" or self.nested:
            raise LayoutError("a flat layout has no mesh splits, explicit blocks or optimizer sharding")
        self._check()

    def _check(self) -> None:
        primary: dict[tuple[tuple[int, ...], tuple[int, ...]], list[tuple[int, int]]] = {}
        for _, off, block, start, stop, rid in self.ranges:
            if rid == 0 and start < stop:
                primary.setdefault((off, block), []).append((start, stop))
        for (off, block), spans in primary.items():
            spans.sort()
            at = 0
            for start, stop in spans:
                if start != at:
                    what = "overlap" if start < at else "leave a gap"
                    raise LayoutError(f"replica-0 flat ranges of the block at {list(off)} of shape {list(block)} "
                                      f"{what} at element {min(start, at)}")
                at = stop
            if at != math.prod(block):
                raise LayoutError(f"replica-0 flat ranges of the block at {list(off)} of shape {list(block)} end at "
                                  f"{at} of its {math.prod(block)} elements")
        check_tiling(self.shape, sorted(primary))
        seen: set[tuple[Any, ...]] = set()
        for _, off, block, start, stop, rid in self.ranges:
            if start == stop:
                continue
            key = (off, block, start, stop, rid)
            if key in seen:
                raise LayoutError(f"two ranges [{start}, {stop}) of the block at {list(off)} share replica id {rid}")
            seen.add(key)
            if rid and (start, stop) not in primary.get((off, block), ()):
                raise LayoutError(f"range [{start}, {stop}) of the block at {list(off)} is replica {rid} of no "
                                  "replica-0 range")

    # ------------------------------------------------------------ constructors

    @classmethod
    def from_ranges(cls, shape: Sequence[int], ranges: Sequence[Sequence[Any]],
                    origin: dict[str, Any] | None = None) -> FlatLayout:
        """From ranges: ``(rank, start, stop[, replica])`` of the whole tensor, or the six fields of
        :data:`FlatRange` for a range of a block (a tensor-parallel local part)."""
        n = len(ranges)
        return cls(shape=tuple(shape), mesh=(max(n, 1),), ranges=tuple(tuple(r) for r in ranges),
                   origin=origin)

    @classmethod
    def even(cls, shape: Sequence[int], ranks: int | Sequence[int], origin: dict[str, Any] | None = None
             ) -> FlatLayout:
        """The flattened tensor cut into ``len(ranks)`` ranges of ``ceil(numel / n)`` (DeepSpeed ZeRO-3's
        partition of one parameter; the last ranges are shorter or empty)."""
        ids = list(range(ranks)) if isinstance(ranks, int) else list(ranks)
        if not ids:
            raise LayoutError("a flat layout needs at least one rank")
        numel = math.prod(int(s) for s in shape)
        step = -(-numel // len(ids))
        return cls.from_ranges(shape, [(r, min(i * step, numel), min((i + 1) * step, numel))
                                       for i, r in enumerate(ids)], origin)

    @classmethod
    def from_megatron(cls, shape: Sequence[int], entries: Sequence[Sequence[Any]]) -> FlatLayout:
        """From Megatron-Core ``ShardedTensor`` facts per rank: ``(rank, global_offset, local_shape,
        flattened_range start, stop, replica_id)`` (the range indexes the flattened local shape)."""
        return cls.from_ranges(shape, entries, {"framework": "megatron", "flattened_range": True})

    @classmethod
    def single(cls, shape: Sequence[int], rank: int = 0) -> FlatLayout:
        """One rank holds the whole flattened tensor."""
        return cls.from_ranges(shape, [(rank, 0, math.prod(int(s) for s in shape))])

    # ------------------------------------------------------------------ tables

    @cached_property
    def _flat(self) -> _Table:
        return _Table(self)

    def _pos(self, rank: int) -> int:
        pos = self._flat.index.get(rank) if isinstance(rank, int) else None
        if pos is None:
            raise RankError(f"rank {rank!r} is not among the flat layout's ranks {list(self.ranks)[:8]}")
        return pos

    def _entry(self, rank: int) -> FlatRange:
        return self.ranges[self._pos(rank)]

    def flat_range(self, rank: int) -> tuple[int, int]:
        """``(start, stop)`` of `rank`'s range within its block's flattening."""
        _, _, _, start, stop, _ = self._entry(rank)
        return start, stop

    def block_of(self, rank: int) -> tuple[slice, ...]:
        """The global region of the block whose flattening `rank`'s range indexes."""
        _, off, block, _, _, _ = self._entry(rank)
        return tuple(slice(o, o + n) for o, n in zip(off, block, strict=True))

    def boxes(self, rank: int) -> tuple[tuple[int, tuple[slice, ...]], ...]:
        """`rank`'s part as ``(offset in its local array, global region)`` per box, in flat order.

        Box ``region`` of shape ``s`` is ``local[offset : offset + prod(s)].reshape(s)``.
        """
        return self._flat.boxes[self._pos(rank)]

    def offset_of(self, block: Block) -> int:
        """Where a block of :meth:`blocks` starts in the local arrays of its holders (the same for each)."""
        try:
            return self._flat.offsets[tuple((s.start, s.stop) for s in block.region)]
        except KeyError:
            raise LayoutError(f"{block!r} is not a block of {self.describe()}") from None

    # --------------------------------------------------------- Layout's methods

    @property
    def _info(self) -> Any:
        """Refused: the mesh tables of block layouts do not describe ranges. Every method of
        :class:`Layout` that reads them is overridden here; one added later fails loudly, not wrongly."""
        raise UnsupportedError(f"{self.describe()}: a flat layout has no mesh table (Layout internals)")

    @property
    def _geo(self) -> Any:
        """Refused, as :attr:`_info`: the O(ndim) mesh geometry of block layouts."""
        raise UnsupportedError(f"{self.describe()}: a flat layout has no mesh geometry (Layout internals)")

    @property
    def _whole(self) -> bool:
        return False

    def block_shape(self) -> tuple[int, ...]:
        """The shape of the first block (box): a regular flat layout's grid cell; the shape if none."""
        blocks = self.blocks()
        return blocks[0].shape if blocks else self.shape

    def has_rank(self, rank: int) -> bool:
        return isinstance(rank, int) and rank in self._flat.index

    def region(self, rank: int) -> tuple[slice, ...]:
        """Refused: a flat range is several boxes (:meth:`boxes`), not one region."""
        self._entry(rank)
        raise UnsupportedError(f"rank {rank} of a flat layout holds a flat range ({len(self.boxes(rank))} boxes), "
                               "not one region: use FlatLayout.boxes(rank)")

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """``(stop - start,)``: a rank's local array is its range, one-dimensional."""
        start, stop = self.flat_range(rank)
        return (stop - start,)

    def replica_id(self, rank: int) -> int:
        return self._entry(rank)[5]

    def coords(self, rank: int) -> tuple[int, ...]:
        return (self._pos(rank),)

    def blocks(self) -> tuple[Block, ...]:
        """Every box of a replica-0 range with the ranks holding it (by replica id), in C order of starts."""
        return self._flat.blocks

    def boundaries(self, dim: int) -> tuple[int, ...]:
        if not 0 <= dim < self.ndim:
            raise LayoutError(f"dim {dim} out of range for shape {list(self.shape)}")
        return self._flat.boundaries[dim]

    def holders(self, point: Sequence[int]) -> tuple[int, ...]:
        point = tuple(point)
        if len(point) != self.ndim or not all(0 <= x < n for x, n in zip(point, self.shape, strict=True)):
            raise LayoutError(f"point {list(point)} lies outside shape {list(self.shape)}")
        for off, block, starts, holders in self._flat.bases:
            if all(o <= x < o + n for o, n, x in zip(off, block, point, strict=True)):
                flat = 0
                for o, n, x in zip(off, block, point, strict=True):
                    flat = flat * n + (x - o)
                return holders[bisect.bisect_right(starts, flat) - 1]
        raise LayoutError(f"no range of {self.describe()} holds point {list(point)}")  # pragma: no cover

    def owner(self, point: Sequence[int]) -> int:
        return self.holders(point)[0]

    def is_regular(self) -> bool:
        return self._flat.regular

    @property
    def opt_sharded(self) -> bool:
        return False

    @property
    def opt_group_size(self) -> int:
        return 1

    def to_json(self) -> dict[str, Any]:
        """``{"version": 1, "kind": "flat", "shape", "ranges", "origin"}`` (see :mod:`.jsonform`). Cached."""
        return self._flat_json

    @cached_property
    def _flat_json(self) -> dict[str, Any]:
        return jsonform.flat_to_json(self)

    def to_json_text(self) -> str:
        return self._flat_json_text

    @cached_property
    def _flat_json_text(self) -> str:
        return json.dumps(self._flat_json, separators=(",", ":"))

    def describe(self) -> str:
        """``flat[4]`` (ranges), plus ``blocks[k]`` when the ranges index several (TP-local) blocks."""
        bases = len(self._flat.bases)
        return f"flat[{len(self.ranges)}]" + (f" blocks[{bases}]" if bases > 1 else "")

    def __repr__(self) -> str:
        return f"FlatLayout(shape={list(self.shape)}, {self.describe()}, ranks={list(self.ranks)[:8]})"


class _Table:
    """Derived facts of a flat layout, built once (lazily)."""

    def __init__(self, layout: FlatLayout) -> None:
        self.index = {r[0]: p for p, r in enumerate(layout.ranges)}
        holders: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
        for rank, off, block, start, stop, rid in layout.ranges:
            if start < stop:
                holders.setdefault((off, block, start, stop), []).append((rid, rank))
        self.boxes: list[tuple[tuple[int, tuple[slice, ...]], ...]] = []
        for _, off, block, start, stop, _ in layout.ranges:
            out, at = [], 0
            for box in range_boxes(block, start, stop):
                region = tuple(slice(o + lo, o + hi) for o, (lo, hi) in zip(off, box, strict=True))
                out.append((at, region))
                at += math.prod(hi - lo for lo, hi in box)
            self.boxes.append(tuple(out))
        found: list[tuple[tuple[slice, ...], tuple[int, ...], int]] = []
        bases: dict[tuple[Any, Any], list[tuple[int, tuple[int, ...]]]] = {}
        for (off, block, start, _), members in holders.items():
            ranks = tuple(r for _, r in sorted(members))
            bases.setdefault((off, block), []).append((start, ranks))
            pos = self.index[ranks[0]]
            found += [(region, ranks, at) for at, region in self.boxes[pos]]
        found.sort(key=lambda f: [s.start for s in f[0]])
        self.blocks = tuple(Block(region, ranks) for region, ranks, _ in found)
        self.offsets = {tuple((s.start, s.stop) for s in region): at for region, _, at in found}
        self.bases = []
        for (off, block), spans in bases.items():
            spans.sort()
            self.bases.append((off, block, [s for s, _ in spans], [h for _, h in spans]))
        cuts = [{0, n} for n in layout.shape]
        for b in self.blocks:
            for c, s in zip(cuts, b.region, strict=True):
                c.update((s.start, s.stop))
        self.boundaries = tuple(tuple(sorted(c)) for c in cuts)
        self.regular = self._regular(layout)

    def _regular(self, layout: FlatLayout) -> bool:
        if not self.blocks:
            return True
        cell = self.blocks[0].shape
        count = 1
        for size, c, bounds in zip(layout.shape, cell, self.boundaries, strict=True):
            if bounds != (*range(0, size, c), size):
                return False
            count *= len(bounds) - 1
        return len(self.blocks) == count
