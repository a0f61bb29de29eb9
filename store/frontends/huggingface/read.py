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
* :func:`export_safetensors` (in :mod:`.write`): a checkpoint -> a folder with
  ``model.safetensors`` (everything fits in ``max_shard_size``) or the numbered shards
  and their index.

A folder's other files (``config.json``, tokenizer files...) travel with the
checkpoint (:mod:`.folder`). Files that torch's ``HuggingFaceStorageWriter``
wrote per rank (``DCP_SHARDING_INFO`` in ``__metadata__``: each tensor's offsets
in the whole) are imported as the pieces they are: a folder of them gives
whole tensors; one such file alone is refused.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import numpy as np
from reshard.layouts import Layout
from reshard.layouts.errors import CheckpointNotFoundError, DTypeMismatchError, FormatError

from ...format.dtypes import SAFETENSORS_DTYPES, numpy_dtype
from ...format.tree import FILES_LEAF, METADATA_LEAF, LayoutSpec, resolve_layout
from ...io.localfs import PlainFiles, plain_root
from ...read.checkpoint import Checkpoint
from ...read.open import open as open_checkpoint
from ...write.writer import create, single_process
from ..sources import Skips, refuse_empty, source_path
from .folder import INDEX_NAME, collect_files

if TYPE_CHECKING:
    pass

#: safetensors dtype -> stored dtype name.
DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
#: The safetensors format refuses headers over 100 MB.
MAX_HEADER = 100_000_000
#: ``__metadata__`` entry of torch's ``HuggingFaceStorageWriter``: ``{name: {"saved_offsets": [...]}}``.
DCP_SHARDING_KEY = "DCP_SHARDING_INFO"


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
class _DuplicateKey(ValueError):
    """A JSON object naming one key twice (a safetensors header that is ambiguous: refused)."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a key given twice (``json.loads(object_pairs_hook=...)``)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out

def _fs(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """The file system and path of ``url``: a plain local path without fsspec (:class:`.PlainFiles`)."""
    root = None if storage_options else plain_root(str(url))
    if root is not None:
        return PlainFiles(), root
    import fsspec

    return fsspec.core.url_to_fs(str(url), **(storage_options or {}))


def read_header(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> Header:
    """Parse the header of a safetensors file (two small reads, no tensor data).

    Raises
    ------
    FormatError
        Not a safetensors file, or a header that breaks the format's rules
        (sizes, offsets outside the data, overlapping tensors, a name given
        twice), naming the file and the tensor.
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
        doc = json.loads(raw, object_pairs_hook=_unique)
    except _DuplicateKey as e:
        raise FormatError(f"{where}: the safetensors header names {e.args[0]!r} twice (a JSON object with a duplicate "
                          "key: which entry holds the tensor is ambiguous)") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
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
                or not isinstance(end, int) or not isinstance(st_dtype, str):
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
    index = index_file(src, storage_options)
    if index is not None:
        return read_index(index, storage_options)
    if fs.isdir(fpath):
        names = sorted(PurePosixPath(p).name for p in fs.ls(fpath, detail=False))
        files = [f"{base}/{n}" for n in names if n.endswith(".safetensors")]
        if len(files) > 1 and all(DCP_SHARDING_KEY in read_header(f, storage_options).metadata for f in files):
            return files, None  # torch's HuggingFaceStorageWriter, one file per rank
        if not files:
            raise CheckpointNotFoundError(f"{src} holds no .safetensors file and no {INDEX_NAME}: nothing to import")
        if len(files) > 1:
            raise FormatError(f"{src} holds {len(files)} .safetensors files and no {INDEX_NAME}: name the file")
        return files, None
    if DCP_SHARDING_KEY in read_header(base, storage_options).metadata:
        raise FormatError(f"{src} is one rank's file of a per-rank save ({DCP_SHARDING_KEY}: its tensors are pieces "
                          "at offsets in the whole): import the folder that holds every rank's file")
    return [base], None


