"""Encoding shards: the bytes of a zarr v3 ``sharding_indexed`` object, and the shared byte helpers.

A shard is inner chunks one after another (each ``bytes`` [+ ``zstd``] [+ 4-byte
``crc32c``]), then the index (``(offset, nbytes)`` as little-endian uint64 per inner
chunk, C order) and the index's own crc32c. :func:`encode_shard` returns them as a
list of buffers for one gathered write; :mod:`.shard` plans and runs the reads.
"""

from __future__ import annotations

import itertools
import math
import struct
from typing import Any

import crc32c as _crc
import numpy as np

from .meta import MISSING, ArrayMeta

#: Inner chunks of at least this many bytes are written from views of the caller's array (one buffer and
#: one crc each, gathered by ``writev``); smaller ones are copied into one buffer with their crcs between.
VIEW_CHUNK_BYTES = 64 << 10


def crc32c(data: Any) -> int:
    """The crc32c of a buffer, as a Python int."""
    return int(_crc.crc32c(data))


def bytes_view(a: np.ndarray) -> memoryview:
    """An array's bytes in C order as a flat memoryview (copied only if not contiguous)."""
    flat: Any = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return memoryview(flat)


def zstd() -> Any:
    """The zstd codec reshard writes with (level 3)."""
    from numcodecs import Zstd

    return Zstd(level=3)


def decompress(data: Any, nbytes: int) -> np.ndarray:
    """Decode one zstd chunk into exactly ``nbytes`` bytes, never more (a chunk's decoded size is known).

    A chunk whose frame declares another size, or that inflates past
    ``nbytes`` (a "zip bomb": kilobytes that decode to gigabytes), is a
    ValueError before more than ``nbytes`` are allocated.
    """
    from numcodecs import zstd as _zstd

    declared = _zstd_content_size(data)
    if declared is not None and declared != nbytes:
        raise ValueError(f"its zstd frame declares {declared} bytes, not the chunk's {nbytes}")
    out = np.empty(nbytes, np.uint8)
    try:
        _zstd.decompress(data, out)
    except RuntimeError as e:  # too small a destination: it inflates past the chunk
        raise ValueError(str(e)) from None
    return out


def _zstd_content_size(data: Any) -> int | None:
    """The decoded size a zstd frame's header declares, or None (no such field, or not a zstd frame)."""
    head = bytes(memoryview(data)[:18])
    if len(head) < 6 or head[:4] != b"\x28\xb5\x2f\xfd":
        return None
    flags = head[4]
    single, size = (flags >> 5) & 1, (1 if (flags >> 5) & 1 else 0, 2, 4, 8)[flags >> 6]
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[flags & 3]
    if not size or len(head) < pos + size:
        return None
    value = int.from_bytes(head[pos : pos + size], "little")
    return value + 256 if size == 2 else value


def encode_chunk(data: np.ndarray, meta: ArrayMeta) -> list[Any]:
    """Stored bytes of one chunk as a list of buffers (data [, crc32c])."""
    view: Any = bytes_view(data.astype(data.dtype.newbyteorder("<"), copy=False))
    if meta.compressor == "zstd":
        view = zstd().encode(view)
    if not meta.checksums:
        return [view]
    return [view, crc32c(view).to_bytes(4, "little")]


def encode_shard(data: np.ndarray, meta: ArrayMeta, index_of: tuple[int, ...] | None = None) -> list[Any]:
    """Stored bytes of one shard (``data`` is its region, clipped at array edges).

    ``index_of`` is the shard's grid index (needed under a rectilinear grid,
    where shards differ in size).
    """
    if not meta.shape:
        return encode_chunk(data, meta)
    if not meta.sharded:  # a grid cell is one chunk (an edge cell of the array padded as zarr stores it)
        extent = meta.chunk_grid.extent(index_of if index_of is not None else (0,) * len(meta.shape))
        if data.shape != extent:
            full = np.zeros(extent, dtype=data.dtype)
            full[tuple(slice(0, k) for k in data.shape)] = data
            data = full
        return encode_chunk(data, meta)
    per = meta.chunks_in(index_of) if index_of is not None else meta.chunks_per_shard
    if data.shape == meta.chunk and math.prod(per) == 1:  # one whole chunk (every small shard): no index array
        chunk = encode_chunk(data, meta)
        return [*chunk, one_chunk_index(sum(memoryview(b).nbytes for b in chunk))]
    if meta.compressor is None and data.shape[1:] == meta.chunk[1:] and math.prod(per[1:]) == 1:
        return _encode_rows(data, meta, per[0])
    return _encode_chunks(data, meta, per)


def shard_encoding(meta: ArrayMeta, index: tuple[int, ...]) -> bytes:
    """What fixes shard ``index``'s stored bytes besides its values: dtype, shapes, chunks, codecs.

    Equal values with an equal description encode to equal bytes (the start
    of a shard's hash: :func:`reshard.store.write.incremental.digest`).
    """
    shape = tuple(s.stop - s.start for s in meta.shard_region(index)) if meta.shape else ()
    per: Any = (meta.chunks_in(index) if meta.sharded else "cell") if meta.shape else ()
    return f"{meta.dtype}/{shape}/{meta.chunk}/{per}/{meta.compressor}/{meta.checksums};".encode()


def one_chunk_index(stored: int) -> bytes:
    """The index of a shard holding one chunk of ``stored`` bytes (crc included) at offset 0, with its crc32c."""
    raw = _ONE_CHUNK.pack(0, stored)
    return raw + crc32c(raw).to_bytes(4, "little")


