"""``jax.Array`` pytrees saved from and restored onto any mesh (jax is imported inside the functions)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from reshard.layouts import Layout, all_ranks
from reshard.layouts.errors import (
    LayoutError,
    ShapeMismatchError,
    TensorNotFoundError,
)

from ...format.grid import writes_any
from ...format.meta import ArrayMeta
from ...format.tree import to_json, unflatten
from ...read.checkpoint import Checkpoint
from ...read.open import open
from ...write.writer import CheckpointWriter, create

Region = tuple[slice, ...]
#: Host bytes gathered before one batched read while restoring (small arrays share a batch).
BATCH_BYTES = 256 << 20


def key_name(path: Sequence[Any]) -> str:
    """Dotted name of a pytree key path: ``params.dense.kernel``, ``layers.0.w``."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def _region(index: Sequence[slice], shape: Sequence[int]) -> Region:
    """A device index (slices that may hold None) as plain ``slice(start, stop)``."""
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


@functools.lru_cache(maxsize=64)
def _device_ids(mesh: Any) -> tuple[int, ...]:
    """A mesh's device ids in mesh order, one tuple per mesh: its layouts share it (no O(devices) per array)."""
    return tuple(d.id for d in mesh.devices.flat)


def layout_of(array: Any) -> Layout:
    """The layout of a ``jax.Array`` (ranks are device ids).

    ``NamedSharding`` gives ``Layout.from_jax`` over the mesh's devices in mesh
    order; a single-device or fully replicated array gives a replicated layout.
    """
    from jax.sharding import NamedSharding

    sharding, shape = array.sharding, tuple(array.shape)
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        return Layout.from_jax(list(mesh.shape.items()), tuple(sharding.spec), shape, ranks=_device_ids(mesh))
    if sharding.is_fully_replicated:
        ids = sorted(d.id for d in sharding.device_set)
        return Layout(shape, (len(ids),), tuple(ids))
    raise LayoutError(f"array of shape {list(shape)} has a {type(sharding).__name__}; "
                      "reshard saves NamedSharding (or fully replicated) arrays")


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) or (hasattr(value, "shape") and hasattr(value, "dtype")
                                             and not isinstance(value, np.generic))


# -------------------------------------------------------------------- save
def save(pytree: Any, url: str, **options: Any) -> CheckpointWriter:
    """Save a pytree of ``jax.Array`` (and numpy arrays and JSON leaves).

    Each device's shards are written with rank = its device id, one device
    at a time (only one device's data on the host at once); replicas are
    written once. With several processes, every process calls this; process
    0 commits after all have written.

    Parameters
    ----------
    pytree : pytree
        Nested dicts/lists/dataclasses of arrays; names are the dotted key paths.
    url : str
        Destination (local path or fsspec URL).
    **options
        As for :func:`reshard.store.create`.
    """
    import jax

    flat = jax.tree_util.tree_flatten_with_path(pytree)[0]
    home = min(d.id for d in jax.devices())  # the rank that writes host (numpy) arrays
    layouts: dict[str, Layout] = {}
    arrays: dict[str, Any] = {}
    leaves: dict[str, Any] = {}
    for path, value in flat:
        name = key_name(path)
        if isinstance(value, jax.Array):
            layouts[name], arrays[name] = layout_of(value), value
        elif _is_array(value):
            layouts[name], arrays[name] = Layout.single(np.shape(value), home), np.asarray(value)
        else:
            leaves[name] = to_json(value, name)
    local_ids = {d.id for d in jax.local_devices()}
    ranks = sorted(local_ids & (all_ranks(layouts.values()) | {home}))
    writer = create(url, layouts, **options)
    for rank in ranks:
        writer.write(rank, {**leaves, **_pieces(rank, layouts, arrays, writer)})
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("reshard save: written")
    if jax.process_index() == 0:
        writer.commit()
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("reshard save: committed")
    return writer


def _pieces(rank: int, layouts: dict[str, Layout], arrays: dict[str, Any], writer: CheckpointWriter
            ) -> dict[str, Any]:
    """Device ``rank``'s local arrays, as the writer expects them."""
    out = {}
    for name, layout in layouts.items():
        if not layout.has_rank(rank):
            continue
        value = arrays[name]
        if isinstance(value, np.ndarray):
            out[name] = value
            continue
        shard = next(s for s in value.addressable_shards if s.device.id == rank)
        if _region(shard.index, value.shape) != layout.region(rank):
            raise LayoutError(f"array {name!r}: device {rank} holds {shard.index}, "
                              f"its layout {layout.describe()} says {layout.region(rank)}")
        if writes_any(layout, rank, writer.balance):
            out[name] = np.asarray(shard.data)
        else:  # a replica writing nothing of it: a stand-in of the right shape and dtype, no device->host copy
            out[name] = np.broadcast_to(np.zeros((), dtype=value.dtype), layout.local_shape(rank))
    return out


