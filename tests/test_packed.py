"""The packed storage form: per-rank data objects + kerchunk references (issue 12 item 1).

Plain zarr-python and dask read it through fsspec's ``reference://`` filesystem
with no reshard code; the folder can be copied and moved; reshard reads it with
few requests (range reads merged by the cost model).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import pathlib
import shutil

import fsspec
import numpy as np
import pytest
import reshard.store as rs
import zarr
from reshard.layouts import Layout
from reshard.layouts.errors import FormatError
from reshard.store.format import refs as references
from reshard.store.read.open import is_warm_up

RNG = np.random.default_rng(12)


def state_and_layouts(ranks: int = 4) -> tuple[dict[str, np.ndarray], dict[str, Layout]]:
    rng = np.random.default_rng(12)  # the same in every process
    full = {
        "model.w": rng.standard_normal((64, 24)).astype(np.float32),
        "model.b": rng.standard_normal((24,)).astype(np.float32),
        "opt.step": np.array(7, dtype=np.int64),
        "emb": rng.standard_normal((10, 6)).astype(np.float16),
    }
    layouts = {
        "model.w": Layout.from_dtensor((ranks,), ["S(0)"], (64, 24)),
        "model.b": Layout.from_dtensor((ranks,), ["R"], (24,)),
        "opt.step": Layout.single(()),
        "emb": Layout.from_oneflow(list(range(ranks)), "S(0)", (10, 6)),
    }
    return full, layouts


def write_ranks(url: str, full: dict[str, np.ndarray], layouts: dict[str, Layout], ranks: list[int],
                **options: object) -> rs.CheckpointWriter:
    writer = rs.create(url, layouts, form="packed", **options)
    for rank in ranks:
        writer.write(rank, {n: a[layouts[n].region(rank)] for n, a in full.items() if rank in layouts[n].ranks})
    return writer


def plain_zarr_group(url: str, storage_options: dict | None = None) -> zarr.Group:
    """The documented recipe, with no reshard code: marker -> references -> zarr."""
    with fsspec.open(f"{url}/.reshard/commit.json", "rb", **(storage_options or {})) as f:
        gen = json.load(f)["generation"]
    store = zarr.storage.FsspecStore.from_url(
        "reference://", read_only=True,
        storage_options={"fo": f"{url}/{gen}/refs.json", "template_overrides": {"root": url},
                         "remote_options": {**(storage_options or {}), "asynchronous": True},
                         "target_options": storage_options or {}})
    return zarr.open_group(store, mode="r")


def test_one_data_object_per_rank_and_references(tmp_path):
    full, layouts = state_and_layouts()
    url = str(tmp_path / "ck")
    write_ranks(url, full, layouts, [0, 1, 2, 3]).commit()
    ckpt = rs.open(url)
    assert ckpt.form == "packed"
    gen = pathlib.Path(ckpt.storage.url)
    objects = sorted(p.relative_to(gen).as_posix() for p in gen.rglob("*") if p.is_file())
    # one object per rank (its manifest rides at its end), the references; reshard's own objects (the root
    # document, the lock) under .reshard/, and no zarr.json: plain zarr would open the folder as a hierarchy
    # without chunks and read fill values (issue 23)
    assert [o for o in objects if not o.startswith(".reshard/")] == [*[f"packed/{r}.bin" for r in range(4)],
                                                                      "refs.json"]
    assert ".reshard/metadata.json" in objects and "zarr.json" not in objects
    doc = json.loads((gen / "refs.json").read_bytes())
    assert (gen / ".reshard" / "metadata.json").read_bytes() == doc["refs"]["zarr.json"].encode()
    assert doc["version"] == 1 and doc["templates"] == {"root": "."}
    assert json.loads(doc["refs"]["zarr.json"])["consolidated_metadata"]["metadata"]
    assert doc["refs"]["model/w/c/2/0"][0] == f"{{{{root}}}}/{gen.name}/packed/2.bin"
    marker = json.loads((tmp_path / "ck" / ".reshard" / "commit.json").read_bytes())
    assert marker["form"] == "packed" and len(marker["references_sha256"]) == 64 and marker["locations"] == "ranks"
    for name, arr in full.items():
        np.testing.assert_array_equal(ckpt[name].read(), arr)


def test_a_load_reads_the_manifests_of_the_ranks_it_touches_not_the_references(tmp_path):
    """Shard locations come from the writing ranks' manifests: loading one target rank reads the marker, the root
    document and the source objects it needs (their trailers, then data), never refs.json."""
    full = {"w": np.arange(64 * 6, dtype=np.float32).reshape(64, 6), "b": np.arange(64, dtype=np.int32)}
    layouts = {n: Layout(a.shape, (8,), dims=((0,),) + ((),) * (a.ndim - 1)) for n, a in full.items()}
    url = str(tmp_path / "ck")
    write_ranks(url, full, layouts, range(8)).commit()
    gen = pathlib.Path(rs.open(url).storage.url)
    (gen / "refs.json").rename(tmp_path / "refs.json")  # reshard's reader must not need it
    ckpt = rs.open(url)
    target = {n: Layout(a.shape, (4,), dims=((0,),) + ((),) * (a.ndim - 1)) for n, a in full.items()}
    got = ckpt.load(target, 1)
    for name, arr in full.items():
        np.testing.assert_array_equal(got[name], arr[16:32])
    stats = ckpt.stats
    # marker, root zarr.json, then source ranks 2 and 3: a trailer read each (their data comes with it: small)
    assert stats.requests <= 2 + 2 * 2, stats
    (gen / "packed" / "2.bin").write_bytes(b"not a data object")
    with pytest.raises(FormatError, match=r"2\.bin"):
        rs.open(url).load(target, 1)
    report = rs.verify(url)
    assert not report.ok and {d.kind for d in report.damage} >= {"references"}


def test_objects_split_at_object_bytes(tmp_path):
    full, layouts = state_and_layouts(ranks=2)
    url = str(tmp_path / "ck")
    write_ranks(url, full, layouts, [0, 1], object_bytes=100).commit()
    ckpt = rs.open(url)
    parts = sorted(p.name for p in (pathlib.Path(ckpt.storage.url) / "packed").iterdir())
    assert len(parts) > 2 and {"0.bin", "0-1.bin", "1.bin"} <= set(parts)
    for name, arr in full.items():
        np.testing.assert_array_equal(ckpt[name].read(), arr)


def test_rank_object_groups_alike_shards(tmp_path):
    """Shards of one geometry lie side by side in a rank's object, whatever the names' order: a target rank
    of another layout needs the same part of each, so its ranges are few and long."""
    names = [f"layer{i}.{kind}" for i in range(4) for kind in ("wide", "tall")]  # alternating by name
    layouts = {n: Layout.from_dtensor((4,), ["S(0)"], (8, 16) if n.endswith("wide") else (32, 4)) for n in names}
    full = {n: np.arange(128, dtype=np.float32).reshape(layouts[n].shape) for n in names}
    url = str(tmp_path / "ck")
    write_ranks(url, full, layouts, [0, 1, 2, 3]).commit()
    ckpt = rs.open(url)
    refs = json.loads((pathlib.Path(ckpt.storage.url) / "refs.json").read_bytes())["refs"]
    for rank in range(4):
        at = sorted((refs[f"{n.replace('.', '/')}/c/{rank}/0"][1], n.split(".")[1]) for n in names)
        kinds = [kind for _, kind in at]
        assert kinds == sorted(kinds, key=kinds[0].__ne__)  # one run of each kind
    target = {n: Layout.from_dtensor((3,), ["S(0)"], layouts[n].shape) for n in names}
    got = ckpt.load(target, 1)
    for n in names:
        np.testing.assert_array_equal(got[n.split(".")[0]][n.split(".")[1]], full[n][target[n].region(1)])


def test_plain_zarr_and_dask_read_packed_after_the_folder_moved(tmp_path):
    da = pytest.importorskip("dask.array")
    full, layouts = state_and_layouts()
    # grid="regular": zarr-python 3.1 cannot read the rectilinear grid of the balanced "emb" (3.2+ can)
    write_ranks(str(tmp_path / "ck"), full, layouts, [0, 1, 2, 3], grid="regular").commit()
    shutil.copytree(tmp_path / "ck", tmp_path / "copy")
    shutil.move(tmp_path / "ck", tmp_path / "moved")  # the original place is gone
    for where in ("copy", "moved"):
        url = str(tmp_path / where)
        group = plain_zarr_group(url)
        for name, arr in full.items():
            np.testing.assert_array_equal(group[name.replace(".", "/")][...], arr)
        assert float(da.from_zarr(group["model/w"]).sum().compute()) == pytest.approx(float(full["model.w"].sum()),
                                                                                     rel=1e-5)
        ckpt = rs.open(url)
        np.testing.assert_array_equal(ckpt["emb"].read(), full["emb"])
        zarr_engine = rs.open(url, engine="zarr")
        np.testing.assert_array_equal(zarr_engine["model.w"].read(), full["model.w"])


@pytest.mark.parametrize("writer", ["ranks", "block writer"])
def test_saves_with_the_old_root_zarr_json_still_open(tmp_path, writer):
    """Packed saves before 2026-11-27 kept the root document's own copy as the generation's ``zarr.json`` (which
    plain zarr opened as a hierarchy without chunks: issue 23). reshard reads them, verifies them, and refuses
    their ``zarr_url`` like any packed save's; ``zarr_store()`` reads them."""
    full, layouts = state_and_layouts()
    url = str(tmp_path / "ck")
    if writer == "ranks":
        write_ranks(url, full, layouts, [0, 1, 2, 3], grid="regular").commit()
    else:
        rs.save(full, str(tmp_path / "dir"), layouts, form="directory", grid="regular")
        rs.convert(str(tmp_path / "dir"), url, "packed")
    marker = json.loads((tmp_path / "ck" / ".reshard" / "commit.json").read_bytes())
    assert marker["locations"] == ("ranks" if writer == "ranks" else "references")
    gen = tmp_path / "ck" / marker["generation"]
    (gen / ".reshard" / "metadata.json").rename(gen / "zarr.json")  # where the old commit wrote it
    ckpt = rs.open(url)
    for name, arr in full.items():
        np.testing.assert_array_equal(ckpt[name].read(), arr)
        np.testing.assert_array_equal(rs.open(url, engine="zarr")[name].read(), arr)
    assert rs.verify(url).ok
    with pytest.raises(rs.FormatError, match=r"zarr_store\(\)"):
        ckpt.zarr_url  # noqa: B018
    group = zarr.open_group(ckpt.zarr_store(), mode="r")
    np.testing.assert_array_equal(group["model/w"][...], full["model.w"])
    (gen / "zarr.json").unlink()  # gone from both places: named, not a raw error
    with pytest.raises(rs.FormatError, match=r"metadata\.json is missing"):
        rs.open(url)


