"""Format v2 save generations: overwrite, crashed ranks, stale locks and readers, gc, version 1."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout
from reshard.store.commit import locks, marker
from reshard.store.commit.gc import gc

L = {"m": Layout.from_dtensor((4,), ["S(0)"], (8, 2))}
OLD = np.arange(16, dtype=np.float32).reshape(8, 2)


def _save_old(url: str) -> None:
    rs.save({"m": OLD}, url, L)


def _pieces(value: float) -> dict[int, dict[str, np.ndarray]]:
    return {r: {"m": np.full((2, 2), value, np.float32)} for r in range(4)}


def test_overwrite_with_a_crashed_rank_never_commits_mixed_data(tmp_path):
    url = str(tmp_path / "ck")
    _save_old(url)
    w = rs.create(url, L, overwrite=True, save_id=2)
    for r in (0, 1, 3):  # rank 2 crashed
        w.write(r, _pieces(1.0)[r])
    with pytest.raises(rs.UncommittedCheckpointError, match=r"ranks \[2\]"):
        w.commit()
    # the committed checkpoint is the old one, whole
    np.testing.assert_array_equal(rs.open(url)["m"].read(), OLD)


def test_overwrite_needs_a_new_save_id(tmp_path):
    url = str(tmp_path / "ck")
    w = rs.create(url, L, save_id=7)
    for r, piece in _pieces(1.0).items():
        w.write(r, piece)
    w.commit()
    with pytest.raises(rs.CheckpointExistsError, match="overwrite=True"):
        rs.create(url, L, save_id=8)
    with pytest.raises(rs.CheckpointExistsError, match="new save_id"):
        rs.create(url, L, overwrite=True, save_id=7)
    with pytest.raises(rs.CheckpointExistsError, match="new save_id"):
        rs.create(url, L, overwrite=True, save_id="7")  # ints and their decimal strings are one save_id
    w = rs.create(url, L, overwrite=True, save_id=8)
    for r, piece in _pieces(2.0).items():
        w.write(r, piece)
    w.commit()
    assert rs.open(url)["m"].read().tolist() == np.full((8, 2), 2.0).tolist()


def test_crash_in_the_middle_of_an_overwrite_keeps_the_old_checkpoint(tmp_path):
    url = str(tmp_path / "ck")
    _save_old(url)
    before = rs.open(url)
    w = rs.create(url, L, overwrite=True, save_id="next")
    w.write(0, _pieces(5.0)[0])  # ... and the job dies here
    np.testing.assert_array_equal(rs.open(url)["m"].read(), OLD)
    np.testing.assert_array_equal(before["m"].read(), OLD)  # a reader opened before is not disturbed


def test_a_rank_left_over_from_an_uncommitted_attempt_is_refused(tmp_path):
    url = str(tmp_path / "ck")
    w = rs.create(url, L, save_id=3)
    w.write(2, _pieces(1.0)[2])  # first attempt: only rank 2 wrote, then the job died
    again = rs.create(url, L, save_id=3)
    with pytest.raises(rs.CheckpointExistsError, match=r"rank 2 already wrote save_id '3'.*reshard gc"):
        again.write(2, _pieces(2.0)[2])
    gone = gc(url, min_age=0)
    assert gone.removed == ("gen-3",)
    w = rs.create(url, L, save_id=3)  # a save_id gc collected is never used again at this URL
    with pytest.raises(rs.CommitConflictError, match=r"save '3' was removed by `reshard gc`.*new save_id"):
        w.write(0, _pieces(2.0)[0])
    w = rs.create(url, L, save_id=4)
    for r, piece in _pieces(2.0).items():
        w.write(r, piece)
    w.commit()
    assert float(rs.open(url)["m"].read().max()) == 2.0


@pytest.mark.directory_form
def test_a_reader_of_a_replaced_checkpoint_raises_never_mixes(tmp_path):
    url = str(tmp_path / "ck")
    _save_old(url)
    old = rs.open(url)
    snapshot = rs.open(url, check_current=False)
    rs.save({"m": OLD + 100}, url, L, overwrite=True)
    with pytest.raises(rs.CheckpointReplacedError, match="replaced"):
        old["m"].read()
    with pytest.raises(rs.CheckpointReplacedError):
        old.load(L, rank=1)
    np.testing.assert_array_equal(snapshot["m"].read(), OLD)  # a snapshot reads its own save, whole
    np.testing.assert_array_equal(rs.open(url)["m"].read(), OLD + 100)
    assert gc(url, min_age=0).removed  # the replaced save goes; the snapshot's objects with it
    with pytest.raises(rs.CheckpointReplacedError):
        old["m"].read()
    with pytest.raises((rs.FormatError, FileNotFoundError)):
        snapshot["m"].read()


def test_edited_metadata_fails_its_first_use_by_digest(tmp_path):
    url = str(tmp_path / "ck")
    _save_old(url)
    gen = pathlib.Path(rs.open(url).storage.url)
    root = next(p for p in (gen / ".reshard" / "metadata.json", gen / "zarr.json") if p.exists())  # packed, directory
    doc = json.loads(root.read_text())
    doc["consolidated_metadata"]["metadata"]["m"]["data_type"] = "int32"
    root.write_text(json.dumps(doc))
    ckpt = rs.open(url)  # the summary is sealed apart, and untouched
    with pytest.raises(rs.FormatError, match="digest"):
        ckpt.read("m")


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe", b"[]", b'{"format_version": "2"}',
                                 b'{"format_version": 2, "generation": "../x", "metadata_sha256": "0"}',
                                 b'{"format_version": 99}'])
def test_malformed_marker_is_a_clear_error_naming_the_file(tmp_path, raw):
    url = str(tmp_path / "ck")
    _save_old(url)
    (tmp_path / "ck" / ".reshard" / "commit.json").write_bytes(raw)
    with pytest.raises(rs.FormatError, match=r"commit\.json|newer"):
        rs.open(url)


# ------------------------------------------------------------------ locks
def _written(url: str, save_id: object) -> None:
    w = rs.create(url, L, save_id=save_id)
    for r, piece in _pieces(1.0).items():
        w.write(r, piece)


def test_a_killed_committer_does_not_block_the_url(tmp_path):
    """A real process takes the commit lock and is killed with SIGKILL; the next commit goes through."""
    url = str(tmp_path / "ck")
    _written(url, 1)
    code = textwrap.dedent(f"""
        import sys, time
        from reshard.store.commit import locks, marker
        from reshard.store.io.storage import Storage
        root = Storage({url!r})
        locks.take_lock(root, root.child(marker.generation_of(1)), "1")
        print("locked", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        with pytest.raises(rs.CommitConflictError, match="reshard unlock"):
            rs.commit(url, save_id=1)  # the holder is alive
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    rs.commit(url, save_id=1)  # its holder is dead: the lock is broken
    assert rs.open(url)["m"].read().sum() == 16


def _foreign_lock(url: str, save_id: object, age: float) -> None:
    lock = pathlib.Path(url, marker.generation_of(save_id), ".reshard", "commit.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(json.dumps({"token": "t", "time": time.time() - age, "host": socket.gethostname() + "-other",
                                "pid": 1, "lease": 600}))


