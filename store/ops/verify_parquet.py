"""``verify``'s check of a packed save's parquet references (``refs.parq``, what plain zarr may read instead
of ``refs.json``): every file against the digest the commit marker records, every row against the ranks'
shard tables."""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, cast

import numpy as np
from reshard.layouts.errors import ReshardError

from ..commit.locate import ByArrays
from ..commit.marker import Marker, read_root_document
from ..commit.merge import Merged, merge_ranks
from ..format import parquet as references_parquet
from ..format.meta import ArrayMeta
from ..io import pool
from ..io.storage import Storage
from ..read.checkpoint import Checkpoint
from .damage import Damage, VerifyReport


def check_parquet(gen: Storage, marker: Marker, ckpt: Checkpoint, report: VerifyReport) -> None:
    """The save's parquet references (what plain zarr may read instead of ``refs.json``): every file there,
    against the digest its marker records, and every row (a shard's object, offset and length) against the
    ranks' shard tables, so an edit re-sealed in the marker is reported too. A file at a time per I/O thread."""
    where = f"{gen.url}/{references_parquet.PARQUET_KEY}"
    merged = _merged(gen, marker, ckpt)
    if merged is None:
        if report.ok:  # otherwise what keeps the tables from merging is reported already
            report.add("references", where, "its rows cannot be checked: the ranks' shard tables do not merge")
        return
    metas = [merged.metas[n] for n in ckpt.arrays]
    paths, grids = [m.path for m in metas], [m.grid for m in metas]
    start = dict(zip(merged.metas, merged.starts, strict=True))
    objects = np.asarray(merged.objects, dtype=object)

    def rows(t: int, key: str, lo: int, hi: int) -> tuple[str | None, Damage | None]:
        raw = _parquet_file(gen, key)
        if not isinstance(raw, bytes):
            return None, raw
        at = start[metas[t].name]
        want = objects[merged.obj[at + lo : at + hi]], merged.off[at + lo : at + hi], merged.length[at + lo : at + hi]
        return hashlib.sha256(raw).hexdigest(), _check_rows(f"{where}/{key}", raw, metas[t], lo, want)

    def zmetadata() -> tuple[str | None, Damage | None]:
        raw = _parquet_file(gen, ".zmetadata")
        if not isinstance(raw, bytes):
            return None, raw
        want = references_parquet.metadata(read_root_document(gen, marker)[1], paths, grids)
        if raw != want and _json_or_none(raw) != json.loads(want):
            return hashlib.sha256(raw).hexdigest(), Damage(
                "references", f"{where}/.zmetadata", f"{where}/.zmetadata differs from the save's root document "
                                                     "and grids (what plain zarr reads the tensors' metadata from)")
        return hashlib.sha256(raw).hexdigest(), None

    last = zmetadata()  # first: the root document it parses (O(tensors)) is let go before the rows are read
    jobs = [functools.partial(rows, *r) for r in references_parquet.records(paths, grids)]
    done = [*pool.run_all(jobs, gen.local), last]
    report.damage += [d for _, d in done if d is not None]
    shas = [sha for sha, _ in done if sha is not None]
    report.files_checked += len(shas)
    if len(shas) == len(done) and references_parquet.digest(shas) != marker.parquet_sha256:
        report.add("references", where, "the parquet references do not match the digest the commit marker names: "
                                        "a file was edited, truncated or replaced (refs.json and reshard's reads "
                                        "are not affected; plain zarr readers of refs.parq are)")


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _merged(gen: Storage, marker: Marker, ckpt: Checkpoint) -> Merged | None:
    """Every shard's location from the ranks' shard tables: the merge the streaming checks made, or a new one."""
    locator = ckpt.fetcher.locator
    if isinstance(locator, ByArrays):
        return cast(Merged, locator.merged)
    try:
        return merge_ranks(gen, marker.save_id, list(marker.ranks), fresh=True)
    except (ReshardError, FileNotFoundError):
        return None


def _parquet_file(gen: Storage, key: str) -> bytes | Damage:
    """One file of the parquet references, or the damage that it is missing or unreadable."""
    where = f"{gen.url}/{references_parquet.PARQUET_KEY}/{key}"
    try:
        return gen.read(f"{references_parquet.PARQUET_KEY}/{key}")
    except FileNotFoundError:
        return Damage("references", where, f"{where}: missing: a parquet references file of the save is gone")
    except ReshardError as e:
        return Damage("references", where, " ".join(str(e).split()))


def _check_rows(where: str, raw: bytes, meta: ArrayMeta, lo: int, want: tuple[np.ndarray, ...]) -> Damage | None:
    """The rows of one parquet file (shards ``lo``... of ``meta``) against the ranks' locations ``want``."""
    try:
        got = references_parquet.decode(where, raw)
    except ReshardError as e:
        return Damage("references", where, " ".join(str(e).split()))
    if len(got[0]) != len(want[0]):
        return Damage("references", where, f"{where}: tensor {meta.name!r}: {len(got[0])} rows where its grid has "
                                           f"{len(want[0])} shards here")
    differ = np.flatnonzero((got[0] != want[0]) | (got[1] != want[1]) | (got[2] != want[2]))
    if not differ.size:
        return None
    i = int(differ[0])
    index = tuple(int(x) for x in np.unravel_index(lo + i, meta.grid)) if meta.grid else ()
    return Damage("references", where, f"{where}: tensor {meta.name!r}, shard {meta.shard_key(index)!r}: row {i} "
                                       f"locates it at {_location(got, i)} where the ranks' shard tables say "
                                       f"{_location(want, i)} ({differ.size} row(s) differ): plain zarr reading "
                                       "refs.parq would read other bytes than reshard")


def _location(columns: tuple[np.ndarray, ...], i: int) -> str:
    return f"{columns[0][i]} bytes {int(columns[1][i])}+{int(columns[2][i])}"
