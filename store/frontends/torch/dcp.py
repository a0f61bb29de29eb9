"""torch DCP import: a ``torch.distributed.checkpoint`` folder into a reshard checkpoint.

DCP's pickled ``.metadata`` is someone else's format: it is read with a
restricted unpickler (only DCP's metadata classes resolve, see
:func:`read_dcp_metadata`) and its saved items with
``torch.load(weights_only=True)``. :func:`import_dcp` streams one saved chunk
at a time. torch is imported inside the functions, never when this module
loads. Also importable from :mod:`reshard.store.frontends.torch.dtensor`.
"""

from __future__ import annotations

import functools
import io
import pickle  # only for a RESTRICTED reader of DCP's own .metadata (see _DCPMetadataUnpickler); never in our format
from collections.abc import Mapping, Sequence
from typing import Any

from reshard.layouts import Layout
from reshard.layouts.errors import CheckpointNotFoundError, FormatError, ReshardError

from ...format.tree import to_json
from ...io.storage import Storage
from ...read.foreign import MEGATRON, detect, foreign_hint
from ...write.writer import create, single_process
from ..sources import Skips, dcp_source, local_path, refuse_empty

#: The globals a DCP ``.metadata`` pickle may name, besides torch dtypes and layouts.
_DCP_GLOBALS = frozenset(
    [("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")]
    + [("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")]
    + [("builtins", n) for n in ("set", "frozenset", "tuple", "list", "dict")]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
       ("torch", "Size"), ("collections", "OrderedDict")]
)


class _DCPMetadataUnpickler(pickle.Unpickler):
    """RESTRICTED unpickler for DCP's pickled ``.metadata`` (someone else's format, not ours).

    Only the DCP metadata dataclasses, ``torch.Size``, torch dtypes and
    layouts, paths and a few builtins resolve; any other global raises, so a
    crafted file cannot run code. Never use plain ``pickle.load`` here.
    """

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) == ("builtins", "getattr"):  # how Python 3.11.2 (Debian 12) pickles an enum member
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which reshard does not load")


def _enum_member(cls: Any, name: Any) -> Any:
    """``getattr(cls, name)`` as a pickle may call it, for a member of an allowed enum only."""
    import enum

    if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and (cls.__module__, cls.__name__) in _DCP_GLOBALS
            and isinstance(name, str) and name in cls.__members__):
        raise pickle.UnpicklingError(f"DCP metadata calls getattr({cls!r}, {name!r}), which reshard does not load")
    return cls[name]


def read_dcp_metadata(data: bytes, where: str = ".metadata",
                      unpickler: type[_DCPMetadataUnpickler] = _DCPMetadataUnpickler) -> Any:
    """Decode a DCP ``.metadata`` file (named ``where`` in errors) with the restricted ``unpickler``.

    Raises
    ------
    FormatError
        Whatever the unpickler refuses or fails on (a global it does not load, an opcode, truncated
        bytes), or another object than DCP's ``Metadata`` (a mapping of items and one of where they are
        stored), naming ``where``.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = unpickler(io.BytesIO(data)).load()
    except Exception as e:  # a hostile pickle may fail in any way; each is the file's fault
        raise FormatError(f"{where}: not a readable DCP .metadata file ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise FormatError(f"{where}: a pickled {type(md).__name__}, not DCP's Metadata of items and their storage")
    return md


def _plain_name(name: Any) -> bool:
    """Whether ``name`` is a file of the checkpoint's own folder (what DCP writes: ``__0_0.distcp``)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


@functools.lru_cache(maxsize=256)
def _object_size(src: Storage, name: str) -> int:
    """The size of a data file of the checkpoint (once per file)."""
    try:
        return int(src.fs.size(src.path(name)))
    except FileNotFoundError:
        raise FormatError(f"{src.url}/.metadata: its items are stored in {name}, which is missing") from None


