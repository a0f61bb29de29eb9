"""Writing a checkpoint: per-rank writes with no communication, then one commit.

Protocol (docs/format.md has the full story):

1. Every rank's process calls :func:`create` with the same arguments and
   :meth:`CheckpointWriter.write` with its own rank. A rank writes the shards
   it writes of the blocks it holds (a block held by R replicas is cut into
   R sub-shards, one per replica: :func:`reshard.store.format.grid.balanced_grid`;
   directory form: one object each;
   packed form: back to back in one data object), then its manifest
   ``.reshard/ranks/<rank>.json`` (what it holds, with dtypes and layouts, and
   in the packed form where each shard's bytes went).
2. Once all have written, any one process calls :meth:`CheckpointWriter.commit`
   (or :func:`commit` with just the URL). It takes the commit lock with a
   create-if-absent write, checks every expected rank's manifest is there and
   that they agree, writes every array's ``zarr.json`` and the root ``zarr.json``
   with consolidated metadata (packed form: one references file holding them
   and every shard's location instead), and finally the commit marker.

Nothing is renamed (object stores cannot) and readers trust only the marker.
"""

from __future__ import annotations

import functools
import math
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
from reshard.layouts import Layout, all_ranks
from reshard.layouts.errors import (
    CheckpointExistsError,
    FormatError,
    LayoutError,
    ShapeMismatchError,
)

from ..commit.fence import MANIFEST_FIELD, manifest_token
from ..commit.locks import Lease
from ..commit.marker import Marker, generation_of, read_marker, save_id_of
from ..commit.protocol import commit
from ..format.dtypes import dtype_name
from ..format.encode import encode_shard
from ..format.manifests import has_written, manifest_key, rank_manifest, read_manifest
from ..format.meta import DEFAULT_CHUNK_BYTES, ArrayMeta, tensor_path
from ..format.refs import DEFAULT_OBJECT_BYTES, PACKED_DIR, check_form
from ..format.schema import check_names, with_digest
from ..format.table import rank_trailer, shard_table
from ..format.tree import LayoutSpec, flatten, json_leaves, resolve_layout
from ..io import packed, pool, progress
from ..io.gcpause import gc_paused
from ..io.storage import Storage
from .incremental import Base, Reusable, digest
from .plan import Settings, TensorPlan, block_shards, take, tensor_plan

#: Block writers (importers, redivide), packed form: bytes held before they go out as one data object.
BUFFER_BYTES = 256 << 20


