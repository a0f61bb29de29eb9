"""What each rank writes at the end of its save (:func:`rank_manifest`), and how a committer or reader gets it back.

A rank's **manifest** lists the tensors it holds (their dtype, layout, shard grid: the
*tensor records*), its leaves, the ranks the save expects and, in the packed form, where
each of its shards went. Directory form: ``<generation>/.reshard/ranks/<rank>.json``.
Packed form: the trailer at the end of the rank's data object ``packed/<rank>.bin``
(:func:`reshard.store.format.refs.trailer`; read back by :mod:`reshard.store.format.trailers`). This module
reads them by key (never by
listing, except for diagnostics), checks them, and merges them into each tensor's
array record; :mod:`reshard.store.commit.protocol` commits what it merges.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from reshard.layouts import Layout
from reshard.layouts.errors import DTypeMismatchError, FormatError, UncommittedCheckpointError

from ..io import pool
from ..io.storage import Storage
from .grid import Grid, allowed_grids, choose_grid, writes_in
from .meta import FORMAT_VERSION, META_DIR, ArrayMeta
from .refs import PACKED_DIR, rank_object
from .schema import MAX_DOCUMENT_BYTES, check_manifest, check_names, loads_json
from .trailers import own, read_packed_manifest


def rank_manifest(rank: int, save_id: str, metas: Mapping[str, ArrayMeta], leaves: dict[str, Any],
                  records: Mapping[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The manifest of ``rank``: its tensors' records (``"tensors"``), its leaves, the ranks the save expects.

    ``records``: each tensor's :func:`tensor_record`, when the caller has them already.
    """
    by_layout = {m.layout.to_json_text(): m.layout.ranks for m in metas.values()}  # a few layouts, many tensors
    return {
        "format_version": FORMAT_VERSION,
        "rank": rank,
        "save_id": save_id,
        "expected_ranks": sorted(set().union(*by_layout.values(), {rank})),
        "tensors": dict(records) if records is not None else {n: tensor_record(m) for n, m in metas.items()},
        "leaves": leaves,
    }


def tensor_record(meta: ArrayMeta) -> dict[str, Any]:
    """A tensor's record in a rank manifest (the layout last: :func:`record_text` splices it)."""
    return {
        "dtype": meta.dtype,
        "chunk": list(meta.chunk),
        "shard": list(meta.shard),
        **({"edges": [list(e) for e in meta.edges]} if meta.edges is not None else {}),
        "checksums": meta.checksums,
        "compressor": meta.compressor,
        "layout": meta.layout.to_json(),
    }


def record_text(name: str, record: dict[str, Any], layout: Layout) -> str:
    """``"name":{record}`` as compact JSON, the layout spliced in from its cached text (a rank's
    manifest repeats a few layouts over hundreds of tensors)."""
    head = json.dumps({k: v for k, v in record.items() if k != "layout"}, separators=(",", ":"))
    return f'{json.dumps(name)}:{head[:-1]},"layout":{layout.to_json_text()}}}'


def records_json(texts: Iterable[str]) -> bytes:
    """The ``"tensors"`` object of a manifest from each tensor's :func:`record_text`."""
    return ("{" + ",".join(texts) + "}").encode()


def manifest_key(rank: int) -> str:
    """Key of a rank's manifest, relative to its generation."""
    return f"{META_DIR}/ranks/{rank}.json"


def read_manifests(storage: Storage, save_id: str | None = None,
                   expected: list[int] | None = None, form: str | None = None) -> dict[int, dict[str, Any]]:
    """Read every expected rank's manifest, by key (``form``: see :func:`read_manifest`).

    ``expected`` defaults to the rank set recorded in any manifest found by listing.
    """
    if expected is None:
        present = present_ranks(storage)
        if not present:
            raise UncommittedCheckpointError(f"{storage.url}: no rank has written anything yet")
        expected = read_manifest(storage, present[0], form)["expected_ranks"]
    manifests: dict[int, dict[str, Any]] = {}

    def load(r: int) -> None:
        try:
            m = read_manifest(storage, r, form)
        except FileNotFoundError:
            return
        if save_id is not None and m.get("save_id") != save_id:
            return  # a stale manifest of an earlier save
        manifests[r] = m

    pool.run_all([functools.partial(load, r) for r in expected], storage.local)
    missing = sorted(set(expected) - set(manifests))
    if missing:
        raise UncommittedCheckpointError(describe_missing(storage.url, missing, manifests))
    return manifests


