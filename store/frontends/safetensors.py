"""Hugging Face safetensors <-> a reshard checkpoint, streaming, dtypes kept.

safetensors file: an 8-byte little-endian header length ``N``, ``N`` bytes of
JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}``, then the data; offsets are relative to the end of the header.
This module parses the header itself (the ``safetensors`` package is not
needed) and reads one tensor at a time, so importing holds about one tensor in
memory whatever the model's size.

A sharded Hugging Face folder holds ``model-0000k-of-0000n.safetensors`` files
and ``model.safetensors.index.json``, ``{"metadata": {"total_size": bytes},
"weight_map": {tensor name: file name}}``, the layout ``transformers``' loader
reads (``save_pretrained(max_shard_size=...)`` writes it). Both directions
handle both forms:

* :func:`import_safetensors`: a ``.safetensors`` file, an index file, or a
  folder holding either -> a checkpoint (each tensor whole on rank 0 unless
  ``layouts`` says otherwise).
* :func:`export_safetensors`: a checkpoint -> a folder with ``model.safetensors``
  (everything fits in ``max_shard_size``) or the numbered shards and their index.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np
from reshard.layouts import Layout
from reshard.layouts.errors import BadNameError, CheckpointNotFoundError, DTypeMismatchError, FormatError

from ..format.dtypes import numpy_dtype
from ..format.tree import LayoutSpec, resolve_layout
from ..read.checkpoint import Checkpoint
from ..read.export import SAFETENSORS_DTYPES
from ..read.open import open as open_checkpoint
from ..write.writer import create, single_process
from .sources import refuse_empty

if TYPE_CHECKING:
    from ..io.stats import IOStats

#: safetensors dtype -> stored dtype name.
DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
#: The index file of a sharded folder, and its shards' names.
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SHARD_NAME = "model-{k:05d}-of-{n:05d}.safetensors"
#: The safetensors format refuses headers over 100 MB.
MAX_HEADER = 100_000_000
#: Default shard size of :func:`export_safetensors`, as ``transformers`` (``save_pretrained``).
DEFAULT_SHARD_SIZE = "5GB"
#: Leaf holding a file's ``__metadata__`` (other than reshard's own entries) after an import.
METADATA_LEAF = "__metadata__"


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are and what they are."""

    name: str
    dtype: str  # the stored dtype name (``bfloat16``...)
    shape: tuple[int, ...]
    start: int  # absolute file offset
    nbytes: int


@dataclass(frozen=True)
class Header:
    """A parsed safetensors header: the tensors in file order and the ``__metadata__``."""

    path: str
    entries: tuple[Entry, ...]
    metadata: dict[str, str]
    data_start: int


