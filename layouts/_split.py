"""How one tensor dim is cut into pieces: the three split conventions.

Pure integer functions; :class:`~reshard.layouts.Layout` calls them for every
rank once and caches the result.
"""

from __future__ import annotations

from collections.abc import Sequence

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
