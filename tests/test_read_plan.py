"""The read-once plan (store/frontends/readplan.py): who reads which stored part, in which round.

Pure planning over real checkpoints on disk: every rank's needs tiled exactly
once, every stored byte read by one rank (measured by running each rank's reads
through the reader and counting ``bytes_fetched``), reading balanced, rounds
within their byte budget, the plan the same on every rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout
from reshard.store.frontends.torch import readplan as rp

SHAPES = {"a": (512, 256), "b": (1000, 64), "c": (384,), "s": ()}


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    out = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items() if s}
    out["s"] = np.array(5, dtype=np.int32)
    return out


SAVING = {  # name -> saving layout maker
    "fsdp8": lambda s: Layout.from_dtensor((8,), ["S(0)"], s) if s else Layout.single(s),
    "tp2x4": lambda s: Layout.from_dtensor((2, 4), ["S(0)", f"S({len(s) - 1})"], s) if s else Layout.single(s),
    "whole": lambda s: Layout.single(s),
}
TARGETS = {  # name -> (layout maker, positions of the group); None: the rank needs the whole tensor
    "ddp": lambda s: None,
    "hsdp": lambda s: Layout.from_dtensor((4, 2), ["R", "S(0)"], s) if s else None,
    "tpdp": lambda s: Layout.from_dtensor((2, 4), ["R", f"S({len(s) - 1})"], s) if s else None,
    "fsdp3": lambda s: Layout.from_dtensor((3,), ["S(0)"], s) if s else None,  # uneven, ranks 3..7 need nothing
    "ceil": lambda s: Layout.from_dtensor((8,), [f"S({len(s) - 1})"], s) if s and s[-1] >= 8 else None,
}


def _needs(target: str, n: int = 8) -> list[dict[str, rp.Box]]:
    out = []
    for p in range(n):
        need = {}
        for name, shape in SHAPES.items():
            layout = TARGETS[target](shape)
            if layout is None:
                need[name] = tuple((0, k) for k in shape)
            elif p in layout.ranks:
                need[name] = rp.box_of(layout.region(p))
        out.append(need)
    return out


@pytest.fixture(scope="module", params=[(s, f) for s in SAVING for f in ("packed", "directory")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> rs.Checkpoint:
    saving, form = request.param
    url = str(tmp_path_factory.mktemp("plan") / "ck")
    rs.save(_state(), url, {n: SAVING[saving](s) for n, s in SHAPES.items()}, form=form)
    return rs.open(url)


def _metas(ckpt: rs.Checkpoint) -> dict[str, object]:
    return {n: ckpt.tensor(n).resolve() for n in ckpt.arrays}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_need_is_covered_once_and_every_byte_read_once(saved: rs.Checkpoint, target: str) -> None:
    needs, metas = _needs(target), _metas(saved)
    plan = rp.plan(needs, metas)
    state = _state()
    # each rank receives each element it needs exactly once, from a cell of a unit
    for p, need in enumerate(needs):
        for name, box in need.items():
            count = np.zeros([b - a for a, b in box], dtype=np.int64)
            for unit in plan.units:
                for cell in unit.cells if unit.name == name else ():
                    assert rp.intersect(cell.box, unit.box) == cell.box  # inside its unit
                    if p in cell.needers:
                        count[rp.within(cell.box, box)] += 1
            assert (count == 1).all(), (p, name)
    # units of a tensor never overlap: no element is read twice
    for i, u in enumerate(plan.units):
        for v in plan.units[i + 1:]:
            assert u.name != v.name or not u.box or rp.intersect(u.box, v.box) is None, (u, v)
    # run each rank's reads: the values are the stored ones, and the bytes fetched add up to the checkpoint once
    fetched = 0
    for reader in range(8):
        fresh = rs.open(saved.url)
        jobs = [(metas[u.name], rp.slices(u.box), np.empty([b - a for a, b in u.box], state[u.name].dtype))
                for u in plan.units if u.reader == reader]
        if jobs:
            fetched += fresh.read_regions(jobs).bytes_fetched
            for meta, region, data in jobs:
                np.testing.assert_array_equal(data, state[meta.name][region])
    root = Path(saved.url)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)
    needed = sum(state[u.name][rp.slices(u.box)].nbytes for u in plan.units)
    assert needed <= fetched <= 1.1 * size


def test_the_plan_is_the_same_on_every_rank(saved: rs.Checkpoint) -> None:
    needs = _needs("tpdp")
    assert rp.plan(needs, _metas(saved)) == rp.plan([dict(reversed(list(n.items()))) for n in needs],
                                                    _metas(rs.open(saved.url)))


def test_a_unit_one_rank_needs_is_read_by_it_in_the_first_round(saved: rs.Checkpoint) -> None:
    plan = rp.plan(_needs("fsdp3"), _metas(saved))
    for i, unit in enumerate(plan.units):
        if not unit.shared:
            assert i in plan.rounds[0]
            assert all(c.needers == (unit.reader,) for c in unit.cells)


def test_reading_is_balanced_and_rounds_keep_their_budget(tmp_path: Path) -> None:
    """One 32 MiB tensor stored as one shard, loaded by 8 replicas: cut into pieces read by every rank."""
    url = str(tmp_path / "one")
    w = np.zeros((4096, 2048), dtype=np.float32)
    rs.save({"w": w}, url)
    ckpt = rs.open(url)
    needs = [{"w": ((0, 4096), (0, 2048))} for _ in range(8)]
    budget = 8 << 20
    plan = rp.plan(needs, _metas(ckpt), budget=budget)
    reads = plan.read_bytes()
    assert sum(reads) == w.nbytes
    assert len(reads) == 8 and max(reads) <= 1.5 * w.nbytes / 8
    assert len(plan.rounds) > 1
    for r, members in enumerate(plan.rounds):
        load = [0] * 8
        for u in members:
            load[plan.units[u].reader] += plan.units[u].nbytes
        for (src, dst), parts in plan.transfers(r).items():
            for u, c in parts:
                nbytes = rp.volume(plan.units[u].cells[c].box) * plan.units[u].itemsize
                load[src] += nbytes
                load[dst] += nbytes
        assert max(load) <= budget or len(members) == 1, (r, load)
    # pieces are cut at inner chunk boundaries
    meta = ckpt.tensor("w").resolve()
    for u in plan.units:
        assert all(a % k == 0 for (a, _), k in zip(u.box, meta.chunk, strict=True))


def test_each_saving_ranks_object_goes_to_one_reader_when_small(tmp_path: Path) -> None:
    """Packed form: a reader locates shards by reading the end of their writer's object; small loads keep
    each object to one reader (so no object's end is read twice)."""
    url = str(tmp_path / "ck")
    rs.save(_state(), url, {n: SAVING["fsdp8"](s) for n, s in SHAPES.items()})
    ckpt = rs.open(url)
    metas = _metas(ckpt)
    for target in ("ddp", "hsdp", "tpdp"):
        plan = rp.plan(_needs(target), metas)
        readers: dict[int, set[int]] = {}
        for u in plan.units:
            meta = metas[u.name]
            readers.setdefault(meta.writer(next(iter(meta.shards_in(rp.slices(u.box))))), set()).add(u.reader)
        assert all(len(r) == 1 for r in readers.values()), (target, readers)