def test_another_hosts_lock_is_broken_after_its_lease_or_by_unlock(tmp_path):
    url = str(tmp_path / "ck")
    _written(url, 1)
    _foreign_lock(url, 1, age=10)
    with pytest.raises(rs.CommitConflictError, match=r"reshard unlock .* --save-id 1"):
        rs.commit(url, save_id=1)
    assert locks.unlock(url, save_id=1)
    rs.commit(url, save_id=1)

    url2 = str(tmp_path / "ck2")
    _written(url2, 1)
    _foreign_lock(url2, 1, age=3600)  # past its lease
    rs.commit(url2, save_id=1)

    url3 = str(tmp_path / "ck3")
    _written(url3, 1)
    _foreign_lock(url3, 1, age=1)
    rs.commit(url3, save_id=1, force=True)
    assert rs.open(url3)["m"].read().sum() == 16


def test_committing_a_committed_save_again_is_a_conflict(tmp_path):
    url = str(tmp_path / "ck")
    _written(url, 1)
    rs.commit(url, save_id=1)
    with pytest.raises(rs.CommitConflictError, match="committed already"):
        rs.commit(url, save_id=1)


# --------------------------------------------------------------------- gc
def test_gc_keeps_the_committed_and_young_saves(tmp_path):
    url = str(tmp_path / "ck")
    _save_old(url)
    rs.save({"m": OLD + 1}, url, L, overwrite=True)
    w = rs.create(url, L, overwrite=True, save_id="in-progress")  # written, not committed: young
    for r, piece in _pieces(1.0).items():
        w.write(r, piece)
    assert gc(url).removed == ()  # default min_age: everything is too young to go
    dry = gc(url, min_age=0, dry_run=True)
    assert len(dry.removed) == 2 and "gen-in-progress" in dry.removed
    assert len([p for p in (tmp_path / "ck").iterdir() if p.name.startswith("gen-")]) == 3
    gc(url, min_age=0)
    assert [p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("gen-")] == [
        json.loads((tmp_path / "ck/.reshard/commit.json").read_text())["generation"]]
    np.testing.assert_array_equal(rs.open(url)["m"].read(), OLD + 1)