def read_manifest(storage: Storage, rank: int, form: str | None = None, *, tensors: bool = True,
                  tail: bytes | None = None, fresh: bool = False) -> dict[str, Any]:
    """One rank's manifest, checked (:func:`reshard.store.format.schema.check_manifest`).

    Directory form: ``.reshard/ranks/<rank>.json``. Packed form: the end of the
    rank's data object ``packed/<rank>.bin`` (one ranged GET; two for a manifest
    over 256 KiB). ``form=None`` tries the JSON object first, then the data object.
    ``tensors=False``: a packed manifest without its tensor records (a reader
    that wants shard locations only; see :func:`reshard.store.format.refs.trailer`).
    ``tail``: the data object's last bytes, already read (:data:`TAIL_GUESS` of them, or all of a smaller one).
    ``fresh``: read and check the tensor records even when an identical document was read before (``verify``).

    Raises
    ------
    FileNotFoundError
        The rank has not written (in the given form).
    """
    if form == "packed":
        return read_packed_manifest(storage, rank, tensors, tail, fresh)
    where = f"{storage.url}/{manifest_key(rank)}"
    try:
        raw = storage.read(manifest_key(rank), limit=MAX_DOCUMENT_BYTES)
    except FileNotFoundError:
        if form == "directory":
            raise
        return read_packed_manifest(storage, rank, tensors, tail, fresh)
    return own(check_manifest(loads_json(where, raw), where), rank, where)


def has_written(gen: Storage, rank: int, form: str | None = None) -> bool:
    """Whether ``rank`` left its manifest in generation ``gen`` (a stale one counts).

    A one-byte GET per form tried (``None``: both), never a listing or a HEAD
    (on S3 ``exists`` is a HEAD and a LIST: a storm at a thousand ranks).
    """
    if form != "packed" and gen.has(manifest_key(rank)):
        return True
    return form != "directory" and gen.has(rank_object(rank))


def describe_missing(url: str, missing: list[int], manifests: dict[int, dict[str, Any]]) -> str:
    """A message naming the ranks that did not write and the tensors they hold."""
    lost: set[str] = set()
    for m in manifests.values():
        for name, t in m["tensors"].items():
            layout = Layout.from_json(t["layout"])
            grid = _recorded_grid(layout, t)
            if any(math.prod(layout.local_shape(r)) > 0 and writes_in(layout, grid, r)
                   for r in missing if r in layout.ranks):
                lost.add(name)
    names = sorted(lost)
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    return (f"{url}: checkpoint is not committed: ranks {missing} have not written"
            + (f"; tensors without their data: {shown}" if names else ""))


def _recorded_grid(layout: Layout, record: dict[str, Any]) -> Grid:
    """The shard grid a manifest's tensor record names, unchecked (for messages; the gcd grid if none)."""
    try:
        edges = record.get("edges")
        return Grid(tuple(layout.shape), tuple(record["shard"]),
                    None if edges is None else tuple(tuple(e) for e in edges))
    except (KeyError, TypeError):
        return choose_grid(layout, "regular")


def merge_manifests(url: str, manifests: dict[int, dict[str, Any]], *,
                    conflicts: list[str] | None = None,
                    known: Mapping[str, tuple[dict[str, Any], ArrayMeta]] | None = None,
                    ) -> tuple[dict[str, ArrayMeta], dict[str, Any]]:
    """Check that the ranks agree and build each tensor's array record.

    With a ``conflicts`` list, disagreements between ranks are described there
    (the lowest rank's record is kept) instead of raised: forensics on a save
    that could not commit. ``known``: ``{name: (manifest record, array record)}``
    the caller built itself; a record equal to its one is taken as built, not parsed.
    """
    metas: dict[str, ArrayMeta] = {}
    seen: dict[str, tuple[int, dict[str, Any]]] = {}
    leaves: dict[str, Any] = {}
    for rank in sorted(manifests, reverse=True):  # the lowest rank's leaves win
        leaves.update(manifests[rank]["leaves"])
    merged: list[dict[str, Any]] = []  # records documents done (ranks that agree share one: see read_manifest)
    for rank in sorted(manifests):
        records = manifests[rank]["tensors"]
        if any(records is done for done in merged):
            continue
        merged.append(records)
        for name, t in records.items():
            if name in seen:
                other, t0 = seen[name]
                if t0["dtype"] != t["dtype"]:
                    text = f"tensor {name!r} is {t0['dtype']} on rank {other} but {t['dtype']} on rank {rank}"
                    if conflicts is None:
                        raise DTypeMismatchError(f"{url}: {text}")
                    conflicts.append(text)
                elif t0 != t:
                    text = f"ranks {other} and {rank} disagree on the layout of {name!r}: " + _difference(other, t0,
                                                                                                       rank, t)
                    if conflicts is None:
                        raise FormatError(f"{url}: {text}")
                    conflicts.append(text)
                continue
            seen[name] = (rank, t)
            hit = known.get(name) if known else None
            if hit is not None and hit[0] == t:
                metas[name] = hit[1]
                continue
            layout = Layout.from_json(t["layout"])
            grid = _grid_of(url, name, layout, t.get("shard"), t.get("edges"))
            metas[name] = ArrayMeta(name=name, shape=tuple(layout.shape), dtype=t["dtype"], shard=grid.shard,
                                    chunk=tuple(t["chunk"]), layout=layout, checksums=t["checksums"],
                                    compressor=t["compressor"], origin=layout.origin, edges=grid.edges)
    check_names(metas, {n: m.path for n, m in metas.items()}, url)
    return metas, leaves


