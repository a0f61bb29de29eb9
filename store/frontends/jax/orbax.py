"""Orbax checkpoints into reshard, through Orbax's own metadata and TensorStore (imported inside the functions)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from reshard.layouts import Layout
from reshard.layouts.errors import (
    CheckpointNotFoundError,
    DTypeMismatchError,
    FormatError,
    LayoutError,
)

from ...format.tree import to_json
from ...write.writer import create, single_process
from ..sources import Skips, local_path, refuse_empty
from .arrays import key_name


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


def import_orbax(src: str, dst: str, *, step: int | None = None, skip: Sequence[str] = (),
                 **options: Any) -> dict[str, Any]:
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
    skip : sequence of str
        Scalars that are not JSON (a complex number) and leaves of kinds reshard does not read
        (not arrays, scalars or strings) which the import may leave out (globs or dotted
        prefixes, :class:`~reshard.store.frontends.sources.Skips`); any other raises
        :class:`FormatError` naming it. What is skipped is recorded in the leaf
        ``reshard.skipped``. (An array of a dtype reshard does not store is refused, named.)
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
    dtypes: dict[str, str] = {}
    leaves: dict[str, Any] = {}
    skips = Skips(skip)
    strings = None
    for keypath, meta in _flatten_metadata(tree):
        name = key_name(keypath)
        kind = type(meta).__name__
        if kind == "ArrayMetadata":
            layouts[name], stored[name] = _orbax_layout(meta), open_array(meta)
            dtypes[name] = _dtype_name(stored[name].dtype.numpy_dtype, f"{path}: array {name!r}")
        elif kind == "ScalarMetadata":
            value = open_array(meta).read().result()[()]
            try:
                leaves[name] = to_json(value, name)
            except TypeError:
                skips.add(name, f"{path}: scalar {name!r}", f"it is a {type(value).__name__}, which is not JSON")
        elif kind == "StringMetadata":  # Orbax keeps strings in one JSON file, by tensorstore name
            strings = strings if strings is not None else json.loads((path / "_strings.json").read_text())
            leaves[name] = strings[meta.name]
        else:
            skips.add(name, f"{path}: leaf {name!r}", f"its metadata is a {kind}, which reshard does not read")
    refuse_empty("Orbax", path, len(layouts), f" (found {len(leaves)} scalars, {len(skips.records)} others)")
    skips.check()
    leaves.update(skips.leaves())
    writer = create(dst, layouts, **single_process(options))
    total = 0
    metas = {}
    for name, layout in layouts.items():
        array = stored[name]
        metas[name] = meta = writer.meta(name, layout, dtypes[name])
        for block in layout.blocks():  # one saved block in memory at a time
            data = np.ascontiguousarray(array[block.region].read().result())
            writer.write_block(meta, block.region, data)
            total += data.nbytes
    writer.write_manifests(metas, leaves)
    writer.commit()
    return {"tensors": len(layouts), "leaves": len(leaves), "bytes": total, "skipped": skips.names(),
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


def _dtype_name(dtype: Any, what: str) -> str:
    """The stored name of an array's dtype, checked before anything is written (errors name ``what``)."""
    from ...format.dtypes import dtype_name

    try:
        return dtype_name(dtype)
    except DTypeMismatchError as e:
        raise DTypeMismatchError(f"{what}: {e}") from None
