"""The one I/O path of every read: fill destination arrays from stored regions.

A :class:`Fetcher` belongs to one open checkpoint (or one dask task's private
view of it). It caches shard indexes, fetches small shards whole, coalesces
chunk reads into few requests and runs them on the storage's thread pool.
"""

from __future__ import annotations

import functools

import numpy as np
from reshard.layouts.errors import FormatError, StorageError

from .format.meta import ArrayMeta
from .format.shard import SMALL_SHARD_BYTES, Request, coalesce, decode_index, execute, plan_reads
from .io import pool
from .io.storage import IOStats, Storage

Region = tuple[slice, ...]

#: Byte gap under which two chunk reads of one shard become one request.
DEFAULT_GAP = 64 << 10
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
    gap : int
        Byte gap under which reads of one shard are merged into one request.
    indexes : dict, optional
        A shard-index cache to share (dask tasks of one checkpoint share one).
    """

    def __init__(self, storage: Storage, engine: str = "fast", gap: int = DEFAULT_GAP,
                 indexes: dict[str, np.ndarray] | None = None) -> None:
        self.storage = storage
        self.engine = engine
        self.gap = gap
        #: Shards up to this size are fetched whole, in one request with their index.
        self.small_shard_bytes = SMALL_SHARD_BYTES
        self.indexes: dict[str, np.ndarray] = {} if indexes is None else indexes

    @property
    def url(self) -> str:
        return self.storage.url

    def read_regions(self, jobs: list[tuple[ArrayMeta, Region, np.ndarray]]) -> IOStats:
        """Fill destinations from stored regions: the one I/O path of every read.

        Returns the counters of this call (exact also when several threads read
        through one checkpoint at once; ``self.stats`` sums every call).
        """
        delivered = sum(d.nbytes for _, _, d in jobs)
        if self.engine != "fast":  # the general engines do their own I/O: only deliveries are known
            from .engines import read_with_engine

            for meta, region, dest in jobs:
                dest[...] = read_with_engine(self, meta, region)
            self.storage.count(bytes_delivered=delivered)
            return IOStats(bytes_delivered=delivered)
        keys = [[(shard, meta.shard_key(shard)) for shard in meta.shards_in(region)] for meta, region, _ in jobs]
        blobs, index_bytes = self._fetch_indexes(jobs, keys)
        temp = LOCAL_TEMP_BYTES if self.storage.local else None
        work: list[tuple[Request, ArrayMeta, np.ndarray]] = []
        for (meta, region, dest), shards in zip(jobs, keys, strict=True):
            reads = []
            for shard, key in shards:
                reads += plan_reads(meta, region, self.indexes.get(key), shard, key, dest)
            if not meta.shape:
                work.append((Request(reads[0].key, 0, -1, tuple(reads)), meta, dest))
                continue
            work += [(req, meta, dest) for req in coalesce(reads, self.gap, max_temp=temp)]
        fetched = pool.run_batched([functools.partial(execute, self.storage, *w, blobs.get(w[0].key)) for w in work],
                                   [w[0].nbytes for w in work], self.storage.local)
        self.storage.count(bytes_delivered=delivered, tasks=len(work))
        requests = len(index_bytes) + sum(1 for w in work if w[0].key not in blobs)
        return IOStats(requests=requests, bytes_fetched=sum(index_bytes) + sum(fetched),
                       bytes_delivered=delivered, tasks=len(work))

    def _fetch_indexes(self, jobs: list[tuple[ArrayMeta, Region, np.ndarray]],
                       keys: list[list[tuple[tuple[int, ...], str]]]) -> tuple[dict[str, memoryview], list[int]]:
        """Fetch the shard indexes the jobs need (cached for the checkpoint's life).

        ``keys`` holds each job's (shard, key) pairs. A shard of at most
        ``small_shard_bytes`` is fetched whole, index and data in one request;
        its bytes are returned (keyed by shard key) for this call only, with
        the bytes of each request made.
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
                if small[key]:
                    blob = memoryview(self.storage.read(key))
                    blobs[key], data = blob, bytes(blob[-n:])
                    size = blob.nbytes
                else:
                    data = self.storage.read_suffix(key, n)
                    size = len(data)
            except FileNotFoundError:
                raise FormatError(f"tensor {meta.name!r}: shard {key!r} is missing from {self.url}") from None
            except StorageError as e:
                raise StorageError(f"tensor {meta.name!r}: {e}") from e
            self.indexes[key] = decode_index(data, meta, key, shard)
            return size

        sizes = pool.run_batched([functools.partial(fetch, k, *w) for k, w in wanted.items()],
                                 [shard_bytes[k] if small[k] else m.index_nbytes(i) for k, (m, i) in wanted.items()],
                                 self.storage.local)
        return blobs, sizes

