"""Deleting what no reader needs: replaced and abandoned saves (``reshard gc``).

A checkpoint URL holds one committed save (the generation its marker names) and,
after overwrites and crashes, others: the saves it replaced (readers that opened
them may still be reading: they get :class:`CheckpointReplacedError` once theirs
is gone) and attempts that never committed (possibly still being written).
An incremental save may reference data objects of a replaced generation, or of a
checkpoint beside it (a manager's earlier step): those objects stay (the rest of
that generation goes) until no committed save needs them.

What makes it safe against saves in progress:

* a writer's **lease** (``<generation>/.reshard/lease.json``, written before its
  first shard) counts as activity: a generation with anything younger than
  ``min_age`` (lease, manifests, lock, metadata, data objects) stays;
* before deleting a generation, ``gc`` **marks it collected**
  (``url/.reshard/collected/<generation>``), then looks for a live commit lock
  (and backs off if there is one). A commit checks the mark while it holds the
  lock, right before its marker: so a save ``gc`` touched never commits, and a
  commit in progress is never touched. A collected save_id is never used again at
  that URL (its writers are refused), so a reader of an old generation reads its
  bytes or finds them gone, never other ones;
* ``gc`` follows no symbolic link: a link inside the checkpoint is removed as a
  link (never what it points to), so nothing outside the checkpoint is deleted.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from reshard.layouts.errors import CheckpointNotFoundError

from ..format.meta import LOCK_KEY, META_DIR
from ..format.refs import PACKED_DIR, REFS_KEY
from ..format.schema import loads_json
from ..io.storage import Storage
from .locks import COLLECTED_DIR, collected_key, lock_is_live
from .marker import GENERATION_PREFIX, Marker, generation_storage, read_marker

#: Uncommitted saves younger than this (seconds since their last lease, manifest, lock or object) may still be
#: written.
DEFAULT_MIN_AGE = 3600.0
#: What ``gc`` looks at to date a generation (each listed: the newest object directly under it).
_DATED = (META_DIR, f"{META_DIR}/ranks", "zarr.json", REFS_KEY, PACKED_DIR)


@dataclass(frozen=True)
class Collected:
    """What :func:`gc` removed (or would remove, with ``dry_run``) and what it kept."""

    removed: tuple[str, ...]
    kept_young: tuple[str, ...]
    legacy: bool
    #: Objects of removed generations kept because a committed save (this one or a sibling) references them.
    kept_referenced: tuple[str, ...] = ()


def gc(url: str | Storage, *, min_age: float = DEFAULT_MIN_AGE, dry_run: bool = False,
       storage_options: dict[str, Any] | None = None) -> Collected:
    """Delete every save of ``url`` but the committed one.

    Parameters
    ----------
    url : str or Storage
        The checkpoint.
    min_age : float
        A save is deleted only when nothing of it (lease, manifest, lock,
        metadata, data object) was written for this many seconds: a younger one
        may be a save in progress, or one that readers opened moments ago. ``0``
        deletes every save that is not being committed right now (a save still
        being written is then refused at its commit).
    dry_run : bool
        Only say what would go.
    storage_options : dict, optional
        fsspec options when ``url`` is a string.

    Returns
    -------
    Collected
        The generations removed and kept, and whether a format-version-1 save
        at the URL's root (replaced by a newer save) was removed.

    Raises
    ------
    CheckpointNotFoundError
        If ``url`` holds no checkpoint (no marker, no saves): a mistyped path is not "nothing to do".
    """
    root = url if isinstance(url, Storage) else Storage(url, storage_options)
    found = read_marker(root)
    committed = found[0].generation if found is not None else None
    names = root.list("")
    collected = set(root.list(COLLECTED_DIR))
    if found is None and not any(n.startswith(GENERATION_PREFIX) for n in names) and not collected:
        hint = " (a CheckpointManager root: its steps, step-<N>, are the checkpoints)" \
            if "manager.json" in names else ""
        raise CheckpointNotFoundError(f"{root.url}: no checkpoint here (no commit marker, no saves){hint}")
    removed: list[str] = []
    young: list[str] = []
    now = time.time()
    for name in names:
        if not name.startswith(GENERATION_PREFIX) or name == committed:
            continue
        if name in collected:  # a gc killed while deleting it: finish
            removed.append(name)
            continue
        gen = root.child(name)
        times = [gen.modified(k) for k in _DATED]
        latest = max((t for t in times if t is not None), default=None)
        (young if latest is not None and now - latest < min_age else removed).append(name)
    legacy = found is not None and found[0].format_version >= 2 and root.exists("zarr.json")
    needed: set[str] = set()
    if removed:
        needed = reused_objects(root, found[0]) if found is not None else set()
        needed |= sibling_references(root)
    if not dry_run:
        for name in list(removed):
            if name not in collected and not mark_collected(root, name):
                removed.remove(name)  # a commit of it is in progress: not ours to touch
                young.append(name)
                continue
            delete_except(root, name, needed)
        if legacy:
            _delete_legacy(root)
    kept = sorted(k for k in needed if k.split("/", 1)[0] in removed)
    return Collected(tuple(removed), tuple(sorted(young)), legacy, tuple(kept))


def mark_collected(root: Storage, generation: str) -> bool:
    """Mark a generation collected (so that it never commits), unless a live commit of it holds its lock.

    The mark is written first, then the lock and the marker are looked at; a
    commit takes the lock, looks at the mark, writes its marker, then releases
    the lock: so either the commit sees the mark (and refuses), or ``gc`` sees
    the lock held or the marker naming the generation (and backs off). Returns
    whether the generation may be deleted.
    """
    key = collected_key(generation)
    root.write_atomic(key, json.dumps({"time": time.time(), "host": socket.gethostname(),
                                       "pid": os.getpid()}).encode())
    found = None
    if not lock_is_live(root.child(generation)):
        found = read_marker(root)  # a commit that finished after gc looked: its marker names it now
        if found is None or found[0].generation != generation:
            return True
    root.delete(key, recursive=False)
    return False


def reused_objects(root: Storage, marker: Marker) -> set[str]:
    """Data objects outside its own generation that the committed save references (incremental saves)."""
    if marker.form != "packed":
        return set()
    from .locate import read_references

    refs = read_references(generation_storage(root, marker), marker)
    return {obj for obj in refs.objects() if not obj.startswith(f"{marker.generation}/")}


def sibling_references(root: Storage) -> set[str]:
    """Objects of ``root`` (keys under it) that committed checkpoints beside it reference (incremental saves).

    An incremental save may reference a checkpoint in the same folder (a
    manager's earlier step), as ``../<name>/<key>``: one listing of the parent,
    one GET per entry (its marker) and the references of each committed packed
    sibling. A sibling whose marker or references cannot be read raises: ``gc``
    would not know what it needs.
    """
    name = root.url.rsplit("/", 1)[-1]
    if root.parent_url is None:
        return set()  # the root is a bucket or a host: it has no siblings
    parent = Storage(root.parent_url, root.options)
    prefix = f"../{name}/"
    out: set[str] = set()
    for sibling in parent.list(""):
        if sibling == name or sibling.startswith("."):
            continue
        if parent.local and (os.path.islink(parent.path(sibling)) or not os.path.isdir(parent.path(sibling))):
            continue  # a file, or a link (gc follows none)
        folder = parent.child(sibling)
        found = read_marker(folder)
        if found is not None:
            out |= {obj[len(prefix):] for obj in reused_objects(folder, found[0]) if obj.startswith(prefix)}
    return out


def delete_except(root: Storage, prefix: str, keep: set[str]) -> None:
    """Remove everything under ``prefix`` but the objects in ``keep`` (keys of ``root``).

    A symbolic link is removed as a link, never followed (and kept, unlisted, if
    ``keep`` names something through it): nothing outside the checkpoint goes.
    """
    inside = any(k == prefix or k.startswith(f"{prefix}/") for k in keep)
    if _is_link(root, prefix):
        if not inside:
            root.delete(prefix)  # the link itself (fsspec removes a link, never its target)
        return
    if not inside:
        root.delete(prefix)
        return
    for name in root.list(prefix):
        if f"{prefix}/{name}" not in keep:
            delete_except(root, f"{prefix}/{name}", keep)


def _is_link(root: Storage, key: str) -> bool:
    return root.local and os.path.islink(root.path(key))


def _delete_legacy(root: Storage) -> None:
    """Remove a format-version-1 save at the URL's root, replaced by a generation."""
    doc = loads_json(f"{root.url}/zarr.json", root.read("zarr.json"))
    paths = (doc.get("consolidated_metadata") or {}).get("metadata") or {}
    for top in sorted({p.split("/")[0] for p in paths}):
        if not top.startswith(GENERATION_PREFIX) and top != META_DIR:
            root.delete(top)
    root.delete(f"{META_DIR}/ranks")
    root.delete(LOCK_KEY)
    root.delete("zarr.json")

