"""Plain records shared by layouts and plans: blocks, pieces, intersections."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import LayoutError

Region = tuple[slice, ...]


def _fmt(region: Region) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in region) + "]"


@dataclass(frozen=True)
class Block:
    """One distinct non-empty region of a layout and the ranks holding it.

    Attributes
    ----------
    region : tuple of slice
        Global coordinates (``slice(start, stop)``, step ``None``).
    ranks : tuple of int
        Ranks holding an identical copy, ordered by replica id:
        ``ranks[0]`` is the one that writes it.
    """

    region: Region
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.ranks:
            raise LayoutError(f"block {_fmt(self.region)} has no ranks")

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the block."""
        return tuple(s.stop - s.start for s in self.region)

    @property
    def writer(self) -> int:
        """The rank that writes the block (replica 0)."""
        return self.ranks[0]

    def __repr__(self) -> str:
        return f"Block({_fmt(self.region)}, ranks={list(self.ranks)})"


@dataclass(frozen=True)
class Piece:
    """Part of a source block that fills part of a target rank's array.

    Attributes
    ----------
    block : Block
        The source block read from.
    src : tuple of slice
        `region` relative to the block's start (for a source whose ranks hold
        several blocks, :meth:`~reshard.layouts.Layout.pieces`: relative to the
        local array of the block's writer).
    dst : tuple of slice
        `region` relative to the target rank's local array.
    region : tuple of slice
        The global intersection.
    src_at : int, optional
        A flat-range source (:class:`~reshard.layouts.flat.FlatLayout`): where
        the block starts in its holders' one-dimensional local arrays.
    dst_box : (int, tuple of int), optional
        A flat-range target: ``(offset, shape)`` of the target rank's box that
        `dst` is relative to (``local[offset : offset + prod(shape)].reshape(shape)``).
    """

    block: Block
    src: Region
    dst: Region
    region: Region
    src_at: int | None = None
    dst_box: tuple[int, tuple[int, ...]] | None = None

    def source(self, local: Any) -> Any:
        """The piece's values in a source holder's local array (any array with ``reshape`` and slicing)."""
        if self.src_at is None:
            return local[self.src]
        n = math.prod(self.block.shape)
        return local.reshape(-1)[self.src_at : self.src_at + n].reshape(self.block.shape)[self.src]

    def target(self, local: Any) -> Any:
        """Where the piece goes in the target rank's local array (a view: assign into it)."""
        if self.dst_box is None:
            return local[self.dst]
        at, shape = self.dst_box
        return local.reshape(-1)[at : at + math.prod(shape)].reshape(shape)[self.dst]

    def __repr__(self) -> str:
        return (
            f"Piece({_fmt(self.region)} from block {_fmt(self.block.region)} "
            f"src={_fmt(self.src)} dst={_fmt(self.dst)})"
        )


def intersect(a: Region, b: Region) -> Region | None:
    """Return the intersection of two regions, or ``None`` if it is empty.

    Parameters
    ----------
    a, b : tuple of slice
        Regions in the same coordinates, with the same number of dims.

    Returns
    -------
    tuple of slice or None
        ``None`` when the regions do not overlap (or either is empty); a 0-d
        pair of regions intersects in ``()``.
    """
    if len(a) != len(b):
        raise LayoutError(f"regions of different ndim: {_fmt(a)} and {_fmt(b)}")
    out = []
    for x, y in zip(a, b, strict=True):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        out.append(slice(lo, hi))
    return tuple(out)
