"""Lazy views of stored tensors: indexing builds a view, ``read()`` does the I/O.

A view keeps, for every stored dim, either the one coordinate it was indexed
with (the dim is dropped) or the coordinates it selects along that dim: a
``range`` (slices, steps and negative steps included: no memory) or an integer
array (lists, integer and boolean arrays). New axes (``None``) are output axes
without a stored dim. Views compose (``t[::2][[0, -1]]``) without I/O.

Reading fetches only the inner chunks that hold selected coordinates: along
each dim the selected coordinates are grouped into runs that skip no whole
chunk, and only the blocks those runs span are read.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import TYPE_CHECKING, Any

import numpy as np
from reshard.layouts import Layout

from ..format.meta import ArrayMeta

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

Region = tuple[slice, ...]
#: The coordinates a view selects along one output axis.
Coords = range | np.ndarray
#: One output axis: the stored dim it walks (None for a new axis) and its coordinates.
Axis = tuple[int | None, Coords]


class LazyTensor:
    """A lazy view of a stored tensor (or of a selection of it): no I/O until read.

    Indexing follows numpy: integers (negative too), slices with any step
    (negative too), ``...``, ``None``, and one integer array, list or boolean
    mask per index (``t[[0, 5, -1]]``, ``t[:, mask]``); chain indexes for an
    outer selection over several dims (``t[rows][:, cols]``).
    """

    def __init__(self, ckpt: Checkpoint, meta: ArrayMeta, region: Region | None = None,
                 keep: tuple[bool, ...] | None = None, *, axes: tuple[Axis, ...] | None = None,
                 fixed: dict[int, int] | None = None) -> None:
        self.ckpt = ckpt
        self.meta = meta
        if axes is None and region is None and keep is None:  # the whole tensor (every ``ckpt[name]``)
            axes, fixed = tuple((d, range(n)) for d, n in enumerate(meta.shape)), None
        elif axes is None:
            region = region if region is not None else tuple(slice(0, n) for n in meta.shape)
            keep = keep if keep is not None else (True,) * len(meta.shape)
            axes = tuple((d, range(r.start, r.stop)) for d, (r, k) in enumerate(zip(region, keep, strict=True)) if k)
            fixed = {d: r.start for d, (r, k) in enumerate(zip(region, keep, strict=True)) if not k}
        self.axes: tuple[Axis, ...] = axes
        #: Stored dims indexed by one integer: ``{dim: coordinate}``.
        self.fixed: dict[int, int] = dict(fixed or {})

    # ------------------------------------------------------------ properties
    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(c) for _, c in self.axes)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.meta.np_dtype

    @property
    def layout(self) -> Layout:
        return self.meta.layout

    @property
    def ndim(self) -> int:
        return len(self.axes)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def region(self) -> Region:
        """The stored region that bounds the view (one slice per stored dim)."""
        out = []
        for d in range(len(self.meta.shape)):
            if d in self.fixed:
                out.append(slice(self.fixed[d], self.fixed[d] + 1))
            else:
                out.append(slice(*_bounds(self._coords(d))))
        return tuple(out)

    @property
    def keep(self) -> tuple[bool, ...]:
        """For each stored dim, whether the view keeps it (False: indexed by one integer)."""
        return tuple(d not in self.fixed for d in range(len(self.meta.shape)))

    @property
    def is_box(self) -> bool:
        """True when the view is a plain region: step-1 ranges, no new axes (what dask graphs take)."""
        return all(d is not None for d, _ in self.axes) and self._contiguous()

    def _contiguous(self) -> bool:
        return all(isinstance(c, range) and (c.step == 1 or len(c) <= 1) for d, c in self.axes if d is not None)

    def _coords(self, d: int) -> Coords:
        return next(c for a, c in self.axes if a == d)

    def __len__(self) -> int:
        if not self.axes:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        return (f"<LazyTensor {self.name!r} shape={self.shape} dtype={self.meta.dtype} "
                f"layout={self.layout.describe()}>")

    def _repr_html_(self) -> str:
        from .display import tensor_html

        return tensor_html(self)

    # --------------------------------------------------------------- indexing
    def __getitem__(self, key: Any) -> LazyTensor:
        key = _normalize(key if isinstance(key, tuple) else (key,), self.name)
        used = sum(1 for k in key if k is not None and k is not Ellipsis)
        if used > self.ndim:
            raise IndexError(f"{self.name!r}: too many indices ({used}) for {self.ndim} dims")
        dots = [i for i, k in enumerate(key) if k is Ellipsis]
        if dots:
            i = dots[0]
            key = key[:i] + (slice(None),) * (self.ndim - used) + key[i + 1:]
        else:
            key = key + (slice(None),) * (self.ndim - used)
        _check_advanced(key, self.name)
        axes: list[Axis] = []
        fixed = dict(self.fixed)
        pos = 0
        for k in key:
            if k is None:
                axes.append((None, range(1)))
                continue
            dim, coords = self.axes[pos]
            pos += 1
            size = len(coords)
            if isinstance(k, slice):
                axes.append((dim, coords[k]))
            elif isinstance(k, np.ndarray):
                if k.dtype == np.bool_:
                    if len(k) != size:
                        raise IndexError(f"{self.name!r}: boolean index of length {len(k)} for a dim of {size}")
                    k = np.flatnonzero(k)
                bad = (k < -size) | (k >= size)
                if bad.any():
                    raise IndexError(f"{self.name!r}: index {int(k[bad][0])} out of range for a dim of {size}")
                idx = np.where(k < 0, k + size, k)
                arr = np.asarray(coords[idx]) if isinstance(coords, np.ndarray) else \
                    coords.start + coords.step * idx
                axes.append((dim, arr.astype(np.int64)))
            else:
                if not -size <= k < size:
                    raise IndexError(f"{self.name!r}: index {k} out of range for a dim of {size}")
                if dim is not None:
                    fixed[dim] = int(coords[k])
        return LazyTensor(self.ckpt, self.meta, axes=tuple(axes), fixed=fixed)

    # ---------------------------------------------------------------- reading
    def read(self) -> np.ndarray:
        """Read the view's values, fetching only the inner chunks that hold selected elements."""
        shape = self.shape
        if math.prod(shape) == 0:
            return np.empty(shape, dtype=self.dtype)
        stored = tuple(len(c) for d, c in self.axes if d is not None)
        if self._contiguous():
            base = self.ckpt.read(self.name, self.region).reshape(stored)
        else:
            base = self._read_runs().reshape(stored)
        for i, (dim, coords) in enumerate(self.axes):  # new axes (None), possibly repeated by an array
            if dim is None:
                base = np.expand_dims(base, i)
                if len(coords) != 1:
                    base = np.take(base, np.asarray(coords), axis=i)
        return base

    def _read_runs(self) -> np.ndarray:
        """The selected elements of every stored dim (fixed dims of length 1), reading only their runs."""
        per_dim: list[list[tuple[int, int, int]]] = []  # runs [lo, hi) per stored dim, with their place
        where: list[np.ndarray] = []  # each selected coordinate's place in the compact buffer
        for d, n_chunk in enumerate(self.meta.chunk):
            coords = np.array([self.fixed[d]]) if d in self.fixed else np.asarray(self._coords(d))
            runs = _runs(coords, n_chunk)
            starts = np.array([lo for lo, _ in runs])
            offsets = np.cumsum([0] + [hi - lo for lo, hi in runs])
            run = np.searchsorted(starts, coords, side="right") - 1
            where.append(offsets[run] + coords - starts[run])
            per_dim.append([(lo, hi, int(at)) for (lo, hi), at in zip(runs, offsets, strict=False)])
        compact = np.empty(tuple(sum(hi - lo for lo, hi, _ in runs) for runs in per_dim), dtype=self.dtype)
        jobs = []
        for combo in itertools.product(*per_dim):
            jobs.append((self.meta, tuple(slice(lo, hi) for lo, hi, _ in combo),
                         np.empty(tuple(hi - lo for lo, hi, _ in combo), self.dtype)))
        self.ckpt.read_regions(jobs)
        for combo, (_, _, block) in zip(itertools.product(*per_dim), jobs, strict=True):
            compact[tuple(slice(at, at + hi - lo) for lo, hi, at in combo)] = block
        return compact[np.ix_(*where)] if where else compact

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.read()
        return out if dtype is None else out.astype(dtype)

    def to_dask(self, chunks: Any = None) -> Any:
        """This view as a lazy ``dask.array.Array`` (chunks follow the stored inner chunks)."""
        from .graph import to_dask

        if self.is_box:
            return to_dask(self, chunks)
        box = LazyTensor(self.ckpt, self.meta, self.region, self.keep)
        x = to_dask(box, chunks)
        for i, (dim, coords) in enumerate(self.axes):
            before = (slice(None),) * i
            if dim is None:
                x = x[(*before, None)]
                if len(coords) != 1:
                    x = x[(*before, np.asarray(coords))]
            elif not (isinstance(coords, range) and coords.step == 1):
                x = x[(*before, np.asarray(coords) - box.region[dim].start)]
        return x