def _dcp_item(src: Storage, info: Any, what: str) -> Any:
    """torch.load one saved item (weights_only: torch's own restricted unpickler), its range checked first."""
    import torch

    if getattr(info, "transform_descriptors", None):
        raise FormatError(f"{src.url}: {what} uses DCP extensions {info.transform_descriptors}, "
                          "which reshard does not decode")
    name, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
    if not _plain_name(name) or type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise FormatError(f"{src.url}/.metadata: {what} is stored at {name!r:.100}, bytes {offset!r:.30}+"
                          f"{length!r:.30}: not a range of a file in the checkpoint's folder")
    assert isinstance(name, str) and isinstance(offset, int) and isinstance(length, int)
    size = _object_size(src, name)
    if offset + length > size:
        raise FormatError(f"{src.url}/{name}: {what} is bytes {offset}+{length} of it, past its end ({size} bytes)")
    buf = bytearray(length)
    src.read_into(name, offset, [memoryview(buf)])
    try:
        return torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
    except Exception as e:
        raise FormatError(f"{src.url}: cannot decode {what} in {name}: {e}") from None


def _storage_index(md: Any, meta: str) -> dict[tuple[str, tuple[int, ...] | None], Any]:
    """Where each item is stored, by (fqn, chunk offsets or None), from DCP's ``storage_data``."""
    try:
        return {(idx.fqn, None if idx.offset is None else tuple(int(o) for o in idx.offset)): info
                for idx, info in md.storage_data.items()}
    except (AttributeError, TypeError, ValueError):
        raise FormatError(f"{meta}: malformed storage_data (not MetadataIndex -> storage info)") from None


def _stored(where: Mapping[tuple[str, tuple[int, ...] | None], Any], fqn: str, offsets: tuple[int, ...] | None,
            meta: str) -> Any:
    """The storage of item ``fqn`` (its chunk at ``offsets``)."""
    info = where.get((fqn, offsets))
    if info is None:
        what = f"item {fqn!r}" if offsets is None else f"chunk {list(offsets)} of {fqn!r}"
        raise FormatError(f"{meta}: {what} has no entry in its storage_data (where its bytes are)")
    return info


def _tensor(fqn: str, item: Any, meta: str) -> tuple[Layout, str]:
    """A tensor item's saving layout (one block per saved chunk) and dtype name, checked."""
    try:
        blocks = [(i, tuple(int(o) for o in c.offsets), tuple(int(n) for n in c.sizes), 0)
                  for i, c in enumerate(item.chunks)]
        layout = Layout.from_blocks(tuple(int(n) for n in item.size), blocks)
        dtype = str(item.properties.dtype).removeprefix("torch.")
    except (ReshardError, AttributeError, TypeError, ValueError) as e:
        raise FormatError(f"{meta}: tensor {fqn!r}: its size and chunks are not a tensor's saved blocks: {e}"
                          ) from None
    return layout, dtype


