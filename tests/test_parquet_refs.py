"""Parquet references (issue 26): plain zarr-python + fsspec read a packed save a tensor at a time.

With pyarrow installed (``reshard[parquet]``) the commit writes ``refs.parq/`` beside
``refs.json``: fsspec's lazy references, one parquet file per tensor. These tests
read them with no reshard code (a subprocess that never imports it), through the
recipe of docs/format.md, with either parquet engine, and check the JSON recipe
reads the same values.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import reshard.store as rs

pytest.importorskip("pyarrow")
pytest.importorskip("pandas")

import pyarrow.parquet as pq
from reshard.store.format import parquet as references_parquet
from reshard.store.format.schema import with_digest

from tests.test_trailer import save

RECIPE = textwrap.dedent('''
    import json, sys
    import fsspec, numpy as np, zarr
    from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
    from fsspec.implementations.reference import LazyReferenceMapper

    url, engine, form = sys.argv[1:4]
    with fsspec.open(f"{url}/.reshard/commit.json", "rb") as f:
        gen = json.load(f)["generation"]
    if form == "parquet":
        fo = f"{url}/{gen}/refs.parq"
        if engine == "pyarrow":  # fsspec's own default engine is fastparquet
            fo = LazyReferenceMapper(fo, fs=fsspec.filesystem("file"), engine="pyarrow")
        objects = AsyncFileSystemWrapper(fsspec.filesystem("dir", path=url), asynchronous=True)
        options = {"fo": fo, "fs": objects}
    else:
        options = {"fo": f"{url}/{gen}/refs.json", "template_overrides": {"root": url}}
    store = zarr.storage.FsspecStore.from_url("reference://", read_only=True, storage_options=options)
    group = zarr.open_group(store, mode="r")
    out = {name: group[name][...].tolist() for name in ("all/t3", "all/bias", "stage/t1")}
    assert "reshard" not in sys.modules
    print(json.dumps(out))
''')


def plain(url: str, engine: str, form: str) -> dict[str, np.ndarray]:
    done = subprocess.run([sys.executable, "-c", RECIPE, url, engine, form], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return {k: np.asarray(v, dtype=np.float32) for k, v in json.loads(done.stdout).items()}


@pytest.mark.parametrize("engine", ["fastparquet", "pyarrow"])
def test_plain_zarr_reads_parquet_references(tmp_path, engine):
    pytest.importorskip(engine)
    url = str(tmp_path / "ck")
    full, _ = save(url, parquet=True)  # small saves get refs.json alone unless asked
    parq = tmp_path / "ck" / "gen-0" / "refs.parq"
    assert (parq / ".zmetadata").is_file() and (parq / "all" / "t3" / "refs.0.parq").is_file()
    moved = tmp_path / "moved"
    (tmp_path / "ck").rename(moved)  # object keys under the root: a moved checkpoint still reads
    got = plain(str(moved), engine, "parquet")
    for name, arr in got.items():
        np.testing.assert_array_equal(arr, full[name.replace("/", ".")])
    assert got.keys() == plain(str(moved), engine, "json").keys()


def test_parquet_documents_are_small_and_name_v2_chunk_keys(tmp_path):
    url = str(tmp_path / "ck")
    save(url, parquet=True)
    meta = json.loads((tmp_path / "ck" / "gen-0" / "refs.parq" / ".zmetadata").read_bytes())
    arrays = meta["metadata"]["zarr.json"]["consolidated_metadata"]["metadata"]
    assert all(a["chunk_key_encoding"]["name"] == "v2" for a in arrays.values() if a["node_type"] == "array")
    assert meta["metadata"]["all/t3/.zarray"] == {"shape": [4, 1], "chunks": [1, 1]}
    refs = (tmp_path / "ck" / "gen-0" / "refs.json").stat().st_size
    assert (tmp_path / "ck" / "gen-0" / "refs.parq" / ".zmetadata").stat().st_size < refs


def test_the_documented_parquet_recipe_runs_as_pasted(tmp_path):
    """docs/format.md's parquet block, run as written on a save by ranks (names as the page uses them)."""
    pytest.importorskip("fastparquet")
    import reshard.store as rs
    import zarr
    from reshard.layouts import Layout

    from tests.test_docs import DOCS, blocks

    url = str(tmp_path / "ck")
    rng = np.random.default_rng(3)
    full = {"model.layer0.weight": rng.standard_normal((8, 4)).astype(np.float32)}
    layouts = {n: Layout.from_dtensor((2,), ["S(0)"], a.shape) for n, a in full.items()}
    writer = rs.create(url, layouts)
    for r in range(2):
        writer.write(r, {n: a[layouts[n].region(r)] for n, a in full.items()})
    writer.commit(parquet=True)
    block = next(b for b in blocks((DOCS / "format.md").read_text()) if "refs.parq" in b.code)
    scope = {"zarr": zarr, "url": url, "gen": "gen-0"}
    exec(compile("\n" * (block.line - 1) + block.code, str(DOCS / "format.md"), "exec"), scope)
    np.testing.assert_array_equal(scope["weight"], full["model.layer0.weight"])


def test_small_saves_get_json_references_only_unless_asked(tmp_path):
    save(str(tmp_path / "small"))
    assert (tmp_path / "small" / "gen-0" / "refs.json").is_file()
    assert not (tmp_path / "small" / "gen-0" / "refs.parq").exists()
    save(str(tmp_path / "off"), parquet=False)
    assert not (tmp_path / "off" / "gen-0" / "refs.parq").exists()


