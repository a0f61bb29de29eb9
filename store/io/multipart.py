"""S3 multipart uploads straight from a writer's buffers: parts in parallel, no joined copy, aborted on failure.

A rank's packed object is many encoded shards back to back (a list of buffers: views of the
tensors' memory, checksums, the trailer). :func:`upload` sends it as one S3 multipart upload whose
parts (:func:`part_ranges`: at least :data:`MIN_PART` bytes each but the last, at most
:data:`MAX_PARTS`) go out :data:`CONCURRENCY` at a time on s3fs's event loop. Each part's body is a
:class:`PartReader`: a file-like view of the object's bytes ``[start, end)`` over the buffers
themselves, read by the HTTP client a chunk at a time, so the object is never joined into one copy
(the process holds at most a chunk per part in flight besides the buffers it was given).

A failing part (after the client's own retries) cancels the parts still in flight and aborts the
upload: S3 shows an object only once the upload completes, so a failed upload leaves nothing at
the key (and no parts billed). The error is raised for :meth:`Storage._call
<reshard.store.io.storage.Storage._call>` to retry the whole upload when it is transient.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import os
from collections.abc import Sequence
from typing import Any

#: S3's smallest part (every part but the last).
MIN_PART = 5 << 20
#: Parts of about this many bytes, fewer when that gives fewer than :data:`CONCURRENCY` parts (never below MIN_PART).
PART_BYTES = 16 << 20
#: S3's most parts in one upload.
MAX_PARTS = 10_000
#: Parts in flight at once per upload (``RESHARD_UPLOAD_CONCURRENCY`` overrides).
CONCURRENCY = 8
#: Objects of at least this many bytes go as multipart uploads; smaller ones as one PUT.
MULTIPART_BYTES = 2 * MIN_PART


def supported(fs: Any) -> bool:
    """Whether ``fs`` is an s3fs filesystem (its client calls are what :func:`upload` uses)."""
    return callable(getattr(fs, "_call_s3", None)) and callable(getattr(fs, "split_path", None))


def concurrency() -> int:
    """Parts in flight at once per upload."""
    env = os.environ.get("RESHARD_UPLOAD_CONCURRENCY")
    return max(1, int(env)) if env else CONCURRENCY


def part_ranges(total: int, part_bytes: int = PART_BYTES, parallel: int = CONCURRENCY) -> list[tuple[int, int]]:
    """``[start, end)`` of each part of a ``total``-byte object: all at least :data:`MIN_PART` but the last.

    About ``part_bytes`` each, smaller (down to :data:`MIN_PART`) when that gives the upload at least
    ``parallel`` parts to send side by side, larger when ``part_bytes`` would need over :data:`MAX_PARTS`.
    """
    part = max(MIN_PART, min(part_bytes, total // max(1, parallel)), -(-total // MAX_PARTS))
    n = max(1, total // part)  # the remainder spread over the parts: each stays >= part
    cuts = [total * i // n for i in range(n + 1)]
    return list(itertools.pairwise(cuts))


def byte_views(buffers: Sequence[Any]) -> list[memoryview]:
    """Each buffer as a flat byte view of its own memory (no copy), empty ones left out."""
    out = []
    for b in buffers:
        m = memoryview(b)
        if m.ndim != 1 or m.format != "B":
            m = m.cast("B")
        if m.nbytes:
            out.append(m)
    return out


class PartReader(io.RawIOBase):
    """A seekable, read-only file over bytes ``[start, end)`` of the concatenation of ``views``, copying nothing
    until read (then just the bytes asked for)."""

    def __init__(self, views: Sequence[memoryview], start: int, end: int) -> None:
        super().__init__()
        self._spans: list[tuple[int, memoryview]] = []  # (offset in the part, bytes)
        at = 0
        for v in views:
            lo, hi = max(start, at), min(end, at + v.nbytes)
            if lo < hi:
                self._spans.append((lo - start, v[lo - at : hi - at]))
            at += v.nbytes
        self._size, self._pos = end - start, 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = self._size if size is None or size < 0 else min(self._size, self._pos + size)
        pos = self._pos
        pieces = [v[max(0, pos - at) : end - at] for at, v in self._spans if at < end and at + v.nbytes > pos]
        self._pos = max(self._pos, end)
        return pieces[0].tobytes() if len(pieces) == 1 else b"".join(pieces)

    def readinto(self, b: Any) -> int:
        data = self.read(memoryview(b).nbytes)
        memoryview(b).cast("B")[: len(data)] = data
        return len(data)


def upload(fs: Any, path: str, buffers: Sequence[Any], part_bytes: int = PART_BYTES,
           parallel: int | None = None) -> int:
    """Write ``buffers`` (back to back) to ``path`` as one multipart upload; the number of parts.

    Parts go ``parallel`` (default :func:`concurrency`) at a time, each read from the buffers; on a
    failure the upload is aborted (nothing appears at ``path``) and the error raised.
    """
    from fsspec.asyn import sync  # here: local saves import no fsspec

    return int(sync(fs.loop, _upload, fs, path, byte_views(buffers), part_bytes, parallel or concurrency()))


async def _upload(fs: Any, path: str, views: list[memoryview], part_bytes: int, parallel: int) -> int:
    bucket, key, _ = fs.split_path(path)
    cuts = part_ranges(sum(v.nbytes for v in views), part_bytes, parallel)
    mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    upload_id = mpu["UploadId"]
    gate = asyncio.Semaphore(parallel)

    async def part(number: int, start: int, end: int) -> dict[str, Any]:
        async with gate:
            out = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                    Body=PartReader(views, start, end), ContentLength=end - start)
        return {"PartNumber": number, "ETag": out["ETag"]}

    tasks = [asyncio.ensure_future(part(i + 1, a, b)) for i, (a, b) in enumerate(cuts)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in done if t.exception() is not None]
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
        await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                          MultipartUpload={"Parts": [t.result() for t in tasks]})
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # nothing at the key, no parts kept; the upload's own error says more than a failed abort
        with contextlib.suppress(Exception):
            await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        raise
    fs.invalidate_cache(path)
    return len(cuts)
