"""``verify``'s data pass: every stored chunk read and crc32c-checked, in bounded memory.

Small tensors are read in batches (thousands of tiny tensors: a read call each
costs more than their bytes), bounded by shards so that a batch's read plans stay
small; a large tensor in slabs along its first dimension. The shard indexes read
are dropped after each batch. A batch that fails is checked again tensor by
tensor, so each problem names its tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from reshard.layouts.errors import ChecksumError, ReshardError

from ..format.meta import ArrayMeta
from ..read.checkpoint import Checkpoint

if TYPE_CHECKING:
    from .damage import VerifyReport

#: Bytes of one tensor read at a time (bounded memory).
SLAB_BYTES = 32 << 20


def check_data(ckpt: Checkpoint, report: VerifyReport, progress: Callable[[int], None] | None) -> None:
    """Read every chunk of every tensor of ``ckpt`` (indexes too), reporting damage in ``report``."""
    ckpt.fetcher.read_indexes = True  # every shard's index too, not only its chunks
    batch: list[ArrayMeta] = []
    held = shards = 0
    for meta in ckpt.arrays.values():
        n = math.prod(meta.grid)
        if meta.nbytes >= SLAB_BYTES or n >= BATCH_SHARDS:
            _check_tensors(ckpt, [meta], report, progress)
            continue
        if batch and (held + meta.nbytes > SLAB_BYTES or shards + n > BATCH_SHARDS):
            _check_tensors(ckpt, batch, report, progress)
            batch, held, shards = [], 0, 0
        batch.append(meta)
        held += meta.nbytes
        shards += n
    if batch:
        _check_tensors(ckpt, batch, report, progress)


#: Shards of small tensors read and checked in one batch (thousands of tiny tensors: a call each cost more
#: than their bytes; a read holds a few hundred bytes of plans per shard until it returns).
BATCH_SHARDS = 4096


def _check_tensors(ckpt: Checkpoint, metas: list[ArrayMeta], report: VerifyReport,
                   progress: Callable[[int], None] | None) -> None:
    """Read and check tensors: small ones together (each whole), a large one in slabs; a batch that fails is
    checked again tensor by tensor, so that each problem names its tensor. The shard indexes read are
    dropped after: memory stays that of a batch, not of every shard."""
    try:
        _check_batch(ckpt, metas, report, progress)
    finally:
        ckpt.fetcher.indexes.clear()


def _check_batch(ckpt: Checkpoint, metas: list[ArrayMeta], report: VerifyReport,
                 progress: Callable[[int], None] | None) -> None:
    if len(metas) > 1:
        try:
            dests = [(meta, tuple(slice(0, n) for n in meta.shape), np.empty(meta.shape, dtype=meta.np_dtype))
                     for meta in metas]
            ckpt.read_regions(dests)
        except (ReshardError, OSError):
            for meta in metas:
                _check_tensors(ckpt, [meta], report, progress)
            return
        for meta, _, dest in dests:
            if progress is not None:
                progress(dest.nbytes)
            _checked(report, meta)
        return
    meta = metas[0]
    name = meta.name
    try:
        for region in _slabs(meta):
            dest = np.empty(tuple(r.stop - r.start for r in region), dtype=meta.np_dtype)
            ckpt.read_regions([(meta, region, dest)])
            if progress is not None:
                progress(dest.nbytes)
        _checked(report, meta)
    except ChecksumError as e:
        report.add("checksum", f"tensor {name!r}", e)
    except (ReshardError, OSError) as e:
        kind = "replaced" if type(e).__name__ == "CheckpointReplacedError" else "shard"
        report.add(kind, f"tensor {name!r}", e)


def _checked(report: VerifyReport, meta: ArrayMeta) -> None:
    report.bytes_checked += meta.nbytes
    report.chunks_checked += math.prod(-(-n // c) for n, c in zip(meta.shape, meta.chunk, strict=True))


def _slabs(meta: ArrayMeta) -> list[tuple[slice, ...]]:
    """Regions of at most about :data:`SLAB_BYTES` along dim 0 (whole chunks) covering a tensor."""
    if not meta.shape:
        return [()]
    rest = tuple(slice(0, n) for n in meta.shape[1:])
    row = meta.np_dtype.itemsize * math.prod(meta.shape[1:])
    step = max(1, SLAB_BYTES // max(row, 1))
    if step >= meta.chunk[0]:
        step -= step % meta.chunk[0]
    return [(slice(i, min(i + step, meta.shape[0])), *rest) for i in range(0, meta.shape[0], step)]
