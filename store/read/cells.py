"""Reading arrays stored without the sharding codec: every grid cell is one chunk.

A flat-range layout saved by its ranks (docs/format.md, "Flattened-range
layouts") stores each cell of its rectilinear grid as one zarr chunk: its bytes
(little endian) [+ zstd] [+ crc32c], no index (``ArrayMeta.sharded`` is False).
A read fetches each cell it meets whole (one object in the directory form, one
byte range of a data object in the packed form, located as the sharded reader
locates shards), checks its crc32c, and copies the wanted part into each
destination. Cells are bounded in size by the writer
(:data:`reshard.store.format.grid.FLAT_CELL_ELEMENTS` elements' worth of rows).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np
from reshard.layouts.errors import ChecksumError, FormatError

from ..format.encode import crc32c, decompress
from ..format.meta import ArrayMeta
from ..io import pool
from ..io.stats import IOStats

if TYPE_CHECKING:
    from .fetch import Fetcher

Region = tuple[slice, ...]


def read_cells(fetcher: Fetcher, jobs: list[tuple[ArrayMeta, Region, np.ndarray]]) -> IOStats:
    """Fill the destinations of ``jobs`` (arrays whose ``sharded`` is False) from their cells."""
    wanted: dict[str, tuple[ArrayMeta, tuple[int, ...]]] = {}
    for meta, region, _ in jobs:
        for idx in meta.shards_in(region):
            wanted.setdefault(meta.shard_key(idx), (meta, idx))
    keys = list(wanted)
    located_by = IOStats()
    if fetcher.locator is not None:
        locations, located_by = fetcher.locator.locate_all([(m, i, k) for k, (m, i) in wanted.items()])
        where: dict[str, Any] = dict(zip(keys, locations, strict=True))
    else:
        where = {}
    sizes = [_stored_max(*wanted[k]) for k in keys]
    cells = pool.run_batched([functools.partial(_fetch, fetcher, k, *wanted[k], where.get(k)) for k in keys], sizes,
                             fetcher.storage.local)
    by_key = dict(zip(keys, cells, strict=True))
    delivered = 0
    for meta, region, dest in jobs:
        for idx in meta.shards_in(region):
            cell = by_key[meta.shard_key(idx)][0]
            box = meta.shard_region(idx)
            lo = [max(r.start, b.start) for r, b in zip(region, box, strict=True)]
            hi = [min(r.stop, b.stop) for r, b in zip(region, box, strict=True)]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            src = tuple(slice(a - b.start, z - b.start) for a, z, b in zip(lo, hi, box, strict=True))
            dst = tuple(slice(a - r.start, z - r.start) for a, z, r in zip(lo, hi, region, strict=True))
            dest[dst] = cell[src]
        delivered += dest.nbytes
    fetched = sum(n for _, n in cells)
    fetcher.storage.count(bytes_delivered=delivered, tasks=len(keys))
    return IOStats(requests=located_by.requests + len(keys), bytes_fetched=located_by.bytes_fetched + fetched,
                   bytes_delivered=delivered, tasks=len(keys))


def _stored_max(meta: ArrayMeta, idx: tuple[int, ...]) -> int:
    """The most bytes a cell's chunk may take (zstd may grow one a little)."""
    raw = math.prod(meta.chunk_grid.extent(idx)) * meta.np_dtype.itemsize
    return raw + (raw // 64 + 4096 if meta.compressor else 0) + meta.crc_nbytes


def _fetch(fetcher: Fetcher, key: str, meta: ArrayMeta, idx: tuple[int, ...], location: Any
           ) -> tuple[np.ndarray, int]:
    """One cell, checked and decoded (its extent: an edge cell of a regular grid is clipped), and the bytes read."""
    limit = _stored_max(meta, idx)
    try:
        if location is None:
            data = fetcher.storage.read(key, limit=limit)
        else:
            obj, off, n = location
            if n > limit:
                raise FormatError(f"tensor {meta.name!r}: chunk {key!r} is {n} bytes, more than its cell can take")
            buf = bytearray(n)
            fetcher.root.read_into(obj, off, [memoryview(buf)])
            data = bytes(buf)
    except FileNotFoundError:
        raise FormatError(f"tensor {meta.name!r}: chunk {key!r} is missing from {fetcher.url}") from None
    body, tail = (data[:-4], data[-4:]) if meta.checksums else (data, b"")
    if meta.checksums and (len(data) < 4 or crc32c(body) != int.from_bytes(tail, "little")):
        raise ChecksumError(f"tensor {meta.name!r}: chunk {key!r} of {fetcher.url} fails its crc32c (corrupted data)")
    extent = meta.chunk_grid.extent(idx)
    nbytes = math.prod(extent) * meta.np_dtype.itemsize
    try:
        raw: Any = decompress(body, nbytes) if meta.compressor == "zstd" else body
        cell = np.frombuffer(raw, dtype=meta.np_dtype.newbyteorder("<")).reshape(extent)
    except (ValueError, RuntimeError, TypeError) as e:
        raise FormatError(f"tensor {meta.name!r}: chunk {key!r} does not decode to {meta.dtype}{list(extent)} "
                          f"({e})") from None
    clipped = tuple(slice(0, r.stop - r.start) for r in meta.shard_region(idx))
    return cell[clipped], len(data)
