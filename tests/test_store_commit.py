"""Per-rank writers in real processes, the commit protocol, and what it refuses."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from paths import shard_keys
from reshard.layouts import Layout

from tests.reliability.harness import step_manifests

SHAPES = {"model.w": (64, 32), "model.b": (32,), "opt.m": (64, 32)}


def layouts() -> dict[str, Layout]:
    return {
        "model.w": Layout.from_mindspore([2, 2], [1, 0], SHAPES["model.w"]),
        "model.b": Layout.from_mindspore([2, 2], [-1], SHAPES["model.b"]),  # replicated on all 4
        "opt.m": Layout.from_mindspore([2, 2], [-1, 0], SHAPES["opt.m"], opt_shard_size=-1),
    }


def full_state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def local(full: dict[str, np.ndarray], rank: int) -> dict:
    """Rank ``rank``'s pieces of ``full`` (and a leaf)."""
    lay = layouts()
    return {**{n: full[n][lay[n].region(rank)] for n in lay}, "step": 5}


def rank_main(url: str, rank: int, die_before_manifest: bool) -> None:
    """One rank's process: create with the same arguments as everyone, write its own pieces."""
    writer = rs.create(url, layouts())
    pieces = local(full_state(), rank)
    if die_before_manifest:
        os._exit(1)  # a crash: nothing of this rank is recorded
    writer.write(rank, pieces)


def run_ranks(url: str, ranks: list[int], die: int | None = None) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(url, r, r == die)) for r in ranks]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode is not None


def test_concurrent_process_writers_then_commit(tmp_path):
    url = str(tmp_path / "ck")
    run_ranks(url, [0, 1, 2, 3])
    # the ranks wrote disjoint shard objects: count the writes per object via the manifests
    rs.commit(url)
    ckpt = rs.open(url)
    full = full_state()
    for name in SHAPES:
        np.testing.assert_array_equal(ckpt[name].read(), full[name])
    assert ckpt.leaves == {"step": 5}
    shards = shard_keys(url)
    # w: 4 blocks; b: replicated, written once; m: opt-sharded into 4 distinct pieces
    assert len([s for s in shards if s.startswith("model/w/")]) == 4
    assert len([s for s in shards if s.startswith("opt/m/")]) == 4
    assert len([s for s in shards if s.startswith("model/b/")]) == 1


def test_killed_rank_is_refused_and_sibling_untouched(tmp_path):
    good = str(tmp_path / "step1")
    rs.save(full_state(), good, layouts())
    before = {p: p.read_bytes() for p in Path(good).rglob("*") if p.is_file()}

    bad = str(tmp_path / "step2")
    run_ranks(bad, [0, 1, 2, 3], die=3)
    with pytest.raises(rs.UncommittedCheckpointError, match=r"ranks \[3\]"):
        rs.commit(bad)
    with pytest.raises(rs.UncommittedCheckpointError, match=r"ranks \[3\] have not written.*model\.w"):
        rs.open(bad)
    # forensics: what did get written is readable
    partial = rs.open(bad, allow_uncommitted=True)
    assert not partial.committed and "model.w" in partial
    # the earlier checkpoint is byte-for-byte untouched and still opens
    assert {p: p.read_bytes() for p in Path(good).rglob("*") if p.is_file()} == before
    np.testing.assert_array_equal(rs.open(good)["model.w"].read(), full_state()["model.w"])


def test_commit_race_one_wins(tmp_path):
    url = str(tmp_path / "ck")
    writer = rs.create(url, layouts())
    full = full_state()
    for r in range(4):
        writer.write(r, {n: full[n][lay.region(r)] for n, lay in layouts().items()})
    writer.commit()
    with pytest.raises(rs.CommitConflictError):
        rs.commit(url)
    assert rs.open(url).committed


def test_uncommitted_and_missing_are_refused(tmp_path):
    with pytest.raises(rs.CheckpointNotFoundError):
        rs.open(tmp_path / "nothing")
    url = str(tmp_path / "ck")
    writer = rs.create(url, layouts())
    full = full_state()
    for r in range(4):
        writer.write(r, {n: full[n][lay.region(r)] for n, lay in layouts().items()})
    with pytest.raises(rs.UncommittedCheckpointError, match="never committed"):
        rs.open(url)