def test_verify_checks_the_parquet_references(tmp_path):
    """The commit marker records the parquet files' digest: a flipped, truncated or missing file is reported by
    verify (reshard's own reads use refs.json and the trailers, and stay exact)."""
    url = str(tmp_path / "ck")
    full, _ = save(url, parquet=True)
    assert rs.verify(url).ok
    files = sorted(p for p in (tmp_path / "ck").rglob("refs.parq/**/*") if p.is_file())
    assert any(p.name == ".zmetadata" for p in files) and any(p.suffix == ".parq" for p in files)
    for path in files:
        original = path.read_bytes()
        for damaged in (original[: len(original) // 2], bytes([original[0] ^ 1]) + original[1:], None):
            if damaged is None:
                path.unlink()
            else:
                path.write_bytes(damaged)
            report = rs.verify(url, data=False)
            assert not report.ok and report.kinds() == {"references"}, (path, report.problems)
            assert "refs.parq" in report.problems[0]
            path.write_bytes(original)
    got = rs.open(url)
    for name, value in full.items():
        np.testing.assert_array_equal(got[name].read(), value)
    assert rs.verify(url).ok


def _reseal(root: pathlib.Path, **digests: str) -> None:
    """Rewrite the commit marker with ``digests`` (and its own sha256), as anyone who can write the files can."""
    marker = root / ".reshard" / "commit.json"
    doc = json.loads(marker.read_bytes())
    doc.pop("sha256")
    marker.write_bytes(with_digest({**doc, **digests}))


def _edit_parquet(root: pathlib.Path, edit: Callable[[dict[str, list[Any]], int], None]) -> None:
    """Edit the rows of ``all/t3``'s parquet file (``edit(columns, object size)``), then re-seal the marker."""
    path = root / "gen-0" / "refs.parq" / "all" / "t3" / "refs.0.parq"
    rows = pq.read_table(path).to_pydict()
    edit(rows, (root / "gen-0" / "packed" / "0.bin").stat().st_size)
    objects = sorted(set(rows["path"]))
    path.write_bytes(references_parquet.encode(objects, np.asarray([objects.index(p) for p in rows["path"]]),
                                               np.asarray(rows["offset"]), np.asarray(rows["size"])))
    _reseal_parquet(root)


def _reseal_parquet(root: pathlib.Path) -> None:
    """Re-seal the marker's ``parquet_sha256`` over the parquet references as they are now."""
    metas = list(rs.open(str(root)).arrays.values())
    keys = references_parquet.keys([m.path for m in metas], [m.grid for m in metas])
    parq = root / "gen-0" / "refs.parq"
    _reseal(root, parquet_sha256=references_parquet.digest([hashlib.sha256((parq / k).read_bytes()).hexdigest()
                                                            for k in keys]))


def _edit_json(root: pathlib.Path, edit: Callable[[dict[str, list[Any]], int], None]) -> None:
    """The same edit of ``all/t3``'s shard references in refs.json, then re-seal the marker."""
    path = root / "gen-0" / "refs.json"
    doc = json.loads(path.read_bytes())
    keys = [f"all/t3/c/{i}/0" for i in range(4)]
    rows = {"path": [doc["refs"][k][0] for k in keys], "offset": [doc["refs"][k][1] for k in keys],
            "size": [doc["refs"][k][2] for k in keys]}
    edit(rows, (root / "gen-0" / "packed" / "0.bin").stat().st_size)
    for i, k in enumerate(keys):
        doc["refs"][k] = [rows["path"][i], rows["offset"][i], rows["size"][i]]
    path.write_bytes(json.dumps(doc).encode())
    _reseal(root, references_sha256=hashlib.sha256(path.read_bytes()).hexdigest())


def _swap(rows: dict[str, list[Any]], size: int) -> None:
    for column in rows.values():
        column[0], column[1] = column[1], column[0]


def _past_the_object(rows: dict[str, list[Any]], size: int) -> None:
    rows["offset"][0] = size + 4096


@pytest.mark.parametrize("form", ["parquet", "json"])
@pytest.mark.parametrize("edit", [_swap, _past_the_object], ids=["swapped-rows", "past-the-object"])
def test_verify_checks_every_reference_against_the_ranks_tables(tmp_path, form, edit):
    """Issue 35 item 5: references rewritten and re-sealed in the marker (so every digest agrees) make the plain
    zarr recipe read another rank's rows or zeros while reshard reads the saved data: verify must report the
    tensor, the shard and the file."""
    pytest.importorskip("fastparquet")
    url = str(tmp_path / "ck")
    full, _ = save(url, parquet=True)
    (_edit_parquet if form == "parquet" else _edit_json)(tmp_path / "ck", edit)
    got = rs.open(url)
    for name, value in full.items():  # reshard reads through the ranks' tables: exact
        np.testing.assert_array_equal(got[name].read(), value)
    plain_t3 = plain(url, "fastparquet", form)["all/t3"]
    assert not np.array_equal(plain_t3, full["all.t3"])  # what the check is for: plain zarr reads other data
    if edit is _past_the_object:
        assert not plain_t3[:2].any()  # the first shard's rows read as zeros
    report = rs.verify(url, data=False)
    assert report.kinds() == {"references"}, report.problems
    file = "refs.parq/all/t3/refs.0.parq" if form == "parquet" else "refs.json"
    assert any(file in p and "tensor 'all.t3', shard 'all/t3/c/0/0'" in p for p in report.problems), \
        report.problems
