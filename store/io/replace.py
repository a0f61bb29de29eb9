"""Exports replace their target whole: the old export or the new one, never a mix, never nothing.

Every exporter writes through :func:`replacing`. A target that exists (a file,
or a folder that is not empty) is refused with
:class:`~reshard.layouts.errors.CheckpointExistsError` unless ``overwrite``.
Otherwise the new export is written into a staging sibling
``.NAME.partial-<id>``, fsynced (every file and folder in it), and then
exchanged with the target in one step: ``renameat2(RENAME_EXCHANGE)`` on Linux
(a new target: ``RENAME_NOREPLACE``), after which the old export, now under
the staging name, is removed. A kill -9 at any point leaves the target whole,
old or new.

Where ``renameat2`` is unavailable (not Linux, or a file system that refuses
it), a folder is swapped in two renames, target -> ``.NAME.old-<id>`` then
staging -> target; a kill between them leaves no target, and the next export
of that target (:func:`clean_leftovers`, run first by :func:`replacing`) renames
``.NAME.old-<id>`` back. A single file is always replaced by ``os.replace``,
atomic everywhere.

The next export also removes what a killed one left: ``.NAME.partial-<id>`` and
``.NAME.old-<id>`` (``<id>``: 12 hex digits), nothing else, and not the staging
of an export still running (it holds an ``flock`` on its staging until done).

A target that is not local (an fsspec URL: single-file exports only) is checked
the same way (refused when it exists unless ``overwrite``) and written in place:
object stores (S3, GCS, Azure) publish an object only when its upload
completes, so readers see the old object or the new one whole; other remote file
systems promise only what they promise.

For tests, ``RESHARD_TEST_KILL_STEP=k`` SIGKILLs the process at the k-th step
(:func:`step`) of this module, and ``RESHARD_TEST_TWO_STEP=1`` takes the
two-rename path.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import functools
import os
import re
import shutil
import signal
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from reshard.layouts.errors import CheckpointExistsError

from .folders import NO_FOLDER_SYNC
from .localfs import is_local_url

#: ``renameat2`` flags (linux/fs.h).
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
#: Why ``renameat2`` may fail where a plain rename would work: no such call, or a file system without it.
_NO_RENAMEAT2 = (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)
_STEPS: dict[int, int] = {}  # steps taken, per process id (a forked child counts from 1)


def step() -> None:
    """A point between two file operations of an export (tests kill the process here, see the module notes)."""
    pid = os.getpid()
    n = _STEPS[pid] = _STEPS.get(pid, 0) + 1
    if os.environ.get("RESHARD_TEST_KILL_STEP") == str(n):
        os.kill(os.getpid(), signal.SIGKILL)


@functools.cache
def _libc_renameat2() -> Any:
    name = ctypes.util.find_library("c")
    try:
        fn = getattr(ctypes.CDLL(name, use_errno=True), "renameat2", None)
    except OSError:
        return None
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


def renameat2(src: str, dst: str, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False when the system or the file system lacks it (nothing done).

    Raises
    ------
    OSError
        Any other failure (``FileExistsError`` for ``RENAME_NOREPLACE`` onto an existing ``dst``).
    """
    fn = None if os.environ.get("RESHARD_TEST_TWO_STEP") else _libc_renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_RENAMEAT2:
        return False
    raise OSError(err, f"renameat2: {os.strerror(err)}", src, None, dst)


def holds_export(path: str) -> bool:
    """Whether ``path`` holds something an export would replace: a file, a link, or a folder that is not empty."""
    return os.path.lexists(path) and (not os.path.isdir(path) or os.path.islink(path) or bool(os.listdir(path)))


def refuse_existing(target: str, overwrite: bool, exists: bool | None = None) -> None:
    """Raise :class:`CheckpointExistsError` naming ``target`` when it exists (default: it holds an export,
    :func:`holds_export`) and not ``overwrite``."""
    if not overwrite and (holds_export(target) if exists is None else exists):
        raise CheckpointExistsError(f"{target} already exists; overwrite=True (--overwrite on the command line) "
                                    "replaces it whole")


def _sync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in NO_FOLDER_SYNC:
            raise


