"""Strict checks of a zarr v3 array's or group's own ``zarr.json`` as reshard writes it (the rules of
:mod:`.schema`, which holds the shared helpers and every other document's checks; ``meta`` and ``verify``
import these)."""

from __future__ import annotations

import math
from typing import Any

from reshard.layouts.errors import FormatError

from .dtypes import numpy_dtype
from .grid import Grid
from .schema import (
    MAX_CHUNK_BYTES,
    MAX_CHUNKS_PER_SHARD,
    MAX_ELEMENTS,
    MAX_NDIM,
    MAX_SHARDS,
    dtype_of,
    fail,
    get,
    int_list,
    is_int,
    layout_of,
)

_SHARD_CONFIG = {"chunk_shape", "codecs", "index_codecs", "index_location"}
_INDEX_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


def check_array(name: str, doc: Any, where: str) -> dict[str, Any]:
    """An array ``zarr.json`` written by reshard, typed; returns its fields.

    Returns ``shape``, ``dtype``, ``shard``, ``chunk``, ``checksums``,
    ``compressor``, ``layout`` (parsed and matching the shape) and ``origin``.
    """
    at = f"{where}: tensor {name!r}"
    if not isinstance(doc, dict):
        raise FormatError(f"{at}: array document must be a JSON object")
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
        raise FormatError(f"{at}: not a zarr v3 array document (zarr_format {doc.get('zarr_format')!r}, "
                          f"node_type {doc.get('node_type')!r})")
    shape = int_list(get(doc, "shape", at), at, "shape")
    dtype = dtype_of(get(doc, "data_type", at), at)
    check_shape(at, shape)
    grid = grid_of(get(doc, "chunk_grid", at), shape, at)
    shard = grid.shard
    encoding = doc.get("chunk_key_encoding")
    if encoding != {"name": "default", "configuration": {"separator": "/"}}:
        raise fail(at, "chunk_key_encoding", "the default encoding with separator '/'", encoding)
    codecs = get(doc, "codecs", at)
    if type(codecs) is not list or not codecs or not all(isinstance(c, dict) for c in codecs):
        raise fail(at, "codecs", "a non-empty list of codec objects", codecs)
    if shape and grid.edges is not None and codecs[0].get("name") != "sharding_indexed":
        chunk, inner = shard, codecs  # every cell of a rectilinear grid its own chunk (ArrayMeta.sharded)
    elif shape:
        cfg = codecs[0].get("configuration")
        if (len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed" or not isinstance(cfg, dict)
                or set(cfg) != _SHARD_CONFIG or cfg["index_location"] != "end" or cfg["index_codecs"] != _INDEX_CODECS):
            raise fail(at, "codecs", "one sharding_indexed codec (index at the end, with crc32c)", codecs)
        chunk = int_list(cfg["chunk_shape"], at, "chunk_shape", minimum=1, length=len(shape))
        if any(s % c for s, c in zip(grid.divisor(), chunk, strict=True)):
            what = f"shard {list(shard)}" if grid.edges is None else "every shard edge"
            raise FormatError(f"{at}: chunk {list(chunk)} does not divide {what}")
        inner = cfg["codecs"]
    else:
        chunk, inner = (), codecs
    names = [c.get("name") for c in inner] if type(inner) is list and all(isinstance(c, dict) for c in inner) else None
    if names not in (["bytes"], ["bytes", "crc32c"], ["bytes", "zstd"], ["bytes", "zstd", "crc32c"]) \
            or inner[0].get("configuration") != {"endian": "little"}:
        raise fail(at, "inner codecs", "bytes (little endian) [+ zstd] [+ crc32c]", inner)
    check_sizes(at, shape, dtype, grid, chunk)
    attrs = get(doc, "attributes", at)
    rs = get(attrs, "reshard", at)
    layout = layout_of(get(rs, "layout", at), at, shape)
    origin = rs.get("origin")
    if origin is not None and not isinstance(origin, dict):
        raise fail(at, "attributes.reshard.origin", "an object or null", origin)
    return {"shape": shape, "dtype": dtype, "shard": shard, "edges": grid.edges, "chunk": chunk, "layout": layout,
            "checksums": "crc32c" in names, "compressor": "zstd" if "zstd" in names else None, "origin": origin}


