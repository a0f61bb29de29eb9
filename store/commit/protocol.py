"""The commit protocol: save generations, the commit lock, the marker.

Manifests are in :mod:`reshard.store.format.manifests`.

A save is a **generation**: every object it writes lives under ``url/<generation>/``
(``gen-<save_id>``), and nothing of a generation is rewritten once it is committed.
Every rank writes its shards, then its manifest ``<generation>/.reshard/ranks/<rank>.json``.
Any one process then calls :func:`commit`: it takes the generation's lock with a
create-if-absent write, reads every expected rank's manifest by key and checks that they
agree (:mod:`reshard.store.format.manifests`), writes every array's and group's ``zarr.json`` and the generation's root
``zarr.json`` (consolidated metadata) and, last, the marker ``url/.reshard/commit.json``,
which names the generation readers use and the sha256 of its metadata. A new save of
the same URL is a new generation: until it commits, readers see the old one whole.
docs/format.md has the whole protocol and what a crash at each step leaves.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from reshard.layouts.errors import (
    BadNameError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CommitConflictError,
    FormatError,
)

from ..format.consolidated import root_document, summary_seal
from ..format.manifests import merge_manifests, merge_packed, read_manifests
from ..format.meta import (
    COMMIT_KEY,
    FORMAT_VERSION,
    LOCK_KEY,
    ArrayMeta,
    escape_component,
    group_json,
)
from ..format.refs import FORMS, REFS_KEY, objects_of
from ..format.refs import build as build_references
from ..format.schema import (
    check_component,
    loads_json,
    marker_fields,
    with_digest,
)
from ..io import pool
from ..io.gcpause import gc_paused
from ..io.storage import Storage

#: The save_id of a save that names none.
DEFAULT_SAVE_ID = "0"
#: Generation folders are named ``gen-<escaped save_id>``.
GENERATION_PREFIX = "gen-"
#: Seconds after which a commit lock whose holder did not finish is broken by the next committer.
DEFAULT_LOCK_LEASE = 600.0


def save_id_of(save_id: Any) -> str:
    """The save_id as stored: a non-empty string (ints, e.g. the step, become their decimal form)."""
    if save_id is None:
        return DEFAULT_SAVE_ID
    if isinstance(save_id, bool) or not isinstance(save_id, str | int):
        raise BadNameError(f"save_id must be a string or an int (e.g. the training step), got {save_id!r}")
    text = str(save_id)
    if not text:
        raise BadNameError("save_id must not be empty")
    return text


def generation_of(save_id: Any) -> str:
    """The folder of a save's generation: ``gen-<save_id>``, escaped like tensor names."""
    sid = save_id_of(save_id)
    generation = GENERATION_PREFIX + escape_component(sid, f"save_id {sid!r}")
    check_component(generation, f"save_id {sid[:40]!r}", "generation")
    return generation


# -------------------------------------------------------------------- marker
@dataclass(frozen=True)
class Marker:
    """The commit marker ``url/.reshard/commit.json``: which generation readers use.

    Format version 1 markers (data at the URL's root, no generation) read with
    ``generation=""`` and no metadata digest.
    """

    format_version: int
    generation: str
    save_id: str | None
    time: float
    tensors: int
    ranks: list[int]
    metadata_sha256: str | None = None
    form: str = "directory"
    #: Packed form: the sha256 of the generation's references file.
    references_sha256: str | None = None
    #: Packed form: where readers find shard locations: ``"ranks"`` (each in the manifest of the rank that wrote
    #: it) or ``"references"`` (the references file); the root ``zarr.json`` is then an object of its own.
    #: None: the directory form, or a packed save whose root document lives inside its references only.
    locations: str | None = None
    #: The root ``zarr.json``'s summary prefix: its length and sha256 (see
    #: :func:`reshard.store.format.consolidated.summary_seal`); None in markers written before it existed.
    summary_bytes: int | None = None
    summary_sha256: str | None = None

    @classmethod
    def parse(cls, url: str, raw: bytes) -> Marker:
        """Parse marker bytes; a :class:`FormatError` naming the file for anything malformed."""
        where = f"{url}/{COMMIT_KEY}"
        doc = loads_json(where, raw)
        if not isinstance(doc, dict):
            raise FormatError(f"{where}: the commit marker is not a JSON object")
        version = doc.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise FormatError(f"{where}: bad format_version {version!r}")
        if version > FORMAT_VERSION:
            raise FormatError(f"{url}: format version {version} is newer than this reshard ({FORMAT_VERSION}); "
                              "upgrade reshard")
        marker = cls(format_version=version, **marker_fields(doc, where))
        if version >= 2 and (not marker.generation.startswith(GENERATION_PREFIX) or "/" in marker.generation
                             or not isinstance(marker.metadata_sha256, str)):
            raise FormatError(f"{where}: malformed commit marker (generation {marker.generation!r}, "
                              f"metadata_sha256 {marker.metadata_sha256!r})")
        if marker.form not in FORMS or (marker.form == "packed" and not isinstance(marker.references_sha256, str)):
            raise FormatError(f"{where}: malformed commit marker (form {marker.form!r}, "
                              f"references_sha256 {marker.references_sha256!r})")
        return marker

    def to_json(self) -> bytes:
        """The marker's bytes, with the sha256 of its own canonical JSON (any edit is detected).

        ``references_sha256`` is left out of directory-form markers (it has nothing to name), and the
        optional fields when unset.
        """
        optional = ("references_sha256", "locations", "summary_bytes", "summary_sha256")
        doc = {k: v for k, v in asdict(self).items() if v is not None or k not in optional}
        return with_digest(doc)