class CheckpointWriter:
    """Writes one checkpoint; see :func:`create`."""

    def __init__(
        self,
        url: str,
        layouts: LayoutSpec,
        *,
        shapes: Mapping[str, tuple[int, ...]] | None = None,
        overwrite: bool = False,
        compression: str | None = None,
        checksums: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        save_id: str | int | None = None,
        storage_options: dict[str, Any] | None = None,
        engine: str = "fast",
        grid: str = "auto",
        form: str | None = None,
        object_bytes: int = DEFAULT_OBJECT_BYTES,
        buffer_bytes: int = BUFFER_BYTES,
        base: str | None = None,
        durable: bool = True,
        balance: bool = True,
        fence: int | None = None,
    ) -> None:
        if engine not in ("fast", "tensorstore"):
            raise ValueError(f"writer engine must be 'fast' or 'tensorstore', got {engine!r}")
        if grid not in ("auto", "exact", "regular"):
            raise ValueError(f"grid must be 'auto', 'exact' or 'regular', got {grid!r}")
        if grid == "exact" and engine == "tensorstore":
            raise ValueError("grid='exact' needs engine='fast': TensorStore cannot write rectilinear chunk grids")
        self.engine = engine
        #: How irregular layouts are sharded: ``"exact"`` (rectilinear, one shard per block) or ``"regular"``.
        self.grid = ("regular" if engine == "tensorstore" else "exact") if grid == "auto" else grid
        #: The storage form: ``"packed"`` (per-rank data objects + references) or ``"directory"``.
        if form is None:
            form = "packed" if base is not None else DEFAULT_FORM if engine == "fast" else "directory"
        self.form = check_form(form)
        if base is not None and self.form != "packed":
            raise ValueError("an incremental save (base=...) is written in the packed form (form='packed')")
        if self.form == "packed" and engine == "tensorstore":
            raise ValueError("the tensorstore writer engine writes the directory form only (form='directory')")
        #: Packed form: a writer's data goes on in a new object once one holds this many bytes.
        self.object_bytes = int(object_bytes)
        #: Packed form, block writers: shards held in memory before they go out as one object.
        self.buffer_bytes = min(int(buffer_bytes), self.object_bytes)
        #: Packed form, block writers: shards written by write_block, not yet in an object.
        self._pending: list[tuple[str, list[Any], str]] = []
        self._unwritten: dict[str, int] = {}  # write_block's tensors: elements still to come (progress)
        self._pending_bytes = 0
        #: Packed form, block writers: where write_block's shards went, and their hashes.
        self._located: dict[str, Any] = {}
        self._json_manifests = False
        self._hashes: dict[str, str] = {}
        if compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', got {compression!r}")
        self.root = Storage(url, storage_options, durable=durable)
        #: Incremental saves: the earlier save whose unchanged shards are referenced, not rewritten.
        self.base = Base(base, self.root.url, storage_options) if base is not None else None
        self.save_id = save_id_of(save_id)
        #: Where this save's objects go: the generation's folder under the root.
        self.generation = generation_of(self.save_id)
        self.storage = self.root.child(self.generation)
        #: Tells ``gc`` this save is live (one small object per generation, renewed by later writes).
        self._lease = Lease(self.root, self.generation)
        self.layouts = layouts
        self.shapes = dict(shapes or {})
        self.compression = compression
        self.checksums = checksums
        self.chunk_bytes = int(chunk_bytes)
        #: What array records depend on, for many writers (index: single_writer).
        #: Whether a replicated block is cut among its holders (:func:`reshard.store.format.grid.balanced_grid`).
        self.balance = bool(balance)
        #: The fencing token of the job writing (a manager's saves; :mod:`reshard.store.commit.fence`), recorded in
        #: every manifest this writer writes; None outside a manager.
        self.fence = fence
        self._settings = tuple(Settings(self.grid, self.chunk_bytes, checksums, compression, single, self.balance)
                               for single in (False, True))
        self._written: set[int] = set()
        #: ``{name: (manifest record, array record)}`` of this process's writes: the commit need not parse them again
        self._known: dict[str, tuple[dict[str, Any], ArrayMeta]] = {}
        self.check_names(self.names())
        self._checked = set(self.names())  # names checked together (a write passing only these needs no check)
        current = read_marker(self.root)
        if current is not None:
            committed = current[0]
            if not overwrite:
                raise CheckpointExistsError(
                    f"{self.root.url} already holds a committed checkpoint (save_id {committed.save_id!r}); "
                    "pass overwrite=True (with a new save_id) to replace it")
            if committed.save_id == self.save_id and committed.format_version >= 2:
                raise CheckpointExistsError(
                    f"{self.root.url}: save_id {self.save_id!r} is the committed save; overwriting needs a new "
                    "save_id shared by every rank (e.g. the training step), so that a crashed overwrite "
                    "leaves the committed checkpoint readable")

    def __repr__(self) -> str:
        return f"CheckpointWriter({self.storage.url!r})"

    @property
    def url(self) -> str:
        return self.root.url

    def check_names(self, names: Any) -> None:
        """Refuse names the format cannot hold (one a prefix of another, a component too long), naming them.

        Called at :func:`create` for the names the layouts give and at every
        ``write`` for the names passed: before the first byte is written.
        """
        names = list(names)
        check_names(names, {n: tensor_path(n) for n in names}, self.root.url)

    def layout(self, name: str, shape: tuple[int, ...] | None = None) -> Layout:
        """The saving layout of tensor ``name``."""
        return resolve_layout(self.layouts, name, self.shapes.get(name, shape))

    def plan(self, name: str, layout: Layout, dtype: str, single_writer: bool = False) -> TensorPlan:
        """How a tensor is stored, and what each rank writes of it (cached per process: :mod:`..writeplan`)."""
        return tensor_plan(name, layout, dtype, self._settings[single_writer])

    def meta(self, name: str, layout: Layout, dtype: str, single_writer: bool = False) -> ArrayMeta:
        """The array record a tensor will be stored with (:func:`reshard.store.write.plan.array_meta`).

        ``single_writer``: one process writes every shard of the tensor (see
        :func:`reshard.store.format.grid.choose_grid`). The shard grid is
        recorded in the manifests.
        """
        meta = self.plan(name, layout, dtype, single_writer).meta
        if name not in self._unwritten:
            self._unwritten[name] = math.prod(meta.shape)
            progress.expect(meta.nbytes, tensors=1)
        return meta

    # -------------------------------------------------------------- write
    @gc_paused()
    def write(self, rank: int, state: Mapping[str, Any]) -> None:
        """Write one rank's local pieces (and its non-tensor leaves).

        Parameters
        ----------
        rank : int
            The global rank whose pieces ``state`` holds.
        state : mapping
            Nested or dotted ``{name: local array or JSON leaf}``; each array has
            the shape ``layout.local_shape(rank)``.

        Everything is validated before the first byte is written.
        """
        tensors, leaves = flatten(state, self.layouts if isinstance(self.layouts, Mapping) else self.shapes)
        if not self._checked.issuperset(tensors):
            self.check_names({*tensors, *self.names()})
            self._checked.update(tensors)
        plans: dict[str, TensorPlan] = {}
        for name, value in tensors.items():
            arr = tensors[name] = np.asarray(value)
            plan = plans[name] = self.plan(name, self.layout(name), dtype_name(arr.dtype))
            want = plan.at(rank).local_shape
            if arr.shape != want:
                raise ShapeMismatchError(
                    f"tensor {name!r} on rank {rank}: local shape {tuple(arr.shape)}, "
                    f"layout {plan.meta.layout.describe()} expects {tuple(want)}"
                )
        missing = [n for n in self.names() if n not in tensors and self.layout(n).has_rank(rank)]
        if missing:
            raise LayoutError(f"rank {rank} holds {missing} by its layouts but did not pass them")
        self._check_not_written(rank)
        self._lease.renew(check=True)  # after that check: a save_id gc collected is refused, never reused
        metas = {n: p.meta for n, p in plans.items()}
        manifest = rank_manifest(rank, self.save_id, metas, leaves, {n: p.record for n, p in plans.items()})
        if self.fence is not None:
            manifest[MANIFEST_FIELD] = self.fence
        self._known.update((n, (p.record, p.meta)) for n, p in plans.items())
        mine = [(p, tensors[n]) for n, p in sorted(plans.items(), key=_geometry) if p.at(rank).writes]
        if self.form == "packed":  # one object: the shards back to back, then the manifest
            reuse = self.base.for_rank(rank) if self.base is not None else Reusable()
            order = [(p.meta, idx, take(arr, within), how) for p, arr in mine
                     for idx, within, how in p.at(rank).shards]
            blobs = self._encode(order, reuse)
            found = {key: reuse.find(key, sha) for key, parts, sha in blobs if parts is None}
            fresh = [(key, parts) for key, parts, _ in blobs if parts is not None]
            objects, where = packed.plan_pack(f"{self.generation}/{PACKED_DIR}", str(rank), fresh, self.object_bytes)
            # the trailer: this rank's layout groups' records if it carries them, its shard table, its manifest
            texts = {n: (plans[n].text, plans[n].meta.layout) for n in manifest.pop("tensors")}
            table = shard_table({n: (plans[n].meta, texts[n][0]) for n in texts},
                                [(m, idx) for m, idx, _, _ in order],
                                {**where, **{k: v for k, v in found.items() if v is not None}},
                                {key: sha for key, _, sha in blobs})
            packed.write_objects(self.root, objects, rank_trailer(rank, manifest, texts, table))
        else:
            pool.run_all([job for p, arr in mine for job in self._shard_jobs(p.meta, p.at(rank).region, arr,
                                                                                 p.at(rank).shards)],
                         self.storage.local)
            self.storage.write_atomic(manifest_key(rank), with_digest(manifest))
        self._written.add(rank)

    def _check_not_written(self, rank: int) -> None:
        """Refuse a rank whose manifest an earlier, uncommitted attempt of this save left behind.

        Its other ranks' manifests may be there too: committing would mix two attempts. A writer with a
        fencing token overwrites what a rank of another (superseded) job left: its committer refuses that
        job's manifests anyway (:func:`reshard.store.commit.fence.check_one_job`).
        """
        if rank not in self._written and has_written(self.storage, rank, self.form) \
                and not self._left_by_another_job(rank):
            raise CheckpointExistsError(
                f"{self.root.url}: rank {rank} already wrote save_id {self.save_id!r} (an earlier attempt that "
                "was not committed?). Save under a new save_id; `reshard gc "
                f"{self.root.url} --min-age 0` removes the attempt (its save_id is then never used again here)")

    def _left_by_another_job(self, rank: int) -> bool:
        """Whether ``rank``'s manifest here was left by an older job (a lower fencing token than this writer's,
        or none): this job's write replaces it. A newer job's is never replaced."""
        if self.fence is None:
            return False
        try:
            found = read_manifest(self.storage, rank, self.form, tensors=False)
        except (FileNotFoundError, FormatError):  # gone meanwhile, or a torn leftover
            return True
        token = manifest_token(found)
        return token is None or token < self.fence

    @gc_paused()
    def write_block(self, meta: ArrayMeta, region: tuple[slice, ...], data: np.ndarray) -> None:
        """Write the shards of one block of a tensor (``data`` holds the block's values).

        For single-process writers that hold blocks rather than ranks' state
        dicts (importers, :func:`reshard.store.redivide`); the caller writes each
        block once, then calls :meth:`write_manifests` and :meth:`commit`.
        In the packed form the shards are held until ``buffer_bytes`` of them
        are pending (then written as one data object) or :meth:`write_manifests`:
        a block writer's memory and object size. They may be views of ``data``:
        the caller leaves it unchanged until then (importers pass each block's own array).
        """
        self._lease.renew()
        self._report(meta, data)
        if self.form == "directory":
            pool.run_all(self._shard_jobs(meta, region, data), self.storage.local)
            return
        blobs = self._encode(self._shards(meta, region, data))
        self._pending += blobs
        self._pending_bytes += sum(memoryview(p).nbytes for _, parts, _ in blobs for p in parts)
        if self._pending_bytes >= self.buffer_bytes:
            self.flush()

    def _report(self, meta: ArrayMeta, data: np.ndarray) -> None:
        """Progress of the command writing (:func:`reshard.store.io.progress.tracking`): bytes, and finished tensors."""
        left = self._unwritten[meta.name] = self._unwritten.get(meta.name, 0) - data.size
        progress.advance(data.nbytes, tensors=int(left == 0))

    def flush(self) -> dict[str, Any]:
        """Packed form: write the shards :meth:`write_block` holds as one data object.

        Returns where every shard this writer wrote went, ``{shard key: [object,
        offset, length]}``: what another process's :meth:`write_manifests` takes
        as ``located`` (a DCP plugin's ranks write, its coordinator commits).
        """
        if self._pending:
            self._located.update(self._pack(uuid.uuid4().hex[:12], self._pending))
            self._hashes.update((key, sha) for key, _, sha in self._pending)
        self._pending, self._pending_bytes = [], 0
        return dict(self._located)

    def write_manifests(self, metas: Mapping[str, ArrayMeta], leaves: Mapping[str, Any],
                        located: Mapping[str, Any] | None = None) -> None:
        """Write the manifest of every rank of ``metas``' layouts (after :meth:`write_block`).

        ``located``: packed shards written elsewhere (redivide's tasks), ``{shard key:
        (object, offset, length)}``; they and :meth:`write_block`'s go into the first rank's manifest.
        """
        self.flush()
        self._json_manifests = True
        records = {**self._located, **(located or {})}
        hashes = {k: v for k, v in self._hashes.items() if k in records}
        ranks = sorted(all_ranks(m.layout for m in metas.values())) or [0]
        stored = json_leaves(leaves)
        for rank in ranks:
            held = {n: m for n, m in metas.items() if m.layout.has_rank(rank)}
            manifest = rank_manifest(rank, self.save_id, held, stored)
            if self.form == "packed":
                manifest["packed"] = records if rank == ranks[0] else {}
                manifest["hashes"] = hashes if rank == ranks[0] else {}
            self.storage.write_atomic(manifest_key(rank), with_digest(manifest))

    def _shards(self, meta: ArrayMeta, region: tuple[slice, ...], local: np.ndarray
                ) -> list[tuple[ArrayMeta, tuple[int, ...], np.ndarray, bytes]]:
        """The shards of a block: (record, grid index, the shard's part of ``local``, its encoding) each."""
        return [(meta, idx, local[within], how) for idx, within, how in block_shards(meta, region)]

    def _shard_jobs(self, meta: ArrayMeta, region: tuple[slice, ...] | None, local: np.ndarray,
                    shards: tuple[Any, ...] | None = None) -> list[Any]:
        """Jobs writing the shards of a block (``shards``: only these, as :meth:`TensorPlan.at` gives them;
        a flat range has no one ``region``: its shards are given)."""
        if shards is None:
            assert region is not None
            shards = block_shards(meta, region)
        if self.engine == "tensorstore" and meta.shape:
            from ..format.engines import write_with_tensorstore

            if region is not None and len(shards) == len(block_shards(meta, region)):  # the whole block: one write
                return [lambda: write_with_tensorstore(self.storage, meta, region, local)]
            return [functools.partial(write_with_tensorstore, self.storage, meta, meta.shard_region(idx),
                                      take(local, within)) for idx, within, _ in shards]
        return [functools.partial(_write_shard, self.storage, meta, idx, take(local, within))
                for idx, within, _ in shards]

    def _encode(self, shards: list[tuple[ArrayMeta, tuple[int, ...], np.ndarray, bytes]],
                reuse: Reusable | None = None) -> list[tuple[str, Any, str]]:
        """Hash and encode shards (XXH3, crc32c, compression) on the pool: (key, buffers, hash) each, in order.

        A shard ``reuse`` holds with the same hash is not encoded: its buffers are None.
        """
        jobs = [functools.partial(_encode_one, *s, reuse) for s in shards]
        sizes = [s[2].nbytes for s in shards]
        if sum(sizes) < INLINE_SHARD_BYTES * len(shards):
            return [job() for job in jobs]
        return pool.run_batched(jobs, sizes, self.storage.local)

    def _pack(self, writer: str, blobs: list[tuple[str, list[Any], str]]) -> dict[str, list[Any]]:
        """Write encoded shards into this writer's data objects; their locations, keyed by shard key."""
        if not blobs:
            return {}
        where = packed.write_pack(self.root, f"{self.generation}/{PACKED_DIR}", writer,
                                  [(key, parts) for key, parts, _ in blobs], self.object_bytes)
        return {k: list(v) for k, v in where.items()}

    # ------------------------------------------------------------- commit
    def names(self) -> list[str]:
        """The tensors this checkpoint will hold, as far as the writer knows them."""
        return list(self.layouts) if isinstance(self.layouts, Mapping) else list(self.shapes)

    def commit(self, ranks: list[int] | None = None, **options: Any) -> Marker:
        """Make the checkpoint visible; see :func:`reshard.store.commit.protocol.commit` (``force``, ``lock_lease``).

        ``ranks``: every rank that wrote (default: the ranks of the layouts this
        writer knows). Pass them when ranks saved different tensors, or a rank
        whose tensors this writer never saw would be left out of the commit.
        """
        names = self.names()
        if ranks is None and names:
            ranks = sorted(all_ranks(self.layout(n) for n in names))
        elif ranks is not None and names:
            ranks = sorted(set(ranks) | all_ranks(self.layout(n) for n in names))
        # where the manifests are: a packed rank's in its data object; write_manifests' as JSON
        form = None if self._json_manifests else self.form
        return commit(self.root, save_id=self.save_id, ranks=ranks, known=self._known, **{"form": form, **options})


