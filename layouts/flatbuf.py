"""Flat buffers: several tensors concatenated into one flat buffer, and each rank's part of it.

DeepSpeed ZeRO-1/2 (per parameter group) and FSDP1 ``FlatParameter`` (per
wrapped module) concatenate parameters into one flat buffer, padded, and give
each rank one contiguous, equal part of it (:meth:`FlatBuffer.partitioned`);
ZeRO-3 cuts each parameter on its own and concatenates a rank's pieces
(:meth:`FlatBuffer.per_tensor`). A :class:`FlatBuffer` says, for each rank,
which ranges of which tensors sit where in its local buffer
(:class:`FlatPart` segments; padding is whatever no segment covers), and
gives each tensor's :class:`~reshard.layouts.flat.FlatLayout`
(:meth:`FlatBuffer.layout`).

Framework rules (facts of their code, restated):

* **DeepSpeed ZeRO-1/2**: a group's parameters back to back, no padding
  between them; the end padded to a multiple of ``2 * dp`` elements
  (``nccl_start_alignment_factor * dp``); rank ``i`` holds ``[i * n / dp,
  (i + 1) * n / dp)``. ``partitioned(shapes, ranks, pad_to=2 * dp)``.
* **DeepSpeed ZeRO-3**: each parameter cut into ``dp`` pieces of
  ``ceil(numel / dp)`` (the last padded); a rank's buffer is its piece of
  every parameter, each padded to that size. ``per_tensor(shapes, ranks)``.
* **FSDP1** ``FlatParameter``: parameters back to back, each start aligned
  to ``align`` elements when the module was wrapped with ``use_orig_params``
  (16 bytes); the whole padded to a multiple of the world size and cut into
  equal shards. ``partitioned(shapes, ranks, align=..., pad_to=len(ranks))``.

Pure math, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import FormatError, LayoutError
from .flat import FlatLayout

#: ``(local offset, tensor index, start, stop)``: elements ``[start, stop)`` of the tensor's flattening
#: sit at ``[offset, offset + stop - start)`` of the rank's local buffer.
Segment = tuple[int, int, int, int]


@dataclass(frozen=True)
class FlatPart:
    """One rank's local buffer: its length (padding included), its segments, its replica id."""

    rank: int
    size: int
    segments: tuple[Segment, ...]
    replica: int = 0