def test_load_merges_ranges_across_tensors(tmp_path):
    """One target rank of 3 from 4 source ranks of 40 tensors: its manifest and one data request per source object."""
    layouts = {f"t{i}": Layout.from_dtensor((4,), ["S(0)"], (64, 512)) for i in range(40)}
    full = {n: RNG.standard_normal((64, 512)).astype(np.float32) for n in layouts}
    url = str(tmp_path / "ck")
    write_ranks(url, full, layouts, [0, 1, 2, 3]).commit()
    ckpt = rs.open(url)
    target = {n: Layout.from_dtensor((3,), ["S(0)"], (64, 512)) for n in layouts}
    got = ckpt.load(target, 1)
    for name in layouts:
        np.testing.assert_array_equal(got[name], full[name][target[name].region(1)])
    needed = sum(a.nbytes for a in got.values())
    stats = ckpt.last_stats
    assert stats.requests <= 2 + 2  # rows 21..43 lie in source ranks 1 and 2: a manifest and a data request each
    assert stats.bytes_fetched <= 2 * needed
    # shards lie back to back: merged even with no gap allowed; a negative gap merges nothing
    assert rs.open(url, gap=0).load(target, 1) and True
    tight = rs.open(url, gap=-1)
    tight.load(target, 1)
    assert tight.last_stats.requests >= 40


