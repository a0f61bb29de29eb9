"""Per-layout tables behind ``region``/``replica_id``/``blocks``.

Two levels of cache keep the store's "512 ranks x 5000 tensors" cheap:

* :func:`mesh_info` (``lru_cache`` on mesh, ranks, dims, opt_shard, so shared
  by every tensor with the same placement): each rank's position, mesh
  coordinate, per-dim piece index, replica id and optimizer group slot.
* :class:`GridInfo` (one per layout, built lazily): the intervals of each
  dim, whether optimizer sharding took effect, and the blocks on demand.

Non-empty regions of different mesh cells are disjoint (each dim's pieces
partition it), so replicas of a non-empty region are exactly the ranks in the
same cell: their replica id is their row-major index over the unused mesh axes
(positions in ``ranks`` run row-major), or, with optimizer sharding, their
chunk index in the optimizer group.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from . import _pieces
from ._split import piece
from .records import Block

if TYPE_CHECKING:
    from .core import Layout

Bounds = tuple[tuple[int, int], ...]


def mesh_coords(position: int, mesh: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major coordinate of `position` in `mesh`, last axis fastest."""
    out = [0] * len(mesh)
    for i in range(len(mesh) - 1, -1, -1):
        position, out[i] = divmod(position, mesh[i])
    return tuple(out)


@dataclass(frozen=True)
class MeshInfo:
    """Shape-independent facts about a placement, indexed by position in ``ranks``."""

    index: dict[int, int]
    coords: tuple[tuple[int, ...], ...]
    cell: tuple[tuple[int, ...], ...]  # per position: piece index of each tensor dim
    replica: tuple[int, ...]  # without optimizer sharding
    holders: dict[tuple[int, ...], tuple[int, ...]]  # cell -> ranks by replica id
    opt_size: int  # optimizer chunk size, 0 if optimizer sharding cannot apply
    opt_slot: tuple[tuple[int, int], ...]  # per position: (piece in chunk, chunk index)
    opt_holders: dict[tuple[tuple[int, ...], int], tuple[int, ...]]