# -------------------------------------------------------------- version 1
def _as_version_1(url: str) -> None:
    """Rewrite a fresh checkpoint the way format version 1 laid it out: data at the root, marker v1."""
    root = pathlib.Path(url)
    gen = pathlib.Path(rs.open(url).zarr_url)
    for item in gen.iterdir():
        shutil.move(str(item), str(root / item.name)) if item.name != ".reshard" else None
    shutil.move(str(gen / ".reshard" / "ranks"), str(root / ".reshard" / "ranks"))
    shutil.rmtree(gen)
    marker = json.loads((root / ".reshard" / "commit.json").read_text())
    (root / ".reshard" / "commit.json").write_text(json.dumps(
        {"format_version": 1, "time": marker["time"], "save_id": None, "tensors": 1, "ranks": marker["ranks"]}))


@pytest.mark.directory_form
def test_format_version_1_opens_and_is_replaced_by_a_generation(tmp_path):
    url = str(tmp_path / "ck")
    _save_old(url)
    _as_version_1(url)
    ckpt = rs.open(url)
    assert ckpt.zarr_url == ckpt.url
    np.testing.assert_array_equal(ckpt["m"].read(), OLD)
    w = rs.create(url, L, overwrite=True)  # version 1 had no save_id: the default one is new here
    for r, piece in _pieces(3.0).items():
        w.write(r, piece)
    w.commit()
    assert float(rs.open(url)["m"].read().max()) == 3.0
    assert gc(url, min_age=0).legacy
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".reshard", "gen-0"]
    assert float(rs.open(url)["m"].read().max()) == 3.0


