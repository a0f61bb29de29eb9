"""One-call operations built on the writer and the reader.

:func:`save` (single process, whole arrays), :func:`save_pieces` (single
process, per-rank pieces) and :func:`redivide` (checkpoint -> checkpoint under
new layouts, as a dask graph within an in-flight byte budget).
"""

from __future__ import annotations

import functools
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from reshard.layouts import FlatLayout, Layout

from ..format.encode import encode_shard
from ..format.meta import ArrayMeta
from ..format.refs import DEFAULT_OBJECT_BYTES, PACKED_DIR, check_form
from ..format.tree import SOURCE_LEAF, LayoutSpec, flatten, resolve_layout
from ..io import packed, pool
from ..io.gcpause import gc_paused
from ..io.stats import IOStats
from ..io.storage import Storage
from ..read import graph
from ..read.checkpoint import Checkpoint
from ..read.open import open
from ..write.writer import CheckpointWriter, create, single_process


def _all_ranks(layouts: Mapping[str, Layout]) -> list[int]:
    return sorted(set().union(*(lay.ranks for lay in layouts.values()))) if layouts else [0]


@gc_paused()
def save(state: Mapping[str, Any], url: str, layouts: LayoutSpec | None = None, **options: Any) -> CheckpointWriter:
    """Save whole arrays, divided by ``layouts``, as if every rank wrote its piece.

    Parameters
    ----------
    state : mapping
        Nested or dotted state dict of whole (global) arrays and JSON leaves.
    url : str
        Destination.
    layouts : mapping or callable, optional
        Saving layouts; default: every tensor whole on rank 0.
    **options
        As for :func:`reshard.store.create`.
    """
    tensors, leaves = flatten(state)
    rule = layouts if layouts is not None else (lambda n, s: Layout.single(s))
    resolved = {n: resolve_layout(rule, n, tuple(np.shape(a))) for n, a in tensors.items()}
    writer = create(url, resolved, **single_process(options))
    for rank in _all_ranks(resolved):
        local: dict[str, Any] = dict(leaves)
        for name, lay in resolved.items():
            if rank in lay.ranks:
                local[name] = local_part(lay, rank, np.asarray(tensors[name]))
        writer.write(rank, local)
    writer.commit()
    return writer


def local_part(layout: Layout, rank: int, full: np.ndarray) -> np.ndarray:
    """``rank``'s local array of a whole array ``full`` (a flat range: its block's C-order flattening, sliced; a
    rank holding several blocks: them, each at its place in the local array)."""
    if isinstance(layout, FlatLayout):
        start, stop = layout.flat_range(rank)
        return np.ascontiguousarray(full[layout.block_of(rank)]).reshape(-1)[start:stop]
    if layout.multi_piece:  # several blocks: each in its part of the local array
        out = np.empty(layout.local_shape(rank), dtype=full.dtype)
        for glob, local in layout.pieces(rank):
            out[local] = full[glob]
        return out
    return full[(*layout.region(rank), ...)]


@gc_paused()
def save_pieces(pieces: Mapping[int, Mapping[str, Any]], url: str, layouts: LayoutSpec,
                **options: Any) -> CheckpointWriter:
    """Save ``{rank: local state dict}`` (each rank's own pieces) and commit."""
    writer = create(url, layouts, **single_process(options))
    for rank, local in pieces.items():
        writer.write(rank, local)
    writer.commit()
    return writer


@dataclass(frozen=True)
class CopyTask:
    """Read target shards' regions from a source and write them as shards of ``dst``."""

    source: graph.Source
    dst: str
    dst_options: Mapping[str, Any]
    items: tuple[tuple[ArrayMeta, ArrayMeta, tuple[int, ...]], ...]  # (source, target, shard index)
    budget: graph.BudgetRef
    packed: bool = False  # write the task's shards back to back into one data object
    durable: bool = True  # as the writer's storage (fsync, see Storage)


def copy_task(task: CopyTask) -> tuple[IOStats, dict[str, tuple[str, int, int]]]:
    """Task body of :func:`redivide`: its reads' and writes' counters, and where packed shards went."""
    ckpt = graph.open_source(task.source)
    storage = Storage(task.dst, dict(task.dst_options), durable=task.durable)
    ops = [graph.ReadOp(src, out.shard_region(idx)) for src, out, idx in task.items]
    located: dict[str, tuple[str, int, int]] = {}
    with graph.budget(task.budget).hold(sum(op.nbytes for op in ops)):
        arrays, stats = graph.read_ops(ckpt, ops)
        if task.packed:
            blobs = [(out.shard_key(idx), encode_shard(arr, out, idx)) for (_, out, idx), arr in zip(task.items, arrays,
                                                                                                 strict=True)]
            generation = task.dst.rstrip("/").rsplit("/", 1)[-1]
            where = packed.write_pack(storage, PACKED_DIR, uuid.uuid4().hex[:12], blobs, DEFAULT_OBJECT_BYTES)
            located = {k: (f"{generation}/{obj}", off, n) for k, (obj, off, n) in where.items()}
        else:
            pool.run_all([functools.partial(_write_shard, storage, out, idx, arr)
                          for (_, out, idx), arr in zip(task.items, arrays, strict=True)], storage.local)
    storage.sync()  # the commit (another storage, maybe another process) publishes these objects
    stats.add(**{k: v for k, v in storage.stats.as_dict().items() if k in ("writes", "bytes_written", "retries")})
    return stats, located


