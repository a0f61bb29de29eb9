"""What a writer stores of each tensor, computed once per process.

A training job saves the same tensors under the same layouts every few
minutes, and a rank's save of a thousand tensors spent most of its time
recomputing, per tensor, things that depend only on the layout: the array
record (shard grid, inner chunk), its manifest JSON, the rank's block and the
shards it covers. :func:`tensor_plan` computes them once per (name, layout,
dtype, writer settings) and keeps them for every later save in the process;
:meth:`TensorPlan.at` does the same per rank.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

from reshard.layouts import FlatLayout, Layout
from reshard.layouts.errors import RankError

from ..format.dtypes import numpy_dtype
from ..format.encode import shard_encoding
from ..format.grid import choose_grid
from ..format.manifests import record_text, tensor_record
from ..format.meta import MIN_CHUNK_BYTES, ArrayMeta, inner_chunk_shape
from ..format.shard import SMALL_SHARD_BYTES

#: Plans kept per process (the cache starts over beyond this: a job changing its tensors all the time).
MAX_PLANS = 1 << 14
#: Rank parts kept per process, over all plans: a process writing every rank of a large job (``save``)
#: computes the others each time rather than hold tensors x ranks of them.
MAX_PARTS = 1 << 15


@dataclass(frozen=True)
class Settings:
    """The writer settings an array record depends on."""

    grid: str
    chunk_bytes: int
    checksums: bool
    compression: str | None
    single_writer: bool = False
    balance: bool = True


@dataclass(frozen=True)
class RankPart:
    """What one rank writes of one tensor.

    Attributes
    ----------
    local_shape : tuple of int
        The shape of the rank's local piece.
    writes : bool
        Whether the rank writes any shard of its block.
    region : tuple of slice or None
        The block's global region (None for a flat range or a rank holding several
        blocks: their shards are in ``shards``).
    shards : tuple
        ``(grid index, slices of the block holding the shard, its encoding)`` per shard
        of the block the rank writes (a flat range: a :class:`BoxCut` of the rank's 1-d
        array in place of the slices, several blocks: a :class:`PieceCut`; :func:`take`
        applies each) (:meth:`~reshard.store.format.meta.ArrayMeta.writer`; the encoding
        from :func:`~reshard.store.format.encode.shard_encoding`, hashed
        with the values).
    """

    local_shape: tuple[int, ...]
    writes: bool
    region: tuple[slice, ...] | None
    shards: tuple[tuple[tuple[int, ...], Any, bytes], ...]


@dataclass(frozen=True)
class TensorPlan:
    """A tensor's array record as written, its manifest record and JSON text, and its parts by rank."""

    meta: ArrayMeta
    record: dict[str, Any] = field(repr=False)
    text: str = field(repr=False)
    parts: dict[int, RankPart] = field(default_factory=dict, repr=False, compare=False)

    def at(self, rank: int) -> RankPart:
        """What ``rank`` writes of the tensor (``rank`` must be one of the layout's)."""
        part = self.parts.get(rank)
        if part is None:
            layout, meta = self.meta.layout, self.meta
            if not layout.has_rank(rank):
                raise RankError(f"tensor {meta.name!r}: rank {rank} is not among the layout's ranks")
            region: tuple[slice, ...] | None = None
            shards: tuple[tuple[tuple[int, ...], Any, bytes], ...]
            if isinstance(layout, FlatLayout):
                shards = tuple((idx, BoxCut(at, tuple(r.stop - r.start for r in box), within), how)
                               for at, box in layout.boxes(rank)
                               for idx, within, how in block_shards(meta, box, rank))
            elif layout.multi_piece:  # several blocks: each one's shards, cut from its part of the local array
                shards = tuple((idx, PieceCut(local, within), how) for glob, local in layout.pieces(rank)
                               for idx, within, how in block_shards(meta, glob, rank))
            else:
                region = layout.region(rank)
                shards = block_shards(meta, region, rank)
            part = RankPart(layout.local_shape(rank), bool(shards), region, shards)
            if _cache.parts < MAX_PARTS:
                self.parts[rank] = part
                _cache.parts += 1  # a lost count under a race only lets a few more parts be kept
        return part


