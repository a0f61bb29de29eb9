"""Chunk (= shard) grids: which shards a saving layout gets, and how to find them.

Two zarr v3 grids:

* ``regular`` (zarr v3 core): every shard has one shape, edge shards are cut by
  the array's end. Every zarr v3 reader reads it.
* ``rectilinear`` (zarr-extensions, ``chunk-grids/rectilinear``): per dimension a
  list of edge lengths, so shards may differ in size. zarr-python >= 3.2 reads it
  (behind its ``array.rectilinear_chunks`` option); zarr-python 3.1 and
  TensorStore do not. reshard's own reader reads both.

Which one a layout gets (:func:`choose_grid`):

* A **regular** layout (its blocks are the cells of a regular grid) uses one
  block as the shard: one shard per block, any reader.
* An **irregular** layout (OneFlow ``balanced`` splits with a remainder, nested
  ``ceil`` splits, explicit Megatron blocks) written by its ranks uses, with
  ``grid="exact"`` (the default), the **rectilinear** grid of its block
  boundaries: per dimension, the edge lengths between consecutive distinct block
  starts/stops. Blocks that tile the array as a product grid (every balanced or
  ``ceil`` split) are then one shard each; any other block set is cut into as
  few shards as its boundaries allow, each inside one block (one writer per
  object still holds). With ``grid="regular"`` it uses the **gcd grid** (per
  dimension the gcd of every boundary): readable by every zarr v3 tool, but a
  balanced split of 50,257 rows over 8 ranks is then 50,257 one-row shards.
* An irregular layout written by **one process** (``single_writer``, e.g.
  :func:`reshard.store.redivide`) uses the regular grid of its piece count,
  ``ceil(size / pieces)`` per dimension, whatever ``grid`` says: one writer
  holds every shard anyway, and the regular grid keeps larger inner chunks.

* A **flattened-range** layout (:class:`reshard.layouts.FlatLayout`: ZeRO,
  FSDP1, Megatron's distributed optimizer) is a set of boxes per rank. Its
  ranks' own writes use the rectilinear grid of the boxes' boundaries, the row
  bands cut further every :data:`FLAT_CELL_ELEMENTS` elements' worth of rows
  (each cell inside one box: one writer per object), and every cell is one
  chunk, without the sharding codec: ranges cut rows at arbitrary columns, and
  an inner chunk dividing every cell would be as narrow as the gcd of those
  columns. One process writing it all (importers, ``redivide``) uses a grid of
  whole rows, ``ceil(rows / ranges)`` rows per shard (:func:`flat_rows_grid`),
  sharded as usual.

* A regular layout whose blocks have **several holders** (data-parallel
  replicas: DDP, HSDP, TP x DP) is, by default (``balance=True``), cut further:
  each block into ``p <= R`` equal sub-shards along one dimension, ``p`` the
  largest divisor of that edge not above its holder count ``R`` (the dimension
  giving the most pieces; no cut below :data:`MIN_BALANCED_ELEMENTS` per piece).
  Sub-shard ``j`` of a block is written by the block's holder of replica id
  ``j`` (:func:`shard_writer`), so the replicas share the writing with no
  communication: the grid and the writers follow from the layout alone. Still a
  regular grid, so every zarr v3 reader reads it.

The inner chunk must divide every shard edge, so under a rectilinear grid it
divides the gcd of each dimension's edge lengths (a balanced split's edges
differ by one: whole rows, or one row, per inner chunk).

Pure functions and records; no I/O.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from reshard.layouts import FlatLayout, Layout
from reshard.layouts.errors import FormatError

#: A replicated block is cut among its holders only into pieces of at least this many elements (below it
#: one more object per piece costs more than the write it spreads; dtype-free, so readers check it alike).
MIN_BALANCED_ELEMENTS = 1 << 15

#: A flat layout's per-rank grid cuts its row bands every this many elements' worth of rows too: each cell is one
#: chunk (:attr:`reshard.store.format.meta.ArrayMeta.sharded`), so this bounds what a read of a few rows fetches.
FLAT_CELL_ELEMENTS = 1 << 18

#: ``grid=`` values accepted by the writer.
GRID_CHOICES = ("exact", "regular")


@dataclass(frozen=True)
class Grid:
    """The shard grid of one stored array.

    Attributes
    ----------
    shape : tuple of int
        The array's shape.
    shard : tuple of int
        Regular grid: the shard shape. Rectilinear: the largest edge per dimension.
    edges : tuple of tuple of int, or None
        Rectilinear grid: the edge lengths along each dimension (they add up to
        the array's extent); None for a regular grid.
    """

    shape: tuple[int, ...]
    shard: tuple[int, ...]
    edges: tuple[tuple[int, ...], ...] | None = None

    @property
    def regular(self) -> bool:
        return self.edges is None

    @functools.cached_property
    def bounds(self) -> tuple[tuple[int, ...], ...]:
        """Rectilinear grid: per dimension the shard starts and the extent, ``(0, e0, e0 + e1, ..., n)``."""
        assert self.edges is not None
        return tuple((0, *itertools.accumulate(e)) for e in self.edges)

    @functools.cached_property
    def counts(self) -> tuple[int, ...]:
        """Number of shards along each dimension."""
        if self.edges is not None:
            return tuple(len(e) for e in self.edges)
        return tuple(-(-n // s) for n, s in zip(self.shape, self.shard, strict=True))

    def start(self, dim: int, i: int) -> int:
        """Global start of shard ``i`` along ``dim``."""
        return i * self.shard[dim] if self.edges is None else self.bounds[dim][i]

    def extent(self, index: tuple[int, ...]) -> tuple[int, ...]:
        """Nominal shape of the shard at ``index`` (a regular grid's edge shard is not cut here: zarr pads it)."""
        if self.edges is None:
            return self.shard
        return tuple(e[i] for e, i in zip(self.edges, index, strict=True))

    def region(self, index: tuple[int, ...]) -> tuple[slice, ...]:
        """Global region of the shard at ``index``, clipped to the array."""
        if self.edges is None:
            return tuple(slice(i * s, min((i + 1) * s, n))
                         for i, s, n in zip(index, self.shard, self.shape, strict=True))
        return tuple(slice(b[i], min(b[i + 1], n)) for b, i, n in zip(self.bounds, index, self.shape, strict=True))

    def indices(self, dim: int, start: int, stop: int) -> range:
        """Shard indices along ``dim`` that meet ``[start, stop)``."""
        if stop <= start:
            return range(0)
        if self.edges is None:
            s = self.shard[dim]
            return range(start // s, -(-stop // s))
        b = self.bounds[dim]
        return range(bisect.bisect_right(b, start) - 1, bisect.bisect_left(b, stop))

    def shards_in(self, region: tuple[slice, ...]) -> Iterator[tuple[int, ...]]:
        """Indices of the shards that meet a global region (C order)."""
        yield from itertools.product(*(self.indices(d, r.start, r.stop) for d, r in enumerate(region)))

    def divisor(self) -> tuple[int, ...]:
        """Per dimension, what every inner chunk edge must divide: the shard edge, or the gcd of the edges."""
        if self.edges is None:
            return self.shard
        return tuple(math.gcd(*e) for e in self.edges)

    # ------------------------------------------------------------------ json
    def to_json(self) -> dict[str, Any]:
        """The ``chunk_grid`` member of the array's ``zarr.json``."""
        if self.edges is None:
            return {"name": "regular", "configuration": {"chunk_shape": list(self.shard) if self.shape else []}}
        return {"name": "rectilinear", "configuration": {"kind": "inline", "chunk_shapes": [
            _run_length(e) for e in self.edges]}}

    @classmethod
    def from_json(cls, shape: tuple[int, ...], doc: Any) -> Grid:
        """Parse a ``chunk_grid`` member (regular or rectilinear).

        Raises
        ------
        FormatError
            For another grid, or edge lengths that do not cover the array.
        KeyError, TypeError, ValueError
            For a malformed document (the caller names the tensor).
        """
        name, cfg = doc["name"], doc["configuration"]
        if name == "regular":
            shard = tuple(int(c) for c in cfg["chunk_shape"])
            if len(shard) != len(shape) or any(c < 1 for c in shard):
                raise ValueError(f"chunk_shape {list(shard)} for shape {list(shape)}")
            return cls(shape, shard)
        if name != "rectilinear":
            raise FormatError(f"unsupported chunk grid {name!r} (reshard reads 'regular' and 'rectilinear')")
        if cfg.get("kind") != "inline":
            raise FormatError(f"unsupported rectilinear grid kind {cfg.get('kind')!r}")
        specs = cfg["chunk_shapes"]
        if not isinstance(specs, list) or len(specs) != len(shape):
            raise ValueError(f"chunk_shapes {specs!r} for shape {list(shape)}")
        edges = tuple(_expand(spec, n) for spec, n in zip(specs, shape, strict=True))
        return cls(shape, tuple(max(e, default=1) for e in edges), edges)


def _run_length(edges: tuple[int, ...]) -> list[Any]:
    """Edge lengths as the extension writes them: runs of a repeated length as ``[length, count]``."""
    out: list[Any] = []
    for length, run in itertools.groupby(edges):
        count = len(list(run))
        out.append([length, count] if count > 1 else length)
    return out


def _expand(spec: Any, size: int) -> tuple[int, ...]:
    """Explicit edge lengths of one dimension (an integer, or a list of lengths and ``[length, count]`` runs).

    Edges past the array's end (the extension allows overflow) are dropped;
    reshard writes edges that add up to the extent exactly.
    """
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 1:
            raise ValueError(f"edge length {spec}")
        return tuple(min(spec, size - s) for s in range(0, size, spec)) or (spec,)
    if not isinstance(spec, list):
        raise ValueError(f"edge lengths {spec!r}")
    edges: list[int] = []
    for item in spec:
        if isinstance(item, list):
            length, count = item
            edges += [int(length)] * int(count)
        else:
            edges.append(int(item))
    if any(e < 1 for e in edges) or sum(edges) < size:
        raise ValueError(f"edge lengths {spec!r} do not cover extent {size}")
    out: list[int] = []
    total = 0
    for e in edges:
        if total >= size and out:
            break
        out.append(e)
        total += e
    return tuple(out)


# ------------------------------------------------------------ which grid
def allowed_grids(layout: Layout) -> list[Grid]:
    """Every grid a tensor saved under ``layout`` may have been written with (block, balanced, exact, gcd,
    piece count).

    What ``commit`` and ``open`` accept: an edited grid would read other shards' bytes.
    Computed once per distinct layout (a model's tensors share a few).
    """
    return list(_allowed_grids(layout))


@functools.lru_cache(maxsize=4096)
def _allowed_grids(layout: Layout) -> tuple[Grid, ...]:
    if not layout.shape or layout.is_regular():
        return tuple(dict.fromkeys([choose_grid(layout), choose_grid(layout, balance=True)]))
    return (choose_grid(layout, "exact", regular=False), choose_grid(layout, "regular", regular=False),
            choose_grid(layout, single_writer=True, regular=False))


def choose_grid(layout: Layout, grid: str = "exact", single_writer: bool = False,
                regular: bool | None = None, balance: bool = False) -> Grid:
    """The shard grid a tensor saved under ``layout`` gets (see the module docstring).

    Parameters
    ----------
    layout : Layout
        The saving layout.
    grid : {"exact", "regular"}
        For an irregular layout written by its ranks: the rectilinear grid of
        its block boundaries, or the regular gcd grid.
    single_writer : bool
        One process writes every shard: an irregular layout gets the regular
        grid of its piece count.
    regular : bool, optional
        ``layout.is_regular()``, when the caller knows it already.
    balance : bool
        A regular layout's replicated blocks are cut into one sub-shard per
        holder (:func:`balanced_grid`); ignored with ``single_writer``.

    Computed once per distinct layout and arguments (a model's tensors share a few layouts).
    """
    return _choose_grid(layout, grid, single_writer, regular, balance)


@functools.lru_cache(maxsize=4096)
def _choose_grid(layout: Layout, grid: str, single_writer: bool, regular: bool | None, balance: bool) -> Grid:
    if grid not in GRID_CHOICES:
        raise ValueError(f"grid must be one of {GRID_CHOICES}, got {grid!r}")
    shape = tuple(layout.shape)
    if not shape:
        return Grid((), ())
    if layout.is_regular() if regular is None else regular:
        if not all(shape):
            return Grid(shape, tuple(max(1, n) for n in shape))
        blocks = Grid(shape, layout.block_shape())  # the first block's shape: O(ndim), whatever the rank count
        return balanced_grid(layout, blocks) if balance and not single_writer else blocks
    if single_writer and isinstance(layout, FlatLayout):
        return flat_rows_grid(layout)
    bounds = [layout.boundaries(d) for d in range(len(shape))]
    if isinstance(layout, FlatLayout) and not single_writer and grid == "exact":
        step = max(1, FLAT_CELL_ELEMENTS // max(1, math.prod(shape[1:])))  # cells of about this many elements
        bounds[0] = tuple(sorted({*bounds[0], *range(0, shape[0], step)}))
    if single_writer:
        return Grid(shape, tuple(max(1, -(-n // max(1, len(b) - 1))) for n, b in zip(shape, bounds, strict=True)))
    if grid == "regular":
        return Grid(shape, tuple(max(1, math.gcd(*b)) for b in bounds))
    edges = tuple(tuple(b[i + 1] - b[i] for i in range(len(b) - 1)) or (1,) for b in bounds)
    if all(len(e) == 1 or (len(set(e[:-1])) == 1 and e[-1] <= e[0]) for e in edges):
        return Grid(shape, tuple(e[0] for e in edges))  # the boundaries are a regular grid after all
    return Grid(shape, tuple(max(e) for e in edges), edges)


def flat_rows_grid(layout: FlatLayout) -> Grid:
    """One process's grid of a flat layout: whole rows (every dim but the first whole), ``ceil(rows / k)``
    rows a shard for ``k`` non-empty replica-0 ranges (a rank's range then spans about one shard)."""
    shape = tuple(layout.shape)
    k = max(1, sum(1 for r in layout.ranges if r[5] == 0 and r[3] < r[4]))
    return Grid(shape, (max(1, -(-shape[0] // k)), *(max(1, n) for n in shape[1:])))


def balanced_grid(layout: Layout, blocks: Grid) -> Grid:
    """A regular layout's block grid with each block cut into one sub-shard per holder, where it can be.

    Along the dimension that allows the most pieces: ``p``, the largest divisor
    of the block's edge that is at most the holder count and leaves pieces of
    at least :data:`MIN_BALANCED_ELEMENTS` (the first such dimension on a tie).
    ``blocks`` itself when no cut helps (one holder, a small block, a prime edge).
    """
    cell = blocks.shard
    replicas = len(layout.holders((0,) * len(cell)))
    size = math.prod(cell)
    best, dim = 1, 0
    for d, n in enumerate(cell):
        p = next((k for k in range(min(replicas, n), best, -1)
                  if n % k == 0 and size // k >= MIN_BALANCED_ELEMENTS), 1)
        if p > best:
            best, dim = p, d
    if best == 1:
        return blocks
    return Grid(blocks.shape, tuple(n // best if d == dim else n for d, n in enumerate(cell)))


@functools.lru_cache(maxsize=1 << 14)
def shard_writer(layout: Layout, grid: Grid, index: tuple[int, ...]) -> int:
    """The rank that writes the shard at ``index`` of ``grid``.

    A sub-shard of a balanced grid (:func:`balanced_grid`): the holder of its
    block whose replica id is the sub-shard's position in the block; any other
    shard: its block's replica 0. Kept per (layout, grid, index): the tensors
    of a model share a few layouts and grids, and a rank asks about the same few shards of each.
    """
    start = tuple(grid.start(d, i) for d, i in enumerate(index))
    if grid.edges is None and layout.is_regular():
        for s, x, cell in zip(grid.shard, start, layout.block_shape(), strict=True):
            if s < cell:  # the cut dimension: the shard's position in its block
                holders = layout.holders(start)
                return holders[(x % cell) // s % len(holders)]
    return layout.owner(start)


def writes_any(layout: Layout, rank: int, balance: bool = True) -> bool:
    """Whether ``rank`` writes any shard of a tensor its ranks save under ``layout`` (a replica that writes
    none may pass a stand-in, never copied)."""
    if not (balance and layout.shape and layout.is_regular()):
        return layout.replica_id(rank) == 0
    return writes_in(layout, choose_grid(layout, balance=True), rank)


def writes_in(layout: Layout, grid: Grid, rank: int) -> bool:
    """Whether ``rank`` writes any shard of ``grid`` (:func:`shard_writer`)."""
    if isinstance(layout, FlatLayout):
        regions = [r for _, r in layout.boxes(rank)]
    else:
        regions = [r for r, _ in layout.pieces(rank)]
    return any(shard_writer(layout, grid, idx) == rank for region in regions for idx in grid.shards_in(region))
