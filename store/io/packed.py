"""Packed data objects: many shards back to back in one object, written once, read by range.

A writer (a rank, or one task of a block writer) hands its encoded shards to
:func:`plan_pack`; they go back to back into ``packed/<writer>.bin`` under the
save's generation (more parts, ``packed/<writer>-<n>.bin``, once one holds
``max_bytes``), and the plan says where each shard lands. Readers fetch byte ranges of such objects
with :func:`read_ranges`, which merges ranges of one object whose gap costs less
than a request (the cost model in docs/performance.md: ``gap`` bytes, about
64 KiB on local disk and 128 KiB on object stores).

A rank's last data object ends with the rank's manifest (``tail`` of
:func:`write_objects`), so a rank's whole save is one object. Knows nothing of
zarr: keys, byte ranges and buffers only.
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


def plan_pack(prefix: str, writer: str, blobs: Sequence[tuple[str, Sequence[Any]]], max_bytes: int
              ) -> tuple[list[tuple[str, list[Any]]], dict[str, tuple[str, int, int]]]:
    """Lay blobs out back to back in data objects: the objects (name, buffers) and where each blob lies.

    Parameters
    ----------
    prefix : str
        Folder of the objects (``gen-<id>/packed`` under the root, or ``packed`` under a generation).
    writer : str
        Unique per writer of the save (a rank number, or a random token).
    blobs : sequence of (key, buffers)
        Each blob's bytes as a list of buffers, in the order they go.
    max_bytes : int
        A new object starts once the current one holds at least this many bytes.

    The last object is ``<prefix>/<writer>.bin``, the others ``<prefix>/<writer>-<n>.bin``
    (the names :mod:`reshard.store.format.refs` documents); ``{blob key: (object, offset, length)}``.
    """
    groups: list[list[tuple[str, Sequence[Any], int]]] = []
    filled = max_bytes  # start a first object on the first blob
    for key, parts in blobs:
        size = sum(memoryview(p).nbytes for p in parts)
        if filled >= max_bytes:
            groups.append([])
            filled = 0
        groups[-1].append((key, parts, size))
        filled += size
    groups = groups or [[]]
    objects: list[tuple[str, list[Any]]] = []
    where: dict[str, tuple[str, int, int]] = {}
    for n, group in enumerate(groups):
        name = f"{prefix}/{writer}.bin" if n == len(groups) - 1 else f"{prefix}/{writer}-{n + 1}.bin"
        buffers: list[Any] = []
        offset = 0
        for key, parts, size in group:
            buffers += parts
            where[key] = (name, offset, size)
            offset += size
        objects.append((name, buffers))
    return objects, where


def write_objects(storage: Storage, objects: list[tuple[str, list[Any]]], tail: bytes = b"") -> None:
    """Write planned objects, ``tail`` appended to the last; the last is written after the others.

    Each object is one request (local: ``writev``; remote: one PUT). The last
    one (which carries a rank's manifest) appears only once every other part is there.
    """
    *first, (name, buffers) = objects
    pool.run_all([functools.partial(storage.write, n, b) for n, b in first], storage.local)
    # atomic: a committer polling for the manifest at its end never reads a part-written object
    storage.write_atomic(name, [*buffers, tail] if tail else buffers)


def write_pack(storage: Storage, prefix: str, writer: str, blobs: Sequence[tuple[str, Sequence[Any]]],
               max_bytes: int) -> dict[str, tuple[str, int, int]]:
    """:func:`plan_pack` and :func:`write_objects` (no manifest inside); where each blob went."""
    objects, where = plan_pack(prefix, writer, blobs, max_bytes)
    write_objects(storage, objects)
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
    """Byte ranges fetched from objects, looked up by (object, start, stop); then in ``base``, if given."""

    def __init__(self, base: Spans | None = None) -> None:
        self.base = base
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
        at = bisect.bisect(starts, start) - 1 if starts else -1
        if at >= 0:
            s0, data = self._spans[key][at]
            if stop - s0 <= data.nbytes:
                return data[start - s0 : stop - s0]
        return None if self.base is None else self.base.get(key, start, stop)

    def held_from(self, key: str, start: int, stop: int) -> int:
        """Where the held end of ``[start, stop)`` begins: ``x`` with ``[x, stop)`` held by one span, else ``stop``."""
        starts = self._starts.get(key)
        at = bisect.bisect(starts, stop - 1) - 1 if starts else -1
        if at >= 0:
            s0, data = self._spans[key][at]
            if start < s0 and s0 + data.nbytes >= stop:
                return s0
        return stop if self.base is None else self.base.held_from(key, start, stop)


def read_ranges(storage: Storage, ranges: Iterable[tuple[str, int, int]], gap: int,
                spans: Spans | None = None) -> tuple[Spans, list[int]]:
    """Fetch byte ranges, merged by :func:`merge_ranges`, into ``spans`` (new if None), leaving out those it
    holds already; return it and each request's bytes."""
    spans = spans if spans is not None else Spans()
    # what is not held yet; a range whose end is held (a rank's tail, read with its manifest): its head only
    heads = [(key, start, spans.held_from(key, start, stop), stop)
             for key, start, stop in ranges if spans.get(key, start, stop) is None]
    requests = merge_ranges([(key, start, x) for key, start, x, _ in heads], gap)

    def fetch(key: str, start: int, stop: int) -> int:
        buf: Any = memoryview(np.empty(stop - start, dtype=np.uint8))  # type: ignore[arg-type]  # not zero-filled
        storage.read_into(key, start, [buf])
        spans.add(key, start, buf)
        return stop - start

    sizes = pool.run_batched([functools.partial(fetch, *r) for r in requests], [r[2] - r[1] for r in requests],
                             storage.local)
    for key, start, x, stop in heads:
        if x < stop:  # one span for the whole range: head and held end side by side
            head, end = spans.get(key, start, x), spans.get(key, x, stop)
            assert head is not None and end is not None
            whole = bytearray(stop - start)
            whole[: x - start], whole[x - start :] = head, end
            spans.add(key, start, memoryview(whole))
    return spans, sizes
