"""Plain records shared by layouts and plans: blocks, pieces, intersections."""

from __future__ import annotations

from dataclasses import dataclass

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
        `region` relative to the block's start.
    dst : tuple of slice
        `region` relative to the target rank's local array.
    region : tuple of slice
        The global intersection.
    """

    block: Block
    src: Region
    dst: Region
    region: Region

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
