"""JAX front end: ``jax.Array`` pytrees in and out, Orbax import.

:func:`save` writes every addressable shard of every array with rank = the
device id (replicas are written once), :func:`restore` builds arrays on any
mesh, reading only the regions the target devices hold (each distinct
region once, in batches). :func:`import_orbax` converts an Orbax checkpoint
(OCDBT or not) through Orbax's own metadata and TensorStore, one saved block
at a time.

jax and orbax are imported inside the functions, never when ``reshard.store`` loads.
"""

from __future__ import annotations

import functools
import json
import math
import re
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from reshard.layouts import Layout, all_ranks
from reshard.layouts.errors import (
    CheckpointNotFoundError,
    FormatError,
    LayoutError,
    ShapeMismatchError,
    TensorNotFoundError,
)

from ..format.grid import writes_any
from ..format.meta import ArrayMeta
from ..format.tree import to_json, unflatten
from ..read.checkpoint import Checkpoint
from ..read.open import open
from ..write.writer import CheckpointWriter, create, single_process
from .sources import local_path, refuse_empty

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


# -------------------------------------------------------------- Orbax import
def _orbax_layout(meta: Any) -> Layout:
    """The saving layout Orbax recorded (NamedSharding), else the whole array as one block."""
    shape = tuple(meta.shape)
    sharding = getattr(meta, "sharding", None)
    if sharding is not None and hasattr(sharding, "partition_spec"):
        axes = list(zip(sharding.axis_names, (int(s) for s in np.asarray(sharding.shape).flat), strict=True))
        ranks = None
        if getattr(sharding, "device_mesh", None) is not None:
            ranks = [d.id for d in np.asarray(sharding.device_mesh.mesh, dtype=object).flat]
        try:
            return Layout.from_jax(axes, tuple(sharding.partition_spec), shape, ranks=ranks)
        except LayoutError:
            pass  # uneven (padded) shards: fall back to one block
    return Layout.single(shape)


def import_orbax(src: str, dst: str, *, step: int | None = None, **options: Any) -> dict[str, Any]:
    """Convert an Orbax checkpoint (``StandardCheckpointer``/``PyTreeCheckpointer``) to reshard.

    Orbax's metadata gives the tree, shapes, dtypes and saving shardings;
    the data is read through TensorStore (OCDBT needs it), one saved block
    at a time, so memory stays bounded by the largest block. Arrays keep
    their Orbax sharding as saving layout (device ids as ranks); scalars
    become JSON leaves.

    Parameters
    ----------
    src : str
        The Orbax item directory (the one holding ``_METADATA``), a step
        folder (``<step>/default`` or its only item is taken), or a
        ``CheckpointManager`` root (the latest finished step is taken, or
        ``step``). Relative paths are resolved against the working directory.
    dst : str
        The new checkpoint.
    step : int, optional
        For a ``CheckpointManager`` root: the step to import.
    **options
        As for :func:`reshard.store.create`.

    Returns
    -------
    dict
        ``{"tensors": n, "leaves": n, "bytes": n, "skipped": [names], "source": item folder,
        "step": the step imported from a CheckpointManager root, else None}``.

    Raises
    ------
    CheckpointNotFoundError
        No Orbax checkpoint at ``src``, or one without arrays (nothing is written).
    """
    import orbax.checkpoint as ocp
    import tensorstore as ts
    from etils import epath

    path, step = orbax_item(epath.Path(local_path(src)), step)
    md = ocp.PyTreeCheckpointer().metadata(str(path))
    md = getattr(md, "item_metadata", md)
    if md is None:
        raise FormatError(f"{path}: Orbax finds no item metadata there")
    use_zarr3 = bool(getattr(md, "use_zarr3", False))
    tree = getattr(md, "tree", md)
    ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(path)
    context = ocp.type_handlers.get_ts_context(use_ocdbt=ocdbt)

    def open_array(meta: Any) -> Any:
        info = ocp.type_handlers.ParamInfo(name=meta.name, parent_dir=path, is_ocdbt_checkpoint=ocdbt,
                                           use_zarr3=use_zarr3, ts_context=context)
        spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=ocdbt)
        return ts.open(spec, context=context, open=True, read=True).result()

    layouts: dict[str, Layout] = {}
    stored: dict[str, Any] = {}
    leaves: dict[str, Any] = {}
    skipped = []
    strings = None
    for keypath, meta in _flatten_metadata(tree):
        name = key_name(keypath)
        kind = type(meta).__name__
        if kind == "ArrayMetadata":
            layouts[name], stored[name] = _orbax_layout(meta), open_array(meta)
        elif kind == "ScalarMetadata":
            leaves[name] = to_json(open_array(meta).read().result()[()], name)
        elif kind == "StringMetadata":  # Orbax keeps strings in one JSON file, by tensorstore name
            strings = strings if strings is not None else json.loads((path / "_strings.json").read_text())
            leaves[name] = strings[meta.name]
        else:
            warnings.warn(f"import_orbax: skipping {name!r} ({kind})", stacklevel=2)
            skipped.append(name)
    refuse_empty("Orbax", path, len(layouts), f" (found {len(leaves)} scalars, skipped {len(skipped)})")
    writer = create(dst, layouts, **single_process(options))
    total = 0
    metas = {}
    for name, layout in layouts.items():
        array = stored[name]
        metas[name] = meta = writer.meta(name, layout, _dtype_name(array.dtype.numpy_dtype))
        for block in layout.blocks():  # one saved block in memory at a time
            data = np.ascontiguousarray(array[block.region].read().result())
            writer.write_block(meta, block.region, data)
            total += data.nbytes
    writer.write_manifests(metas, leaves)
    writer.commit()
    return {"tensors": len(layouts), "leaves": len(leaves), "bytes": total, "skipped": skipped,
            "source": str(path), "step": step}


