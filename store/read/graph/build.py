"""Dask graphs over a checkpoint: lazy dask arrays, loading many ranks at once.

Also the task records and bodies that :func:`reshard.store.redivide` and
:func:`reshard.store.read.export.export` share (sources, reads, counters). How
tasks are grouped and run (I/O fusion, the in-flight byte budget, pluggable
schedulers, the progress bar) lives in :mod:`reshard.store.read.graph.schedule`; its
names are importable from here too. See ``docs/dask.md``.

Tasks carry only plain, picklable records (:class:`Source`: the URL, the
storage options, the engine and the read settings; :class:`ArrayMeta`;
regions), never an open :class:`Checkpoint` with its locks and filesystem
handles. A task re-opens the checkpoint from its :class:`Source` without any
metadata read (the records it carries say everything), so the same graph runs
on threads or on the processes of a ``dask.distributed`` cluster. Dask pickles
the graph to ship it to workers: that is the task transport, not the
checkpoint format, which stays JSON + zarr.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ...commit.locate import Locator, locator_for
from ...format.meta import ArrayMeta
from ...format.tree import LayoutSpec, unflatten
from ...io.progress import progress_bar
from ...io.stats import IOStats
from ...io.storage import Storage
from ..fetch import Boxes, Fetcher, Parts, target_region
from .schedule import (
    DEFAULT_FUSE_BYTES,
    fuse,
    fusion_cap,
    run,
)

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint, LazyTensor

__all__ = [
    # tasks, reads, dask arrays, load_many
    "LoadResult", "ReadOp", "ReadTask", "Source", "chunk_step", "count_home", "load_many", "open_source",
    "read_block", "read_ops", "read_task", "source_of", "to_dask", "total",
]

Region = tuple[slice, ...]


# ----------------------------------------------------------------- sources
@dataclass(frozen=True, eq=False)
class Source:
    """How a task reaches a checkpoint: plain, picklable data.

    ``token`` names one open :class:`Checkpoint`: tasks of the same token in one
    process share its cache of shard indexes (in the caller's process, the
    open checkpoint's own cache, whose counters also receive the tasks' reads).
    Credentials in ``storage_options`` travel inside the graph to the workers;
    on a cluster prefer credentials from the workers' environment.
    """

    url: str
    storage_options: Mapping[str, Any]
    engine: str
    gap: int
    retries: int
    token: str
    small_shard_bytes: int | None = None
    #: Packed form: the checkpoint root (shard locations are relative to it); None for the directory form.
    root: str | None = None
    #: Packed form: how shards are located (:func:`reshard.store.commit.locate.locator_for`), and the save's id.
    locations: str | None = None
    save_id: str | None = None
    generation: str = ""


_opened: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()  # token -> open checkpoint
_indexes: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()  # token -> index cache, in workers
_locators: OrderedDict[str, Locator] = OrderedDict()  # token -> packed shard locations, in workers
_lock = threading.Lock()


def _renew_lock() -> None:  # a forked child gets a fresh lock (a parent thread may have held it at the fork)
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_renew_lock)


def source_of(ckpt: Checkpoint, gap: int | None = None) -> Source:
    """The :class:`Source` of an open checkpoint (``gap`` overrides its coalescing gap)."""
    with _lock:
        token = vars(ckpt).setdefault("_graph_token", uuid.uuid4().hex)
        _opened[token] = ckpt
    fetcher = ckpt.fetcher
    storage = fetcher.storage
    options = dict(getattr(storage.fs, "storage_options", None) or {})
    locator = fetcher.locator
    return Source(storage.url, options, fetcher.engine, fetcher.gap if gap is None else int(gap),
                  storage.retries, token, fetcher.small_shard_bytes,
                  None if locator is None else fetcher.root.url, None if locator is None else locator.kind,
                  ckpt.save_id, getattr(locator, "generation", ""))


def open_source(source: Source) -> Fetcher:
    """A private :class:`Fetcher` for one task: its own counters, a shared index cache.

    No metadata is read: tasks carry the :class:`ArrayMeta` of what they read.
    """
    storage = Storage(source.url, dict(source.storage_options), retries=source.retries)
    home = _opened.get(source.token)
    root = Storage(source.root, dict(source.storage_options), retries=source.retries) if source.root else None
    with _lock:
        if home is not None:
            indexes, locator = home.fetcher.indexes, home.fetcher.locator
        else:  # a worker process: a small LRU of index caches (and shard locations), one per checkpoint
            cache = _indexes.pop(source.token, None)
            indexes = _indexes[source.token] = cache if cache is not None else {}
            while len(_indexes) > 16:
                _indexes.popitem(last=False)
            locator = _locators.get(source.token)
            if locator is None and source.locations is not None:
                locator = _locators[source.token] = locator_for(storage, source.locations, source.save_id,
                                                                      source.generation)
                while len(_locators) > 16:
                    _locators.popitem(last=False)
    fetcher = Fetcher(storage, source.engine, source.gap, indexes, locator=locator, root=root)
    if root is not None:  # one counter for the task's reads, through either storage
        root.stats = storage.stats
    if source.small_shard_bytes is not None:
        fetcher.small_shard_bytes = source.small_shard_bytes
    return fetcher


def count_home(source: Source, stats: IOStats) -> None:
    """Add a task's counters to the caller's open checkpoint, if it lives in this process."""
    home = _opened.get(source.token)
    if home is not None:
        home.storage.count(**stats.as_dict())


def total(parts: Iterable[IOStats], tasks: int) -> IOStats:
    """Sum of task counters; ``tasks`` is the number of tasks in the graph."""
    out = IOStats()
    for p in parts:
        out.add(**p.as_dict())
    out.tasks = tasks
    return out


# ------------------------------------------------------------------- reads
@dataclass(frozen=True)
class ReadOp:
    """One region of one stored tensor to read."""

    meta: ArrayMeta
    region: Region

    @property
    def shape(self) -> tuple[int, ...]:
        if isinstance(self.region, Boxes):  # a flat range: one 1-d array
            return (self.region.size,)
        if isinstance(self.region, Parts):  # several blocks: the local array they tile
            return self.region.shape
        return tuple(r.stop - r.start for r in self.region)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.meta.np_dtype.itemsize


@dataclass(frozen=True)
class ReadTask:
    """A fused task: several regions read with one ``read_regions`` call."""

    source: Source
    ops: tuple[ReadOp, ...]
    shape: tuple[int, ...] | None = None  # to_dask: the block's shape with dropped dims removed


def read_ops(ckpt: Checkpoint | Fetcher, ops: Sequence[ReadOp]) -> tuple[list[np.ndarray], IOStats]:
    """Read regions into new arrays through the reader's single I/O path."""
    dests = [np.empty(op.shape, dtype=op.meta.np_dtype) for op in ops]
    stats = ckpt.read_regions([(op.meta, op.region, d) for op, d in zip(ops, dests, strict=True)])
    return dests, stats


