"""The commit: a save's manifests checked, its metadata written, then its marker.

The marker and generations are in :mod:`.marker`, the lock, leases and gc's marks
in :mod:`.locks`, manifests in :mod:`reshard.store.format.manifests`.

A save is a **generation**: every object it writes lives under ``url/<generation>/``
(``gen-<save_id>``), and nothing of a generation is rewritten once it is committed.
Every rank writes its shards, then its manifest ``<generation>/.reshard/ranks/<rank>.json``.
Any one process then calls :func:`commit`: it takes the generation's lock with a
create-if-absent write, reads every expected rank's manifest by key and checks that they
agree (:mod:`reshard.store.format.manifests`), writes every array's and group's ``zarr.json`` and the generation's root
``zarr.json`` (consolidated metadata; the packed form puts them in its references, and its
root document's own copy in ``.reshard/metadata.json``) and, last, the marker ``url/.reshard/commit.json``,
which names the generation readers use and the sha256 of its metadata. A new save of
the same URL is a new generation: until it commits, readers see the old one whole.
docs/format.md has the whole protocol and what a crash at each step leaves.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from reshard.layouts.errors import (
    CheckpointNotFoundError,
    UncommittedCheckpointError,
)

from ..format import parquet as references_parquet
from ..format.consolidated import PACKED_ROOT_KEY, ROOT_KEY, root_document, summary_seal
from ..format.manifests import merge_manifests, merge_packed, read_manifests
from ..format.meta import (
    COMMIT_KEY,
    FORMAT_VERSION,
    HEAD_KEY,
    LOCK_KEY,
    ArrayMeta,
    group_json,
)
from ..format.refs import REFS_KEY, objects_of
from ..format.refs import build as build_references
from ..format.refs import stream as references_stream
from ..io import pool
from ..io.gcpause import gc_paused
from ..io.storage import Storage
from .fence import check_one_job
from .locks import (
    DEFAULT_LOCK_LEASE,
    check_not_collected,
    take_lock,
)
from .marker import (
    Marker,
    generation_of,
    metadata_digest,
    save_id_of,
)
from .merge import Merged, expected_ranks, merge_ranks, third_form


# -------------------------------------------------------------------- commit
@gc_paused()
def commit(url: str | Storage, *, save_id: Any = None, ranks: list[int] | None = None,
           storage_options: dict[str, Any] | None = None, force: bool = False,
           lock_lease: float = DEFAULT_LOCK_LEASE, manifests: dict[int, dict[str, Any]] | None = None,
           form: str | None = None, known: Mapping[str, tuple[dict[str, Any], ArrayMeta]] | None = None,
           parquet: bool | None = None, before_marker: Callable[[], None] | None = None) -> Marker:
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
    parquet : bool, optional
        Write parquet references beside ``refs.json`` (:mod:`reshard.store.format.parquet`; saves by
        ranks, packed). None (default): when pyarrow is installed and the save has at least
        :data:`~reshard.store.format.parquet.MIN_SHARDS` shards (where ``refs.json`` passes ~10 MB).
    before_marker : callable, optional
        Called holding the lock just before the marker is written; what it raises stops the commit (a
        manager's committer checks there that its job still owns the root: :mod:`.fence`).

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
    if parquet and not references_parquet.available():
        raise ValueError("parquet=True needs pyarrow and pandas: pip install 'reshard[parquet]'")
    root = url if isinstance(url, Storage) else Storage(url, storage_options)
    sid = save_id_of(save_id)
    generation = generation_of(sid)
    gen = root.child(generation)
    lock = take_lock(root, gen, sid, force=force, lease=lock_lease)
    # holding the lock (gc marks first, then looks for a lock): whether gc collected the save is asked before the
    # marker; on an object store beside the commit's own reads and writes (a round trip fewer)
    collected = None if root.local else pool.pool(False).submit(check_not_collected, root, generation)
    try:
        merged = None
        if manifests is None and form in ("packed", None):
            expected = ranks if ranks else expected_ranks(gen)
            # a packed save of ranks: its trailers are read at once (merge_ranks takes the general path when one
            # is of an earlier form or missing); a form not told: the lowest rank's trailer says first
            if expected and (form == "packed" or third_form(gen, min(expected))):
                try:
                    merged = merge_ranks(gen, sid, expected, known)  # rank trailers of the third form: streamed
                except FileNotFoundError as e:  # a data object went away while it was merged
                    check_not_collected(root, generation)  # say why it is gone, if gc removed it
                    raise UncommittedCheckpointError(f"{gen.url}: {e.filename or e} went away during the commit "
                                                     "(deleted?): the save cannot commit") from None
        if merged is not None:
            marker = _commit_merged(root, gen, generation, sid, merged, parquet)
        else:
            marker = _commit_manifests(root, gen, generation, sid, ranks, form, manifests, known)
        if collected is None:
            check_not_collected(root, generation)
        else:
            collected.result()
        if before_marker is not None:
            before_marker()
        root.write_atomic(COMMIT_KEY, marker.to_json())
    except BaseException:
        if collected is not None:
            with contextlib.suppress(BaseException):
                collected.result()  # not left running past the commit
        with contextlib.suppress(Exception):
            gen.delete(LOCK_KEY, recursive=False)
        raise
    with contextlib.suppress(Exception):  # a live lock means a commit in progress to gc: this one is done
        gen.write(LOCK_KEY, json.dumps({**json.loads(lock), "done": True}).encode())
    return marker


def _commit_merged(root: Storage, gen: Storage, generation: str, sid: str, merged: Merged,
                   parquet: bool | None) -> Marker:
    """Write the metadata and references of a merged third-form save (and the root's copy); the marker to write."""
    check_reused(root, generation, merged.objects)
    docs, raw = metadata_documents(merged.metas, merged.leaves)
    metas = list(merged.metas.values())
    chunks = references_stream({"zarr.json": raw, **docs}, [m.path for m in metas], [m.grid for m in metas],
                               merged.objects, merged.obj, merged.off, merged.length)
    # the references, what open reads (O(tensors) bytes, not the O(tensors x ranks) refs) and its copy side by side
    refs_digest, *_ = side_by_side(gen, [lambda: gen.write_stream(REFS_KEY, chunks),
                                         lambda: gen.write(PACKED_ROOT_KEY, raw), head_copy(root, raw)])
    if parquet is None:
        parquet = merged.shards() >= references_parquet.MIN_SHARDS and references_parquet.available()
    parquet_digest = None
    if parquet and not any(o.startswith("../") for o in merged.objects):
        parquet_digest = write_parquet(gen, raw, metas, merged)
    return Marker(format_version=FORMAT_VERSION, generation=generation, save_id=sid, time=time.time(),
                  tensors=len(merged.metas), ranks=merged.ranks,
                  metadata_sha256=metadata_digest(raw),
                  form="packed", references_sha256=refs_digest, locations="ranks", **summary_seal(raw),
                  parquet_sha256=parquet_digest)


def side_by_side(gen: Storage, jobs: list[Callable[[], Any]]) -> list[Any]:
    """A few writes of the commit: on an object store side by side (one round trip), locally one by one."""
    return [job() for job in jobs] if gen.local else pool.run_all(jobs, False)


def head_copy(root: Storage, raw: bytes) -> Callable[[], None]:
    """The write of the root's copy of the metadata (:data:`HEAD_KEY`), which readers take with the marker when
    its digest is the marker's (so a copy of a commit that fails is never used): written holding the lock, beside
    the generation's own metadata."""
    return functools.partial(root.write, HEAD_KEY, raw)


def write_parquet(gen: Storage, raw: bytes, metas: list[ArrayMeta], merged: Merged) -> str:
    """The save's parquet references (:mod:`reshard.store.format.parquet`): a file per tensor, ``.zmetadata`` last;
    their digest, for the marker (``verify`` checks it)."""
    paths, grids = [m.path for m in metas], [m.grid for m in metas]

    def one(key: str, blob: bytes) -> str:
        gen.write(f"{references_parquet.PARQUET_KEY}/{key}", blob)
        return hashlib.sha256(blob).hexdigest()

    def encoded(key: str, args: tuple[Any, ...]) -> str:
        return one(key, references_parquet.encode(*args))

    jobs = references_parquet.files(paths, grids, merged.objects, merged.obj, merged.off, merged.length)
    shas = pool.run_all([functools.partial(encoded, key, args) for key, args in jobs], gen.local)
    shas.append(one(".zmetadata", references_parquet.metadata(raw, paths, grids)))
    return references_parquet.digest(shas)


def _commit_manifests(root: Storage, gen: Storage, generation: str, sid: str, ranks: list[int] | None,
                      form: str | None, manifests: dict[int, dict[str, Any]] | None,
                      known: Mapping[str, tuple[dict[str, Any], ArrayMeta]] | None) -> Marker:
    """Write the metadata (and references, and the root's copy) of a save from its ranks' whole manifests; the
    marker to write."""
    if manifests is None:
        try:
            manifests = read_manifests(gen, sid, ranks, form)
        except UncommittedCheckpointError:
            check_not_collected(root, generation)  # say why they are gone, if gc removed them
            raise
    check_one_job(gen.url, manifests, root)
    metas, leaves = merge_manifests(gen.url, manifests, known=known)
    located = merge_packed(gen.url, manifests, metas)
    if located is not None:
        check_reused(root, generation, objects_of(located))
    refs_digest = locations = None
    if located is None:
        raw = write_metadata(gen, metas, leaves, root)
    else:
        docs, raw = metadata_documents(metas, leaves)
        refs = build_references({"zarr.json": raw, **docs}, located)
        # what open reads (O(tensors) bytes, not the O(tensors x ranks) refs) and its copy beside the references
        side_by_side(gen, [functools.partial(gen.write, REFS_KEY, refs),
                           functools.partial(gen.write, PACKED_ROOT_KEY, raw), head_copy(root, raw)])
        refs_digest = metadata_digest(refs)
        # ranks' own writes (trailers) record their shards in their manifests; block writers' may not
        locations = "ranks" if all("tensors_sha256" in m or "groups" in m for m in manifests.values()) else "references"
    return Marker(format_version=FORMAT_VERSION, generation=generation, save_id=sid, time=time.time(),
                  tensors=len(metas), ranks=sorted(manifests), metadata_sha256=metadata_digest(raw),
                  form="directory" if located is None else "packed", references_sha256=refs_digest,
                  locations=locations, **summary_seal(raw))


def write_metadata(gen: Storage, metas: dict[str, ArrayMeta], leaves: dict[str, Any], root: Storage) -> bytes:
    """Write every array's and group's ``zarr.json``, then the root one (consolidated) and its copy at ``root``
    (:func:`head_copy`); return the root's bytes."""
    docs, raw = metadata_documents(metas, leaves)
    pool.run_all([functools.partial(gen.write, key, doc) for key, doc in docs.items()], gen.local)
    side_by_side(gen, [functools.partial(gen.write, ROOT_KEY, raw), head_copy(root, raw)])
    return raw


def metadata_documents(metas: dict[str, ArrayMeta], leaves: dict[str, Any]) -> tuple[dict[str, bytes], bytes]:
    """Every array's and group's ``<path>/zarr.json`` (bytes by key), and the root ``zarr.json`` (consolidated)."""
    docs = {m.path: json.dumps(m.to_zarr_json()) for m in metas.values()}
    groups = sorted({"/".join(m.path.split("/")[:i]) for m in metas.values() for i in range(1, m.path.count("/") + 1)})
    docs.update({g: json.dumps(group_json()) for g in groups})
    return {f"{path}/zarr.json": text.encode() for path, text in docs.items()}, root_document(metas, docs, leaves)


def check_reused(root: Storage, generation: str, objects: Iterable[str]) -> None:
    """Check that the objects an incremental save reuses (outside its own generation) are still there.

    Raises
    ------
    CheckpointNotFoundError
        If one is gone (its save was deleted by retention or ``gc`` meanwhile).
    """
    reused = sorted(obj for obj in set(objects) if not obj.startswith(f"{generation}/"))
    found = pool.run_all([functools.partial(root.has, obj) for obj in reused], root.local)  # GETs, no listing
    gone = [obj for obj, there in zip(reused, found, strict=True) if not there]
    if gone:
        raise CheckpointNotFoundError(f"{root.url}: this incremental save references {len(gone)} object(s) of its "
                                      f"base that are gone (e.g. {gone[0]!r}; deleted meanwhile?); save it again "
                                      "without that base")


