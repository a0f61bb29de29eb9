"""A DCP storage plugin: ``dcp.save``/``dcp.load`` (and ``dcp.async_save``) on reshard checkpoints.

::

    from reshard.torch import StorageReader, StorageWriter

    dcp.save(state_dict, storage_writer=StorageWriter(url))
    dcp.load(state_dict, storage_reader=StorageReader(url))

The writer stores a normal reshard checkpoint (zarr arrays, JSON leaves, no
pickle): DCP's planner decides which rank writes which chunk (replicas
deduplicated), the coordinator turns the global plan into one explicit layout
per tensor (one block per saved chunk), every rank writes its own chunks, and
the coordinator writes the manifests and commits in ``finish``. Non-tensor
items must be JSON values or bytes-like (``bytes``, ``bytearray``,
``io.BytesIO``, kept as tagged base64); lists DCP split per element
(``param_groups``) are joined back, so ``rs.open`` and :func:`reshard.store.frontends.torch.dtensor.load`
see what :func:`~reshard.store.frontends.torch.dtensor.save` would have written.

The reader presents any reshard checkpoint (written by this plugin, by
``save``, by an importer, by another framework) to DCP as one chunk per
tensor; DCP's planner then asks each rank for the regions its own state dict
needs, and only the inner chunks meeting them are read. JSON leaves are
split the way DCP flattens state dicts.

This module imports torch when it loads; :mod:`reshard.store.frontends.torch` imports it on first
use of ``StorageWriter``/``StorageReader``.
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from reshard.layouts import Layout
from reshard.layouts.errors import CheckpointExistsError, CheckpointNotFoundError, DTypeMismatchError
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.planner import WriteItemType as _WriteType
from torch.distributed.checkpoint.storage import StorageReader as _Reader
from torch.distributed.checkpoint.storage import StorageWriter as _Writer
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ...commit.marker import read_marker
from ...format.torch_arrays import from_numpy, to_numpy
from ...format.tree import to_json
from ...io.storage import Storage
from ...read.foreign import DCP, detect
from ...read.open import open
from ...write.writer import create
from .dcp import _regroup

__all__ = ["StorageReader", "StorageWriter"]


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def _url(checkpoint_id: str | os.PathLike[str] | None, current: str | None) -> str:
    url = os.fspath(checkpoint_id) if checkpoint_id is not None else current
    if not url:
        raise ValueError("no checkpoint URL: pass it to the storage plugin or as dcp's checkpoint_id")
    return str(url)


class StorageWriter(_Writer):
    """Write ``dcp.save``'s state dict as a reshard checkpoint at ``url``.

    Parameters
    ----------
    url : str, optional
        Destination (local path or fsspec URL); or give DCP a ``checkpoint_id``.
    **options
        As for :func:`reshard.store.create`: ``overwrite``, ``compression``,
        ``chunk_bytes``, ``checksums``, ``storage_options``, ``save_id``.
        ``overwrite`` defaults to True, as DCP's ``FileSystemWriter``
        overwrites: the earlier checkpoint stays readable until the new one
        commits (a new generation). Without ``save_id`` the coordinator picks a
        fresh one per save.
    """

    def __init__(self, url: str | os.PathLike[str] | None = None, **options: Any) -> None:
        super().__init__()
        self.url = None if url is None else os.fspath(url)
        self.options = {"overwrite": True, **options}
        self.is_coordinator = False
        self._save_id: Any = None
        self._layouts: dict[str, Any] = {}

    # ------------------------------------------------------------------ DCP calls, in order
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.url = _url(checkpoint_id, self.url)
        self._save_id, self._layouts = None, {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """With ``overwrite=False``, refuse a committed checkpoint at the URL on every rank, before anything
        is written: where and in the words DCP's ``FileSystemWriter`` does ("Checkpoint already exists")."""
        if not self.options["overwrite"]:
            url = _url(None, self.url)
            found = read_marker(Storage(url, self.options.get("storage_options")))
            if found is not None:
                raise CheckpointExistsError(
                    f"Checkpoint already exists at {url} (save_id {found[0].save_id!r}) and overwrite=False; "
                    "pass overwrite=True to replace it (the old one stays readable until the new one commits)")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: one explicit layout per tensor, a block per saved chunk; each plan gets its tensors'."""
        chunks: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...], int]]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for plan in plans:
            for item in plan.items:
                if item.type == _WriteType.BYTE_IO or item.tensor_data is None:
                    continue
                fqn = item.index.fqn
                blocks = chunks.setdefault(fqn, [])
                c = item.tensor_data.chunk
                blocks.append((len(blocks), tuple(c.offsets), tuple(c.sizes), 0))
                shapes[fqn] = tuple(item.tensor_data.size)
        paths = {fqn: path for plan in plans for fqn, path in (plan.planner_data or {}).items()}
        layouts = {n: _with_path(Layout.from_blocks(shapes[n], b), n, paths.get(n)).to_json()
                   for n, b in chunks.items()}
        save_id = self.options.get("save_id") or uuid.uuid4().hex[:16]
        out = []
        for plan in plans:
            mine = {i.index.fqn for i in plan.items if i.type != _WriteType.BYTE_IO}
            data = {"save_id": save_id, "layouts": {n: layouts[n] for n in mine}}
            out.append(dataclasses.replace(plan, storage_data=data))
        self._layouts = layouts
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's chunks; JSON leaves travel to the coordinator in the results."""
        data = plan.storage_data or {}
        self._save_id = data.get("save_id")
        layouts = {n: Layout.from_json(j) for n, j in data.get("layouts", {}).items()}
        writer = create(_url(None, self.url), layouts, **{**self.options, "save_id": self._save_id})
        results = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == _WriteType.BYTE_IO or item.tensor_data is None:
                leaf = to_json(_object(planner, item), fqn)
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data={"leaf": leaf}))
                continue
            tensor = planner.resolve_data(item)
            array = to_numpy(tensor)
            layout = layouts[fqn]
            meta = writer.meta(fqn, layout, _dtype_name(array))
            c = item.tensor_data.chunk
            region = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))
            writer.write_block(meta, region, array)
            results.append(WriteResult(index=item.index, size_in_bytes=array.nbytes,
                                       storage_data={"dtype": meta.dtype}))
        located = writer.flush()  # packed form: this rank's data object; where its shards went
        if located and results:
            results[-1].storage_data["located"] = located
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write every block's manifest and commit (the marker is written last)."""
        items: dict[str, Any] = {}
        dtypes: dict[str, str] = {}
        located: dict[str, Any] = {}
        for result in (r for rank in results for r in rank):
            data = result.storage_data or {}
            if "leaf" in data:
                items[result.index.fqn] = data["leaf"]
            else:
                dtypes[result.index.fqn] = data["dtype"]
            located.update(data.get("located", {}))
        layouts = {n: Layout.from_json(j) for n, j in self._layouts.items()}
        save_id = self._save_id or self.options.get("save_id")
        writer = create(_url(None, self.url), layouts, **{**self.options, "save_id": save_id})
        metas = {n: writer.meta(n, lay, dtypes[n]) for n, lay in layouts.items()}
        leaves = _regroup(items, getattr(metadata, "planner_data", None) or {}, layouts)
        writer.write_manifests(metas, leaves, located)
        writer.commit()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def _with_path(layout: Layout, fqn: str, path: Any) -> Layout:
    """The layout, with DCP's key path in its origin when splitting ``fqn`` at dots would not give it back
    (a key holding dots, or a list position: an int in the path)."""
    if not isinstance(path, (tuple, list)) or list(path) == fqn.split("."):
        return layout
    return dataclasses.replace(layout, origin={**(layout.origin or {}), "path": list(path)})