def test_overwrite_rules(tmp_path):
    url = str(tmp_path / "ck")
    rs.save({"x": np.zeros(4)}, url)
    with pytest.raises(rs.CheckpointExistsError, match="overwrite=True"):
        rs.save({"x": np.ones(4)}, url)
    np.testing.assert_array_equal(rs.open(url)["x"].read(), np.zeros(4))
    rs.save({"x": np.ones(4)}, url, overwrite=True)
    np.testing.assert_array_equal(rs.open(url)["x"].read(), np.ones(4))
    marker = json.loads((tmp_path / "ck" / ".reshard" / "commit.json").read_text())
    assert marker["tensors"] == 1


def test_save_id_rejects_stale_manifests(tmp_path):
    """A rank that crashed on a re-save must not be covered by its manifest from the last save."""
    url = str(tmp_path / "ck")
    lay = {"x": Layout.from_dtensor((2,), ["S(0)"], (4,))}
    rs.save({"x": np.arange(4.0)}, url, lay, save_id="100")
    writer = rs.create(url, lay, overwrite=True, save_id="200")
    writer.write(0, {"x": np.array([9.0, 9.0])})  # rank 1 never writes this time
    with pytest.raises(rs.UncommittedCheckpointError, match=r"ranks \[1\]"):
        writer.commit()


def test_commit_takes_own_records_as_built_and_parses_the_rest(tmp_path):
    """A writer's own records are not parsed again at commit, but only where they equal what the manifests say."""
    from reshard.store.commit.marker import generation_of
    from reshard.store.format.manifests import merge_manifests, read_manifests

    url = str(tmp_path / "ck")
    full, lay = full_state(), layouts()
    writer = rs.create(url, lay)
    for rank in range(4):
        writer.write(rank, {n: full[n][lay[n].region(rank)] for n in lay})
    gen = writer.root.child(generation_of(writer.save_id))
    manifests = read_manifests(gen, writer.save_id, [0, 1, 2, 3], writer.form)
    known = dict(writer._known)
    metas, _ = merge_manifests(gen.url, manifests, known=known)
    assert all(metas[n] is known[n][1] for n in lay)  # taken as built
    record, meta = known["model.w"]
    known["model.w"] = ({**record, "chunk": [1, 1]}, meta)  # not what the manifests say: parsed instead
    metas, _ = merge_manifests(gen.url, manifests, known=known)
    assert metas["model.w"] is not meta and metas["model.w"] == merge_manifests(gen.url, manifests)[0]["model.w"]
    writer.commit()
    for name, arr in full.items():
        np.testing.assert_array_equal(rs.open(url).read(name), arr)


@pytest.mark.parametrize("form", ["packed", "directory"])
def test_a_commit_refuses_ranks_of_two_jobs(tmp_path, form):
    """Manifests carry their job's fencing token (a manager's saves); ranks of two tokens never commit together,
    whichever path the commit takes (the third-form merge, whole manifests); tokens alike commit."""
    state = full_state()
    url = str(tmp_path / "ck")
    writers = [rs.create(url, layouts(), save_id="s", form=form, fence=token) for token in (3, 4)]
    for rank in range(4):
        writers[rank // 2].write(rank, local(state, rank))
    with pytest.raises(rs.CommitConflictError, match=r"ranks of two jobs wrote this save: rank 0 by job 3, "
                                                     r"rank 2 by job 4"):
        writers[0].commit()
    assert not (tmp_path / "ck" / ".reshard" / "commit.json").exists()
    late = rs.create(url, layouts(), save_id="s", form=form, fence=3)  # the older job's rank, replaced by job 4's
    with pytest.raises(rs.CheckpointExistsError):
        late.write(2, local(state, 2))  # a newer job's manifest is never replaced by an older job's
    newer = rs.create(url, layouts(), save_id="s", form=form, fence=4)
    for rank in (0, 1):
        newer.write(rank, local(state, rank))  # the older job's leftovers are replaced
    newer.commit()
    assert {m["fence"] for m in step_manifests(url)} == {4}
    np.testing.assert_array_equal(rs.open(url)["model.w"].read(), state["model.w"])


def test_a_manifest_with_a_malformed_token_is_refused(tmp_path):
    from reshard.store.format.schema import check_manifest, with_digest

    doc = {"format_version": 2, "rank": 0, "save_id": "s", "expected_ranks": [0], "tensors": {}, "leaves": {}}
    assert check_manifest(json.loads(with_digest(doc)), "m")  # no token: a save outside a manager, or older
    assert check_manifest(json.loads(with_digest({**doc, "fence": 7})), "m")["fence"] == 7
    for bad in (0, -1, "7", True, 1.5):
        with pytest.raises(rs.FormatError, match="field 'fence' must be an int >= 1"):
            check_manifest(json.loads(with_digest({**doc, "fence": bad})), "m")
