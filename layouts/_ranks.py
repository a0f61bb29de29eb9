"""A layout's rank list, checked once and shared: rank -> position in O(1).

A model's tensors share a few rank lists (often ``range(n)``), each thousands
of ranks long at scale. :func:`rank_set` checks a list once (ints, none
negative) and keeps one :class:`RankSet` per distinct list, so that building
10,000 layouts over 4,096 ranks does not check, copy or index 10,000 lists,
and every layout built from the same list holds the same tuple object (equal
layouts then compare their ranks by identity).
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Iterable
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any

from .errors import LayoutError

if TYPE_CHECKING:
    from .core import Layout

#: Rank lists at most this long are not kept (checking them costs less than looking them up).
SMALL = 64
#: Distinct long rank lists kept per process (the cache starts over beyond this).
KEPT = 256


class RankSet:
    """A checked rank list: its tuple, whether it is a run ``start, start+1, ...``, and rank -> position.

    Parameters
    ----------
    ranks : tuple of int
        The ranks, already ints and none negative.
    """

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks
        first = ranks[0] if ranks else 0
        #: ``ranks == range(start, start + len(ranks))``: positions by arithmetic; else None.
        self.start: int | None = first if ranks == tuple(range(first, first + len(ranks))) else None

    @cached_property
    def distinct(self) -> bool:
        """Whether no rank appears twice."""
        return self.start is not None or len(set(self.ranks)) == len(self.ranks)

    @cached_property
    def ascending(self) -> bool:
        """Whether the ranks increase along the list (then a rank's order among any of them is its position's)."""
        r = self.ranks
        return self.start is not None or all(a < b for a, b in itertools.pairwise(r))

    @cached_property
    def hash(self) -> int:
        """``hash(ranks)``, computed once (a layout's hash uses it)."""
        return hash(self.ranks)

    @cached_property
    def _index(self) -> dict[int, int]:
        return {r: p for p, r in enumerate(self.ranks)}

    @cached_property
    def as_list(self) -> list[int]:
        """The ranks as a list (shared: the JSON form of every layout over them; do not modify)."""
        return list(self.ranks)

    def position(self, rank: Any) -> int | None:
        """The position of ``rank`` in the list, or None if it is not there (or not an int)."""
        if self.start is None:
            try:
                return self._index.get(rank)
            except TypeError:  # unhashable
                return None
        try:
            p = operator.index(rank) - self.start
        except TypeError:
            return None
        return p if 0 <= p < len(self.ranks) else None


_kept: dict[tuple[int, ...], RankSet] = {}
_by_id: dict[int, RankSet] = {}  # the kept tuples by identity (alive while kept): no hashing of a known tuple
_lock = threading.Lock()


def _ints(value: Any) -> tuple[int, ...]:
    try:
        out = tuple(map(int, value))
    except (TypeError, ValueError):
        raise LayoutError(f"ranks must be a sequence of ints, got {value!r}") from None
    if out and min(out) < 0:
        raise LayoutError(f"ranks {list(out)} holds {min(out)}, below the minimum 0")
    return out


def rank_set(value: Any) -> RankSet:
    """The checked :class:`RankSet` of a sequence of ranks (the same object for equal long lists).

    Raises
    ------
    LayoutError
        Not a sequence of ints, or a negative rank.
    """
    hit = _by_id.get(id(value))
    if hit is not None and hit.ranks is value:
        return hit
    if type(value) is tuple and len(value) > SMALL:
        hit = _kept.get(value)
        if hit is not None:
            return hit
    ranks = _ints(value)
    if len(ranks) <= SMALL:
        return RankSet(ranks)
    with _lock:
        hit = _kept.get(ranks)
        if hit is None:
            if len(_kept) >= KEPT:
                _kept.clear()
                _by_id.clear()
            hit = _kept[ranks] = RankSet(ranks)
            _by_id[id(ranks)] = hit
    return hit


@lru_cache(maxsize=KEPT)
def run(start: int, count: int) -> RankSet:
    """The :class:`RankSet` of ``range(start, start + count)`` (``start`` >= 0), built once per run."""
    return rank_set(tuple(range(start, start + count)))


def all_ranks(layouts: Iterable[Layout]) -> set[int]:
    """Every rank of some layouts, each distinct rank list read once.

    Layouts over one rank list share its tuple, so a model's 10,000 layouts over
    4,096 ranks cost 10,000 steps and one union, not 40 million.
    """
    lists = {id(lay.ranks): lay.ranks for lay in layouts}
    return set().union(*lists.values())


def check_ints(value: Any, what: str, minimum: int = 0) -> tuple[int, ...]:
    try:
        out = tuple(map(int, value))
    except (TypeError, ValueError):
        raise LayoutError(f"{what} must be a sequence of ints, got {value!r}") from None
    if out and min(out) < minimum:
        raise LayoutError(f"{what} {list(out)} holds {min(out)}, below the minimum {minimum}")
    return out


def short(ranks: tuple[int, ...]) -> str:
    if ranks and ranks == tuple(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}..{ranks[-1]}"
    return str(list(ranks)) if len(ranks) <= 8 else f"[{ranks[0]}, {ranks[1]}, ... {ranks[-1]}]"
