"""Byte storage under one checkpoint root: any fsspec URL, with a local fast path.

Everything the store reads or writes goes through :class:`Storage`, which
counts requests and bytes (:class:`~reshard.store.io.stats.IOStats`) and retries transient failures of
remote stores with exponential backoff. Local files are read with ``os.preadv``
straight into the destination buffers (no intermediate copies).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from reshard.layouts.errors import CheckpointExistsError, ReshardError, StorageError

from . import direct, localfs, multipart, remote, retry, s3client
from .folders import FolderSync
from .stats import IOStats

T = TypeVar("T")
#: Largest object :meth:`Storage.read` reads whole unless told otherwise: whole reads are metadata documents
#: and small shards (documents have lower limits of their own: :mod:`reshard.store.format.schema`).
MAX_WHOLE_READ = 1 << 30

class Storage:
    """Objects under one root URL.

    Parameters
    ----------
    url : str
        Any fsspec URL or local path (``/data/ckpt``, ``file://``, ``memory://``,
        ``s3://bucket/ckpt``, ``gs://``, ``http(s)://`` read-only).
    storage_options : dict, optional
        Passed to the fsspec filesystem (credentials, endpoint...).
    retries : int
        Attempts after the first for a transiently failing remote request.
    durable : bool
        Local files only (an object store's PUT is durable once answered):
        every object written is fsynced before it is closed, and a
        *publishing* write (:meth:`write_atomic`, :meth:`write_new`: manifests,
        indexes, commit markers) first fsyncs the folders of every earlier
        write, then its own folder after it. So whatever a published object
        announces survives a power loss whenever the object itself does.
    """

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, retries: int = 5, durable: bool = True
    ) -> None:
        self.url = str(url).rstrip("/")
        #: The fsspec options it was made with (credentials, endpoint...).
        self.options = dict(storage_options or {})
        local_root = None if self.options else localfs.plain_root(self.url)
        if local_root is not None:  # fsspec (60 ms to import) only when a call needs it: see :attr:`fs`
            self._fs: Any = None
            root, self.local = local_root, True
        else:
            import fsspec
            from fsspec.implementations.local import LocalFileSystem

            self._fs, root = fsspec.core.url_to_fs(self.url, **s3client.with_connections(self.url, self.options))
            self.local = isinstance(self._fs, LocalFileSystem)
            s3client.one_round_trip_writes(self._fs)
        self.root = root.rstrip("/")
        self._getter: remote.Getter | None = None
        self.retries = retries
        self.durable = bool(durable) and self.local
        self.stats = IOStats()
        #: Where keys ``../<name>/...`` (a checkpoint beside this one) lead; None: nowhere (the root has no
        #: parent on its host or bucket, so such a key would leave it).
        self._parent = localfs.parent_of(self.root)
        #: Local files and folders checked to be no links (and files to be regular), shared by child storages.
        self._checked: set[str] = set()
        self._also: IOStats | None = None
        self._lock = threading.Lock()
        #: Durable writes: folders whose entries changed since they were last fsynced (shared by child storages).
        self._folders = FolderSync()

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    @property
    def fs(self) -> Any:
        """The fsspec file system (for a plain local path, made on first use: ``LocalFileSystem()``)."""
        if self._fs is None:
            from fsspec.implementations.local import LocalFileSystem

            self._fs = LocalFileSystem()
        return self._fs

    def child(self, prefix: str) -> Storage:
        """The objects under ``prefix``, as a storage of their own (same filesystem, same counters)."""
        self.path(prefix)  # confined like any key
        sub = copy.copy(self)
        sub.url, sub.root = f"{self.url}/{prefix}", f"{self.root}/{prefix}"
        sub._parent = self.root
        return sub

    def path(self, key: str) -> str:
        """The filesystem path of ``key``; ``../<name>/...`` is a key of the folder beside this one.

        Every access goes through here, so this is where keys are confined
        (:func:`.localfs.confined`): a key that leads outside the checkpoint and
        its siblings is a :class:`FormatError` naming it.
        """
        return localfs.confined(self.url, self.root, self._parent, key)

    @property
    def parent_url(self) -> str | None:
        """The URL of the folder keys ``../<name>/...`` lead to (None: there is none on this host or bucket).

        Locally its absolute path (the URL may be a bare relative name, ``step-2``).
        """
        if self._parent is None or self.local:
            return self._parent
        return self.url.rsplit("/", 1)[0]

    def check_object(self, key: str) -> None:
        """Check ``key`` is one reshard may read (confined; locally a regular file reached through no link)."""
        if self.local:
            os.close(self._call(key, lambda: self._local_fd(key)))
        else:
            self.path(key)

    def check_tree(self, prefix: str = "") -> None:
        """Locally, walk ``prefix`` (links not followed): a FormatError for a link or anything but files and folders.

        Before a general library (zarr-python, TensorStore) reads a folder, which
        it would read through links. Nothing to do on object stores.
        """
        if self.local:
            localfs.check_tree(self.path(prefix), self.url)

    def _local_fd(self, key: str) -> int:
        """A local object opened for reading (:func:`.localfs.open_regular`)."""
        base = self._parent if key.startswith("../") else self.root
        assert base is not None  # self.path() refused the key otherwise
        return localfs.open_regular(self.path(key), base, self._checked, f"{self.url}/{key}")

    def counting(self, also: IOStats) -> Storage:
        """This storage, its requests counted in ``also`` too (the counters of one call)."""
        sub = copy.copy(self)
        sub._also = also
        return sub

    def count(self, **counts: int) -> None:
        with self._lock:
            self.stats.add(**counts)
            if self._also is not None:
                self._also.add(**counts)

    # ------------------------------------------------------------ reading
    def read(self, key: str, limit: int | None = None) -> bytes:
        """Read a whole object (FileNotFoundError if absent).

        An object over ``limit`` bytes (default :data:`MAX_WHOLE_READ`) is a
        :class:`FormatError` naming it, raised before its bytes are read (locally
        its size is checked first; a remote read asks for ``limit + 1`` bytes at most).
        """
        limit = MAX_WHOLE_READ if limit is None else limit
        if self.local:  # plain open/read: a tenth of fsspec's cost per small file
            data = self._call(key, lambda: self._read_whole(key, limit))
        else:  # one ranged GET (no HEAD first), of at most limit + 1 bytes
            data = self._call(key, lambda: self._remote.get(self.path(key), 0, limit + 1))
        if len(data) > limit:
            raise localfs.too_big(f"{self.url}/{key}", len(data), limit)
        self.count(requests=1, bytes_fetched=len(data))
        return bytes(data)

    def _read_whole(self, key: str, limit: int) -> bytes:
        fd = self._local_fd(key)
        try:
            return localfs.read_whole(fd, limit, f"{self.url}/{key}")
        finally:
            os.close(fd)

    def read_suffix(self, key: str, nbytes: int) -> bytes:
        """Read the last ``nbytes`` of an object in one request."""
        if self.local:
            fd = self._call(key, lambda: self._local_fd(key))
            try:
                size = os.fstat(fd).st_size
                if size < nbytes:
                    raise StorageError(f"{self.url}/{key}: object is {size} bytes, shorter than the {nbytes} bytes "
                                       "expected at its end (truncated?)")
                data = os.pread(fd, nbytes, size - nbytes)
            finally:
                os.close(fd)
        else:
            data = self._call(key, lambda: self._remote.get(self.path(key), -nbytes))
        if len(data) != nbytes:  # a remote object shorter than nbytes comes back whole
            raise StorageError(f"{self.url}/{key}: object is {len(data)} bytes, shorter than the {nbytes} bytes "
                               "expected at its end (truncated?)")
        self.count(requests=1, bytes_fetched=len(data))
        return bytes(data)

    def read_tail(self, key: str, nbytes: int) -> bytes:
        """Read the last ``nbytes`` of an object, or all of it if it is shorter: one request."""
        if self.local:
            def tail() -> bytes:
                fd = self._local_fd(key)
                try:
                    size = os.fstat(fd).st_size
                    return os.pread(fd, min(size, nbytes), max(0, size - nbytes))
                finally:
                    os.close(fd)
            data = self._call(key, tail)
        else:
            data = self._call(key, lambda: self._remote.get(self.path(key), -nbytes))
        self.count(requests=1, bytes_fetched=len(data))
        return bytes(data)

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` (in order) from the bytes at ``offset``: one request."""
        total = sum(b.nbytes for b in buffers)
        try:
            self._read_into(key, offset, buffers, total)
        except FileNotFoundError:  # the key, for the caller to name what the object held
            raise FileNotFoundError(errno.ENOENT, "no such object", key) from None
        self.count(requests=1, bytes_fetched=total)

    def _read_into(self, key: str, offset: int, buffers: Sequence[memoryview], total: int) -> None:
        if self.local:
            fd = self._call(key, lambda: self._local_fd(key))
            try:
                done, pos = 0, offset
                for i in range(0, len(buffers), localfs.IOV_MAX):
                    part = buffers[i : i + localfs.IOV_MAX]
                    want = sum(b.nbytes for b in part)
                    got = os.preadv(fd, part, pos)
                    if got != want:  # short read: the object is shorter than its index says
                        raise StorageError(f"{self.url}/{key}: short read at offset {pos}")
                    done, pos = done + got, pos + got
            finally:
                os.close(fd)
        else:
            path = self.path(key)
            cuts = remote.split_range(offset, total)
            if len(cuts) == 1:
                parts = [self._call(key, lambda: self._remote.get(path, offset, offset + total))]
            else:  # a long range: its parts in parallel, on the filesystem's own event loop when it has one
                parts = self._call(key, lambda: self._remote.get_parts(path, cuts))
            if sum(len(p) for p in parts) != total:
                raise StorageError(f"{self.url}/{key}: short read at offset {offset}")
            remote.scatter(parts, buffers)

    @property
    def _remote(self) -> remote.Getter:
        """The GETs of :attr:`fs` (made on first use)."""
        if self._getter is None:
            self._getter = remote.Getter(self.fs)
        return self._getter

    def warm_up(self, key: str) -> None:
        """Open a connection of the remote pool with a 1-byte read of ``key``, counted nowhere, errors ignored
        (:func:`reshard.store.read.open` warms a pool before the load's requests need it)."""
        with contextlib.suppress(Exception):
            self._remote.get(self.path(key), 0, 1)

    def read_if_exists(self, key: str) -> bytes | None:
        """Read a whole object, or None if it is absent: one GET, never a listing.

        Only "no such key" reads as None: a missing bucket, a denied or failing
        request raises :class:`StorageError`.
        """
        try:
            return self.read(key)
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        """Whether an object or a prefix exists (on S3 a HEAD and a LIST: decide objects with :meth:`has`)."""
        return bool(self._call(key, lambda: self.fs.exists(self.path(key))))

    def has(self, key: str) -> bool:
        """Whether object ``key`` exists: a GET of its last byte, never a HEAD + LIST (:meth:`exists` on S3)."""
        try:
            self.read_tail(key, 1)
        except FileNotFoundError:
            return False
        return True

    def list(self, prefix: str) -> list[str]:
        """Keys directly under ``prefix``; empty if there are none (a missing bucket or a failed listing raises)."""
        try:
            names = self._call(prefix, lambda: self.fs.ls(self.path(prefix), detail=False))
        except FileNotFoundError:
            return []
        return sorted(n.rstrip("/").rsplit("/", 1)[-1] for n in names)

    def modified(self, key: str) -> float | None:
        """Newest modification time (POSIX seconds) of ``key`` or of the objects directly under it; None if absent."""
        try:
            infos = self._call(key, lambda: self.fs.ls(self.path(key), detail=True))
        except FileNotFoundError:
            return None
        times = [_mtime(i) for i in infos]
        return max((t for t in times if t is not None), default=None)

    # ------------------------------------------------------------ writing
    def write(self, key: str, data: bytes | Sequence[Any]) -> None:
        """Write (or replace) one object from bytes or a list of buffers.

        On S3 an object of at least :data:`.multipart.MULTIPART_BYTES` is a multipart upload whose parts go
        in parallel straight from the buffers (:mod:`.multipart`); a smaller one is one PUT.
        """
        parts = [data] if isinstance(data, bytes | bytearray | memoryview) else list(data)
        nbytes = sum(memoryview(p).nbytes for p in parts)
        if self.local:
            with self._created(key) as fd:
                if not (self.durable and direct.write(fd, parts)):  # durable: around the page cache
                    for i in range(0, len(parts), localfs.IOV_MAX):
                        localfs.writev_all(fd, parts[i : i + localfs.IOV_MAX])
        elif nbytes >= multipart.MULTIPART_BYTES and multipart.supported(self.fs):
            # parts in parallel, read from the buffers themselves (no joined copy); aborted on failure
            self._call(key, lambda: multipart.upload(self.fs, self.path(key), parts))
        else:
            blob = parts[0] if len(parts) == 1 else b"".join(parts)
            self._call(key, lambda: self.fs.pipe_file(self.path(key), bytes(blob)))
        self.count(writes=1, bytes_written=nbytes)

    @contextlib.contextmanager
    def _created(self, key: str) -> Iterator[int]:
        """A local object opened for writing (created or emptied, its folders made); fsynced when durable."""
        path = self.path(key)
        with self._naming(key):
            self._makedirs(os.path.dirname(path))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                yield fd
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def write_stream(self, key: str, chunks: Iterable[bytes], part_bytes: int = 16 << 20) -> str:
        """Write (or replace) one object from pieces made as it goes, never all held; its sha256 (hex).

        Local files are written piece by piece (fsynced at the end when durable);
        object stores get one upload, in parts of ``part_bytes`` (a multipart upload on S3).
        """
        digest = hashlib.sha256()
        nbytes = 0
        if self.local:
            with self._created(key) as fd:
                pending: list[bytes] = []
                held = 0
                for chunk in chunks:
                    digest.update(chunk)
                    nbytes += len(chunk)
                    pending.append(chunk)
                    held += len(chunk)
                    if held >= part_bytes or len(pending) >= localfs.IOV_MAX:
                        localfs.writev_all(fd, pending)
                        pending, held = [], 0
                if pending:
                    localfs.writev_all(fd, pending)
        else:
            started: list[bool] = []

            def upload() -> None:
                nonlocal nbytes
                if started:  # a retry cannot replay the pieces already consumed
                    raise StorageError(f"{self.url}/{key}: the upload failed part way; write it again")
                started.append(True)
                with self.fs.open(self.path(key), "wb", block_size=part_bytes) as f:
                    for chunk in chunks:
                        digest.update(chunk)
                        nbytes += len(chunk)
                        f.write(chunk)

            self._call(key, upload)
        self.count(writes=1, bytes_written=nbytes)
        return digest.hexdigest()

    def digest(self, key: str, piece: int = 16 << 20) -> str:
        """The sha256 (hex) of an object, read in pieces of ``piece`` bytes (never held whole).

        Raises
        ------
        FileNotFoundError
            If there is no such object.
        """
        h = hashlib.sha256()
        if self.local:
            fd = self._call(key, lambda: self._local_fd(key))  # a regular file reached through no link
            try:
                while block := os.read(fd, piece):
                    h.update(block)
                    self.count(bytes_fetched=len(block))
            finally:
                os.close(fd)
        else:
            def read() -> None:
                with self.fs.open(self.path(key), "rb", block_size=piece) as f:
                    while block := f.read(piece):
                        h.update(block)
                        self.count(bytes_fetched=len(block))

            self._call(key, read)
        self.count(requests=1)
        return h.hexdigest()

    def write_atomic(self, key: str, data: bytes | Sequence[Any]) -> None:
        """Write (or replace) one object so that readers see the old or the new bytes, never a mix or a part.

        An object store's PUT is atomic already; a local file is written beside and renamed over.
        """
        if not self.local:
            self.write(key, data)
            return
        tmp = f"{key}.{uuid.uuid4().hex}.tmp"
        self.write(tmp, data)
        with self._naming(key):
            try:
                self.sync()  # what this object announces is durable before it is
                os.replace(self.path(tmp), self.path(key))
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path(tmp))
                raise
            self._folders.changed(os.path.dirname(self.path(key)))
            self.sync()

    def write_new(self, key: str, data: bytes) -> None:
        """Write an object only if it does not exist yet (atomic create).

        Local files use ``O_EXCL``; S3 gets a conditional PUT (``If-None-Match: *``,
        through fsspec's ``mode="create"``). A filesystem without conditional
        writes falls back to check-then-write, which is not atomic (documented).
        Write a unique ``data`` (e.g. with a random token): if a retried create
        answers "exists" because its own first attempt landed, the object is
        read back and accepted when it holds ``data``.

        Raises
        ------
        CheckpointExistsError
            If the object already exists with other content.
        """
        if self.local:
            path = self.path(key)
            with self._naming(key):
                self._makedirs(os.path.dirname(path))
                self.sync()  # what this object announces is durable before it is
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    raise CheckpointExistsError(f"{self.url}/{key} already exists") from None
                try:
                    localfs.writev_all(fd, [data])
                    if self.durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                self._folders.changed(os.path.dirname(path))
                self.sync()
        else:
            try:
                self._call(key, lambda: self.fs.pipe_file(self.path(key), data, mode="create"))
            except FileExistsError:
                if self.read(key) != data:  # not our own create, acknowledged late
                    raise CheckpointExistsError(f"{self.url}/{key} already exists") from None
            except TypeError:  # a filesystem without the mode argument: best effort
                if self.exists(key):
                    raise CheckpointExistsError(f"{self.url}/{key} already exists") from None
                self._call(key, lambda: self.fs.pipe_file(self.path(key), data))
        self.count(writes=1, bytes_written=len(data))

    def sync(self) -> None:
        """Durable local storage: fsync the folders whose entries changed (new files, renames, new folders).

        Publishing writes call it; a writer whose objects another storage
        publishes (a redivide task) calls it before it reports its work done.
        """
        if self.durable:
            self._folders.sync()

    def _makedirs(self, folder: str) -> None:
        """Create ``folder`` and its missing parents; durable storage notes the folders whose entries change."""
        if self.durable:
            self._folders.makedirs(folder)
        else:
            os.makedirs(folder, exist_ok=True)

    @contextlib.contextmanager
    def _naming(self, key: str) -> Iterator[None]:
        """A local write's failure (no space, denied, I/O error) as a StorageError naming the object."""
        try:
            yield
        except ReshardError:  # named already (CheckpointExistsError, a nested write's StorageError)
            raise
        except OSError as e:
            raise StorageError(f"{self.url}/{key}: {type(e).__name__}: {e}") from e

    def delete(self, key: str, *, recursive: bool = True) -> None:
        """Remove an object or a whole prefix; absent is fine. ``recursive=False``: one object (no LIST on S3)."""
        with contextlib.suppress(FileNotFoundError):
            self._call(key, lambda: self.fs.rm(self.path(key), recursive=recursive))

    # ------------------------------------------------------------ retries
    def _call(self, key: str, fn: Callable[[], T]) -> T:
        """Run one storage call, retrying transient failures with backoff (:func:`reshard.store.io.retry.call`)."""
        return retry.call(f"{self.url}/{key}", fn, self.retries, lambda: self.count(retries=1))


def _mtime(info: dict[str, Any]) -> float | None:
    """Modification time from an fsspec listing entry (local ``mtime``, S3 ``LastModified``, memory ``created``)."""
    for field in ("mtime", "LastModified", "last_modified", "created", "updated"):
        value = info.get(field)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return None
