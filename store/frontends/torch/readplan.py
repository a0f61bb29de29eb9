"""Who reads what in a read-once load: a plan every rank of a group computes alike.

The ranks of a group (positions ``0..n-1``) each need some boxes of some stored
tensors. :func:`plan` cuts what they need along the stored shard grid into
*units*, boxes inside one stored shard that one rank reads from storage, each
made of *cells*, the parts of the unit that the same ranks need (the unit's
box cut at every needed region's boundaries). A unit needed by one rank only is
read by that rank (no exchange); a unit several ranks need is read by one of
them, chosen so that the bytes read are balanced over the ranks (largest
first, to the least loaded), and its cells are sent to the others. Large shared
units are cut, at inner chunk boundaries, into pieces of a fraction of what the
group reads, so the work spreads even when a checkpoint holds few large shards,
and so that a round holds a piece from every reader (one piece, its copies sent and
the pieces received from the others within the budget).

Every stored byte is then read once: units of one shard are disjoint, a shard
small enough to be fetched whole (:data:`SMALL_SHARD_BYTES`) is one unit, and
no two units share an inner chunk unless a needed region's boundary cuts that
chunk (as it would for independent reads). The shared units are packed into
*rounds* in which no rank stages, sends and receives more than ``budget`` bytes
(a single larger unit runs alone); units one rank needs alone go into round 0
(they are read straight into their destination where it can take them).

Pure functions of the needs and the stored records: no I/O, no communication,
no framework import. :mod:`reshard.store.frontends.torch.exchange` runs the plan.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...format.meta import ArrayMeta
from ...format.shard import SMALL_SHARD_BYTES
from ...format.trailers import TAIL_GUESS

#: A box of a tensor: ``(start, stop)`` per dimension (a 0-d tensor's box is ``()``).
Box = tuple[tuple[int, int], ...]

#: Bytes of staging, sending and receiving one rank does in one round of the exchange (per rank).
DEFAULT_BUDGET = 256 << 20
#: Shared units are not cut below this (a piece costs a request of its own).
MIN_PIECE_BYTES = 4 << 20
#: Aim for this many shared pieces per rank, so that largest-first assignment balances well.
PIECES_PER_RANK = 4
#: What a rank reading from one more saving rank's data object is charged (packed form: the object's last
#: ``TAIL_GUESS`` bytes, with its manifest, are read to locate the shards in it, and ranges that readers
#: merge across their gaps overlap at the ends of runs): a shared run goes to a rank that reads that
#: object already unless another is less loaded by more than this. Large loads balance all the same (their
#: runs are tens of MB); small ones keep each object to one reader.
TOUCH_BYTES = 4 * TAIL_GUESS
#: A shard whose needed regions cut it into more cells than this is read per needed region instead.
MAX_CELLS = 4096


@dataclass(frozen=True)
class Cell:
    """A part of a unit that the same ranks need: sent from the unit's reader to each of ``needers``."""

    box: Box
    needers: tuple[int, ...]


@dataclass(frozen=True)
class Unit:
    """A box inside one stored shard of tensor ``name``, read from storage by group position ``reader``."""

    name: str
    box: Box
    cells: tuple[Cell, ...]
    reader: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return volume(self.box) * self.itemsize

    @property
    def shared(self) -> bool:
        """Whether any rank other than the reader needs a part of it."""
        return any(p != self.reader for c in self.cells for p in c.needers)


@dataclass(frozen=True)
class Plan:
    """Every unit of a load and the rounds that run them (indices into ``units``)."""

    units: tuple[Unit, ...]
    rounds: tuple[tuple[int, ...], ...]

    def transfers(self, round_: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
        """``{(sender, receiver): [(unit, cell), ...]}`` of a round, in the order both sides lay them out."""
        out: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for u in self.rounds[round_]:
            unit = self.units[u]
            for c, cell in enumerate(unit.cells):
                for p in cell.needers:
                    if p != unit.reader:
                        out.setdefault((unit.reader, p), []).append((u, c))
        return out

    def read_bytes(self) -> list[int]:
        """Bytes each position reads from storage (unencoded)."""
        n = 1 + max((u.reader for u in self.units), default=0)
        out = [0] * n
        for u in self.units:
            out[u.reader] += u.nbytes
        return out


# ------------------------------------------------------------------ boxes
def volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def box_of(region: Iterable[slice]) -> Box:
    return tuple((int(r.start), int(r.stop)) for r in region)


def slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def intersect(x: Box, y: Box) -> Box | None:
    out = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(x, y, strict=True))
    return out if all(a < b for a, b in out) else None


