"""CheckpointManager in one process: steps, retention, resume, async staging, errors surfacing."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout
from reshard.store.io.storage import Storage
from reshard.store.manager import Index, Retention, StepRecord, read_index
from reshard.store.manager.retention import delete_steps, plan

from tests.reliability.harness import step_manifests

SHAPE = (8, 3)
L = {"w": Layout.from_dtensor((4,), ["S(0)"], SHAPE), "b": Layout.from_dtensor((4,), ["R"], (3,))}


def full(step: int) -> np.ndarray:
    return np.arange(24, dtype=np.float32).reshape(SHAPE) + step


def save_all(mgr: rs.CheckpointManager, step: int, **kw) -> None:
    for r in range(4):
        mgr.save(step, r, {"w": full(step)[2 * r : 2 * r + 2], "b": np.full(3, step, np.float32), "lr": 0.1}, **kw)


def test_steps_are_ordinary_checkpoints_and_retention_keeps_latest_and_every(tmp_path):
    url = str(tmp_path / "run")
    with rs.CheckpointManager(url, L, max_to_keep=2, keep_every=10) as mgr:
        assert mgr.steps() == [] and mgr.latest_step() is None
        for step in (5, 10, 15, 20, 25):
            save_all(mgr, step)
            mgr.wait(committed=True, timeout=30)
        assert mgr.steps() == [10, 20, 25]
        assert mgr.latest_step() == 25
        np.testing.assert_array_equal(mgr.open()["w"].read(), full(25))
        np.testing.assert_array_equal(mgr.open(step=10)["w"].read(), full(10))
        got = mgr.load({"w": Layout.from_dtensor((3,), ["S(0)"], SHAPE)}, rank=1)
        np.testing.assert_array_equal(got["w"], full(25)[3:6])
        assert got["lr"] == 0.1
    assert sorted(os.listdir(url)) == [".reshard", "manager.json", "step-10", "step-20", "step-25"]
    np.testing.assert_array_equal(rs.open(f"{url}/step-20")["w"].read(), full(20))  # plain rs.open reads a step


def test_keep_best_by_a_recorded_metric(tmp_path):
    with rs.CheckpointManager(str(tmp_path / "run"), L, max_to_keep=1, keep_best=2, best_metric="loss") as mgr:
        for step, loss in [(1, 0.5), (2, 0.1), (3, 0.9), (4, 0.2), (5, 0.7)]:
            save_all(mgr, step, metrics={"loss": loss})
            mgr.wait(committed=True, timeout=30)
        assert mgr.steps() == [2, 4, 5]
        assert mgr.metrics(2) == {"loss": 0.1}


def test_retention_plans_by_the_rules_alone(tmp_path):
    # references between steps do not keep a step listed: its referenced objects outlive it
    # (tests/test_incremental.py checks that on real incremental steps)
    records = (StepRecord(1, 0.0), StepRecord(2, 0.0, refs=(1,)), StepRecord(3, 0.0, refs=(1, 2)), StepRecord(4, 0.0))
    assert plan(Index(records), Retention(max_to_keep=1)) == ([4], [1, 2, 3])
    assert plan(Index(records), Retention(max_to_keep=2, keep_every=2)) == ([2, 3, 4], [1])
    root = Storage(str(tmp_path))
    for s in (1, 2, 3):
        root.write(f"step-{s}/x", b"1")
    held = delete_steps(root, [records[1]], Index((records[2],)))
    # step 2 and the step it references (1) are reconsidered; step 3 has no marker, so it needs none of their objects
    assert held == {} and not (tmp_path / "step-1").exists() and not (tmp_path / "step-2").exists()
    assert (tmp_path / "step-3").exists()


def test_the_index_keeps_the_committing_flag_and_refuses_newer_versions(tmp_path):
    index = Index((StepRecord(1, 1.0, {"loss": 0.5}), StepRecord(2, 2.0, refs=(1,), committing=True)))
    back = Index.parse("x", index.to_json())
    assert back.steps == index.steps and [r.committing for r in back.steps] == [False, True]
    assert "committing" not in json.loads(index.to_json())["steps"][0]  # only flagged records carry it
    doc = json.loads(index.to_json())
    doc["manager_version"] = 3
    with pytest.raises(rs.FormatError, match="version"):
        Index.parse("x", json.dumps(doc).encode())


def test_bad_retention_arguments():
    with pytest.raises(ValueError, match="max_to_keep"):
        Retention(max_to_keep=0)
    with pytest.raises(ValueError, match="best_metric"):
        Retention(keep_best=2)


def test_resume_continues_numbering_and_refuses_a_committed_step(tmp_path):
    url = str(tmp_path / "run")
    with rs.CheckpointManager(url, L) as mgr:
        save_all(mgr, 100)
    mgr = rs.CheckpointManager(url, L, max_to_keep=3)
    assert mgr.latest_step() == 100
    with pytest.raises(rs.CheckpointExistsError, match="already holds a committed checkpoint"):
        save_all(mgr, 100)  # again: the background write refuses, the next call raises
        mgr.wait(committed=True, timeout=30)
    with contextlib.suppress(rs.CheckpointExistsError):
        mgr.wait(committed=True, timeout=30)  # the other ranks' refusals, if they came later
    mgr.wait(timeout=30)  # each failure is raised once
    save_all(mgr, 200)
    mgr.close()
    assert rs.CheckpointManager(url, L).steps() == [100, 200]
    np.testing.assert_array_equal(mgr.open(100)["w"].read(), full(100))


def test_steps_must_increase(tmp_path):
    with rs.CheckpointManager(str(tmp_path / "run"), L) as mgr:
        save_all(mgr, 3)
        with pytest.raises(ValueError, match="steps must increase"):
            mgr.save(2, 0, {"w": full(2)[:2], "b": np.zeros(3, np.float32)})


def test_state_changed_right_after_save_returns_is_not_what_is_written(tmp_path):
    with rs.CheckpointManager(str(tmp_path / "run"), L, max_pending=2) as mgr:
        for step in (1, 2, 3):
            pieces = [{"w": full(step)[2 * r : 2 * r + 2].copy(), "b": np.full(3, step, np.float32),
                       "meta": {"seen": [step]}} for r in range(4)]
            for r, piece in enumerate(pieces):
                mgr.save(step, r, piece)
                piece["w"][...] = -1  # the training step moves on at once
                piece["b"] += 100
                piece["meta"]["seen"].append(-1)
        mgr.wait(committed=True, timeout=30)
        for step in (1, 2, 3):
            ckpt = mgr.open(step)
            np.testing.assert_array_equal(ckpt["w"].read(), full(step))
            np.testing.assert_array_equal(ckpt["b"].read(), np.full(3, step, np.float32))
            assert ckpt.leaves["meta.seen"] == [step]


def test_staging_buffers_are_reused_across_saves(tmp_path):
    with rs.CheckpointManager(str(tmp_path / "run"), L) as mgr:
        save_all(mgr, 1)
        mgr.wait()
        slot = mgr.staging._free[0][0]
        first = [a.ctypes.data for a in slot.arrays]
        save_all(mgr, 2)
        mgr.wait()
        assert [a.ctypes.data for a in mgr.staging._free[0][0].arrays] == first


def test_a_background_failure_surfaces_on_the_next_call(tmp_path):
    mgr = rs.CheckpointManager(str(tmp_path / "run"), L, commit_timeout=2)
    mgr.save(1, 1, {"w": np.zeros((5, 3), np.float32), "b": np.zeros(3, np.float32)})  # wrong local shape
    with pytest.raises(rs.ShapeMismatchError, match="rank 1"):
        mgr.wait(timeout=30)
    mgr.wait(timeout=30)  # raised once
    mgr.close(raise_errors=False)


def test_a_step_a_rank_never_wrote_is_invisible_and_cleaned_up(tmp_path):
    url = str(tmp_path / "run")
    mgr = rs.CheckpointManager(url, L, commit_timeout=3)
    save_all(mgr, 1)
    for r in (0, 1, 3):  # rank 2 died
        mgr.save(2, r, {"w": full(2)[2 * r : 2 * r + 2], "b": np.zeros(3, np.float32)})
    with pytest.raises(rs.UncommittedCheckpointError, match=r"ranks \[2\].*step 2 is abandoned"):
        mgr.wait(committed=True, timeout=30)
    assert mgr.steps() == [1]
    assert "step 2" in json.loads((tmp_path / "run" / "manager.json").read_text())["failed"]["2"]
    assert (tmp_path / "run" / "step-2").exists()
    save_all(mgr, 3)
    mgr.wait(committed=True, timeout=30)
    assert mgr.steps() == [1, 3] and not (tmp_path / "run" / "step-2").exists()
    mgr.close()


def test_a_new_job_removes_what_a_crashed_one_left(tmp_path):
    url = str(tmp_path / "run")
    with rs.CheckpointManager(url, L) as mgr:
        save_all(mgr, 1)
    w = rs.create(f"{url}/step-2", L, save_id="2")  # a crashed job's half-written step
    w.write(3, {"w": full(2)[6:8], "b": np.zeros(3, np.float32)})
    stray = tmp_path / "run" / "manager.json.0123abcd.tmp"  # its committer killed while writing the index
    stray.write_text("{")
    with rs.CheckpointManager(url, L, rank=3) as other:  # not the committer: touches nothing
        assert other.steps() == [1]
    assert (tmp_path / "run" / "step-2").exists() and stray.exists()
    with rs.CheckpointManager(url, L, rank=0) as mgr:
        assert not (tmp_path / "run" / "step-2").exists() and not stray.exists()
        save_all(mgr, 2)
        mgr.wait(committed=True, timeout=30)
        np.testing.assert_array_equal(mgr.open()["w"].read(), full(2))


def test_a_reading_manager_never_deletes_and_cannot_save(tmp_path):
    url = str(tmp_path / "run")
    with rs.CheckpointManager(url, L) as mgr:
        save_all(mgr, 1)
    w = rs.create(f"{url}/step-2", L, save_id="2")  # a live job's step being written
    w.write(3, {"w": full(2)[6:8], "b": np.zeros(3, np.float32)})
    reader = rs.CheckpointManager(url)  # a notebook: no layouts, no RANK
    assert reader.steps() == [1] and (tmp_path / "run" / "step-2").exists()
    np.testing.assert_array_equal(reader.load({"w": Layout.single(SHAPE)}, 0)["w"], full(1))
    with pytest.raises(ValueError, match="cannot save"):
        reader.save(3, 0, {})


def test_sync_save_writes_before_returning(tmp_path):
    url = str(tmp_path / "run")
    with rs.CheckpointManager(url, L, async_save=False) as mgr:
        save_all(mgr, 1)
        (gen,) = (tmp_path / "run" / "step-1").glob("gen-1-j*")  # rank objects (packed) or manifests (directory)
        assert all((gen / "packed" / f"{r}.bin").exists() or (gen / ".reshard" / "ranks" / f"{r}.json").exists()
                   for r in range(4))
        mgr.wait(committed=True, timeout=30)
        assert mgr.steps() == [1]


def test_index_errors_raise_never_read_as_empty(tmp_path):
    url = str(tmp_path / "run")
    with rs.CheckpointManager(url, L) as mgr:
        save_all(mgr, 1)
    (tmp_path / "run" / "manager.json").write_text("{not json")
    with pytest.raises(rs.FormatError, match=r"manager\.json"):
        rs.CheckpointManager(url, L, rank=5).steps()
    assert read_index(Storage(str(tmp_path / "elsewhere"))).numbers() == []


def test_torch_tensors_are_staged_bit_exact(tmp_path):
    torch = pytest.importorskip("torch")
    lay = {"w": Layout.from_dtensor((2,), ["S(0)"], (4, 4))}
    src = torch.randn(4, 4).to(torch.bfloat16)
    with rs.CheckpointManager(str(tmp_path / "run"), lay) as mgr:
        for r in range(2):
            piece = src[2 * r : 2 * r + 2].clone()
            mgr.save(1, r, {"w": piece})
            piece.zero_()
        mgr.wait(committed=True, timeout=30)
        got = mgr.open()["w"].read()
    assert got.dtype.name == "bfloat16"
    assert torch.equal(torch.from_numpy(got.view(np.int16)).view(torch.bfloat16), src)


def test_jax_arrays_are_staged(tmp_path):
    jnp = pytest.importorskip("jax.numpy")
    lay = {"w": Layout.from_dtensor((2,), ["S(0)"], (4, 2))}
    with rs.CheckpointManager(str(tmp_path / "run"), lay) as mgr:
        for r in range(2):
            mgr.save(1, r, {"w": jnp.arange(4, dtype=jnp.float32).reshape(2, 2) + 10 * r})
        mgr.wait(committed=True, timeout=30)
        np.testing.assert_array_equal(mgr.open()["w"].read()[2:], np.arange(4).reshape(2, 2) + 10)


def test_s3_missing_bucket_is_an_error_not_nothing_there(s3_proxy):
    mgr = rs.CheckpointManager("s3://no-such-bucket-here/run", L, rank=7, storage_options=s3_proxy.storage_options())
    with pytest.raises(rs.StorageError, match="bucket"):
        mgr.steps()
    with pytest.raises(rs.StorageError, match="bucket"):
        Storage("s3://no-such-bucket-here/run", s3_proxy.storage_options()).list("")


def test_s3_failed_index_read_raises(s3_proxy, s3_bucket):
    url = f"s3://{s3_bucket}/run"
    with rs.CheckpointManager(url, L, storage_options=s3_proxy.storage_options()) as mgr:
        save_all(mgr, 1)
    s3_proxy.deny("*manager.json")
    with pytest.raises(rs.StorageError):
        mgr.latest_step()


def test_replicas_are_not_staged(tmp_path):
    with rs.CheckpointManager(str(tmp_path / "run"), L) as mgr:
        save_all(mgr, 1)
        mgr.wait()
        assert [a.shape for a in mgr.staging._free[0][0].arrays] == [(2, 3), (3,)]  # rank 0 writes "b"
        assert [a.shape for a in mgr.staging._free[1][0].arrays] == [(2, 3)]  # rank 1 holds a replica of it
        mgr.wait(committed=True, timeout=30)
        np.testing.assert_array_equal(mgr.open()["b"].read(), np.ones(3, np.float32))


def test_torch_manager_saves_and_loads_a_state_dict(tmp_path):
    torch = pytest.importorskip("torch")
    from reshard.store.manager import TorchCheckpointManager

    model = torch.nn.Linear(4, 3)
    with TorchCheckpointManager(str(tmp_path / "run"), model.state_dict(), max_to_keep=1) as mgr:
        for step in (1, 2):
            with torch.no_grad():
                model.weight.fill_(step)
            mgr.save(step, {**model.state_dict(), "epoch": step}, metrics={"loss": 1.0 / step})
        mgr.wait(committed=True, timeout=30)
        assert mgr.steps() == [2] and mgr.metrics(2) == {"loss": 0.5}
        other = torch.nn.Linear(4, 3)
        sd = {**other.state_dict(), "epoch": 0}
        assert mgr.load(sd) == 2
        assert torch.equal(sd["weight"], torch.full((3, 4), 2.0)) and sd["epoch"] == 2


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(not _cuda(), reason="no CUDA device")
def test_cuda_tensors_are_staged_through_pinned_buffers(tmp_path):
    import torch

    lay = {"w": Layout.from_dtensor((2,), ["S(0)"], (1024, 256))}
    src = torch.randn(1024, 256, device="cuda")
    with rs.CheckpointManager(str(tmp_path / "run"), lay) as mgr:
        for r in range(2):
            piece = src[512 * r : 512 * (r + 1)].clone()
            mgr.save(1, r, {"w": piece})
            piece.zero_()  # on the GPU stream, after the staging copy was queued
        mgr.wait(committed=True, timeout=60)
        assert mgr.staging._free[0][0].pinned
        np.testing.assert_array_equal(mgr.open()["w"].read(), src.cpu().numpy())


def test_staging_copies_large_states_in_pieces_on_the_pool(monkeypatch):
    """A state over PARALLEL_BYTES is copied in pieces by the pool's threads: every byte lands, the
    non-contiguous and small arrays too, and the copy is the caller's no longer (mutating it changes nothing)."""
    import threading

    from reshard.store.manager import staging

    monkeypatch.setattr(staging, "PARALLEL_BYTES", 1 << 16)
    monkeypatch.setattr(staging, "PIECE_BYTES", 1 << 12)
    monkeypatch.setattr(staging.os, "cpu_count", lambda: 2)
    rng = np.random.default_rng(5)
    state = {"big": rng.standard_normal((64, 300)).astype(np.float32),  # 75 KiB: 19 pieces
             "strided": rng.standard_normal((40, 60))[:, ::2],
             "small": np.arange(7, dtype=np.int16)}
    want = {n: a.copy() for n, a in state.items()}
    threads: set[str] = set()
    copyto = np.copyto
    monkeypatch.setattr(staging.np, "copyto", lambda d, s: threads.add(threading.current_thread().name) or copyto(d, s))
    assert len(staging._copy_jobs(state["big"], np.empty_like(state["big"]))) == 19
    staged = staging.StagingPool().stage(0, state)
    for a in state.values():
        a[...] = 0
    for name, arr in want.items():
        np.testing.assert_array_equal(staged.arrays[name], arr)
    assert threads and all(t.startswith("reshard-io") for t in threads)
    staged.release()


