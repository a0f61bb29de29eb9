"""The one I/O path of every read: fill destination arrays from stored regions.

A :class:`Fetcher` belongs to one open checkpoint (or one dask task's private
view of it). It caches shard indexes, fetches small shards whole, coalesces
chunk reads into few requests and runs them on the storage's thread pool.

Both storage forms go through it. The directory form reads one object per
shard. The packed form (:mod:`reshard.store.format.refs`) reads byte ranges of
the per-rank data objects its references point into: a shard is a range, its
index the range's last bytes, and ranges of one object are merged across
shards and tensors by the cost model (a gap of up to ``gap`` bytes is read
rather than paid for with another request: 64 KiB on local disk, 128 KiB on
object stores by default), so loading one rank's pieces takes a few requests
per source object touched.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
from reshard.layouts import FlatLayout, Layout
from reshard.layouts.errors import FormatError, ShapeMismatchError, StorageError

from ..format.encode import plain_index, stored_bytes
from ..format.meta import ArrayMeta
from ..format.refs import Location
from ..format.shard import (
    SMALL_SHARD_BYTES,
    ChunkRead,
    Request,
    Target,
    WholeRead,
    coalesce,
    decode_index,
    execute,
    execute_mixed,
    execute_whole,
    plan_reads,
    whole_read,
)
from ..io import packed, pool
from ..io.stats import IOStats
from ..io.storage import Storage

if TYPE_CHECKING:
    from ..commit.locate import Locator

Region = tuple[slice, ...]

#: Byte gap under which two reads of one object become one request, on local disk
#: (a request costs about as much as reading this many more bytes from the page cache).
DEFAULT_GAP = 64 << 10
#: The same on object stores. Requests run in parallel, so another request costs its share of the
#: round trip, ``RTT / connections``, not a whole one: a gap is worth reading while it takes less than
#: that on the link, ``bandwidth * RTT / connections`` (1 Gbit/s, 20 ms, 24 connections: ~100 KiB).
#: It was 1 MiB, which on a shaped link (issue 38) made one rank's packed load fetch 1.7x its bytes.
REMOTE_GAP = 128 << 10


class Boxes(tuple):
    """A flat-range rank's part as a read job's region: ``(offset, global region)`` per box
    (:meth:`reshard.layouts.FlatLayout.boxes`); the job's destination is the rank's 1-d array."""

    @property
    def size(self) -> int:
        """Elements of all the boxes: the length of the 1-d destination."""
        return sum(math.prod(s.stop - s.start for s in box) for _, box in self)

    def key(self) -> tuple[Any, ...]:
        """A hashable form (slices are not hashable before Python 3.12)."""
        return tuple((at, tuple((s.start, s.stop) for s in box)) for at, box in self)


class Parts(tuple):
    """The part of a rank holding several blocks as a read job's region: ``(global region, region of its local
    array)`` per block (:meth:`reshard.layouts.Layout.pieces`); the job's destination is the rank's local array."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the local array the blocks tile."""
        return tuple(max(local[d].stop for _, local in self) for d in range(len(self[0][1])))

    def key(self) -> tuple[Any, ...]:
        """A hashable form (slices are not hashable before Python 3.12)."""
        return tuple(tuple((s.start, s.stop) for s in (*glob, *local)) for glob, local in self)


def target_region(layout: Layout, rank: int) -> Any:
    """What a read job fills for ``rank``: its region, or for a flat-range layout its :class:`Boxes`, for a
    rank holding several blocks its :class:`Parts`."""
    if isinstance(layout, FlatLayout):
        return Boxes(layout.boxes(rank))
    if layout.multi_piece:
        return Parts(layout.pieces(rank))
    return layout.region(rank)


