"""Packed data objects: many shards back to back in one object, written once, read by range.

A writer (a rank, or one task of a block writer) hands its encoded shards to
:func:`write_pack`; they go back to back into ``packed/<writer>-<part>.bin``
under the save's generation, a new part once one holds ``max_bytes``, and the
call returns where each shard landed. Readers fetch byte ranges of such objects
with :func:`read_ranges`, which merges ranges of one object whose gap costs less
than a request (the cost model in docs/performance.md: ``gap`` bytes, about
64 KiB on local disk and 1 MiB on object stores).

Knows nothing of zarr: keys, byte ranges and buffers only.
"""

from __future__ import annotations

import bisect
import functools
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from . import pool
from .storage import Storage

#: Upper bound of one merged range request.
MAX_REQUEST_BYTES = 64 << 20


def write_pack(storage: Storage, prefix: str, writer: str, blobs: Sequence[tuple[str, Sequence[Any]]],
               max_bytes: int) -> dict[str, tuple[str, int, int]]:
    """Write blobs back to back into data objects; return ``{blob key: (object, offset, length)}``.

    Parameters
    ----------
    storage : Storage
        The checkpoint root.
    prefix : str
        Folder of the objects under the root (``gen-<id>/packed``).
    writer : str
        Unique per writer of the save (a rank number, or a random token).
    blobs : sequence of (key, buffers)
        Each blob's bytes as a list of buffers, in the order they go.
    max_bytes : int
        A new object starts once the current one holds at least this many bytes.

    Objects are named ``<prefix>/<writer>-<part>.bin`` and written in parallel,
    each with one request (local: ``writev``; remote: one PUT, streamed as a
    multipart upload when large).
    """
    where: dict[str, tuple[str, int, int]] = {}
    objects: list[tuple[str, list[Any]]] = []
    offset = max_bytes  # start a first object on the first blob
    for key, parts in blobs:
        size = sum(memoryview(p).nbytes for p in parts)
        if offset >= max_bytes:
            objects.append((f"{prefix}/{writer}-{len(objects)}.bin", []))
            offset = 0
        name, buffers = objects[-1]
        buffers += parts
        where[key] = (name, offset, size)
        offset += size
    pool.run_all([functools.partial(storage.write, name, buffers) for name, buffers in objects], storage.local)
    return where


def merge_ranges(ranges: Iterable[tuple[str, int, int]], gap: int,
                 max_bytes: int = MAX_REQUEST_BYTES) -> list[tuple[str, int, int]]:
    """Merge ``(object, start, stop)`` ranges into requests: one range per request.

    Two ranges of one object become one request when the gap between them is
    at most ``gap`` bytes (reading the gap costs less than another request) and
    the merged request stays within ``max_bytes``. Overlapping ranges merge.
    """
    out: list[tuple[str, int, int]] = []
    for key, start, stop in sorted(ranges):
        if out and out[-1][0] == key and start - out[-1][2] <= gap and max(stop, out[-1][2]) - out[-1][1] <= max_bytes:
            out[-1] = (key, out[-1][1], max(stop, out[-1][2]))
        else:
            out.append((key, start, stop))
    return out


class Spans:
    """Byte ranges fetched from objects, looked up by (object, start, stop)."""

    def __init__(self) -> None:
        self._starts: dict[str, list[int]] = {}
        self._spans: dict[str, list[tuple[int, memoryview]]] = {}
        self._lock = threading.Lock()

    def add(self, key: str, start: int, data: memoryview) -> None:
        with self._lock:
            starts, spans = self._starts.setdefault(key, []), self._spans.setdefault(key, [])
            at = bisect.bisect(starts, start)
            starts.insert(at, start)
            spans.insert(at, (start, data))

    def get(self, key: str, start: int, stop: int) -> memoryview | None:
        """The bytes ``[start, stop)`` of ``key`` if one fetched span holds them all, else None."""
        starts = self._starts.get(key)
        if not starts:
            return None
        at = bisect.bisect(starts, start) - 1
        if at < 0:
            return None
        s0, data = self._spans[key][at]
        if stop - s0 > data.nbytes:
            return None
        return data[start - s0 : stop - s0]


def read_ranges(storage: Storage, ranges: Iterable[tuple[str, int, int]], gap: int,
                spans: Spans | None = None) -> tuple[Spans, list[int]]:
    """Fetch byte ranges, merged by :func:`merge_ranges`; return them and each request's bytes."""
    requests = merge_ranges(ranges, gap)
    spans = spans if spans is not None else Spans()

    def fetch(key: str, start: int, stop: int) -> int:
        buf: Any = memoryview(np.empty(stop - start, dtype=np.uint8))  # type: ignore[arg-type]  # not zero-filled
        storage.read_into(key, start, [buf])
        spans.add(key, start, buf)
        return stop - start

    sizes = pool.run_batched([functools.partial(fetch, *r) for r in requests], [r[2] - r[1] for r in requests],
                             storage.local)
    return spans, sizes
