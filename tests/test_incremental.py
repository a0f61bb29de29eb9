"""Incremental saves (issue 13 item 3): unchanged shards are referenced, not rewritten; retention and gc keep them."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import fsspec
import numpy as np
import pytest
import reshard.store as rs
import zarr
from reshard.layouts import Layout
from reshard.layouts.errors import CheckpointNotFoundError, FormatError, UncommittedCheckpointError

RANKS = 4
L = {
    "base.w": Layout.from_dtensor((RANKS,), ["S(0)"], (64, 512)),   # frozen: 95% of the bytes
    "lora.a": Layout.from_dtensor((RANKS,), ["S(0)"], (64, 8)),     # trained
    "lora.b": Layout.from_dtensor((RANKS,), ["R"], (8, 16)),
}


def state(step: int, frozen_seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(frozen_seed)
    return {"base.w": rng.standard_normal((64, 512)).astype(np.float32),
            "lora.a": np.full((64, 8), step, np.float32), "lora.b": np.full((8, 16), -step, np.float32)}


def local(full: dict[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
    return {n: a[L[n].region(rank)] for n, a in full.items()}


def save(url: str, full: dict[str, np.ndarray], **options: object) -> None:
    writer = rs.create(url, L, form="packed", **options)
    for rank in range(RANKS):
        writer.write(rank, local(full, rank))
    writer.commit()


def data_bytes(folder: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.bin"))


def check(url: str, full: dict[str, np.ndarray], **options: object) -> None:
    ckpt = rs.open(url, **options)
    assert sorted(ckpt.arrays) == sorted(full)
    for name, want in full.items():
        np.testing.assert_array_equal(ckpt[name].read(), want)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reshard.store.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_a_step_beside_its_base_writes_only_what_changed(tmp_path):
    save(str(tmp_path / "step-1"), state(1))
    save(str(tmp_path / "step-2"), state(2), base=str(tmp_path / "step-1"))
    first, second = data_bytes(tmp_path / "step-1"), data_bytes(tmp_path / "step-2")
    assert second <= 0.10 * first, (first, second)
    check(str(tmp_path / "step-2"), state(2))
    refs = json.loads(next((tmp_path / "step-2").glob("gen-*/refs.json")).read_text())
    assert refs["templates"] == {"root": ".", "parent": ".."}
    assert all(v[0].startswith("{{parent}}/step-1/") for k, v in refs["refs"].items() if k.startswith("base/w/c/"))
    # plain zarr + fsspec read it too, given both templates
    url = str(tmp_path / "step-2")
    gen = json.loads((tmp_path / "step-2/.reshard/commit.json").read_text())["generation"]
    store = zarr.storage.FsspecStore.from_url(
        "reference://", read_only=True,
        storage_options={"fo": f"{url}/{gen}/refs.json", "template_overrides": {"root": url, "parent": str(tmp_path)},
                         "remote_options": {"asynchronous": True}})
    np.testing.assert_array_equal(zarr.open_group(store, mode="r")["base"]["w"][:], state(2)["base.w"])
    # diff says identical by hash without reading the frozen tensor, and finds what changed
    out = cli("diff", str(tmp_path / "step-1"), str(tmp_path / "step-2"))
    assert out.returncode == 1 and "1 identical by their shard hashes" in out.stdout, out.stdout + out.stderr
    assert "~ lora.a" in out.stdout and "~ lora.b" in out.stdout
    same = cli("diff", str(tmp_path / "step-2"), str(tmp_path / "step-2"))
    assert same.returncode == 0 and "3 identical by their shard hashes" in same.stdout


def test_a_compressed_step_does_not_compress_what_it_reuses(tmp_path, monkeypatch):
    """Shard hashes are of the values (and their encoding), so an unchanged shard is never encoded again."""
    from numcodecs import Zstd

    save(str(tmp_path / "step-1"), state(1), compression="zstd")
    calls = []
    real = Zstd.encode
    monkeypatch.setattr(Zstd, "encode", lambda self, buf: calls.append(1) or real(self, buf))
    save(str(tmp_path / "step-2"), state(2), base=str(tmp_path / "step-1"), compression="zstd")
    assert data_bytes(tmp_path / "step-2") <= 0.10 * data_bytes(tmp_path / "step-1")
    chunks_changed = len(calls)  # only lora.a and lora.b were compressed
    check(str(tmp_path / "step-2"), state(2))
    calls.clear()
    save(str(tmp_path / "step-3"), state(3))  # another encoding (no compression) shares no hashes
    save(str(tmp_path / "step-4"), state(3), base=str(tmp_path / "step-2"))
    assert data_bytes(tmp_path / "step-4") >= data_bytes(tmp_path / "step-3") * 0.99  # nothing reused
    assert chunks_changed == RANKS + 1  # a chunk of lora.a per rank, lora.b once (replica 0); base.w none
    check(str(tmp_path / "step-4"), state(3))


def test_shard_hashes_cover_values_and_encoding_not_memory_layout():
    from reshard.store.format.encode import shard_encoding
    from reshard.store.write.incremental import digest

    meta = rs.create("memory://digest-test/ck", L).meta("base.w", L["base.w"], "float32")
    zstd = rs.create("memory://digest-test/z", L, compression="zstd").meta("base.w", L["base.w"], "float32")
    how = shard_encoding(meta, (0, 0))
    values = np.arange(16 * 512, dtype=np.float32).reshape(16, 512)
    strided = np.asfortranarray(values)  # same values, other memory order
    assert digest(how, values) == digest(how, strided) == digest(how, values.astype(">f4"))
    assert digest(how, values).startswith("xxh3_128v:")
    changed = values.copy()
    changed[7, 300] += 1
    assert digest(how, changed) != digest(how, values)
    assert digest(shard_encoding(zstd, (0, 0)), values) != digest(how, values)  # another codec, another hash
    assert shard_encoding(meta, (1, 0)) == how  # same shape and codecs: only the values tell shards apart


def test_an_overwrite_reuses_the_replaced_generation_and_gc_keeps_what_it_references(tmp_path):
    url = str(tmp_path / "ck")
    save(url, state(1))
    save(url, state(2), base=url, overwrite=True, save_id="2")
    collected = rs.gc(url, min_age=0)
    assert collected.removed == ("gen-0",) and collected.kept_referenced  # the frozen shards' objects stay
    assert not (tmp_path / "ck/gen-0/.reshard/ranks").exists()
    check(url, state(2))
    assert cli("verify", url).returncode == 0
    # a third save that changes everything references nothing old: gc then removes all of gen-0
    save(url, state(3, frozen_seed=1), base=url, overwrite=True, save_id="3")
    rs.gc(url, min_age=0)
    assert sorted(p.name for p in (tmp_path / "ck").glob("gen-*")) == ["gen-3"]
    check(url, state(3, frozen_seed=1))


def _three_steps_keeping_one(url: str) -> list[int]:
    """Steps 1-3 of an incremental manager that keeps one step; the steps it lists at the end."""
    with rs.CheckpointManager(url, L, max_to_keep=1, incremental=True, async_save=False) as mgr:
        for step in (1, 2, 3):
            for rank in range(RANKS):
                mgr.save(step, rank, local(state(step), rank))
            mgr.wait(committed=True, timeout=60)
        return mgr.steps()


def test_a_manager_keeps_referenced_objects_of_steps_retention_dropped(tmp_path):
    url = str(tmp_path / "run")
    assert _three_steps_keeping_one(url) == [3]
    index = json.loads((tmp_path / "run/manager.json").read_text())
    assert index["steps"][-1]["refs"] == [1]  # the frozen bytes are step 1's, whatever step 2 did
    # steps 1 and 2 are gone as checkpoints; step 1's referenced objects stay
    with pytest.raises((CheckpointNotFoundError, UncommittedCheckpointError)):  # its marker is gone
        rs.open(str(tmp_path / "run/step-1"))
    assert not (tmp_path / "run/step-2").exists()
    assert data_bytes(tmp_path / "run/step-1") > 0
    check(str(tmp_path / "run/step-3"), state(3))
    assert cli("verify", str(tmp_path / "run/step-3")).returncode == 0
    # reopening the root (the committer reconciles) keeps them; a step changing everything frees them
    with rs.CheckpointManager(url, L, max_to_keep=1, incremental=True, async_save=False) as mgr:
        assert (tmp_path / "run/step-1").exists()
        for rank in range(RANKS):
            mgr.save(4, rank, local(state(4, frozen_seed=1), rank))
        mgr.wait(committed=True, timeout=60)
        assert mgr.steps() == [4]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".reshard", "manager.json", "step-4"]
    check(str(tmp_path / "run/step-4"), state(4, frozen_seed=1))


def test_incremental_on_s3(s3_server, s3_bucket):
    opts = s3_server.storage_options()
    root = f"s3://{s3_bucket}/run"
    save(f"{root}/step-1", state(1), storage_options=opts)
    save(f"{root}/step-2", state(2), base=f"{root}/step-1", storage_options=opts)
    fs = fsspec.filesystem("s3", **opts)
    sizes = [sum(fs.du(f"{s3_bucket}/run/step-{s}/{g}", total=True) for g in ("gen-0",)) for s in (1, 2)]
    assert sizes[1] < 0.2 * sizes[0], sizes
    check(f"{root}/step-2", state(2), storage_options=opts)


def test_bad_bases_are_refused_with_clear_errors(tmp_path):
    save(str(tmp_path / "a"), state(1))
    with pytest.raises(ValueError, match="same folder"):
        rs.create(str(tmp_path / "x" / "b"), L, base=str(tmp_path / "a"))
    with pytest.raises(UncommittedCheckpointError, match="no committed checkpoint"):
        rs.create(str(tmp_path / "b"), L, base=str(tmp_path / "nothing"))
    writer = rs.create(str(tmp_path / "d"), L, form="directory")
    for rank in range(RANKS):
        writer.write(rank, local(state(1), rank))
    writer.commit()
    with pytest.raises(FormatError, match="directory form"):
        rs.create(str(tmp_path / "b"), L, base=str(tmp_path / "d"))
    with pytest.raises(ValueError, match="packed form"):
        rs.create(str(tmp_path / "b"), L, base=str(tmp_path / "a"), form="directory")


def test_a_commit_refuses_references_to_objects_deleted_meanwhile(tmp_path):
    save(str(tmp_path / "step-1"), state(1))
    writer = rs.create(str(tmp_path / "step-2"), L, base=str(tmp_path / "step-1"))
    for rank in range(RANKS):
        writer.write(rank, local(state(2), rank))
    for obj in (tmp_path / "step-1").rglob("*.bin"):
        obj.unlink()
    with pytest.raises(CheckpointNotFoundError, match="gone"):
        writer.commit()


# ------------------------------------------------------------ issue 23: gc and retention follow references
def test_gc_of_a_retired_step_keeps_what_later_steps_reference(tmp_path):
    url = str(tmp_path / "run")
    _three_steps_keeping_one(url)
    assert (tmp_path / "run/step-1").exists()  # retired: step 3 references its frozen bytes
    done = cli("gc", f"{url}/step-1", "--min-age", "0")
    assert done.returncode == 0, done.stderr
    check(f"{url}/step-3", state(3))
    assert cli("verify", f"{url}/step-3").returncode == 0


@pytest.mark.parametrize("where", ["file", "s3"])
def test_gc_of_a_base_keeps_what_a_checkpoint_beside_it_references(tmp_path, where, request):
    opts: dict = {}
    root = str(tmp_path)
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        opts, root = server.storage_options(), f"s3://{server.make_bucket()}/run"
    save(f"{root}/a", state(1), storage_options=opts)
    save(f"{root}/b", state(2), base=f"{root}/a", storage_options=opts)
    save(f"{root}/a", state(5, frozen_seed=3), overwrite=True, save_id="new", storage_options=opts)  # replaces a
    done = rs.gc(f"{root}/a", min_age=0, storage_options=opts)
    assert done.removed == ("gen-0",) and done.kept_referenced  # b's frozen shards live in a's replaced save
    check(f"{root}/b", state(2), storage_options=opts)
    check(f"{root}/a", state(5, frozen_seed=3), storage_options=opts)


def test_back_to_back_async_incremental_saves_with_retention_all_commit(tmp_path):
    url = str(tmp_path / "run")
    with rs.CheckpointManager(url, L, max_to_keep=2, incremental=True) as mgr:  # async, no pause between steps
        for step in range(1, 9):
            for rank in range(RANKS):
                mgr.save(step, rank, local(state(step), rank))
        mgr.wait(committed=True, timeout=120)
        assert mgr.steps() == [7, 8]
    for step in (7, 8):
        check(f"{url}/step-{step}", state(step))
    with rs.CheckpointManager(url, L, max_to_keep=1, incremental=True) as mgr:  # a new job: nothing in flight
        for rank in range(RANKS):
            mgr.save(9, rank, local(state(9, frozen_seed=1), rank))
        mgr.wait(committed=True, timeout=60)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".reshard", "manager.json", "step-9"]
    check(f"{url}/step-9", state(9, frozen_seed=1))


@pytest.mark.parametrize("engine", ["zarr", "fast"])
def test_an_incremental_step_opened_by_a_relative_path_reads_its_base(tmp_path, monkeypatch, engine):
    """zarr's engine resolves references into the checkpoint beside through ``Storage.parent_url``."""
    monkeypatch.chdir(tmp_path)
    save(str(tmp_path / "step-1"), state(1))
    save(str(tmp_path / "step-2"), state(2), base=str(tmp_path / "step-1"))
    check("step-2", state(2), engine=engine)  # the folder named alone: its parent is the working directory