_ONE_CHUNK = struct.Struct("<QQ")


def _encode_chunks(data: np.ndarray, meta: ArrayMeta, per: tuple[int, ...]) -> list[Any]:
    """:func:`encode_shard`, one inner chunk at a time (``per``: chunks along each dim)."""
    index = np.full((math.prod(per), 2), MISSING, dtype="<u8")
    parts: list[Any] = []
    offset = 0
    for n, c in enumerate(itertools.product(*map(range, per))):
        sub = tuple(
            slice(i * k, min((i + 1) * k, s)) for i, k, s in zip(c, meta.chunk, data.shape, strict=True)
        )
        if any(s.start >= s.stop for s in sub):
            continue  # wholly outside the array: left missing, as zarr does
        piece = data[sub]
        if piece.shape != meta.chunk:  # edge chunk: zarr stores it padded to full size
            full = np.zeros(meta.chunk, dtype=data.dtype)
            full[tuple(slice(0, k) for k in piece.shape)] = piece
            piece = full
        chunk = encode_chunk(piece, meta)
        size = sum(memoryview(b).nbytes for b in chunk)
        index[n] = (offset, size)
        parts += chunk
        offset += size
    raw = index.tobytes()
    return [*parts, raw, crc32c(raw).to_bytes(4, "little")]


def _encode_rows(data: np.ndarray, meta: ArrayMeta, count: int) -> list[Any]:
    """:func:`encode_shard` when every inner chunk is a run of whole rows of ``data`` (no compression).

    The chunks are then consecutive byte ranges of ``data``: one buffer holds
    them with their crc32c interleaved, and the index is arithmetic. This is the
    common case (inner chunks keep trailing dims whole), and under a rectilinear
    grid of a balanced split it is thousands of one-row chunks per shard, which
    the general loop would encode one small array at a time.
    """
    rows = meta.chunk[0]
    size = math.prod(meta.chunk) * data.dtype.itemsize
    flat = np.ascontiguousarray(data.astype(data.dtype.newbyteorder("<"), copy=False)).reshape(-1).view(np.uint8)
    whole = min(count, data.shape[0] // rows)  # chunks holding full rows; the rest are padded or missing
    stored = size + meta.crc_nbytes
    index = np.full((count, 2), MISSING, dtype="<u8")
    if meta.checksums and size >= VIEW_CHUNK_BYTES:  # chunks as views of data, each with its crc: no copy
        parts: list[Any] = []
        for c in flat[: whole * size].reshape(whole, size):
            parts += [bytes_view(c), crc32c(c).to_bytes(4, "little")]
    elif meta.checksums:  # many small chunks (a balanced split's one-row chunks): one buffer, crcs interleaved
        body = np.empty((whole, stored), dtype=np.uint8)
        chunks = flat[: whole * size].reshape(whole, size)
        body[:, :size] = chunks
        crcs = np.fromiter(map(_crc.crc32c, chunks), dtype="<u4", count=whole)  # type: ignore[arg-type]  # C, 6,000+ calls
        body[:, size:] = crcs.view(np.uint8).reshape(whole, 4)
        parts = [bytes_view(body)]
    else:
        parts = [bytes_view(flat[: whole * size])]
    index[:whole, 0] = np.arange(whole, dtype="<u8") * stored
    index[:whole, 1] = stored
    offset = whole * stored
    if whole < count and whole * rows < data.shape[0]:  # a last, partial chunk at the array's end
        full = np.zeros(meta.chunk, dtype=data.dtype)
        tail = data[whole * rows :]
        full[: tail.shape[0]] = tail
        chunk = encode_chunk(full, meta)
        parts += chunk
        index[whole] = (offset, sum(memoryview(b).nbytes for b in chunk))
    raw = index.tobytes()
    return [*parts, raw, crc32c(raw).to_bytes(4, "little")]


def plain_index(meta: ArrayMeta, shard: tuple[int, ...]) -> np.ndarray:
    """The index :func:`encode_shard` writes for shard ``shard`` of an uncompressed array, without reading it.

    Every inner chunk that starts inside the array is stored padded to full size,
    with its crc32c, one after another in C order; a chunk wholly past the array's
    end (in an edge shard of a regular grid) is missing. Returns the ``(n, 2)``
    uint64 index; the shard's stored length is ``stored_bytes(meta, shard, index)``.
    """
    if meta.compressor is not None:
        raise ValueError("plain_index: the shard is compressed (its chunk sizes are known only from its index)")
    per = meta.chunks_in(shard)
    clipped = [s.stop - s.start for s in meta.shard_region(shard)]
    present = np.ones(per, dtype=bool)
    for d, (n, k, extent) in enumerate(zip(per, meta.chunk, clipped, strict=True)):
        starts_inside = np.arange(n) * k < extent
        present &= starts_inside.reshape((1,) * d + (n,) + (1,) * (len(per) - d - 1))
    flat = present.reshape(-1)
    stored = meta.plain_chunk_nbytes
    index = np.full((flat.size, 2), MISSING, dtype="<u8")
    index[flat, 0] = np.arange(int(flat.sum()), dtype="<u8") * np.uint64(stored)
    index[flat, 1] = stored
    return index


def stored_bytes(meta: ArrayMeta, shard: tuple[int, ...], index: np.ndarray) -> int:
    """The stored length of shard ``shard`` whose chunks are laid out back to back as ``index`` says."""
    present = index[:, 0] != MISSING
    return int(index[present, 1].sum()) + meta.index_nbytes(shard)