def test_corrupted_references_and_data_are_refused(tmp_path):
    full, layouts = state_and_layouts()
    url = str(tmp_path / "ck")
    write_ranks(url, full, layouts, [0, 1, 2, 3]).commit()
    gen = pathlib.Path(rs.open(url).storage.url)
    data = gen / "packed" / "1.bin"
    raw = bytearray(data.read_bytes())
    raw[3] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(rs.ChecksumError):
        rs.open(url).read_all()
    data.write_bytes(bytes(raw[:3]) + bytes([raw[3] ^ 0xFF]) + bytes(raw[4:]))  # mended
    refs = gen / "refs.json"
    refs.write_bytes(refs.read_bytes().replace(b'"version":1', b'"version":1 '))
    # reshard's reader locates shards through the ranks' manifests: it reads on, exactly; verify names the file
    for name, arr in full.items():
        np.testing.assert_array_equal(rs.open(url)[name].read(), arr)
    report = rs.verify(url)
    assert [(d.kind, d.where) for d in report.damage] == [("references", str(refs))]


def test_missing_rank_is_named_and_uncommitted_opens_from_manifests(tmp_path):
    full, layouts = state_and_layouts()
    url = str(tmp_path / "ck")
    writer = write_ranks(url, full, layouts, [0, 1, 3])
    with pytest.raises(rs.UncommittedCheckpointError, match=r"ranks \[2\]"):
        writer.commit()
    ckpt = rs.open(url, allow_uncommitted=True)
    assert ckpt.form == "packed"
    np.testing.assert_array_equal(ckpt["model.w"][0:16].read(), full["model.w"][:16])


