"""Export a checkpoint to ONE file (safetensors or npz), streaming.

Every tensor is cut into slabs, regions that are contiguous runs of its
C-order bytes, of at most ``min(fuse_bytes, budget)`` bytes (aligned to the
stored inner chunks where they can be), and small tensors are fused into
tasks (see :mod:`reshard.store.read.graph`). Peak memory is the in-flight byte
``budget``, not the model.

* safetensors to a local path: the header is written first, then tasks read
  their slabs and ``pwrite`` them at their final offsets, in parallel
  (with a dask.distributed client the path must be visible to every worker:
  a shared filesystem).

Every export writes through :func:`reshard.store.io.replace.replacing`: an
existing file is refused unless ``overwrite``, and a local file appears under
its name only once complete and fsynced (``os.replace`` of a staging sibling).
* npz, and safetensors to an fsspec URL: tasks run in waves of at most
  ``budget`` bytes and this process writes their results in order.

safetensors header: 8-byte little-endian length, then JSON
``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}`` padded
with spaces to a multiple of 8 bytes; data offsets are relative to the end of
the header. npz: a zip (stored, zip64) of ``<name>.npy`` members, as
``numpy.savez`` writes; bfloat16 and float8 members hold their bit patterns as
``uint16``/``uint8`` (numpy has no such types). The zip comment holds
``{"reshard": {"dtypes": {name: real dtype}, "leaves": {...}}}`` (or, when over
the 64 KiB a comment allows, names the member that does); view such members
back with ``ml_dtypes``.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from reshard.layouts.errors import BadNameError, DTypeMismatchError, TensorNotFoundError
from reshard.layouts.views import View, check_view

from ..format.dtypes import SAFETENSORS_DTYPES
from ..format.meta import ArrayMeta
from ..format.tree import FILES_LEAF, METADATA_LEAF, json_leaves
from ..io.localfs import is_local_url
from ..io.replace import replacing
from ..io.stats import IOStats
from . import graph

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

Region = tuple[slice, ...]

#: npz holds these as unsigned ints of the same width (their bit patterns).
NPZ_AS_BITS = {"bfloat16": "<u2", "float8_e4m3fn": "|u1", "float8_e5m2": "|u1"}
#: Member holding the npz note when it is too long for the zip comment.
NPZ_NOTE = "reshard.json"


# -------------------------------------------------------------------- plan
def slabs(meta: ArrayMeta, max_bytes: int, region: Region | None = None) -> list[Region]:
    """Cut a tensor (or a ``region`` of it contiguous in C order) into regions that are contiguous in C
    order, each at most ``max_bytes``.

    The first dim whose trailing extent fits is cut; cuts fall on inner-chunk
    boundaries when a slab holds at least one chunk's extent. A single
    element larger than ``max_bytes`` is still one slab.
    """
    region = region or tuple(slice(0, n) for n in meta.shape)
    base = tuple(r.start for r in region)
    shape = tuple(r.stop - r.start for r in region)
    if not shape or math.prod(shape) == 0:
        return [region]
    item = meta.np_dtype.itemsize
    d = next(d for d in range(len(shape)) if item * math.prod(shape[d + 1:]) <= max_bytes or d == len(shape) - 1)
    k = max(1, max_bytes // (item * math.prod(shape[d + 1:])))
    if k >= meta.chunk[d]:
        k -= k % meta.chunk[d]
    tail = tuple(slice(b, b + n) for b, n in zip(base[d + 1:], shape[d + 1:], strict=True))
    return [
        (*(slice(b + i, b + i + 1) for b, i in zip(base, outer, strict=False)),
         slice(base[d] + lo, base[d] + min(lo + k, shape[d])), *tail)
        for outer in itertools.product(*map(range, shape[:d]))
        for lo in range(0, shape[d], k)
    ]


@dataclass(frozen=True)
class Entry:
    """One tensor of the output file: its name there, dtype, shape, and the stored regions (each contiguous
    in C order) whose bytes, one after the other, are its bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[tuple[ArrayMeta, Region], ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.parts[0][0].np_dtype.itemsize if self.parts else 0


def entries_of(ckpt: Checkpoint, names: Iterable[str] | None, rename: Mapping[str, str] | None,
               views: Mapping[str, View] | None) -> list[Entry]:
    """The output tensors: stored tensors (renamed), or ``views`` (all, or those of ``names``), checked."""
    if views is None:
        metas = [ckpt.tensor(n) for n in (sorted(ckpt.arrays) if names is None else names)]
        return [Entry(rename.get(m.name, m.name) if rename else m.name, m.dtype, m.shape,
                      ((m, tuple(slice(0, n) for n in m.shape)),)) for m in metas]
    out = []
    for name in (list(views) if names is None else names):
        if name not in views:
            raise TensorNotFoundError(f"no view named {name!r} to export")
        view = views[name]
        stored = {p.name: ckpt.tensor(p.name) for p in view.pieces}
        check_view(name, view, {n: m.shape for n, m in stored.items()})
        dtypes = {m.dtype for m in stored.values()}
        if len(dtypes) > 1:
            raise DTypeMismatchError(f"{name}: its pieces are of several dtypes {sorted(dtypes)}")
        out.append(Entry(name, dtypes.pop() if dtypes else "float32", tuple(view.shape),
                         tuple((stored[p.name], tuple(slice(lo, hi) for lo, hi in p.region))
                               for p in view.pieces)))
    return out


@dataclass(frozen=True)
class Slab:
    """A region of one tensor and where its bytes go in the output file."""

    meta: ArrayMeta
    region: Region
    offset: int

    @property
    def op(self) -> graph.ReadOp:
        return graph.ReadOp(self.meta, self.region)


@dataclass(frozen=True)
class WriteTask:
    """Read fused slabs and ``pwrite`` them into ``path`` (local safetensors)."""

    source: graph.Source
    slabs: tuple[Slab, ...]
    path: str
    budget: graph.BudgetRef


def write_task(task: WriteTask) -> IOStats:
    """Task body of the local safetensors export."""
    ckpt = graph.open_source(task.source)
    ops = [s.op for s in task.slabs]
    with graph.budget(task.budget).hold(sum(op.nbytes for op in ops)):
        arrays, stats = graph.read_ops(ckpt, ops)
        fd = os.open(task.path, os.O_WRONLY)
        try:
            for s, arr in zip(task.slabs, arrays, strict=True):
                _pwrite_all(fd, _bytes(arr), s.offset)
        finally:
            os.close(fd)
    return stats


def _bytes(arr: np.ndarray) -> memoryview:
    flat: Any = arr.reshape(-1).view(np.uint8)
    return memoryview(flat)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data.nbytes:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


# ------------------------------------------------------------------ export
def export(ckpt: Checkpoint, path: str, format: str = "safetensors", names: Iterable[str] | None = None,
           progress: bool | None = None, *, scheduler: Any = None, budget: int = graph.DEFAULT_BUDGET,
           fusion: int | str | None = None, fuse_bytes: int = graph.DEFAULT_FUSE_BYTES, gap: int | None = None,
           metadata: dict[str, str] | None = None, storage_options: dict[str, Any] | None = None,
           overwrite: bool = False, rename: Mapping[str, str] | None = None,
           views: Mapping[str, View] | None = None) -> IOStats:
    """Stream tensors of a checkpoint into one safetensors or npz file.

    Parameters
    ----------
    ckpt : Checkpoint
        The open checkpoint.
    path : str
        Output file: a local path or an fsspec URL.
    format : {"safetensors", "npz"}
        Output format.
    names : iterable of str, optional
        Tensors to export, in this order (default: all, sorted by name).
    progress : bool, optional
        A progress bar; default: on a terminal or in a notebook (:mod:`reshard.store.io.progress`).
    scheduler : None, "threads", "sync" or dask.distributed.Client
        Where the read tasks run.
    budget : int
        Bytes of tensor data in flight at once (per process); peak memory is
        about this, whatever the model's size.
    fusion, fuse_bytes, gap
        I/O fusion cap, bytes per fused task, coalescing gap: see
        :func:`reshard.store.read.graph.load_many`.
    metadata : dict of str to str, optional
        safetensors ``__metadata__`` entries, added to ``{"format": "pt"}`` and
        the checkpoint's non-tensor leaves as JSON under ``"reshard.leaves"``.
    storage_options : dict, optional
        fsspec options for a remote ``path``.
    overwrite : bool
        Replace ``path`` if it exists (else :class:`~reshard.layouts.errors.CheckpointExistsError`); a
        local file is replaced whole, never left half-written (:mod:`reshard.store.io.replace`).
    rename : mapping, optional
        safetensors only: ``{stored name: name in the file}`` (e.g. without a
        ``"model."`` prefix, for ``from_pretrained``); names not in it are kept.
    views : mapping, optional
        safetensors only: write these tensors instead, ``{name in the file: View}`` (each made of regions
        of stored tensors, :mod:`reshard.layouts.views`), streamed like the others; ``names`` then picks
        among them.

    Returns
    -------
    IOStats
        Reads from the checkpoint (requests, bytes fetched and delivered), the
        file written (``writes=1``, ``bytes_written``) and the graph's tasks.
    """
    if format not in ("safetensors", "npz"):
        raise ValueError(f"format must be 'safetensors' or 'npz', got {format!r}")
    if (rename or views is not None) and format != "safetensors":
        raise ValueError(f"rename= and views= are for safetensors exports, not {format!r}")
    if rename and views is not None:
        raise ValueError("give rename= or views=, not both (a view is named as it is to be written)")
    entries = entries_of(ckpt, names, rename, views)
    metas = [e.parts[0][0] for e in entries]  # npz: one whole stored tensor per entry
    if format == "safetensors":
        header, offsets = safetensors_header(entries, ckpt.leaves, metadata)
    else:
        header, offsets = b"", [0] * len(metas)
    cap = graph.fusion_cap(fusion)
    ref = graph.BudgetRef.new(budget)
    per_task = min(fuse_bytes, ref.limit)
    pieces = [piece for e, off in zip(entries, offsets, strict=True) for piece in _entry_slabs(e, off, per_task)]
    groups = graph.fuse(pieces, lambda s: s.op.nbytes, cap, per_task)
    source = graph.source_of(ckpt, gap)
    local = is_local_url(str(path))
    try:
        with replacing(str(path), overwrite=overwrite, folder=False, storage_options=storage_options) as out, \
                graph.progress_bar(len(groups), f"export {format}", progress) as bar:
            if format == "safetensors" and local:
                parts, size = _export_local(out, header, pieces, groups, source, ref, scheduler, bar)
            else:
                parts, size = _export_stream(out, format, header, metas, groups, source, ref, scheduler, bar,
                                             storage_options, ckpt.leaves)
    finally:
        graph.release(ref)
    stats = graph.total(parts, len(groups))
    ckpt.storage.count(**stats.as_dict())
    stats.add(writes=1, bytes_written=size)
    return stats


def _entry_slabs(entry: Entry, offset: int, per_task: int) -> list[Slab]:
    """The slabs of one output tensor, each at its file offset: its parts one after the other."""
    out = []
    for meta, region in entry.parts:
        if math.prod(r.stop - r.start for r in region) == 0:
            continue
        cut = slabs(meta, per_task, region)  # first: it checks the stored shape (an untrusted document's)
        first = _flat_offset(meta, region)
        out += [Slab(meta, r, offset + _flat_offset(meta, r) - first) for r in cut]
        offset += math.prod(r.stop - r.start for r in region) * meta.np_dtype.itemsize
    return out or [Slab(m, r, offset) for m, r in entry.parts[:1]]


def _flat_offset(meta: ArrayMeta, region: Region) -> int:
    if not meta.shape or math.prod(meta.shape) == 0:
        return 0
    start = 0
    for r, n in zip(region, meta.shape, strict=True):  # C order, in Python ints (no numpy size limit)
        start = start * n + r.start
    return start * meta.np_dtype.itemsize


def safetensors_header(entries: list[Entry], leaves: dict[str, Any],
                       metadata: dict[str, str] | None = None) -> tuple[bytes, list[int]]:
    """The header bytes (length prefix included) and each tensor's absolute file offset.

    ``__metadata__``: the imported one (leaf ``"__metadata__"``), ``"format": "pt"``,
    the other leaves as JSON under ``"reshard.leaves"`` (not the kept files of
    ``"__files__"``: an export to a folder writes those beside), then ``metadata``.
    """
    kept = leaves.get(METADATA_LEAF)
    extra = {k: v for k, v in (kept.items() if isinstance(kept, dict) else ()) if isinstance(v, str)}
    extra["format"] = "pt"  # transformers reads "pt" files only, whatever format the source had
    rest = {k: v for k, v in leaves.items() if k not in (METADATA_LEAF, FILES_LEAF)}
    if rest:
        extra["reshard.leaves"] = json.dumps(json_leaves(rest))
    extra.update(metadata or {})
    doc: dict[str, Any] = {"__metadata__": extra}
    pos, starts = 0, []
    for e in entries:
        if e.name == "__metadata__":
            raise BadNameError("a tensor named '__metadata__' cannot be stored in safetensors")
        if e.name in doc:
            raise BadNameError(f"two tensors would be named {e.name!r} in the safetensors file")
        doc[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                       "data_offsets": [pos, pos + e.nbytes]}
        starts.append(pos)
        pos += e.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = len(raw).to_bytes(8, "little") + raw
    return head, [len(head) + s for s in starts]


def _export_local(path: str, header: bytes, pieces: list[Slab], groups: list[list[Slab]],
                  source: graph.Source, ref: graph.BudgetRef, scheduler: Any, bar: Any) -> tuple[list[IOStats], int]:
    size = len(header) + sum(p.op.nbytes for p in pieces)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(size)
    prefix = f"reshard-export-{ref.token}"
    dsk = {(prefix, g): (write_task, WriteTask(source, tuple(group), path, ref)) for g, group in enumerate(groups)}
    return graph.run(dsk, list(dsk), scheduler, bar), size


def _waves(groups: list[list[Slab]], limit: int) -> list[list[list[Slab]]]:
    """Consecutive task groups, at most ``limit`` bytes per wave (a larger group alone)."""
    return graph.fuse(groups, lambda g: sum(s.op.nbytes for s in g), len(groups) or 1, limit)


def _export_stream(path: str, format: str, header: bytes, metas: list[ArrayMeta], groups: list[list[Slab]],
                   source: graph.Source, ref: graph.BudgetRef, scheduler: Any, bar: Any,
                   storage_options: dict[str, Any] | None, leaves: dict[str, Any]) -> tuple[list[IOStats], int]:
    """Compute waves of tasks and write their results in order through one file object."""
    import fsspec

    parts: list[IOStats] = []
    fs, fpath = fsspec.core.url_to_fs(str(path), **(storage_options or {}))
    try:
        with fs.open(fpath, "wb") as raw:
            sink = _NpzSink(raw, metas) if format == "npz" else _RawSink(raw, header)
            try:
                for w, wave in enumerate(_waves(groups, ref.limit)):
                    prefix = f"reshard-export-{ref.token}-{w}"
                    dsk = {(prefix, g): (graph.read_task, graph.ReadTask(source, tuple(s.op for s in group)))
                           for g, group in enumerate(wave)}
                    for group, (arrays, stats) in zip(wave, graph.run(dsk, list(dsk), scheduler, bar), strict=True):
                        for s, arr in zip(group, arrays, strict=True):
                            sink.write(s.meta, arr)
                        parts.append(stats)
                    del dsk
            except BaseException:
                sink.abort()  # the file is removed: nothing more may write to it, now or when collected
                raise
            sink.close(leaves)
            size = raw.tell()
    except BaseException:
        if fs.exists(fpath):
            fs.rm(fpath)
        raise
    return parts, size


class _RawSink:
    """safetensors to a stream: the header, then each slab in order."""

    def __init__(self, raw: Any, header: bytes) -> None:
        self.raw = raw
        raw.write(header)

    def write(self, meta: ArrayMeta, arr: np.ndarray) -> None:
        self.raw.write(_bytes(arr))

    def close(self, leaves: dict[str, Any]) -> None:
        pass

    def abort(self) -> None:
        pass


class _NpzSink:
    """npz to a stream: one stored ``.npy`` member per tensor (every tensor has at least one slab)."""

    def __init__(self, raw: Any, metas: list[ArrayMeta]) -> None:
        self.zip = zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED, allowZip64=True)
        self.dtypes = {m.name: m.dtype for m in metas if m.dtype in NPZ_AS_BITS}
        self.name: str | None = None
        self.member: Any = None

    def write(self, meta: ArrayMeta, arr: np.ndarray) -> None:
        if meta.name != self.name:
            if self.member is not None:
                self.member.close()
            dtype = np.dtype(NPZ_AS_BITS.get(meta.dtype, meta.np_dtype))
            header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": meta.shape}
            self.member = self.zip.open(_entry(f"{meta.name}.npy"), "w", force_zip64=True)
            self.name = meta.name
            try:
                np.lib.format.write_array_header_1_0(self.member, header)
            except ValueError:  # a header over 64 KiB needs format 2.0
                np.lib.format.write_array_header_2_0(self.member, header)
        self.member.write(_bytes(arr))

    def close(self, leaves: dict[str, Any]) -> None:
        if self.member is not None:
            self.member.close()
        note = json.dumps({"reshard": {"dtypes": self.dtypes, "leaves": json_leaves(leaves)}}).encode()
        if len(note) <= 0xFFFF:
            self.zip.comment = note
        else:  # a zip comment holds at most 64 KiB: a member then, named in the comment
            self.zip.writestr(_entry(NPZ_NOTE), note)
            self.zip.comment = json.dumps({"reshard": {"member": NPZ_NOTE}}).encode()
        self.zip.close()

    def abort(self) -> None:
        """Drop the archive after a failure, writing nothing more (else, once collected, the zip file's
        finaliser wrote its directory to the closed stream: "Exception ignored ... seek of closed file")."""
        if self.member is not None:
            io.BufferedIOBase.close(self.member)  # closed, without writing the member's record
            self.member = None
        self.zip._writing = False  # type: ignore[attr-defined]
        self.zip.fp = None


def _entry(name: str) -> zipfile.ZipInfo:
    """A zip member with a fixed timestamp: the same checkpoint exports to the same bytes."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    return info