# ------------------------------------------------------------ issue 23: the lifecycle around saves
def test_keep_best_never_takes_a_nan_metric_for_best(tmp_path):
    records = [StepRecord(s, 0.0, metrics={"loss": v}) for s, v in
               [(1, float("nan")), (2, 5.0), (3, 0.1), (4, 3.0), (5, 4.0)]]
    assert plan(Index(tuple(records)), Retention(max_to_keep=1, keep_best=1, best_metric="loss")) == ([3, 5],
                                                                                                     [1, 2, 4])
    assert Retention(max_to_keep=1, keep_best=1, best_metric="loss", best_mode="max").chosen(records) == {2, 5}
    with rs.CheckpointManager(str(tmp_path / "run"), L, max_to_keep=1, keep_best=1, best_metric="loss") as mgr:
        for step, loss in [(1, float("nan")), (2, 5.0), (3, 0.1), (4, 3.0), (5, 4.0)]:
            save_all(mgr, step, metrics={"loss": loss})
            mgr.wait(committed=True, timeout=30)
        assert mgr.steps() == [3, 5]  # the best step (loss 0.1) stays; the diverged one goes
        np.testing.assert_array_equal(mgr.open(step=3)["w"].read(), full(3))


def test_a_second_job_takes_the_root_over_and_the_first_is_superseded(tmp_path):
    url = str(tmp_path / "run")
    first = rs.CheckpointManager(url, L, max_to_keep=3)
    save_all(first, 1)
    first.wait(committed=True, timeout=30)
    with pytest.warns(RuntimeWarning, match=rf"may still be alive \({socket.gethostname()} pid {os.getpid()}"):
        second = rs.CheckpointManager(url, L, max_to_keep=3)  # never refused: it supersedes the first
    assert rs.CheckpointManager(url).steps() == [1]  # a reader needs no token
    with pytest.raises(rs.JobSupersededError,
                       match=r"this job, job 1 \(started .*, was superseded by job 2 \(started .* on host "):
        save_all(first, 2)  # the first job's next save (its write, in the background, raises at once)
        first.wait(committed=True, timeout=30)
    with pytest.raises(rs.JobSupersededError):  # and every later one, at the call
        save_all(first, 3)
    first.close(raise_errors=False)
    save_all(second, 2)
    second.wait(committed=True, timeout=30)
    assert second.steps() == [1, 2]
    np.testing.assert_array_equal(second.open(step=2)["w"].read(), full(2))
    second.close()
    assert not (tmp_path / "run" / "manager.lock").exists()
    tokens = {json.loads(p.read_text())["token"] for p in (tmp_path / "run" / ".reshard" / "fence").glob("*.json")}
    assert tokens == {1, 2}
    assert [{m["fence"] for m in step_manifests(f"{url}/step-{s}")} for s in (1, 2)] == [{1}, {2}]