def test_references_refuse_paths_outside_the_checkpoint():
    # a data object of a folder beside the checkpoint (an incremental save's base) is allowed, nothing further
    # out; every reference is checked when the file is parsed, before any reader requests anything (issue 23)
    raw = references.build({"zarr.json": b"{}"}, {"a/c/0": ("../../elsewhere/x.bin", 0, 4),
                                                  "b/c/0": ("../step-1/gen-1/packed/0-0.bin", 0, 4)})
    with pytest.raises(rs.FormatError, match="outside"):
        references.parse("refs.json", raw)
    raw = references.build({"zarr.json": b"{}"}, {"b/c/0": ("../step-1/gen-1/packed/0-0.bin", 0, 4)})
    parsed = references.parse("refs.json", raw)
    assert parsed.locate("b/c/0", "b") == ("../step-1/gen-1/packed/0-0.bin", 0, 4)
    for url in ("/etc/passwd", "{{root}}/../x.bin", "{{parent}}/./x.bin", "s3://other/x.bin",
                "{{parent}}/.ssh/id_rsa", "{{parent}}/notes/thesis.tex", "http://127.0.0.1:1/x"):
        with pytest.raises(rs.FormatError, match="outside"):
            references.parse("refs.json", json.dumps({"version": 1, "refs": {
                "zarr.json": "{}", "a/c/0": [url, 0, 4]}}).encode())
    with pytest.raises(rs.FormatError, match="no reference"):
        parsed.locate("a/c/1", "a")


def _write_rank(url: str, rank: int, opts: dict) -> None:
    full, layouts = state_and_layouts()
    # grid="regular": the test reads it with plain zarr-python 3.1 too, which has no rectilinear grid
    writer = rs.create(url, layouts, form="packed", storage_options=opts, grid="regular")
    writer.write(rank, {n: a[layouts[n].region(rank)] for n, a in full.items() if rank in layouts[n].ranks})


def test_packed_on_s3_rank_processes_plain_zarr_and_gets(s3_proxy, s3_bucket):
    opts = s3_proxy.storage_options()
    url = f"s3://{s3_bucket}/packed"
    s3_proxy.reset_counters()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_write_rank, args=(url, r, opts)) for r in (0, 1)]
    for p in procs:
        p.start()
    for r in (2, 3):
        _write_rank(url, r, opts)
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    puts = s3_proxy.records(method="PUT")
    # per rank: its data object (shards and manifest in one) and its writer's lease (gc leaves live saves alone)
    assert len(puts) == 8 and sum(r.path.endswith(".reshard/lease.json") for r in puts) == 4
    s3_proxy.reset_counters()
    rs.commit(url, storage_options=opts, form="packed")
    puts = s3_proxy.records(method="PUT")
    # the lock, the references, the root document and its copy at the root (read with the marker), the marker,
    # the lock marked done
    assert len(puts) <= 6
    full, _ = state_and_layouts()
    s3_proxy.reset_counters()
    ckpt = rs.open(url, storage_options=opts)
    target = {"model.w": Layout.from_dtensor((4,), ["S(0)"], (64, 24))}
    got = ckpt.load(target, 2)["model"]["w"]
    np.testing.assert_array_equal(got, full["model.w"][32:48])
    # marker + references, one range of the one source object touched, the after-read marker check; besides them
    # the first open's 1-byte reads of the marker that open the connections the load then uses (not data)
    gets = s3_proxy.records(method="GET")
    warm = [r for r in gets if is_warm_up(r.path, r.range)]
    assert len(warm) <= 8 and len(gets) - len(warm) <= 2 + 2 * 1
    group = plain_zarr_group(url, opts)
    np.testing.assert_array_equal(group["emb"][...], full["emb"])
    same = zarr.open_group(ckpt.zarr_store(), mode="r")  # the recipe, from the checkpoint
    np.testing.assert_array_equal(same["model/w"][...], full["model.w"])


