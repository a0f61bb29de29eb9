"""The commit protocol: per-rank manifests, the commit lock, the commit marker.

Every rank writes its shards, then its manifest ``.reshard/ranks/<rank>.json``.
Any one process then calls :func:`commit`: it takes the lock with a
create-if-absent write, reads every expected rank's manifest by key, checks that
they agree, writes every array's and group's ``zarr.json``, the root
``zarr.json`` with consolidated metadata and, last, the marker
``.reshard/commit.json``. Readers trust only the marker. docs/format.md has the
whole protocol and what a crash at each step leaves.
"""

from __future__ import annotations

import functools
import json
import math
import time
import uuid
from typing import Any

from reshard.layouts import Layout
from reshard.layouts.errors import (
    CheckpointExistsError,
    CommitConflictError,
    DTypeMismatchError,
    FormatError,
    UncommittedCheckpointError,
)

from .format.meta import COMMIT_KEY, FORMAT_VERSION, LOCK_KEY, META_DIR, ArrayMeta, group_json, shard_shape, tensor_path
from .io import pool
from .io.storage import Storage


def manifest_key(rank: int) -> str:
    return f"{META_DIR}/ranks/{rank}.json"


def commit(url: str | Storage, *, save_id: str | None = None, ranks: list[int] | None = None,
           storage_options: dict[str, Any] | None = None) -> None:
    """Commit a checkpoint once every rank has written.

    Parameters
    ----------
    url : str or Storage
        The checkpoint.
    save_id : str, optional
        Accept only manifests written with this ``save_id``.
    ranks : list of int, optional
        The ranks expected to have written (a writer passes them from its
        layouts). Without them, the set recorded in any manifest found is used:
        the only listing in the protocol; every manifest is then read by key.
    storage_options : dict, optional
        fsspec options when ``url`` is a string.

    Raises
    ------
    UncommittedCheckpointError
        If a rank's manifest is missing; the message names the ranks and the
        tensors left without data. Nothing is committed; retry after they write.
    CommitConflictError
        If another process holds the commit lock or committed first.
    """
    storage = url if isinstance(url, Storage) else Storage(url, storage_options)
    try:
        storage.write_new(LOCK_KEY, json.dumps({"time": time.time(), "token": uuid.uuid4().hex}).encode())
    except CheckpointExistsError:
        raise CommitConflictError(
            f"{storage.url}: another writer is committing or has committed this checkpoint"
        ) from None
    try:
        manifests = read_manifests(storage, save_id, ranks)
        metas, leaves = merge_manifests(storage.url, manifests)
        jobs = [lambda m=m: storage.write(f"{m.path}/zarr.json", json.dumps(m.to_zarr_json()).encode())
                for m in metas.values()]
        groups = sorted({"/".join(m.path.split("/")[:i]) for m in metas.values()
                         for i in range(1, m.path.count("/") + 1)})
        jobs += [lambda g=g: storage.write(f"{g}/zarr.json", json.dumps(group_json()).encode())
                 for g in groups]
        pool.run_all(jobs, storage.local)
        consolidated = {m.path: m.to_zarr_json() for m in metas.values()}
        consolidated.update({g: group_json() for g in groups})
        root = group_json({"reshard": {"format_version": FORMAT_VERSION, "leaves": leaves}})
        root["consolidated_metadata"] = {"kind": "inline", "must_understand": False, "metadata": consolidated}
        storage.write("zarr.json", json.dumps(root).encode())
        marker = {"format_version": FORMAT_VERSION, "time": time.time(), "save_id": save_id,
                  "tensors": len(metas), "ranks": sorted(manifests)}
        storage.write(COMMIT_KEY, json.dumps(marker).encode())
    except BaseException:
        storage.delete(LOCK_KEY)
        raise


def read_manifests(storage: Storage, save_id: str | None = None,
                   expected: list[int] | None = None) -> dict[int, dict[str, Any]]:
    """Read every expected rank's manifest, by key.

    ``expected`` defaults to the rank set recorded in any manifest found by listing.
    """
    if expected is None:
        present = [int(n.split(".")[0]) for n in storage.list(f"{META_DIR}/ranks") if n.endswith(".json")]
        if not present:
            raise UncommittedCheckpointError(f"{storage.url}: no rank has written anything yet")
        expected = _read_json(storage, manifest_key(present[0]))["expected_ranks"]
    manifests: dict[int, dict[str, Any]] = {}

    def load(r: int) -> None:
        try:
            m = _read_json(storage, manifest_key(r))
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


def describe_missing(url: str, missing: list[int], manifests: dict[int, dict[str, Any]]) -> str:
    """A message naming the ranks that did not write and the tensors they hold."""
    lost: set[str] = set()
    for m in manifests.values():
        for name, t in m["tensors"].items():
            layout = Layout.from_json(t["layout"])
            if any(layout.replica_id(r) == 0 and math.prod(layout.local_shape(r)) > 0
                   for r in missing if r in layout.ranks):
                lost.add(name)
    names = sorted(lost)
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    return (f"{url}: checkpoint is not committed: ranks {missing} have not written"
            + (f"; tensors without their data: {shown}" if names else ""))


def merge_manifests(url: str, manifests: dict[int, dict[str, Any]]) -> tuple[dict[str, ArrayMeta], dict[str, Any]]:
    """Check that the ranks agree and build each tensor's array record."""
    metas: dict[str, ArrayMeta] = {}
    seen: dict[str, tuple[int, dict[str, Any]]] = {}
    leaves: dict[str, Any] = {}
    for rank in sorted(manifests, reverse=True):  # the lowest rank's leaves win
        leaves.update(manifests[rank]["leaves"])
    for rank in sorted(manifests):
        for name, t in manifests[rank]["tensors"].items():
            if name in seen:
                other, t0 = seen[name]
                if t0["dtype"] != t["dtype"]:
                    raise DTypeMismatchError(
                        f"{url}: tensor {name!r} is {t0['dtype']} on rank {other} but {t['dtype']} on rank {rank}")
                if t0 != t:
                    raise FormatError(f"{url}: ranks {other} and {rank} disagree on the layout of {name!r}")
                continue
            seen[name] = (rank, t)
            layout = Layout.from_json(t["layout"])
            shard = _shard_of(url, name, layout, t.get("shard"))
            metas[name] = ArrayMeta(name=name, shape=tuple(layout.shape), dtype=t["dtype"], shard=shard,
                                    chunk=tuple(t["chunk"]), layout=layout, checksums=t["checksums"],
                                    compressor=t["compressor"], origin=layout.origin)
            tensor_path(name)  # validates the name once more
    return metas, leaves


def _shard_of(url: str, name: str, layout: Layout, recorded: Any) -> tuple[int, ...]:
    """The shard shape a manifest records (checked to be one of the layout's two grids), else the per-rank grid."""
    per_rank = shard_shape(layout)
    if recorded is None or tuple(recorded) == per_rank:
        return per_rank
    single = shard_shape(layout, single_writer=True)
    if tuple(recorded) != single:
        raise FormatError(f"{url}: tensor {name!r}: manifest records shard shape {list(recorded)}, "
                          f"layout {layout.describe()} allows {sorted({per_rank, single})}")
    return single


def _read_json(storage: Storage, key: str) -> Any:
    try:
        return json.loads(storage.read(key))
    except json.JSONDecodeError as e:
        raise FormatError(f"{storage.url}/{key} is not valid JSON: {e}") from None


