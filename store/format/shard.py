"""Reading shards (zarr v3 ``sharding_indexed`` objects; :mod:`.encode` writes them and describes their bytes).

Reading is planned first (plain records you can print),
then executed: adjacent chunk reads of one shard are coalesced into one request,
and chunks that land contiguously in the destination are read straight into it.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from reshard.layouts.errors import ChecksumError, FormatError

from ..io.storage import Storage
from .encode import bytes_view, crc32c, decompress, one_chunk_index
from .meta import MISSING, ArrayMeta

Region = tuple[slice, ...]
#: Shards up to this many bytes are read whole (index and data in one request)
#: and written as one inner chunk.
SMALL_SHARD_BYTES = 256 << 10


def decode_index(data: bytes, meta: ArrayMeta, key: str, shard: tuple[int, ...] | None = None,
                 where: str = "") -> np.ndarray:
    """Parse and check the index of the shard at grid index ``shard``; returns an ``(n, 2)`` uint64 array.

    ``where``: the object (and range) the shard was read from, for messages.
    """
    at = f" ({where})" if where else ""
    if len(data) != meta.index_nbytes(shard):
        raise FormatError(f"tensor {meta.name!r}: shard {key!r}{at} is shorter than its index (truncated)")
    raw, crc = data[:-4], data[-4:]
    if crc32c(raw) != int.from_bytes(crc, "little"):
        raise ChecksumError(f"tensor {meta.name!r}: shard index of {key!r}{at} fails its crc32c")
    index = np.frombuffer(raw, dtype="<u8").reshape(-1, 2)
    if meta.compressor is None:  # every stored chunk is its raw bytes (+ its crc32c): the metadata must agree
        want = meta.plain_chunk_nbytes
        sizes = index[index[:, 0] != MISSING, 1]
        if sizes.size and not (sizes == want).all():
            raise FormatError(f"tensor {meta.name!r}: shard {key!r} holds chunks of {int(sizes[sizes != want][0])} "
                              f"bytes where its metadata ({meta.dtype}, chunk {list(meta.chunk)}, checksums "
                              f"{meta.checksums}) means {want}: the metadata was edited or the shard is not its own")
    return index


# --------------------------------------------------------------------- plan
class ChunkRead(NamedTuple):
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


def _chunk_parts(meta: ArrayMeta, shard: tuple[int, ...], region: Region, shape: tuple[int, ...] = ()
                 ) -> Iterator[tuple[int, Region, Region, Region, bool, bool]]:
    """Per inner chunk meeting ``region``: flat index, global chunk region, ``src``,
    ``dst``, whether the chunk is wanted whole, and whether ``dst`` is one
    contiguous run of a C-contiguous destination of ``shape`` (when given).

    Per-dim options are computed once, then combined (W3 plans some 1,500 chunk
    reads per rank, so the per-chunk cost matters).
    """
    per = meta.chunks_in(shard)
    grid = meta.chunk_grid
    dims = []
    for d, (i, s, k, r) in enumerate(zip(shard, grid.extent(shard), meta.chunk, region, strict=True)):
        base = grid.start(d, i)
        lo = max(r.start, base) - base
        hi = min(r.stop, base + s, meta.shape[d]) - base
        full = shape[d] if shape else -1
        opts = []
        for j in range(lo // k, -(-hi // k)) if hi > lo else ():
            c0 = base + j * k
            a, b = max(c0, r.start), min(c0 + k, r.stop)
            opts.append((j, slice(c0, c0 + k), slice(a - c0, b - c0), slice(a - r.start, b - r.start),
                         a == c0 and b == c0 + k, b - a == full, b - a == 1))
        dims.append(opts)
    step = [math.prod(per[d + 1:]) for d in range(len(per))]
    for combo in itertools.product(*dims):
        js, chunk, src, dst, whole, fulls, ones = zip(*combo, strict=True)
        yield sum(map(operator.mul, js, step)), chunk, src, dst, all(whole), _run(fulls, ones)


def _run(fulls: tuple[bool, ...], ones: tuple[bool, ...]) -> bool:
    """A region is one run of a C-order array when every dim before the last
    partial dim has extent 1 (numpy's C-contiguity of the view, without the view)."""
    for d in range(len(fulls) - 1, -1, -1):
        if not fulls[d]:
            return all(ones[:d])
    return True


def plan_reads(
    meta: ArrayMeta, region: Region, index: np.ndarray | None, shard: tuple[int, ...], key: str,
    dest: np.ndarray | None = None,
) -> list[ChunkRead]:
    """Chunk reads of one shard for a destination array covering ``region``.

    ``dest`` (when given) lets the planner mark reads that can land directly.
    """
    if not meta.shape:  # 0-d: one chunk, the whole object
        return [ChunkRead(key, 0, -1, (), (), False)]
    assert index is not None
    pairs = index.tolist()
    plain = dest is not None and meta.compressor is None
    contiguous = dest is not None and bool(dest.flags.c_contiguous)
    if plain and contiguous:
        rows = _plan_rows(meta, region, pairs, shard, key)
        if rows is not None:
            return rows
    return _plan_chunks(meta, region, pairs, shard, key, dest)


def _plan_chunks(meta: ArrayMeta, region: Region, pairs: list[list[int]], shard: tuple[int, ...], key: str,
                 dest: np.ndarray | None) -> list[ChunkRead]:
    """:func:`plan_reads` in general: every inner chunk meeting ``region``, dim by dim."""
    plain = dest is not None and meta.compressor is None
    contiguous = dest is not None and bool(dest.flags.c_contiguous)
    shape = dest.shape if dest is not None and contiguous else ()
    out = []
    for flat, _, src, dst, whole, run in _chunk_parts(meta, shard, region, shape):
        off, n = pairs[flat]
        if off == _MISSING:
            raise FormatError(
                f"tensor {meta.name!r}: chunk {flat} of {key!r} is missing inside the array"
            )
        direct = plain and whole and (run if contiguous else _view_contiguous(dest, dst))
        out.append(ChunkRead(key, off, n, src, dst, direct))
    return out


_MISSING = int(MISSING)


def _plan_rows(meta: ArrayMeta, region: Region, pairs: list[list[int]], shard: tuple[int, ...],
               key: str) -> list[ChunkRead] | None:
    """:func:`plan_reads` when the inner chunks are runs of whole rows of the shard and ``region``
    takes the shard's whole extent along every other dim (into a C-contiguous destination).

    Then chunk ``j`` is rows ``j * chunk[0]`` on of the shard and lands as one run of the
    destination: no per-dim combinations to build. Balanced splits on a rectilinear grid
    have thousands of one-row chunks per shard; None when the case does not apply.
    """
    grid = meta.chunk_grid
    ext = grid.extent(shard)
    if meta.chunk[1:] != ext[1:]:
        return None
    for d in range(1, len(ext)):
        start, r = grid.start(d, shard[d]), region[d]
        if r.start != start or r.stop != start + ext[d] or r.stop > meta.shape[d]:
            return None
    trail = tuple(slice(0, e) for e in ext[1:])
    r0, base, k = region[0], grid.start(0, shard[0]), meta.chunk[0]
    lo, hi = max(r0.start, base), min(r0.stop, base + ext[0], meta.shape[0])
    out = []
    for j in range((lo - base) // k, -(-(hi - base) // k)) if hi > lo else ():
        c0 = base + j * k
        a, b = max(c0, lo), min(c0 + k, hi)
        off, n = pairs[j]
        if off == _MISSING:
            raise FormatError(f"tensor {meta.name!r}: chunk {j} of {key!r} is missing inside the array")
        out.append(ChunkRead(key, off, n, (slice(a - c0, b - c0), *trail), (slice(a - r0.start, b - r0.start), *trail),
                             a == c0 and b == c0 + k))
    return out


def _view_contiguous(dest: np.ndarray | None, dst: Region) -> bool:
    return dest is not None and bool(dest[dst].flags.c_contiguous)


def coalesce(reads: Iterable[ChunkRead], gap: int, max_bytes: int = 64 << 20,
             max_temp: int | None = None) -> list[Request]:
    """Merge reads of the same object whose byte ranges are at most ``gap`` apart.

    ``max_temp`` caps the bytes of a request that do not land directly (they go
    through a scratch buffer): small enough to stay in cache, never a big fresh
    allocation. Local files pass it; remote stores favour fewer requests.
    """
    out: list[Request] = []
    by_key: dict[str, list[ChunkRead]] = {}
    for r in reads:
        by_key.setdefault(r.key, []).append(r)
    for key, rs in by_key.items():
        rs.sort(key=lambda r: r.offset)
        group = [rs[0]]
        temp = 0 if rs[0].direct else rs[0].nbytes
        for r in rs[1:]:
            end = group[-1].offset + group[-1].nbytes
            more = 0 if r.direct else r.nbytes
            if (r.offset - end <= gap and r.offset + r.nbytes - group[0].offset <= max_bytes and r.offset >= end
                    and (max_temp is None or temp + more <= max_temp)):
                group.append(r)
                temp += more
            else:
                out.append(Request(key, group[0].offset, end, tuple(group)))
                group, temp = [r], more
        out.append(Request(key, group[0].offset, group[-1].offset + group[-1].nbytes, tuple(group)))
    return out


# ------------------------------------------------------------------ execute
class Target(NamedTuple):
    """Where one chunk read goes: its tensor's record and destination array."""

    meta: ArrayMeta
    dest: np.ndarray


def execute(storage: Storage, req: Request, meta: ArrayMeta, dest: np.ndarray,
            blob: memoryview | None = None) -> int:
    """Run one request: fetch its bytes, check crc32c, place every chunk.

    Chunks marked ``direct`` are read straight into ``dest``; the others (and
    the gaps) go through one scratch buffer, then are decoded into place.
    ``blob`` is the whole shard object when it was already fetched (small
    shards): chunks are then checked and decoded from it, nothing is fetched.
    Returns the bytes fetched from storage.
    """
    if req.stop < 0:  # 0-d tensor: read the whole object
        whole = storage.read(req.key)
        _place(memoryview(whole), req.reads[0], meta, dest)
        return len(whole)
    return execute_mixed(storage, req, [Target(meta, dest)] * len(req.reads), blob)


def execute_mixed(storage: Storage, req: Request, targets: Sequence[Target],
                  blob: memoryview | None = None) -> int:
    """:func:`execute` for a request whose reads go to several tensors (``targets[i]`` for ``req.reads[i]``).

    The packed form merges reads of neighbouring shards of different tensors
    into one request; each read is still checked and placed on its own.
    ``blob`` holds the request's bytes when already fetched (offsets relative to it).
    """
    flats: dict[int, memoryview | None] = {}
    for t in targets:
        if id(t.dest) not in flats:
            flats[id(t.dest)] = bytes_view(t.dest) if t.dest.flags.c_contiguous else None
    tails = [t.meta.crc_nbytes for t in targets]
    fetched = 0
    if blob is None:
        pieces = _fetch(storage, req, targets, flats, tails)
        fetched = req.nbytes
    else:
        for r, t in zip(req.reads, targets, strict=True):
            if r.offset + r.nbytes > blob.nbytes:
                raise FormatError(f"tensor {t.meta.name!r}: {storage.url}/{req.key} is shorter than its index says "
                                  "(truncated)")
        pieces = [(r, blob[r.offset : r.offset + r.nbytes - tail],
                   blob[r.offset + r.nbytes - tail : r.offset + r.nbytes])
                  for r, tail in zip(req.reads, tails, strict=True)]
    for (r, data, crc), (meta, dest), tail in zip(pieces, targets, tails, strict=True):
        if tail and crc32c(data) != int.from_bytes(crc, "little"):
            raise ChecksumError(
                f"tensor {meta.name!r}: chunk at byte {r.offset} of {storage.url}/{r.key} "
                "fails its crc32c (corrupted data)"
            )
        if not r.direct:
            _decode_into(data, r, meta, dest)
        elif blob is not None:
            _dest_bytes(dest, flats[id(dest)], r, data.nbytes)[:] = data
    return fetched


def _fetch(storage: Storage, req: Request, targets: Sequence[Target], flats: dict[int, memoryview | None],
           tails: Sequence[int]) -> list[tuple[ChunkRead, memoryview, memoryview]]:
    """One ``read_into`` for the whole request: (read, its data, its crc) per chunk."""
    gaps, temp, pos = 0, 0, req.start
    for r, tail in zip(req.reads, tails, strict=True):
        gaps = max(gaps, r.offset - pos)
        temp += 0 if r.direct else r.nbytes - tail
        pos = r.offset + r.nbytes
    scratch = bytes_view(np.empty(temp + gaps, dtype=np.uint8))  # not zero-filled, unlike bytearray
    crcs = memoryview(bytearray(sum(tails)))
    buffers: list[memoryview] = []
    pieces = []
    pos, at, c = req.start, gaps, 0  # scratch[:gaps] takes every gap in turn
    for r, (_, dest), tail in zip(req.reads, targets, tails, strict=True):
        if r.offset > pos:
            buffers.append(scratch[: r.offset - pos])
        body = r.nbytes - tail
        if r.direct:
            data = _dest_bytes(dest, flats[id(dest)], r, body)
        else:
            data, at = scratch[at : at + body], at + body
        crc, c = crcs[c : c + tail], c + tail
        buffers += [data, crc] if tail else [data]
        pieces.append((r, data, crc))
        pos = r.offset + r.nbytes
    storage.read_into(req.key, req.start, buffers)
    return pieces


def _dest_bytes(dest: np.ndarray, flat: memoryview | None, r: ChunkRead, nbytes: int) -> memoryview:
    """The bytes of ``dest[r.dst]`` (a contiguous run) as a writable view."""
    if flat is None:
        return bytes_view(dest[r.dst])
    start = sum(s.start * st for s, st in zip(r.dst, dest.strides, strict=True))
    return flat[start : start + nbytes]


def _place(data: memoryview, r: ChunkRead, meta: ArrayMeta, dest: np.ndarray) -> None:
    if meta.checksums:
        body, crc = data[:-4], data[-4:]
        if crc32c(body) != int.from_bytes(crc, "little"):
            raise ChecksumError(f"tensor {meta.name!r}: {r.key!r} fails its crc32c (corrupted data)")
        data = body
    _decode_into(data, r, meta, dest)


def _decode_into(data: memoryview, r: ChunkRead, meta: ArrayMeta, dest: np.ndarray) -> None:
    try:
        raw: Any = decompress(data, meta.plain_chunk_nbytes - meta.crc_nbytes) if meta.compressor == "zstd" else data
        chunk = np.frombuffer(raw, dtype=meta.np_dtype.newbyteorder("<")).reshape(meta.chunk)
    except (ValueError, RuntimeError, TypeError) as e:  # zstd's errors; a size that is not the chunk's
        raise FormatError(f"tensor {meta.name!r}: chunk at byte {r.offset} of {r.key!r} does not decode to "
                          f"{meta.dtype}{list(meta.chunk)} ({e})") from None
    dest[r.dst] = chunk[r.src]


# ------------------------------------------------------- small shards, direct
class WholeRead(NamedTuple):
    """A small one-chunk shard read straight into its destination (see :func:`whole_read`).

    ``offset``/``nbytes`` locate the shard in its object; ``body`` is the chunk's
    bytes in the destination, ``region`` the shard's region (for the general path).
    """

    meta: ArrayMeta
    key: str
    shard: tuple[int, ...]
    offset: int
    nbytes: int
    body: memoryview
    dest: np.ndarray
    region: Region


def whole_read(meta: ArrayMeta, shard: tuple[int, ...], region: Region, dest: np.ndarray, key: str,
               offset: int, nbytes: int) -> WholeRead | None:
    """A :class:`WholeRead` of a shard whose bytes can be laid out one way only, else None.

    That is a shard of one uncompressed chunk, wanted whole (``region`` is the
    shard's, unclipped), into a C-contiguous destination of the stored dtype,
    whose stored length is the chunk, its crc and the index: then the chunk is
    the first bytes and is read straight into the destination. What the index
    says is checked after the read (:func:`execute_whole`).
    """
    if meta.compressor is not None or not meta.shape or not dest.flags.c_contiguous or dest.dtype != meta.np_dtype:
        return None
    ext = meta.chunk_grid.extent(shard)
    if ext != meta.chunk or ext != dest.shape or nbytes != dest.nbytes + meta.crc_nbytes + meta.index_nbytes(shard):
        return None
    if meta.shard_region(shard) != tuple(region):
        return None
    return WholeRead(meta, key, shard, offset, nbytes, bytes_view(dest), dest, region)


def execute_whole(storage: Storage, obj: str, reads: Sequence[WholeRead]) -> int:
    """Read shards of object ``obj`` (by offset, none overlapping) with one ``read_into``: each chunk
    straight into its destination, crcs, indexes and gaps into scratch; then check each shard.

    A shard whose index does not say "one chunk at 0" (valid, but not how reshard
    writes) is decoded the general way from its bytes. Returns the bytes fetched.
    """
    tails = [r.nbytes - r.body.nbytes for r in reads]
    gaps = [b.offset - (a.offset + a.nbytes) for a, b in itertools.pairwise(reads)]
    scratch = memoryview(bytearray(sum(tails) + max(gaps, default=0)))
    buffers: list[memoryview] = []
    ends, at = [], max(gaps, default=0)  # scratch[:max gap] takes every gap in turn
    for r, tail, gap in zip(reads, tails, [0, *gaps], strict=True):
        if gap:
            buffers.append(scratch[:gap])
        ends.append(scratch[at : at + tail])
        buffers += [r.body, ends[-1]]
        at += tail
    start = reads[0].offset
    storage.read_into(obj, start, buffers)
    for r, end in zip(reads, ends, strict=True):
        crc = r.meta.crc_nbytes
        if end[crc:] != one_chunk_index(r.body.nbytes + crc):  # then decode it, checked
            index = decode_index(bytes(end[crc:]), r.meta, r.key, r.shard,
                                 f"{storage.url}/{obj} bytes {r.offset}+{r.nbytes}")
            blob = memoryview(bytes(r.body) + bytes(end))
            planned = plan_reads(r.meta, r.region, index, r.shard, r.key, r.dest)
            execute_mixed(storage, Request(r.key, 0, r.nbytes, tuple(planned)), [Target(r.meta, r.dest)] * len(planned),
                          blob)
        elif crc and crc32c(r.body) != int.from_bytes(end[:4], "little"):
            raise ChecksumError(f"tensor {r.meta.name!r}: shard {r.key!r} at byte {r.offset} of {storage.url}/{obj} "
                                "fails its crc32c (corrupted data)")
    return reads[-1].offset + reads[-1].nbytes - start
