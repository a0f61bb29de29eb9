"""O(ndim) answers of a mesh layout: a rank's region and replica id, the holders of a point, regularity.

A mesh layout cuts each tensor dim by one or more *levels*: ``(pieces,
split)`` each, applied one inside the other (a nested split has one level per
mesh axis on the dim, a flat split one level of their product; optimizer
sharding adds an ``even`` level on dim 0). A rank's piece index at each level
follows from its mesh coordinate, so its region is O(levels) of integer math
(:func:`piece_at`), and the piece holding a point is found level by level the
other way (:func:`locate`). Nothing here is O(ranks) except the holders
returned and, under optimizer sharding over ranks that do not increase along
the mesh, the per-placement table of :mod:`._table` it falls back on.

Whether a dim's pieces are a regular cut (every non-empty piece but the last
of one size, the last no larger) follows from a *signature* of each distinct
extent a level cuts (:func:`signature`): a level cuts an extent into at most
three distinct extents (full, remainder, empty), so the signature of a dim is
computed from at most ``3 ** levels`` sub-signatures, never from its pieces.
Per-dim values are cached by value: a model's tensors share a few dim sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

from ._split import piece
from ._table import MeshInfo, mesh_coords, mesh_info

if TYPE_CHECKING:
    from ._ranks import RankSet

#: One cut of an extent: ``(pieces, split)``.
Level = tuple[int, str]


class Signature(NamedTuple):
    """The non-empty pieces of an extent cut by some levels, summarised (there is at least one)."""

    pieces: int  #: how many
    first: int  #: size of the first
    last: int  #: size of the last
    regular: bool  #: every piece but the last has size `first`, the last no more
    sizes: frozenset[int]  #: their distinct sizes


def _runs(extent: int, parts: int, split: str) -> list[tuple[int, int]]:
    """The pieces one level cuts `extent` into, in order, as ``(size, how many)`` runs."""
    if split == "even":
        return [(extent // parts, parts)]
    if split == "ceil":
        if extent == 0:
            return [(0, parts)]
        chunk = -(-extent // parts)
        full, rest = divmod(extent, chunk)
        runs = [(chunk, full)] + ([(rest, 1)] if rest else [])
        empty = parts - full - (1 if rest else 0)
        return runs + ([(0, empty)] if empty else [])
    base, rem = divmod(extent, parts)
    return [(size, n) for size, n in ((base + 1, rem), (base, parts - rem)) if n]


def _repeat(s: Signature, times: int) -> Signature:
    if times == 1:
        return s
    return Signature(s.pieces * times, s.first, s.last, s.regular and s.last == s.first, s.sizes)


def _concat(a: Signature, b: Signature) -> Signature:
    fits = b.first <= a.first if b.pieces == 1 else b.regular and b.first == a.first
    return Signature(a.pieces + b.pieces, a.first, b.last, a.regular and a.last == a.first and fits, a.sizes | b.sizes)


@lru_cache(maxsize=4096)
def signature(size: int, levels: tuple[Level, ...]) -> Signature | None:
    """The :class:`Signature` of the non-empty pieces `levels` cut `size` into (None: all are empty)."""
    if not levels:
        return Signature(1, size, size, True, frozenset((size,))) if size else None
    (parts, split), rest = levels[0], levels[1:]
    out: Signature | None = None
    for extent, times in _runs(size, parts, split):
        sub = signature(extent, rest)
        if sub is not None:
            sub = _repeat(sub, times)
            out = sub if out is None else _concat(out, sub)
    return out


def _intervals(size: int, levels: tuple[Level, ...]) -> list[tuple[int, int]]:
    """Every non-empty piece, in order (O(pieces): for an irregular dim's boundaries only)."""
    spans = [(0, size)]
    for parts, split in levels:
        spans = [(lo + s, lo + e) for lo, hi in spans for s, e in (piece(hi - lo, parts, i, split)
                                                                    for i in range(parts)) if e > s]
    return [iv for iv in spans if iv[1] > iv[0]]


@lru_cache(maxsize=256)
def cuts(size: int, levels: tuple[Level, ...]) -> tuple[int, ...]:
    """Sorted distinct starts and stops of the non-empty pieces (with 0 and `size`)."""
    sig = signature(size, levels)
    if sig is None:
        return (0, size) if size else (0,)
    if sig.regular:
        return (*range(0, size, sig.first), size)
    return tuple(sorted({0, size, *(x for iv in _intervals(size, levels) for x in iv)}))


def piece_at(size: int, levels: tuple[Level, ...], index: tuple[int, ...]) -> tuple[int, int]:
    """``(start, stop)`` of the piece with `index` (one entry per level)."""
    lo, hi = 0, size
    for (parts, split), i in zip(levels, index, strict=True):
        s, e = piece(hi - lo, parts, i, split)
        lo, hi = lo + s, lo + e
    return lo, hi


def _inverse(extent: int, parts: int, split: str, x: int) -> int:
    """The index of the non-empty piece holding offset ``0 <= x < extent``."""
    if split == "even":
        return x // (extent // parts)
    if split == "ceil":
        return x // -(-extent // parts)
    base, rem = divmod(extent, parts)
    big = rem * (base + 1)
    return x // (base + 1) if x < big else rem + (x - big) // base


def locate(size: int, levels: tuple[Level, ...], x: int) -> tuple[int, ...]:
    """The index (per level) of the piece holding ``0 <= x < size``."""
    lo, hi = 0, size
    out = []
    for parts, split in levels:
        i = _inverse(hi - lo, parts, split, x - lo)
        s, e = piece(hi - lo, parts, i, split)
        lo, hi = lo + s, lo + e
        out.append(i)
    return tuple(out)


#: Regions kept per geometry: a rank asks for its own (a process simulating many ranks computes the others each time).
BOUNDS_KEPT = 16
#: Rank lists at most this long key the geometry cache by value (longer ones by their shared RankSet).
SMALL_RANKS = 64
#: Geometries kept per process (the cache starts over beyond this).
GEOMETRIES_KEPT = 4096
_geometries: dict[tuple[Any, ...], Geometry] = {}


def geometry(shape: tuple[int, ...], mesh: tuple[int, ...], ranks: RankSet, dims: tuple[tuple[int, ...], ...],
             split: str, nested: bool, opt_shard: int | None) -> Geometry:
    """The :class:`Geometry` of a mesh layout's fields, shared by the equal layouts of a model's tensors.

    Long rank lists key it by their shared :class:`RankSet` (no hashing of thousands of ranks), short ones by value.
    """
    key = (shape, mesh, ranks.ranks if len(ranks.ranks) <= SMALL_RANKS else ranks, dims, split, nested, opt_shard)
    found = _geometries.get(key)
    if found is None:
        if len(_geometries) >= GEOMETRIES_KEPT:
            _geometries.clear()
        found = _geometries[key] = Geometry(shape, mesh, ranks, dims, split, nested, opt_shard)
    return found


class Geometry:
    """The O(ndim) derived facts of a mesh layout (built in O(ndim + mesh axes), shared by equal layouts).

    Replicas of a block are the ranks of one cell (the same piece of every dim):
    their replica id is their row-major index over the mesh axes that split no
    dim (positions run row-major); under optimizer sharding, ranks of a cell
    sorted by rank id take slot ``i % eff`` of dim 0's piece and replica id ``i // eff``.
    """

    def __init__(self, shape: tuple[int, ...], mesh: tuple[int, ...], ranks: RankSet,
                 dims: tuple[tuple[int, ...], ...], split: str, nested: bool, opt_shard: int | None) -> None:
        self.ranks = ranks
        self.shape = shape
        self.mesh = mesh
        self.dims = dims
        self.opt_shard = opt_shard
        self.strides = tuple(math.prod(mesh[a + 1:]) for a in range(len(mesh)))
        used = {a for axes in dims for a in axes}
        #: The mesh axes splitting no dim (replica axes), in mesh order.
        self.free = tuple(a for a in range(len(mesh)) if a not in used)
        self.nested = tuple(nested and len(axes) > 1 for axes in dims)
        levels = [tuple((mesh[a], split) for a in axes) if nest else
                  (((math.prod(mesh[a] for a in axes), split),) if axes else ())
                  for axes, nest in zip(dims, self.nested, strict=True)]
        group = math.prod(mesh[a] for a in self.free)
        self.opt = 0
        if opt_shard is not None and shape:
            eff = group if opt_shard == -1 or opt_shard >= group else opt_shard
            if eff > 1 and group % eff == 0:
                sig = signature(shape[0], levels[0])
                if sig is None or all(s % eff == 0 for s in sig.sizes):  # MindSpore: else not optimizer-sharded
                    self.opt = eff
                    levels[0] = (*levels[0], (eff, "even"))
        self.levels = tuple(levels)
        self.sigs = tuple(signature(n, lv) for n, lv in zip(shape, self.levels, strict=True))
        #: No block at all (a dim of size 0).
        self.empty = any(s is None for s in self.sigs)
        self._table: MeshInfo | None = None
        self._bounds: dict[int, tuple[tuple[int, int], ...]] = {}

    @property
    def table(self) -> MeshInfo:
        """The placement's per-rank table (optimizer sharding over ranks not in increasing order only)."""
        if self._table is None:
            self._table = mesh_info(self.mesh, self.ranks.ranks, self.dims, self.opt_shard)
        return self._table

    def _free_index(self, coords: tuple[int, ...]) -> int:
        return self._flat(self.free, coords)

    def _opt_slot(self, p: int, coords: tuple[int, ...]) -> tuple[int, int]:
        """(slot in dim 0's piece, replica id) of position `p` under optimizer sharding."""
        if self.ranks.ascending:
            chunk, slot = divmod(self._free_index(coords), self.opt)
            return slot, chunk
        return self.table.opt_slot[p]

    def _flat(self, axes: tuple[int, ...], coords: Sequence[int]) -> int:
        """Row-major index of `coords` over `axes`."""
        i = 0
        for a in axes:
            i = i * self.mesh[a] + coords[a]
        return i

    def _index(self, d: int, coords: tuple[int, ...]) -> tuple[int, ...]:
        """The piece index of dim `d` at each of its levels (optimizer slot aside)."""
        axes = self.dims[d]
        if not axes:
            return ()
        if self.nested[d]:
            return tuple(coords[a] for a in axes)
        return (self._flat(axes, coords),)

    def bounds(self, p: int) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` per dim of the region of position `p` (kept for the first :data:`BOUNDS_KEPT`)."""
        found = self._bounds.get(p)
        if found is None:
            found = self._compute_bounds(p)
            if len(self._bounds) < BOUNDS_KEPT:
                self._bounds[p] = found
        return found

    def _compute_bounds(self, p: int) -> tuple[tuple[int, int], ...]:
        coords = mesh_coords(p, self.mesh)
        out = []
        for d, (size, levels) in enumerate(zip(self.shape, self.levels, strict=True)):
            index = self._index(d, coords)
            if d == 0 and self.opt:
                index = (*index, self._opt_slot(p, coords)[0])
            out.append(piece_at(size, levels, index))
        return tuple(out)

    def replica(self, p: int) -> int:
        coords = mesh_coords(p, self.mesh)
        if self.opt:
            return self._opt_slot(p, coords)[1]
        return self._free_index(coords)

    def _cell(self, point: tuple[int, ...]) -> tuple[list[int], int]:
        """The mesh coordinate of the axes splitting the block at `point` (0 on the others) and its
        optimizer slot (0 without optimizer sharding)."""
        coords = [0] * len(self.mesh)
        slot = 0
        for d, (size, levels, x) in enumerate(zip(self.shape, self.levels, point, strict=True)):
            index = locate(size, levels, x)
            if d == 0 and self.opt:
                index, slot = index[:-1], index[-1]
            axes = self.dims[d]
            if self.nested[d]:
                for a, i in zip(axes, index, strict=True):
                    coords[a] = i
            elif axes:
                i = index[0]
                for a in reversed(axes):
                    i, coords[a] = divmod(i, self.mesh[a])
        return coords, slot

    def holders(self, point: tuple[int, ...]) -> tuple[int, ...]:
        """The ranks holding the block at `point` (inside the tensor), by replica id."""
        coords, slot = self._cell(point)
        if self.opt and not self.ranks.ascending:
            cell = tuple(self._flat(axes, coords) for axes in self.dims)  # mesh_info's key
            return self.table.opt_holders[cell, slot]
        offsets = [sum(c * s for c, s in zip(coords, self.strides, strict=True))]
        for a in self.free:
            step = self.strides[a]
            offsets = [o + c * step for o in offsets for c in range(self.mesh[a])]
        if self.opt:
            offsets = offsets[slot::self.opt]
        ranks = self.ranks.ranks
        return tuple(ranks[p] for p in offsets)

    def owner(self, point: tuple[int, ...]) -> int:
        """The replica-0 holder of the block at `point` (O(ndim + mesh axes), not O(holders))."""
        coords, slot = self._cell(point)
        if self.opt:
            if not self.ranks.ascending:
                return self.holders(point)[0]
            i = slot  # replica 0 of slot k is the k-th rank of the cell, in rank (= position) order
            for a in reversed(self.free):
                i, coords[a] = divmod(i, self.mesh[a])
        return self.ranks.ranks[sum(c * s for c, s in zip(coords, self.strides, strict=True))]

    @property
    def regular(self) -> bool:
        return self.empty or all(s is not None and s.regular for s in self.sigs)

    def cell(self) -> tuple[int, ...]:
        """The shape of the block at the origin (the shape itself when there is no block)."""
        if self.empty:
            return self.shape
        return tuple(s.first for s in self.sigs if s is not None)

    def boundaries(self, d: int) -> tuple[int, ...]:
        size = self.shape[d]
        if self.empty:
            return (0, size) if size else (0,)
        return cuts(size, self.levels[d])