def test_cli_gc_and_unlock(tmp_path, capsys):
    from reshard.store.cli.app import main

    url = str(tmp_path / "ck")
    _save_old(url)
    rs.save({"m": OLD + 1}, url, L, overwrite=True)
    assert main(["gc", url, "--dry-run"]) == 0
    assert "kept gen-" in capsys.readouterr().out  # the replaced save is younger than an hour
    assert main(["gc", url, "--min-age", "0", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["removed"]) == 1
    np.testing.assert_array_equal(rs.open(url)["m"].read(), OLD + 1)

    _written(str(tmp_path / "locked"), 5)
    _foreign_lock(str(tmp_path / "locked"), 5, age=1)
    assert main(["unlock", str(tmp_path / "locked"), "--save-id", "5"]) == 0
    assert "removed the commit lock of save '5'" in capsys.readouterr().out
    rs.commit(str(tmp_path / "locked"), save_id=5)


# ------------------------------------------------------------ issue 23: gc against saves in progress
FORMS = ["packed", "directory"]


def _storage(where: str, tmp_path: pathlib.Path, request: pytest.FixtureRequest) -> tuple[str, dict]:
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        return f"s3://{server.make_bucket()}/ck", server.storage_options()
    return str(tmp_path / "ck"), {}


@pytest.mark.parametrize("where", ["file", "s3"])
@pytest.mark.parametrize("form", FORMS)
def test_gc_never_deletes_a_save_in_progress_and_a_save_it_touched_never_commits(tmp_path, request, form, where):
    url, opts = _storage(where, tmp_path, request)
    rs.save({"m": OLD}, url, L, form=form, storage_options=opts)
    w = rs.create(url, L, overwrite=True, save_id="live", form=form, storage_options=opts)
    for r in (0, 1):  # a save in progress: two ranks wrote, two are still writing (no manifest of theirs yet)
        w.write(r, _pieces(1.0)[r])
    assert gc(url, storage_options=opts).removed == ()  # its lease is young: it stays
    for r in (2, 3):
        w.write(r, _pieces(1.0)[r])
    w.commit()
    np.testing.assert_array_equal(rs.open(url, storage_options=opts)["m"].read(), np.full((8, 2), 1.0, np.float32))

    w = rs.create(url, L, overwrite=True, save_id="slow", form=form, storage_options=opts)
    w.write(0, _pieces(2.0)[0])
    assert "gen-slow" in gc(url, min_age=0, storage_options=opts).removed  # told to take everything: it goes
    with pytest.raises(rs.CommitConflictError, match=r"save 'slow' was removed by `reshard gc`"):
        w.write(1, _pieces(2.0)[1])  # the next write of it is refused, and so is its commit
    with pytest.raises(rs.CommitConflictError, match=r"save 'slow' was removed by `reshard gc`"):
        rs.commit(url, save_id="slow", ranks=[0], storage_options=opts)
    # every rank wrote, then gc marked it (its deletion raced the commit): the commit is refused all the same
    w = rs.create(url, L, overwrite=True, save_id="raced", form=form, storage_options=opts)
    for r, piece in _pieces(3.0).items():
        w.write(r, piece)
    from reshard.store.commit.gc import mark_collected
    from reshard.store.io.storage import Storage

    assert mark_collected(Storage(url, opts), "gen-raced")
    with pytest.raises(rs.CommitConflictError, match=r"save 'raced' was removed by `reshard gc`"):
        w.commit()
    np.testing.assert_array_equal(rs.open(url, storage_options=opts)["m"].read(), np.full((8, 2), 1.0, np.float32))


@pytest.mark.parametrize("form", FORMS)
def test_gc_between_a_commits_lock_and_its_marker_lets_the_commit_win_or_refuses_it(tmp_path, form):
    url = str(tmp_path / "ck")
    w = rs.create(url, L, save_id="1", form=form)
    for r, piece in _pieces(1.0).items():
        w.write(r, piece)
    from reshard.store.io.storage import Storage

    gen = Storage(url).child("gen-1")
    live = {"token": "t", "time": time.time(), "host": socket.gethostname(), "pid": os.getpid(), "lease": 600.0}
    gen.write_new(".reshard/commit.lock", json.dumps(live).encode())  # a live committer holds the lock
    assert gc(url, min_age=0).removed == ()  # gc backs off: the commit in progress is not touched
    gen.delete(".reshard/commit.lock")
    w.commit()
    np.testing.assert_array_equal(rs.open(url)["m"].read(), np.full((8, 2), 1.0, np.float32))


@pytest.mark.parametrize("form", FORMS)
def test_a_snapshot_reader_never_reads_another_save_under_a_reused_save_id(tmp_path, form):
    url = str(tmp_path / "ck")
    w = rs.create(url, L, save_id="A", form=form)
    for r, piece in _pieces(1.0).items():
        w.write(r, piece)
    w.commit()
    snap = rs.open(url, check_current=False)
    graph = snap.to_dask("m") if hasattr(snap, "to_dask") else None
    w = rs.create(url, L, overwrite=True, save_id="B", form=form)
    for r, piece in _pieces(2.0).items():
        w.write(r, piece)
    w.commit()
    gc(url, min_age=0)  # A goes
    again = rs.create(url, L, overwrite=True, save_id="A", form=form)
    with pytest.raises(rs.CommitConflictError, match="save 'A' was removed by `reshard gc`"):
        again.write(0, _pieces(3.0)[0])  # A's name is never used again here
    with pytest.raises(rs.ReshardError):  # gone, said clearly: never save B's or a third save's data
        snap["m"].read()
    if graph is not None:
        with pytest.raises(Exception) as caught:
            graph.compute(scheduler="synchronous")
        assert not isinstance(caught.value, AssertionError)


def test_gc_never_follows_a_link_out_of_the_checkpoint(tmp_path):
    url = str(tmp_path / "ck")
    rs.save({"m": OLD}, url, L, form="packed", save_id="a")
    w = rs.create(url, L, overwrite=True, save_id="b", base=url)  # references gen-a's data objects
    for r in range(4):
        w.write(r, {"m": OLD[2 * r: 2 * r + 2]})
    w.commit()
    victim = tmp_path / "thesis"
    shutil.move(str(tmp_path / "ck/gen-a/packed"), str(victim))
    for name in ("thesis.tex", "notes.md"):
        (victim / name).write_text("years of work")
    os.symlink(victim, tmp_path / "ck/gen-a/packed")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere/main.py").write_text("print()")
    os.symlink(tmp_path / "elsewhere", tmp_path / "ck/gen-a/src")
    rs.gc(url, min_age=0)
    assert (victim / "thesis.tex").read_text() == "years of work" and (victim / "notes.md").exists()
    assert (tmp_path / "elsewhere/main.py").exists()
    assert not (tmp_path / "ck/gen-a/src").exists()  # the link itself goes, never what it points to


def test_gc_of_a_missing_path_is_an_error(tmp_path, capsys):
    from reshard.store.cli.app import main

    with pytest.raises(rs.CheckpointNotFoundError, match="no checkpoint here"):
        rs.gc(str(tmp_path / "typo"))
    assert main(["gc", str(tmp_path / "typo")]) != 0
    assert "no checkpoint here" in capsys.readouterr().err
    done = subprocess.run([sys.executable, "-m", "reshard.store.cli", "gc", str(tmp_path / "typo")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "no checkpoint here" in done.stderr


def test_leases_renewed_at_once_by_many_writers_stay_whole(tmp_path):
    """Ranks in many processes write one generation's lease at once: it is always one whole JSON document."""
    import threading

    from reshard.store.commit.locks import LEASE_KEY, Lease
    from reshard.store.io.storage import Storage

    root = Storage(str(tmp_path / "ck"))
    start = threading.Barrier(8)

    def writer() -> None:
        start.wait(timeout=30)
        for _ in range(200):
            Lease(root, "gen-1").renew()  # a new writer each time: its first renew writes the lease

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert set(json.loads(root.child("gen-1").read(LEASE_KEY))) == {"time", "host", "pid"}
    assert sorted(p.name for p in (tmp_path / "ck" / "gen-1" / ".reshard").iterdir()) == ["lease.json"]