def fsync_path(path: str) -> None:
    """fsync one file or folder (folders whose file system cannot are skipped)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        _sync_fd(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file and folder under ``path`` (links are not followed), then ``path`` itself."""
    if os.path.isdir(path) and not os.path.islink(path):
        for top, dirs, files in os.walk(path, topdown=False):
            for name in files:
                if not os.path.islink(os.path.join(top, name)):
                    fsync_path(os.path.join(top, name))
            for name in dirs:
                fsync_path(os.path.join(top, name))
    fsync_path(path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _lock(path: str) -> int:
    """An fd holding an exclusive ``flock`` on ``path`` (-1 where the file system has none)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    except OSError:
        os.close(fd)
        return -1
    return fd


def _in_use(path: str) -> bool:
    """Whether a running export holds ``path`` (its staging)."""
    try:
        fd = _lock(path)
    except BlockingIOError:
        return True
    except OSError:  # gone meanwhile
        return False
    if fd >= 0:
        os.close(fd)
    return False


def leftover_pattern(name: str) -> re.Pattern[str]:
    """The names of an export's leftovers beside target ``name``: ``.NAME.partial-<id>``, ``.NAME.old-<id>``."""
    return re.compile(rf"\.{re.escape(name)}\.(partial|old)-([0-9a-f]{{12}})")


def set_aside(target: str) -> str | None:
    """Where the old export of a missing ``target`` lies, when a two-rename swap was killed between its
    renames (``.NAME.old-<id>``, whole); None when ``target`` exists or nothing was set aside."""
    parent, name = os.path.split(os.path.abspath(target))
    if os.path.lexists(target) or not os.path.isdir(parent):
        return None
    pattern = leftover_pattern(name)
    old = sorted(e for e in os.listdir(parent) if (m := pattern.fullmatch(e)) and m.group(1) == "old")
    return os.path.join(parent, old[0]) if old else None


def clean_leftovers(target: str) -> list[str]:
    """Recover and remove what killed exports of ``target`` left beside it; the paths removed.

    When ``target`` is missing and ``.NAME.old-<id>`` exists (a two-rename swap
    killed between its renames), the old export is renamed back first. Only
    names of :func:`leftover_pattern` are touched, and not the staging of an
    export still running.
    """
    parent, name = os.path.split(os.path.abspath(target))
    pattern = leftover_pattern(name)
    found: dict[str, set[str]] = {}
    for entry in os.listdir(parent):
        if m := pattern.fullmatch(entry):
            found.setdefault(m.group(2), set()).add(m.group(1))
    removed = []
    for uid, kinds in sorted(found.items()):
        partial, old = (os.path.join(parent, f".{name}.{kind}-{uid}") for kind in ("partial", "old"))
        if "partial" in kinds and _in_use(partial):
            continue
        if "old" in kinds and not os.path.lexists(target):
            os.rename(old, target)  # the two-rename swap was cut between its renames: the old export comes back
            fsync_path(parent)
            kinds.discard("old")
        for kind in sorted(kinds):
            path = os.path.join(parent, f".{name}.{kind}-{uid}")
            _remove(path)
            removed.append(path)
    if removed:
        fsync_path(parent)
    return removed


def _swap_in(staging: str, target: str, old: str) -> None:
    """Put ``staging`` at ``target`` and remove what was there (kept at ``staging`` or ``old`` until then)."""
    parent = os.path.dirname(target)
    if not os.path.lexists(target):
        if not renameat2(staging, target, RENAME_NOREPLACE):
            os.rename(staging, target)
    elif renameat2(staging, target, RENAME_EXCHANGE):  # the old export is now at ``staging``
        step()
        fsync_path(parent)
        step()
        _remove(staging)
    elif not os.path.isdir(staging):
        os.replace(staging, target)  # one file: atomic everywhere
    else:  # the documented two-step: a kill between the renames leaves no target until clean_leftovers
        os.rename(target, old)
        step()
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(old, target)
            raise
        step()
        fsync_path(parent)
        step()
        _remove(old)
    fsync_path(parent)


@contextlib.contextmanager
def replacing(target: str, *, overwrite: bool, folder: bool,
              storage_options: Mapping[str, Any] | None = None) -> Iterator[str]:
    """Where to write an export of ``target``; on a clean exit the export replaces ``target`` whole.

    Parameters
    ----------
    target : str
        The export's file or folder: a local path, or (files only) an fsspec URL.
    overwrite : bool
        Replace a ``target`` that exists (else :class:`CheckpointExistsError`).
    folder : bool
        The export is a folder (yielded created and empty), else one file (yielded as a path to create).
    storage_options : mapping, optional
        fsspec options of a remote ``target``.

    Yields
    ------
    str
        The staging path to write (a remote target: ``target`` itself).

    Raises
    ------
    CheckpointExistsError
        ``target`` exists (a file, or a folder that is not empty) and ``overwrite`` is False.
    NotADirectoryError, IsADirectoryError
        A folder export onto a file, or a file export onto a folder.
    """
    if not is_local_url(target):
        if folder:
            raise ValueError(f"{target}: folder exports write local folders only")
        import fsspec

        fs, path = fsspec.core.url_to_fs(target, **dict(storage_options or {}))
        refuse_existing(target, overwrite, not overwrite and fs.exists(path))
        yield target
        return
    target = os.path.abspath(os.path.expanduser(target.removeprefix("file://")))
    if folder and os.path.isfile(target):
        raise NotADirectoryError(f"{target} is a file; this export writes a folder")
    if not folder and os.path.isdir(target):
        raise IsADirectoryError(f"{target} is a folder; this export writes one file")
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    clean_leftovers(target)
    refuse_existing(target, overwrite)
    step()
    uid = uuid.uuid4().hex[:12]
    staging, old = (os.path.join(parent, f".{name}.{kind}-{uid}") for kind in ("partial", "old"))
    if folder:
        os.mkdir(staging)
    else:
        os.close(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    lock = _lock(staging)
    try:
        step()
        yield staging
        step()
        fsync_tree(staging)
        step()
        refuse_existing(target, overwrite)  # one may have appeared while this export ran
        _swap_in(staging, target, old)
        step()
    except BaseException:
        _remove(staging)
        raise
    finally:
        if lock >= 0:
            os.close(lock)