@dataclass(frozen=True)
class BoxCut:
    """A shard's part of a flat-range rank's 1-d local array: box ``shape`` at ``offset``, then ``within``."""

    offset: int
    shape: tuple[int, ...]
    within: tuple[Any, ...]


@dataclass(frozen=True)
class PieceCut:
    """A shard's part of the local array of a rank holding several blocks: the block at ``local``, then
    ``within``."""

    local: tuple[slice, ...]
    within: tuple[Any, ...]


def take(local: Any, within: Any) -> Any:
    """``local[within]``, or the part a :class:`BoxCut` (:class:`PieceCut`) names of a rank's local array."""
    if isinstance(within, PieceCut):
        return local[within.local][within.within]
    if isinstance(within, BoxCut):
        box = local.reshape(-1)[within.offset : within.offset + math.prod(within.shape)].reshape(within.shape)
        return box[within.within]
    return local[within]


def block_shards(meta: ArrayMeta, region: tuple[slice, ...], rank: int | None = None
                 ) -> tuple[tuple[tuple[int, ...], tuple[Any, ...], bytes], ...]:
    """The shards a block of ``region`` covers (those ``rank`` writes, if given): (grid index, the slices of
    the block's array holding it, its encoding) each."""
    out = []
    for idx in meta.shards_in(region):
        if rank is not None and meta.writer(idx) != rank:
            continue
        within = tuple(slice(s.start - r.start, s.stop - r.start) for s, r in zip(meta.shard_region(idx), region,
                                                                                   strict=True))
        out.append((idx, (*within, ...), shard_encoding(meta, idx)))  # the Ellipsis keeps 0-d an array
    return tuple(out)


class _Cache:
    """The process's plans by key, and how many rank parts they hold."""

    def __init__(self) -> None:
        self.plans: dict[tuple[Any, ...], TensorPlan] = {}
        self.parts = 0
        self.lock = threading.Lock()


_cache = _Cache()


def tensor_plan(name: str, layout: Layout, dtype: str, settings: Settings) -> TensorPlan:
    """The plan of tensor ``name`` saved under ``layout`` as ``dtype`` (cached per process)."""
    key = (name, layout.to_json_text(), dtype, settings)  # the text: equal layouts with another origin differ
    plan = _cache.plans.get(key)
    if plan is None:
        meta = array_meta(name, layout, dtype, settings)
        rec = tensor_record(meta)
        plan = TensorPlan(meta, rec, record_text(name, rec, layout))
        with _cache.lock:
            if len(_cache.plans) >= MAX_PLANS:
                _cache.plans.clear()
                _cache.parts = 0
            _cache.plans[key] = plan
    return plan


def array_meta(name: str, layout: Layout, dtype: str, settings: Settings) -> ArrayMeta:
    """The array record a tensor is stored with (the shard grid by
    :func:`reshard.store.format.grid.choose_grid`, the inner chunk by size)."""
    grid = choose_grid(layout, settings.grid, settings.single_writer, balance=settings.balance)
    shard = grid.shard
    itemsize = numpy_dtype(dtype).itemsize
    size = math.prod(shard) * itemsize
    # A small shard is one chunk: readers fetch it whole anyway (SMALL_SHARD_BYTES),
    # and splitting it by divisors of a prime row count would give one chunk (and crc) per row.
    target = min(settings.chunk_bytes, size if size <= SMALL_SHARD_BYTES else max(MIN_CHUNK_BYTES, size // 16))
    chunk = inner_chunk_shape(grid.divisor(), itemsize, target)
    if isinstance(layout, FlatLayout) and not settings.single_writer and grid.edges is not None:
        chunk = grid.shard  # every cell its own chunk, no sharding codec (ArrayMeta.sharded; docs/format.md)
    return ArrayMeta(
        name=name,
        shape=tuple(layout.shape),
        dtype=dtype,
        shard=shard,
        chunk=chunk,
        layout=layout,
        checksums=settings.checksums,
        compressor=settings.compression,
        origin=layout.origin,
        edges=grid.edges,
    )