def read_task(task: ReadTask) -> tuple[list[np.ndarray], IOStats]:
    """Task body of :func:`load_many`: the arrays and this task's counters."""
    return read_ops(open_source(task.source), task.ops)


def read_block(task: ReadTask) -> np.ndarray:
    """Task body of :func:`to_dask`: one dask chunk (counted onto the caller's checkpoint)."""
    (dest,), stats = read_ops(open_source(task.source), task.ops)
    stats.tasks = 1
    count_home(task.source, stats)
    return dest.reshape(task.shape if task.shape is not None else dest.shape)


# ----------------------------------------------------------------- to_dask
def chunk_step(meta: ArrayMeta, chunks: Any, ndim: int, keep: tuple[bool, ...]) -> tuple[int, ...]:
    """Dask chunk extent per stored dim: the inner chunk times a multiple."""
    if not meta.shape:
        return ()
    if chunks is None:
        return meta.chunk
    if chunks == "shard":
        return meta.shard
    if chunks == "auto":
        import dask
        from dask.utils import parse_bytes

        target = parse_bytes(dask.config.get("array.chunk-size"))
        size, step = meta.np_dtype.itemsize * math.prod(meta.chunk), list(meta.chunk)
        for d in reversed(range(len(step))):  # trailing dims first: blocks stay C-contiguous runs
            m = max(1, min(meta.chunks_per_shard[d], target // max(1, size)))
            step[d] *= m
            size *= m
        return tuple(step)
    multiples = (chunks,) * ndim if isinstance(chunks, int) else tuple(chunks)
    if len(multiples) != ndim or not all(isinstance(m, int) and m >= 1 for m in multiples):
        raise ValueError(f"chunks must be None, 'auto', 'shard', a positive int or {ndim} positive ints "
                         f"(multiples of the stored chunk {meta.chunk}), got {chunks!r}")
    it = iter(multiples)
    return tuple(c * next(it) if k else c for c, k in zip(meta.chunk, keep, strict=True))


def _cuts(r: slice, step: int) -> list[tuple[int, int]]:
    if r.stop <= r.start:
        return [(r.start, r.start)]
    bounds = [r.start, *range((r.start // step + 1) * step, r.stop, step), r.stop]
    return list(itertools.pairwise(bounds))


def _cuts_at(r: slice, bounds: tuple[int, ...]) -> list[tuple[int, int]]:
    if r.stop <= r.start:
        return [(r.start, r.start)]
    return list(itertools.pairwise([r.start, *(b for b in bounds if r.start < b < r.stop), r.stop]))


def to_dask(tensor: LazyTensor, chunks: Any = None) -> Any:
    """A lazy ``dask.array.Array`` over a stored tensor or a view of it.

    Parameters
    ----------
    tensor : LazyTensor
        A tensor of an open checkpoint, possibly sliced (``ckpt["w"][10:20, 3]``).
    chunks : None, "auto", "shard", int or tuple of int
        ``None``: the stored inner chunks (the read unit; edge blocks of a view
        are cut at the view's bounds). An int ``m`` (or one per dim of the
        view): ``m`` inner chunks per dask chunk along each dim. ``"shard"``:
        one dask chunk per stored shard. ``"auto"``: inner chunks grouped, within
        a shard, up to dask's ``array.chunk-size``.

    Each block is read through ``Checkpoint.read_regions`` by its own task,
    which carries the checkpoint's URL and the tensor's record, so the array
    computes on threads or on a dask.distributed cluster.
    """
    import dask.array as da
    from dask.base import tokenize

    meta, region, keep = tensor.meta, tensor.region, tensor.keep
    step = chunk_step(meta, chunks, tensor.ndim, keep)
    source = source_of(tensor.ckpt)
    if chunks == "shard" and meta.edges is not None:  # a rectilinear grid: its own shard bounds
        cuts = [_cuts_at(r, b) for r, b in zip(region, meta.chunk_grid.bounds, strict=True)]
    else:
        cuts = [_cuts(r, s) for r, s in zip(region, step, strict=True)]
    name = f"reshard-{meta.name}-{tokenize(source.token, meta.name, region, keep, step)}"
    dsk: dict[Any, Any] = {}
    for idx in np.ndindex(*(len(c) for c in cuts)):
        block = tuple(slice(*cuts[d][i]) for d, i in enumerate(idx))
        shape = tuple(b.stop - b.start for b, k in zip(block, keep, strict=True) if k)
        key = (name, *(i for i, k in zip(idx, keep, strict=True) if k))
        dsk[key] = (read_block, ReadTask(source, (ReadOp(meta, block),), shape))
    out_chunks = tuple(tuple(b - a for a, b in c) for c, k in zip(cuts, keep, strict=True) if k)
    return da.Array(dsk, name, out_chunks, dtype=meta.np_dtype)


# --------------------------------------------------------------- load_many
class LoadResult(dict[int, dict[str, Any]]):
    """``{rank: nested state dict}`` with the counters of the load as ``.stats``."""

    def __init__(self, data: Mapping[int, dict[str, Any]], stats: IOStats) -> None:
        super().__init__(data)
        self.stats = stats


@dataclass
class _Plan:
    ops: list[ReadOp] = field(default_factory=list)
    owners: list[tuple[str, list[int]]] = field(default_factory=list)


def load_many(ckpt: Checkpoint, layouts: LayoutSpec, ranks: Iterable[int], *, names: Any = None,
              scheduler: Any = None, fusion: int | str | None = None, fuse_bytes: int = DEFAULT_FUSE_BYTES,
              gap: int | None = None, progress: bool | None = None) -> LoadResult:
    """Load the pieces of many target ranks at once, as one dask graph.

    Parameters
    ----------
    ckpt : Checkpoint
        The open checkpoint.
    layouts : mapping or callable
        Target layouts, as for ``Checkpoint.load``.
    ranks : iterable of int
        Target ranks to load.
    names : iterable of str, optional
        Restrict to these tensors.
    scheduler : None, "threads", "sync" or dask.distributed.Client
        Where the graph runs; on a cluster the workers re-open the checkpoint
        by URL and the arrays come back to this process.
    fusion : int or str, optional
        Fusion cap (see :func:`fusion_cap`; default from ``RESHARD_FUSION``).
        On: a region held by several of ``ranks`` (replicas) is read once and
        the same array is given to each of them; small regions are fused into
        tasks of up to ``fusion`` regions and ``fuse_bytes`` bytes. Off: one
        task per tensor and rank.
    fuse_bytes : int
        Byte cap of one fused task.
    gap : int, optional
        Coalescing gap (bytes) between chunk reads of one shard; default the
        checkpoint's.
    progress : bool, optional
        A progress bar; default: on a terminal or in a notebook (:mod:`reshard.store.io.progress`).

    Returns
    -------
    LoadResult
        ``{rank: nested dict}``, each equal to ``ckpt.load(layouts, rank)``.
        Replicas share one array (copy before writing into it). ``.stats``:
        requests, bytes fetched and delivered, tasks in the graph.
    """
    cap = fusion_cap(fusion)
    ranks = list(dict.fromkeys(int(r) for r in ranks))
    local: dict[int, dict[str, Any]] = {r: dict(ckpt.leaves) for r in ranks}
    plan = _plan_loads(ckpt, layouts, ranks, names, cap > 0, local)
    groups = fuse(list(range(len(plan.ops))), lambda i: plan.ops[i].nbytes, cap, fuse_bytes)
    source = source_of(ckpt, gap)
    prefix = f"reshard-load-{uuid.uuid4().hex}"
    dsk = {(prefix, g): (read_task, ReadTask(source, tuple(plan.ops[i] for i in group)))
           for g, group in enumerate(groups)}
    keys = list(dsk)
    with progress_bar(len(keys), "load", progress) as bar:
        results = run(dsk, keys, scheduler, bar)
    for group, (arrays, _) in zip(groups, results, strict=True):
        for i, arr in zip(group, arrays, strict=True):
            name, owners = plan.owners[i]
            for r in owners:
                local[r][name] = arr
    stats = total((s for _, s in results), len(keys))
    ckpt.storage.count(**stats.as_dict())
    ckpt.last_stats = stats
    return LoadResult({r: unflatten(local[r]) for r in ranks}, stats)


def _plan_loads(ckpt: Checkpoint, layouts: LayoutSpec, ranks: list[int], names: Any, reuse: bool,
                local: dict[int, dict[str, Any]]) -> _Plan:
    """One read per distinct region (``reuse``) or per rank; empty regions need no read."""
    plan = _Plan()
    for name, meta in ckpt._select(layouts, names):
        layout = ckpt._target(layouts, meta)
        members = set(layout.ranks)
        by_region: dict[Any, tuple[Region, list[int]]] = {}
        for r in ranks:
            if r not in members:
                continue
            region = target_region(layout, r)
            key = (region.key() if isinstance(region, (Boxes, Parts)) else tuple((s.start, s.stop) for s in region)) \
                if reuse else r
            by_region.setdefault(key, (region, []))[1].append(r)
        for region, owners in by_region.values():
            op = ReadOp(meta, region)
            if op.shape and math.prod(op.shape) == 0:
                for r in owners:
                    local[r][name] = np.empty(op.shape, dtype=meta.np_dtype)
                continue
            plan.ops.append(op)
            plan.owners.append((name, owners))
    return plan
