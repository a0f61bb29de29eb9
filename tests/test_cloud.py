"""One storage contract on every backend: local files, fsspec memory, and S3.

S3 is a real moto server on loopback (started by the test session) behind a
counting, fault-injecting proxy: requests and bytes are counted on the wire.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout

SHAPES = {"model.w": (96, 40), "model.b": (40,), "moments.model.w": (96, 40)}


def source_layouts() -> dict[str, Layout]:
    return {
        "model.w": Layout.from_mindspore([2, 2], [1, 0], SHAPES["model.w"]),
        "model.b": Layout.from_mindspore([2, 2], [-1], SHAPES["model.b"]),
        "moments.model.w": Layout.from_mindspore([2, 2], [-1, 0], SHAPES["model.w"], opt_shard_size=-1),
    }


def target_layouts() -> dict[str, Layout]:
    return {n: Layout.from_dtensor((3,), ["S(0)"], s) for n, s in SHAPES.items()}


def full_state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


@dataclass
class Backend:
    name: str
    base: str
    options: dict[str, Any] = field(default_factory=dict)
    proxy: Any = None

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    @property
    def processes(self) -> bool:  # memory:// lives in one process
        return self.name != "memory"


@pytest.fixture(params=["file", "memory", "s3"])
def backend(request, tmp_path) -> Backend:
    if request.param == "file":
        return Backend("file", f"file://{tmp_path}")
    if request.param == "memory":
        return Backend("memory", f"memory://reshard-{uuid.uuid4().hex}")
    proxy = request.getfixturevalue("s3_proxy")
    bucket = request.getfixturevalue("s3_bucket")
    return Backend("s3", f"s3://{bucket}", proxy.storage_options(), proxy)


# ---------------------------------------------------------------- helpers
def write_rank(url: str, options: dict[str, Any], rank: int, seed: int = 0) -> None:
    """What each rank's process runs: create with the common arguments, write its pieces."""
    full, lay = full_state(seed), source_layouts()
    writer = rs.create(url, lay, storage_options=options)
    writer.write(rank, {**{n: full[n][lay[n].region(rank)] for n in lay}, "step": 7})


def run_writers(backend: Backend, url: str, ranks: list[int], seed: int = 0) -> None:
    if backend.processes:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=write_rank, args=(url, backend.options, r, seed)) for r in ranks]
    else:
        procs = [threading.Thread(target=write_rank, args=(url, backend.options, r, seed)) for r in ranks]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    if backend.processes:
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def check_all_ranks(url: str, options: dict[str, Any], seed: int = 0) -> None:
    """Open (in whatever process this runs in) and check every target rank exactly."""
    ckpt = rs.open(url, storage_options=options)
    full, tgt = full_state(seed), target_layouts()
    assert ckpt.leaves == {"step": 7}
    for rank in range(3):
        got = ckpt.load(tgt, rank)
        for name, lay in tgt.items():
            node: Any = got
            for part in name.split("."):
                node = node[part]
            np.testing.assert_array_equal(node, full[name][lay.region(rank)])


# ------------------------------------------------------------------ tests
def test_ranks_save_commit_and_a_fresh_process_loads(backend):
    url = backend.url("ck")
    run_writers(backend, url, [0, 1, 2, 3])
    rs.commit(url, storage_options=backend.options)
    if backend.processes:
        proc = mp.get_context("spawn").Process(target=check_all_ranks, args=(url, backend.options))
        proc.start()
        proc.join(120)
        assert proc.exitcode == 0
    else:
        check_all_ranks(url, backend.options)


def test_uncommitted_refused_and_crash_keeps_previous(backend):
    first, second = backend.url("step1"), backend.url("step2")
    rs.save(full_state(0), first, source_layouts(), storage_options=backend.options)
    run_writers(backend, second, [0, 1, 2], seed=1)  # rank 3 "crashed" before writing
    with pytest.raises(rs.UncommittedCheckpointError, match=r"ranks \[3\]"):
        rs.open(second, storage_options=backend.options)
    with pytest.raises(rs.UncommittedCheckpointError):
        rs.commit(second, storage_options=backend.options, ranks=[0, 1, 2, 3])
    ckpt = rs.open(first, storage_options=backend.options)
    np.testing.assert_array_equal(ckpt["model.w"].read(), full_state(0)["model.w"])


def test_commit_race_on_the_backend(backend):
    url = backend.url("ck")
    saved = rs.save(full_state(), url, source_layouts(), storage_options=backend.options)
    with pytest.raises(rs.CommitConflictError, match="committed already"):
        rs.commit(url, save_id=saved.save_id, storage_options=backend.options)
    with pytest.raises(rs.CheckpointExistsError):
        rs.save(full_state(), url, source_layouts(), storage_options=backend.options)