def _regroup(items: dict[str, Any], paths: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Join DCP's per-element items of JSON lists back into one leaf each.

    DCP walks lists that hold mappings (``param_groups.0.lr``...); :func:`save`
    keeps such a list whole (``param_groups``), so an imported checkpoint
    loads into the same state dicts. ``paths`` is DCP's ``planner_data``
    (fqn -> key path); lists that also hold tensors stay split.
    """
    leaves: dict[str, Any] = {}
    for fqn, value in items.items():
        path = paths.get(fqn)
        cut = next((i for i, k in enumerate(path or ()) if isinstance(k, int)), None)
        if path is None or cut is None or cut == 0:
            leaves[fqn] = value
            continue
        name = ".".join(str(k) for k in path[:cut])
        if any(t.startswith(name + ".") for t in tensors) or not isinstance(leaves.get(name, []), list):
            leaves[fqn] = value
            continue
        node: Any = leaves.setdefault(name, [])
        for key, nxt in zip(path[cut:], path[cut + 1:], strict=False):
            if isinstance(key, int):
                node.extend({} if isinstance(nxt, str) else [] for _ in range(key + 1 - len(node)))
                node = node[key]
            else:
                node = node.setdefault(key, {} if isinstance(nxt, str) else [])
        last = path[-1]
        if isinstance(last, int):
            node.extend(None for _ in range(last + 1 - len(node)))
        node[last] = value
    return leaves


def import_dcp(src: str, dst: str, *, src_storage_options: dict[str, Any] | None = None,
               skip: Sequence[str] = (), **options: Any) -> dict[str, Any]:
    """Convert a torch DCP checkpoint (``.metadata`` + ``*.distcp``) into a reshard checkpoint.

    Streams: one saved chunk is in memory at a time (read by byte range, so
    ``src`` may be any fsspec URL). Each tensor keeps DCP's chunks as its
    saving layout (an explicit layout, one block per saved chunk, numbered
    in DCP's order); non-tensor items become JSON leaves.

    Parameters
    ----------
    src : str
        The DCP checkpoint directory.
    dst : str
        The new checkpoint.
    src_storage_options : dict, optional
        fsspec options for ``src``.
    skip : sequence of str
        Non-tensor items that are not JSON which the import may leave out (globs or dotted
        prefixes, :class:`~reshard.store.frontends.sources.Skips`); any other raises
        :class:`FormatError` naming it and its file. What is skipped is recorded in the leaf
        ``reshard.skipped``.
    **options
        As for :func:`reshard.store.create`.

    Returns
    -------
    dict
        ``{"tensors": n, "leaves": n, "bytes": n, "skipped": [names]}``.
    """
    import torch

    from ...format.torch_arrays import to_numpy

    src_store = Storage(local_path(src), src_storage_options)
    try:
        raw = src_store.read(".metadata")
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{src_store.url}: no DCP checkpoint there (no .metadata file)"
                                      f"{foreign_hint(src_store)}") from None
    if detect(src_store) is MEGATRON:  # a DCP folder too, but its optimizer state is Megatron's flat buckets
        raise FormatError(f"{src_store.url} is a Megatron-Core torch_dist save (metadata.json names its backend): "
                          f"import it with `reshard import megatron {src_store.url} DST`, which decodes its "
                          "distributed optimizer's state")
    meta = f"{src_store.url}/.metadata"
    md = read_dcp_metadata(raw, meta)
    where = _storage_index(md, meta)
    layouts, dtypes, items, skips = {}, {}, {}, Skips(skip)
    for fqn, item in md.state_dict_metadata.items():
        if hasattr(item, "chunks"):
            layouts[fqn], dtypes[fqn] = _tensor(fqn, item, meta)
        else:
            info = _stored(where, fqn, None, meta)
            value = _dcp_item(src_store, info, f"item {fqn!r}")
            try:
                items[fqn] = to_json(value, fqn)
            except TypeError as e:
                skips.add(fqn, f"{src_store.url}: item {fqn!r} (in {info.relative_path})",
                          f"it holds {e}, which is not JSON")
    leaves = _regroup(items, getattr(md, "planner_data", None) or {}, layouts)
    refuse_empty("DCP", src_store.url, len(layouts), f" (found {len(items)} other items)")
    skips.check()
    leaves.update(skips.leaves())
    leaves.update(dcp_source("DCP", (getattr(info, "relative_path", "") for info in where.values())))
    writer = create(dst, layouts, **single_process(options))
    metas = {n: writer.meta(n, lay, dtypes[n]) for n, lay in layouts.items()}
    total = 0
    for fqn, item in md.state_dict_metadata.items():
        for chunk in getattr(item, "chunks", ()):
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            info = _stored(where, fqn, offsets, meta)
            tensor = _dcp_item(src_store, info, f"chunk {list(offsets)} of {fqn!r}")
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != sizes:
                got = list(tensor.shape) if isinstance(tensor, torch.Tensor) else f"a {type(tensor).__name__}"
                raise FormatError(f"{src_store.url}/{info.relative_path}: chunk {list(offsets)} of {fqn!r} holds "
                                  f"{got}, {meta} says {list(sizes)}")
            array = to_numpy(tensor)
            region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            writer.write_block(metas[fqn], region, array)
            total += array.nbytes
    writer.write_manifests(metas, leaves)
    writer.commit()
    return {"tensors": len(layouts), "leaves": len(leaves), "bytes": total, "skipped": skips.names()}