def orbax_item(path: Any, step: int | None = None) -> tuple[Any, int | None]:
    """The Orbax item folder (the one holding ``_METADATA``) that ``path`` names, and its step.

    ``path`` may be the item folder itself, a step folder holding one item
    (or ``default``), or a ``CheckpointManager`` root: then ``step`` picks the
    step folder, by default the latest finished one (the number is returned).

    Raises
    ------
    CheckpointNotFoundError
        Nothing at ``path``, no Orbax checkpoint under it, or no such ``step``.
    FormatError
        A step folder with several items (the message names them: pass one).
    """
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such Orbax checkpoint")
    item = _item_in(path)
    if item is not None:
        if step is not None:
            raise CheckpointNotFoundError(f"{path} is one Orbax checkpoint, not a CheckpointManager folder of steps; "
                                          "drop step=")
        return item, None
    steps = {}
    for child in path.iterdir():
        m = re.fullmatch(r"(?:.*_)?(\d+)", child.name)
        if m and child.is_dir() and _item_in(child) is not None:
            steps[int(m.group(1))] = child
    if not steps:
        raise CheckpointNotFoundError(f"{path}: neither an Orbax checkpoint (no _METADATA) nor a CheckpointManager "
                                      "folder (no finished step folder holding one)")
    chosen = max(steps) if step is None else int(step)
    if chosen not in steps:
        raise CheckpointNotFoundError(f"{path}: no finished step {chosen}; steps found: {sorted(steps)}")
    item = _item_in(steps[chosen])
    assert item is not None
    return item, chosen


def _item_in(folder: Any) -> Any:
    """``folder`` if it holds ``_METADATA``, else its ``default`` or only item folder, else None."""
    if (folder / "_METADATA").exists():
        return folder
    if (folder / "default" / "_METADATA").exists():
        return folder / "default"
    items = sorted((c for c in folder.iterdir() if c.is_dir() and (c / "_METADATA").exists()), key=str)
    if len(items) > 1:
        raise FormatError(f"{folder} holds several Orbax items ({', '.join(c.name for c in items)}): "
                          f"import one of them, e.g. {items[0]}")
    return items[0] if items else None


def _flatten_metadata(tree: Any) -> list[tuple[Any, Any]]:
    import jax

    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]


def _dtype_name(dtype: Any) -> str:
    from ..format.dtypes import dtype_name

    return dtype_name(dtype)
