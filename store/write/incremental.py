"""Incremental saves: a shard whose bytes did not change is referenced, not written again.

A packed save records a 128-bit hash of every shard it writes in its ranks'
manifests: of the shard's values (C order, little-endian) after a short
description of how they are encoded (dtype, shard and inner chunk shapes,
codecs), which together fix the shard's stored bytes.
A save made with a **base** (an earlier committed packed save: a previous
generation of the same checkpoint, or a checkpoint beside it such as a
manager's previous ``step-<N>`` folder) compares each shard's hash with what
the base's manifest of the same rank recorded for the same key; an equal
hash means equal bytes, so the new save's references point at the base's
bytes instead of writing them again. Each rank reads one manifest of the
base (one GET), no listing.

Equal hashes mean equal values encoded the same way, so reusing the base's
bytes is exact whatever changed around them (layouts, other tensors). Hashing
the values rather than the encoded bytes lets an unchanged shard skip its
encoding (crc32c, compression) altogether. It is XXH3-128, written
``xxh3_128v:<hex>`` so that another definition never compares equal (saves of
an earlier reshard wrote ``xxh3_128:`` hashes of the encoded bytes: a base of
theirs is simply not reused); hashing runs on every byte of every incremental
save, and XXH3 is 7x sha256 and 12x blake2b here (``python -m bench.incremental``
prints the three side by side).
A 128-bit hash makes an accidental match between two different shards
vanishingly unlikely (about n^2 / 2^129 for n shards); it is not meant to resist
someone crafting colliding weights on purpose.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash
from reshard.layouts.errors import FormatError, UncommittedCheckpointError

from ..commit.marker import Marker, generation_storage, read_marker
from ..format.encode import bytes_view
from ..format.manifests import read_manifest, read_manifests
from ..format.refs import Location
from ..io.storage import Storage

#: The shard hash, named in every recorded value.
HASH = "xxh3_128v"


def digest(encoding: bytes, data: np.ndarray) -> str:
    """``xxh3_128v:<hex>`` of a shard's ``encoding`` (:func:`~reshard.store.format.encode.shard_encoding`)
    and its values ``data``."""
    h = xxhash.xxh3_128(encoding)
    _update(h, data.astype(data.dtype.newbyteorder("<"), copy=False))
    return f"{HASH}:{h.hexdigest()}"


def _update(h: Any, a: np.ndarray) -> None:
    """Hash ``a``'s bytes in C order without copying: contiguous runs of it in turn."""
    if a.flags.c_contiguous or a.ndim <= 1:
        h.update(bytes_view(a))
    else:
        for sub in a:
            _update(h, sub)


def sibling_prefix(base_url: str, url: str) -> str:
    """How keys under ``url`` name objects of the checkpoint ``base_url``.

    ``""`` when the base is ``url`` itself (an earlier generation), ``"../<name>/"``
    when it is a folder beside it; anything else is refused: a checkpoint may
    reference only itself and its siblings, so that copying their parent folder
    keeps every reference valid.
    """
    base, new = base_url.rstrip("/"), url.rstrip("/")
    if base == new:
        return ""
    parent, _, name = base.rpartition("/")
    if not parent or new.rpartition("/")[0] != parent:
        raise ValueError(f"incremental base {base_url!r} must be {url!r} itself (an earlier save) or a checkpoint "
                         "in the same folder (e.g. the manager's previous step)")
    return f"../{name}/"


@dataclass(frozen=True)
class Reusable:
    """What one rank's base manifest offers: shard bytes by key, with their hashes.

    Attributes
    ----------
    located : dict
        ``{shard key: (object key under the *new* checkpoint's root, offset, length)}``.
    hashes : dict
        ``{shard key: hash}`` (:func:`digest`).
    """

    located: dict[str, Location] = field(default_factory=dict)
    hashes: dict[str, str] = field(default_factory=dict)

    def find(self, key: str, sha: str) -> Location | None:
        """Where the base holds these bytes under this key, or None."""
        if self.hashes.get(key) != sha:
            return None
        return self.located.get(key)


