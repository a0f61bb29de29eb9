"""Issue 11, defects 2, 4, 8 and 9: refused names, forked writers, named errors, empty imports.

Each test here failed before its fix (the defect is quoted in its docstring).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from paths import zarr_root
from reshard.layouts import Layout
from reshard.store.cli import main


def _files(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


# ---------------------------------------------------------------- defect 2
@pytest.mark.parametrize("state", [
    {"a": np.zeros(3), "a.b": np.ones(2)},
    {"a": np.zeros(3), "a.c.0": np.ones(2)},
    {"x.a.c.0": np.ones(2), "x.a": np.zeros(3)},
])
def test_a_name_that_is_a_prefix_of_another_is_refused_before_writing(tmp_path, state):
    """Defect 2: ``save({"a": x, "a.b": y})`` committed, then only ``a.b`` was listed."""
    names = sorted(state)
    with pytest.raises(rs.BadNameError, match=rf"{names[0]!r} is a prefix of tensor {names[1]!r}") as e:
        rs.save(state, tmp_path / "ck")
    assert str(tmp_path / "ck") in str(e.value)
    assert _files(tmp_path / "ck") == []
    with pytest.raises(rs.BadNameError, match="prefix"):  # create refuses too, when the layouts name them
        rs.create(tmp_path / "ck2", {n: Layout.single(np.shape(v)) for n, v in state.items()})


def test_ranks_that_write_conflicting_names_cannot_commit(tmp_path):
    """Two ranks each write a name that alone is fine: the commit refuses the pair (no checkpoint)."""
    w0 = rs.create(tmp_path / "ck", lambda n, s: Layout.single(s, rank=0), shapes={"a": (2,)}, save_id=1)
    w0.write(0, {"a": np.zeros(2)})
    w1 = rs.create(tmp_path / "ck", lambda n, s: Layout.single(s, rank=1), shapes={"a.b": (2,)}, save_id=1)
    w1.write(1, {"a.b": np.ones(2)})
    with pytest.raises(rs.BadNameError, match=r"'a' is a prefix of tensor 'a\.b'"):
        rs.commit(tmp_path / "ck", save_id=1, ranks=[0, 1])
    assert not (tmp_path / "ck" / ".reshard" / "commit.json").exists()


# --------------------------------------------------------- defect 8: names
def test_names_over_the_file_system_limit_are_refused_before_writing(tmp_path):
    """Defect 8: a 300-byte name failed halfway through ``write`` with ENAMETOOLONG."""
    long = "layer." + "w" * 300
    with pytest.raises(rs.BadNameError, match=r"300 bytes, over the 255-byte limit") as e:
        rs.save({long: np.zeros(2), "ok": np.ones(2)}, tmp_path / "ck")
    assert str(tmp_path / "ck") in str(e.value) and "'layer.www" in str(e.value)
    assert _files(tmp_path / "ck") == []
    # escaping makes a name longer: 100 characters outside [A-Za-z0-9_-] are 300 bytes stored
    with pytest.raises(rs.BadNameError, match="300 bytes"):
        rs.save({"é" * 50: np.zeros(2)}, tmp_path / "ck")
    with pytest.raises(rs.BadNameError, match="save_id"):
        rs.create(tmp_path / "ck", {"w": Layout.single((2,))}, save_id="s" * 300)
    rs.save({"w" * 255: np.arange(3.0)}, tmp_path / "ok")  # the limit itself is fine
    np.testing.assert_array_equal(rs.open(tmp_path / "ok").read("w" * 255), np.arange(3.0))


# ------------------------------------------------------------- defect 4
def _child_save_and_read(url: str, queue: multiprocessing.Queue) -> None:
    state = {f"t{i}": np.full((64, 64), i, np.float32) for i in range(8)}
    rs.save(state, url, {n: Layout.from_dtensor((4,), ["S(0)"], (64, 64)) for n in state})
    ckpt = rs.open(url)
    queue.put(all(np.array_equal(ckpt.read(n), v) for n, v in state.items()))


def test_a_forked_writer_does_not_hang_after_the_parent_used_reshard(tmp_path):
    """Defect 4: forked children inherited the parent's I/O pools without their threads and hung."""
    state = {f"t{i}": np.full((64, 64), i, np.float32) for i in range(8)}
    layouts = {n: Layout.from_dtensor((4,), ["S(0)"], (64, 64)) for n in state}
    rs.save(state, tmp_path / "parent", layouts)  # the parent's pools now exist, with threads
    rs.open(tmp_path / "parent").read_all()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork of a threaded process
        children = [ctx.Process(target=_child_save_and_read, args=(str(tmp_path / f"child{i}"), queue))
                    for i in range(2)]
        for c in children:
            c.start()
    try:
        for c in children:
            c.join(timeout=60)
        assert all(c.exitcode == 0 for c in children), [c.exitcode for c in children]
        assert [queue.get(timeout=10) for _ in children] == [True, True]
    finally:
        for c in children:
            if c.is_alive():
                c.kill()
                c.join(timeout=10)


