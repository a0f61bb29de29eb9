"""Shard objects: encode them, plan reads from them, run the reads.

A shard is a zarr v3 ``sharding_indexed`` object: inner chunks one after
another (each ``bytes`` [+ ``zstd``] [+ 4-byte ``crc32c``]), then the index
(``(offset, nbytes)`` as little-endian uint64 per inner chunk, C order) and the
index's own crc32c. Reading is planned first (plain records you can print),
then executed: adjacent chunk reads of one shard are coalesced into one request,
and chunks that land contiguously in the destination are read straight into it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import crc32c as _crc
import numpy as np
from reshard.layouts.errors import ChecksumError, FormatError

from .format import MISSING, ArrayMeta
from .storage import Storage

Region = tuple[slice, ...]


def crc32c(data: Any) -> int:
    return int(_crc.crc32c(data))


def _bytes_view(a: np.ndarray) -> memoryview:
    flat: Any = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return memoryview(flat)


def _zstd() -> Any:
    from numcodecs import Zstd

    return Zstd(level=3)


# ------------------------------------------------------------------- encode
def encode_chunk(data: np.ndarray, meta: ArrayMeta) -> list[Any]:
    """Stored bytes of one chunk as a list of buffers (data [, crc32c])."""
    view: Any = _bytes_view(data.astype(data.dtype.newbyteorder("<"), copy=False))
    if meta.compressor == "zstd":
        view = _zstd().encode(view)
    if not meta.checksums:
        return [view]
    return [view, crc32c(view).to_bytes(4, "little")]


def encode_shard(data: np.ndarray, meta: ArrayMeta) -> list[Any]:
    """Stored bytes of one shard (``data`` is its region, clipped at array edges)."""
    if not meta.shape:
        return encode_chunk(data, meta)
    per = meta.chunks_per_shard
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


def decode_index(data: bytes, meta: ArrayMeta, key: str) -> np.ndarray:
    """Parse and check a shard index; returns an ``(n, 2)`` uint64 array."""
    raw, crc = data[:-4], data[-4:]
    if crc32c(raw) != int.from_bytes(crc, "little"):
        raise ChecksumError(f"tensor {meta.name!r}: shard index of {key!r} fails its crc32c")
    return np.frombuffer(raw, dtype="<u8").reshape(-1, 2)


# --------------------------------------------------------------------- plan
@dataclass(frozen=True)
class ChunkRead:
    """One inner chunk to read and where its wanted part goes.

    ``offset``/``nbytes`` locate the stored bytes (crc included) in shard ``key``;
    ``src`` selects inside the decoded chunk, ``dst`` inside the destination.
    ``direct`` means the bytes are read straight into the destination.
    """

    key: str
    offset: int
    nbytes: int
    src: Region
    dst: Region
    direct: bool


@dataclass(frozen=True)
class Request:
    """One storage request: a byte range of one object covering several chunk reads."""

    key: str
    start: int
    stop: int
    reads: tuple[ChunkRead, ...]

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def chunks_in(meta: ArrayMeta, shard: tuple[int, ...], region: Region) -> Iterator[tuple[int, Region]]:
    """(flat index in shard, global chunk region) of inner chunks meeting ``region``."""
    per = meta.chunks_per_shard
    ranges = []
    for d, (i, s, k, r) in enumerate(zip(shard, meta.shard, meta.chunk, region, strict=True)):
        lo = max(r.start, i * s) - i * s
        hi = min(r.stop, (i + 1) * s, meta.shape[d]) - i * s
        ranges.append(range(lo // k, -(-hi // k)) if hi > lo else range(0))
    for c in itertools.product(*ranges):
        flat = int(np.ravel_multi_index(c, per)) if per else 0
        yield flat, tuple(
            slice(i * s + j * k, i * s + (j + 1) * k)
            for i, s, j, k in zip(shard, meta.shard, c, meta.chunk, strict=True)
        )


def plan_reads(
    meta: ArrayMeta, region: Region, index: np.ndarray | None, shard: tuple[int, ...], key: str,
    dest: np.ndarray | None = None,
) -> list[ChunkRead]:
    """Chunk reads of one shard for a destination array covering ``region``.

    ``dest`` (when given) lets the planner mark reads that can land directly.
    """
    out = []
    if not meta.shape:  # 0-d: one chunk, the whole object
        return [ChunkRead(key, 0, -1, (), (), False)]
    assert index is not None
    for flat, chunk in chunks_in(meta, shard, region):
        off, n = (int(x) for x in index[flat])
        if index[flat][0] == MISSING:
            raise FormatError(
                f"tensor {meta.name!r}: chunk {flat} of {key!r} is missing inside the array"
            )
        inter = tuple(
            slice(max(c.start, r.start), min(c.stop, r.stop)) for c, r in zip(chunk, region, strict=True)
        )
        src = tuple(slice(i.start - c.start, i.stop - c.start) for i, c in zip(inter, chunk, strict=True))
        dst = tuple(slice(i.start - r.start, i.stop - r.start) for i, r in zip(inter, region, strict=True))
        direct = (
            dest is not None
            and meta.compressor is None
            and inter == chunk
            and dest[dst].flags.c_contiguous
        )
        out.append(ChunkRead(key, off, n, src, dst, direct))
    return out


def coalesce(reads: Iterable[ChunkRead], gap: int, max_bytes: int = 64 << 20) -> list[Request]:
    """Merge reads of the same object whose byte ranges are at most ``gap`` apart."""
    out: list[Request] = []
    by_key: dict[str, list[ChunkRead]] = {}
    for r in reads:
        by_key.setdefault(r.key, []).append(r)
    for key, rs in by_key.items():
        rs.sort(key=lambda r: r.offset)
        group = [rs[0]]
        for r in rs[1:]:
            end = group[-1].offset + group[-1].nbytes
            if r.offset - end <= gap and r.offset + r.nbytes - group[0].offset <= max_bytes and r.offset >= end:
                group.append(r)
            else:
                out.append(Request(key, group[0].offset, end, tuple(group)))
                group = [r]
        out.append(Request(key, group[0].offset, group[-1].offset + group[-1].nbytes, tuple(group)))
    return out


# ------------------------------------------------------------------ execute
def execute(storage: Storage, req: Request, meta: ArrayMeta, dest: np.ndarray,
            blob: memoryview | None = None) -> int:
    """Run one request: fetch its bytes, check crc32c, place every chunk.

    ``blob`` is the whole shard object when it was already fetched (small shards).
    Returns the bytes fetched from storage.
    """
    if req.stop < 0:  # 0-d tensor: read the whole object
        whole = storage.read(req.key)
        _place(memoryview(whole), req.reads[0], meta, dest)
        return len(whole)
    buffers: list[memoryview] = []
    temps: list[tuple[ChunkRead, memoryview, memoryview]] = []
    pos, gaps = req.start, []
    for r in req.reads:
        gaps.append(r.offset - pos)
        pos = r.offset + r.nbytes
    gap = memoryview(bytearray(max(gaps)))  # one scratch buffer serves every gap
    for r, skip in zip(req.reads, gaps, strict=True):
        if skip:
            buffers.append(gap[:skip])
        body = r.nbytes - 4 if meta.checksums else r.nbytes
        data = _bytes_view(dest[r.dst]) if r.direct else memoryview(bytearray(body))
        crc = memoryview(bytearray(4 if meta.checksums else 0))
        buffers += [data, crc] if meta.checksums else [data]
        temps.append((r, data, crc))
    if blob is None:
        storage.read_into(req.key, req.start, buffers)
        fetched = req.nbytes
    else:
        fetched = 0
        at = req.start
        for b in buffers:
            b[:] = blob[at : at + b.nbytes]
            at += b.nbytes
    for r, data, crc in temps:
        if meta.checksums and crc32c(data) != int.from_bytes(crc, "little"):
            raise ChecksumError(
                f"tensor {meta.name!r}: chunk at byte {r.offset} of {storage.url}/{r.key} "
                "fails its crc32c (corrupted data)"
            )
        if not r.direct:
            _decode_into(data, r, meta, dest)
    return fetched


def _place(data: memoryview, r: ChunkRead, meta: ArrayMeta, dest: np.ndarray) -> None:
    if meta.checksums:
        body, crc = data[:-4], data[-4:]
        if crc32c(body) != int.from_bytes(crc, "little"):
            raise ChecksumError(f"tensor {meta.name!r}: {r.key!r} fails its crc32c (corrupted data)")
        data = body
    _decode_into(data, r, meta, dest)


def _decode_into(data: memoryview, r: ChunkRead, meta: ArrayMeta, dest: np.ndarray) -> None:
    raw: Any = _zstd().decode(data) if meta.compressor == "zstd" else data
    chunk = np.frombuffer(raw, dtype=meta.np_dtype.newbyteorder("<")).reshape(meta.chunk)
    dest[r.dst] = chunk[r.src]
