"""Where a packed save's shard bytes are: the owning ranks' manifests, or the references file.

A packed save records every shard's location twice: in the manifest that the
rank which wrote it appended to its data object (``packed/<rank>.bin``), and in
the save's kerchunk references (``refs.json``, what plain zarr-python reads).
The references hold every shard of every tensor: tensors x ranks entries, tens
of MB for thousands of tensors over a thousand ranks. A reader that loads one
rank's part touches the shards of a few source ranks only, so reshard's reader
locates shards through the manifests of those ranks (:class:`ByRanks`: one
ranged read of each, in parallel, on first use): the bytes read grow with what
is loaded, not with the checkpoint. The owner of a shard follows from the
tensor's layout and grid (:meth:`reshard.store.format.meta.ArrayMeta.writer`), no listing needed.

Saves whose shards were written by single-process block writers (importers,
``convert``, ``redivide``) record them elsewhere than the owner's manifest;
their commit marker says ``locations: "references"`` and they are located
through the references file, read on first use (:class:`ByReferences`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from reshard.layouts.errors import FormatError

from ..format import refs as references
from ..format.manifests import read_manifest
from ..format.meta import ArrayMeta
from ..format.refs import REFS_KEY, Location
from ..format.schema import MAX_REFERENCES_BYTES
from ..format.trailers import TAIL_GUESS
from ..io import pool
from ..io.packed import Spans
from ..io.stats import IOStats
from ..io.storage import Storage
from .marker import Marker, metadata_digest

#: One shard to locate: its tensor's record, grid index and key.
Shard = tuple[ArrayMeta, tuple[int, ...], str]


class Locator(Protocol):
    """Where shards lie: ``(object key under the checkpoint root, offset, length)`` each."""

    @property
    def kind(self) -> str:
        """How the locations are found: ``"ranks"`` or ``"references"`` (a worker process rebuilds it from this)."""

    @property
    def references_url(self) -> str:
        """The save's references file (what zarr-python reads), for messages and the general engines."""

    @property
    def spans(self) -> Spans | None:
        """Bytes of data objects the locator read anyway (None: none); reads take shards from there first."""

    def locate_all(self, shards: Sequence[Shard]) -> tuple[list[Location], IOStats]:
        """The location of each shard, in order (FormatError for a shard with none), and the requests made."""
        ...

    def references(self, stats: IOStats | None = None) -> references.References:
        """The save's references, read and checked on first use (what the general engines read through)."""
        ...


def read_references(gen: Storage, marker: Marker | None) -> references.References:
    """A packed save's references, checked against the digest its marker recorded (``marker=None``: not checked)."""
    where = f"{gen.url}/{REFS_KEY}"
    try:
        raw = gen.read(REFS_KEY, limit=MAX_REFERENCES_BYTES)
    except FileNotFoundError:
        raise FormatError(f"{where} is missing: the committed save's references are gone") from None
    if marker is not None and metadata_digest(raw) != marker.references_sha256:
        raise FormatError(f"{where} does not match the digest in its commit marker: the references were edited or "
                          "corrupted after the commit")
    return references.parse(where, raw)


class ByReferences:
    """Locations from the references file, read on first use (or given, e.g. built from manifests)."""

    kind: str = "references"
    spans: Spans | None = None

    def __init__(self, gen: Storage, marker: Marker | None, refs: references.References | None = None) -> None:
        self.gen, self.marker, self._refs = gen, marker, refs
        self.references_url = f"{gen.url}/{REFS_KEY}"
        self._lock = threading.Lock()

    def references(self, stats: IOStats | None = None) -> references.References:
        """The references (read on the first call; its requests counted in ``stats`` too)."""
        with self._lock:
            if self._refs is None:
                self._refs = read_references(self.gen if stats is None else self.gen.counting(stats), self.marker)
            return self._refs

    def locate_all(self, shards: Sequence[Shard]) -> tuple[list[Location], IOStats]:
        stats = IOStats()
        refs = self.references(stats)
        return [refs.locate(key, meta.name) for meta, _, key in shards], stats