# ------------------------------------------------------------------ helpers
def _normalize(key: tuple[Any, ...], name: str) -> tuple[Any, ...]:
    """Lists and arrays to 1-d int64 arrays (masks to their indices), integers to int."""
    out: list[Any] = []
    if sum(1 for k in key if k is Ellipsis) > 1:
        raise IndexError(f"{name!r}: an index can only have a single ellipsis ('...')")
    for k in key:
        if k is None or k is Ellipsis or isinstance(k, slice):
            out.append(k)
        elif isinstance(k, bool | np.bool_):
            raise IndexError(f"{name!r}: a boolean scalar index is not supported; use a boolean array")
        elif isinstance(k, int | np.integer):
            out.append(int(k))
        elif isinstance(k, list | tuple | np.ndarray) or hasattr(k, "__array__"):
            arr = np.asarray(k)
            if arr.dtype == np.bool_:
                if arr.ndim != 1:
                    raise IndexError(f"{name!r}: only 1-d boolean masks are supported")
                out.append(arr)  # made indices once the dim's size is known
                continue
            if arr.size == 0 and isinstance(k, list | tuple):  # [] is an empty integer index
                arr = arr.astype(np.int64)
            elif arr.dtype.kind not in "iu":
                raise IndexError(f"{name!r}: arrays used as indices must be of integer or boolean type")
            if arr.ndim == 0:
                out.append(int(arr))
            elif arr.ndim != 1:
                raise IndexError(f"{name!r}: only 1-d integer arrays are supported as indices")
            else:
                out.append(arr.astype(np.int64))
        else:
            try:
                out.append(operator.index(k))
            except TypeError:
                raise IndexError(f"{name!r}: unsupported index {k!r}") from None
    return tuple(out)