def within(inner: Box, outer: Box) -> tuple[Any, ...]:
    """``inner`` as an index of an array holding ``outer`` (``inner`` lies inside ``outer``).

    It ends with ``...``, so that a 0-d array indexed by it gives a view, not a scalar.
    """
    return (*(slice(a - c, b - c) for (a, b), (c, _) in zip(inner, outer, strict=True)), Ellipsis)


def _hull(boxes: Sequence[Box]) -> Box:
    return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))


# ------------------------------------------------------------------- cells
def _cells(shard: Box, regions: Sequence[tuple[Box, tuple[int, ...]]]) -> tuple[list[Cell], list[list[int]] | None]:
    """The parts of ``shard`` the ranks need: cut at every needed region's boundary, one needer set each.

    ``regions``: distinct needed boxes meeting the shard, with the positions
    needing each. Returns the cells and the cuts per dimension; when the cuts
    would make more than :data:`MAX_CELLS` cells, the intersections themselves
    (which may overlap) are the cells, and the cuts None.
    """
    parts = [(b, pos) for box, pos in regions if (b := intersect(shard, box)) is not None]
    cuts = [sorted({x for b, _ in parts for x in b[d]}) for d in range(len(shard))]
    if len(parts) == 1:
        return [Cell(parts[0][0], parts[0][1])], cuts
    if math.prod(len(c) - 1 for c in cuts) > MAX_CELLS:
        return [Cell(b, pos) for b, pos in parts], None
    out = []
    for cell in itertools.product(*(list(itertools.pairwise(c)) for c in cuts)):
        needers = sorted({p for b, pos in parts if all(a <= lo and hi <= z for (lo, hi), (a, z) in zip(cell, b,
                                                                                                      strict=True))
                          for p in pos})
        if needers:
            out.append(Cell(tuple(cell), tuple(needers)))
    return out, cuts


def _units(name: str, meta: ArrayMeta, idx: tuple[int, ...], cells: list[Cell],
           cuts: list[list[int]] | None) -> list[Unit]:
    """The units of one shard: no inner chunk in two of them, and as few as that allows.

    Cells on both sides of a cut that falls inside inner chunks share those
    chunks: they form one *block*, read by one reader (each needer then gets
    its cells from it). Blocks that one set of ranks needs whole are merged
    where they fill their hull. A small shard (fetched whole) is one unit.
    """
    itemsize = meta.np_dtype.itemsize
    if len(cells) == 1:
        return [Unit(name, cells[0].box, (cells[0],), -1, itemsize)]
    if meta.shard_nbytes(idx) <= SMALL_SHARD_BYTES:  # fetched whole: by one reader
        return [Unit(name, _hull([c.box for c in cells]), tuple(cells), -1, itemsize)]
    if cuts is None:  # overlapping cells: one unit each
        return [Unit(name, c.box, (c,), -1, itemsize) for c in cells]
    grid = meta.chunk_grid
    kept = []
    for d, cut in enumerate(cuts):  # the cuts at inner chunk boundaries (and the ends) bound the blocks
        base, step = grid.start(d, idx[d]), meta.chunk[d]
        kept.append([x for i, x in enumerate(cut) if i in (0, len(cut) - 1) or (x - base) % step == 0])
    blocks: dict[tuple[int, ...], list[Cell]] = {}
    for c in cells:
        at = tuple(bisect.bisect_right(k, lo) - 1 for k, (lo, _) in zip(kept, c.box, strict=True))
        blocks.setdefault(at, []).append(c)
    out = []
    whole: dict[tuple[int, ...], list[Box]] = {}  # needer set -> blocks it alone needs, each filled by its cells
    for group in blocks.values():
        hull = _hull([c.box for c in group])
        sets = {c.needers for c in group}
        if len(sets) == 1 and volume(hull) == sum(volume(c.box) for c in group):
            whole.setdefault(group[0].needers, []).append(hull)
        else:
            out.append(Unit(name, hull, tuple(group), -1, itemsize))
    for needers, boxes in whole.items():
        hull = _hull(boxes)
        if volume(hull) == sum(volume(b) for b in boxes):
            out.append(Unit(name, hull, (Cell(hull, needers),), -1, itemsize))
        else:
            out += [Unit(name, b, (Cell(b, needers),), -1, itemsize) for b in boxes]
    return out