def index_file(src: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The index ``src`` is (a ``*.json`` file), or the one its folder holds (``model.safetensors.index.json``,
    else its only ``*.safetensors.index.json``); None if it has none."""
    fs, fpath = _fs(str(src), storage_options)
    base = str(src).rstrip("/")
    if not fs.isdir(fpath):
        return base if base.endswith(".json") else None
    indexes = sorted(n for n in (PurePosixPath(p).name for p in fs.ls(fpath, detail=False))
                     if n.endswith(".safetensors.index.json"))
    if len(indexes) > 1 and INDEX_NAME not in indexes:
        raise FormatError(f"{src} holds several index files {indexes}; name one")
    return f"{base}/{INDEX_NAME if INDEX_NAME in indexes else indexes[0]}" if indexes else None


def read_index(index: str, storage_options: Mapping[str, Any] | None = None) -> tuple[list[str], dict[str, str]]:
    """The files a Hugging Face index names, in its folder, and its ``weight_map`` (tensor -> file name).

    Raises
    ------
    FormatError
        Naming the index: over :data:`MAX_HEADER` bytes, not JSON, no ``weight_map`` of tensor -> file, a file
        outside its folder or missing.
    """
    fs, fpath = _fs(index, storage_options)
    size = fs.size(fpath)
    if size > MAX_HEADER:
        raise FormatError(f"{index} is {size} bytes, over the {MAX_HEADER}-byte limit of a safetensors index")
    with fs.open(fpath, "rb") as f:
        try:
            weight_map = json.loads(f.read(MAX_HEADER))["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError
        except (ValueError, KeyError, TypeError, RecursionError):
            raise FormatError(f"{index}: not a safetensors index (no weight_map of tensor -> file)") from None
    folder = index.rsplit("/", 1)[0] if "/" in index else "."
    files = list(dict.fromkeys(weight_map.values()))
    for name in files:
        if "/" in name or "\\" in name or name in ("", ".", ".."):
            raise FormatError(f"{index}: weight_map names a file outside its folder: {name!r:.200}")
        if not fs.exists(_fs(f"{folder}/{name}", storage_options)[1]):
            raise FormatError(f"{index}: weight_map names {name!r:.200}, which is not in {folder}")
    return [f"{folder}/{n}" for n in files], dict(weight_map)


def import_safetensors(src: str | os.PathLike[str], dst_url: str, *, layouts: LayoutSpec | None = None,
                       src_storage_options: Mapping[str, Any] | None = None, progress: bool | None = None,
                       skip: Sequence[str] = (), **options: Any) -> Checkpoint:
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
        A progress bar (default: on a terminal or in a notebook).
    skip : sequence of str
        ``__metadata__`` entries the import may leave out (``"__metadata__.<key>"``, globs or
        dotted prefixes, :class:`~reshard.store.frontends.sources.Skips`): a key that shards give
        different values (the first file's is kept). Without it that raises :class:`FormatError`;
        what is skipped is recorded in the leaf ``reshard.skipped``.
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
    src = source_path(src)
    files, weight_map = source_files(src, src_storage_options)
    headers = [read_header(f, src_storage_options) for f in files]  # every header is checked before writing
    pieces = _pieces(str(src), headers)
    if weight_map is not None:
        for name, file in weight_map.items():
            held = pieces.get(name)
            if held is None or PurePosixPath(held[0].header.path).name != file:
                raise FormatError(f"{index_file(src, src_storage_options)}: the index puts tensor {name!r} in "
                                  f"{file}, which does not hold it")
    refuse_empty("safetensors", src, len(pieces))
    skips = Skips(skip)
    leaves, extra = _leaves(headers, skips)
    skips.check()
    leaves.update(skips.leaves())
    if extra:
        leaves[METADATA_LEAF] = extra
    fs, fpath = _fs(str(src), src_storage_options)
    if fs.isdir(fpath) or weight_map is not None:
        folder = str(src).rstrip("/") if fs.isdir(fpath) else str(src).rstrip("/").rsplit("/", 1)[0]
        kept = collect_files(folder, *_fs(folder, src_storage_options))
        if kept:
            leaves[FILES_LEAF] = kept
    shapes = {n: _whole_shape(ps) for n, ps in pieces.items()}
    split = [n for n, ps in pieces.items() if len(ps) > 1]
    if split and layouts is not None:
        raise ValueError(f"{src} holds tensors in pieces ({split[0]!r}...): import it as saved, then redivide")
    rule = layouts if layouts is not None else (lambda n, s: Layout.single(s))
    chosen = {n: Layout.from_blocks(shapes[n], [(i, p.offsets, p.entry.shape, 0) for i, p in enumerate(ps)])
              if len(ps) > 1 else resolve_layout(rule, n, shapes[n]) for n, ps in pieces.items()}
    writer = create(dst_url, chosen, **single_process(options))
    metas = {n: writer.meta(n, chosen[n], ps[0].entry.dtype, single_writer=True) for n, ps in pieces.items()}
    from ...io.progress import progress_bar

    offsets = {(p.header.path, p.entry.name): p.offsets for ps in pieces.values() for p in ps}
    with progress_bar(sum(m.nbytes for m in metas.values()), "import safetensors", progress, unit="B") as bar:
        for header in headers:
            fs, fpath = _fs(header.path, src_storage_options)
            with fs.open(fpath, "rb") as f:
                for e in header.entries:  # in file order: sequential reads
                    data = read_tensor(f, e, header.path)
                    at = offsets[header.path, e.name]
                    writer.write_block(metas[e.name], tuple(slice(o, o + n) for o, n in zip(at, e.shape, strict=True)),
                                       data)
                    del data
                    if bar is not None:
                        bar.update(e.nbytes)
    writer.write_manifests(metas, leaves)
    writer.commit()
    return open_checkpoint(dst_url, storage_options=options.get("storage_options"))


@dataclass(frozen=True)
class Piece:
    """One stored piece of a tensor: its entry, its file's header and where it sits in the whole."""

    header: Header
    entry: Entry
    offsets: tuple[int, ...]


def _pieces(src: str, headers: list[Header]) -> dict[str, list[Piece]]:
    """Every tensor's pieces: one per tensor, or one per file for torch's per-rank files (``DCP_SHARDING_INFO``).

    Raises
    ------
    FormatError
        A tensor in two files without sharding information, pieces of one
        tensor that overlap, leave parts of it out (a lone rank file) or
        disagree on the dtype.
    """
    pieces: dict[str, list[Piece]] = {}
    for h in headers:
        info = _sharding(h)
        for e in h.entries:
            offsets = info.get(e.name, (0,) * len(e.shape)) if info is not None else (0,) * len(e.shape)
            if len(offsets) != len(e.shape):
                raise FormatError(f"{h.path}: {DCP_SHARDING_KEY} gives tensor {e.name!r} offsets {list(offsets)} "
                                  f"for a {len(e.shape)}-d piece")
            held = pieces.setdefault(e.name, [])
            if held and (info is None or _sharding(held[0].header) is None):
                raise FormatError(f"tensor {e.name!r} is in both {held[0].header.path} and {h.path}")
            if held and held[0].entry.dtype != e.dtype:
                raise FormatError(f"tensor {e.name!r} is {held[0].entry.dtype} in {held[0].header.path} "
                                  f"and {e.dtype} in {h.path}")
            held.append(Piece(h, e, offsets))
    for name, ps in pieces.items():
        shape = _whole_shape(ps)
        boxes = [tuple(zip(p.offsets, p.entry.shape, strict=True)) for p in ps]
        covered = sum(math.prod(p.entry.shape) for p in ps)
        overlap = any(all(a0 < b0 + bn and b0 < a0 + an for (a0, an), (b0, bn) in zip(a, b, strict=True))
                      for i, a in enumerate(boxes) for b in boxes[i + 1:])
        if overlap or covered != math.prod(shape):
            raise FormatError(
                f"{src}: tensor {name!r}: the pieces in {sorted({p.header.path for p in ps})} "
                + ("overlap" if overlap else f"hold {covered} of its {math.prod(shape)} elements")
                + f" ({DCP_SHARDING_KEY}: files of a per-rank save; import the folder that holds every rank's file)")
    return pieces


def _sharding(header: Header) -> dict[str, tuple[int, ...]] | None:
    raw = header.metadata.get(DCP_SHARDING_KEY)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        return {n: tuple(int(o) for o in v["saved_offsets"]) for n, v in doc.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        raise FormatError(f"{header.path}: __metadata__ {DCP_SHARDING_KEY} is not "
                          "{name: {saved_offsets: [int...]}}") from None


def _whole_shape(pieces: list[Piece]) -> tuple[int, ...]:
    return tuple(max(o + n for o, n in dims) for dims in zip(*(zip(p.offsets, p.entry.shape, strict=True)
                                                               for p in pieces), strict=True))


def _leaves(headers: list[Header], skips: Skips) -> tuple[dict[str, Any], dict[str, str]]:
    """reshard's leaves (``reshard.leaves``) and the other metadata entries of the files (the first file's
    value of each; another file's different value goes to ``skips``)."""
    leaves: dict[str, Any] = {}
    extra: dict[str, str] = {}
    first: dict[str, str] = {}
    for h in headers:
        for key, value in h.metadata.items():
            if key == "reshard.leaves":
                try:
                    leaves.update(json.loads(value))
                except ValueError:
                    raise FormatError(f"{h.path}: __metadata__ reshard.leaves is not JSON") from None
            elif key not in ("format", DCP_SHARDING_KEY, "DCP_VERSION"):  # per file (every export writes "pt")
                if extra.setdefault(key, value) != value:
                    skips.add(f"__metadata__.{key}", f"{h.path}: __metadata__ entry {key!r}",
                              f"its value differs from the one in {first[key]}, which is kept")
                first.setdefault(key, h.path)
    return leaves, extra


__all__ = ["DCP_SHARDING_KEY", "DTYPES", "FILES_LEAF", "INDEX_NAME", "METADATA_LEAF", "Entry", "Header", "Piece",
           "import_safetensors", "index_file", "read_header", "read_index", "read_tensor", "source_files"]