def expand_boxes(jobs: list[tuple[ArrayMeta, Any, np.ndarray]]) -> list[tuple[ArrayMeta, Region, np.ndarray]]:
    """Read jobs with :class:`Boxes` regions as one job per box, into views of the 1-d destination (and jobs
    with :class:`Parts` as one per block, into its part of the local array).

    A box is a contiguous run of the destination (the rank's range in C order), so
    each view is contiguous and the fetcher reads straight into it.
    """
    if not any(isinstance(region, (Boxes, Parts)) for _, region, _ in jobs):
        return jobs
    out = []
    for meta, region, dest in jobs:
        if isinstance(region, Parts):  # a rank holding several blocks: one job per block, into its part of dest
            out += [(meta, glob, dest[local]) for glob, local in region]
            continue
        if not isinstance(region, Boxes):
            out.append((meta, region, dest))
            continue
        flat = dest.reshape(-1)
        if not np.shares_memory(flat, dest) and dest.size:
            raise ShapeMismatchError(f"tensor {meta.name!r}: the destination of a flat range must be one "
                                     "contiguous 1-d array")
        for at, box in region:
            shape = tuple(s.stop - s.start for s in box)
            out.append((meta, box, flat[at : at + math.prod(shape)].reshape(shape)))
    return out


def default_gap(storage: Storage) -> int:
    """The cost model's gap for ``storage``: :data:`DEFAULT_GAP` locally, :data:`REMOTE_GAP` remote."""
    return DEFAULT_GAP if storage.local else REMOTE_GAP
#: Local files: bytes of one request that go through a scratch buffer (chunks
#: that do not land directly in the destination) stay under this, so the
#: scratch stays in cache and never is a large fresh allocation.
LOCAL_TEMP_BYTES = 2 << 20


