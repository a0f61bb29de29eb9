"""A rank's trailer, third form: tensor records once per layout group, shard locations as a compact table.

A rank's data object ``packed/<rank>.bin`` ends with its **trailer**
(:func:`reshard.store.format.refs.trailer_lengths` finds its parts)::

    records | table | manifest | len(records) | len(table) | len(manifest) | b"RSHDMAN3"

* **records**: the tensor records (dtype, grids, codecs, layout JSON) of the
  *layout groups* this rank carries, each a JSON object ``{name: record}``
  sorted by name, back to back. A layout group is the tensors whose layouts
  span one set of ranks; its records are the same bytes on every rank of the
  set, so only the set's lowest rank, its **carrier**, writes them. Every
  other rank names them by sha256. Empty on the ranks that carry nothing.
* **table**: the tensors this rank holds and where each shard it wrote (or reuses) lies:
  a JSON object with ``objects`` (keys under the checkpoint root), ``tensors`` (every
  tensor the rank holds, once each), ``grids`` (the distinct grids, shards per dimension),
  ``dtypes`` (the distinct dtype names) and columns of numbers, each little-endian,
  base64 in a JSON string: per tensor ``grid`` (int32: its grid in ``grids``), ``dtype``
  (int32: its dtype in ``dtypes``) and ``record`` (int64: the first 8 bytes of the sha256
  of its record, so that a commit can name the tensor two ranks disagree on without
  either rank storing the other's records), and per shard ``tensor`` (int32, index into ``tensors``), ``index``
  (int64, C-order position in the tensor's grid), ``object`` (int32, index into
  ``objects``), ``offset`` and ``length`` (int64); ``hashes``: the shards' 16-byte
  hashes back to back, base64, of the kind ``hash`` (``"xxh3_128v"``). About 60 bytes a
  shard where the keyed form (``{key: [object, offset, length]}`` plus ``{key: hash}``)
  took 170; 4,096 ranks' tables of 10,000 shards parse in seconds, where JSON lists of
  ints took ~18 ms a rank.
* **manifest**: the rank's JSON manifest without tensors: ``groups``
  (``[[records sha256, carrier rank, tensors], ...]``: every group it holds),
  ``carried`` (``[[sha256, length], ...]``: the record documents in its own
  records part, in order), ``table_sha256``, the leaves and the expected
  ranks, and its own ``sha256``.

A committer reads each rank's manifest, each distinct records document once
(from its carrier) and each table as numbers; a reader that needs a few ranks'
locations reads their tables. Pure functions: no I/O here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from reshard.layouts import Layout
from reshard.layouts.errors import FormatError

from .meta import ArrayMeta, tensor_path
from .refs import TRAILER_BYTES_V3, TRAILER_MAGIC_V3, is_object_key

#: The hash kind every table records (:data:`reshard.store.write.incremental.HASH`).
HASH_KIND = "xxh3_128v"
_HASH_DIGITS = 32
_HASH_BYTES = 16
_COLUMNS = ("tensor", "index", "object", "offset", "length")


def group_of(layout: Layout) -> tuple[str, int]:
    """A layout's group (the JSON of its rank set) and the group's carrier (its lowest rank)."""
    ranks = layout.to_json().get("ranks")
    if isinstance(ranks, dict):  # {"range": [start, stop]}: mesh layouts over consecutive ranks
        return f"{ranks['range'][0]}:{ranks['range'][1]}", int(ranks["range"][0])
    if ranks is None:  # flat layouts (ranges of ranks): their rank set
        ranks = sorted(set(layout.ranks))
    return json.dumps(sorted(ranks), separators=(",", ":")), min(ranks)


def layout_groups(texts: Mapping[str, tuple[str, Layout]]) -> dict[str, tuple[int, list[str]]]:
    """``{group: (carrier, sorted names)}`` of tensors given as ``{name: (record text, layout)}``."""
    groups: dict[str, tuple[int, list[str]]] = {}
    by_layout: dict[int, tuple[str, int]] = {}  # layouts are shared by many tensors: their group computed once
    for name, (_, layout) in texts.items():
        found = by_layout.get(id(layout))
        if found is None:
            found = by_layout[id(layout)] = group_of(layout)
        groups.setdefault(found[0], (found[1], []))[1].append(name)
    for _, names in groups.values():
        names.sort()
    return groups


def rank_trailer(rank: int, manifest: dict[str, Any], texts: Mapping[str, tuple[str, Layout]],
                 table: bytes) -> bytes:
    """The trailer of ``rank``: the record documents it carries, ``table``, its manifest, lengths, magic.

    ``manifest``: the rank's manifest without ``tensors`` (format version, rank,
    save id, expected ranks, leaves); ``texts``: ``{name: (record text, layout)}``
    of every tensor it holds (:func:`reshard.store.format.manifests.record_text`).
    """
    from .schema import with_digest

    groups, carried, records = [], [], []
    docs = []
    for carrier, names in layout_groups(texts).values():
        doc = ("{" + ",".join(texts[n][0] for n in names) + "}").encode()
        docs.append((carrier, hashlib.sha256(doc).hexdigest(), len(names), doc))
    for carrier, sha, count, doc in sorted(docs, key=lambda d: d[:2]):  # the order a committer merges them in
        groups.append([sha, carrier, count])
        if carrier == rank:
            carried.append([sha, len(doc)])
            records.append(doc)
    body = with_digest({**manifest, "groups": groups, "carried": carried,
                        "table_sha256": hashlib.sha256(table).hexdigest()})
    part = b"".join(records)
    return b"".join([part, table, body, len(part).to_bytes(8, "little"), len(table).to_bytes(8, "little"),
                     len(body).to_bytes(8, "little"), TRAILER_MAGIC_V3])


def shard_table(held: Mapping[str, tuple[ArrayMeta, str]], shards: Sequence[tuple[ArrayMeta, tuple[int, ...]]],
                located: Mapping[str, Sequence[Any]], hashes: Mapping[str, str]) -> bytes:
    """The table of a rank: the tensors it holds (``{name: (record, record text)}``), then ``shards`` (record,
    grid index) in order with their locations and hashes by key. A shard without a location (none was written
    or reused) is left out."""
    names = {name: t for t, name in enumerate(held)}
    grids: dict[tuple[int, ...], int] = {}
    dtypes: dict[str, int] = {}
    per_tensor: dict[str, list[int]] = {"grid": [], "dtype": [], "record": []}
    for meta, text in held.values():
        per_tensor["grid"].append(grids.setdefault(tuple(meta.grid), len(grids)))
        per_tensor["dtype"].append(dtypes.setdefault(meta.dtype, len(dtypes)))
        per_tensor["record"].append(record_digest(text))
    objects: dict[str, int] = {}
    cols: dict[str, list[int]] = {c: [] for c in _COLUMNS}
    digests: list[bytes] = []
    for meta, idx in shards:
        key = meta.shard_key(idx)
        loc = located.get(key)
        if loc is None:
            continue
        sha = hashes[key]
        kind, _, hexd = sha.partition(":")
        if kind != HASH_KIND or len(hexd) != _HASH_DIGITS:
            raise ValueError(f"shard {key!r}: hash {sha!r} is not {HASH_KIND}")
        cols["tensor"].append(names[meta.name])
        cols["index"].append(_ravel(idx, meta.grid))
        cols["object"].append(objects.setdefault(str(loc[0]), len(objects)))
        cols["offset"].append(int(loc[1]))
        cols["length"].append(int(loc[2]))
        digests.append(bytes.fromhex(hexd))
    doc = {"objects": list(objects), "tensors": list(names), "grids": [list(g) for g in grids],
           "dtypes": list(dtypes), **{c: _pack(v, c) for c, v in {**per_tensor, **cols}.items()}, "hash": HASH_KIND,
           "hashes": base64.b64encode(b"".join(digests)).decode()}
    return json.dumps(doc, separators=(",", ":")).encode()


def record_digest(text: str) -> int:
    """The ``record`` column's number for a tensor's record text: the first 8 bytes of its sha256, signed."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