def _check_advanced(key: tuple[Any, ...], name: str) -> None:
    """Refuse what numpy would not index orthogonally (several arrays; an array apart from integers)."""
    arrays = [i for i, k in enumerate(key) if isinstance(k, np.ndarray)]
    if len(arrays) > 1:
        raise IndexError(f"{name!r}: one integer array per index (numpy would pair several element-wise); "
                         "chain them for an outer selection: t[rows][:, cols]")
    if arrays:
        advanced = [i for i, k in enumerate(key) if isinstance(k, int | np.ndarray) and not isinstance(k, bool)]
        if advanced != list(range(advanced[0], advanced[-1] + 1)):
            raise IndexError(f"{name!r}: an integer array apart from integer indices (numpy moves its axis first); "
                             "index in two steps")


def _bounds(coords: Coords) -> tuple[int, int]:
    """``(lo, hi)``: the smallest slice holding every coordinate."""
    if len(coords) == 0:
        return 0, 0
    if isinstance(coords, range):
        first, last = coords[0], coords[-1]
        return min(first, last), max(first, last) + 1
    return int(coords.min()), int(coords.max()) + 1


def _runs(coords: np.ndarray, chunk: int) -> list[tuple[int, int]]:
    """Sorted ``[lo, hi)`` runs covering ``coords``; a run breaks where a whole inner chunk is skipped."""
    u = np.unique(coords)
    if u.size == 0:
        return []
    ids = u // max(chunk, 1)
    breaks = np.flatnonzero(np.diff(ids) > 1) + 1
    return [(int(part[0]), int(part[-1]) + 1) for part in np.split(u, breaks)]