def test_a_restart_with_the_dead_jobs_host_and_pid_takes_the_root_at_once(tmp_path):
    """A container restarted after kill -9: same hostname, and its committer has the dead job's pid (here: a live
    one, this very process). The old lock looked alive for 600 s; the token decides now, at once."""
    url = str(tmp_path / "run")
    (tmp_path / "run").mkdir()
    alive = {"token": "x", "time": time.time(), "host": socket.gethostname(), "pid": os.getpid(), "lease": 600.0,
             "ready": True}
    (tmp_path / "run" / "manager.lock").write_text(json.dumps(alive))
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="fenced"), rs.CheckpointManager(url, L) as mgr:
        save_all(mgr, 1)
        mgr.wait(committed=True, timeout=30)
        assert mgr.steps() == [1]
    assert time.monotonic() - t0 < 20


def test_a_dead_jobs_root_lock_is_broken(tmp_path):
    url = str(tmp_path / "run")
    (tmp_path / "run").mkdir()
    dead = {"token": "x", "time": 0.0, "host": socket.gethostname(), "pid": 2**22 + 12345, "lease": 600.0}
    (tmp_path / "run" / "manager.lock").write_text(json.dumps(dead))
    with rs.CheckpointManager(url, L) as mgr:  # its holder is a dead process of this host
        save_all(mgr, 1)
        mgr.wait(committed=True, timeout=30)
        assert mgr.steps() == [1]