#: The numbers of a table, each column little-endian of this type, base64 in a JSON string: 4096 ranks' tables
#: of 10,000 shards parse in seconds where JSON lists of ints took a minute.
_TYPES = {"grid": "<i4", "dtype": "<i4", "record": "<i8",
          "tensor": "<i4", "index": "<i8", "object": "<i4", "offset": "<i8", "length": "<i8"}


def _pack(values: Sequence[int], column: str) -> str:
    return base64.b64encode(np.asarray(values, dtype=_TYPES[column]).tobytes()).decode()


def _unpack(where: str, doc: dict[str, Any], column: str) -> np.ndarray:
    text = doc.get(column)
    dtype = np.dtype(_TYPES[column])
    try:
        raw = base64.b64decode(text, validate=True) if isinstance(text, str) else None
    except ValueError:
        raw = None
    if raw is None or len(raw) % dtype.itemsize:
        raise FormatError(f"{where}: malformed shard table (column {column!r})")
    return np.frombuffer(raw, dtype=dtype).astype(np.int64)


def _ravel(idx: tuple[int, ...], grid: tuple[int, ...]) -> int:
    out = 0
    for i, n in zip(idx, grid, strict=True):
        out = out * n + i
    return out


def _unravel(lin: int, grid: Sequence[int]) -> list[int]:
    out = []
    for n in reversed(grid):
        lin, i = divmod(lin, n)
        out.append(i)
    return out[::-1]