class Fetcher:
    """Reads regions of stored tensors through ``storage`` with ``engine``.

    Parameters
    ----------
    storage : Storage
        Where the checkpoint lives.
    engine : {"fast", "tensorstore", "zarr"}
        Which code reads chunks.
    gap : int, optional
        Byte gap under which reads of one object are merged into one request
        (default: :func:`default_gap`).
    indexes : dict, optional
        A shard-index cache to share (dask tasks of one checkpoint share one).
    locator : Locator, optional
        A packed save's shard locations (:mod:`reshard.store.commit.locate`); ``root`` is
        then the checkpoint root they are relative to. None: the directory form.
    """

    def __init__(self, storage: Storage, engine: str = "fast", gap: int | None = None,
                 indexes: dict[str, np.ndarray] | None = None, locator: Locator | None = None,
                 root: Storage | None = None) -> None:
        self.storage = storage
        self.engine = engine
        self.gap = default_gap(storage) if gap is None else int(gap)
        self.locator = locator
        #: The checkpoint root (packed references are relative to it).
        self.root = root if root is not None else storage
        #: Shards up to this size are fetched whole, in one request with their index.
        self.small_shard_bytes = SMALL_SHARD_BYTES
        self.indexes: dict[str, np.ndarray] = {} if indexes is None else indexes
        #: Packed form: fetch a large uncompressed shard's index even though its length shows the chunks lie
        #: as reshard writes them (:func:`reshard.store.format.encode.plain_index`). ``verify`` sets it: it
        #: checks every index; a load needs only the chunks, each checked by its crc32c.
        self.read_indexes = False
        self._store: Any = None
        self._store_lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.storage.url

    def general_store(self, arrays: Iterable[ArrayMeta] = ()) -> Any:
        """The save as a read-only zarr-python store, every location it may request checked first (made once).

        The general engines (zarr, TensorStore) and :meth:`Checkpoint.zarr_store`
        read through libraries that follow whatever they are given. So first:
        a packed save's references are read and checked
        (:func:`reshard.store.format.refs.parse`: every url under the checkpoint
        root) and each data object they name is checked like any object reshard
        reads (a regular file, no link); a directory-form save's folder is
        walked once, refusing links and anything but regular files and folders.
        ``arrays``: the records of every tensor, checked in full first
        (:func:`reshard.store.format.schema_array.check_array`: its sizes and counts
        within the limits), as the library will allocate what they declare.
        """
        for meta in arrays:
            meta.resolve()
        with self._store_lock:
            if self._store is None:
                from ..format.engines import directory_store, references_store

                if self.locator is not None:
                    refs = self.locator.references()
                    for obj in sorted(refs.objects()):
                        try:
                            self.root.check_object(obj)
                        except FileNotFoundError:
                            raise FormatError(f"{self.root.url}/{obj} is missing: a data object of the save "
                                              "(deleted, or the checkpoint was copied incompletely)") from None
                    self._store = references_store(self.root, refs)
                else:
                    self.storage.check_tree()
                    self._store = directory_store(self.storage)
            return self._store

    def read_regions(self, jobs: list[tuple[ArrayMeta, Region, np.ndarray]]) -> IOStats:
        """Fill destinations from stored regions: the one I/O path of every read.

        Returns the counters of this call (exact also when several threads read
        through one checkpoint at once; ``self.stats`` sums every call).
        """
        jobs = expand_boxes(jobs)
        delivered = sum(d.nbytes for _, _, d in jobs)
        if self.engine != "fast":  # the general engines do their own I/O: only deliveries are known
            from ..format.engines import read_with_engine

            self.general_store()  # every location they may request checked first
            for meta, region, dest in jobs:
                dest[...] = read_with_engine(self, meta, region)
            self.storage.count(bytes_delivered=delivered)
            return IOStats(bytes_delivered=delivered)
        cells = [job for job in jobs if job[0].shape and not job[0].sharded]
        if cells:  # arrays without the sharding codec: whole cells (read/cells.py), the rest as below
            from .cells import read_cells

            stats = read_cells(self, cells)
            rest = [job for job in jobs if not (job[0].shape and not job[0].sharded)]
            if rest:
                stats.add(**self.read_regions(rest).as_dict())
            return stats
        if self.locator is not None:
            return self._read_packed(jobs, delivered)
        keys = [[(shard, meta.shard_key(shard)) for shard in meta.shards_in(region)] for meta, region, _ in jobs]
        assumed = self._assumed_indexes(jobs, keys)
        fetches, blobs = self._index_jobs(jobs, keys)
        # jobs whose chunks can be located now (cached or assumed indexes) are read with the indexes fetched;
        # the others once those are in. Without assumed indexes: the indexes first, then every job's chunks.
        now = [j for j, shards in enumerate(keys)
               if assumed and all(k in self.indexes or k in assumed for _, k in shards)]
        taken = set(now)
        later = [j for j in range(len(jobs)) if j not in taken]
        work = self._plan_directory([jobs[j] for j in now], [keys[j] for j in now], assumed)
        # first the indexes that later reads wait on; then each read that can go now beside one index fetch that
        # only checks an assumed index. Queued before every read, those checks held back a load's first data;
        # after them, they held its end on the threads freed last (a rank's load of W1 over S3 at 5 ms: 0.325 s
        # with the checks first, 0.29-0.31 s with them last, 0.256 s in turn; docs/performance.md)
        reads = [(True, functools.partial(_guarded, execute, self.storage, *w), w[0].nbytes) for w in work]
        queue = [(False, fetch, n) for key, fetch, n in fetches if key not in assumed]
        queue += _alternate(reads, [(False, fetch, n) for key, fetch, n in fetches if key in assumed])
        done = pool.run_batched([task for _, task, _ in queue], [n for _, _, n in queue], self.storage.local)
        first = [got for (is_read, _, _), got in zip(queue, done, strict=True) if is_read]
        index_bytes = [got for (is_read, _, _), got in zip(queue, done, strict=True) if not is_read]
        wrong = {k for k, index in assumed.items()
                 if k not in self.indexes or not np.array_equal(self.indexes[k], index)}
        for w, got in zip(work, first, strict=True):
            if isinstance(got, BaseException) and w[0].key not in wrong:
                raise got
        fetched = [n for n in first if not isinstance(n, BaseException)]
        # what waited for its indexes; and the shards an assumed index got wrong (laid out otherwise than
        # reshard writes them), read again by their real index
        work2 = self._plan_directory([jobs[j] for j in later], [keys[j] for j in later], {})
        if wrong:
            fix = [j for j in now if any(k in wrong for _, k in keys[j])]
            work2 += [w for w in self._plan_directory([jobs[j] for j in fix], [keys[j] for j in fix], {})
                      if w[0].key in wrong]
        fetched += pool.run_batched([functools.partial(execute, self.storage, *w, blobs.get(w[0].key))
                                     for w in work2], [w[0].nbytes for w in work2], self.storage.local)
        work += work2
        self.storage.count(bytes_delivered=delivered, tasks=len(work))
        requests = len(index_bytes) + sum(1 for w in work if w[0].key not in blobs)
        return IOStats(requests=requests, bytes_fetched=sum(index_bytes) + sum(fetched),
                       bytes_delivered=delivered, tasks=len(work))

    def _assumed_indexes(self, jobs: list[tuple[ArrayMeta, Region, np.ndarray]],
                         keys: list[list[tuple[tuple[int, ...], str]]]) -> dict[str, np.ndarray]:
        """Remote directory form: the index each uncached big uncompressed shard has when reshard wrote it
        (:func:`reshard.store.format.encode.plain_index`), to read its chunks in the same round trip as its
        real index, which then checks it (a shard laid out otherwise is read again). None locally, where a
        round trip costs nothing, nor for ``verify`` (``read_indexes``)."""
        if self.storage.local or self.read_indexes:
            return {}
        out = {}
        for (meta, _, _), shards in zip(jobs, keys, strict=True):
            if meta.shape and meta.compressor is None:
                for shard, key in shards:
                    if key not in self.indexes and meta.shard_nbytes(shard) > self.small_shard_bytes:
                        out[key] = plain_index(meta, shard)
        return out

    def _plan_directory(self, jobs: list[tuple[ArrayMeta, Region, np.ndarray]],
                        keys: list[list[tuple[tuple[int, ...], str]]], assumed: dict[str, np.ndarray]
                        ) -> list[tuple[Request, ArrayMeta, np.ndarray]]:
        """The directory form's requests: each shard's chunk reads by its index (cached, or ``assumed``)."""
        temp = LOCAL_TEMP_BYTES if self.storage.local else None
        work: list[tuple[Request, ArrayMeta, np.ndarray]] = []
        for (meta, region, dest), shards in zip(jobs, keys, strict=True):
            reads = []
            for shard, key in shards:
                index = assumed[key] if key in assumed else self.indexes.get(key)
                reads += plan_reads(meta, region, index, shard, key, dest)
            if not meta.shape:
                work.append((Request(reads[0].key, 0, -1, tuple(reads)), meta, dest))
                continue
            work += [(req, meta, dest) for req in coalesce(reads, self.gap, max_temp=temp)]
        return work

    def _index_jobs(self, jobs: list[tuple[ArrayMeta, Region, np.ndarray]],
                    keys: list[list[tuple[tuple[int, ...], str]]]
                    ) -> tuple[list[tuple[str, Any, int]], dict[str, memoryview]]:
        """The fetches of the shard indexes the jobs need (cached for the checkpoint's life), to run.

        ``keys`` holds each job's (shard, key) pairs. A shard of at most
        ``small_shard_bytes`` is fetched whole, index and data in one request;
        its bytes land in the returned dict (keyed by shard key) for this call
        only. Returns ``(shard key, job, size)`` for each (a job returns the
        bytes of its request), and that dict (filled as they run).
        """
        wanted: dict[str, tuple[ArrayMeta, tuple[int, ...]]] = {}
        for (meta, _, _), shards in zip(jobs, keys, strict=True):
            if meta.shape:
                for shard, key in shards:
                    if key not in self.indexes:
                        wanted[key] = (meta, shard)
        blobs: dict[str, memoryview] = {}
        shard_bytes = {k: m.shard_nbytes(i) for k, (m, i) in wanted.items()}
        small = {k: n <= self.small_shard_bytes for k, n in shard_bytes.items()}

        def fetch(key: str, meta: ArrayMeta, shard: tuple[int, ...]) -> int:
            n = meta.index_nbytes(shard)
            try:
                if small[key]:  # no more than such a shard can take (zstd may grow a chunk a little)
                    blob = memoryview(self.storage.read(key, limit=2 * shard_bytes[key] + n + 4096))
                    blobs[key], data = blob, bytes(blob[-n:])
                    size = blob.nbytes
                else:
                    data = self.storage.read_suffix(key, n)
                    size = len(data)
            except FileNotFoundError:
                raise FormatError(f"tensor {meta.name!r}: shard {key!r} is missing from {self.url}") from None
            except StorageError as e:
                raise StorageError(f"tensor {meta.name!r}: {e}") from e
            self.indexes[key] = decode_index(data, meta, key, shard, f"{self.storage.url}/{key}")
            return size

        return [(k, functools.partial(fetch, k, m, i), shard_bytes[k] if small[k] else m.index_nbytes(i))
                for k, (m, i) in wanted.items()], blobs

    # ------------------------------------------------------------ packed
    def _read_packed(self, jobs: list[tuple[ArrayMeta, Region, np.ndarray]], delivered: int) -> IOStats:
        """:meth:`read_regions` for the packed form: byte ranges of data objects, merged by the cost model.

        First the ranges of what is not cached yet (a small shard whole, a big
        one's index at the end of its range, unless the shard's length shows its
        chunks lie as reshard writes them), merged per object into requests;
        then the chunk reads not served from those bytes, merged again. A small
        shard of one chunk that a job wants whole skips the first step: it is read
        straight into the job's array (:func:`reshard.store.format.shard.execute_whole`),
        unless the locator read part of it already with the end of its object (then
        the first step reads only the part before: no byte twice).
        """
        assert self.locator is not None
        root = self.root
        wanted_shards = [[(meta, s, meta.shard_key(s)) for s in meta.shards_in(region)] for meta, region, _ in jobs]
        locations, located_by = self.locator.locate_all([s for job in wanted_shards for s in job])
        found = iter(locations)
        shards = [[(s, k, next(found)) for _, s, k in job] for job in wanted_shards]
        ranges: list[tuple[str, int, int]] = []
        wanted: dict[str, tuple[ArrayMeta, tuple[int, ...], Location]] = {}
        direct: dict[str, list[WholeRead]] = {}  # small shards read straight into their destination, by object
        direct_jobs: set[int] = set()
        taken: set[str] = set()  # a second job wanting one of these shards takes the general path
        ends = self.locator.spans  # the objects' ends, read with the manifests
        for j, ((meta, region, dest), located) in enumerate(zip(jobs, shards, strict=True)):
            for shard, key, (obj, off, n) in located:
                if not meta.shape:
                    ranges.append((obj, off, off + n))
                elif (len(located) == 1 and n <= self.small_shard_bytes and key not in self.indexes
                      and key not in taken and (ends is None or (ends.get(obj, off, off + n) is None
                                                                 and ends.held_from(obj, off, off + n) == off + n))
                      and (w := whole_read(meta, shard, region, dest, key, off, n)) is not None):
                    direct.setdefault(obj, []).append(w)
                    direct_jobs.add(j)
                    taken.add(key)
                elif key not in self.indexes:
                    if n > self.small_shard_bytes and meta.compressor is None and not self.read_indexes:
                        index = plain_index(meta, shard)
                        if stored_bytes(meta, shard, index) == n:  # laid out as reshard writes it: no index round trip
                            self.indexes[key] = index
                            continue
                    wanted[key] = (meta, shard, (obj, off, n))
                    whole = n <= self.small_shard_bytes  # data and index in one range
                    ranges.append((obj, off if whole else off + n - meta.index_nbytes(shard), off + n))
        try:
            spans, sizes = packed.read_ranges(root, ranges, self.gap, packed.Spans(self.locator.spans))
        except FileNotFoundError as e:
            raise _missing(root, e, jobs, shards) from None
        for key, (meta, shard, (obj, off, n)) in wanted.items():
            tail = spans.get(obj, off + n - meta.index_nbytes(shard), off + n)
            if tail is None or n < meta.index_nbytes(shard):
                raise FormatError(f"tensor {meta.name!r}: shard {key!r} is {n} bytes at {off} of {root.url}/{obj}, "
                                  f"too short for its index of {meta.index_nbytes(shard)} bytes")
            self.indexes[key] = decode_index(bytes(tail), meta, key, shard, f"{root.url}/{obj} bytes {off}+{n}")
        work: list[tuple[Request, list[Target], memoryview | None]] = []
        far: list[ChunkRead] = []
        target_of: dict[int, Target] = {}
        for j, ((meta, region, dest), located) in enumerate(zip(jobs, shards, strict=True)):
            if j in direct_jobs:
                continue
            target = Target(meta, dest)
            for shard, key, (obj, off, n) in located:
                reads = plan_reads(meta, region, self.indexes.get(key), shard, key, dest)
                if not meta.shape:
                    reads = [reads[0]._replace(nbytes=n)]
                blob = spans.get(obj, off, off + n)
                if blob is not None:  # fetched whole above
                    work.append((Request(key, 0, n, tuple(reads)), [target] * len(reads), blob))
                    continue
                for r in reads:
                    held = spans.get(obj, off + r.offset, off + r.offset + r.nbytes)
                    if held is not None:  # in the end of the object read with its manifest
                        work.append((Request(key, 0, r.nbytes, (r._replace(offset=0),)), [target], held))
                        continue
                    moved = r._replace(key=obj, offset=off + r.offset)
                    target_of[id(moved)] = target
                    far.append(moved)
        temp = LOCAL_TEMP_BYTES if root.local else None
        for req in coalesce(far, self.gap, max_temp=temp):
            work.append((req, [target_of[id(r)] for r in req.reads], None))
        groups = [(obj, g) for obj, reads in direct.items() for g in _runs(reads, self.gap)]
        tasks = ([functools.partial(execute_mixed, root, *w) for w in work]
                 + [functools.partial(execute_whole, root, obj, g) for obj, g in groups])
        task_bytes = [w[0].nbytes for w in work] + [g[-1].offset + g[-1].nbytes - g[0].offset for _, g in groups]
        try:
            fetched = pool.run_batched(tasks, task_bytes, root.local)
        except FileNotFoundError as e:
            raise _missing(root, e, jobs, shards) from None
        self.storage.count(bytes_delivered=delivered, tasks=len(tasks))
        far_requests = sum(1 for w in work if w[2] is None) + len(groups)
        return IOStats(requests=located_by.requests + len(sizes) + far_requests,
                       bytes_fetched=located_by.bytes_fetched + sum(sizes) + sum(fetched),
                       bytes_delivered=delivered, tasks=len(tasks))