class ByRanks:
    """Locations from the manifests of the ranks that wrote the shards, each read once, on first use.

    Parameters
    ----------
    gen : Storage
        The save's generation.
    save_id : str or None
        The save's id: a manifest of another save is refused (None: not checked).
    """

    kind: str = "ranks"

    def __init__(self, gen: Storage, save_id: str | None, generation: str) -> None:
        self.gen, self.save_id, self.generation = gen, save_id, generation
        self.references_url = f"{gen.url}/{REFS_KEY}"
        self._located: dict[int, dict[str, Location]] = {}
        self._lock = threading.Lock()
        #: Data objects small enough that reading their manifest read them whole (keys under the root):
        #: their shards need no other request.
        self.spans = Spans()
        self._by_references = ByReferences(gen, None)

    def references(self, stats: IOStats | None = None) -> references.References:
        return self._by_references.references(stats)

    def locate_all(self, shards: Sequence[Shard]) -> tuple[list[Location], IOStats]:
        owners = [meta.writer(idx) for meta, idx, _ in shards]
        with self._lock:
            missing = sorted(set(owners) - set(self._located))
        stats = IOStats()
        gen = self.gen.counting(stats)
        pool.run_all([functools.partial(self._load, gen, r) for r in missing], gen.local)
        out = []
        for (meta, _, key), rank in zip(shards, owners, strict=True):
            found = self._located[rank].get(key)
            if found is None:
                raise FormatError(f"tensor {meta.name!r}: shard {key!r} has no location in the manifest of rank "
                                  f"{rank}, which wrote it ({self.gen.url}/{references.rank_object(rank)})")
            out.append(found)
        return out, stats

    def _load(self, gen: Storage, rank: int) -> None:
        key = references.rank_object(rank)
        where = f"{gen.url}/{key}"
        try:
            tail = gen.read_tail(key, TAIL_GUESS)
        except FileNotFoundError:
            raise FormatError(f"{where} is missing: a data object of the committed save is gone") from None
        manifest = read_manifest(gen, rank, "packed", tensors=False, tail=tail)
        if self.save_id is not None and manifest.get("save_id") != self.save_id:
            raise FormatError(f"{where}: its manifest is of save {manifest.get('save_id')!r}, not of the committed "
                              f"save {self.save_id!r}")
        located = {key: _location(where, key, rec) for key, rec in _records(where, manifest).items()}
        # keep the bytes read: the object whole when small, else its end (shards written last, no second read).
        # The object is its shards back to back, then the trailer: its size follows from the records.
        obj = f"{self.generation}/{key}" if self.generation else key
        footer, n_records, n_manifest = references.trailer_lengths(where, tail)
        size = max((off + n for o, off, n in located.values() if o == obj), default=0) + footer + n_records + n_manifest
        if size >= len(tail) and (len(tail) < TAIL_GUESS) == (size == len(tail)):
            self.spans.add(obj, size - len(tail), memoryview(tail))
        with self._lock:
            self._located[rank] = located


def _records(where: str, manifest: dict[str, Any]) -> dict[str, Any]:
    packed = manifest.get("packed")
    if not isinstance(packed, dict):
        raise FormatError(f"{where}: the manifest has no shard locations ('packed')")
    return packed


def _location(where: str, key: str, rec: Any) -> Location:
    """A manifest's record of one shard, checked: an object key inside the checkpoint (or a sibling), ints."""
    if (type(rec) is not list or len(rec) != 3 or not isinstance(rec[0], str) or type(rec[1]) is not int
            or type(rec[2]) is not int or rec[1] < 0 or rec[2] <= 0 or not references.is_object_key(rec[0])):
        raise FormatError(f"{where}: malformed location of shard {key!r}: {rec!r:.120}")
    return rec[0], rec[1], rec[2]


def locator_for(gen: Storage, kind: str, save_id: str | None, generation: str) -> Locator:
    """A locator of the given kind (what a worker process rebuilds from a task's source)."""
    return ByRanks(gen, save_id, generation) if kind == "ranks" else ByReferences(gen, None)


class ByArrays:
    """Locations from a merge of every rank's shard table (:class:`reshard.store.commit.merge.Merged`): what
    ``verify`` reads every shard through, 20 bytes a shard, without a dict entry per shard."""

    kind: str = "arrays"
    spans: Spans | None = None

    def __init__(self, gen: Storage, merged: Any) -> None:
        self.gen, self.merged = gen, merged
        self.references_url = f"{gen.url}/{REFS_KEY}"
        self._at = {name: (start, meta.grid) for (name, meta), start in zip(merged.metas.items(), merged.starts,
                                                                              strict=True)}
        self._by_references = ByReferences(gen, None)

    def references(self, stats: IOStats | None = None) -> references.References:
        return self._by_references.references(stats)

    def locate_all(self, shards: Sequence[Shard]) -> tuple[list[Location], IOStats]:
        m = self.merged
        out = []
        for meta, idx, key in shards:
            at = self._at.get(meta.name)
            if at is None or tuple(at[1]) != tuple(meta.grid):
                raise FormatError(f"tensor {meta.name!r}: shard {key!r} has no location in the ranks' manifests "
                                  f"({self.gen.url})")
            pos = at[0] + _ravel(idx, at[1])
            out.append((m.objects[int(m.obj[pos])], int(m.off[pos]), int(m.length[pos])))
        return out, IOStats()


def _ravel(idx: tuple[int, ...], grid: tuple[int, ...]) -> int:
    out = 0
    for i, n in zip(idx, grid, strict=True):
        out = out * n + i
    return out