def _difference(a: int, record_a: dict[str, Any], b: int, record_b: dict[str, Any]) -> str:
    """What two ranks' records of one tensor differ in: both layouts, or the other fields."""
    def shown(record: dict[str, Any]) -> str:
        try:
            layout = Layout.from_json(record["layout"])
        except Exception:
            return repr(record.get("layout"))[:200]
        placed = (layout.origin or {}).get("placements")
        return f"{layout!r}" + (f" from placements {placed}" if placed else "")

    if record_a.get("layout") != record_b.get("layout"):
        return f"rank {a} has {shown(record_a)}, rank {b} has {shown(record_b)}"
    keys = sorted(k for k in set(record_a) | set(record_b) if record_a.get(k) != record_b.get(k))
    return "same layout, but " + ", ".join(f"{k} {record_a.get(k)!r} on rank {a}, {record_b.get(k)!r} on rank {b}"
                                           for k in keys)[:600]


def _grid_of(url: str, name: str, layout: Layout, shard: Any, edges: Any) -> Grid:
    """The shard grid a manifest records, checked to be one the layout allows (see
    :func:`reshard.store.format.grid.choose_grid`); a manifest without one: the per-rank grid."""
    allowed = allowed_grids(layout)
    if shard is None:  # manifests written before grids were recorded: the gcd grid
        return choose_grid(layout, "regular")
    try:
        want = (tuple(shard), None if edges is None else tuple(tuple(e) for e in edges))
    except TypeError:
        want = None
    for grid in allowed:
        if (grid.shard, grid.edges) == want:
            return grid
    raise FormatError(f"{url}: tensor {name!r}: manifest records shard shape {shard!r} (edges {edges!r}); "
                      f"layout {layout.describe()} allows {sorted({str(g.edges or list(g.shard)) for g in allowed})}")


def merge_packed(url: str, manifests: dict[int, dict[str, Any]],
                 metas: dict[str, ArrayMeta]) -> dict[str, tuple[str, int, int]] | None:
    """Where every shard's bytes are, from the manifests of a packed save; None for the directory form.

    Every shard of every tensor of ``metas`` (by tensor, then C order of its grid), and nothing else:
    an entry no tensor's grid names is left out of the references.

    Raises
    ------
    FormatError
        If some ranks wrote the packed form and others not, or a shard of a tensor has no bytes.
    """
    forms = {"packed" if "packed" in m else "directory" for m in manifests.values()}
    if len(forms) > 1:
        raise FormatError(f"{url}: the ranks wrote different storage forms (some packed, some directory)")
    if forms != {"packed"}:
        return None
    packed: dict[str, Any] = {}
    for rank in sorted(manifests):
        if not isinstance(manifests[rank]["packed"], dict):
            raise FormatError(f"{url}: rank {rank}'s manifest has a malformed packed record (not an object)")
        packed.update(manifests[rank]["packed"])
    located: dict[str, tuple[str, int, int]] = {}  # every shard of every tensor, in order; nothing else
    for meta in metas.values():
        for key in meta.shard_keys():
            loc = packed.get(key)
            if loc is None:
                raise FormatError(f"{url}: tensor {meta.name!r}: no rank wrote shard {key!r}")
            if type(loc) is not list or len(loc) != 3 or type(loc[0]) is not str or type(loc[1]) is not int \
                    or type(loc[2]) is not int:
                raise FormatError(f"{url}: the manifests have a malformed packed record of {key!r}: {loc!r}")
            located[key] = (loc[0], loc[1], loc[2])
    return located


def present_ranks(storage: Storage) -> list[int]:
    """The ranks whose manifests a generation holds, by listing (diagnostics and uncommitted saves only)."""
    found = {int(n.split(".")[0]) for n in storage.list(f"{META_DIR}/ranks") if n.endswith(".json")}
    found |= {int(n[:-4]) for n in storage.list(PACKED_DIR) if n.endswith(".bin") and n[:-4].isdigit()}
    return sorted(found)
