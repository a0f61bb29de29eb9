"""Parquet references: what plain zarr-python + fsspec read a large packed save through, a tensor at a time.

``refs.json`` maps every shard of a save: tens of bytes a shard, parsed whole by
fsspec before zarr reads anything (3 GB at 4,096 ranks x 10,000 tensors). fsspec's
lazy references (``fsspec.implementations.reference.LazyReferenceMapper``, what
``reference://`` opens when ``fo`` is a folder) keep the documents in one small JSON
object and the shard locations in parquet files, one folder per array, read only
when that array is read. The commit writes them beside ``refs.json`` when pyarrow
is installed (``pip install "reshard[parquet]"``)::

    gen-<id>/refs.parq/.zmetadata            {"metadata": {...documents...}, "record_size": N}
    gen-<id>/refs.parq/<array path>/refs.0.parq   columns path, offset, size, raw (one row a shard)

fsspec's mapper finds a key's row from zarr v2 style chunk keys (``<array
path>/<i>.<j>``, the row: C-order position in the grid), so the documents served
here name zarr's ``v2`` chunk key encoding with ``.`` (a zarr v3 encoding every v3
reader knows) and give each array a ``<array path>/.zarray`` entry with its grid
(fsspec's mapper reads its chunk counts there; zarr v3 never reads it). Same
arrays, same shard bytes, other shard keys. The ``path`` column holds object keys
under the checkpoint root: fsspec resolves them through a ``dir`` filesystem
rooted there (docs/format.md has the recipe), so a moved checkpoint stays valid.
Pure functions over arrays; the commit does the writing.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import io
import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from reshard.layouts.errors import FormatError

#: Folder of a packed save's parquet references, relative to its generation.
PARQUET_KEY = "refs.parq"
#: Shards from which a commit writes parquet references by default (``refs.json`` is then ~10 MB or more,
#: all of which fsspec parses before zarr reads one tensor); fewer: ``refs.json`` alone, unless asked.
MIN_SHARDS = 1 << 17
#: Rows of one parquet file: every shard of a tensor in one file (up to this many shards).
RECORD_SIZE = 1 << 17
#: zarr v3's chunk key encoding fsspec's lazy references can look keys up by.
V2_KEYS = {"name": "v2", "configuration": {"separator": "."}}


def available() -> bool:
    """Whether parquet references can be written here (pyarrow installed)."""
    try:
        import pandas  # noqa: F401
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return False
    return True


def metadata(root: bytes, paths: Sequence[str], grids: Sequence[tuple[int, ...]]) -> bytes:
    """The ``.zmetadata`` object: the root document (its arrays with ``v2`` chunk keys) and each array's grid."""
    doc = json.loads(root)
    for entry in doc.get("consolidated_metadata", {}).get("metadata", {}).values():
        if entry.get("node_type") == "array":
            entry["chunk_key_encoding"] = copy.deepcopy(V2_KEYS)
    meta: dict[str, Any] = {"zarr.json": doc}
    for path, grid in zip(paths, grids, strict=True):
        meta[f"{path}/.zarray"] = {"shape": list(grid), "chunks": [1] * len(grid)}
    return json.dumps({"metadata": meta, "record_size": RECORD_SIZE}, separators=(",", ":")).encode()


def records(paths: Sequence[str], grids: Sequence[tuple[int, ...]]) -> Iterator[tuple[int, str, int, int]]:
    """``(tensor t, key under refs.parq, lo, hi)`` of every parquet file, tensor by tensor: the file of tensor
    ``t``'s shards ``lo`` to ``hi`` (C order of its grid; every shard of a tensor up to :data:`RECORD_SIZE`)."""
    for t, (path, grid) in enumerate(zip(paths, grids, strict=True)):
        n = int(np.prod(grid)) if grid else 1
        for record, lo in enumerate(range(0, n, RECORD_SIZE)):
            yield t, f"{path}/refs.{record}.parq", lo, min(n, lo + RECORD_SIZE)


