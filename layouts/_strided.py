"""torch's ``_StridedShard`` (FSDP2 on top of tensor parallelism) as a nested split.

``fully_shard`` on a DTensor that tensor parallelism already split along dim
``d`` chunks each rank's TP-local block again along ``d`` over the FSDP mesh
axis. torch describes the result left to right as
``[_StridedShard(d, split_factor=k), Shard(d)]``: the FSDP axis comes first
in the mesh, yet its split applies *inside* the ``k`` pieces of the later TP
axes. In reshard's terms that is a nested ``ceil`` split of ``d`` whose axes
are listed TP first, FSDP second (:func:`nested_order`).

torch computes a strided placement's global indices by a different rule
(``_StridedShard._split_tensor``: chunk into ``split_factor`` pieces, chunk
each over the mesh axis, concatenate), which, for some uneven sizes, does not
give the blocks FSDP2 actually holds (e.g. 9 rows over TP 2 x FSDP 4).
:func:`check_torch_agrees` replays torch's rule on intervals and refuses
those sizes, since a rank's data would then depend on who built the DTensor.

Pure integer math on ``(start, stop)`` runs; no torch import.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from functools import lru_cache

from ._split import piece
from .errors import UnsupportedError

#: A list of global indices, in local order, as ``(start, stop)`` runs.
Runs = tuple[tuple[int, int], ...]

#: One mesh axis's placement on a dim: ``(mesh axis, split_factor)``; 1 for ``Shard``.
AxisSplit = tuple[int, int]


def _length(runs: Runs) -> int:
    return sum(hi - lo for lo, hi in runs)


def _take(runs: Runs, start: int, stop: int) -> Runs:
    """The runs of positions ``start:stop`` of the concatenation of `runs`."""
    out = []
    pos = 0
    for lo, hi in runs:
        n = hi - lo
        a, b = max(start - pos, 0), min(stop - pos, n)
        if a < b:
            out.append((lo + a, lo + b))
        pos += n
    return tuple(out)


def _chunk(runs: Runs, parts: int, index: int) -> Runs:
    """Piece `index` of ``torch.chunk(runs, parts)`` (by position)."""
    lo, hi = piece(_length(runs), parts, index, "ceil")
    return _take(runs, lo, hi)


def _strided(runs: Runs, parts: int, split_factor: int, index: int) -> Runs:
    """torch's ``_StridedShard._split_tensor`` piece `index`: chunk, chunk each, concatenate."""
    return tuple(r for j in range(split_factor) for r in _chunk(_chunk(runs, split_factor, j), parts, index))


def nested_order(
    dim: int, splits: Sequence[AxisSplit], mesh: Sequence[int], placements: Sequence[str]
) -> tuple[int, ...]:
    """The mesh axes splitting `dim`, outer first, for a nested split.

    ``Shard`` axes keep mesh order. A ``_StridedShard`` axis with
    ``split_factor`` k moves behind the later axes on the same dim whose
    sizes multiply to k (those splits came first).

    Raises
    ------
    UnsupportedError
        No run of later axes multiplies to the split factor.
    """
    order: list[int] = []
    for axis, factor in reversed(splits):  # the right-most split was applied first
        if factor == 1:
            order.insert(0, axis)
            continue
        product, at = 1, 0
        while product < factor and at < len(order):
            product *= mesh[order[at]]
            at += 1
        if product != factor:
            later = [mesh[a] for a in order]
            raise UnsupportedError(
                f"DTensor placements {list(placements)} on mesh {list(mesh)}: mesh axis {axis} strides dim "
                f"{dim} with split_factor {factor}, but the later axes splitting it have sizes {later} "
                "(no leading run multiplies to it); redistribute to Shard/Replicate first"
            )
        order.insert(at, axis)
    return tuple(order)


@lru_cache(maxsize=4096)
def check_torch_agrees(
    size: int, dim: int, splits: tuple[AxisSplit, ...], order: tuple[int, ...], mesh: tuple[int, ...],
    placements: tuple[str, ...],
) -> None:
    """Raise unless torch's strided indices equal the nested ``ceil`` blocks for every coordinate.

    Parameters
    ----------
    size : int
        Global extent of `dim`.
    splits : tuple of (axis, split_factor)
        The placements on `dim` in mesh order (``split_factor`` 1 for ``Shard``).
    order : tuple of int
        The nested order from :func:`nested_order`.
    mesh, placements : tuple
        Mesh shape, and the placements as strings (for the message).

    Results are cached: tensors of one model share a few sizes.

    Raises
    ------
    UnsupportedError
        For some coordinate torch's rule gives other indices (or several
        runs) than the nested split: an uneven size torch and FSDP2 cut
        differently.
    """
    axes = [a for a, _ in splits]
    for combo in itertools.product(*(range(mesh[a]) for a in axes)):
        coord = dict(zip(axes, combo, strict=True))
        runs: Runs = ((0, size),) if size else ()
        for axis, factor in splits:
            if factor > 1:
                runs = _strided(runs, mesh[axis], factor, coord[axis])
            else:
                runs = _chunk(runs, mesh[axis], coord[axis])
        lo, hi = 0, size
        for axis in order:
            a, b = piece(hi - lo, mesh[axis], coord[axis], "ceil")
            lo, hi = lo + a, lo + b
        want: Runs = ((lo, hi),) if hi > lo else ()
        merged = _merge(runs)
        if merged != want:
            where = ", ".join(f"axis {a}={coord[a]}" for a in axes)
            raise UnsupportedError(
                f"DTensor placements {list(placements)} on mesh {list(mesh)} with dim {dim} of size {size}: "
                f"at {where} torch's strided indices {_show(runs)} differ from the nested split's "
                f"{_show(want)} (uneven sizes torch and FSDP2 cut differently); make dim {dim} a multiple of "
                f"{math.prod(mesh[a] for a in axes)} or redistribute to Shard/Replicate first"
            )


def _merge(runs: Runs) -> Runs:
    out: list[tuple[int, int]] = []
    for lo, hi in runs:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        elif hi > lo:
            out.append((lo, hi))
    return tuple(out)


def _show(runs: Runs) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in runs) + "]" if runs else "[]"
