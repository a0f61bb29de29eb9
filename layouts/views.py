"""A tensor made of regions of stored tensors: :class:`View` (what an exporter writes without a copy).

A :class:`Piece` is a region of one stored tensor that is contiguous in C order
(leading dims of extent 1, one dim cut, the trailing dims whole); a :class:`View`
is a new tensor whose C-order elements are its pieces' one after the other, e.g.
one layer of a stacked ``[layers, rows, cols]`` weight, or the rows of every query
group's keys taken from a fused ``[q, k, v]`` projection. Pure math, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import ShapeMismatchError


@dataclass(frozen=True)
class Piece:
    """``region`` (``(start, stop)`` per dim, contiguous in C order) of the stored tensor ``name``."""

    name: str
    region: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return math.prod(hi - lo for lo, hi in self.region)


@dataclass(frozen=True)
class View:
    """A new tensor of ``shape``: its pieces' elements one after the other, in C order."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def check_piece(piece: Piece, shape: Sequence[int]) -> None:
    """Refuse a piece that is not a region of ``shape`` contiguous in C order (:class:`ShapeMismatchError`)."""
    if len(piece.region) != len(shape) or any(not 0 <= lo <= hi <= n
                                               for (lo, hi), n in zip(piece.region, shape, strict=False)):
        raise ShapeMismatchError(f"{piece.name}: region {list(piece.region)} is not inside its shape {list(shape)}")
    cut = next((d for d, (lo, hi) in enumerate(piece.region) if hi - lo != 1), len(shape))
    if piece.size and any(piece.region[d] != (0, shape[d]) for d in range(cut + 1, len(shape))):
        raise ShapeMismatchError(f"{piece.name}: region {list(piece.region)} of {list(shape)} is not contiguous "
                                 "in C order (after its first dim longer than 1, every dim must be whole)")


def check_view(name: str, view: View, shapes: dict[str, Sequence[int]]) -> None:
    """Refuse a view whose pieces are not contiguous regions of ``shapes`` or do not add up to its size."""
    for piece in view.pieces:
        if piece.name not in shapes:
            raise ShapeMismatchError(f"{name}: its piece names {piece.name!r}, which the checkpoint does not hold")
        check_piece(piece, shapes[piece.name])
    if sum(p.size for p in view.pieces) != math.prod(view.shape):
        raise ShapeMismatchError(f"{name}: pieces of {sum(p.size for p in view.pieces)} elements for shape "
                                 f"{list(view.shape)}")


__all__ = ["Piece", "View", "check_piece", "check_view"]