# ------------------------------------------------------- defect 8: errors
@pytest.mark.directory_form
def test_a_truncated_shard_names_the_file_and_tensor(tmp_path):
    """Defect 8: a truncated shard gave ``OSError [Errno 22] Invalid argument`` naming nothing."""
    big = np.arange(300_000, dtype=np.float32)  # over SMALL_SHARD_BYTES: its index is read by suffix
    rs.save({"big": big, "small": np.arange(10.0)}, tmp_path / "ck")
    gen = zarr_root(tmp_path / "ck")
    for name in ("big", "small"):
        shard = gen / name / "c" / "0"
        data = shard.read_bytes()
        for size in (10, len(data) // 2, len(data) - 1):
            shard.write_bytes(data[:size])
            with pytest.raises(rs.ReshardError) as e:
                rs.open(tmp_path / "ck").read(name)
            assert f"'{name}'" in str(e.value) and f"{name}/c/0" in str(e.value), str(e.value)
        shard.write_bytes(data)
    assert main(["verify", str(tmp_path / "ck")]) == 0


@pytest.mark.parametrize("junk", [b"", b"{", b"\xff\xfe\x00garbage", b"[1, 2]", b'{"format_version": "2"}',
                                  b'{"format_version": 2, "generation": 7}', b"null"])
def test_malformed_marker_is_a_format_error_naming_it(tmp_path, junk):
    """Defect 8: malformed ``commit.json`` gave a raw JSONDecodeError/UnicodeDecodeError/TypeError."""
    rs.save({"w": np.zeros(2)}, tmp_path / "ck")
    (tmp_path / "ck" / ".reshard" / "commit.json").write_bytes(junk)
    with pytest.raises(rs.FormatError, match=r"commit\.json"):
        rs.open(tmp_path / "ck")


@pytest.mark.parametrize("edit", [
    lambda d: d.update(rank="0"), lambda d: d.update(tensors=[]), lambda d: d.update(expected_ranks=None),
    lambda d: d["tensors"]["w"].update(dtype="float33"), lambda d: d["tensors"]["w"].update(chunk="2"),
    lambda d: d["tensors"]["w"].update(layout={"version": 1}), lambda d: d["tensors"]["w"].pop("layout"),
    lambda d: d["tensors"]["w"]["layout"].update(ranks={"range": [0]}), lambda d: d.update(leaves=3),
])
@pytest.mark.directory_form
def test_wrong_typed_manifests_are_format_errors(tmp_path, edit):
    """Defect 8: wrong-typed JSON gave raw TypeError/ValueError/AttributeError.

    The manifests' self-digest catches every edit; without it (as an older
    writer left them) the typed checks must.
    """
    w = rs.create(tmp_path / "ck", {"w": Layout.from_dtensor((2,), ["S(0)"], (4,))})
    for r in (0, 1):
        w.write(r, {"w": np.arange(2.0) + 2 * r})
    path = tmp_path / "ck" / "gen-0" / ".reshard" / "ranks" / "0.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(rs.FormatError, match=r"ranks/0.json.*sha256"):
        w.commit()
    del doc["sha256"]
    path.write_text(json.dumps(doc))
    with pytest.raises(rs.FormatError, match=r"ranks/0.json"):
        w.commit()
    assert not (tmp_path / "ck" / ".reshard" / "commit.json").exists()


# ------------------------------------------------------------- defect 9
def test_importers_refuse_missing_sources_and_empty_imports(tmp_path, monkeypatch):
    """Defect 9: an import that found nothing committed an empty checkpoint and exited 0."""
    from reshard.store.frontends import mindspore as ms
    from reshard.store.frontends.oneflow.npz import save_npz

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(rs.CheckpointNotFoundError, match="no tensors to import"):
        ms.import_mindspore(tmp_path / "empty", str(tmp_path / "ck"), None)
    with pytest.raises(rs.CheckpointNotFoundError, match="does not exist"):
        ms.import_mindspore("missing", str(tmp_path / "ck"), None)
    save_npz({"step": 3}, tmp_path / "leaves_only")  # an npz without arrays
    assert main(["import", "oneflow", "leaves_only", "ck", "--placement", "[0]", "--sbp", "B"]) == 1
    assert main(["import", "oneflow", "nowhere", "ck", "--placement", "[0]", "--sbp", "B"]) == 1
    assert main(["import", "mindspore", "empty", "ck", "--strategy", "none.json"]) == 1
    assert not (tmp_path / "ck").exists()


def test_dcp_import_refuses_missing_and_tensorless_checkpoints(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from reshard.store.frontends.torch.dcp import import_dcp

    monkeypatch.chdir(tmp_path)
    dcp.save({"step": 5, "name": "x"}, checkpoint_id=str(tmp_path / "leaves"))
    with pytest.raises(rs.CheckpointNotFoundError, match=r"DCP checkpoint holds no tensors \(found 2 other"):
        import_dcp("leaves", "ck")
    with pytest.raises(rs.CheckpointNotFoundError, match="no DCP checkpoint"):
        import_dcp("missing", "ck")
    assert main(["import", "dcp", "missing", "ck"]) == 1
    assert not (tmp_path / "ck").exists()
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(tmp_path / "ok"))
    assert main(["import", "dcp", "ok", "ck"]) == 0  # a relative path works
    np.testing.assert_array_equal(rs.open(os.path.join(tmp_path, "ck")).read("w"), np.arange(4.0))


# ------------------------------------------------------------ issue 23, items 10, 12, 13
def test_storage_confines_keys_to_the_root_and_its_siblings_data(tmp_path):
    """Item 10: ``../.ssh/id_rsa`` and, on ``http://HOST:PORT``, ``../HOST:OTHER/...`` left the checkpoint."""
    from reshard.store.io.storage import Storage

    local = Storage(str(tmp_path / "ck"))
    assert local.path("gen-1/packed/0.bin") == f"{tmp_path}/ck/gen-1/packed/0.bin"
    assert local.path("../step-1/gen-1/packed/0.bin") == f"{tmp_path}/step-1/gen-1/packed/0.bin"
    for key in ("/etc/passwd", "a/../../b", "../.ssh/id_rsa", "../../x", "a//b", "./a", "a/./b", "../"):
        with pytest.raises(rs.FormatError, match="outside"):
            local.path(key)
    top = Storage("http://127.0.0.1:1")  # a host's top: it has no sibling on that host
    with pytest.raises(rs.FormatError, match="outside"):
        top.path("../127.0.0.1:2/x/packed/0.bin")
    assert Storage("http://127.0.0.1:1/ck").path("../other/g/packed/0.bin") == "http://127.0.0.1:1/other/g/packed/0.bin"
    with pytest.raises(rs.FormatError, match="outside"):
        Storage("memory://bucket").path("../other-bucket/g/packed/0.bin")


def test_links_fifos_and_loops_are_refused_at_once(tmp_path):
    """Items 10, 12, 13: a link read /etc/passwd; a FIFO hung; a link loop was retried 6 times as transient."""
    from reshard.store.io.storage import Storage

    root = tmp_path / "ck"
    root.mkdir()
    (tmp_path / "secret").write_bytes(b"secret")
    (root / "out").symlink_to(tmp_path / "secret")
    (root / "zero").symlink_to("/dev/zero")
    (root / "loop").symlink_to("loop")
    (root / "dir").symlink_to(tmp_path)
    os.mkfifo(root / "fifo")
    (root / "ok").write_bytes(b"fine")
    storage = Storage(str(root))
    for key in ("out", "zero", "loop", "dir/secret"):
        with pytest.raises(rs.FormatError, match="symbolic link"):
            storage.read(key)
        with pytest.raises(rs.FormatError, match="symbolic link"):
            storage.read_into(key, 0, [memoryview(bytearray(4))])
    with pytest.raises(rs.FormatError, match="not a regular file"):
        storage.read("fifo")
    assert storage.stats.retries == 0
    assert storage.read("ok") == b"fine"
    (root / "big").write_bytes(b"x" * 100)
    with pytest.raises(rs.FormatError, match="100 bytes, over the 99-byte limit"):
        storage.read("big", limit=99)


def test_zstd_chunks_decode_within_their_size():
    """Item 12: a chunk of kilobytes inflated to 2 GiB before its size was checked."""
    from reshard.store.format.encode import decompress

    # a zstd frame of RLE blocks, no declared size: 4 bytes per 128 KiB of zeros (tests/reliability/test_hostile.py)
    bomb = b"\x28\xb5\x2f\xfd\x00\x38" + b"".join(
        (int(i == 511) | 2 | (128 << 13)).to_bytes(3, "little") + b"\x00" for i in range(512))
    assert len(bomb) < 4096
    with pytest.raises(ValueError):
        decompress(bomb, 1 << 20)
    import numcodecs.zstd

    declared = numcodecs.zstd.compress(bytes(1 << 20), 3)
    with pytest.raises(ValueError, match="declares 1048576 bytes"):
        decompress(declared, 1024)
    assert decompress(declared, 1 << 20).nbytes == 1 << 20


def test_a_failed_npz_export_leaves_no_unraisable_errors(tmp_path):
    """Item 13: ``reshard export`` to npz printed ``Exception ignored ... seek of closed file`` after a failure."""
    import subprocess
    import sys

    url = str(tmp_path / "ck")
    rs.save({"a": np.arange(100_000.0), "b": np.arange(100_000.0)}, url, form="directory")
    os.remove(next(p for p in _files(tmp_path / "ck") if p.parts[-3:] == ("b", "c", "0")))
    code = ("import sys; from reshard.store.cli import main; import gc; rc = main(['export', sys.argv[1], "
            "sys.argv[2], '--format', 'npz']); gc.collect(); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, url, str(tmp_path / "out.npz")], capture_output=True,
                          timeout=120)
    assert done.returncode == 1, done.stderr.decode()[-2000:]
    assert b"Exception ignored" not in done.stderr, done.stderr.decode()[-2000:]
    assert b"'b'" in done.stderr + done.stdout
    assert not (tmp_path / "out.npz").exists()


# ------------------------------------------------------------ issue 35: no import exits 0 having skipped state
def test_dcp_items_that_are_not_json_are_refused_unless_skipped(tmp_path, monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from reshard.store.frontends.torch.dcp import import_dcp

    monkeypatch.chdir(tmp_path)
    dcp.save({"w": torch.arange(4.0), "tags": {1, 2}}, checkpoint_id=str(tmp_path / "src"))
    with pytest.raises(rs.FormatError, match=r"src: item 'tags' \(in __0_0\.distcp\): it holds .*set is not JSON.*"
                       r"Nothing was written; pass skip=\['tags'\]"):
        import_dcp("src", "ck")
    assert main(["import", "dcp", "src", "ck"]) == 1 and not (tmp_path / "ck").exists()
    assert main(["import", "dcp", "src", "ck", "--skip", "tags"]) == 0
    capsys.readouterr()
    assert main(["inspect", "ck"]) == 0
    assert "skipped at import: tags: " in capsys.readouterr().out
    assert rs.open(str(tmp_path / "ck")).leaves["reshard.skipped"][0]["why"].startswith("it holds leaf 'tags'")


def test_a_metadata_pickle_the_unpickler_refuses_names_the_file(tmp_path):
    torch = pytest.importorskip("torch")
    import pickle

    import torch.distributed.checkpoint as dcp
    from reshard.store.frontends.megatron import import_megatron
    from reshard.store.frontends.torch.dcp import import_dcp

    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(tmp_path / "src"))
    (tmp_path / "src" / ".metadata").write_bytes(pickle.dumps([1] * 3, protocol=4)[:-3])  # truncated
    with pytest.raises(rs.FormatError, match=r"src/\.metadata: not a readable DCP \.metadata file \(UnpicklingError"):
        import_dcp(str(tmp_path / "src"), str(tmp_path / "x"))
    (tmp_path / "src" / ".metadata").write_bytes(b"cos\nsystem\n(S'true'\ntR.")  # refused, never run
    with pytest.raises(rs.FormatError, match=r"src/\.metadata: .*os\.system, which reshard does not load"):
        import_dcp(str(tmp_path / "src"), str(tmp_path / "x"))
    (tmp_path / "src" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    with pytest.raises(rs.FormatError, match=r"src/\.metadata: .*os\.system"):
        import_megatron(str(tmp_path / "src"), str(tmp_path / "x"))


def test_a_pickled_npz_array_names_the_file(tmp_path):
    """An object array in a OneFlow npz folder: numpy refuses to unpickle it; the error names the file and array."""
    (tmp_path / "rank0").mkdir()
    np.savez(tmp_path / "rank0" / "tensors.npz", w=np.ones(2), obj=np.array([{"a": 1}], dtype=object))
    from reshard.store.frontends.oneflow import load_npz

    assert main(["import", "oneflow", str(tmp_path / "rank0"), str(tmp_path / "ck")]) == 1

    for headers_only in (True, False):
        with pytest.raises(rs.FormatError, match=r"rank0/tensors\.npz: array 'obj': .*(pickle|Object arrays)"):
            load_npz(tmp_path / "rank0", headers_only=headers_only)
    assert not (tmp_path / "ck").exists()
