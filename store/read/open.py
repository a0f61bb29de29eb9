"""Opening a checkpoint: the marker, the root metadata, and the ``Checkpoint`` over them.

:func:`open` reads the commit marker and the generation's root metadata document (two
small reads, no data: the directory form's ``zarr.json``, the packed form's
``.reshard/metadata.json``; remote, both in one round trip through the root's copy
``.reshard/head.json``, :func:`read_marker_and_head`) and picks how shards are located (the ranks' manifests, or
the references of a block writer's save). An uncommitted save opens from its
ranks' manifests on request (``allow_uncommitted=True``), for forensics.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reshard.layouts.errors import CheckpointNotFoundError, FormatError, StorageError, UncommittedCheckpointError

from ..commit.locate import ByRanks, ByReferences, Locator, read_references
from ..commit.marker import (
    GENERATION_PREFIX,
    Marker,
    generation_of,
    generation_storage,
    metadata_digest,
    read_marker,
    read_root_document,
    root_document_keys,
)
from ..format import refs as references
from ..format.consolidated import RootMetadata
from ..format.manifests import merge_manifests, present_ranks, read_manifest, read_manifests
from ..format.meta import COMMIT_KEY, HEAD_KEY, META_DIR, ArrayMeta
from ..format.schema import MAX_DOCUMENT_BYTES
from ..io import pool
from ..io.gcpause import gc_paused
from ..io.storage import Storage
from .checkpoint import Checkpoint
from .foreign import foreign_hint


@gc_paused()
def open(url: str, *, allow_uncommitted: bool = False, storage_options: dict[str, Any] | None = None,
         engine: str = "fast", gap: int | None = None, retries: int = 5, save_id: Any = None,
         check_current: bool = True) -> Checkpoint:
    """Open a checkpoint lazily: the commit marker and one metadata document, no data.

    Parameters
    ----------
    url : str
        Local path or fsspec URL of the checkpoint.
    allow_uncommitted : bool
        Open a save whose commit marker is missing, from the ranks' manifests
        (forensics: what did get written?). ``save_id`` picks the save when
        several were attempted.
    storage_options : dict, optional
        fsspec options (credentials, endpoint...).
    engine : {"fast", "tensorstore", "zarr"}
        Which code reads chunks. All three read the same files.
    gap : int, optional
        Byte gap under which reads of one object are merged into one request:
        the cost model (docs/performance.md). Default 64 KiB on local disk,
        128 KiB on object stores.
    retries : int
        Retries of transiently failing remote requests.
    save_id : str or int, optional
        With ``allow_uncommitted``: the save to open.
    check_current : bool
        After each read, check (one small request) that the URL still holds the
        save this view opened, else raise :class:`CheckpointReplacedError`.

    Raises
    ------
    CheckpointNotFoundError
        Nothing is stored at ``url``.
    UncommittedCheckpointError
        The checkpoint was never committed; the message names missing ranks.
    FormatError
        The marker or the metadata is malformed, or the metadata does not match
        the digest its marker recorded (edited or corrupted).
    """
    if engine not in ("fast", "tensorstore", "zarr"):
        raise ValueError(f"engine must be 'fast', 'tensorstore' or 'zarr', got {engine!r}")
    root = Storage(url, storage_options, retries=retries)
    try:
        found, head = read_marker_and_head(root)
    except StorageError as e:
        if isinstance(e.__cause__, NotADirectoryError):
            raise CheckpointNotFoundError(_file_not_checkpoint(url)) from None
        raise
    if found is None or allow_uncommitted:
        return _open_uncommitted(root, allow_uncommitted, save_id, engine, gap)
    marker, raw_marker = found
    storage = generation_storage(root, marker)
    locator: Locator | None = None
    if marker.form == "packed" and marker.locations is None:  # older packed saves: the root document is in refs
        refs = read_references(storage, marker)
        arrays, leaves = parse_metadata(f"{storage.url}/zarr.json", refs.root, marker)
        locator = ByReferences(storage, marker, refs)
    else:
        if head is not None and metadata_digest(head) == marker.metadata_sha256:  # the marker's own metadata
            arrays, leaves = parse_metadata(f"{root.url}/{HEAD_KEY}", head, marker)
        else:  # a save committed before the copy existed, or a commit that raced the two reads
            arrays, leaves = read_metadata(storage, marker)
        if marker.locations == "ranks":
            locator = ByRanks(storage, marker.save_id, marker.generation)
        elif marker.form == "packed":
            locator = ByReferences(storage, marker)
    ckpt = Checkpoint(storage, arrays, leaves, committed=True, engine=engine, gap=gap, root=root, marker=raw_marker,
                      locator=locator)
    ckpt.check_replaced = check_current
    ckpt.save_id = marker.save_id
    return ckpt


def read_marker_and_head(root: Storage) -> tuple[tuple[Marker, bytes] | None, bytes | None]:
    """The marker (as :func:`read_marker`) and the root's copy of the metadata (:data:`HEAD_KEY`), or None.

    Remote, both requests go out at once: one round trip, not two (the copy's URL needs no marker;
    local files have no round trips to save, and read the generation's document). The
    copy is only a candidate: :func:`open` uses it when its sha256 is the marker's ``metadata_sha256``,
    which also holds when a commit landed between the two reads (then the generation's own document is
    read, as for saves committed before the copy existed). A copy that cannot be read is no copy.
    """
    def head() -> bytes | None:
        try:
            return root.read(HEAD_KEY, limit=MAX_DOCUMENT_BYTES)
        except (OSError, StorageError, FormatError):
            return None

    if root.local:  # no round trip to save: the generation's own document, as a plain zarr reader sees it
        return read_marker(root), None
    jobs: list[Callable[[], Any]] = [functools.partial(read_marker, root), head, *_warm_ups(root)]
    found, copy, *_ = pool.run_all(jobs, local=False)
    return found, copy


#: Connections a pooling remote filesystem (fsspec's async ones: HTTP(S), S3, GCS...) opens with its first
#: ``open`` (1-byte reads of the marker, beside the marker's own read, not counted in ``stats``): the requests
#: after it then find them open, not paying a handshake each (a round trip; more with TLS) in the middle of the load.
WARM_CONNECTIONS = 8
_warmed_lock = threading.Lock()


def _warm_ups(root: Storage) -> list[Callable[[], None]]:
    """The warm-up reads for ``root``'s filesystem: :data:`WARM_CONNECTIONS` the first time, none after (the
    filesystem object is marked: its pool keeps the connections; a new object, even of equal options, has a
    new pool)."""
    fs = root.fs
    if not getattr(fs, "async_impl", False):  # no pool of connections (local, memory://)
        return []
    with _warmed_lock:
        if getattr(fs, "_reshard_warmed", False):
            return []
        fs._reshard_warmed = True
    return [functools.partial(root.warm_up, COMMIT_KEY)] * WARM_CONNECTIONS


def is_warm_up(path: str, range_header: str | None) -> bool:
    """Whether a request seen on the wire (its path and ``Range`` header) is one of :func:`_warm_ups`' reads
    (tests and benches that count requests tell them from the load's own)."""
    return path.endswith(COMMIT_KEY) and range_header == "bytes=0-0"


def _file_not_checkpoint(url: str) -> str:
    hint = ("; 'reshard import safetensors FILE DST' converts it"
            if str(url).endswith((".safetensors", ".json")) else "")
    return f"{url} is a file, not a checkpoint (a reshard checkpoint is a folder or URL prefix){hint}"


def read_metadata(storage: Storage, marker: Marker) -> tuple[dict[str, ArrayMeta], dict[str, Any]]:
    """The arrays and leaves of a committed save, checked against its marker."""
    try:
        key, raw = read_root_document(storage, marker)
    except FileNotFoundError:
        raise FormatError(f"{storage.url}/{root_document_keys(marker)[0]} is missing: the committed save's "
                          "metadata is gone") from None
    return parse_metadata(f"{storage.url}/{key}", raw, marker)


def parse_metadata(where: str, raw: bytes, marker: Marker) -> tuple[dict[str, ArrayMeta], dict[str, Any]]:
    """The arrays and leaves of a root ``zarr.json`` (``raw``), checked against its marker.

    A marker that seals the document's summary (``summary_bytes``) lets this
    check and parse only that prefix: the whole document (megabytes at
    thousands of tensors) is checked against ``metadata_sha256`` and parsed
    when a full record is first needed.
    """
    if marker.summary_bytes is None:
        _check_digest(where, raw, marker)
        parsed = RootMetadata(where, raw)
    else:
        prefix = raw[: marker.summary_bytes]
        if len(prefix) != marker.summary_bytes or hashlib.sha256(prefix).hexdigest() != marker.summary_sha256:
            raise FormatError(f"{where}: its summary does not match the digest in its commit marker: the metadata "
                              "was edited or corrupted after the commit")
        parsed = RootMetadata(where, prefix, _WholeRoot(raw, where, marker))
    arrays = parsed.arrays()
    if marker.format_version >= 2 and len(arrays) != marker.tensors:
        raise FormatError(f"{where} describes {len(arrays)} tensors, its commit marker {marker.tensors}")
    return arrays, parsed.leaves


@dataclass(frozen=True)
class _WholeRoot:
    """The whole root document, checked against the marker when first asked for (a plain record: it pickles)."""

    raw: bytes
    where: str
    marker: Marker

    def __call__(self) -> bytes:
        _check_digest(self.where, self.raw, self.marker)
        return self.raw


def _check_digest(where: str, raw: bytes, marker: Marker) -> None:
    if marker.metadata_sha256 is not None and metadata_digest(raw) != marker.metadata_sha256:
        raise FormatError(f"{where} does not match the digest in its commit marker: the metadata was edited or "
                          "corrupted after the commit")


def _open_uncommitted(root: Storage, allow: bool, save_id: Any, engine: str, gap: int | None) -> Checkpoint:
    """An uncommitted save: refused with what is missing, or opened from its manifests when allowed."""
    if save_id is not None:
        gen = root.child(generation_of(save_id))
    else:
        attempts = sorted(n for n in root.list("") if n.startswith(GENERATION_PREFIX))  # diagnostics only
        legacy = root.exists(f"{META_DIR}/ranks")
        found = read_marker(root)
        if found is not None:  # allow_uncommitted on a committed URL: the newest other attempt, else the committed
            attempts = [a for a in attempts if a != found[0].generation] or [found[0].generation]
        if len(attempts) > 1:
            raise UncommittedCheckpointError(
                f"{root.url}: several saves were attempted ({', '.join(attempts)}); pass save_id to open one")
        if attempts:
            gen = root.child(attempts[0])
        elif legacy:
            gen = root  # format version 1: manifests at the root
        else:
            raise CheckpointNotFoundError(f"no checkpoint at {root.url}{foreign_hint(root)}")
    if not allow:
        try:
            read_manifests(gen)
        except UncommittedCheckpointError as e:
            if "no rank has written" in str(e):
                raise CheckpointNotFoundError(f"no checkpoint at {root.url}{foreign_hint(root)}") from None
            raise UncommittedCheckpointError(str(e).replace(gen.url, root.url)) from None
        raise UncommittedCheckpointError(
            f"{root.url}: every rank has written but the checkpoint was never committed "
            "(call commit(), or open with allow_uncommitted=True)")
    conflicts: list[str] = []
    arrays, leaves, locator = _from_manifests(gen, conflicts)
    ckpt = Checkpoint(gen, arrays, leaves, committed=False, engine=engine, gap=gap, root=root, locator=locator)
    ckpt.conflicts = conflicts
    return ckpt


def _from_manifests(storage: Storage, conflicts: list[str]
                    ) -> tuple[dict[str, ArrayMeta], dict[str, Any], Locator | None]:
    """Whatever the ranks that did write have described (missing ranks are skipped, disagreements listed)."""
    try:
        manifests = read_manifests(storage)
    except UncommittedCheckpointError:
        manifests = {r: read_manifest(storage, r) for r in present_ranks(storage)}
    arrays, leaves = merge_manifests(storage.url, manifests, conflicts=conflicts)
    located = {k: v for m in manifests.values() for k, v in (m.get("packed") or {}).items()}
    if not any("packed" in m for m in manifests.values()):
        return arrays, leaves, None
    refs = references.parse(f"{storage.url}/{META_DIR}/ranks", references.build({"zarr.json": b"{}"}, located))
    return arrays, leaves, ByReferences(storage, None, refs)
