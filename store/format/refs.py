"""The packed form's references: kerchunk/fsspec reference documents (version 1).

In the packed storage form every rank writes its shard objects (unchanged
``sharding_indexed`` bytes) back to back into one data object per rank, and the
commit writes one references file per save, ``<generation>/refs.json``::

    {"version": 1,
     "templates": {"root": "."},
     "refs": {"zarr.json": "<root group document, the same bytes as the directory form's>",
              "model/w/zarr.json": "<array document>",
              "model/w/c/0/1": ["{{root}}/gen-7/packed/3.bin", 4096, 81920], ...}}

Every zarr key of the save maps to its bytes: documents inline (JSON text),
shards as ``[url, offset, length]``. Urls are relative to the checkpoint root
through the ``root`` template, so copying or moving the checkpoint's folder
keeps it valid: fsspec's ``reference://`` filesystem resolves them with
``template_overrides={"root": url}`` (docs/format.md has the two-line recipe), and
reshard's own reader takes the part after ``{{root}}/`` as a key under the root.
A reference may point into another generation's object (``{{root}}/gen-6/...``)
or, for an incremental save whose base is a checkpoint beside it (a manager's
``step-<N>`` folders), into a sibling folder through the ``parent`` template
(``{{parent}}/step-100/gen-100/packed/3-0.bin``; reshard's keys spell it
``../step-100/...``). Pure functions and records; no I/O here.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from reshard.layouts.errors import FormatError

#: The two storage forms: one object per zarr key, or per-rank data objects + references.
FORMS = ("directory", "packed")
#: Key of a packed save's references, relative to its generation.
REFS_KEY = "refs.json"
#: Folder of a packed save's data objects, relative to its generation.
PACKED_DIR = "packed"
#: The template every reference url starts with: the checkpoint root.
ROOT_TEMPLATE = "root"
_PREFIX = "{{" + ROOT_TEMPLATE + "}}/"
#: The template of references into a folder beside the checkpoint (incremental saves).
PARENT_TEMPLATE = "parent"
_PARENT = "{{" + PARENT_TEMPLATE + "}}/"
#: A rank's data goes on in a new object once the current one holds this many bytes.
DEFAULT_OBJECT_BYTES = 4 << 30

#: A shard's location: (object key relative to the checkpoint root, offset, length).
Location = tuple[str, int, int]


def check_form(form: str) -> str:
    """``form`` if it is one of :data:`FORMS`, else ValueError."""
    if form not in FORMS:
        raise ValueError(f"storage form must be one of {FORMS}, got {form!r}")
    return form


#: The last 8 bytes of a rank's data object that carries its manifest.
TRAILER_MAGIC = b"RSHDMAN2"
#: The same, of trailers written before the tensor records were a document of their own.
TRAILER_MAGIC_V1 = b"RSHDMAN1"
#: Bytes of the trailer after the manifest: the two lengths (uint64, little endian) and the magic.
TRAILER_BYTES = 24
#: The last 8 bytes of a third-form trailer (:mod:`reshard.store.format.table`): records once per layout group.
TRAILER_MAGIC_V3 = b"RSHDMAN3"
#: Bytes after the manifest in a third-form trailer: three lengths and the magic.
TRAILER_BYTES_V3 = 32


def rank_object(rank: int) -> str:
    """Key (relative to the generation) of the data object that carries rank ``rank``'s manifest.

    A writer's data objects are ``packed/<writer>.bin`` (its last, written last: a
    rank's carries its manifest) and ``packed/<writer>-<n>.bin`` (the others, when
    its data exceeds ``object_bytes``); block writers use random tokens as names.
    """
    return f"{PACKED_DIR}/{rank}.bin"


def trailer(manifest: bytes, tensors: bytes) -> bytes:
    """The bytes a rank appends to its last data object: its tensor records and manifest, their lengths, the magic.

    The manifest travels inside the data object, so a rank's save is one object
    (one PUT): the object count stays ranks + a few. The tensor records (dtype,
    grid, layout of every tensor the rank holds: the bulk, and the same bytes on
    every rank that agrees) are a document of their own, named in the manifest
    by their sha256: a committer parses them once per distinct document, and a
    reader that only needs where the shards are never reads them.
    """
    return tensors + manifest + len(tensors).to_bytes(8, "little") + len(manifest).to_bytes(8, "little") + TRAILER_MAGIC


def trailer_lengths(where: str, tail: bytes) -> tuple[int, int, int]:
    """(trailer footer bytes, tensor records length, manifest length) from a data object's last bytes
    (third form: the records and the shard table together as the second).

    A FormatError if it does not end with a trailer.
    """
    if len(tail) >= TRAILER_BYTES_V3 and tail[-8:] == TRAILER_MAGIC_V3:  # records and table before the manifest
        return (TRAILER_BYTES_V3, int.from_bytes(tail[-32:-24], "little") + int.from_bytes(tail[-24:-16], "little"),
                int.from_bytes(tail[-16:-8], "little"))
    if len(tail) >= TRAILER_BYTES and tail[-8:] == TRAILER_MAGIC:
        return TRAILER_BYTES, int.from_bytes(tail[-24:-16], "little"), int.from_bytes(tail[-16:-8], "little")
    if len(tail) >= 16 and tail[-8:] == TRAILER_MAGIC_V1:
        return 16, 0, int.from_bytes(tail[-16:-8], "little")
    raise FormatError(f"{where}: the data object does not end with a manifest (truncated or not reshard's)")


def build(documents: Mapping[str, bytes], shards: Mapping[str, Location]) -> bytes:
    """The references file of a save.

    Parameters
    ----------
    documents : mapping
        ``{zarr key: JSON bytes}``: the root ``zarr.json`` and every array's
        and group's ``<path>/zarr.json``.
    shards : mapping
        ``{shard key: (object key relative to the root, offset, length)}``, written in
        the order given (a commit gives them by tensor, then C order of the grid).
    """
    refs: dict[str, Any] = {k: v.decode() for k, v in documents.items()}
    urls = {obj: _PARENT + obj[3:] if obj.startswith("../") else _PREFIX + obj for obj in objects_of(shards)}
    refs.update((key, [urls[obj], offset, length]) for key, (obj, offset, length) in shards.items())
    return json.dumps({"version": 1, "templates": templates_for(urls), "refs": refs}, separators=(",", ":")).encode()


def stream(documents: Mapping[str, bytes], paths: Sequence[str], grids: Sequence[tuple[int, ...]],
           objects: Sequence[str], obj: np.ndarray, off: np.ndarray, length: np.ndarray,
           batch: int = 1 << 16) -> Iterator[bytes]:
    """The references file of a save, in pieces: the same bytes :func:`build` makes, without holding them.

    ``paths[t]`` and ``grids[t]``: tensor ``t``'s zarr path and shards per dimension;
    shard ``i`` (tensors in order, each in C order of its grid) lies in
    ``objects[obj[i]]`` from ``off[i]`` for ``length[i]`` bytes.
    """
    urls = {o: _PARENT + o[3:] if o.startswith("../") else _PREFIX + o for o in objects}
    head = json.dumps({"version": 1, "templates": templates_for(objects), "refs": {}},
                      separators=(",", ":"))
    yield head[:-2].encode()  # '..."refs":{'
    first = True
    for key, doc in documents.items():
        yield (("" if first else ",") + json.dumps(key) + ":" + json.dumps(doc.decode())).encode()
        first = False
    quoted = [json.dumps(urls[o]) for o in objects]
    suffixes: dict[tuple[int, ...], list[str]] = {}  # tensors share a few grids: their keys' ends made once
    at = 0
    for path, grid in zip(paths, grids, strict=True):
        ends = suffixes.get(grid)
        if ends is None:
            ends = suffixes[grid] = ["/" + "/".join(map(str, i)) for i in itertools.product(*map(range, grid))] \
                if grid else [""]
        prefix = json.dumps(path + "/c")[:-1]  # '"<escaped path>/c'
        n = len(ends)
        for lo in range(0, n, batch):
            hi = min(n, lo + batch)
            us = [quoted[o] for o in obj[at + lo : at + hi].tolist()]
            text = ",".join([f'{prefix}{e}":[{u},{a},{b}]' for e, u, a, b in
                             zip(ends[lo:hi], us, off[at + lo : at + hi].tolist(), length[at + lo : at + hi].tolist(),
                                 strict=True)])
            yield (("" if first else ",") + text).encode()
            first = False
        at += n
    yield b"}}"


def objects_of(shards: Mapping[str, Location]) -> set[str]:
    """The objects ``shards`` lie in (a few per rank, for tens of thousands of shards)."""
    return {loc[0] for loc in shards.values()}


@dataclass(frozen=True)
class References:
    """A parsed references file: the root document and where every shard's bytes are.

    Attributes
    ----------
    root : bytes
        The save's root ``zarr.json`` (consolidated metadata), as stored.
    shards : dict
        ``{shard key: [url, offset, length]}`` as stored (see :meth:`locate`).
    url : str
        The references file, for messages.
    """

    root: bytes
    shards: dict[str, Any]
    url: str
    #: Every key the file maps (documents, shards and anything else), and its ``templates``.
    keys: frozenset[str] = frozenset()
    templates: Any = None
    #: The inline documents (``{zarr key: JSON text}``), the root's included.
    inline: Mapping[str, str] = field(default_factory=dict)

    def locate(self, key: str, tensor: str) -> Location:
        """Where shard ``key`` of ``tensor`` lies: (object key under the root, offset, length).

        Every location was checked when the file was parsed (:func:`parse`).
        """
        try:
            url, offset, length = self.shards[key]
        except KeyError:
            raise FormatError(f"tensor {tensor!r}: shard {key!r} has no reference in {self.url}") from None
        return _object_key(url) or "", offset, length

    def objects(self) -> set[str]:
        """Every data object the references point into (keys under the root; ``../`` for a folder beside it)."""
        return {_object_key(u) or "" for u in {v[0] for v in self.shards.values()}}

    def document(self, root_url: str, parent_url: str | None) -> dict[str, Any]:
        """The references as a version 1 document for fsspec's ``reference://``, every url absolute.

        Built from the checked references only: shard urls resolved here
        against ``root_url`` (``parent_url`` for those beside it), no
        ``templates`` or ``gen`` entries of the stored file, so fsspec requests
        nothing but objects inside the checkpoint (or its siblings' data objects).
        """
        refs: dict[str, Any] = dict(self.inline)
        urls: dict[str, str] = {}
        for key, (url, offset, length) in self.shards.items():
            full = urls.get(url)
            if full is None:
                obj = _object_key(url) or ""
                if obj.startswith("../"):
                    if parent_url is None:
                        raise FormatError(f"{self.url}: reference of {key!r} points beside a checkpoint that has "
                                          f"no parent folder on its host or bucket ({url!r})")
                    full = urls[url] = f"{parent_url}/{obj[3:]}"
                else:
                    full = urls[url] = f"{root_url}/{obj}"
            refs[key] = [full, offset, length]
        return {"version": 1, "refs": refs}


def _object_key(url: Any) -> str | None:
    """The key under the checkpoint root of a reference's url (``../<folder>/...`` beside it); None if invalid."""
    if not isinstance(url, str):
        return None
    for prefix, key_prefix in ((_PREFIX, ""), (_PARENT, "../")):
        if url.startswith(prefix) and is_object_key(key_prefix + url[len(prefix):]):
            return key_prefix + url[len(prefix):]
    return None


def is_object_key(key: str) -> bool:
    """Whether ``key`` names an object inside the checkpoint root, or a data object of a checkpoint beside it.

    Beside it means one leading ``../``, then a folder name that does not
    start with ``.``, then a path inside it ending ``packed/<object>`` (what
    incremental saves reference: ``../step-100/gen-100/packed/3-0.bin``), so a
    hostile checkpoint cannot name ``../.ssh/id_rsa`` or ``../notes/thesis.tex``.
    """
    if key.startswith("../"):
        parts = key[3:].split("/")
        return _inside(key[3:]) and len(parts) >= 3 and not parts[0].startswith(".") and parts[-2] == PACKED_DIR
    return _inside(key)


def _inside(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and ".." not in parts and "." not in parts and "" not in parts and "\\" not in path


#: Most entries one references file may hold (documents and shard references: tensors x shards). A save
#: with more is read through its ranks' manifests (``locations: "ranks"``), never through the file.
MAX_REFERENCES = 1 << 26


def parse(url: str, raw: bytes) -> References:
    """Parse a references file and check every reference in it: a :class:`FormatError` naming ``url`` otherwise.

    The one check of references, made once where they are loaded, before any
    reader (reshard's own, the zarr engine, :meth:`~reshard.store.Checkpoint.zarr_store`)
    requests anything through them: every value is an inline document (a
    string) or ``[url, offset, length]`` with ints ``offset >= 0``, ``length >= 1``
    and a url ``{{root}}/<key inside the checkpoint>`` or ``{{parent}}/<a data
    object of a checkpoint beside it>`` (:func:`is_object_key`): no absolute
    path, no other host or scheme, no ``..``. Nothing else of the file is used
    (its ``templates`` and any ``gen`` entries are ignored: :meth:`References.document`).
    """
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise FormatError(f"{url} is not valid JSON: {e}") from None
    refs = doc.get("refs") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or doc.get("version") != 1 or not isinstance(refs, dict):
        raise FormatError(f"{url}: not a version 1 references document")
    root = refs.get("zarr.json")
    if not isinstance(root, str):
        raise FormatError(f"{url}: references lack the root zarr.json")
    if len(refs) > MAX_REFERENCES:
        raise FormatError(f"{url} holds {len(refs)} references, over the limit of {MAX_REFERENCES}")
    shards: dict[str, Any] = {}
    inline: dict[str, str] = {}
    checked: set[str] = set()  # distinct urls: a few per rank
    for key, v in refs.items():
        if isinstance(v, str):
            inline[key] = v
            continue
        if (type(v) is not list or len(v) != 3 or not isinstance(v[0], str) or type(v[1]) is not int
                or type(v[2]) is not int or v[1] < 0 or v[2] < 1):
            raise FormatError(f"{url}: malformed reference of {key!r}: {v!r:.120} (want [url, offset, length])")
        if v[0] not in checked:
            if _object_key(v[0]) is None:
                raise FormatError(f"{url}: reference of {key!r} points outside the checkpoint ({v[0][:200]!r}): "
                                  "a url must be {{root}}/<key inside it> (or {{parent}}/<a data object of a "
                                  "checkpoint beside it>)")
            checked.add(v[0])
        shards[key] = v
    return References(root.encode(), shards, url, frozenset(refs), doc.get("templates"), inline)


def templates_for(objects: Iterable[str]) -> dict[str, str]:
    """The ``templates`` of a references file locating shards in ``objects`` (``parent`` once one lies beside
    the root; see :func:`objects_of`)."""
    if any(obj.startswith("../") for obj in objects):
        return {ROOT_TEMPLATE: ".", PARENT_TEMPLATE: ".."}
    return {ROOT_TEMPLATE: "."}
