"""Deleting what no reader needs: replaced and abandoned saves (``reshard gc``).

A checkpoint URL holds one committed save (the generation its marker names) and,
after overwrites and crashes, others: the saves it replaced (readers that opened
them may still be reading: they get :class:`CheckpointReplacedError` once theirs
is gone) and attempts that never committed (possibly still being written).
An incremental save may reference data objects of a replaced generation: those
objects stay (the rest of that generation goes) until no committed save needs them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..format.meta import LOCK_KEY, META_DIR
from ..format.refs import PACKED_DIR, REFS_KEY
from ..io.storage import Storage
from .protocol import GENERATION_PREFIX, Marker, generation_storage, loads_json, read_marker

#: Uncommitted saves younger than this (seconds since their last manifest or lock) may still be written.
DEFAULT_MIN_AGE = 3600.0


@dataclass(frozen=True)
class Collected:
    """What :func:`gc` removed (or would remove, with ``dry_run``) and what it kept."""

    removed: tuple[str, ...]
    kept_young: tuple[str, ...]
    legacy: bool
    #: Objects of removed generations kept because the committed save references them.
    kept_referenced: tuple[str, ...] = ()


def gc(url: str | Storage, *, min_age: float = DEFAULT_MIN_AGE, dry_run: bool = False,
       storage_options: dict[str, Any] | None = None) -> Collected:
    """Delete every save of ``url`` but the committed one.

    Parameters
    ----------
    url : str or Storage
        The checkpoint.
    min_age : float
        A save is deleted only when nothing of it (manifest, lock, metadata)
        was written for this many seconds: a younger one may be a save in
        progress, or one that readers opened moments ago. ``0`` deletes all.
    dry_run : bool
        Only say what would go.
    storage_options : dict, optional
        fsspec options when ``url`` is a string.

    Returns
    -------
    Collected
        The generations removed and kept, and whether a format-version-1 save
        at the URL's root (replaced by a newer save) was removed.
    """
    root = url if isinstance(url, Storage) else Storage(url, storage_options)
    found = read_marker(root)
    committed = found[0].generation if found is not None else None
    removed: list[str] = []
    young: list[str] = []
    now = time.time()
    for name in root.list(""):
        if not name.startswith(GENERATION_PREFIX) or name == committed:
            continue
        gen = root.child(name)
        times = [gen.modified(k) for k in (f"{META_DIR}/ranks", LOCK_KEY, "zarr.json", REFS_KEY, PACKED_DIR)]
        latest = max((t for t in times if t is not None), default=None)
        (young if latest is not None and now - latest < min_age else removed).append(name)
    legacy = found is not None and found[0].format_version >= 2 and root.exists("zarr.json")
    needed = reused_objects(root, found[0]) if found is not None else set()
    if not dry_run:
        for name in removed:
            delete_except(root, name, needed)
        if legacy:
            _delete_legacy(root)
    kept = sorted(k for k in needed if k.split("/", 1)[0] in removed)
    return Collected(tuple(removed), tuple(young), legacy, tuple(kept))


def reused_objects(root: Storage, marker: Marker) -> set[str]:
    """Data objects outside its own generation that the committed save references (incremental saves)."""
    if marker.form != "packed":
        return set()
    from .locate import read_references

    refs = read_references(generation_storage(root, marker), marker)
    return {obj for obj in refs.objects() if not obj.startswith(f"{marker.generation}/")}


def delete_except(root: Storage, prefix: str, keep: set[str]) -> None:
    """Remove everything under ``prefix`` but the objects in ``keep`` (keys of ``root``)."""
    if not any(k == prefix or k.startswith(f"{prefix}/") for k in keep):
        root.delete(prefix)
        return
    for name in root.list(prefix):
        if f"{prefix}/{name}" not in keep:
            delete_except(root, f"{prefix}/{name}", keep)


def _delete_legacy(root: Storage) -> None:
    """Remove a format-version-1 save at the URL's root, replaced by a generation."""
    doc = loads_json(f"{root.url}/zarr.json", root.read("zarr.json"))
    paths = (doc.get("consolidated_metadata") or {}).get("metadata") or {}
    for top in sorted({p.split("/")[0] for p in paths}):
        if not top.startswith(GENERATION_PREFIX):
            root.delete(top)
    root.delete(f"{META_DIR}/ranks")
    root.delete(LOCK_KEY)
    root.delete("zarr.json")
