"""The streaming merge of a packed save's rank trailers (third form: :mod:`reshard.store.format.table`).

A commit of N ranks x T tensors merges N x T shard locations. Reading every
rank's whole manifest into dicts (the first two trailer forms) costs about a
kilobyte of memory and ten microseconds per shard: 36 GB and minutes at 4,096
ranks x 10,000 tensors. Here the commit reads

1. every rank's manifest (the end of its trailer: its layout groups, leaves, and
   the lengths of its parts), keeping only the few fields it needs;
2. each distinct layout group's tensor records once, from the group's carrier
   (the lowest rank of its layouts): the array records;
3. every rank's shard table, one rank at a time, as numbers (from the bytes of
   step 1 where they held it, up to :data:`KEEP_TABLES` bytes in all): each shard's
   object, offset and length go straight into three arrays laid out by tensor,
   then C order of its grid (the order of the references), 20 bytes a shard.

Nothing else grows with ranks x tensors; the references are then written from
those arrays as a stream (:func:`reshard.store.format.refs.stream`).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from reshard.layouts.errors import FormatError

from ..format.manifests import merge_manifests, present_ranks
from ..format.meta import ArrayMeta
from ..format.refs import TRAILER_MAGIC, TRAILER_MAGIC_V1, rank_object
from ..format.table import TRAILER_MAGIC_V3, Table
from ..format.trailers import group_records, read_head, read_table
from ..io import pool
from ..io.storage import Storage
from .fence import MANIFEST_FIELD, check_one_job

#: Bytes of a data object's end read for its manifest (and, for small saves, its table).
HEAD_GUESS = 64 << 10
#: Most bytes of tables kept from those reads (a small save's commit then reads each rank once); beyond, reread.
KEEP_TABLES = 64 << 20


@dataclass
class Merged:
    """What the commit of a third-form save needs: array records, leaves, and every shard's location.

    ``objects[obj[i]], off[i], length[i]`` is shard ``i`` in the order of the
    references: tensors in the order of ``metas``, each from ``starts[t]`` in C
    order of its grid.
    """

    metas: dict[str, ArrayMeta]
    leaves: dict[str, Any]
    objects: list[str]
    obj: np.ndarray
    off: np.ndarray
    length: np.ndarray
    starts: list[int]
    ranks: list[int]

    def shards(self) -> int:
        return int(self.obj.size)


def third_form(gen: Storage, rank: int) -> bool | None:
    """Whether ``rank``'s data object ends with a third-form trailer (None: no such object)."""
    try:
        tail = gen.read_tail(rank_object(rank), 8)
    except FileNotFoundError:
        return None
    if tail == TRAILER_MAGIC_V3:
        return True
    if tail in (TRAILER_MAGIC, TRAILER_MAGIC_V1):
        return False
    return None


def expected_ranks(gen: Storage) -> list[int] | None:
    """The ranks a save expects, from the first rank found by listing (a commit not told them); None if that
    rank's trailer is not of the third form."""
    present = present_ranks(gen)
    if not present or not third_form(gen, present[0]):
        return None
    doc = read_head(gen, present[0])[0]
    return list(doc["expected_ranks"])


def merge_ranks(gen: Storage, save_id: str | None, expected: list[int],
                known: Mapping[str, tuple[dict[str, Any], ArrayMeta]] | None = None, fresh: bool = False
                ) -> Merged | None:
    """Merge the trailers of ``expected`` ranks; None if one is missing, of another save, or of an earlier form
    (the caller then takes the general path, which also names what is missing). ``fresh``: read and check
    every records document even when one with its sha256 was read before (``verify``)."""
    heads: dict[int, tuple[dict[str, Any], tuple[int, int, int, int]]] = {}
    tables: dict[int, bytes] = {}  # the end of a rank's object from its table on, where the first read held it
    lock = threading.Lock()
    kept = [0]

    def head(r: int) -> None:
        try:
            tail = gen.read_tail(rank_object(r), HEAD_GUESS)
        except FileNotFoundError:
            return
        if tail[-8:] != TRAILER_MAGIC_V3:
            return
        doc, tail, parts = read_head(gen, r, tail)
        if save_id is not None and doc.get("save_id") != save_id:
            return
        fields: dict[str, Any] = {k: doc[k] for k in ("groups", "carried", "leaves", "table_sha256", MANIFEST_FIELD)
                                  if k in doc}
        footer, _, n_table, n_manifest = parts
        end = footer + n_manifest + n_table
        with lock:
            heads[r] = fields, parts
            if end <= len(tail) and kept[0] + end <= KEEP_TABLES:
                kept[0] += end
                tables[r] = tail[len(tail) - end:]

    pool.run_all([functools.partial(head, r) for r in expected], gen.local)
    if len(heads) != len(set(expected)):
        return None
    check_one_job(gen.url, {r: h[0] for r, h in heads.items()})
    metas = _records(gen, heads, known, fresh)
    if metas is None:
        return None
    leaves: dict[str, Any] = {}
    for r in sorted(heads, reverse=True):  # the lowest rank's leaves win
        leaves.update(heads[r][0]["leaves"])
    return _locations(gen, heads, tables, metas, leaves)