@dataclass(frozen=True)
class FlatBuffer:
    """Tensors of ``shapes`` concatenated into one flat buffer, held in ``parts`` by the ranks.

    Parameters
    ----------
    shapes : tuple of tuple of int
        The tensors, in buffer order.
    parts : tuple of FlatPart
        One per rank. Segments of one part do not overlap and lie within its
        size; a rank holds at most one range of each tensor; the replica-0
        ranges of each tensor tile its elements (checked by :meth:`layout`).
    """

    shapes: tuple[tuple[int, ...], ...]
    parts: tuple[FlatPart, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shapes", tuple(tuple(int(n) for n in s) for s in self.shapes))
        if not self.parts:
            raise LayoutError("a flat buffer needs at least one rank")
        ranks = [p.rank for p in self.parts]
        if len(set(ranks)) != len(ranks):
            raise LayoutError(f"flat buffer ranks {ranks} repeat a rank")
        for p in self.parts:
            at = 0
            held: set[int] = set()
            for off, t, start, stop in sorted(p.segments):
                if off < at or off + stop - start > p.size or not 0 <= start <= stop:
                    raise LayoutError(f"rank {p.rank}: segment {(off, t, start, stop)} overlaps another or lies "
                                      f"outside its buffer of {p.size}")
                if not 0 <= t < len(self.shapes) or stop > math.prod(self.shapes[t]):
                    raise LayoutError(f"rank {p.rank}: segment {(off, t, start, stop)} names no range of a tensor")
                if t in held:
                    raise LayoutError(f"rank {p.rank} holds two ranges of tensor {t}")
                held.add(t)
                at = off + stop - start

    # ------------------------------------------------------------ constructors

    @classmethod
    def partitioned(cls, shapes: Sequence[Sequence[int]], ranks: Sequence[int] | Sequence[Sequence[int]], *,
                    align: int = 1, pad_to: int = 1, offsets: Sequence[int] | None = None,
                    total: int | None = None) -> FlatBuffer:
        """Contiguous equal partitions of the concatenation (ZeRO-1/2, FSDP1).

        Each tensor starts at a multiple of ``align`` elements (or at its entry
        of ``offsets``, increasing, as a framework recorded them); the total is
        padded to a multiple of ``pad_to`` (or is ``total``, trailing padding
        included, as recorded), then cut into ``len(ranks)`` parts of
        ``ceil(total / n)`` (the last ones shorter, padded to that size).
        ``ranks[i]`` is a rank, or the ranks holding part ``i`` by replica id (HSDP).
        """
        if align < 1 or pad_to < 1:
            raise LayoutError(f"align {align} and pad_to {pad_to} must be at least 1")
        if offsets is not None and len(offsets) != len(shapes):
            raise LayoutError(f"{len(offsets)} offsets for {len(shapes)} tensors")
        starts, end = [], 0
        for i, s in enumerate(shapes):
            at = -(-end // align) * align if offsets is None else int(offsets[i])
            if at < end:
                raise LayoutError(f"tensor {i} starts at {at}, inside the tensor before it (which ends at {end})")
            starts.append(at)
            end = at + math.prod(int(n) for n in s)
        if total is None:
            total = -(-end // pad_to) * pad_to
        elif total < end:
            raise LayoutError(f"flat buffer total {total} is shorter than its tensors' end {end}")
        groups = [(r,) if isinstance(r, int) else tuple(r) for r in ranks]
        if not groups or not all(groups):
            raise LayoutError("a partitioned flat buffer needs at least one rank per part")
        step = -(-total // len(groups))
        parts = []
        for i, members in enumerate(groups):
            lo, hi = i * step, min((i + 1) * step, total)
            segs = []
            for t, (off, s) in enumerate(zip(starts, shapes, strict=True)):
                a, b = max(lo, off), min(hi, off + math.prod(int(n) for n in s))
                if a < b:
                    segs.append((a - lo, t, a - off, b - off))
            parts += [FlatPart(r, step, tuple(segs), k) for k, r in enumerate(members)]
        return cls(tuple(tuple(s) for s in shapes), tuple(parts))

    @classmethod
    def per_tensor(cls, shapes: Sequence[Sequence[int]], ranks: Sequence[int]) -> FlatBuffer:
        """Each tensor cut into ``len(ranks)`` pieces of ``ceil(numel / n)``; a rank's buffer is its piece of
        every tensor in turn, each padded to that size (DeepSpeed ZeRO-3)."""
        n = len(ranks)
        if not n:
            raise LayoutError("a flat buffer needs at least one rank")
        steps = [-(-math.prod(int(x) for x in s) // n) for s in shapes]
        parts = []
        for i, r in enumerate(ranks):
            segs, at = [], 0
            for t, (s, step) in enumerate(zip(shapes, steps, strict=True)):
                numel = math.prod(int(x) for x in s)
                a, b = min(i * step, numel), min((i + 1) * step, numel)
                if a < b:
                    segs.append((at, t, a, b))
                at += step
            parts.append(FlatPart(int(r), at, tuple(segs)))
        return cls(tuple(tuple(s) for s in shapes), tuple(parts))

    # ----------------------------------------------------------------- queries

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(p.rank for p in self.parts)

    def part(self, rank: int) -> FlatPart:
        """The part `rank` holds."""
        for p in self.parts:
            if p.rank == rank:
                return p
        raise LayoutError(f"rank {rank} holds no part of the flat buffer (ranks {list(self.ranks)[:8]})")

    def layout(self, tensor: int, origin: dict[str, Any] | None = None) -> FlatLayout:
        """The flat layout of tensor ``tensor`` (its index in :attr:`shapes`): the ranks holding part of it.

        A tensor with no elements is held (empty) by the rank whose part would hold its start.
        """
        if not 0 <= tensor < len(self.shapes):
            raise LayoutError(f"tensor {tensor} is not one of the flat buffer's {len(self.shapes)}")
        shape = self.shapes[tensor]
        ranges = [(p.rank, start, stop, p.replica) for p in self.parts
                  for _, t, start, stop in p.segments if t == tensor and start < stop]
        if not ranges:
            ranges = [(self.parts[0].rank, 0, 0, 0)]
        return FlatLayout.from_ranges(shape, ranges, origin)

    def layouts(self, origin: dict[str, Any] | None = None) -> tuple[FlatLayout, ...]:
        """:meth:`layout` of every tensor, in order."""
        return tuple(self.layout(t, origin) for t in range(len(self.shapes)))

    # -------------------------------------------------------------------- JSON

    def to_json(self) -> dict[str, Any]:
        """``{"shapes": [...], "parts": [[rank, size, replica, [[offset, tensor, start, stop], ...]], ...]}``."""
        return {"shapes": [list(s) for s in self.shapes],
                "parts": [[p.rank, p.size, p.replica, [list(s) for s in p.segments]] for p in self.parts]}

    @classmethod
    def from_json(cls, obj: Any) -> FlatBuffer:
        """Inverse of :meth:`to_json`; raises FormatError on anything else."""
        def ints(v: Any, n: int | None = None) -> list[int]:
            if type(v) is not list or not all(type(x) is int and x >= 0 for x in v) or (n is not None and len(v) != n):
                raise FormatError(f"flat buffer JSON: expected a list of {n or 'some'} ints >= 0, got {v!r}")
            return v

        if not isinstance(obj, dict) or set(obj) != {"shapes", "parts"} or type(obj["parts"]) is not list:
            raise FormatError("flat buffer JSON must be an object with 'shapes' and 'parts'")
        if type(obj["shapes"]) is not list:
            raise FormatError("flat buffer JSON field 'shapes' must be a list")
        shapes = tuple(tuple(ints(s)) for s in obj["shapes"])
        parts = []
        for p in obj["parts"]:
            if type(p) is not list or len(p) != 4 or type(p[3]) is not list:
                raise FormatError(f"flat buffer JSON part must be [rank, size, replica, segments], got {p!r}")
            rank, size, rid = ints(p[:3], 3)
            segs = tuple(tuple(ints(s, 4)) for s in p[3])
            parts.append(FlatPart(rank, size, segs, rid))  # type: ignore[arg-type]
        try:
            return cls(shapes, tuple(parts))
        except LayoutError as e:
            raise FormatError(f"flat buffer JSON describes an impossible buffer: {e}") from e