# ------------------------------------------------------------------ convert
def test_convert_both_ways_and_tensorstore_reads_the_directory_form(tmp_path):
    full, layouts = state_and_layouts()
    src = str(tmp_path / "packed")
    write_ranks(src, full, layouts, [0, 1, 2, 3], compression="zstd").commit()
    rs.convert(src, str(tmp_path / "dir"), "directory")
    directory = rs.open(str(tmp_path / "dir"))
    assert directory.form == "directory" and directory.references_url is None
    assert directory.arrays["model.w"].compressor == "zstd"  # kept
    with pytest.raises(rs.FormatError, match="directory form only"):
        rs.open(src, engine="tensorstore").read_all()
    pytest.importorskip("tensorstore")
    via_ts = rs.open(str(tmp_path / "dir"), engine="tensorstore")
    rs.convert(directory, str(tmp_path / "back"), "packed")
    back = rs.open(str(tmp_path / "back"))
    assert back.form == "packed"
    for name, arr in full.items():
        np.testing.assert_array_equal(via_ts[name].read(), arr)
        np.testing.assert_array_equal(back[name].read(), arr)
        assert back[name].layout == layouts[name]


def test_convert_in_place_and_the_cli(tmp_path, capsys):
    from reshard.store.cli.app import main

    full, layouts = state_and_layouts()
    url = str(tmp_path / "ck")
    rs.save(full, url, layouts, form="directory")
    with pytest.raises(rs.CheckpointExistsError):
        rs.convert(url, url, "packed")
    assert main(["convert", url, url, "--form", "packed", "--overwrite"]) == 0
    assert "(directory) ->" in capsys.readouterr().out
    ckpt = rs.open(url)
    assert ckpt.form == "packed"
    for name, arr in full.items():
        np.testing.assert_array_equal(ckpt[name].read(), arr)
    rs.gc(url, min_age=0)  # the directory-form save goes; the packed one stays whole
    assert len([p for p in pathlib.Path(url).iterdir() if p.name.startswith("gen-")]) == 1
    assert main(["inspect", url]) == 0
    assert "refs.json" in capsys.readouterr().out


def test_records_json_is_the_json_of_the_records(tmp_path):
    """The trailer's records are spliced from each layout's cached text: the same bytes as one json.dumps."""
    from reshard.store.format.manifests import rank_manifest, records_json

    full, layouts = state_and_layouts()
    writer = rs.create(str(tmp_path / "ck"), layouts)
    plans = {n: writer.plan(n, lay, str(full[n].dtype)) for n, lay in layouts.items()}
    records = rank_manifest(0, writer.save_id, {n: p.meta for n, p in plans.items()}, {})["tensors"]
    text = records_json(plans[n].text for n in records)
    assert text == json.dumps(records, separators=(",", ":")).encode()
    assert json.loads(text) == records


def test_writer_plans_are_shared_and_keyed_by_everything_they_depend_on(tmp_path):
    """A later writer with the same layouts reuses the plans; another dtype, chunk size or origin gets its own."""
    full, layouts = state_and_layouts()
    name, lay = next(iter(layouts.items()))
    dtype = str(full[name].dtype)
    one = rs.create(str(tmp_path / "a"), layouts)
    two = rs.create(str(tmp_path / "b"), layouts, save_id="other")
    assert one.plan(name, lay, dtype) is two.plan(name, lay, dtype)
    assert one.plan(name, lay, dtype).at(lay.ranks[0]) is two.plan(name, lay, dtype).at(lay.ranks[0])
    small = rs.create(str(tmp_path / "c"), layouts, chunk_bytes=4096)
    assert small.plan(name, lay, dtype) is not one.plan(name, lay, dtype)
    assert one.plan(name, lay, "float64").meta.dtype == "float64"
    tagged = Layout(lay.shape, lay.mesh, lay.ranks, lay.dims, lay.split, lay.nested, origin={"framework": "test"})
    assert tagged == lay  # origin is not compared, but it is stored: the plan must carry the right one
    assert one.plan(name, tagged, dtype).meta.origin == {"framework": "test"}
    assert one.plan(name, lay, dtype).meta.origin == lay.origin


