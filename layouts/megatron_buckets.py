"""Megatron-Core's distributed-optimizer buckets: where each parameter sits, which stored chunks hold it.

Megatron-Core (``megatron/core/distributed/param_and_grad_buffer.py``) lays a
data-parallel group's parameters (tensor-parallel local parts) out in flat
buffers, cut into buckets. Its rules, restated:

* parameters go in reverse ``named_parameters()`` order; with the distributed
  optimizer each parameter starts at a multiple of :data:`PARAM_ALIGN` (64)
  elements, the gap before it being padding;
* a bucket ends after the parameter that brings it to ``bucket_size``
  elements, and is padded to a multiple of ``lcm(dp, 128)`` (so every bucket,
  and every parameter, starts 64-aligned within its bucket too);
* data-parallel rank ``r`` holds elements ``[r * n / dp, (r + 1) * n / dp)``
  of a bucket of ``n`` padded elements.

The ``dp_reshardable`` checkpoint form stores bucket ``b`` of state ``s`` as a
1-d tensor of the bucket's unpadded length, one chunk per (parameter, rank)
piece plus one per padding gap a rank holds before the unpadded end. The
parameters' order is not stored: :func:`bucket_pieces` checks a proposed
placement (parameter spans) against the stored chunks, and says which chunk
holds which range of which parameter.

Pure math, no I/O.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from .errors import FormatError

#: Elements a parameter's start is aligned to within a distributed-optimizer buffer (128 bytes of 16-bit values).
PARAM_ALIGN = 64

#: ``(chunk offset, start, stop)``: the stored chunk at ``chunk offset`` holds elements ``[start, stop)`` of a
#: parameter's flattening.
BucketPiece = tuple[int, int, int]


def param_start(at: int) -> int:
    """Where the next parameter starts when the previous one (or the bucket) ends at ``at``."""
    return -(-at // PARAM_ALIGN) * PARAM_ALIGN


def chunk_bounds(size: int, chunks: Sequence[tuple[int, int]], what: str = "bucket") -> tuple[int, ...]:
    """The sorted starts of ``chunks`` (``(offset, length)`` each) and ``size``, checking they tile ``[0, size)``.

    Raises
    ------
    FormatError
        If the chunks leave a gap, overlap, or pass the end.
    """
    at = 0
    starts = []
    for off, n in sorted((int(o), int(n)) for o, n in chunks):
        if off != at or n <= 0:
            what_ = "overlap" if off < at else ("leave a gap" if off > at else "include an empty chunk")
            raise FormatError(f"{what}: the stored chunks {what_} at element {min(off, at)} (Megatron's buckets are "
                              "fully covered by parameter and padding chunks)")
        starts.append(off)
        at = off + n
    if at != size:
        raise FormatError(f"{what}: the stored chunks end at element {at}, the bucket holds {size}")
    return (*starts, size)


def bucket_pieces(size: int, chunks: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]],
                  what: str = "bucket") -> tuple[tuple[BucketPiece, ...], ...]:
    """Which stored chunks hold which range of each parameter of a bucket.

    Parameters
    ----------
    size : int
        The bucket's unpadded length (the stored tensor's length).
    chunks : sequence of (offset, length)
        The stored chunks; they tile ``[0, size)``.
    spans : sequence of (start, stop)
        Each parameter's elements in the bucket, in order: the first starts at
        0, each next one at :func:`param_start` of the previous stop, the last
        stops at ``size``.

    Returns
    -------
    tuple
        Per span, its pieces ``(chunk offset, start, stop)`` in order; they
        tile the span's ``[0, stop - start)``.

    Raises
    ------
    FormatError
        When the spans break Megatron's rules or a chunk straddles a span's bound.
    """
    bounds = chunk_bounds(size, chunks, what)
    at, out = 0, []
    for start, stop in spans:
        if start != param_start(at) or stop <= start:
            raise FormatError(f"{what}: a parameter at [{start}, {stop}) does not follow the one ending at {at} "
                              f"(parameters start at the next multiple of {PARAM_ALIGN})")
        i = _index(bounds, start, what)
        j = _index(bounds, stop, what)
        out.append(tuple((bounds[k], bounds[k] - start, bounds[k + 1] - start) for k in range(i, j)))
        at = stop
    if at != size:
        raise FormatError(f"{what}: its parameters end at element {at}, the bucket holds {size}")
    return tuple(out)


def _index(bounds: tuple[int, ...], at: int, what: str) -> int:
    i = bisect.bisect_left(bounds, at)
    if i == len(bounds) or bounds[i] != at:
        raise FormatError(f"{what}: no stored chunk starts or ends at element {at}, where a parameter does")
    return i