def test_partial_load_reads_only_needed_bytes(backend):
    """One rank of 8 from a 64 MiB tensor saved by 3 ranks: bytes and requests bounded."""
    arr = np.random.default_rng(5).standard_normal((4096, 4096)).astype(np.float32)
    url = backend.url("big")
    rs.save({"w": arr}, url, {"w": Layout.from_dtensor((3,), ["S(0)"], arr.shape)},
            storage_options=backend.options)
    target = {"w": Layout.from_dtensor((8,), ["S(0)"], arr.shape)}
    ckpt = rs.open(url, storage_options=backend.options)
    if backend.proxy:
        backend.proxy.reset_counters()
    got = ckpt.load(target, 3)["w"]
    np.testing.assert_array_equal(got, arr[target["w"].region(3)])
    needed = got.nbytes  # 8 MiB, inside source shard 1
    stats = ckpt.last_stats
    assert stats.bytes_fetched <= 1.25 * needed
    # bound: one index read + one coalesced data read per source shard touched (1 here)
    assert stats.requests <= 2
    if backend.proxy:  # and the after-read check that the checkpoint was not replaced: its marker
        gets = backend.proxy.records(method="GET")
        assert len(gets) == backend.proxy.requests <= 3
        assert backend.proxy.bytes_sent <= 1.25 * needed
    # the shard index is cached: reading again fetches no index
    before = ckpt.stats.snapshot()
    ckpt.load(target, 3)
    assert (ckpt.stats - before).requests == 2  # the data and the marker


def test_s3_survives_503s_and_connection_resets(s3_proxy, s3_bucket):
    s3_proxy.fail_rate, s3_proxy.reset_rate, s3_proxy.max_streak = 0.2, 0.1, 2
    opts = s3_proxy.storage_options()
    url = f"s3://{s3_bucket}/flaky"
    rs.save({**full_state(), "step": 7}, url, source_layouts(), storage_options=opts)
    check_all_ranks(url, opts)
    assert s3_proxy.faults > 0, "no fault was injected: the test proved nothing"


def test_s3_permanent_403_fails_fast_naming_the_key(s3_proxy, s3_bucket):
    opts = s3_proxy.storage_options()
    url = f"s3://{s3_bucket}/denied"
    rs.save({**full_state(), "step": 7}, url, source_layouts(), storage_options=opts, form="directory")  # shard keys
    ckpt = rs.open(url, storage_options=opts)
    s3_proxy.deny("*/model/w/c/*")
    s3_proxy.reset_counters()
    start = time.monotonic()
    with pytest.raises(rs.StorageError, match=r"denied/gen-[0-9a-f]+/model/w/c/.*PermissionError"):
        ckpt["model.w"].read()
    assert time.monotonic() - start < 5
    assert s3_proxy.requests <= 8  # no retry storm: at most one try per shard touched
    np.testing.assert_array_equal(ckpt["model.b"].read(), full_state()["model.b"])


@pytest.mark.parametrize("engine", ["tensorstore", "zarr"])
def test_general_engines_read_from_s3(s3_server, s3_bucket, engine, monkeypatch):
    """TensorStore's s3 kvstore and zarr-python's FsspecStore read the same objects."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # TensorStore takes credentials from the env
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    opts = s3_server.storage_options()
    url = f"s3://{s3_bucket}/engines"
    form = "directory" if engine == "tensorstore" else "packed"  # TensorStore reads the directory form only
    rs.save({**full_state(), "step": 7}, url, source_layouts(), storage_options=opts, form=form)
    ckpt = rs.open(url, storage_options=opts, engine=engine)
    for name, arr in full_state().items():
        np.testing.assert_array_equal(ckpt[name].read(), arr)


def test_overwrite_gc_and_replaced_readers_on_the_backend(backend):
    """Generations on every storage: an overwrite leaves the old save readable until it commits, a reader of the
    replaced save is told so, and gc removes only what is old enough (listing times from each filesystem)."""
    url = backend.url("gens")
    opts = backend.options
    rs.save(full_state(0), url, source_layouts(), storage_options=opts)
    before = rs.open(url, storage_options=opts)
    rs.create(url, source_layouts(), overwrite=True, save_id="next", storage_options=opts)  # begun, not written
    np.testing.assert_array_equal(rs.open(url, storage_options=opts)["model.w"].read(), full_state(0)["model.w"])
    rs.save(full_state(1), url, source_layouts(), storage_options=opts, overwrite=True)
    with pytest.raises(rs.CheckpointReplacedError):
        before["model.w"].read()
    assert rs.gc(url, storage_options=opts).removed == ()  # the replaced save was written just now
    gone = rs.gc(url, min_age=0, storage_options=opts)
    assert len(gone.removed) == 1
    np.testing.assert_array_equal(rs.open(url, storage_options=opts)["model.w"].read(), full_state(1)["model.w"])