def _opt(
    ranks: tuple[int, ...], cell: tuple[tuple[int, ...], ...], opt_shard: int | None
) -> tuple[int, tuple[tuple[int, int], ...], dict[tuple[tuple[int, ...], int], tuple[int, ...]]]:
    if opt_shard is None:
        return 0, (), {}
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for p, key in enumerate(cell):
        groups[key].append(p)
    size = len(ranks) // len(groups)
    eff = size if opt_shard == -1 or opt_shard >= size else opt_shard
    if eff <= 1 or size % eff:  # MindSpore: shard size must divide the group
        return 0, (), {}
    slot = [(0, 0)] * len(ranks)
    holders: dict[tuple[tuple[int, ...], int], list[tuple[int, int]]] = defaultdict(list)
    for key, members in groups.items():
        members.sort(key=lambda p: ranks[p])
        for i, p in enumerate(members):
            slot[p] = (i % eff, i // eff)
            holders[key, i % eff].append((i // eff, ranks[p]))
    return eff, tuple(slot), {k: tuple(r for _, r in sorted(v)) for k, v in holders.items()}


@lru_cache(maxsize=1024)
def mesh_info(
    mesh: tuple[int, ...],
    ranks: tuple[int, ...],
    dims: tuple[tuple[int, ...], ...],
    opt_shard: int | None,
) -> MeshInfo:
    """Compute (and cache) the shape-independent table of a placement."""
    index = {r: p for p, r in enumerate(ranks)}
    coords = tuple(mesh_coords(p, mesh) for p in range(len(ranks)))
    cells = []
    for c in coords:
        row = []
        for axes in dims:
            i = 0
            for a in axes:
                i = i * mesh[a] + c[a]
            row.append(i)
        cells.append(tuple(row))
    cell = tuple(cells)
    members: dict[tuple[int, ...], list[int]] = defaultdict(list)
    replica = [0] * len(ranks)
    for p, key in enumerate(cell):
        replica[p] = len(members[key])
        members[key].append(ranks[p])
    holders = {k: tuple(v) for k, v in members.items()}
    opt_size, opt_slot, opt_holders = _opt(ranks, cell, opt_shard)
    return MeshInfo(index, coords, cell, tuple(replica), holders, opt_size, opt_slot, opt_holders)


def _dim_intervals(size: int, axes: tuple[int, ...], layout: Layout) -> tuple[tuple[int, int], ...]:
    """Interval of every piece index of one dim (index = row-major over `axes`)."""
    sizes = tuple(layout.mesh[a] for a in axes)
    return _intervals(size, sizes, layout.split, layout.nested and len(axes) > 1)


@functools.lru_cache(maxsize=4096)
def _intervals(size: int, sizes: tuple[int, ...], split: str, nested: bool) -> tuple[tuple[int, int], ...]:
    """:func:`_dim_intervals` by value (a model's tensors share a few dim sizes: computed once each)."""
    if not nested:
        k = 1
        for s in sizes:
            k *= s
        return tuple(piece(size, k, i, split) for i in range(k))
    out = []
    for combo in itertools.product(*(range(s) for s in sizes)):
        lo, hi = 0, size
        for k, i in zip(sizes, combo, strict=True):
            s, e = piece(hi - lo, k, i, split)
            lo, hi = lo + s, lo + e
        out.append((lo, hi))
    return tuple(out)


class GridInfo:
    """Derived facts of a mesh-based layout (built once per layout, lazily)."""

    def __init__(self, layout: Layout) -> None:
        self.info = mesh_info(layout.mesh, layout.ranks, layout.dims, layout.opt_shard)
        self.intervals = [
            _dim_intervals(size, axes, layout) for size, axes in zip(layout.shape, layout.dims, strict=True)
        ]
        eff = self.info.opt_size if layout.shape else 0
        if eff and any((hi - lo) % eff for lo, hi in self.intervals[0]):
            eff = 0  # MindSpore: dim 0 not divisible, the parameter is not optimizer-sharded
        self.opt = eff
        self.index = self.info.index
        self._blocks: tuple[Block, ...] | None = None

    def coords(self, p: int) -> tuple[int, ...]:
        return self.info.coords[p]

    def bounds(self, p: int) -> Bounds:
        cell = self.info.cell[p]
        out = [iv[i] for iv, i in zip(self.intervals, cell, strict=True)]
        if self.opt:
            lo, hi = out[0]
            step = (hi - lo) // self.opt
            k = self.info.opt_slot[p][0]
            out[0] = (lo + k * step, lo + (k + 1) * step)
        return tuple(out)

    def replica(self, p: int) -> int:
        return self.info.opt_slot[p][1] if self.opt else self.info.replica[p]

    def blocks(self) -> tuple[Block, ...]:
        if self._blocks is None:
            found: list[tuple[Bounds, tuple[int, ...]]] = []
            for cell, holders in self.info.holders.items():
                bounds = tuple(iv[i] for iv, i in zip(self.intervals, cell, strict=True))
                if not all(lo < hi for lo, hi in bounds):
                    continue
                if not self.opt:
                    found.append((bounds, holders))
                    continue
                (lo, hi), *rest = bounds
                step = (hi - lo) // self.opt
                for k in range(self.opt):
                    sub = ((lo + k * step, lo + (k + 1) * step), *rest)
                    found.append((sub, self.info.opt_holders[cell, k]))
            found.sort(key=lambda f: [lo for lo, _ in f[0]])
            self._blocks = tuple(Block(tuple(slice(*b) for b in bounds), h) for bounds, h in found)
        return self._blocks


class ExplicitInfo:
    """Derived facts of an explicit (Megatron) layout; a rank may hold several blocks (:mod:`._pieces`)."""

    def __init__(self, layout: Layout) -> None:
        assert layout.explicit is not None
        self.index, self.pieces, self.shapes, self._replica = _pieces.rank_table(layout.explicit)
        self.multi = any(len(p) > 1 for p in self.pieces)
        holders: dict[Bounds, list[tuple[int, int]]] = defaultdict(list)
        for rank, off, shp, rid, *_ in layout.explicit:
            b = tuple((o, o + s) for o, s in zip(off, shp, strict=True))
            if all(lo < hi for lo, hi in b):
                holders[b].append((rid, rank))
        order = sorted(holders, key=lambda b: ([lo for lo, _ in b], [hi for _, hi in b]))
        self._blocks = tuple(
            Block(tuple(slice(*iv) for iv in b), tuple(r for _, r in sorted(holders[b]))) for b in order
        )

    def coords(self, p: int) -> tuple[int, ...]:
        return (p,)

    def bounds(self, p: int) -> Bounds:
        """The rank's one region (callers check it holds one piece)."""
        return tuple((s.start, s.stop) for s in self.pieces[p][0][0])

    def replica(self, p: int) -> int:
        return self._replica[p]

    def blocks(self) -> tuple[Block, ...]:
        return self._blocks
