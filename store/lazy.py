"""Lazy views of stored tensors: indexing builds a view, ``read()`` does the I/O."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
from reshard.layouts import Layout

from .format.meta import ArrayMeta

if TYPE_CHECKING:
    from .reader import Checkpoint

Region = tuple[slice, ...]


class LazyTensor:
    """A lazy view of a stored tensor (or of a region of it): no I/O until read.

    Supports basic indexing (integers, slices with step 1, ``...``).
    """

    def __init__(self, ckpt: Checkpoint, meta: ArrayMeta, region: Region | None = None,
                 keep: tuple[bool, ...] | None = None) -> None:
        self.ckpt = ckpt
        self.meta = meta
        self.region = region if region is not None else tuple(slice(0, n) for n in meta.shape)
        self.keep = keep if keep is not None else (True,) * len(meta.shape)

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(r.stop - r.start for r, k in zip(self.region, self.keep, strict=True) if k)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.meta.np_dtype

    @property
    def layout(self) -> Layout:
        return self.meta.layout

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return (f"<LazyTensor {self.name!r} shape={self.shape} dtype={self.meta.dtype} "
                f"layout={self.layout.describe()}>")

    def _repr_html_(self) -> str:
        from .display import tensor_html

        return tensor_html(self)

    def __getitem__(self, key: Any) -> LazyTensor:
        if not isinstance(key, tuple):
            key = (key,)
        dims = [d for d, k in enumerate(self.keep) if k]
        if Ellipsis in key:
            i = key.index(Ellipsis)
            key = key[:i] + (slice(None),) * (len(dims) - len(key) + 1) + key[i + 1:]
        if len(key) > len(dims):
            raise IndexError(f"{self.name!r}: too many indices ({len(key)}) for {len(dims)} dims")
        region, keep = list(self.region), list(self.keep)
        for d, k in zip(dims, key, strict=False):
            r = region[d]
            size = r.stop - r.start
            if isinstance(k, slice):
                start, stop, step = k.indices(size)
                if step != 1:
                    raise IndexError(f"{self.name!r}: only step 1 slices are lazy; read() then slice")
                region[d] = slice(r.start + start, r.start + max(start, stop))
            elif isinstance(k, int | np.integer):
                i = int(k) + size if k < 0 else int(k)
                if not 0 <= i < size:
                    raise IndexError(f"{self.name!r}: index {k} out of range for dim of {size}")
                region[d], keep[d] = slice(r.start + i, r.start + i + 1), False
            else:
                raise IndexError(f"{self.name!r}: unsupported index {k!r}")
        return LazyTensor(self.ckpt, self.meta, tuple(region), tuple(keep))

    def read(self) -> np.ndarray:
        """Read the view's values (only the intersecting inner chunks)."""
        full = self.ckpt.read(self.name, self.region)
        return full.reshape(self.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.read()
        return out if dtype is None else out.astype(dtype)

    def to_dask(self, chunks: Any = None) -> Any:
        """This view as a lazy ``dask.array.Array`` (chunks follow the stored inner chunks)."""
        from .graph import to_dask

        return to_dask(self, chunks)
