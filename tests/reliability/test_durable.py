"""Power-loss safety of local saves: what a manifest or commit marker announces is fsynced before it is.

A power cut cannot be staged in a test, so the real system calls are watched
(each still runs): every ``open``, ``rename`` and ``fsync`` of the save, in
order. At the moment the commit marker's name is created, every other file of
the checkpoint must have been fsynced after it was written, and every folder
on its path fsynced after the file's name appeared in it; the marker (written
beside and renamed) is fsynced before its rename, its folder after. ``durable=False`` makes no fsync at all.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout

SHAPE = (16, 6)
L = {"w": Layout.from_dtensor((4,), ["S(0)"], SHAPE), "b": Layout.from_dtensor((4,), ["R"], (6,))}


class Calls:
    """The file-system calls of the save, in order: ``(what, path)``: create, fsync, or rename (of its target)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str]] = []
        lock = threading.Lock()
        real_open, real_fsync, real_replace = os.open, os.fsync, os.replace

        def note(what: str, path: str) -> None:
            with lock:
                self.events.append((what, os.path.realpath(path)))

        def open_(path, flags, *args, **kw):
            fd = real_open(path, flags, *args, **kw)
            if flags & os.O_CREAT:
                note("create", path)
            return fd

        def fsync(fd):
            real_fsync(fd)
            note("fsync", os.readlink(f"/proc/self/fd/{fd}"))

        def replace(src, dst, *args, **kw):
            real_replace(src, dst, *args, **kw)
            note("rename", dst)

        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def last(self, what: str, path: Path, before: int) -> int:
        """Index of the last ``what`` event of ``path`` before event ``before`` (-1 if none)."""
        path_s = os.path.realpath(path)
        return max((i for i, e in enumerate(self.events[:before]) if e == (what, path_s)), default=-1)


def save(url: Path, **options) -> None:
    writer = rs.create(str(url), L, **options)
    full = np.arange(96, dtype=np.float32).reshape(SHAPE)
    for r in range(4):
        writer.write(r, {"w": full[4 * r : 4 * r + 4], "b": np.ones(6, np.float32)})
    writer.commit()


def assert_durable_before_marker(calls: Calls, root: Path, base: Path) -> None:
    """Every file under ``root`` and every folder up to ``base`` was fsynced before the marker's rename."""
    marker = root / ".reshard" / "commit.json"
    at = calls.last("rename", marker, len(calls.events))  # written beside and renamed: the commit
    assert at >= 0 and calls.last("fsync", marker.parent, len(calls.events)) > at
    files = [p for p in root.rglob("*") if p.is_file() and p != marker and p.suffix != ".lock"]
    assert len(files) >= 4 + 2  # a data object or shard per rank at least, the metadata
    for f in files:
        made = max(calls.last("create", f, at), calls.last("rename", f, at))
        assert made >= 0, f
        if calls.last("rename", f, at) == made:  # written beside, fsynced under its temporary name, renamed
            assert any(w == "fsync" and p.startswith(os.path.realpath(f)) for w, p in calls.events[:made]), f
        else:
            assert calls.last("fsync", f, at) > made, f"{f} not fsynced after it was written"
        for folder in [f.parent, *f.parent.parents]:
            if folder == base:
                break
            assert calls.last("fsync", folder, at) > made, f"{folder} not fsynced after {f.name} appeared in it"
    assert any(w == "fsync" and p.startswith(os.path.realpath(marker)) for w, p in calls.events[:at])


@pytest.mark.parametrize("form", ["packed", "directory"])
def test_everything_the_marker_announces_is_fsynced_before_it(tmp_path, monkeypatch, form):
    calls = Calls(monkeypatch)
    save(tmp_path / "ck", form=form)
    monkeypatch.undo()
    assert_durable_before_marker(calls, tmp_path / "ck", tmp_path)


@pytest.mark.parametrize("form", ["packed", "directory"])
def test_a_redivided_copy_is_durable_before_its_marker(tmp_path, monkeypatch, form):
    save(tmp_path / "src")
    calls = Calls(monkeypatch)
    target = {"w": Layout.from_dtensor((3,), ["S(0)"], SHAPE), "b": Layout.single((6,))}
    rs.redivide(str(tmp_path / "src"), str(tmp_path / "dst"), target, form=form)
    monkeypatch.undo()
    assert_durable_before_marker(calls, tmp_path / "dst", tmp_path)


def test_durable_false_leaves_flushing_to_the_os(tmp_path, monkeypatch):
    calls = Calls(monkeypatch)
    save(tmp_path / "ck", durable=False)
    monkeypatch.undo()
    assert not [e for e in calls.events if e[0] == "fsync"]
    got = rs.open(str(tmp_path / "ck"))["w"].read()
    np.testing.assert_array_equal(got, np.arange(96, dtype=np.float32).reshape(SHAPE))


def test_the_manager_index_is_published_after_the_marker_it_confirms(tmp_path, monkeypatch):
    calls = Calls(monkeypatch)
    with rs.CheckpointManager(str(tmp_path / "run"), L, rank=0) as mgr:
        full = np.arange(96, dtype=np.float32).reshape(SHAPE)
        for r in range(4):
            mgr.save(1, r, {"w": full[4 * r : 4 * r + 4], "b": np.ones(6, np.float32)})
    monkeypatch.undo()
    index = os.path.realpath(tmp_path / "run" / "manager.json")
    marker = tmp_path / "run" / "step-1" / ".reshard" / "commit.json"
    renames = [i for i, e in enumerate(calls.events) if e == ("rename", index)]
    made = calls.last("rename", marker, len(calls.events))
    assert len(renames) >= 2 and renames[0] < made < renames[-1]  # flagged, marker, confirmed
    assert calls.last("fsync", marker.parent, renames[-1]) > made  # the marker is durable before the confirmation
    assert calls.last("fsync", tmp_path / "run", len(calls.events)) > renames[-1]


def test_a_file_system_that_cannot_sync_folders_still_saves(tmp_path, monkeypatch):
    """Some network and FUSE mounts answer fsync of a folder with EINVAL: the save goes on; files still raise."""
    import errno

    real = os.fsync

    def fsync(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save(tmp_path / "ck")
    got = rs.open(str(tmp_path / "ck"))["w"].read()
    np.testing.assert_array_equal(got, np.arange(96, dtype=np.float32).reshape(SHAPE))

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(rs.StorageError, match=r"other/gen-0/.*Input/output error"):
        save(tmp_path / "other")
    assert rs.open(str(tmp_path / "ck"))["w"].read().shape == SHAPE  # what was saved before is untouched