def _write_shard(storage: Storage, meta: ArrayMeta, idx: tuple[int, ...], data: np.ndarray) -> None:
    storage.write(meta.shard_key(idx), encode_shard(data, meta, idx))


def redivide(src: str | Checkpoint, dst: str, layouts: LayoutSpec, *, scheduler: Any = None,
             budget: int = graph.DEFAULT_BUDGET, fusion: int | str | None = None,
             fuse_bytes: int = graph.DEFAULT_FUSE_BYTES, gap: int | None = None, progress: bool | None = None,
             **options: Any) -> IOStats:
    """Write checkpoint ``src`` again at ``dst`` under new layouts, as one dask graph.

    Each target shard is read from ``src`` once (replicas are not read again)
    and written by one task; small shards are fused into tasks. At most
    ``budget`` bytes of shard data are in flight per process (a single shard
    larger than that is handled alone). Tensors a mapping of ``layouts`` does
    not name keep their saving layout.

    Parameters
    ----------
    src : str or Checkpoint
        The source checkpoint (``src_storage_options=`` in ``options`` for a URL).
    dst : str
        Where the new checkpoint goes.
    layouts : mapping or callable
        Target layouts.
    scheduler : None, "threads", "sync" or dask.distributed.Client
        Where the tasks run; on a cluster every worker must reach ``src`` and
        ``dst`` by URL.
    budget : int
        In-flight byte budget per process.
    fusion, fuse_bytes, gap, progress
        As for :func:`reshard.store.read.graph.load_many`.
    **options
        As for :func:`reshard.store.create` (shards are always written by
        reshard's own encoder).

    Returns
    -------
    IOStats
        Reads from ``src``, shards written to ``dst`` and tasks in the graph.
    """
    ref = graph.BudgetRef.new(budget)
    ckpt = src if isinstance(src, Checkpoint) else open(src, storage_options=options.pop("src_storage_options", None))
    targets = {}
    for name, meta in ckpt.arrays.items():
        if isinstance(layouts, Mapping) and name not in layouts:
            targets[name] = meta.layout
        else:
            targets[name] = ckpt._target(layouts, meta)
    writer = create(dst, targets, **single_process(options))
    metas = {n: writer.meta(n, targets[n], m.dtype, single_writer=True) for n, m in ckpt.arrays.items()}
    items = [(meta, metas[name], idx) for name, meta in ckpt.arrays.items()
             for idx in metas[name].shards_in(tuple(slice(0, n) for n in meta.shape))]
    cap = graph.fusion_cap(fusion)
    groups = graph.fuse(items, lambda it: math.prod(_extent(it[1], it[2])) * it[1].np_dtype.itemsize,
                        cap, min(fuse_bytes, budget))
    source = graph.source_of(ckpt, gap)
    options_dst = dict(getattr(writer.storage.fs, "storage_options", None) or {})
    dsk = {(f"reshard-redivide-{ref.token}", g): (copy_task, CopyTask(source, writer.storage.url, options_dst,
                                                                       tuple(group), ref, writer.form == "packed",
                                                                       writer.storage.durable))
           for g, group in enumerate(groups)}
    try:
        with graph.progress_bar(len(dsk), "redivide", progress) as bar:
            parts = graph.run(dsk, list(dsk), scheduler, bar)
    finally:
        graph.release(ref)
    stats = graph.total([p[0] for p in parts], len(dsk))
    ckpt.storage.count(**{k: v for k, v in stats.as_dict().items() if k not in ("writes", "bytes_written")})
    # the import's record of who saved it no longer describes layouts that changed (read.display.saved_by)
    same = all(targets[n] == m.layout for n, m in ckpt.arrays.items())
    leaves = {k: v for k, v in ckpt.leaves.items() if same or not k.startswith(SOURCE_LEAF)}
    writer.write_manifests(metas, leaves, {k: v for p in parts for k, v in p[1].items()})
    writer.commit()
    return stats


def convert(src: str | Checkpoint, dst: str, form: str, **options: Any) -> IOStats:
    """Write checkpoint ``src`` again at ``dst`` in storage form ``form``, same layouts (``reshard convert``).

    A :func:`redivide` that keeps every tensor's layout: ``"directory"`` for
    TensorStore (one object per shard), ``"packed"`` for O(ranks) objects. The
    chunk compression of ``src`` is kept. ``dst`` may be ``src`` itself with
    ``overwrite=True``: the converted save is a new generation, committed
    atomically, and the old one is left for ``reshard gc``. Also upgrades a
    format-version-1 checkpoint.

    Parameters
    ----------
    src : str or Checkpoint
        The checkpoint to convert (``src_storage_options=`` in ``options`` for a URL).
    dst : str
        Where the converted checkpoint goes.
    form : {"directory", "packed"}
        The storage form to write.
    **options
        As for :func:`redivide` (``overwrite``, ``storage_options``, ``scheduler``...).
    """
    check_form(form)
    ckpt = src if isinstance(src, Checkpoint) else open(src, storage_options=options.pop("src_storage_options", None))
    compressors = {m.compressor for m in ckpt.arrays.values()}
    options.setdefault("compression", compressors.pop() if len(compressors) == 1 else None)
    return redivide(ckpt, dst, {}, form=form, **options)


def _extent(meta: ArrayMeta, idx: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(r.stop - r.start for r in meta.shard_region(idx))