def files(paths: Sequence[str], grids: Sequence[tuple[int, ...]], objects: Sequence[str], obj: np.ndarray,
          off: np.ndarray, length: np.ndarray) -> Iterator[tuple[str, Any]]:
    """``(key under refs.parq, the arguments of :func:`encode` making its bytes)`` for each parquet file.

    Shards as :func:`reshard.store.format.refs.stream` takes them: tensor ``t`` from its
    start in ``obj``/``off``/``length``, in C order of its grid.
    """
    starts = np.concatenate([[0], np.cumsum([int(np.prod(g)) if g else 1 for g in grids])]).astype(np.int64)
    for t, key, lo, hi in records(paths, grids):
        at = int(starts[t])
        yield key, (objects, obj[at + lo : at + hi], off[at + lo : at + hi], length[at + lo : at + hi])


def keys(paths: Sequence[str], grids: Sequence[tuple[int, ...]]) -> list[str]:
    """Every file's key under ``refs.parq`` (``.zmetadata`` last), as :func:`files` and the commit write them."""
    return [*(key for _, key, _, _ in records(paths, grids)), ".zmetadata"]


def digest(shas: Sequence[str]) -> str:
    """The digest a commit marker records of a save's parquet references: the sha256 of the files' sha256s (hex,
    one a line) in the order of :func:`keys`."""
    return hashlib.sha256("".join(f"{s}\n" for s in shas).encode()).hexdigest()


def encode(objects: Sequence[str], obj: np.ndarray, off: np.ndarray, length: np.ndarray) -> bytes:
    """One parquet file of shard locations: ``path`` (dictionary-encoded object keys), ``offset``, ``size``, ``raw``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = int(obj.size)
    schema = _schema()
    paths = pa.DictionaryArray.from_arrays(pa.array(obj.astype(np.int32)), pa.array(list(objects), pa.string()))
    table = pa.table([paths.cast(pa.string()), pa.array(off), pa.array(length), pa.nulls(n, pa.binary())],
                     schema=schema)
    out = io.BytesIO()
    pq.write_table(table, out, compression="zstd", write_statistics=False)
    return out.getvalue()


def decode(where: str, raw: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows of one parquet file of shard locations: (object keys, offsets, lengths), as plain zarr's reader
    (fsspec's lazy references) takes them.

    Raises
    ------
    FormatError
        Not a parquet file of the columns :func:`encode` writes (``path`` strings, ``offset`` and ``size``
        integers), or a row with inline bytes (``raw``: fsspec would serve those instead of the object's).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(pa.BufferReader(raw), pre_buffer=False).read(columns=["path", "offset", "size", "raw"],
                                                                            use_threads=False)
    except (pa.ArrowException, OSError, ValueError, KeyError) as e:
        raise FormatError(f"{where}: not a parquet file of shard references ({e})") from None
    types = [table.schema.field(c).type for c in ("path", "offset", "size")]
    if not pa.types.is_string(types[0]) or not all(pa.types.is_integer(t) for t in types[1:]):
        raise FormatError(f"{where}: its columns path, offset, size are {[str(t) for t in types]}, not a string "
                          "and two integers")
    if table.column("raw").null_count != table.num_rows:
        raise FormatError(f"{where}: rows with inline bytes (column raw): plain zarr would read those, not the "
                          "shards")
    paths, offsets, sizes = (table.column(c).to_numpy(zero_copy_only=False) for c in ("path", "offset", "size"))
    return paths, offsets, sizes


@functools.lru_cache(maxsize=1)
def _schema() -> Any:
    """The files' columns, with pandas' description of them: without it fastparquet (the engine fsspec's mapper
    reads with by default) takes pyarrow's int64 columns for float64, and fsspec cannot seek to a float."""
    import pandas as pd
    import pyarrow as pa

    schema = pa.schema([pa.field("path", pa.string()), pa.field("offset", pa.int64(), nullable=False),
                        pa.field("size", pa.int64(), nullable=False), pa.field("raw", pa.binary())])
    empty = pd.DataFrame({"path": pd.Series([], dtype=object), "offset": np.zeros(0, np.int64),
                          "size": np.zeros(0, np.int64), "raw": pd.Series([], dtype=object)})
    return schema.with_metadata(pa.Table.from_pandas(empty, schema=schema, preserve_index=False).schema.metadata)