class Table:
    """A parsed, checked shard table: numpy columns, the tensors' names and grids, the objects."""

    def __init__(self, where: str, raw: bytes) -> None:
        from .schema import loads_json

        doc = loads_json(where, raw)
        if not isinstance(doc, dict):
            raise FormatError(f"{where}: the shard table is not a JSON object")
        self.where = where
        objects, names, grids = doc.get("objects"), doc.get("tensors"), doc.get("grids")
        if (type(objects) is not list or not all(isinstance(o, str) and is_object_key(o) for o in objects)
                or type(names) is not list or not _strings(names) or type(grids) is not list
                or not all(type(g) is list and all(type(n) is int and n >= 0 for n in g) for g in grids)):
            raise FormatError(f"{where}: malformed shard table (objects, tensors or grids)")
        self.objects: list[str] = objects
        self.names: list[str] = names
        grid = _unpack(where, doc, "grid")
        if grid.size != len(names) or (grid.size and (grid.min() < 0 or grid.max() >= len(grids))):
            raise FormatError(f"{where}: malformed shard table (grid)")
        self.grid_shapes: list[tuple[int, ...]] = [tuple(g) for g in grids]
        self.grid = grid
        dtypes, dtype, record = doc.get("dtypes"), _unpack(where, doc, "dtype"), _unpack(where, doc, "record")
        if (type(dtypes) is not list or not all(isinstance(d, str) for d in dtypes) or dtype.size != len(names)
                or record.size != len(names) or (dtype.size and (dtype.min() < 0 or dtype.max() >= len(dtypes)))):
            raise FormatError(f"{where}: malformed shard table (dtypes or records of the tensors)")
        self._dtypes, self._dtype, self._record = dtypes, dtype, record
        cols = {c: _unpack(where, doc, c) for c in _COLUMNS}
        n = cols["tensor"].size
        if any(v.size != n for v in cols.values()):
            raise FormatError(f"{where}: malformed shard table (columns of different lengths)")
        self.size = n
        sizes = np.asarray([math.prod(g) for g in self.grid_shapes] or [0], dtype=np.int64)[grid] if grid.size \
            else np.zeros(0, np.int64)
        t, i, o = cols["tensor"], cols["index"], cols["object"]
        if n and (t.min() < 0 or t.max() >= len(names) or o.min() < 0 or o.max() >= len(objects)
                  or i.min() < 0 or np.any(i >= sizes[t]) or cols["offset"].min() < 0 or cols["length"].min() < 1):
            raise FormatError(f"{where}: the shard table has an index, object, offset or length out of range")
        text = doc.get("hashes")
        try:
            digests = base64.b64decode(text, validate=True) if isinstance(text, str) else b""
        except ValueError:
            digests = b""
        if doc.get("hash") != HASH_KIND or len(digests) != _HASH_BYTES * n:
            raise FormatError(f"{where}: malformed shard table (hashes)")
        self.digests = digests
        self.tensor, self.index, self.object, self.offset, self.length = (cols[c] for c in _COLUMNS)

    def described(self) -> dict[str, tuple[str, int]]:
        """``{name: (dtype, record digest)}`` of every tensor the rank holds (:func:`record_digest`)."""
        return {n: (self._dtypes[d], r) for n, d, r in zip(self.names, self._dtype.tolist(), self._record.tolist(),
                                                           strict=True)}

    @property
    def grids(self) -> list[tuple[int, ...]]:
        """Each tensor's grid (shards per dimension), in the order of ``names``."""
        return [self.grid_shapes[g] for g in self.grid.tolist()]

    def keys(self) -> list[str]:
        """Each shard's key (its tensor's path, ``c``, its grid index), in table order."""
        paths = [tensor_path(n) for n in self.names]
        grids = self.grids
        return ["/".join([paths[t], "c", *map(str, _unravel(i, grids[t]))])
                for t, i in zip(self.tensor.tolist(), self.index.tolist(), strict=True)]

    def expand(self) -> tuple[dict[str, list[Any]], dict[str, str]]:
        """The keyed form: ``({key: [object, offset, length]}, {key: "xxh3_128v:<hex>"})``."""
        keys = self.keys()
        packed = {k: [self.objects[o], off, n] for k, o, off, n in
                  zip(keys, self.object.tolist(), self.offset.tolist(), self.length.tolist(), strict=True)}
        h = self.digests.hex()
        hashes = {k: f"{HASH_KIND}:{h[j * _HASH_DIGITS:(j + 1) * _HASH_DIGITS]}" for j, k in enumerate(keys)}
        return packed, hashes


def _strings(values: list[Any]) -> bool:
    """Whether every value is a string (checked once per distinct list: every rank of a save lists the same names)."""
    global _SEEN
    if values == _SEEN:
        return True
    if all(isinstance(v, str) for v in values):
        _SEEN = values
        return True
    return False


_SEEN: list[Any] = []


def trailer_parts(where: str, tail: bytes) -> tuple[int, int, int, int]:
    """(footer bytes, records length, table length, manifest length) of a third-form trailer's last bytes."""
    if len(tail) < TRAILER_BYTES_V3 or tail[-8:] != TRAILER_MAGIC_V3:
        raise FormatError(f"{where}: the data object does not end with a manifest (truncated or not reshard's)")
    return (TRAILER_BYTES_V3, int.from_bytes(tail[-32:-24], "little"), int.from_bytes(tail[-24:-16], "little"),
            int.from_bytes(tail[-16:-8], "little"))
