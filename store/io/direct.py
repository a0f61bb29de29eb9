"""Durable local writes that bypass the page cache (``O_DIRECT``).

A durable save must put every byte on the disk before it returns. Written
the ordinary way, each byte is first copied into a fresh page-cache page, then
written back from there by ``fsync``: the copy and the page allocation are
pure overhead, and on a virtual machine whose host takes back the guest's idle
memory (free page reporting: Firecracker, most clouds' balloons) the first
touch of each fresh page costs far more than the copy (measured on the
benchmark machine, 2 cores: 1 GiB into the page cache 1.0-2.3 s of system
CPU, through ``O_DIRECT`` 0.1 s; docs/performance.md, "Eight fresh processes").

:func:`write` copies the buffers through one aligned bounce buffer (a memory
copy at memory speed, into pages it touched once) and writes each full block
with ``O_DIRECT``; the unaligned end goes out the ordinary way. A file system
that refuses ``O_DIRECT`` (tmpfs, some network and FUSE file systems) gets the
ordinary write: :func:`write` returns False having written nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any

#: Offsets, lengths and buffer addresses of direct writes are multiples of this (every
#: Linux block device's logical block size divides it).
ALIGN = 4096
#: The bounce buffer: one direct write each.
BLOCK_BYTES = 8 << 20
#: Smaller objects are written the ordinary way: the page cache costs them little.
MIN_BYTES = 1 << 20
#: What a file system refusing direct I/O answers (open/fcntl or the first write).
_REFUSED = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Bounce buffers kept for the next write: a fresh one costs a page fault per 4 KiB (and, on
#: a VM whose host took the idle memory back, the host's fault too); at most this many are kept.
MAX_SPARE = 4
_spare: list[mmap.mmap] = []
_lock = threading.Lock()


def _renew_after_fork() -> None:
    """In a forked child: a parent thread may have held the lock at the fork."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_after_fork)


def write(fd: int, parts: Sequence[Any]) -> bool:
    """Write ``parts`` back to back to ``fd`` (a new, empty file open for writing) with ``O_DIRECT``.

    Returns False, having written nothing, when the data is under ``MIN_BYTES``
    or the file system refuses direct I/O: the caller then writes it the
    ordinary way. The caller still ``fsync``-s (the file's size and the end).
    """
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(v.nbytes for v in views)
    if not _O_DIRECT or total < MIN_BYTES or not _set_direct(fd, True):
        return False
    size = min(BLOCK_BYTES, -(-total // ALIGN) * ALIGN)
    bounce = _take(size)
    whole = memoryview(bounce)
    out = whole[:size]
    try:
        fill = 0
        first = True
        for v in views:
            while v.nbytes:
                n = min(size - fill, v.nbytes)
                out[fill : fill + n] = v[:n]
                fill, v = fill + n, v[n:]
                if fill == size:
                    if not _write_block(fd, out, first):
                        return False
                    fill, first = 0, False
        aligned = fill - fill % ALIGN
        if aligned and not _write_block(fd, out[:aligned], first):
            return False
        _set_direct(fd, False)
        _write_all(fd, out[aligned:fill])
        return True
    finally:
        out.release()
        whole.release()
        _give(bounce)


def _take(size: int) -> mmap.mmap:
    """A page-aligned bounce buffer of at least ``size`` bytes: a kept one, or a new one of ``BLOCK_BYTES``."""
    with _lock:
        for i, spare in enumerate(_spare):
            if len(spare) >= size:
                return _spare.pop(i)
    return mmap.mmap(-1, max(size, BLOCK_BYTES))


def _give(bounce: mmap.mmap) -> None:
    with _lock:
        if len(_spare) < MAX_SPARE:
            _spare.append(bounce)
            return
    with contextlib.suppress(BufferError):  # a view still held by a traceback: the collector frees it
        bounce.close()


def _write_block(fd: int, block: memoryview, first: bool) -> bool:
    """Write one aligned block directly; False if the very first one is refused (then nothing is written)."""
    try:
        _write_all(fd, block)
    except OSError as e:
        if first and e.errno in _REFUSED and os.lseek(fd, 0, os.SEEK_CUR) == 0:
            _set_direct(fd, False)
            return False
        raise
    return True


def _write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        data = data[os.write(fd, data) :]


def _set_direct(fd: int, on: bool) -> bool:
    """Switch ``O_DIRECT`` on or off for ``fd``; False if the file system refuses it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT if on else flags & ~_O_DIRECT)
    except OSError as e:
        if e.errno in _REFUSED:
            return False
        raise
    return True
