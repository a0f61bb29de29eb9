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
from reshard.store.commit import protocol
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
    w = rs.create(url, L, save_id=3)
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
    root = pathlib.Path(rs.open(url).zarr_url) / "zarr.json"
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
        from reshard.store.commit import protocol
        from reshard.store.io.storage import Storage
        root = Storage({url!r})
        protocol.take_lock(root, root.child(protocol.generation_of(1)), "1")
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
    lock = pathlib.Path(url, protocol.generation_of(save_id), ".reshard", "commit.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(json.dumps({"token": "t", "time": time.time() - age, "host": socket.gethostname() + "-other",
                                "pid": 1, "lease": 600}))


def test_another_hosts_lock_is_broken_after_its_lease_or_by_unlock(tmp_path):
    url = str(tmp_path / "ck")
    _written(url, 1)
    _foreign_lock(url, 1, age=10)
    with pytest.raises(rs.CommitConflictError, match=r"reshard unlock .* --save-id 1"):
        rs.commit(url, save_id=1)
    assert protocol.unlock(url, save_id=1)
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
        rs.open(url).zarr_url.rsplit("/", 1)[-1]]
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