def _object(planner: SavePlanner, item: Any) -> Any:
    """The non-tensor value of a BYTE_IO item: from the planner's state dict, else decoded safely."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is not None:
        return lookup(item.index)
    buf = planner.resolve_data(item)
    assert isinstance(buf, io.BytesIO)
    return torch.load(buf, weights_only=True)


def _dtype_name(array: np.ndarray) -> str:
    from ...format.dtypes import dtype_name

    return dtype_name(array.dtype)


# ------------------------------------------------------------------------ reader
def _torch_dtype(name: str, url: str, fqn: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise DTypeMismatchError(f"{url}: tensor {fqn!r} is {name}, which torch has no dtype for")
    return dtype


def _dcp_flat(name: str, value: Any, out: dict[str, Any], paths: dict[str, tuple[Any, ...]],
              path: tuple[Any, ...]) -> None:
    """Split a leaf the way DCP flattens state dicts: mappings always, lists holding containers.

    ``paths`` gets each item's key path (list positions as ints), as DCP's ``planner_data``.
    """
    if isinstance(value, Mapping):
        for k, v in value.items():
            _dcp_flat(f"{name}.{k}", v, out, paths, (*path, k))
    elif isinstance(value, list) and not _terminal(value):
        for i, v in enumerate(value):
            _dcp_flat(f"{name}.{i}", v, out, paths, (*path, i))
    else:
        out[name] = value
        paths[name] = path


def _key_path(name: str, origin: Any) -> tuple[Any, ...]:
    """A tensor's key path: the one DCP saved it under (kept in its origin), else its name split at dots."""
    path = origin.get("path") if isinstance(origin, Mapping) else None
    if isinstance(path, list) and path and ".".join(map(str, path)) == name:
        return tuple(path)
    return tuple(name.split("."))


def _list_positions(paths: Any) -> set[tuple[str, ...]]:
    """The key paths (as strings) of the lists that saved key paths index into."""
    return {tuple(map(str, p[:i])) for p in paths for i, k in enumerate(p) if isinstance(k, int)}


