"""The on-disk format: names, chunk grids, zarr v3 metadata documents.

Pure functions and records; no I/O here. See ``docs/format.md`` for the prose
version of every rule in this module.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import numpy as np
from reshard.layouts import Layout
from reshard.layouts.errors import BadNameError, FormatError

from .dtypes import numpy_dtype
from .grid import Grid, allowed_grids, shard_writer
from .schema_array import check_array

#: Version of the reshard layer on top of zarr v3 (attributes, marker, manifests).
FORMAT_VERSION = 2
#: Default target size of one inner chunk, the unit of reading.
DEFAULT_CHUNK_BYTES = 1 << 20
#: Inner chunks aim at 1/16 of a shard (so another layout's boundary wastes little),
#: but not below this size, nor above the chunk_bytes target.
MIN_CHUNK_BYTES = 64 << 10
META_DIR = ".reshard"
COMMIT_KEY = f"{META_DIR}/commit.json"
#: A copy of the committed generation's root document at the checkpoint's root, written with each commit
#: before its marker: a reader asks for it with the marker (one round trip, not two) and uses it when its
#: sha256 is the marker's ``metadata_sha256`` (else it reads the generation's own; docs/format.md).
HEAD_KEY = f"{META_DIR}/head.json"
LOCK_KEY = f"{META_DIR}/commit.lock"
MISSING = np.uint64(2**64 - 1)

_SAFE = re.compile(r"[A-Za-z0-9_-]")
_ALL_SAFE = re.compile(r"[A-Za-z0-9_-]+")


# --------------------------------------------------------------------- names
def escape_component(part: str, name: str) -> str:
    """Escape one dotted component of ``name`` into a safe zarr node name.

    Characters outside ``[A-Za-z0-9_-]`` become ``~XX`` (UTF-8 hex), so a name can
    never hold ``/``, ``..`` or anything a store or URL treats specially; a leading
    ``__`` (reserved by zarr) is escaped too.
    """
    if not part:
        raise BadNameError(f"tensor name {name!r} has an empty component")
    if _ALL_SAFE.fullmatch(part) and not part.startswith("__"):
        return part
    out = "".join(
        c if _SAFE.fullmatch(c) else "".join(f"~{b:02X}" for b in c.encode()) for c in part
    )
    if out.startswith("__"):
        out = "~5F" + out[1:]
    return out


def unescape_component(part: str) -> str:
    """Invert :func:`escape_component`."""
    raw = re.sub(rb"~([0-9A-F]{2})", lambda m: bytes([int(m.group(1), 16)]), part.encode())
    return raw.decode("utf-8")


@functools.lru_cache(maxsize=1 << 16)
def tensor_path(name: str) -> str:
    """Return the zarr path (``a/b/c``) of a dotted tensor name (``a.b.c``)."""
    if not isinstance(name, str) or not name:
        raise BadNameError(f"tensor name must be a non-empty string, got {name!r}")
    return "/".join(escape_component(p, name) for p in name.split("."))


def tensor_name(path: str) -> str:
    """Return the dotted tensor name of a zarr path (inverse of :func:`tensor_path`)."""
    return ".".join(unescape_component(p) for p in path.split("/"))


def stored_name(path: str, where: str) -> str:
    """The tensor name of a stored zarr path, refusing a path :func:`tensor_path` would not write."""
    try:
        name = tensor_name(path)
        if tensor_path(name) == path:
            return name
    except (UnicodeDecodeError, BadNameError):
        pass
    raise FormatError(f"{where}: {path!r} is not the stored form of a tensor name")


# --------------------------------------------------------------- chunk grids
def inner_chunk_shape(shard: tuple[int, ...], itemsize: int, target: int) -> tuple[int, ...]:
    """Choose the inner chunk (read unit) inside a shard.

    ``shard`` is what the chunk must divide along each dim: the shard shape, or
    under a rectilinear grid the gcd of each dim's shard edges
    (:meth:`reshard.store.format.grid.Grid.divisor`).

    Rule: keep trailing dims whole (a chunk is a run of C-order rows, so it lands
    contiguously in a destination with the same trailing extents) and take the
    largest divisor of the leading dim that keeps the chunk within ``target``
    bytes; if one row alone is over ``target``, do the same one dim further in.
    """
    chunk = list(shard)
    for d in range(len(shard)):
        row = itemsize * math.prod(chunk[d + 1 :])
        if row * chunk[d] <= target:
            break
        fit = max(1, target // row) if row <= target else 1
        chunk[d] = max(c for c in _divisors(shard[d]) if c <= fit)
        if row <= target:
            break
    return tuple(chunk)


def _divisors(n: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return sorted(set(small + [n // i for i in small]))


# ------------------------------------------------------------------ records
_T = TypeVar("_T")
_UNSET: Any = object()


class _Deferred(Generic[_T]):
    """A field of :class:`ArrayMeta` that a record made by :meth:`ArrayMeta.deferred`
    resolves on first access (every deferred field at once, from its ``source``).

    A non-data descriptor: once the value is in the instance's ``__dict__``
    (set by ``__init__`` or by resolving), attribute access finds it there at
    the speed of a plain attribute and never calls :meth:`__get__` again.
    """

    def __init__(self, *default: _T) -> None:
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _T: ...
    @overload
    def __get__(self, obj: ArrayMeta, owner: type | None = None) -> _T: ...

    def __get__(self, obj: ArrayMeta | None, owner: type | None = None) -> _T:
        if obj is None:  # dataclasses ask the class for the field's default
            if self.default:
                return self.default[0]
            raise AttributeError(self.name)
        found = obj.__dict__.get(self.name, _UNSET)
        if found is _UNSET:
            obj._resolve()
            found = obj.__dict__[self.name]
        return found

    if TYPE_CHECKING:  # for type checkers, the field's value type; no __set__ at run time (see above)
        def __set__(self, obj: ArrayMeta, value: _T) -> None: ...


@dataclass(frozen=True)
class ArrayMeta:
    """Everything needed to read one stored tensor: a plain record.

    A checkpoint opened from its summary holds *deferred* records (see
    :meth:`deferred`): name, shape and dtype are known at once, the other fields
    are parsed from the tensor's metadata document on first access, and checked
    then (:meth:`validate`), so opening costs nothing per tensor beyond the summary.

    Attributes
    ----------
    name : str
        Dotted tensor name.
    shape, dtype : tuple of int, str
        Global shape and stored dtype name.
    shard, chunk : tuple of int
        Shard (zarr chunk) shape and inner chunk shape. Under a rectilinear
        grid ``shard`` is the largest shard edge along each dim.
    layout : Layout
        The layout the tensor was saved with.
    checksums : bool
        Whether every inner chunk ends with a crc32c.
    compressor : str or None
        ``"zstd"`` or None.
    origin : JSON, optional
        Where the layout came from (framework details), stored with it.
    edges : tuple of tuple of int, optional
        Rectilinear shard grid: each dim's shard edge lengths (see
        :mod:`reshard.store.format.grid`); None for a regular grid.
    source : callable, optional
        For a deferred record: returns the full record.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    shard: _Deferred[tuple[int, ...]] = _Deferred()
    chunk: _Deferred[tuple[int, ...]] = _Deferred()
    layout: _Deferred[Layout] = _Deferred()
    checksums: _Deferred[bool] = _Deferred(True)
    compressor: _Deferred[str | None] = _Deferred(None)
    origin: _Deferred[Any] = _Deferred(None)
    edges: _Deferred[tuple[tuple[int, ...], ...] | None] = _Deferred(None)
    source: Callable[[], ArrayMeta] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def deferred(cls, name: str, shape: tuple[int, ...], dtype: str, source: Callable[[], ArrayMeta],
                 where: str = "") -> ArrayMeta:
        """A record knowing ``name``, ``shape`` and ``dtype``; ``source()`` gives the rest on first use.

        ``where``: the document the summary came from, named when the full record disagrees with it.
        """
        obj = object.__new__(cls)
        obj.__dict__.update(name=name, shape=shape, dtype=dtype, source=source, _where=where)
        return obj

    def _resolve(self) -> None:
        if self.source is None:
            raise AttributeError(f"tensor {self.name!r}: incomplete array record")
        full = self.source()
        if (full.name, full.shape, full.dtype) != (self.name, self.shape, self.dtype):
            where = self.__dict__.get("_where") or "the checkpoint"
            raise FormatError(f"{where}: tensor {self.name!r}: its metadata says {full.dtype}{list(full.shape)}, "
                              f"the summary {self.dtype}{list(self.shape)}")
        full.validate()
        for f in _DEFERRED:
            self.__dict__[f] = full.__dict__[f]
        self.__dict__["source"] = None  # complete now: a plain record (dask ships and tokenizes it)
        self.__dict__.pop("_where", None)

    def resolve(self) -> ArrayMeta:
        """Complete a deferred record now, checked against the summary (before buffers are sized by it)."""
        if not self.resolved:
            self._resolve()
        return self

    @property
    def resolved(self) -> bool:
        """Whether every field is known (always, except for a deferred record not used yet)."""
        return all(f in self.__dict__ for f in _DEFERRED)

    def validate(self) -> None:
        """Check the record is consistent (called once per deferred record, on first use).

        Raises
        ------
        FormatError
            Naming the tensor.
        """
        shard, chunk = self.shard, self.chunk
        if len(shard) != len(self.shape) or len(chunk) != len(self.shape):
            raise FormatError(f"tensor {self.name!r}: shard {list(shard)} or chunk {list(chunk)} does not match "
                              f"the rank of shape {list(self.shape)}")
        if self.edges is not None and any(sum(e) != n for e, n in zip(self.edges, self.shape, strict=True)):
            raise FormatError(f"tensor {self.name!r}: rectilinear shard edges {[list(e) for e in self.edges]} "
                              f"do not add up to shape {list(self.shape)}")
        if self.sharded and any(k < 1 or s % k for s, k in zip(self.chunk_grid.divisor(), chunk, strict=True)):
            what = "every shard edge" if self.edges is not None else f"shard {list(shard)}"
            raise FormatError(f"tensor {self.name!r}: inner chunk {list(chunk)} does not divide {what}")
        if tuple(self.layout.shape) != self.shape:
            raise FormatError(f"tensor {self.name!r}: layout is for shape {list(self.layout.shape)}, the array "
                              f"is {list(self.shape)}")

    @property
    def sharded(self) -> bool:
        """Whether the array uses the sharding codec (every array but those below; 0-d arrays have no grid).

        A rectilinear grid whose inner chunk is the largest shard (``chunk == shard``, which no sharded
        rectilinear grid can have: its chunk divides every edge, and its edges are not all equal) has no
        sharding codec: every grid cell is one chunk, its bytes [+ zstd] [+ crc32c] (a flat layout saved
        by its ranks, docs/format.md "Flattened-range layouts").
        """
        return not (self.edges is not None and self.shape and tuple(self.chunk) == tuple(self.shard))

    @functools.cached_property
    def path(self) -> str:
        """The zarr path of the tensor (computed once: every shard key uses it)."""
        return tensor_path(self.name)

    @functools.cached_property
    def np_dtype(self) -> np.dtype[Any]:
        return numpy_dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.np_dtype.itemsize

    @functools.cached_property
    def chunk_grid(self) -> Grid:
        """The shard grid (regular or rectilinear)."""
        return Grid(self.shape, self.shard, self.edges)

    @property
    def grid(self) -> tuple[int, ...]:
        """Number of shards along each dim."""
        return self.chunk_grid.counts

    @property
    def chunks_per_shard(self) -> tuple[int, ...]:
        """Inner chunks along each dim of a regular grid's shard (the largest shard of a rectilinear one)."""
        return tuple(s // c for s, c in zip(self.shard, self.chunk, strict=True))

    def chunks_in(self, index: tuple[int, ...]) -> tuple[int, ...]:
        """Inner chunks along each dim of the shard at ``index``."""
        if self.edges is None:
            return self.chunks_per_shard
        return tuple(s // c for s, c in zip(self.chunk_grid.extent(index), self.chunk, strict=True))

    def shard_key(self, index: tuple[int, ...]) -> str:
        """Storage key (relative to the checkpoint root) of the shard at ``index``."""
        return "/".join([self.path, "c", *map(str, index)])

    def shard_keys(self) -> Iterator[str]:
        """Every shard's key, in C order of the grid (:meth:`shard_key` of each index)."""
        if not self.shape:
            yield self.shard_key(())
            return
        head = f"{self.path}/c/"
        for parts in itertools.product(*([str(i) for i in range(n)] for n in self.grid)):
            yield head + "/".join(parts)

    def writer(self, index: tuple[int, ...]) -> int:
        """The rank that writes the shard at ``index`` (:func:`reshard.store.format.grid.shard_writer`)."""
        return shard_writer(self.layout, self.chunk_grid, index)

    def shard_region(self, index: tuple[int, ...]) -> tuple[slice, ...]:
        """Global region of a shard, clipped to the array."""
        return self.chunk_grid.region(index)

    def shards_in(self, region: tuple[slice, ...]) -> Iterator[tuple[int, ...]]:
        """Indices of the shards that intersect a global region (C order)."""
        return self.chunk_grid.shards_in(region)

    def shard_nbytes(self, index: tuple[int, ...]) -> int:
        """Bytes of the shard at ``index``, unencoded (its nominal shape: an edge shard of a regular grid is padded)."""
        return math.prod(self.chunk_grid.extent(index)) * self.np_dtype.itemsize

    @property
    def crc_nbytes(self) -> int:
        """Bytes of the crc32c stored after each chunk (0 without checksums)."""
        return 4 if self.checksums else 0

    @property
    def plain_chunk_nbytes(self) -> int:
        """Stored bytes of one uncompressed inner chunk: its values, padded to full size, and its crc32c."""
        return math.prod(self.chunk) * self.np_dtype.itemsize + self.crc_nbytes

    def index_nbytes(self, index: tuple[int, ...] | None = None) -> int:
        """Size of a shard's index (offset/nbytes pairs plus its crc32c); a rectilinear grid needs ``index``."""
        per = self.chunks_per_shard if index is None or self.edges is None else self.chunks_in(index)
        return 16 * math.prod(per) + 4

    def to_zarr_json(self) -> dict[str, Any]:
        """The array's ``zarr.json`` document (zarr v3, sharding_indexed)."""
        inner: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
        if self.compressor == "zstd":
            inner.append({"name": "zstd", "configuration": {"level": 3, "checksum": False}})
        if self.checksums:
            inner.append({"name": "crc32c"})
        attrs: dict[str, Any] = {"reshard": {"layout": self.layout.to_json()}}
        if self.origin is not None:
            attrs["reshard"]["origin"] = self.origin
        if self.shape and self.sharded:
            codecs: list[dict[str, Any]] = [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(self.chunk),
                        "codecs": inner,
                        "index_codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "crc32c"},
                        ],
                        "index_location": "end",
                    },
                }
            ]
        else:
            codecs = inner
        fill: Any = False if self.dtype == "bool" else 0
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": self.dtype,
            "chunk_grid": self.chunk_grid.to_json(),
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill,
            "codecs": codecs,
            "attributes": attrs,
            "storage_transformers": [],
            "dimension_names": dimension_names(self.name, len(self.shape)),
        }

    @classmethod
    def from_zarr_json(cls, name: str, doc: dict[str, Any], where: str = "zarr.json") -> ArrayMeta:
        """Read back :meth:`to_zarr_json`, strictly (see :func:`reshard.store.format.schema_array.check_array`).

        The shard grid must also be one of the grids its layout allows
        (:func:`reshard.store.format.grid.choose_grid`): an edited grid would
        read other shards' bytes.

        Raises
        ------
        FormatError
            Anything malformed, naming ``where`` and the tensor.
        """
        # Tensors of one shape, dtype and layout have one document but for their dimension names: checked once
        key = json.dumps({k: v for k, v in doc.items() if k != "dimension_names"}, separators=(",", ":")) \
            if isinstance(doc, dict) else None
        f = _CHECKED.get(key) if key is not None else None
        if f is None:
            f = check_array(name, doc, where)
            layout = f["layout"]
            if f["shape"]:
                allowed = allowed_grids(layout)
                if not any((g.shard, g.edges) == (f["shard"], f["edges"]) for g in allowed):
                    grid = [list(e) for e in f["edges"]] if f["edges"] is not None else list(f["shard"])
                    raise FormatError(f"{where}: tensor {name!r}: shard grid {grid} is not a grid of its "
                                      f"layout {layout.describe()}")
            if key is not None:
                if len(_CHECKED) >= _CHECKED_KEPT:
                    _CHECKED.clear()
                _CHECKED[key] = f
        return cls(name=name, shape=f["shape"], dtype=f["dtype"], shard=f["shard"], chunk=f["chunk"],
                   layout=f["layout"], checksums=f["checksums"], compressor=f["compressor"], origin=f["origin"],
                   edges=f["edges"])


#: Array documents checked (:meth:`ArrayMeta.from_zarr_json`), by their JSON without dimension names: a model's
#: layers repeat a few shapes and layouts over thousands of tensors (issue 26: 10,000 tensors opened 0.3 s faster).
_CHECKED: dict[str, dict[str, Any]] = {}
_CHECKED_KEPT = 4096


def dimension_names(name: str, ndim: int) -> list[str]:
    """The ``dimension_names`` of a tensor's array: ``<dotted name>.<axis>``.

    Unique per tensor, so xarray opens any group of a checkpoint as a Dataset
    without two tensors claiming one dimension with different sizes.
    """
    return [f"{name}.{axis}" for axis in range(ndim)]


_DEFERRED = tuple(f.name for f in fields(ArrayMeta) if isinstance(ArrayMeta.__dict__.get(f.name), _Deferred))


def group_json(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    """A zarr v3 group ``zarr.json`` document."""
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}
