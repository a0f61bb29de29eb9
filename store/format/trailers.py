"""A rank's trailer read back: the manifest at the end of its data object ``packed/<rank>.bin``.

Three forms (:mod:`reshard.store.format.refs`, :mod:`reshard.store.format.table`):
``RSHDMAN1`` (the manifest alone, records inline), ``RSHDMAN2`` (the rank's tensor
records, then its manifest) and ``RSHDMAN3`` (the records of the layout groups the rank
carries, its shard table, its manifest). Each part is checked against the sha256 the
manifest names before it is used; records documents are kept by sha256 (the ranks of a
save share them). Ranks of one group that disagree on its records get stand-ins that
say how (:func:`_stand_ins`). :mod:`reshard.store.format.manifests` reads manifests of
either storage form through here.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

from reshard.layouts.errors import FormatError

from ..io.storage import Storage
from .refs import rank_object, trailer_lengths
from .schema import MAX_DOCUMENT_BYTES, check_manifest, check_tensors, loads_json
from .table import TRAILER_MAGIC_V3, Table, trailer_parts


def own(doc: dict[str, Any], rank: int, where: str) -> dict[str, Any]:
    if doc["rank"] != rank:
        raise FormatError(f"{where}: the manifest says it is rank {doc['rank']}'s")
    return doc


#: Tensor records already read and checked, by sha256 (the ranks of a save share one; a few saves' worth).
_RECORDS: dict[str, dict[str, Any]] = {}
_RECORDS_KEPT = 8
_RECORDS_LOCK = threading.Lock()


#: Bytes of a data object's end read to find its manifest: one request for most manifests.
TAIL_GUESS = 256 << 10


def read_packed_manifest(storage: Storage, rank: int, tensors: bool, tail: bytes | None,
                          fresh: bool) -> dict[str, Any]:
    """A manifest from the trailer of ``packed/<rank>.bin``: one ranged GET for most (more for big ones)."""
    key = rank_object(rank)
    where = f"{storage.url}/{key}"
    if tail is None:
        tail = storage.read_tail(key, TAIL_GUESS)
    if tail[-8:] == TRAILER_MAGIC_V3:
        return _read_grouped_manifest(storage, rank, tensors, tail, fresh)
    footer, n_records, n_manifest = trailer_lengths(where, tail)
    if n_manifest > MAX_DOCUMENT_BYTES or n_records > MAX_DOCUMENT_BYTES:
        raise FormatError(f"{where}: its trailer declares a manifest of {n_manifest} bytes and tensor records of "
                          f"{n_records}, over the limit of {MAX_DOCUMENT_BYTES} (malformed or hostile?)")
    need = footer + n_manifest
    if need > len(tail):
        tail = storage.read_tail(key, need + n_records if tensors else need)
        if len(tail) < need:
            raise FormatError(f"{where}: the manifest at its end is longer than the object")
    doc = own(check_manifest(loads_json(where, tail[len(tail) - need : len(tail) - footer]), where), rank, where)
    sha = doc.get("tensors_sha256")
    if not tensors or sha is None:
        return doc
    records = None if fresh else _RECORDS.get(sha)
    if records is None:
        need += n_records
        if need > len(tail):
            tail = storage.read_tail(key, need)
        raw = tail[len(tail) - need : len(tail) - need + n_records]
        if len(tail) < need or hashlib.sha256(raw).hexdigest() != sha:
            raise FormatError(f"{where}: the tensor records do not match the sha256 the manifest names: the data "
                              "object was truncated, edited or corrupted")
        records = check_tensors(loads_json(where, raw), where)
        _remember(sha, records)
    return {**doc, "tensors": records}


def read_head(storage: Storage, rank: int, tail: bytes | None = None,
              ) -> tuple[dict[str, Any], bytes, tuple[int, int, int, int]]:
    """A third-form trailer's manifest (checked; no tensors, no locations), the object's last bytes read, and
    the trailer's (footer, records, table, manifest) lengths (:mod:`reshard.store.format.table`).

    Raises
    ------
    FileNotFoundError
        The rank has not written.
    FormatError
        The object does not end with a third-form trailer, or its manifest is damaged.
    """
    key = rank_object(rank)
    where = f"{storage.url}/{key}"
    if tail is None:
        tail = storage.read_tail(key, TAIL_GUESS)
    parts = footer, n_records, n_table, n_manifest = trailer_parts(where, tail)
    if max(n_records, n_table, n_manifest) > MAX_DOCUMENT_BYTES:
        raise FormatError(f"{where}: its trailer declares parts of {n_records}, {n_table} and {n_manifest} bytes, "
                          f"over the limit of {MAX_DOCUMENT_BYTES} (malformed or hostile?)")
    need = footer + n_manifest
    if need > len(tail):
        tail = storage.read_tail(key, need + n_table)
        if len(tail) < need:
            raise FormatError(f"{where}: the manifest at its end is longer than the object")
    doc = own(check_manifest(loads_json(where, tail[len(tail) - need : len(tail) - footer]), where), rank, where)
    if "groups" not in doc:
        raise FormatError(f"{where}: the manifest of a third-form trailer names no layout groups")
    return doc, tail, parts


def read_table(storage: Storage, rank: int, head: dict[str, Any], tail: bytes,
               parts: tuple[int, int, int, int]) -> Table:
    """The shard table of a third-form trailer (read unless ``tail`` holds it), checked against its sha256."""
    key = rank_object(rank)
    where = f"{storage.url}/{key}"
    footer, _, n_table, n_manifest = parts
    need = footer + n_manifest + n_table
    if need > len(tail):
        tail = storage.read_tail(key, need)
    raw = tail[len(tail) - need : len(tail) - need + n_table]
    if len(tail) < need or hashlib.sha256(raw).hexdigest() != head["table_sha256"]:
        raise FormatError(f"{where}: its shard table does not match the sha256 its manifest names: the data object "
                          "was truncated, edited or corrupted")
    return Table(where, raw)


def group_records(storage: Storage, sha: str, carrier: int, count: int, fresh: bool = False,
                  tail: bytes | None = None) -> dict[str, Any] | None:
    """The tensor records of one layout group, from the trailer of its carrier (checked, cached by sha256).

    ``tail``: the carrier's object's last bytes when already read. None if the carrier
    does not carry them: the ranks disagree on the tensors or layouts of the group
    (:func:`_stand_ins` then says how).
    """
    records = None if fresh else _RECORDS.get(sha)
    if records is not None:
        return records
    head, tail, (footer, n_records, n_table, n_manifest) = read_head(storage, carrier, tail)
    where = f"{storage.url}/{rank_object(carrier)}"
    start = 0
    for other, length in head.get("carried", []):
        if other == sha:
            break
        start += length
    else:
        return None
    need = footer + n_manifest + n_table + n_records
    if need > len(tail):
        tail = storage.read_tail(rank_object(carrier), need)
    raw = tail[len(tail) - need + start : len(tail) - need + start + length]
    if len(tail) < need or hashlib.sha256(raw).hexdigest() != sha:
        raise FormatError(f"{where}: the tensor records it carries do not match their sha256: the data object was "
                          "truncated, edited or corrupted")
    records = check_tensors(loads_json(where, raw), where)
    if len(records) != count:
        raise FormatError(f"{where}: tensor records {sha[:12]}... hold {len(records)} tensors, the manifests say "
                          f"{count}")
    _remember(sha, records)
    return records


def _remember(sha: str, records: dict[str, Any]) -> None:
    with _RECORDS_LOCK:
        while len(_RECORDS) >= _RECORDS_KEPT:
            del _RECORDS[next(iter(_RECORDS))]
        _RECORDS[sha] = records


def _read_grouped_manifest(storage: Storage, rank: int, tensors: bool, tail: bytes, fresh: bool) -> dict[str, Any]:
    """A manifest from a third-form trailer, in the keyed form every reader takes (``packed``, ``hashes``,
    ``tensors`` when asked: its groups' records merged, one shared dict per combination of groups)."""
    head, tail, parts = read_head(storage, rank, tail)
    table = read_table(storage, rank, head, tail, parts)
    located, hashes = table.expand()
    doc = {**head, "packed": located, "hashes": hashes}
    if tensors:
        shas = "+".join(sha for sha, _, _ in head["groups"])
        merged = None if fresh else _RECORDS.get(shas)
        if merged is None:
            merged, strays = {}, []
            for sha, carrier, count in head["groups"]:
                records = group_records(storage, sha, carrier, count, fresh, tail if carrier == rank else None)
                if records is None:
                    strays.append(carrier)
                else:
                    merged.update(records)
            if strays:
                merged.update(_stand_ins(storage, rank, table, merged, strays))
            else:
                _remember(shas, merged)
        doc["tensors"] = merged
    return doc


def _stand_ins(storage: Storage, rank: int, table: Table, merged: dict[str, Any], carriers: list[int]
               ) -> dict[str, Any]:
    """Records for the tensors of ``rank`` whose layout groups' records their carriers do not carry (the ranks
    disagree on them). Only the carrier's records are stored: each stand-in is the carrier's record of the
    tensor, with this rank's dtype (the table's) where it differs, and marked where this rank's record differs
    otherwise, so that :func:`merge_manifests` names the tensor and the disagreement. A FormatError for a tensor
    its carriers do not hold, or where no tensor differs (the trailer was edited)."""
    theirs: dict[str, Any] = {}
    described: dict[str, tuple[str, int]] = {}
    for carrier in sorted(set(carriers)):
        head, tail, parts = read_head(storage, carrier)
        described.update(read_table(storage, carrier, head, tail, parts).described())
        for sha, _ in head.get("carried", []):
            count = next((c for s, _, c in head["groups"] if s == sha), 0)
            theirs.update(group_records(storage, sha, carrier, count, tail=tail) or {})
    out: dict[str, Any] = {}
    for name, (dtype, digest) in table.described().items():
        if name in merged:
            continue
        record = theirs.get(name)
        if record is None or name not in described:
            raise FormatError(f"{storage.url}/{rank_object(rank)}: rank {rank} holds tensor {name!r}, which rank "
                              f"{' or '.join(map(str, sorted(set(carriers))))}, the lowest rank of its layout, does "
                              "not hold: the ranks disagree on the tensors they hold")
        if dtype != record["dtype"]:
            record = {**record, "dtype": dtype}
        elif digest != described[name][1]:
            record = {**record, "differs_on_rank": rank}
        out[name] = record
    if all(out[name] is theirs[name] for name in out):
        raise FormatError(f"{storage.url}/{rank_object(rank)}: rank {rank} names tensor records that rank "
                          f"{' or '.join(map(str, sorted(set(carriers))))}, the lowest rank of their layouts, does "
                          "not carry, though every tensor it holds has the record that rank carries: its trailer "
                          "was edited or damaged")
    return out