def read_marker(root: Storage) -> tuple[Marker, bytes] | None:
    """The marker of the checkpoint at ``root`` and its raw bytes, or None if none is committed."""
    try:
        raw = root.read(COMMIT_KEY)
    except FileNotFoundError:
        return None
    return Marker.parse(root.url, raw), raw


def generation_storage(root: Storage, marker: Marker) -> Storage:
    """Where the committed generation's objects live (the root itself for format version 1)."""
    return root.child(marker.generation) if marker.generation else root


def metadata_digest(raw: bytes) -> str:
    """The digest of a generation's root ``zarr.json`` recorded in its marker."""
    return hashlib.sha256(raw).hexdigest()


# ---------------------------------------------------------------------- lock
def _lock_body(lease: float) -> bytes:
    return json.dumps({"token": uuid.uuid4().hex, "time": time.time(), "host": socket.gethostname(),
                       "pid": os.getpid(), "lease": lease}).encode()


def _lock_is_stale(holder: Any, now: float) -> bool:
    """A lock whose lease ran out, whose holder is a dead process of this host, or that is unreadable."""
    if not isinstance(holder, dict):
        return True
    try:
        if now - float(holder["time"]) > float(holder.get("lease", DEFAULT_LOCK_LEASE)):
            return True
        if holder.get("host") == socket.gethostname():
            os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (KeyError, TypeError, ValueError):
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def take_lock(root: Storage, gen: Storage, save_id: str, *, force: bool = False,
              lease: float = DEFAULT_LOCK_LEASE) -> None:
    """Take the commit lock of one generation (create-if-absent), breaking a dead holder's.

    Raises
    ------
    CommitConflictError
        If the generation is committed already, or a live process holds its lock.
    """
    body = _lock_body(lease)
    try:
        gen.write_new(LOCK_KEY, body)
        return
    except CheckpointExistsError:
        pass
    current = read_marker(root)
    if current is not None and current[0].generation == gen.url.rsplit("/", 1)[-1]:
        raise CommitConflictError(f"{root.url}: save {save_id!r} is committed already")
    try:
        holder = json.loads(gen.read(LOCK_KEY))
    except (FileNotFoundError, ValueError):
        holder = None
    if not (force or _lock_is_stale(holder, time.time())):
        age = time.time() - float(holder["time"])
        raise CommitConflictError(
            f"{root.url}: save {save_id!r} is being committed by {holder.get('host')} pid {holder.get('pid')} "
            f"(lock taken {age:.0f} s ago, lease {holder.get('lease')} s). If that process is dead, "
            f"run `reshard unlock {root.url} --save-id {save_id}` or commit(..., force=True); "
            "a lock older than its lease is broken by the next commit")
    gen.delete(LOCK_KEY)
    try:
        gen.write_new(LOCK_KEY, body)
    except CheckpointExistsError:
        raise CommitConflictError(f"{root.url}: another process took the commit lock of save {save_id!r}") from None


def unlock(url: str | Storage, save_id: Any = None, *, storage_options: dict[str, Any] | None = None) -> bool:
    """Remove the commit lock of a save (``reshard unlock``); True if there was one.

    For a committer that died holding the lock. A lock older than its lease is
    broken by the next commit anyway; this is for not waiting that long.
    """
    root = url if isinstance(url, Storage) else Storage(url, storage_options)
    gen = root.child(generation_of(save_id))
    existed = gen.exists(LOCK_KEY)
    gen.delete(LOCK_KEY)
    return existed


