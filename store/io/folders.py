"""Durable local writes: the folders whose entries changed, fsynced before what they name is announced.

A new file, a rename or a new folder is durable only once its folder is
fsynced. A :class:`~reshard.store.io.storage.Storage` (and its children, which
share one :class:`FolderSync`) notes every such folder, and publishing writes
call :meth:`FolderSync.sync` before and after they publish.
"""

from __future__ import annotations

import errno
import os
import threading

#: fsync of a folder answered with these: the file system keeps its folders in order itself, or cannot
#: (some network and FUSE mounts).
NO_FOLDER_SYNC = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF)


class FolderSync:
    """The local folders whose entries changed since they were last fsynced."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._syncing = threading.Lock()  # one sync at a time: a publish waits for folders another sync took
        self._folders: set[str] = set()

    def changed(self, *folders: str) -> None:
        """Note folders whose entries changed (a new file or folder in them, a rename)."""
        with self._lock:
            self._folders.update(folders)

    def makedirs(self, folder: str) -> None:
        """Create ``folder`` and its missing parents, noting every folder whose entries change."""
        changed, top = [folder], folder
        while not os.path.isdir(top):
            top = os.path.dirname(top)
            changed.append(top)
        os.makedirs(folder, exist_ok=True)
        self.changed(*changed)

    def sync(self) -> None:
        """fsync every noted folder, deepest first: a new folder's own entries, then its name in its parent."""
        with self._syncing:
            with self._lock:
                todo = sorted(self._folders, key=len, reverse=True)
                self._folders.clear()
            for folder in todo:
                try:
                    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
                except FileNotFoundError:  # removed since (a cleaned-up step): nothing to keep
                    continue
                try:
                    os.fsync(fd)
                except OSError as e:
                    if e.errno not in NO_FOLDER_SYNC:
                        raise
                finally:
                    os.close(fd)
