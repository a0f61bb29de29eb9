"""Megatron-Core ``dist_checkpointing`` saves (the ``torch_dist`` format) into reshard checkpoints.

A ``torch_dist`` save is a torch DCP folder (``.metadata``, ``__<rank>_<n>.distcp``)
plus ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``) and
``common.pt`` (the state every rank shares). Its tensors are Megatron
``ShardedTensor`` s: regular ones are stored as DCP chunks in their own shape
(tensor-parallel blocks: an explicit layout, as :func:`reshard.store.frontends.torch.dcp.import_dcp`
gives), and the distributed optimizer's state in its ``fully_sharded_model_space``
form holds, per data-parallel rank, a ``flattened_range`` of every
tensor-parallel local block. Megatron stores such a tensor of global shape
``[X, Y]`` with local blocks ``[x, y]`` as a DCP array ``[X // x, Y // y, x * y]``
whose last axis the ranges cut, and records the original shape in the
metadata's ``mcore_data`` (``nd_reformulated_orig_global_shape``).
:func:`import_megatron` turns each such array back into the tensor in its own
shape under a :class:`~reshard.layouts.FlatLayout`: chunk ``i`` (offsets
``(*block index, start)``, sizes ``(1, ..., 1, n)``) is rank ``i``'s range
``[start, start + n)`` of the block at ``block index * [x, y]``. Loading any
rank of another data-parallel or tensor-parallel size then reads only what it
needs, and reading a tensor whole integrates it.

The ``dp_reshardable`` form (flat buckets, :mod:`.buckets`) becomes
each parameter's state in its own shape too (a legacy GroupedMLP's in its saved
weight's shape and blocks, :mod:`.grouped`); the ``fully_reshardable`` form is
regular tensors. :mod:`.write` writes an import back. Flat buckets under a
prefix ``chained_<i>.`` (a ``ChainedOptimizer``'s: an MoE model's expert
parameters get an optimizer of their own) are decoded the same way, each
optimizer's state keeping its prefix (``chained_<i>.optimizer.state.<s>.<key>``,
the names Megatron gives the ``fully_reshardable`` form). Buckets under any other
prefix, items and ``common.pt`` entries that are not JSON are not decoded: the
import refuses them, naming them and their files, unless ``skip`` names them (then
the checkpoint records them as skipped, :class:`~reshard.store.frontends.sources.Skips`).

``.metadata`` is read with the DCP import's restricted unpickler, Megatron's
own classes (its save plan) becoming inert stand-ins; items and ``common.pt``
with ``torch.load(weights_only=True)``. torch is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from reshard.layouts import FlatLayout, Layout
from reshard.layouts.errors import CheckpointNotFoundError, FormatError, LayoutError, UnsupportedError

from ...format.tree import to_json
from ...io.storage import Storage
from ...write.writer import create, single_process
from ..sources import Skips, dcp_source, refuse_empty, source_path
from ..torch.dcp import _dcp_item, _DCPMetadataUnpickler, _regroup, read_dcp_metadata
from ..torch.pt_files import load_pt, plain, stub_class
from .buckets import PREFIXED_BUCKETS, chained_prefix, is_bucket_key, is_bucket_object, place_chained_buckets
from .grouped import blocks_of


class _MegatronMetadataUnpickler(_DCPMetadataUnpickler):
    """The DCP metadata unpickler, plus inert stand-ins for Megatron's classes and DCP's plan records."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("megatron.") or module == "torch.distributed.checkpoint.planner":
            return stub_class(f"{module}.{name}")
        return super().find_class(module, name)


def read_megatron_metadata(data: bytes, where: str = ".metadata") -> Any:
    """Decode a ``torch_dist`` ``.metadata`` file (restricted: see the module docstring); errors name ``where``."""
    return read_dcp_metadata(data, where, _MegatronMetadataUnpickler)