# -------------------------------------------------------------------- commit
@gc_paused()
def commit(url: str | Storage, *, save_id: Any = None, ranks: list[int] | None = None,
           storage_options: dict[str, Any] | None = None, force: bool = False,
           lock_lease: float = DEFAULT_LOCK_LEASE, manifests: dict[int, dict[str, Any]] | None = None,
           form: str | None = None, known: Mapping[str, tuple[dict[str, Any], ArrayMeta]] | None = None) -> Marker:
    """Commit a save once every rank has written.

    Parameters
    ----------
    url : str or Storage
        The checkpoint (its root, not a generation).
    save_id : str or int, optional
        The save to commit, as every rank passed it to ``create`` (default ``"0"``).
    ranks : list of int, optional
        The ranks expected to have written (a writer passes them from its
        layouts). Without them, the set recorded in any manifest found is used:
        the only listing in the protocol; every manifest is then read by key.
    storage_options : dict, optional
        fsspec options when ``url`` is a string.
    force : bool
        Break the commit lock even if its holder looks alive.
    lock_lease : float
        Seconds after which this commit's lock may be broken by another committer.
    form : {"packed", "directory"}, optional
        The storage form the ranks wrote, when known (it says where their
        manifests are; unknown: each is looked for as JSON, then in the data object).
    manifests : dict, optional
        ``{rank: manifest}`` already read by the caller (a committer that
        polled for them): they are not read again.
    known : mapping, optional
        ``{name: (manifest record, array record)}`` the caller wrote itself:
        a manifest record equal to one of these is not parsed again.

    Returns
    -------
    Marker
        The marker written.

    Raises
    ------
    UncommittedCheckpointError
        If a rank's manifest is missing; the message names the ranks and the
        tensors left without data. Nothing is committed; retry after they write.
    CommitConflictError
        If another live process holds the commit lock, or the save is committed already.
    """
    root = url if isinstance(url, Storage) else Storage(url, storage_options)
    sid = save_id_of(save_id)
    generation = generation_of(sid)
    gen = root.child(generation)
    take_lock(root, gen, sid, force=force, lease=lock_lease)
    try:
        if manifests is None:
            manifests = read_manifests(gen, sid, ranks, form)
        metas, leaves = merge_manifests(gen.url, manifests, known=known)
        located = merge_packed(gen.url, manifests, metas)
        if located is not None:
            check_reused(root, generation, located)
        refs_digest = locations = None
        if located is None:
            raw = write_metadata(gen, metas, leaves)
        else:
            docs, raw = metadata_documents(metas, leaves)
            refs = build_references({"zarr.json": raw, **docs}, located)
            gen.write(REFS_KEY, refs)
            gen.write("zarr.json", raw)  # what open reads: O(tensors) bytes, not the O(tensors x ranks) references
            refs_digest = metadata_digest(refs)
            # ranks' own writes (trailers) record their shards in their manifests; block writers' may not
            locations = "ranks" if all("tensors_sha256" in m for m in manifests.values()) else "references"
        marker = Marker(format_version=FORMAT_VERSION, generation=generation, save_id=sid, time=time.time(),
                        tensors=len(metas), ranks=sorted(manifests), metadata_sha256=metadata_digest(raw),
                        form="directory" if located is None else "packed", references_sha256=refs_digest,
                        locations=locations, **summary_seal(raw))
        root.write_atomic(COMMIT_KEY, marker.to_json())
    except BaseException:
        with contextlib.suppress(Exception):
            gen.delete(LOCK_KEY)
        raise
    return marker


def write_metadata(gen: Storage, metas: dict[str, ArrayMeta], leaves: dict[str, Any]) -> bytes:
    """Write every array's and group's ``zarr.json`` and the root one (consolidated); return the root's bytes."""
    docs, raw = metadata_documents(metas, leaves)
    pool.run_all([functools.partial(gen.write, key, doc) for key, doc in docs.items()], gen.local)
    gen.write("zarr.json", raw)
    return raw


def metadata_documents(metas: dict[str, ArrayMeta], leaves: dict[str, Any]) -> tuple[dict[str, bytes], bytes]:
    """Every array's and group's ``<path>/zarr.json`` (bytes by key), and the root ``zarr.json`` (consolidated)."""
    docs = {m.path: json.dumps(m.to_zarr_json()) for m in metas.values()}
    groups = sorted({"/".join(m.path.split("/")[:i]) for m in metas.values() for i in range(1, m.path.count("/") + 1)})
    docs.update({g: json.dumps(group_json()) for g in groups})
    return {f"{path}/zarr.json": text.encode() for path, text in docs.items()}, root_document(metas, docs, leaves)


def check_reused(root: Storage, generation: str, located: dict[str, tuple[str, int, int]]) -> None:
    """Check that the objects an incremental save reuses (outside its own generation) are still there.

    Raises
    ------
    CheckpointNotFoundError
        If one is gone (its save was deleted by retention or ``gc`` meanwhile).
    """
    reused = sorted(obj for obj in objects_of(located) if not obj.startswith(f"{generation}/"))
    found = pool.run_all([functools.partial(root.has, obj) for obj in reused], root.local)  # GETs, no listing
    gone = [obj for obj, there in zip(reused, found, strict=True) if not there]
    if gone:
        raise CheckpointNotFoundError(f"{root.url}: this incremental save references {len(gone)} object(s) of its "
                                      f"base that are gone (e.g. {gone[0]!r}; deleted meanwhile?); save it again "
                                      "without that base")


def read_json(storage: Storage, key: str) -> Any:
    return loads_json(f"{storage.url}/{key}", storage.read(key))
