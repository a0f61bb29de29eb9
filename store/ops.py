"""One-call operations built on the writer and the reader.

:func:`save` (single process, whole arrays), :func:`save_pieces` (single
process, per-rank pieces) and :func:`redivide` (checkpoint -> checkpoint under
new layouts, one target block in memory at a time).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from reshard.layouts import Layout

from . import pool
from .reader import Checkpoint, open
from .storage import IOStats
from .tree import LayoutSpec, flatten, resolve_layout
from .writer import CheckpointWriter, create, manifest_key


def _all_ranks(layouts: Mapping[str, Layout]) -> list[int]:
    return sorted(set().union(*(lay.ranks for lay in layouts.values()))) if layouts else [0]


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
    writer = create(url, resolved, **options)
    for rank in _all_ranks(resolved):
        local: dict[str, Any] = dict(leaves)
        for name, lay in resolved.items():
            if rank in lay.ranks:
                local[name] = np.asarray(tensors[name])[(*lay.region(rank), ...)]
        writer.write(rank, local)
    writer.commit()
    return writer


def save_pieces(pieces: Mapping[int, Mapping[str, Any]], url: str, layouts: LayoutSpec, **options: Any) -> CheckpointWriter:
    """Save ``{rank: local state dict}`` (each rank's own pieces) and commit."""
    writer = create(url, layouts, **options)
    for rank, local in pieces.items():
        writer.write(rank, local)
    writer.commit()
    return writer


def redivide(src: str | Checkpoint, dst: str, layouts: LayoutSpec, **options: Any) -> IOStats:
    """Write checkpoint ``src`` again at ``dst`` under new layouts.

    Each target block is read from ``src`` once (replicas are not read again)
    and written as the new shards; only one block per I/O thread is in memory.
    Tensors a mapping of ``layouts`` does not name keep their saving layout.

    Returns
    -------
    IOStats
        Counters of the reads from ``src``.
    """
    ckpt = src if isinstance(src, Checkpoint) else open(src, storage_options=options.pop("src_storage_options", None))
    before = ckpt.stats.snapshot()
    targets = {}
    for name, meta in ckpt.arrays.items():
        if isinstance(layouts, Mapping) and name not in layouts:
            targets[name] = meta.layout
        else:
            targets[name] = ckpt._target(layouts, meta)
    writer = create(dst, targets, **options)
    metas = {n: writer.meta(n, targets[n], m.dtype) for n, m in ckpt.arrays.items()}
    for name, meta in ckpt.arrays.items():
        for block in targets[name].blocks():  # one block at a time: bounded memory
            _copy_block(ckpt, writer, meta, metas[name], block.region)
    for rank in _all_ranks(targets):
        held = {n: m for n, m in metas.items() if rank in targets[n].ranks}
        doc = writer._manifest(rank, held, ckpt.leaves)
        writer.storage.write(manifest_key(rank), json.dumps(doc).encode())
    writer.commit()
    return ckpt.stats - before


def _copy_block(ckpt: Checkpoint, writer: CheckpointWriter, src: Any, out: Any, region: tuple[slice, ...]) -> None:
    dest = np.empty(tuple(r.stop - r.start for r in region), dtype=src.np_dtype)
    ckpt.read_regions([(src, region, dest)])
    pool.run_all(writer._shard_jobs(out, region, dest))