def _at_positions(path: tuple[Any, ...], lists: set[tuple[str, ...]]) -> tuple[Any, ...]:
    """``path`` with its keys that index one of ``lists`` as ints: a JSON leaf that DCP saved beside a
    tensor in a list (``k.1`` of ``{"k": [tensor, 99]}``) goes back into that list."""
    return tuple(int(k) if isinstance(k, str) and k.isdigit() and tuple(map(str, path[:i])) in lists else k
                 for i, k in enumerate(path))


def _terminal(value: list[Any]) -> bool:
    return not any(isinstance(v, Mapping) or (isinstance(v, list) and not _terminal(v)) for v in value)


def _like(value: Any, template: Any) -> Any:
    if isinstance(template, tuple) and isinstance(value, list):
        return tuple(value)
    return value


class StorageReader(_Reader):
    """Read a reshard checkpoint in ``dcp.load``, onto any world size and placements.

    Parameters
    ----------
    url : str, optional
        The checkpoint; or give DCP a ``checkpoint_id``.
    storage_options, engine
        As for :func:`reshard.store.open`.
    """

    def __init__(self, url: str | os.PathLike[str] | None = None, *,
                 storage_options: dict[str, Any] | None = None, engine: str = "fast") -> None:
        super().__init__()
        self.url = None if url is None else os.fspath(url)
        self.storage_options = storage_options
        self.engine = engine
        self._ckpt: Any = None
        self._leaves: dict[str, Any] = {}
        self._paths: dict[str, tuple[Any, ...]] = {}
        #: The last ``read_data``'s I/O counters (this rank).
        self.last_stats: Any = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.url = _url(checkpoint_id, self.url)
        self._ckpt = None

    def _open(self) -> Any:
        if self._ckpt is None:
            url = _url(None, self.url)
            try:
                self._ckpt = open(url, storage_options=self.storage_options, engine=self.engine)
            except CheckpointNotFoundError as e:
                if detect(Storage(url, self.storage_options)) is not DCP:
                    raise
                raise CheckpointNotFoundError(
                    f"{e}; or load it as it is with DCP's own reader: "
                    f"dcp.load(state_dict, storage_reader=torch.distributed.checkpoint.FileSystemReader({url!r}))"
                ) from None
        return self._ckpt

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Every tensor as one chunk of its global shape; leaves as DCP's per-element items.

        ``planner_data`` gives each item's key path, so a load without a template
        (``_load_state_dict_from_keys``) returns the nested state dict DCP would.
        """
        ckpt = self._open()
        sd: dict[str, Any] = {}
        paths: dict[str, tuple[Any, ...]] = {}
        for name, meta in ckpt.arrays.items():
            props = TensorProperties(dtype=_torch_dtype(meta.dtype, ckpt.url, name))
            shape = torch.Size(meta.shape)
            sd[name] = TensorStorageMetadata(properties=props, size=shape,
                                             chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)),
                                                                          sizes=shape)])
            paths[name] = _key_path(name, meta.origin)
        self._split_leaves()
        lists = _list_positions(paths.values())
        for name, path in self._paths.items():
            sd[name] = BytesStorageMetadata()
            paths[name] = _at_positions(path, lists)
        return Metadata(state_dict_metadata=sd, planner_data=paths)

    def _split_leaves(self) -> None:
        self._leaves, self._paths = {}, {}
        for name, value in self._ckpt.leaves.items():
            _dcp_flat(name, value, self._leaves, self._paths, tuple(name.split(".")))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._open()
        if not self._leaves:
            self._split_leaves()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every requested region in one batch, straight into the target when it is CPU, contiguous, same dtype."""
        ckpt = self._open()
        regions: list[tuple[Any, tuple[slice, ...], np.ndarray]] = []
        copies: list[tuple[Any, torch.Tensor, np.ndarray | None]] = []
        targets = getattr(planner, "state_dict", None) or {}
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(_like(self._leaves[fqn], targets.get(item.dest_index.fqn)), buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            meta = ckpt.arrays[fqn]
            region = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths, strict=True))
            target = planner.resolve_tensor(item).detach()
            view = to_numpy(target) if target.device.type == "cpu" and target.is_contiguous() else None
            if view is not None and view.dtype == meta.np_dtype:
                regions.append((meta, region, view))
                copies.append((item, target, None))
            else:
                buf_arr = np.empty(tuple(item.lengths), dtype=meta.np_dtype)
                regions.append((meta, region, buf_arr))
                copies.append((item, target, buf_arr))
        if regions:
            self.last_stats = ckpt.read_regions(regions)
        with torch.no_grad():
            for item, target, array in copies:
                if array is not None:
                    target.copy_(from_numpy(array))
                planner.commit_tensor(item, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