def test_small_shards_are_read_straight_into_their_arrays_and_still_checked(tmp_path, monkeypatch):
    """Small one-chunk shards go straight into their arrays (one request for many), and the crc and the index
    are still checked: a flipped data byte, an index saying "missing" or another chunk size are refused."""
    import struct

    import reshard.store.read.fetch as fetch
    from reshard.store.format.encode import crc32c

    full = {f"p{i}": RNG.standard_normal((60 + i % 5, 256)).astype(np.float32) for i in range(30)}  # 2 MB
    url = str(tmp_path / "ck")
    rs.save(full, url)
    direct: list[int] = []
    execute_whole = fetch.execute_whole
    monkeypatch.setattr(fetch, "execute_whole", lambda s, obj, reads: direct.append(len(reads)) or
                        execute_whole(s, obj, reads))
    ckpt = rs.open(url)
    got = ckpt.read_all()
    for name, arr in full.items():
        np.testing.assert_array_equal(got[name], arr)
    assert ckpt.last_stats.requests <= 3  # the manifest, then one request for the 30 shards
    assert len(direct) == 1 and direct[0] >= 30 - 5  # one request; the last 256 KiB came with the manifest
    meta, part = ckpt.arrays["p1"], got["p1"][:30]
    assert fetch.whole_read(meta, (0, 0), (slice(0, 30), slice(0, 256)), part, "p1/c/0/0", 0, part.nbytes + 24) is None
    refs = json.loads((pathlib.Path(ckpt.storage.url) / "refs.json").read_bytes())["refs"]
    obj, off, _ = refs["p7/c/0/0"]
    data = pathlib.Path(ckpt.storage.url) / obj.split("/", 2)[2]  # "{{root}}/gen-.../packed/0.bin"
    original = data.read_bytes()
    body = full["p7"].nbytes

    def damaged(at: int, new: bytes) -> None:
        raw = bytearray(original)
        raw[off + at : off + at + len(new)] = new
        data.write_bytes(bytes(raw))

    damaged(5, bytes([original[off + 5] ^ 0x10]))
    with pytest.raises(rs.ChecksumError, match="p7"):
        rs.open(url).read_all()
    for index, error in (((2**64 - 1, 2**64 - 1), "missing"), ((0, body), "bytes where")):
        raw_index = struct.pack("<QQ", *index)
        damaged(body + 4, raw_index + crc32c(raw_index).to_bytes(4, "little"))
        with pytest.raises(rs.FormatError, match=error):
            rs.open(url).read_all()
    data.write_bytes(original)
    np.testing.assert_array_equal(rs.open(url)["p7"].read(), full["p7"])


def test_references_name_every_shard_in_order_and_nothing_else(tmp_path):
    """merge_packed keeps the shards of the tensors, by tensor then grid order: a manifest entry for any other
    key (a hostile "zarr.json" would replace the root document in the references) is left out."""
    from reshard.store.format.manifests import merge_packed

    full, layouts = state_and_layouts()
    url = str(tmp_path / "ck")
    writer = write_ranks(url, full, layouts, [0, 1, 2, 3])
    metas = {n: writer.meta(n, lay, str(full[n].dtype)) for n, lay in layouts.items()}
    manifests = {r: {"packed": {k: ["packed/x.bin", 8 * i, 8] for i, k in enumerate(m.shard_keys())}}
                 for r, m in enumerate(metas.values())}
    manifests[0]["packed"]["zarr.json"] = ["packed/x.bin", 0, 8]
    located = merge_packed(url, manifests, metas)
    assert list(located) == [k for m in metas.values() for k in m.shard_keys()]
    assert [m.shard_key(idx) for m in metas.values() for idx in m.shards_in(tuple(slice(0, n) for n in m.shape))] \
        == list(located)
    manifests[1]["packed"][next(iter(metas["model.b"].shard_keys()))] = ["packed/x.bin", True, 8]
    with pytest.raises(rs.FormatError, match="malformed packed record"):
        merge_packed(url, manifests, metas)