def flat_layout(name: str, shape: tuple[int, ...], stored: tuple[int, ...], chunks: list[Any]) -> FlatLayout:
    """The flat layout of a tensor Megatron stored N-d flattened (see the module docstring).

    ``shape`` is the original global shape, ``stored`` the DCP array's shape
    ``(*fragments, prod(local shape))``, ``chunks`` its DCP chunks (``offsets``,
    ``sizes``); chunk ``i`` becomes rank ``i``.

    Raises
    ------
    FormatError
        When the stored array does not match the original shape that way.
    """
    frags, numel = stored[:-1], stored[-1] if stored else 0
    if len(frags) != len(shape) or any(f < 1 or n % f for n, f in zip(shape, frags, strict=True)):
        raise FormatError(f"tensor {name!r}: stored as {list(stored)}, which is not [fragments..., block] of its "
                          f"original shape {list(shape)}")
    block = tuple(n // f for n, f in zip(shape, frags, strict=True))
    if math.prod(block) != numel:
        raise FormatError(f"tensor {name!r}: stored rows of {numel} elements, but its blocks {list(block)} hold "
                          f"{math.prod(block)}")
    ranges = []
    for i, chunk in enumerate(chunks):
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(stored) or any(s != 1 for s in sizes[:-1]):
            raise FormatError(f"tensor {name!r}: chunk {list(offsets)} of sizes {list(sizes)} is not a flat range")
        index = offsets[:-1]
        ranges.append((i, tuple(k * b for k, b in zip(index, block, strict=True)), block, offsets[-1],
                       offsets[-1] + sizes[-1], 0))
    try:
        return FlatLayout.from_ranges(shape, ranges, {"framework": "megatron", "stored_shape": list(stored)})
    except (ValueError, TypeError) as e:
        raise FormatError(f"tensor {name!r}: its flattened ranges do not describe the tensor: {e}") from None


@contextlib.contextmanager
def _described_by(meta: str) -> Iterator[None]:
    """Errors about what the ``.metadata`` file ``meta`` describes (layouts, buckets) name it."""
    try:
        yield
    except (LayoutError, FormatError) as e:
        if meta in str(e):
            raise
        raise type(e)(f"{meta}: {e}") from None


def import_megatron(src: str, dst: str, *, skip: Sequence[str] = (), **options: Any) -> dict[str, Any]:
    """Convert a Megatron-Core ``torch_dist`` checkpoint folder into a reshard checkpoint.

    Tensors keep their names; flattened optimizer state becomes the tensor in
    its own shape under a :class:`~reshard.layouts.FlatLayout`, regular tensors
    keep their chunks as an explicit layout. Non-tensor items (ShardedObjects) and
    ``common.pt``'s entries (under ``common.``) become JSON leaves. One tensor in
    memory at a time.

    Parameters
    ----------
    src, dst : str
        The ``torch_dist`` folder, and the new checkpoint.
    skip : sequence of str
        What the import may leave out (globs or dotted prefixes): items or ``common.pt`` entries that are not
        JSON, flat buckets under a prefix that is not a ``ChainedOptimizer``'s. Anything
        else not decoded raises :class:`FormatError`, naming it and its files; what is skipped is recorded in
        the leaf ``reshard.skipped``.
    **options
        As for :func:`reshard.store.create`.

    Returns
    -------
    dict
        ``{"tensors", "flat", "leaves", "bytes", "skipped"}`` (``skipped``: the names left out).
    """
    from ...format.torch_arrays import to_numpy

    folder = source_path(src)
    store = Storage(folder)
    try:
        backend = json.loads(store.read("metadata.json"))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{folder}: no metadata.json: not a Megatron dist_checkpointing save") from None
    except ValueError as e:
        raise FormatError(f"{folder}/metadata.json is not JSON: {e}") from None
    kind = backend.get("sharded_backend") if isinstance(backend, dict) else backend
    if kind != "torch_dist":
        raise UnsupportedError(f"{folder}: sharded_backend {kind!r} is not 'torch_dist' (the zarr backend is not "
                               "imported)")
    try:
        md = read_megatron_metadata(store.read(".metadata"), f"{folder}/.metadata")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{folder}: no .metadata: the torch_dist save is incomplete") from None
    mcore = getattr(md, "mcore_data", None) or {}
    where = {(idx.fqn, None if idx.offset is None else tuple(idx.offset)): info
             for idx, info in md.storage_data.items()}
    layouts: dict[str, Layout] = {}
    dtypes: dict[str, str] = {}
    items: dict[str, Any] = {}
    skips = Skips(skip)
    files: dict[str, set[str]] = {}
    for (fqn, _), info in where.items():
        files.setdefault(fqn, set()).add(info.relative_path)
    chained: dict[str, set[str]] = {}
    metadata_file = f"{folder}/.metadata"
    with _described_by(metadata_file):
        buckets = place_chained_buckets(store, md, where)
    for name, bucket in buckets.items():
        layouts[name], dtypes[name] = bucket.layout, bucket.dtype
    for fqn, item in md.state_dict_metadata.items():
        if is_bucket_key(fqn) or (buckets and is_bucket_object(fqn)):
            continue  # read by place_buckets: the state is imported per parameter
        prefixed = PREFIXED_BUCKETS.fullmatch(fqn)
        if prefixed and not chained_prefix(fqn):
            chained.setdefault(f"{prefixed.group(1)}.optimizer.distributed", set()).update(files.get(fqn, ()))
            continue
        if not hasattr(item, "chunks"):
            try:
                items[fqn] = to_json(_dcp_item(store, where[(fqn, None)], f"item {fqn!r}"), fqn)
            except TypeError as e:
                skips.add(fqn, f"{folder}: item {fqn!r} (in {', '.join(sorted(files.get(fqn, ())))})",
                          f"it holds {e}, which is not JSON")
            continue
        stored = tuple(int(n) for n in item.size)
        orig = (mcore.get(fqn) or {}).get("nd_reformulated_orig_global_shape")
        with _described_by(metadata_file):
            if orig is not None:
                layouts[fqn] = flat_layout(fqn, tuple(int(n) for n in orig), stored, list(item.chunks))
            else:
                blocks = [(i, tuple(c.offsets), tuple(c.sizes), 0) for i, c in enumerate(item.chunks)]
                layouts[fqn] = Layout.from_blocks(stored, blocks)
        dtypes[fqn] = str(item.properties.dtype).removeprefix("torch.")
    for family, held in sorted(chained.items()):
        skips.add(family, f"{folder}: the flat optimizer buckets {family}.* (in {', '.join(sorted(held))})",
                  "they are flat dp_reshardable buckets under a prefix that is not a ChainedOptimizer's "
                  "(chained_<i>.), which reshard does not decode")
    leaves = _regroup(items, getattr(md, "planner_data", None) or {}, layouts)
    if os.path.isfile(os.path.join(folder, "common.pt")):
        common = load_pt(os.path.join(folder, "common.pt"), prefixes=("megatron.", "argparse."))
        for key, value in (common.items() if isinstance(common, dict) else ()):
            try:
                leaves[f"common.{key}"] = to_json(plain(value), key)
            except TypeError as e:
                skips.add(f"common.{key}", f"{folder}/common.pt: entry {key!r}", f"it holds {e}, which is not JSON")
    refuse_empty("Megatron torch_dist", folder, len(layouts), f" (found {len(items)} other items)")
    skips.check()
    leaves.update(skips.leaves())
    leaves.update(dcp_source("Megatron-Core torch_dist", (getattr(i, "relative_path", "") for i in where.values())))
    writer = create(dst, layouts, **single_process(options))
    metas = {}
    total = 0
    for fqn, lay in layouts.items():
        flat = isinstance(lay, FlatLayout)
        metas[fqn] = meta = writer.meta(fqn, lay, dtypes[fqn], single_writer=flat)
        if fqn in buckets and buckets[fqn].grouped:  # GroupedMLP: each parameter's flat state, transposed
            for part, sources in buckets[fqn].grouped:
                state = np.concatenate([_chunk(store, where, src, (off,), (n,), to_numpy)[lo:hi].reshape(-1)
                                        for src, off, n, lo, hi in sources])
                for (_, offsets, sizes), array in blocks_of(part, state):
                    writer.write_block(meta, tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True)),
                                       array)
                    total += array.nbytes
            continue
        if not flat:
            for chunk in md.state_dict_metadata[fqn].chunks:
                offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
                array = _chunk(store, where, fqn, offsets, sizes, to_numpy)
                writer.write_block(meta, tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True)), array)
                total += array.nbytes
            continue
        assert isinstance(lay, FlatLayout)
        if fqn in buckets:
            sources = buckets[fqn].sources
            arrays = (_chunk(store, where, src, (off,), (n,), to_numpy)[lo:hi] for src, off, n, lo, hi in sources)
        else:
            arrays = (_chunk(store, where, fqn, tuple(c.offsets), tuple(c.sizes), to_numpy)
                      for c in md.state_dict_metadata[fqn].chunks)
        whole = _integrate(lay, meta.np_dtype, arrays)
        writer.write_block(meta, tuple(slice(0, n) for n in lay.shape), whole)
        total += whole.nbytes
    writer.write_manifests(metas, leaves)
    writer.commit()
    return {"tensors": len(layouts), "flat": sum(isinstance(x, FlatLayout) for x in layouts.values()),
            "leaves": len(leaves), "bytes": total, "skipped": skips.names()}