#: Shards averaging fewer bytes are encoded in the calling thread: their per-shard Python work outweighs
#: what the pool's threads gain (W5's 873 shards of 8.6 KiB: 11 ms inline, 21-33 ms on the pool).
INLINE_SHARD_BYTES = 128 << 10

#: The storage form new checkpoints get (chosen by measurement: docs/performance.md).
DEFAULT_FORM = "packed"


def _geometry(item: tuple[str, TensorPlan]) -> tuple[Any, ...]:
    """Order of a rank's shards in its data object: alike layouts and shapes side by side, then by name.

    A target rank of another layout needs the same part of every shard of one
    geometry, so grouping them makes its byte ranges few and long (W5: one rank
    of 56 from 64 reads whole runs of shards, not every other shard).
    """
    name, plan = item
    lay = plan.meta.layout
    return lay.ranks, lay.mesh, lay.dims, lay.split, lay.nested, lay.opt_shard or 0, lay.shape, name


def _write_shard(storage: Storage, meta: ArrayMeta, idx: tuple[int, ...], data: np.ndarray) -> None:
    storage.write(meta.shard_key(idx), encode_shard(data, meta, idx))


def _encode_one(meta: ArrayMeta, idx: tuple[int, ...], data: np.ndarray, how: bytes, reuse: Reusable | None
                ) -> tuple[str, list[Any] | None, str]:
    key, sha = meta.shard_key(idx), digest(how, data)
    if reuse is not None and reuse.find(key, sha) is not None:
        return key, None, sha  # the base holds these bytes: nothing to encode
    return key, encode_shard(data, meta, idx), sha


