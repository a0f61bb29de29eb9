"""Check a checkpoint end to end: every metadata document, every shard, every chunk.

:func:`verify` (``reshard verify``) reads what ``open`` trusts (the marker and
the consolidated metadata, checked against the marker's digest), then what it
does not read: every array's and group's own ``zarr.json`` (the files plain
zarr-python and TensorStore read), compared with the consolidated metadata;
every rank's manifest, compared with the committed metadata (dtype, shape,
grids, codecs, layout, leaves); and every stored chunk, through the same read
path as ``load`` (shard indexes and chunks crc32c-checked). Each problem is a
:class:`Damage` of one kind, naming the file or tensor.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any, cast

from reshard.layouts.errors import (
    CheckpointNotFoundError,
    ReshardError,
    StorageError,
    UncommittedCheckpointError,
)

from ..commit.locate import ByArrays, read_references
from ..commit.marker import Marker, generation_storage, read_marker, read_root_document
from ..commit.merge import merge_ranks, third_form
from ..commit.protocol import metadata_documents
from ..format.manifests import merge_manifests, merge_packed, read_manifest
from ..format.meta import ArrayMeta, stored_name
from ..format.refs import REFS_KEY, References, objects_of, templates_for
from ..format.refs import stream as references_stream
from ..format.schema import check_root, loads_json
from ..format.schema_array import check_group
from ..io.progress import progress_bar
from ..io.storage import Storage
from ..read.checkpoint import Checkpoint
from ..read.open import _file_not_checkpoint as file_not_checkpoint
from ..read.open import open, parse_metadata
from .damage import KINDS, Damage, VerifyReport
from .verify_data import check_data as _check_data
from .verify_parquet import check_parquet as _check_parquet

__all__ = ["KINDS", "Damage", "VerifyReport", "documents", "verify"]


def verify(url: str, *, storage_options: dict[str, Any] | None = None, data: bool = True,
           progress: bool | Callable[[int], None] | None = None) -> VerifyReport:
    """Check the checkpoint at ``url``; never raises for damage, reports it.

    Parameters
    ----------
    url : str
        The checkpoint.
    storage_options : dict, optional
        fsspec options.
    data : bool
        Read and crc32c-check every chunk (the long part); metadata only if false.
    progress : bool or callable, optional
        A progress bar over the bytes read (``None``: on a terminal or in a notebook,
        :mod:`reshard.store.io.progress`), or a callable called with the bytes of each slab read.

    Raises
    ------
    CheckpointNotFoundError
        Nothing is stored at ``url``, or it is a file.
    """
    t0 = time.perf_counter()
    report = VerifyReport(url=str(url).rstrip("/"))
    root = Storage(url, storage_options)
    try:
        found = read_marker(root)
    except ReshardError as e:
        if isinstance(e, StorageError) and isinstance(e.__cause__, NotADirectoryError):
            raise CheckpointNotFoundError(file_not_checkpoint(str(url))) from None
        report.add("marker", f"{root.url}/.reshard/commit.json", e)
        ckpt = None  # which save is committed is unknown: nothing else can be checked against it
    else:
        if found is None:
            ckpt = _uncommitted(root, storage_options, report)
        else:
            ckpt = _committed(root, found[0], storage_options, report)
            if ckpt is not None and found[0].parquet_sha256 is not None:
                _check_parquet(generation_storage(root, found[0]), found[0], ckpt, report)
    if ckpt is not None:
        report.tensors = len(ckpt.arrays)
        report.without_checksums = sorted(n for n, m in ckpt.arrays.items() if not m.checksums)
        if data and callable(progress):
            _check_data(ckpt, report, progress)
        elif data:
            with progress_bar(ckpt.nbytes, "verify", cast(bool | None, progress), unit="B") as bar:
                _check_data(ckpt, report, None if bar is None else bar.update)
    report.seconds = time.perf_counter() - t0
    return report


def _uncommitted(root: Storage, storage_options: dict[str, Any] | None, report: VerifyReport) -> Checkpoint | None:
    try:
        open(root.url, storage_options=storage_options)
    except UncommittedCheckpointError as e:
        report.add("uncommitted", root.url, e)
    except CheckpointNotFoundError:
        if report.damage:
            return None
        raise
    except ReshardError as e:
        report.add("uncommitted", root.url, e)
    try:
        return open(root.url, storage_options=storage_options, allow_uncommitted=True)
    except ReshardError as e:
        report.add("manifest", root.url, e)
        return None


def _committed(root: Storage, marker: Marker, storage_options: dict[str, Any] | None,
               report: VerifyReport) -> Checkpoint | None:
    report.committed = True
    gen = generation_storage(root, marker)
    if marker.form == "packed" and marker.locations == "ranks" and marker.ranks and third_form(gen, min(marker.ranks)):
        done = _committed_streaming(root, gen, marker, storage_options, report)
        if done is not None:
            return done
    where = f"{gen.url}/zarr.json"
    if marker.locations is not None:  # the packed form's root document, an object of its own: name it
        with contextlib.suppress(FileNotFoundError):
            where = f"{gen.url}/{read_root_document(gen, marker)[0]}"
    read_doc, refs = documents(gen, marker, report)
    try:
        arrays, leaves = parse_metadata(where, read_doc("zarr.json"), marker)
    except FileNotFoundError:
        report.add("metadata", where, "missing: the committed save's metadata is gone")
        return None
    except ReshardError as e:
        report.add("metadata", where, e)
        return None
    for meta in arrays.values():
        try:
            meta.layout  # noqa: B018 - a deferred record parses and validates its document on first use
            meta.validate()
        except ReshardError as e:
            report.add("metadata", where, e)
    if report.damage:
        return None
    docs = check_root(loads_json(where, read_doc("zarr.json")), where)[1]
    differ = _read_differs(arrays, docs)
    if differ is not None:
        report.add("metadata", where, f"tensor {differ!r}: the record reshard reads (the summary's) and its "
                                      "consolidated document (what zarr reads) differ")
    _check_node_files(gen, read_doc, docs, report)
    _check_manifests(gen, marker, arrays, leaves, report, refs)
    try:
        return open(root.url, storage_options=storage_options)
    except ReshardError as e:  # replaced meanwhile
        report.add("replaced", root.url, e)
        return None


def _committed_streaming(root: Storage, gen: Storage, marker: Marker, storage_options: dict[str, Any] | None,
                         report: VerifyReport) -> Checkpoint | None:
    """A save whose ranks wrote third-form trailers, checked in memory that grows with tensors and ranks, not
    their product: the ranks' trailers merged as the commit merges them, the references rebuilt from that merge
    as a stream and compared by digest, every shard read through the merge. None: something differs, and the
    general checks (which hold every location, and say which shard differs) take over."""
    try:
        where, raw = read_root_document(gen, marker)
        where = f"{gen.url}/{where}"
        arrays, leaves = parse_metadata(where, raw, marker)
        for meta in arrays.values():
            meta.layout  # noqa: B018 - a deferred record parses and validates its document on first use
            meta.validate()
        merged = merge_ranks(gen, marker.save_id, list(marker.ranks), fresh=True)
    except (ReshardError, FileNotFoundError):
        return None  # reported by the general checks
    if merged is None or list(merged.metas) != list(arrays) or json.dumps(merged.leaves, sort_keys=True) != \
            json.dumps(leaves, sort_keys=True):
        return None
    if any(getattr(arrays[n], f) != getattr(m, f) for n, m in merged.metas.items()
           for f in ("shape", "dtype", "shard", "chunk", "layout", "checksums", "compressor")):
        return None
    try:
        if _read_differs(arrays, check_root(loads_json(where, raw), where)[1]) is not None:
            return None
    except ReshardError:
        return None
    docs, _ = metadata_documents(merged.metas, merged.leaves)
    metas = list(merged.metas.values())
    rebuilt = hashlib.sha256()
    for piece in references_stream({"zarr.json": raw, **docs}, [m.path for m in metas], [m.grid for m in metas],
                                   merged.objects, merged.obj, merged.off, merged.length):
        rebuilt.update(piece)
    try:
        stored = gen.digest(REFS_KEY)
    except FileNotFoundError:
        return None
    if rebuilt.hexdigest() != marker.references_sha256 or stored != marker.references_sha256:
        return None
    report.files_checked += len(docs) + len(marker.ranks) + 1
    try:
        ckpt = open(root.url, storage_options=storage_options)
    except ReshardError as e:  # replaced meanwhile
        report.add("replaced", root.url, e)
        return None
    ckpt.fetcher.locator = ByArrays(gen, merged)  # every shard where the merge says, no dict of every shard
    return ckpt


def _read_differs(arrays: dict[str, ArrayMeta], docs: dict[str, Any]) -> str | None:
    """The first tensor whose record (what reshard reads: the summary's records where the root document has
    them) is not its consolidated document (what zarr reads); None if every one matches."""
    for name, meta in arrays.items():
        if meta.to_zarr_json() != docs.get(meta.path):
            return name
    return None


def documents(gen: Storage, marker: Marker, report: VerifyReport
              ) -> tuple[Callable[[str], bytes], References | None]:
    """Read a save's zarr documents by key: objects in the directory form, the references' inline copies in the
    packed form (FileNotFoundError for a key that has none); and the packed form's references (None if damaged,
    which is reported)."""
    if marker.form != "packed":
        return gen.read, None
    where = f"{gen.url}/{REFS_KEY}"
    try:
        refs = read_references(gen, marker)  # the references match their digest in the marker
        inline = loads_json(where, gen.read(REFS_KEY))["refs"]
    except (ReshardError, FileNotFoundError) as e:
        report.add("references", where, e)
        refs, inline = None, {}
    if marker.locations is not None and refs is not None:  # the root document is an object of its own too
        with contextlib.suppress(FileNotFoundError):
            own, raw = read_root_document(gen, marker)
            if raw != refs.root:
                report.add("references", where, f"its root zarr.json differs from the save's {own}")

    def read(key: str) -> bytes:
        if key == "zarr.json" and marker.locations is not None:
            return read_root_document(gen, marker)[1]
        doc = inline.get(key)
        if not isinstance(doc, str):
            raise FileNotFoundError(f"{where}: no document {key!r}")
        return doc.encode()

    return read, refs


def _check_node_files(gen: Storage, read_doc: Callable[[str], bytes], docs: dict[str, Any],
                      report: VerifyReport) -> None:
    """Every array's and group's own zarr.json against its consolidated copy."""
    for path, want in sorted(docs.items()):
        kind = "array-json" if want["node_type"] == "array" else "group-json"
        where = f"{gen.url}/{path}/zarr.json"
        try:
            doc = loads_json(where, read_doc(f"{path}/zarr.json"))
            if kind == "group-json":
                check_group(doc, where)
            else:
                ArrayMeta.from_zarr_json(stored_name(path, where), doc, where)
        except FileNotFoundError:
            report.add(kind, where, "missing")
            continue
        except ReshardError as e:
            report.add(kind, where, e)
            continue
        report.files_checked += 1
        if doc != want:
            fields = sorted(k for k in set(doc) | set(want) if doc.get(k) != want.get(k))
            report.add(kind, where, f"differs from the consolidated metadata in {fields}")


def _check_manifests(gen: Storage, marker: Marker, arrays: dict[str, ArrayMeta], leaves: dict[str, Any],
                     report: VerifyReport, refs: References | None) -> None:
    """Every committed rank's manifest, merged, against the committed metadata (and the packed form's references)."""
    manifests = {}
    for rank in marker.ranks:
        where = f"{gen.url}/.reshard/ranks/{rank}.json"
        try:
            manifests[rank] = read_manifest(gen, rank, fresh=True)
            report.files_checked += 1
        except FileNotFoundError:
            report.add("manifest", where, "missing")
        except ReshardError as e:
            report.add("manifest", where, e)
    if len(manifests) != len(marker.ranks) or not manifests:
        return
    try:
        metas, merged_leaves = merge_manifests(gen.url, manifests)
    except ReshardError as e:
        report.add("manifest", f"{gen.url}/.reshard/ranks", e)
        return
    for name in sorted(set(metas) ^ set(arrays)):
        side = "the manifests" if name in metas else "the committed metadata"
        report.add("metadata", f"tensor {name!r}", f"only {side} hold it ({gen.url})")
    for name in sorted(set(metas) & set(arrays)):
        a, m = arrays[name], metas[name]
        fields = [f for f in ("shape", "dtype", "shard", "chunk", "layout", "checksums", "compressor")
                  if getattr(a, f) != getattr(m, f)]
        if fields:
            report.add("metadata", f"tensor {name!r}",
                       f"the committed metadata differs from the ranks' manifests in {fields} ({gen.url})")
    if json.dumps(merged_leaves, sort_keys=True) != json.dumps(leaves, sort_keys=True):
        report.add("metadata", f"{gen.url}/zarr.json", "its leaves differ from the ranks' manifests")
    if refs is not None:
        _check_references(gen, manifests, metas, refs, report)


def _check_references(gen: Storage, manifests: dict[int, dict[str, Any]], metas: dict[str, ArrayMeta],
                      refs: References, report: VerifyReport) -> None:
    """The references point every shard where the ranks' manifests say it is (what reshard reads)."""
    try:
        located = merge_packed(gen.url, manifests, metas) or {}
    except ReshardError as e:
        report.add("manifest", f"{gen.url}/.reshard/ranks", e)
        return
    where = f"{gen.url}/{REFS_KEY}"
    wrong = []
    for meta in metas.values():
        for key in meta.shard_keys():
            got = refs.locate(key, meta.name) if key in refs.shards else None
            if got is None or tuple(got) != tuple(located[key]):
                wrong.append((meta.name, key, got))
    extra = sorted(set(refs.shards) - set(located))
    if wrong:
        name, key, got = wrong[0]
        obj, offset, length = located[key]
        said = "no reference" if got is None else f"a reference to {got[0]} bytes {got[1]}+{got[2]}"
        report.add("references", where, f"tensor {name!r}, shard {key!r}: {said} where the ranks' manifests say "
                                         f"{obj} bytes {offset}+{length} ({len(wrong)} shard reference(s) differ): "
                                         "plain zarr reading refs.json would read other bytes than reshard")
    if extra:
        report.add("references", where, f"{len(extra)} reference(s) name shards no rank wrote (e.g. {extra[:3]})")
    odd = sorted(k for k in refs.keys - set(located) if k != "zarr.json" and not k.endswith("/zarr.json"))
    if odd:
        report.add("references", where, f"keys that are neither zarr documents nor shards: {odd[:3]}")
    templates = templates_for(objects_of(located))
    if refs.templates != templates:
        report.add("references", where, f"templates {refs.templates!r:.80} where {templates} is "
                                         "right: fsspec's reference:// resolves the shard urls with them")
