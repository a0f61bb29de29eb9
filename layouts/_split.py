"""How one tensor dim is cut into pieces: the three split conventions.

Pure integer functions; :class:`~reshard.layouts.Layout` calls them for every
rank once and caches the result.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._ranks import check_ints
from .errors import LayoutError, ShapeMismatchError

SPLITS = ("even", "ceil", "balanced")


def piece(size: int, parts: int, index: int, split: str) -> tuple[int, int]:
    """Return ``(start, stop)`` of piece `index` when `size` is cut into `parts`.

    Parameters
    ----------
    size : int
        Extent being cut.
    parts : int
        Number of pieces (at least 1).
    index : int
        Which piece, ``0 <= index < parts``.
    split : {"even", "ceil", "balanced"}
        ``even``: equal pieces (the caller checked that `parts` divides
        `size`); ``ceil``: ``torch.chunk``, pieces of ``ceil(size/parts)``,
        trailing pieces smaller or empty; ``balanced``: OneFlow's
        BalancedSplitter, the first ``size % parts`` pieces get one more.

    Returns
    -------
    tuple of int
        Half-open interval, relative to the start of the extent.
    """
    if split == "even":
        step = size // parts
        return index * step, (index + 1) * step
    if split == "ceil":
        chunk = -(-size // parts)
        return min(index * chunk, size), min((index + 1) * chunk, size)
    base, rem = divmod(size, parts)
    start = index * base + min(index, rem)
    return start, start + base + (1 if index < rem else 0)


def divides(size: int, axes: Sequence[int], mesh: Sequence[int]) -> int | None:
    """Return the piece count if it does not divide `size` (else ``None``)."""
    parts = 1
    for a in axes:
        parts *= mesh[a]
    return None if size % parts == 0 else parts


def check_dims(shape: tuple[int, ...], mesh: tuple[int, ...], dims: Sequence[Sequence[int]], split: str
               ) -> tuple[tuple[int, ...], ...]:
    """A layout's `dims` as ints, checked against its shape, mesh and split (each mesh axis splits one dim)."""
    out = tuple(check_ints(axes, f"dims[{d}]") for d, axes in enumerate(dims))
    dims = out
    if len(dims) != len(shape):
        raise ShapeMismatchError(
            f"dims {[list(a) for a in dims]} has {len(dims)} entries "
            f"but shape {list(shape)} has {len(shape)} dims"
        )
    seen: dict[int, int] = {}
    for d, axes in enumerate(dims):
        for a in axes:
            if a >= len(mesh):
                raise LayoutError(f"dim {d} names mesh axis {a}; mesh {list(mesh)} has {len(mesh)}")
            if a in seen:
                raise LayoutError(f"mesh axis {a} splits both dim {seen[a]} and dim {d}")
            seen[a] = d
    if split not in SPLITS:
        raise LayoutError(f"split {split!r} is not one of {list(SPLITS)}")
    if split == "even":
        for d, (size, axes) in enumerate(zip(shape, dims, strict=True)):
            k = divides(size, axes, mesh)
            if k is not None:
                raise LayoutError(f"dim {d} of size {size} cannot be split evenly into {k} pieces")
    return out