@pytest.fixture
def slow_commits(monkeypatch):
    """Commits that take 0.4 s: a save returns (and ``wait()`` too) while its commit still runs."""
    from reshard.store.manager import committer

    real = committer.commit

    def commit(root, **kw):
        time.sleep(0.4)
        return real(root, **kw)

    monkeypatch.setattr(committer, "commit", commit)


def test_a_restore_after_wait_waits_for_the_saves_commits(tmp_path, slow_commits):
    url = str(tmp_path / "run")
    with rs.CheckpointManager(url, L) as mgr:
        for step in (1, 2, 3):
            save_all(mgr, step)
        mgr.wait()  # written, not committed: the documented meaning of wait()
        assert mgr.restorable_step() == 3
        np.testing.assert_array_equal(mgr.open()["w"].read(), full(3))
    with rs.CheckpointManager(url, L, commit_timeout=0.2) as mgr:  # a commit slower than the timeout: named
        save_all(mgr, 4)
        with pytest.raises(TimeoutError, match=r"step 4, saved by this process, is still committing"):
            mgr.restorable_step()
        mgr.wait(committed=True, timeout=30)
        assert mgr.restorable_step() == 4


def test_torch_manager_load_after_wait_and_clear_errors(tmp_path, slow_commits):
    torch = pytest.importorskip("torch")
    from reshard.store.manager import TorchCheckpointManager

    url = str(tmp_path / "run")
    with pytest.raises(TypeError, match=r"needs the state dict it will save.*CheckpointManager\("):
        TorchCheckpointManager(url)
    model = torch.nn.Linear(4, 3)
    with TorchCheckpointManager(url, model.state_dict()) as mgr:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.fill_(step)
            mgr.save(step, model.state_dict())
        mgr.wait()
        other = torch.nn.Linear(4, 3).state_dict()
        assert mgr.load(other) == 3 and torch.equal(other["weight"], torch.full((3, 4), 3.0))
        with pytest.raises(rs.TensorNotFoundError, match=r"tensor 'z' was not in the state dict this manager"):
            mgr.save(4, {**model.state_dict(), "z": torch.ones(2)})


def test_jax_manager_restore_after_wait_and_clear_errors(tmp_path, slow_commits):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from reshard.store.frontends import jax as rj
    from reshard.store.manager import JaxCheckpointManager

    url = str(tmp_path / "run")
    with pytest.raises(TypeError, match=r"needs a pytree like the ones it will save.*CheckpointManager\("):
        JaxCheckpointManager(url)
    like = {"w": jnp.zeros(4)}
    with JaxCheckpointManager(url, like) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": jnp.full(4, float(step))})
        mgr.wait()
        got = mgr.restore({"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=like["w"].sharding)})
        np.testing.assert_array_equal(np.asarray(got["w"]), np.full(4, 3.0))
        with pytest.raises(TypeError, match=r"'w': .* stores an array \(float32\[4\]\) there, and the target gives "
                                             r"NoneType"):
            rj.restore(mgr.open(3), {"w": None})