# ------------------------------------------------------------------ reading
def _fs(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(str(url), **(storage_options or {}))


def read_header(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Header:
    """Parse the header of a safetensors file (two small reads, no tensor data).

    Raises
    ------
    FormatError
        Not a safetensors file, or a header that breaks the format's rules
        (sizes, offsets outside the data, overlapping tensors), naming the
        file and the tensor.
    DTypeMismatchError
        A dtype reshard does not store (``F8_E8M0``, complex...).
    """
    fs, fpath = _fs(str(path), storage_options)
    where = str(path)
    try:
        size = fs.size(fpath)
        with fs.open(fpath, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{where}: not a safetensors file ({size} bytes, no header)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER or 8 + n > size:
                raise FormatError(f"{where}: not a safetensors file (header length {n} for a file of {size} bytes)")
            raw = f.read(n)
    except IsADirectoryError:
        raise FormatError(f"{where} is a folder, not a safetensors file") from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{where}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: the safetensors header is not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise FormatError(f"{where}: __metadata__ must map strings to strings")
    data_start, data_size = 8 + n, size - 8 - n
    entries = [_entry(where, name, info, data_start, data_size) for name, info in doc.items()]
    entries.sort(key=lambda e: e.start)
    for a, b in itertools.pairwise(entries):
        if b.start < a.start + a.nbytes:
            raise FormatError(f"{where}: tensors {a.name!r} and {b.name!r} overlap")
    return Header(where, tuple(entries), dict(meta), data_start)


def _entry(where: str, name: str, info: Any, data_start: int, data_size: int) -> Entry:
    try:
        st_dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        shape = tuple(shape)
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not isinstance(begin, int) \
                or not isinstance(end, int):
            raise TypeError
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"{where}: tensor {name!r}: malformed header entry {info!r}") from None
    if st_dtype not in DTYPES:
        raise DTypeMismatchError(f"{where}: tensor {name!r} has dtype {st_dtype}, which reshard does not store; "
                                 f"supported: {', '.join(DTYPES)}")
    dtype = DTYPES[st_dtype]
    nbytes = math.prod(shape) * numpy_dtype(dtype).itemsize
    if not 0 <= begin <= end <= data_size or end - begin != nbytes:
        raise FormatError(f"{where}: tensor {name!r}: data_offsets [{begin}, {end}] do not hold {st_dtype}"
                          f"{list(shape)} ({nbytes} bytes) within the {data_size} data bytes")
    return Entry(name, dtype, shape, data_start + begin, nbytes)


def read_tensor(f: Any, entry: Entry, where: str = "") -> np.ndarray:
    """One tensor's values from an open binary file (a new array: one tensor in memory)."""
    buf = np.empty(entry.nbytes, np.uint8)
    f.seek(entry.start)
    view: Any = memoryview(buf)  # type: ignore[arg-type]
    got = 0
    while got < entry.nbytes:
        n = f.readinto(view[got:])
        if not n:
            raise FormatError(f"{where}: tensor {entry.name!r} is cut short ({got} of {entry.nbytes} bytes)")
        got += n
    return buf.view(numpy_dtype(entry.dtype)).reshape(entry.shape)


def source_files(src: str | os.PathLike[str],
                 storage_options: Mapping[str, Any] | None = None) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of ``src`` and, for a sharded folder, its ``weight_map``.

    ``src`` is a ``.safetensors`` file, an ``*.safetensors.index.json`` file,
    or a folder holding ``model.safetensors.index.json`` (or another single
    ``*.safetensors.index.json``), else exactly one ``.safetensors`` file.
    """
    fs, fpath = _fs(str(src), storage_options)
    base = str(src).rstrip("/")
    if not fs.exists(fpath):
        raise CheckpointNotFoundError(f"{src} does not exist (a .safetensors file, an index, or a folder)")
    if fs.isdir(fpath):
        names = sorted(PurePosixPath(p).name for p in fs.ls(fpath, detail=False))
        indexes = [n for n in names if n.endswith(".safetensors.index.json")]
        if INDEX_NAME in indexes or len(indexes) == 1:
            return source_files(f"{base}/{INDEX_NAME if INDEX_NAME in indexes else indexes[0]}", storage_options)
        if indexes:
            raise FormatError(f"{src} holds several index files {indexes}; name one")
        files = [n for n in names if n.endswith(".safetensors")]
        if len(files) != 1:
            raise FormatError(f"{src} holds {len(files)} .safetensors files and no {INDEX_NAME}: "
                              + ("name the file" if files else "nothing to import"))
        return [f"{base}/{files[0]}"], None
    if base.endswith(".json"):
        with fs.open(fpath, "rb") as f:
            try:
                index = json.loads(f.read())
                weight_map = index["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise FormatError(f"{src}: not a safetensors index (no weight_map of tensor -> file)") from None
        folder = base.rsplit("/", 1)[0] if "/" in base else "."
        files = list(dict.fromkeys(weight_map.values()))
        for name in files:
            if "/" in name or name in ("", ".", ".."):
                raise FormatError(f"{src}: weight_map names a file outside its folder: {name!r}")
        return [f"{folder}/{n}" for n in files], dict(weight_map)
    return [base], None


def import_safetensors(src: str | os.PathLike[str], dst_url: str, *, layouts: LayoutSpec | None = None,
                       src_storage_options: Mapping[str, Any] | None = None, progress: bool | None = None,
                       **options: Any) -> Checkpoint:
    """Import a safetensors file or a sharded Hugging Face folder, one tensor in memory at a time.

    Parameters
    ----------
    src : path or URL
        A ``.safetensors`` file, a ``model.safetensors.index.json`` file, or a
        folder holding either (fsspec URLs work too).
    dst_url : str
        Where the checkpoint goes.
    layouts : mapping or callable, optional
        Saving layouts (``{name: Layout}`` or ``(name, shape) -> Layout``);
        default every tensor whole on rank 0.
    src_storage_options : dict, optional
        fsspec options for ``src`` (``dst_url``'s are ``storage_options``).
    progress : bool, optional
        A progress bar (default: when stderr is a terminal).
    **options
        As for :func:`reshard.store.create` (``overwrite``, ``compression``,
        ``storage_options`` of ``dst_url``...).

    Returns
    -------
    Checkpoint
        The new checkpoint, opened. Its leaves hold reshard's own leaves when
        the file came from :func:`export_safetensors`, and the files' other
        ``__metadata__`` entries under ``"__metadata__"``.

    Raises
    ------
    FormatError
        A malformed header or index, a tensor in two files, or a tensor the
        index names but its file lacks (names the file and the tensor).
    DTypeMismatchError
        A dtype reshard does not store.
    """
    files, weight_map = source_files(src, src_storage_options)
    headers = [read_header(f, src_storage_options) for f in files]  # every header is checked before writing
    where: dict[str, tuple[Header, Entry]] = {}
    for header in headers:
        for e in header.entries:
            if e.name in where:
                raise FormatError(f"tensor {e.name!r} is in both {where[e.name][0].path} and {header.path}")
            where[e.name] = (header, e)
    if weight_map is not None:
        for name, file in weight_map.items():
            held = where.get(name)
            if held is None or PurePosixPath(held[0].path).name != file:
                raise FormatError(f"{src}: the index puts tensor {name!r} in {file}, which does not hold it")
    refuse_empty("safetensors", src, len(where))
    leaves, extra = _leaves(headers)
    if extra:
        leaves[METADATA_LEAF] = extra
    rule = layouts if layouts is not None else (lambda n, s: Layout.single(s))
    chosen = {n: resolve_layout(rule, n, e.shape) for n, (_, e) in where.items()}
    writer = create(dst_url, chosen, **single_process(options))
    metas = {n: writer.meta(n, chosen[n], e.dtype, single_writer=True) for n, (_, e) in where.items()}
    from ..read.graph.schedule import progress_bar

    with progress_bar(sum(e.nbytes for _, e in where.values()), "import safetensors", progress, unit="B") as bar:
        for header in headers:
            fs, fpath = _fs(header.path, src_storage_options)
            with fs.open(fpath, "rb") as f:
                for e in header.entries:  # in file order: sequential reads
                    data = read_tensor(f, e, header.path)
                    writer.write_block(metas[e.name], tuple(slice(0, n) for n in e.shape), data)
                    del data
                    if bar is not None:
                        bar.update(e.nbytes)
    writer.write_manifests(metas, leaves)
    writer.commit()
    return open_checkpoint(dst_url, storage_options=options.get("storage_options"))


def _leaves(headers: list[Header]) -> tuple[dict[str, Any], dict[str, str]]:
    """reshard's leaves (``reshard.leaves``) and the other metadata entries of the files."""
    leaves: dict[str, Any] = {}
    extra: dict[str, str] = {}
    for h in headers:
        for key, value in h.metadata.items():
            if key == "reshard.leaves":
                try:
                    leaves.update(json.loads(value))
                except ValueError:
                    raise FormatError(f"{h.path}: __metadata__ reshard.leaves is not JSON") from None
            elif key != "format" or value != "pt":
                extra.setdefault(key, value)
    return leaves, extra


# ------------------------------------------------------------------ writing
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, an int as is (``transformers``' units)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if not m:
            raise ValueError(f"size {size!r}: use bytes or a number with KB, MB, GB, KiB, MiB, GiB...")
        value = int(float(m.group(1)) * _UNITS[m.group(2)])
    if value <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return value


def plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Cut tensors, in order, into shards of at most ``max_bytes`` (a larger tensor is a shard alone)."""
    shards: list[list[str]] = []
    used = 0
    for name, nbytes in sizes:
        if not shards or (used + nbytes > max_bytes and shards[-1]):
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def export_safetensors(src: str | Checkpoint, folder: str | os.PathLike[str], *,
                       max_shard_size: int | str = DEFAULT_SHARD_SIZE, names: Iterable[str] | None = None,
                       metadata: Mapping[str, str] | None = None, storage_options: Mapping[str, Any] | None = None,
                       **options: Any) -> dict[str, Any]:
    """Write a checkpoint as Hugging Face safetensors: one file, or shards and their index.

    Parameters
    ----------
    src : str or Checkpoint
        The checkpoint.
    folder : path
        Output folder (created). It gets ``model.safetensors`` when every
        tensor fits in one shard, else ``model-0000k-of-0000n.safetensors``
        and ``model.safetensors.index.json`` (``metadata.total_size``,
        ``weight_map``), as ``transformers``' ``save_pretrained`` writes them.
    max_shard_size : int or str
        Largest shard (``"5GB"``, ``"500MiB"``, bytes); a tensor larger than
        this is a shard alone.
    names : iterable of str, optional
        The tensors to export, in this order (default: all, sorted by name).
    metadata : mapping of str to str, optional
        Extra ``__metadata__`` entries of every file (the imported
        ``"__metadata__"`` leaf is written back there too).
    storage_options : dict, optional
        fsspec options of ``src``.
    **options
        As for :func:`reshard.store.read.export.export` (``budget``, ``scheduler``...).

    Returns
    -------
    dict
        ``{"files": [paths], "index": path or None, "total_size": bytes, "stats": IOStats}``.
    """
    opts = dict(storage_options) if storage_options is not None else None
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(str(src), storage_options=opts)
    chosen = list(names) if names is not None else sorted(ckpt.arrays)
    for name in chosen:
        if name == "__metadata__":
            raise BadNameError("a tensor named '__metadata__' cannot be stored in safetensors")
        ckpt.tensor(name)  # a TensorNotFoundError (with close matches) for what is not a tensor
    shards = plan_shards(((n, ckpt.arrays[n].nbytes) for n in chosen), parse_size(max_shard_size))
    out = os.fspath(folder)
    os.makedirs(out, exist_ok=True)
    extra = {k: v for k, v in (ckpt.leaves.get(METADATA_LEAF) or {}).items() if isinstance(v, str)}
    extra.update(metadata or {})
    files, weight_map = [], {}
    total: IOStats | None = None
    for k, part in enumerate(shards, 1):
        file = SINGLE_NAME if len(shards) == 1 else SHARD_NAME.format(k=k, n=len(shards))
        stats = ckpt.export(os.path.join(out, file), format="safetensors", names=part, metadata=extra, **options)
        total = stats if total is None else _add(total, stats)
        files.append(os.path.join(out, file))
        weight_map.update(dict.fromkeys(part, file))
    total_size = sum(ckpt.arrays[n].nbytes for n in chosen)
    index = None
    if len(shards) > 1:
        index = os.path.join(out, INDEX_NAME)
        doc = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        tmp = index + ".partial"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, index)
    return {"files": files, "index": index, "total_size": total_size, "stats": total}


def _add(a: IOStats, b: IOStats) -> IOStats:
    a.add(**b.as_dict())
    return a


__all__ = ["DEFAULT_SHARD_SIZE", "DTYPES", "INDEX_NAME", "METADATA_LEAF", "Entry", "Header", "export_safetensors",
           "import_safetensors", "parse_size", "plan_shards", "read_header", "read_tensor", "source_files"]