def single_process(options: dict[str, Any]) -> dict[str, Any]:
    """``create`` options for a writer that writes every rank's part itself: a fresh save_id unless given.

    One process needs no agreement on the save's name, so every save gets a
    generation of its own, and overwriting needs no save_id from the caller.
    Its blocks are not cut among replicas (``balance``): one process writes them all anyway.
    """
    return {"balance": False, **options, "save_id": options.get("save_id") or uuid.uuid4().hex[:16]}


def create(url: str, layouts: LayoutSpec, **options: Any) -> CheckpointWriter:
    """Start writing a checkpoint at ``url``.

    Every rank's process calls this with the same arguments (no rank goes
    first), then ``writer.write(rank, local_state_dict)``; one process calls
    ``writer.commit()`` once all have written.

    Parameters
    ----------
    url : str
        Where the checkpoint goes (local path or fsspec URL).
    layouts : mapping or callable
        ``{name: Layout}`` or a rule ``(name, global_shape) -> Layout``.
    **options
        ``save_id`` (str or int, the same on every rank, e.g. the training
        step; default ``"0"``): names this save's generation. ``overwrite``:
        replace a committed checkpoint; needs a ``save_id`` other than the
        committed one, and the old checkpoint stays readable until this save
        commits. ``shapes`` (needed with a rule), ``compression`` (None or
        ``"zstd"``), ``checksums``, ``chunk_bytes``, ``storage_options``,
        ``engine`` (``"fast"`` or ``"tensorstore"``): see :class:`CheckpointWriter`.
        ``grid``: how a tensor whose layout is not a regular grid of blocks
        (OneFlow balanced splits, Megatron blocks) is sharded: ``"exact"``, one
        shard per block on zarr's rectilinear chunk grid (zarr-python >= 3.2
        reads it, TensorStore and zarr-python 3.1 do not); ``"regular"``, the
        gcd grid every zarr v3 reader reads (one shard per gcd of the block
        boundaries: many small objects); ``"auto"`` (default), ``"exact"``, or
        ``"regular"`` with ``engine="tensorstore"``. Regular layouts always get
        one shard per block on a regular grid. See docs/format.md.
        ``form``: ``"packed"`` (default: each rank's shards back to back in one
        data object, plus kerchunk references) or ``"directory"`` (one object
        per shard, for TensorStore); ``object_bytes``: packed form, a rank's
        data goes on in a new object once one holds this many bytes (4 GiB);
        ``buffer_bytes``: packed form, block writers (importers, redivide) hold
        this many bytes in memory (256 MiB), then write them as one object.
        ``base``: an incremental save (packed form): the URL of an earlier
        committed packed save, this checkpoint itself or one beside it (a
        manager's previous step); a shard whose values and encoding (their XXH3-128 hash)
        equal what the base's same rank wrote under the same key is referenced, not encoded or written
        (:mod:`reshard.store.write.incremental`).
        ``durable`` (default True): local files are fsynced, and every object a
        manifest or the commit marker announces is on disk before they are
        (power-loss safe; no effect on object stores, whose PUTs are durable).
        False leaves flushing to the OS: a process killed (even with -9) loses
        nothing, a machine losing power may (docs/reliability.md).
        ``balance`` (default True): a block held by several ranks (data-parallel
        replicas) is cut into one sub-shard per holder along one dimension, and
        each holder writes its own (no communication: the cut follows from the
        layout); False: replica 0 writes the whole block. Each rank must then
        pass its real piece (a replica's too).

    Raises
    ------
    CheckpointExistsError
        A committed checkpoint is there and ``overwrite`` is false, or
        ``save_id`` is the committed save's.
    """
    return CheckpointWriter(url, layouts, **options)