def _candidates(unit: Unit) -> tuple[int, ...]:
    return tuple(sorted({p for c in unit.cells for p in c.needers}))


# ------------------------------------------------------------------ pieces
def _split(unit: Unit, meta: ArrayMeta, pieces: int) -> list[Unit]:
    """``unit`` cut into about ``pieces`` boxes at inner chunk boundaries (along its first dim that has some)."""
    if pieces <= 1 or not unit.box:
        return [unit]
    shard = next(iter(meta.shards_in(slices(unit.box))))
    grid = meta.chunk_grid
    for d, (a, b) in enumerate(unit.box):
        base, step = grid.start(d, shard[d]), meta.chunk[d]
        cuts = sorted({base + round((a + (b - a) * i / pieces - base) / step) * step for i in range(1, pieces)})
        cuts = [c for c in cuts if a < c < b]
        if not cuts:
            continue
        out = []
        for lo, hi in itertools.pairwise([a, *cuts, b]):
            box = (*unit.box[:d], (lo, hi), *unit.box[d + 1:])
            cells = tuple(Cell(x, c.needers) for c in unit.cells if (x := intersect(c.box, box)) is not None)
            out.append(Unit(unit.name, box, cells, unit.reader, unit.itemsize))
        return out
    return [unit]


# -------------------------------------------------------------------- plan
def plan(needs: Sequence[Mapping[str, Box]], metas: Mapping[str, ArrayMeta], budget: int = DEFAULT_BUDGET) -> Plan:
    """The read-once plan of a group: ``needs[p]`` maps tensor names to the box position ``p`` needs.

    Deterministic: every rank given the same needs and records computes the same plan.
    """
    units: list[Unit] = []
    for name in sorted({n for need in needs for n in need}):
        meta = metas[name]
        distinct: dict[Box, list[int]] = {}
        for p, need in enumerate(needs):
            box = need.get(name)
            if box is not None and volume(box) > 0:
                distinct.setdefault(box, []).append(p)
        by_shard: dict[tuple[int, ...], list[tuple[Box, tuple[int, ...]]]] = {}
        for box, pos in distinct.items():
            for idx in meta.shards_in(slices(box)):
                by_shard.setdefault(idx, []).append((box, tuple(pos)))
        for idx in sorted(by_shard):
            shard = box_of(meta.shard_region(idx))
            units += _units(name, meta, idx, *_cells(shard, by_shard[idx]))
    n = len(needs)
    shared_bytes = sum(u.nbytes for u in units if len(_candidates(u)) > 1)
    cap = max(MIN_PIECE_BYTES, shared_bytes // max(1, PIECES_PER_RANK * n))
    cut: list[Unit] = []
    for u in units:
        meta = metas[u.name]
        fan = max(len(c.needers) for c in u.cells)
        if len(_candidates(u)) > 1 and meta.shard_nbytes(next(iter(meta.shards_in(slices(u.box))))) > SMALL_SHARD_BYTES:
            pieces = max(-(-u.nbytes // cap), -(-u.nbytes * 2 * fan // max(1, budget)))
            cut += _split(u, meta, pieces)
        else:
            cut.append(u)
    return _schedule(_assign(cut, metas, n, cap), n, budget)


def _geometry(meta: ArrayMeta) -> tuple[Any, ...]:
    """Where a writer puts a tensor's shards in its packed data object: the writer's own order
    (alike layouts side by side, then by name; see ``reshard.store.write.writer``)."""
    lay = meta.layout
    return lay.ranks, lay.mesh, lay.dims, lay.split, lay.nested, lay.opt_shard or 0, lay.shape, meta.name


def _assign(units: list[Unit], metas: Mapping[str, ArrayMeta], n: int, cap: int) -> list[Unit]:
    """Readers: a unit one rank needs goes to it; shared ones go, in runs, largest first to the least loaded.

    A run is a stretch of at most ``cap`` bytes of the shared units that one
    saving rank wrote and the same ranks need, in the order that rank wrote
    them: in the packed form they lie side by side in its data object, so one
    reader reads them in few requests and no two readers read across each
    other's bytes (the reader merges ranges that lie close, gaps included).
    A run goes to a rank already reading from that saving rank's object unless
    another is less loaded by more than :data:`TOUCH_BYTES`; that rank may need
    none of the run (it is then charged the run's bytes once more, for sending).
    """
    load = [0] * n
    touchers: dict[int, set[int]] = {}  # saving rank -> the ranks reading from its data object
    readers = [-1] * len(units)
    bundles: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i, u in enumerate(units):
        cands = _candidates(u)
        meta = metas[u.name]
        writer = meta.writer(next(iter(meta.shards_in(slices(u.box)))))
        if len(cands) == 1:
            readers[i] = cands[0]
            load[cands[0]] += u.nbytes
            touchers.setdefault(writer, set()).add(cands[0])
        else:
            bundles.setdefault((writer, cands), []).append(i)
    runs: list[tuple[int, tuple[int, ...], list[int], int]] = []
    for (writer, cands), members in sorted(bundles.items()):
        members.sort(key=lambda i: (_geometry(metas[units[i].name]), units[i].box))
        run: list[int] = []
        size = 0
        for i in members:
            if run and size + units[i].nbytes > cap:
                runs.append((writer, cands, run, size))
                run, size = [], 0
            run.append(i)
            size += units[i].nbytes
        runs.append((writer, cands, run, size))
    for writer, cands, run, size in sorted(runs, key=lambda r: -r[3]):
        near = touchers.setdefault(writer, set())

        def cost(p: int, near: set[int] = near, cands: tuple[int, ...] = cands, size: int = size) -> tuple[int, int]:
            return load[p] + (0 if p in near else TOUCH_BYTES) + (0 if p in cands else size), p

        reader = min(sorted(near.union(cands)), key=cost)
        near.add(reader)
        for i in run:
            readers[i] = reader
        load[reader] += size
    return [Unit(u.name, u.box, u.cells, r, u.itemsize) for u, r in zip(units, readers, strict=True)]


def _schedule(units: list[Unit], n: int, budget: int) -> Plan:
    """Rounds: round 0 takes every unshared unit; shared units, interleaved by reader, fill rounds in turn."""
    local = [i for i, u in enumerate(units) if not u.shared]
    by_reader: list[list[int]] = [[] for _ in range(n)]
    for i, u in enumerate(units):
        if u.shared:
            by_reader[u.reader].append(i)
    order = [i for batch in itertools.zip_longest(*by_reader) for i in batch if i is not None]
    rounds: list[list[int]] = [local]
    used = [0] * n
    for i in order:
        u = units[i]
        cost = [0] * n
        cost[u.reader] += u.nbytes  # staged
        for c in u.cells:
            nbytes = volume(c.box) * u.itemsize
            for p in c.needers:
                if p != u.reader:
                    cost[u.reader] += nbytes
                    cost[p] += nbytes
        if any(used) and any(used[p] + cost[p] > budget for p in range(n) if cost[p]):
            rounds.append([])
            used = [0] * n
        rounds[-1].append(i)
        used = [a + b for a, b in zip(used, cost, strict=True)]
    return Plan(tuple(units), tuple(tuple(r) for r in rounds))
