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
* **table**: where each shard this rank wrote (or reuses) lies, as columns of a
  JSON object: ``tensors`` (names, once each) and their ``grids`` (shards per
  dimension), then per shard ``tensor`` (index into ``tensors``), ``index``
  (C-order position in the tensor's grid), ``object`` (index into
  ``objects``, keys under the checkpoint root), ``offset``, ``length``, and
  ``hashes``: the shards' 128-bit hashes as one hex string (32 digits each),
  all of the kind ``hash`` (``"xxh3_128v"``). About 60 bytes a shard where
  the keyed form (``{key: [object, offset, length]}`` plus ``{key: hash}``)
  took 170.
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
_COLUMNS = ("tensor", "index", "object", "offset", "length")


def group_of(layout: Layout) -> tuple[str, int]:
    """A layout's group (the JSON of its rank set) and the group's carrier (its lowest rank)."""
    ranks = layout.to_json()["ranks"]
    if isinstance(ranks, dict):  # {"range": [start, stop]}
        return f"{ranks['range'][0]}:{ranks['range'][1]}", int(ranks["range"][0])
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


def shard_table(shards: Sequence[tuple[ArrayMeta, tuple[int, ...]]], located: Mapping[str, Sequence[Any]],
                hashes: Mapping[str, str]) -> bytes:
    """The table of a rank's shards: ``shards`` (record, grid index) in order, their locations and hashes by key.

    A shard without a location (none was written or reused) is left out.
    """
    names: dict[str, int] = {}
    grids: list[list[int]] = []
    objects: dict[str, int] = {}
    cols: dict[str, list[int]] = {c: [] for c in _COLUMNS}
    digits: list[str] = []
    for meta, idx in shards:
        key = meta.shard_key(idx)
        loc = located.get(key)
        if loc is None:
            continue
        t = names.get(meta.name)
        if t is None:
            t = names[meta.name] = len(names)
            grids.append(list(meta.grid))
        sha = hashes[key]
        kind, _, hexd = sha.partition(":")
        if kind != HASH_KIND or len(hexd) != _HASH_DIGITS:
            raise ValueError(f"shard {key!r}: hash {sha!r} is not {HASH_KIND}")
        cols["tensor"].append(t)
        cols["index"].append(_ravel(idx, meta.grid))
        cols["object"].append(objects.setdefault(str(loc[0]), len(objects)))
        cols["offset"].append(int(loc[1]))
        cols["length"].append(int(loc[2]))
        digits.append(hexd)
    doc = {"objects": list(objects), "tensors": list(names), "grids": grids, **cols, "hash": HASH_KIND,
           "hashes": "".join(digits)}
    return json.dumps(doc, separators=(",", ":")).encode()


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
                or type(names) is not list or not all(isinstance(n, str) for n in names)
                or type(grids) is not list or len(grids) != len(names)
                or not all(type(g) is list and all(type(n) is int and n >= 1 for n in g) for g in grids)):
            raise FormatError(f"{where}: malformed shard table (objects, tensors or grids)")
        self.objects: list[str] = objects
        self.names: list[str] = names
        self.grids: list[tuple[int, ...]] = [tuple(g) for g in grids]
        n = None
        cols: dict[str, np.ndarray] = {}
        for c in _COLUMNS:
            v = doc.get(c)
            if type(v) is not list or (n is not None and len(v) != n):
                raise FormatError(f"{where}: malformed shard table (column {c!r})")
            n = len(v)
            arr = np.asarray(v) if v else np.zeros(0, np.int64)
            if arr.ndim != 1 or arr.dtype.kind != "i":  # floats, strings, nested lists, ints past int64
                raise FormatError(f"{where}: shard table column {c!r} holds something other than ints")
            cols[c] = arr
        self.size = n or 0
        sizes = np.asarray([math.prod(g) for g in self.grids] or [0], dtype=np.int64)
        t, i, o = cols["tensor"], cols["index"], cols["object"]
        if self.size and (t.min() < 0 or t.max() >= len(names) or o.min() < 0 or o.max() >= len(objects)
                          or i.min() < 0 or np.any(i >= sizes[t]) or cols["offset"].min() < 0
                          or cols["length"].min() < 1):
            raise FormatError(f"{where}: the shard table has an index, object, offset or length out of range")
        hexd = doc.get("hashes")
        if doc.get("hash") != HASH_KIND or not isinstance(hexd, str) or len(hexd) != _HASH_DIGITS * self.size:
            raise FormatError(f"{where}: malformed shard table (hashes)")
        self.hashes = hexd
        self.tensor, self.index, self.object, self.offset, self.length = (cols[c] for c in _COLUMNS)

    def keys(self) -> list[str]:
        """Each shard's key (its tensor's path, ``c``, its grid index), in table order."""
        paths = [tensor_path(n) for n in self.names]
        return ["/".join([paths[t], "c", *map(str, _unravel(i, self.grids[t]))])
                for t, i in zip(self.tensor.tolist(), self.index.tolist(), strict=True)]

    def expand(self) -> tuple[dict[str, list[Any]], dict[str, str]]:
        """The keyed form: ``({key: [object, offset, length]}, {key: "xxh3_128v:<hex>"})``."""
        keys = self.keys()
        packed = {k: [self.objects[o], off, n] for k, o, off, n in
                  zip(keys, self.object.tolist(), self.offset.tolist(), self.length.tolist(), strict=True)}
        h = self.hashes
        hashes = {k: f"{HASH_KIND}:{h[j * _HASH_DIGITS:(j + 1) * _HASH_DIGITS]}" for j, k in enumerate(keys)}
        return packed, hashes


def trailer_parts(where: str, tail: bytes) -> tuple[int, int, int, int]:
    """(footer bytes, records length, table length, manifest length) of a third-form trailer's last bytes."""
    if len(tail) < TRAILER_BYTES_V3 or tail[-8:] != TRAILER_MAGIC_V3:
        raise FormatError(f"{where}: the data object does not end with a manifest (truncated or not reshard's)")
    return (TRAILER_BYTES_V3, int.from_bytes(tail[-32:-24], "little"), int.from_bytes(tail[-24:-16], "little"),
            int.from_bytes(tail[-16:-8], "little"))