# ----------------------------------------------------------------- restore
def restore(url: str | Checkpoint, target: Any, *, storage_options: dict[str, Any] | None = None) -> Any:
    """Build a pytree of ``jax.Array`` from a checkpoint, on any mesh.

    Parameters
    ----------
    url : str or Checkpoint
        The checkpoint (an open one lets you read its ``stats`` afterwards).
    target : pytree or Sharding
        A pytree whose leaves are ``jax.sharding.Sharding``,
        ``jax.ShapeDtypeStruct`` (with ``sharding``; its dtype casts) or
        ``jax.Array`` (its sharding and dtype are used); other leaves (and
        ``None``) get the stored JSON leaf of the same name (``None`` stays
        where there is none). A single ``Sharding`` restores
        every tensor with it and returns a nested dict (with the leaves).

    Returns
    -------
    pytree
        Like ``target``. Each device receives only its region; a region
        held by several devices is read once.
    """
    import jax

    ckpt = url if isinstance(url, Checkpoint) else open(url, storage_options=storage_options)
    if isinstance(target, jax.sharding.Sharding):
        tree = unflatten({**ckpt.leaves, **{n: target for n in ckpt.arrays}})
        return restore(ckpt, tree)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        target, is_leaf=lambda x: x is None or isinstance(x, jax.sharding.Sharding))
    out: list[Any] = [None] * len(flat)
    batch: list[tuple[int, ArrayMeta, Any, Any]] = []
    size = 0
    for i, (path, leaf) in enumerate(flat):
        name = key_name(path)
        if name in ckpt.arrays:
            meta = ckpt.arrays[name]
            if not isinstance(leaf, jax.sharding.Sharding) and getattr(leaf, "sharding", None) is None:
                raise TypeError(f"{name!r}: {ckpt.url} stores an array ({meta.dtype}{list(meta.shape)}) there, and the "
                                f"target gives {type(leaf).__name__}, not where to put it: give a "
                                "jax.sharding.Sharding, a jax.ShapeDtypeStruct with a sharding, or a jax.Array")
            sharding = leaf if isinstance(leaf, jax.sharding.Sharding) else leaf.sharding
            dtype = None if isinstance(leaf, jax.sharding.Sharding) else leaf.dtype
            if not isinstance(leaf, jax.sharding.Sharding) and tuple(leaf.shape) != meta.shape:
                raise ShapeMismatchError(f"{name!r}: target shape {tuple(leaf.shape)}, stored {meta.shape}")
            batch.append((i, meta, sharding, dtype))
            size += _host_bytes(meta, sharding)
            if size >= BATCH_BYTES:
                _restore_batch(ckpt, batch, out)
                batch, size = [], 0
        elif name in ckpt.leaves:
            out[i] = ckpt.leaves[name]
        elif leaf is None:
            out[i] = None
        else:
            raise TensorNotFoundError(f"{ckpt.url} holds no tensor or leaf named {name!r}")
    _restore_batch(ckpt, batch, out)
    return jax.tree_util.tree_unflatten(treedef, out)


def _bounds(index: Sequence[slice], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """A device index as hashable ``(start, stop)`` pairs (slices are not hashable before 3.12)."""
    return tuple((r.start, r.stop) for r in _region(index, shape))


def _distinct(meta: ArrayMeta, sharding: Any) -> set[tuple[tuple[int, int], ...]]:
    """The distinct regions the addressable devices of ``sharding`` hold."""
    return {_bounds(idx, meta.shape) for idx in sharding.addressable_devices_indices_map(meta.shape).values()}


def _host_bytes(meta: ArrayMeta, sharding: Any) -> int:
    return sum(math.prod(b - a for a, b in reg) for reg in _distinct(meta, sharding)) * meta.np_dtype.itemsize


def _restore_batch(ckpt: Checkpoint, batch: list[tuple[int, ArrayMeta, Any, Any]], out: list[Any]) -> None:
    """Read every distinct region of a batch of arrays in one call, then place them on their devices."""
    import jax

    buffers: list[dict[Any, np.ndarray]] = []
    jobs = []
    for _, meta, sharding, _ in batch:
        bufs = {r: np.empty(tuple(b - a for a, b in r), meta.np_dtype) for r in _distinct(meta, sharding)}
        jobs += [(meta, tuple(slice(a, b) for a, b in r), buf) for r, buf in bufs.items()]
        buffers.append(bufs)
    ckpt.read_regions(jobs)
    for (i, meta, sharding, dtype), bufs in zip(batch, buffers, strict=True):
        def piece(index: Any, bufs: dict[Any, np.ndarray] = bufs, meta: ArrayMeta = meta,
                  dtype: Any = dtype) -> np.ndarray:
            data = bufs[_bounds(index, meta.shape)]
            return data if dtype is None else data.astype(dtype, copy=False)

        out[i] = jax.make_array_from_callback(meta.shape, sharding, piece)
