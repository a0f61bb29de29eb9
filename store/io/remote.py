"""GETs from a remote store: one range, a long range as parallel parts, and the parts laid into buffers.

Every remote read of a :class:`~reshard.store.io.storage.Storage` is a :class:`Getter` call: on S3 a
presigned URL sent on s3fs's HTTP session (:class:`.s3client.PresignedGets`), elsewhere (HTTP(S), GCS,
Azure, ``memory://``) the fsspec filesystem's ``cat_file`` and ``cat_ranges``. Retries are the storage's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import s3client

#: A remote read longer than ``1.5 * PART_BYTES`` is fetched as parts of about this size in parallel:
#: an object store gives each connection a fraction of the link (tens of MB/s per stream on S3).
PART_BYTES = 8 << 20


def split_range(offset: int, total: int, part: int = PART_BYTES) -> list[tuple[int, int]]:
    """``[start, end)`` pieces of the range, about ``part`` bytes each (one piece when it is short)."""
    if total < 1.5 * part:
        return [(offset, offset + total)]
    n = -(-total // part)
    step = -(-total // n)
    return [(offset + i, offset + min(total, i + step)) for i in range(0, total, step)]


def scatter(parts: Sequence[bytes], buffers: Sequence[memoryview]) -> None:
    """Copy the concatenation of ``parts`` into ``buffers`` in order (their lengths add up)."""
    it = iter(parts)
    src, pos = memoryview(b""), 0
    for b in buffers:
        dst = b.cast("B") if b.ndim != 1 or b.format != "B" else b
        filled = 0
        while filled < dst.nbytes:
            if pos == src.nbytes:
                src, pos = memoryview(next(it)), 0
                continue
            n = min(dst.nbytes - filled, src.nbytes - pos)
            dst[filled : filled + n] = src[pos : pos + n]
            filled, pos = filled + n, pos + n


class Getter:
    """The GETs of one fsspec filesystem.

    Parameters
    ----------
    fs : fsspec.AbstractFileSystem
        The filesystem; an s3fs one without per-request options gets presigned GETs.
    """

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self.presigned = s3client.presigned_gets(fs)

    def get(self, path: str, start: int, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``path`` (a negative ``start`` and no end: its last ``-start`` bytes): one GET."""
        if self.presigned is not None:
            return self.presigned.cat(path, start, end)
        return bytes(self.fs.cat_file(path, start=start, end=end))

    def get_parts(self, path: str, cuts: Sequence[tuple[int, int]]) -> list[bytes]:
        """Each ``[start, end)`` of ``path``, all at once (on the filesystem's event loop when it has one)."""
        if self.presigned is not None:
            return self.presigned.cat_ranges(path, cuts)
        starts, ends = [a for a, _ in cuts], [b for _, b in cuts]
        parts = self.fs.cat_ranges([path] * len(cuts), starts, ends, on_error="raise")
        if any(isinstance(p, BaseException) for p in parts):
            raise next(p for p in parts if isinstance(p, BaseException))
        return [bytes(p) for p in parts]