@pytest.mark.parametrize("grid", ["exact", "regular"])
@pytest.mark.parametrize("checksums", [True, False])
def test_plain_index_is_the_index_the_encoder_writes(grid, checksums):
    """plain_index (what a load assumes of a large uncompressed shard) equals the index encode_shard writes, for
    regular grids with clipped edge shards, rectilinear grids, row chunks and general chunks."""
    from reshard.store.format.encode import encode_shard, plain_index, stored_bytes
    from reshard.store.format.shard import decode_index

    count = 0
    for shape, mesh, split, chunk_bytes in [((100, 7), (3,), "ceil", 256), ((100, 7), (3,), "balanced", 64),
                                            ((37,), (4,), "balanced", 64), ((30, 5, 3), (4,), "ceil", 256),
                                            ((64, 24), (3,), "balanced", 1 << 20), ((30, 5, 3), (1,), "ceil", 64)]:
        layout = Layout(shape, mesh, dims=((0,),) + ((),) * (len(shape) - 1), split=split)
        writer = rs.create("unused", {}, chunk_bytes=chunk_bytes, checksums=checksums, grid=grid)
        meta = writer.meta("t", layout, "float32")
        data = RNG.standard_normal(shape).astype(np.float32)
        for idx in meta.shards_in(tuple(slice(0, n) for n in shape)):
            raw = b"".join(memoryview(p).cast("B").tobytes() for p in encode_shard(data[meta.shard_region(idx)], meta,
                                                                                    idx))
            want = plain_index(meta, idx)
            np.testing.assert_array_equal(decode_index(raw[-meta.index_nbytes(idx):], meta, "t", idx), want)
            assert stored_bytes(meta, idx, want) == len(raw)
            count += 1
    assert count >= 18


def test_large_shards_load_without_their_index_and_verify_still_checks_it(tmp_path, monkeypatch):
    """A large uncompressed shard whose length shows the encoder's layout is read without fetching its index
    (one round trip fewer); its chunks are still crc-checked, and verify still reads and checks every index."""
    import reshard.store.read.fetch as fetch

    layouts = {f"t{i}": Layout.from_dtensor((2,), ["S(0)"], (1024, 256)) for i in range(4)}  # 512 KiB shards
    full = {n: RNG.standard_normal((1024, 256)).astype(np.float32) for n in layouts}
    url = str(tmp_path / "ck")
    write_ranks(url, full, layouts, [0, 1]).commit()
    decoded: list[str] = []
    decode_index = fetch.decode_index
    monkeypatch.setattr(fetch, "decode_index", lambda data, meta, key, *rest: decoded.append(key) or
                        decode_index(data, meta, key, *rest))
    target = {n: Layout.from_dtensor((3,), ["S(0)"], (1024, 256)) for n in layouts}
    ckpt = rs.open(url)
    got = ckpt.load(target, 1)
    for name in layouts:
        np.testing.assert_array_equal(got[name], full[name][target[name].region(1)])
    assert decoded == []
    assert rs.verify(url).ok and decoded  # verify decodes the indexes
    refs = json.loads((pathlib.Path(ckpt.storage.url) / "refs.json").read_bytes())["refs"]
    obj, off, n = refs["t2/c/1/0"]
    data = pathlib.Path(ckpt.storage.url) / obj.split("/", 2)[2]
    original = data.read_bytes()
    for at, error in ((off + n - 30, None), (off + 1000, rs.ChecksumError)):  # in the index, in a chunk
        raw = bytearray(original)
        raw[at] ^= 0x40
        data.write_bytes(bytes(raw))
        if error is None:  # the load never needed the index: exact data; verify names the damage
            np.testing.assert_array_equal(rs.open(url).load(target, 1)["t2"], full["t2"][target["t2"].region(1)])
            damage = rs.verify(url).damage
            assert len(damage) == 1 and "index" in str(damage[0].message) and "t2" in damage[0].where
        else:
            with pytest.raises(error, match="t2"):
                rs.open(url).load(target, 1)
    data.write_bytes(original)