def _alternate(a: list[Any], b: list[Any]) -> list[Any]:
    """``a[0], b[0], a[1], b[1], ...``, the longer list's rest at the end."""
    out = [x for pair in zip(a, b, strict=False) for x in pair]
    n = min(len(a), len(b))
    return out + a[n:] + b[n:]


def _guarded(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or the error it raised (a read by an assumed index: the real one decides)."""
    try:
        return fn(*args)
    except (FormatError, StorageError, ValueError, OSError) as e:
        return e


def _missing(root: Storage, e: FileNotFoundError, jobs: list[tuple[ArrayMeta, Region, np.ndarray]],
             shards: list[list[tuple[tuple[int, ...], str, Location]]]) -> FormatError:
    """A missing data object of a packed save, as a FormatError naming it and the tensors it holds."""
    obj = str(e.filename or "")
    names = sorted({meta.name for (meta, _, _), located in zip(jobs, shards, strict=True)
                    for _, _, (o, _, _) in located if o == obj})
    shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return FormatError(f"{root.url}/{obj} is missing: a data object of the committed save, holding tensor(s) "
                       f"{shown or '(unknown)'} (deleted, or the checkpoint was copied incompletely)")


def _runs(reads: list[WholeRead], gap: int) -> list[list[WholeRead]]:
    """Whole-shard reads of one object grouped into requests by the cost model (gaps up to ``gap``, no overlap)."""
    reads = sorted(reads, key=lambda r: r.offset)
    out = [[reads[0]]]
    for r in reads[1:]:
        first, last = out[-1][0], out[-1][-1]
        end = last.offset + last.nbytes
        if end <= r.offset <= end + gap and r.offset + r.nbytes - first.offset <= packed.MAX_REQUEST_BYTES:
            out[-1].append(r)
        else:
            out.append([r])
    return out