def _integrate(lay: FlatLayout, dtype: Any, arrays: Any) -> np.ndarray:
    """The tensor of a flat layout from its ranges' arrays (one per range, in order)."""
    whole = np.empty(lay.shape, dtype=dtype)
    pieces: dict[tuple[int, ...], np.ndarray] = {}
    for array, (_, off, block, start, stop, _) in zip(arrays, lay.ranges, strict=True):
        pieces.setdefault(off, np.empty(math.prod(block), dtype=dtype))[start:stop] = array.reshape(-1)
    for (_, off, block, _, _, _) in lay.ranges:
        if off in pieces:
            whole[tuple(slice(o, o + b) for o, b in zip(off, block, strict=True))] = pieces.pop(off).reshape(block)
    return whole


def _chunk(store: Storage, where: dict[Any, Any], fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
           to_numpy: Any) -> np.ndarray:
    info = where.get((fqn, offsets))
    if info is None:
        raise FormatError(f"{store.url}: chunk {list(offsets)} of {fqn!r} has no storage entry in .metadata")
    tensor = _dcp_item(store, info, f"chunk {list(offsets)} of {fqn!r}")
    if tuple(tensor.shape) != sizes:
        raise FormatError(f"{store.url}: chunk {list(offsets)} of {fqn!r} has shape {list(tensor.shape)}, the "
                          f"metadata says {list(sizes)}")
    return np.asarray(to_numpy(tensor))
