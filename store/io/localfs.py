"""Local files of a checkpoint read as untrusted input: keys confined, no link followed, regular files only.

:class:`~reshard.store.io.storage.Storage` routes every key through
:func:`confined` and every local read through :func:`open_regular`: a checkpoint
cannot make reshard read outside its root (``/etc/passwd``, ``../.ssh/id_rsa``,
a symbolic link out), hang on a FIFO, or stream ``/dev/zero``. The checks cost
no system call per chunk read: folders and files are checked once each and
remembered in the storage's ``checked`` set.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Sequence
from typing import Any

from reshard.layouts.errors import FormatError

#: Local reads open with these: never through a link (the last component; folders are checked once each),
#: never blocking on a FIFO.
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def is_local_url(url: str) -> bool:
    """Whether ``url`` names a local path (no scheme, or ``file://``)."""
    return "://" not in url or url.startswith("file://")


def plain_root(url: str) -> str | None:
    """The absolute path fsspec's ``url_to_fs`` gives a plain local path (no scheme, no chaining), else None.

    As ``fsspec.implementations.local.make_path_posix`` on POSIX: ``~`` expanded, a relative
    path (``./`` dropped) joined to the working directory, trailing slashes dropped.
    """
    if "://" in url or "::" in url or os.sep != "/" or not url:
        return None
    if url.startswith("~"):
        path = os.path.expanduser(url)
    elif url.startswith("/"):
        path = url
    else:
        rest = "" if url == "." else url[2:] if url.startswith("./") else url
        path = f"{os.getcwd()}/{rest}"
    return path.rstrip("/") or "/"


def relative(key: str) -> bool:
    """Whether ``key`` is a relative key with no empty, ``.`` or ``..`` component (one check per request)."""
    return not key.startswith("/") and "//" not in key and "\\" not in key \
        and "/./" not in f"/{key}/" and "/../" not in f"/{key}/"


def parent_of(root: str) -> str | None:
    """The root's parent folder, if it lies on the same host or bucket (keys ``../<name>/...`` lead there)."""
    body = root.split("://", 1)[-1].strip("/")
    if "/" not in body:  # the root is a bucket, a host or "/": its siblings are other buckets, hosts or anything
        return None
    return root.rsplit("/", 1)[0]


def confined(url: str, root: str, parent: str | None, key: str) -> str:
    """The path of ``key`` under ``root``; a :class:`FormatError` naming the key if it leads outside.

    A key is relative, with no empty, ``.`` or ``..`` component, except one
    leading ``../`` followed by a folder name that does not start with ``.``
    (incremental saves reference a sibling checkpoint's objects), and only where
    the root has a ``parent`` on the same host or bucket. Anything else
    (``/etc/passwd``, ``a/../../b``, ``../.ssh/id_rsa``, ``../host:port/x`` on
    ``http://host:port``) is refused.
    """
    if key.startswith("../"):
        rest = key[3:]
        if parent is None or not rest or rest.startswith(".") or not relative(rest):
            raise FormatError(f"{url}: key {key[:200]!r} leads outside the checkpoint and its siblings")
        return f"{parent}/{rest}"
    if not key:
        return root
    if not relative(key):
        raise FormatError(f"{url}: key {key[:200]!r} leads outside the checkpoint")
    return f"{root}/{key}"


def open_regular(path: str, base: str, checked: set[str], where: str) -> int:
    """``path`` (below ``base``) opened for reading: a regular file reached through no link below ``base``.

    ``base`` itself may be a link. Below it, each folder is checked once
    (``lstat``, remembered in ``checked``), the file is opened with
    ``O_NOFOLLOW`` (a link fails there, costing nothing) and ``O_NONBLOCK`` (a
    FIFO does not hang) and checked to be a regular file on first use. Errors
    name ``where``: FileNotFoundError if absent, FormatError for a link or a
    file that is not regular.
    """
    folder = path.rpartition("/")[0]
    if folder not in checked and folder != base:
        _check_folders(base, folder, checked, where)
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FormatError(f"{where} is a symbolic link: reshard follows no links inside a checkpoint") from None
        raise
    if path not in checked:
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise FormatError(f"{where} is not a regular file (mode {stat.filemode(mode)}): "
                                  "reshard reads regular files only")
        except BaseException:
            os.close(fd)
            raise
        checked.add(path)
    return fd


def _check_folders(base: str, folder: str, checked: set[str], where: str) -> None:
    """Refuse a path whose folders below ``base`` include a link (each folder is checked once)."""
    parts = folder[len(base) + 1:].split("/") if folder.startswith(base + "/") else []
    at = base
    for part in parts:
        at = f"{at}/{part}"
        if at in checked:
            continue
        try:
            mode = os.lstat(at).st_mode
        except FileNotFoundError:
            return  # the open that follows says the object is missing
        if stat.S_ISLNK(mode):
            raise FormatError(f"{where}: {at} is a symbolic link: reshard follows no links inside a checkpoint")
        checked.add(at)


def read_whole(fd: int, limit: int, where: str) -> bytes:
    """All of an open file, refused (FormatError) before reading when it is over ``limit`` bytes."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise too_big(where, size, limit)
    parts, got = [], 0
    while got <= size:  # one read as a rule; a file that grew meanwhile is read to the limit only
        part = os.read(fd, max(size - got, 0) + 1)
        if not part:
            break
        parts.append(part)
        got += len(part)
        if got > limit:
            break
    return parts[0] if len(parts) == 1 else b"".join(parts)


def check_tree(top: str, url: str) -> None:
    """Walk the folder ``top`` (links not followed): a FormatError for a link or anything but files and folders."""
    todo = [top]
    while todo:
        with os.scandir(todo.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    todo.append(entry.path)
                elif not entry.is_file(follow_symlinks=False):
                    what = "a symbolic link" if entry.is_symlink() else "not a regular file"
                    raise FormatError(f"{url}: {entry.path} is {what}: reshard reads regular files only and "
                                      "follows no links inside a checkpoint")


def too_big(where: str, size: int, limit: int) -> FormatError:
    return FormatError(f"{where} is {size} bytes, over the {limit}-byte limit of what reshard reads of such an "
                       "object (malformed or hostile?)")


#: Buffers one ``writev``/``preadv`` takes at most (Linux's ``IOV_MAX`` is 1024).
IOV_MAX = 512


def writev_all(fd: int, parts: Sequence[Any]) -> None:
    """Write every byte of ``parts`` (at most :data:`IOV_MAX` buffers) at the file's position, however short
    each ``writev`` falls."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


class PlainFiles:
    """The calls the importers make of an fsspec file system, for plain local paths, without fsspec.

    ``size``, ``open`` (``"rb"``), ``exists``, ``isdir`` and ``ls`` as ``LocalFileSystem`` answers
    them (``ls(detail=True)``: ``name``, ``size``, ``type`` of the entry itself, ``islink``), so that
    a command reading a local file need not import fsspec (60 ms).
    """

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def open(self, path: str, mode: str = "rb") -> Any:
        if mode != "rb":
            raise ValueError(f"PlainFiles opens for reading only, not {mode!r}")
        return open(path, "rb")

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def ls(self, path: str, detail: bool = False) -> list[Any]:
        base = plain_root(path) or path
        if not os.path.isdir(base):
            os.stat(base)  # a missing path: FileNotFoundError, as fsspec
            return [self._info(base, None)] if detail else [base]
        out: list[Any] = []
        with os.scandir(base) as it:
            for entry in it:
                with contextlib.suppress(FileNotFoundError):  # gone since listed: left out, as fsspec does
                    out.append(self._info(f"{base}/{entry.name}", entry) if detail else f"{base}/{entry.name}")
        return out

    @staticmethod
    def _info(path: str, entry: os.DirEntry[str] | None) -> dict[str, Any]:
        if entry is None:
            st = os.stat(path)
            kind = "directory" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
            return {"name": path, "size": st.st_size, "type": kind, "islink": os.path.islink(path)}
        link = entry.is_symlink()
        kind = ("directory" if entry.is_dir(follow_symlinks=False) else "file" if entry.is_file(follow_symlinks=False)
                else "other")
        size = entry.stat(follow_symlinks=False).st_size
        if link:
            try:
                size = entry.stat(follow_symlinks=True).st_size
            except OSError:
                size = 0
        return {"name": path, "size": size, "type": kind, "islink": link}