def _records(gen: Storage, heads: dict[int, tuple[dict[str, Any], tuple[int, int, int, int]]],
             known: Mapping[str, tuple[dict[str, Any], ArrayMeta]] | None, fresh: bool) -> dict[str, ArrayMeta] | None:
    """The array records: every distinct layout group's records, read once from its carrier, merged. None where
    the ranks disagree on a group's records (the general path then names the tensor and how)."""
    groups: dict[str, tuple[int, int]] = {}  # sha -> (carrier, tensors)
    for _, (doc, _) in sorted(heads.items()):
        for sha, carrier, count in doc["groups"]:
            if groups.setdefault(sha, (carrier, count)) != (carrier, count):
                return None
    if any(carrier not in heads or not any(c[0] == sha for c in heads[carrier][0]["carried"])
           for sha, (carrier, _) in groups.items()):
        return None
    docs = pool.run_all([functools.partial(group_records, gen, sha, carrier, count, fresh)
                         for sha, (carrier, count) in sorted(groups.items(), key=lambda g: (g[1][0], g[0]))],
                        gen.local)
    combined: dict[str, Any] = {}
    for records in docs:
        for name, t in (records or {}).items():
            if combined.setdefault(name, t) != t:
                return None
    metas, _ = merge_manifests(gen.url, {0: {"tensors": combined, "leaves": {}}}, known=known)
    return metas


def _locations(gen: Storage, heads: dict[int, tuple[dict[str, Any], tuple[int, int, int, int]]],
               tables: dict[int, bytes], metas: dict[str, ArrayMeta], leaves: dict[str, Any]) -> Merged:
    """Every shard's location, from the ranks' tables (``tables``: those already read; the others are read one
    at a time per thread), as numbers."""
    names = list(metas)
    gid = {n: i for i, n in enumerate(names)}
    grids = [metas[n].grid for n in names]
    sizes = [math.prod(g) for g in grids]
    starts = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    total = int(starts[-1])
    obj = np.full(total, -1, dtype=np.int32)
    off = np.zeros(total, dtype=np.int64)
    length = np.zeros(total, dtype=np.int64)
    objects: dict[str, int] = {}
    lock = threading.Lock()

    def place(r: int) -> None:
        doc, parts = heads[r]
        table = read_table(gen, r, doc, tables.pop(r, b""), parts)
        t_gid = _tensor_ids(table)
        with lock:
            o_ids = np.asarray([objects.setdefault(o, len(objects)) for o in table.objects] or [0], dtype=np.int32)
        if not table.size:
            return
        g = t_gid[table.tensor]
        keep = g >= 0  # a shard of no committed tensor is left out of the references
        pos = starts[g[keep]] + table.index[keep]
        obj[pos] = o_ids[table.object[keep]]
        off[pos] = table.offset[keep]
        length[pos] = table.length[keep]

    seen: list[tuple[list[str], list[tuple[int, ...]], np.ndarray, np.ndarray]] = []  # the last rank's mapping

    def _tensor_ids(table: Table) -> np.ndarray:
        """Each table tensor's position in the merge (-1: not committed), its grid checked against the records.
        Ranks of a save mostly list the same tensors: the last mapping is reused when the lists are equal."""
        if seen and seen[-1][0] == table.names and seen[-1][1] == table.grid_shapes and \
                np.array_equal(seen[-1][2], table.grid):
            return seen[-1][3]
        ids = np.asarray([gid.get(n, -1) for n in table.names] or [0], dtype=np.int64)
        shapes = table.grid_shapes
        for t, g in enumerate(table.grid.tolist()):
            i = ids[t]
            if i >= 0 and shapes[g] != tuple(grids[i]):
                raise FormatError(f"{table.where}: its shard table gives tensor {table.names[t]!r} a grid of "
                                  f"{list(shapes[g])} shards, its records {list(grids[i])}")
        seen[:] = [(table.names, shapes, table.grid, ids)]
        return ids

    pool.run_all([functools.partial(place, r) for r in sorted(heads)], gen.local)
    missing = np.flatnonzero(obj < 0)
    if missing.size:
        at = int(missing[0])
        t = int(np.searchsorted(starts, at, side="right")) - 1
        meta = metas[names[t]]
        idx = np.unravel_index(at - int(starts[t]), meta.grid) if meta.grid else ()
        raise FormatError(f"{gen.url}: tensor {meta.name!r}: no rank wrote shard "
                          f"{meta.shard_key(tuple(int(i) for i in idx))!r}")
    return Merged(metas, leaves, list(objects), obj, off, length, starts[:-1].tolist(), sorted(heads))
