"""Durable local writes around the page cache (store/io/direct.py): exact bytes, fallbacks, and the bypass."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from reshard.store.io import direct
from reshard.store.io.storage import Storage


def _parts(sizes: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


def _fd(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


@pytest.mark.parametrize("sizes", [[1 << 20], [3, (1 << 20) + 5, 4093, 70_000], [5 << 20, 1]])
def test_writes_the_exact_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sizes: list[int]) -> None:
    monkeypatch.setattr(direct, "BLOCK_BYTES", 1 << 20)  # several bounce blocks, an unaligned end
    parts = _parts(sizes)
    fd = _fd(tmp_path / "f")
    try:
        wrote = direct.write(fd, parts)
    finally:
        os.close(fd)
    if not wrote:
        pytest.skip("this file system refuses O_DIRECT")
    assert (tmp_path / "f").read_bytes() == b"".join(p.tobytes() for p in parts)


def test_small_objects_are_left_to_the_caller(tmp_path: Path) -> None:
    fd = _fd(tmp_path / "f")
    try:
        assert direct.write(fd, _parts([direct.MIN_BYTES - 1])) is False
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)


def test_a_refused_first_write_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that accepts the flag but refuses the write (EINVAL): the caller writes it all."""
    real = os.write

    def refuse(fd: int, data: object) -> int:
        if direct._O_DIRECT & fcntl.fcntl(fd, fcntl.F_GETFL):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data)  # type: ignore[arg-type]

    monkeypatch.setattr(direct.os, "write", refuse)
    parts = _parts([2 << 20])
    path = tmp_path / "f"
    storage = Storage(str(tmp_path), durable=True)
    storage.write("f", parts)  # falls back to the ordinary write
    assert path.read_bytes() == parts[0].tobytes()


def _resident_pages(path: Path) -> int:
    """Pages of ``path`` in the page cache (mincore)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)  # the mapping's address (nothing read)
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        ok = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec) == 0
        del view
    if not ok:
        pytest.skip(f"mincore: {os.strerror(ctypes.get_errno())}")
    return sum(v & 1 for v in vec)


def _fstype(path: Path) -> str:
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, point, fstype, *_ = line.split()
            if str(path).startswith(point) and len(point) > len(best):
                best, kind = point, fstype
    return kind


def test_a_durable_save_goes_around_the_page_cache(tmp_path: Path) -> None:
    """A durable 8 MiB object leaves (at most) its unaligned end in the page cache; a non-durable one all of it."""
    if _fstype(tmp_path) not in ("ext4", "xfs", "btrfs"):
        pytest.skip(f"page cache residency is meaningful on disk file systems, not {_fstype(tmp_path)!r}")
    parts = _parts([8 << 20, 100])
    Storage(str(tmp_path), durable=True).write("durable", parts)
    Storage(str(tmp_path), durable=False).write("plain", parts)
    pages = -(-((8 << 20) + 100) // mmap.PAGESIZE)
    assert _resident_pages(tmp_path / "plain") == pages
    assert _resident_pages(tmp_path / "durable") <= 1  # checked before anything reads it back
    assert (tmp_path / "durable").read_bytes() == (tmp_path / "plain").read_bytes()