class Base:
    """The committed packed save an incremental save reuses bytes of.

    Parameters
    ----------
    url : str
        The base checkpoint (committed, packed form).
    new_url : str
        The checkpoint being written.
    storage_options : dict, optional
        fsspec options.

    Raises
    ------
    UncommittedCheckpointError
        If ``url`` holds no committed checkpoint.
    FormatError
        If the base is not in the packed form (only packed saves record hashes).
    """

    def __init__(self, url: str, new_url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.prefix = sibling_prefix(url, new_url)
        root = Storage(url, storage_options)
        found = read_marker(root)
        if found is None:
            raise UncommittedCheckpointError(f"incremental base {url}: no committed checkpoint there")
        marker = found[0]
        if marker.form != "packed":
            raise FormatError(f"incremental base {url} is in the {marker.form} form; only packed saves record "
                              "shard hashes (`reshard convert` makes a packed copy)")
        self.url = url
        self.generation = marker.generation
        self.ranks = set(marker.ranks)
        self._gen = generation_storage(root, marker)

    def for_rank(self, rank: int) -> Reusable:
        """The base's shards written by ``rank`` (one GET); nothing if the base had no such rank."""
        if rank not in self.ranks:
            return Reusable()
        try:  # a rank's manifest rides at the end of its data object; block writers wrote JSON ones
            manifest = read_manifest(self._gen, rank, "packed", tensors=False)  # locations and hashes only
        except FileNotFoundError:
            try:
                manifest = read_manifest(self._gen, rank)
            except FileNotFoundError:
                return Reusable()
        return reusable(manifest, self.prefix, f"{self._gen.url}: rank {rank}'s manifest")


def reusable(manifest: Mapping[str, Any], prefix: str, where: str) -> Reusable:
    """The located, hashed shards of a manifest, with object keys rebased by ``prefix`` (:func:`sibling_prefix`)."""
    hashes, packed = manifest.get("hashes") or {}, manifest.get("packed") or {}
    if not isinstance(hashes, dict) or not isinstance(packed, dict):
        raise FormatError(f"{where}: malformed packed records or hashes")
    located: dict[str, Location] = {}
    for key, sha in hashes.items():
        record = packed.get(key)
        if not isinstance(sha, str) or not isinstance(record, list) or len(record) != 3:
            continue
        obj, offset, length = record
        # the base's own references to *its* siblings are siblings of the new checkpoint too
        located[key] = (obj if obj.startswith("../") or not prefix else prefix + obj, int(offset), int(length))
    return Reusable(located, {k: v for k, v in hashes.items() if k in located})


def shard_hashes(ckpt: Any) -> dict[str, str]:
    """``{shard key: hash}`` of every hashed shard of an opened, committed checkpoint (one GET per rank).

    Empty for saves that recorded no hashes (the directory form, format version 1).
    """
    if ckpt.marker is None:
        return {}
    marker = Marker.parse(ckpt.root.url, ckpt.marker)
    if marker.form != "packed":
        return {}
    out: dict[str, str] = {}
    for manifest in read_manifests(ckpt.storage, marker.save_id, list(marker.ranks)).values():
        hashes = manifest.get("hashes") or {}
        if isinstance(hashes, dict):
            out.update((k, v) for k, v in hashes.items() if isinstance(v, str))
    return out


def same_by_hash(a: Any, b: Any, name: str, hashes_a: Mapping[str, str], hashes_b: Mapping[str, str]) -> bool:
    """Whether tensor ``name`` of checkpoints ``a`` and ``b`` is certainly identical by its shard hashes.

    True only when both store it on the same shard grid with the same codecs
    (so equal shard keys cover equal regions) and every shard's hash is recorded
    in both and equal; False means "read the values to tell".
    """
    ma, mb = a.arrays[name], b.arrays[name]
    if ma.to_zarr_json() != mb.to_zarr_json():
        return False
    keys = [ma.shard_key(idx) for idx in ma.shards_in(tuple(slice(0, n) for n in ma.shape))]
    return all(k in hashes_a and hashes_a.get(k) == hashes_b.get(k) for k in keys)