def check_shape(at: str, shape: tuple[int, ...]) -> None:
    """Refuse a tensor of more than :data:`MAX_NDIM` dimensions or :data:`MAX_ELEMENTS` elements."""
    if len(shape) > MAX_NDIM:
        raise FormatError(f"{at}: {len(shape)} dimensions, over the limit of {MAX_NDIM}")
    if math.prod(shape) > MAX_ELEMENTS:
        raise FormatError(f"{at}: shape {list(shape)} has {math.prod(shape)} elements, over the limit of "
                          f"{MAX_ELEMENTS}")


def check_sizes(at: str, shape: tuple[int, ...], dtype: str, grid: Grid, chunk: tuple[int, ...]) -> None:
    """Refuse an array whose counts exceed the limits above, before anything is allocated for it.

    Cheap arithmetic on the document: its shards, the inner chunks of a
    shard, the bytes of one inner chunk.
    """
    if not shape:
        return
    shards = math.prod(grid.counts)
    if shards > MAX_SHARDS:
        raise FormatError(f"{at}: {shards} shards, over the limit of {MAX_SHARDS} per tensor")
    chunks = math.prod(-(-s // c) for s, c in zip(grid.shard, chunk, strict=True))
    if chunks > MAX_CHUNKS_PER_SHARD:
        raise FormatError(f"{at}: inner chunk {list(chunk)} makes {chunks} chunks per shard, over the limit of "
                          f"{MAX_CHUNKS_PER_SHARD}")
    nbytes = math.prod(chunk) * numpy_dtype(dtype).itemsize
    if nbytes > MAX_CHUNK_BYTES:
        raise FormatError(f"{at}: inner chunk {list(chunk)} is {nbytes} bytes, over the limit of {MAX_CHUNK_BYTES}")


def grid_of(doc: Any, shape: tuple[int, ...], at: str) -> Grid:
    """An array's ``chunk_grid``: regular, or rectilinear with edges adding up to the shape."""
    if not isinstance(doc, dict) or doc.get("name") not in ("regular", "rectilinear") \
            or not isinstance(doc.get("configuration"), dict):
        raise fail(at, "chunk_grid", "a regular or rectilinear chunk grid", doc)
    if doc["name"] == "regular":
        int_list(doc["configuration"].get("chunk_shape"), at, "chunk_grid.configuration.chunk_shape", minimum=1,
                 length=len(shape))
    else:  # the edges a rectilinear grid spells, counted before they are expanded
        specs = doc["configuration"].get("chunk_shapes")
        for spec, n in zip(specs if isinstance(specs, list) else [], shape, strict=False):
            count = (-(-n // spec) if is_int(spec) and spec >= 1 else
                     sum(int(i[1]) if type(i) is list and len(i) == 2 and is_int(i[1]) else 1 for i in spec)
                     if isinstance(spec, list) else 0)
            if count > MAX_SHARDS:
                raise FormatError(f"{at}: its rectilinear chunk grid spells {count} edges along one dimension, "
                                  f"over the limit of {MAX_SHARDS} shards per tensor")
    try:
        grid = Grid.from_json(shape, doc)
    except FormatError as e:
        raise FormatError(f"{at}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise fail(at, "chunk_grid", f"a valid {doc['name']} chunk grid ({e})", doc) from None
    if grid.edges is not None and any(sum(e) != n for e, n in zip(grid.edges, shape, strict=True)):
        raise fail(at, "chunk_grid", f"rectilinear edges that add up to shape {list(shape)}", doc)
    return grid


def check_group(doc: Any, where: str) -> None:
    """A group ``zarr.json`` (not the root): a zarr v3 group."""
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise FormatError(f"{where}: not a zarr v3 group document")
