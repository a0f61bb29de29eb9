"""Rank trailers of the third form (issue 26): tensor records once per layout group, shard tables.

Every rank used to repeat the records of every tensor it holds (dtype, grids,
codecs, layout: about 340 of 480 bytes a tensor) in its trailer, identical on
every rank. Now the lowest rank of a layout group carries them and the others
name them by sha256; shard locations are a compact table. Saves written with
the earlier trailers (``RSHDMAN1``: records inline in the manifest;
``RSHDMAN2``: records beside it) still commit, open and verify.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout
from reshard.store.format import refs as references
from reshard.store.format import trailers
from reshard.store.format.manifests import read_manifest
from reshard.store.format.schema import with_digest
from reshard.store.format.table import Table, trailer_parts
from reshard.store.io.storage import Storage

RANKS = 4


def state() -> tuple[dict[str, np.ndarray], dict[str, Layout]]:
    """Two layout groups: tensors over all 4 ranks, and tensors over ranks 2 and 3 only (a pipeline stage)."""
    rng = np.random.default_rng(26)
    full: dict[str, np.ndarray] = {}
    layouts: dict[str, Layout] = {}
    for i in range(6):
        full[f"all.t{i}"] = rng.standard_normal((8, 3 + i)).astype(np.float32)
        layouts[f"all.t{i}"] = Layout.from_dtensor((RANKS,), ["S(0)"], full[f"all.t{i}"].shape)
    for i in range(3):
        full[f"stage.t{i}"] = rng.standard_normal((6, 2)).astype(np.float32)
        layouts[f"stage.t{i}"] = Layout.from_dtensor((2,), ["S(0)"], (6, 2), ranks=[2, 3])
    full["all.bias"] = rng.standard_normal((5,)).astype(np.float32)
    layouts["all.bias"] = Layout.from_dtensor((RANKS,), ["R"], (5,))
    return full, layouts


def save(url: str, commit: bool = True, **options: object) -> tuple[dict[str, np.ndarray], dict[str, Layout]]:
    full, layouts = state()
    writer = rs.create(url, layouts, durable=False)
    for r in range(RANKS):
        writer.write(r, {n: a[layouts[n].region(r)] for n, a in full.items() if r in layouts[n].ranks})
    if commit:
        writer.commit(**options)
    return full, layouts


def parts(path: pathlib.Path) -> dict[str, bytes]:
    raw = path.read_bytes()
    footer, n_records, n_table, n_manifest = trailer_parts(str(path), raw)
    end = len(raw) - footer
    return {"body": raw[: end - n_manifest - n_table - n_records],
            "records": raw[end - n_manifest - n_table - n_records : end - n_manifest - n_table],
            "table": raw[end - n_manifest - n_table : end - n_manifest], "manifest": raw[end - n_manifest : end]}


def check(url: str, full: dict[str, np.ndarray]) -> None:
    ckpt = rs.open(url)
    for name, arr in full.items():
        np.testing.assert_array_equal(ckpt[name].read(), arr)
    report = rs.verify(url)
    assert report.ok, report.problems


def test_records_are_carried_once_per_layout_group(tmp_path):
    url = str(tmp_path / "ck")
    full, _ = save(url)
    packed = tmp_path / "ck" / "gen-0" / "packed"
    heads = {r: json.loads(parts(packed / f"{r}.bin")["manifest"]) for r in range(RANKS)}
    # rank 0 carries the group of all ranks, rank 2 the group of ranks 2 and 3; ranks 1 and 3 carry nothing
    assert [len(heads[r]["carried"]) for r in range(RANKS)] == [1, 0, 1, 0]
    assert all(parts(packed / f"{r}.bin")["records"] == b"" for r in (1, 3))
    assert [len(heads[r]["groups"]) for r in range(RANKS)] == [1, 1, 2, 2]
    assert {tuple(g) for r in (2, 3) for g in heads[r]["groups"]} == {tuple(g) for g in heads[2]["groups"]}
    shared = parts(packed / "0.bin")["records"]
    assert hashlib.sha256(shared).hexdigest() == heads[1]["groups"][0][0]
    assert sorted(json.loads(shared)) == sorted(n for n in full if n.startswith("all."))
    # a rank's trailer (without the records it carries) is at most twice its locations in the keyed form
    for r in (1, 3):
        p = parts(packed / f"{r}.bin")
        located, _ = Table(str(packed), p["table"]).expand()
        keyed = len(json.dumps(located, separators=(",", ":")))
        assert len(p["table"]) + len(p["manifest"]) + 32 <= 2 * keyed + 2048  # + the manifest's fixed fields
    manifest = read_manifest(Storage(url).child("gen-0"), 3, "packed")  # the keyed form readers take
    assert sorted(manifest["tensors"]) == sorted(n for n in full if r_holds(n, 3))
    assert all(k in manifest["hashes"] for k in manifest["packed"])
    check(url, full)
    marker = json.loads((tmp_path / "ck" / ".reshard" / "commit.json").read_bytes())
    assert marker["locations"] == "ranks"


def r_holds(name: str, rank: int) -> bool:
    return name.startswith("all.") or rank in (2, 3)


def test_corrupted_shared_records_are_refused_naming_the_carrier(tmp_path):
    url = str(tmp_path / "ck")
    save(url, commit=False)
    obj = tmp_path / "ck" / "gen-0" / "packed" / "0.bin"
    p = parts(obj)
    raw = obj.read_bytes()
    at = len(p["body"]) + p["records"].index(b'"float32"') + 2
    obj.write_bytes(raw[:at] + b"i" + raw[at + 1 :])  # float32 -> fioat32: same length, another sha256
    trailers._RECORDS.clear()  # records of that sha256 read by an earlier test in this process are not read again
    with pytest.raises(rs.FormatError, match=r"packed/0\.bin: the tensor records it carries do not match"):
        rs.commit(url, ranks=list(range(RANKS)))


def test_corrupted_shared_records_after_commit_are_reported_by_verify(tmp_path):
    url = str(tmp_path / "ck")
    full, _ = save(url)
    obj = tmp_path / "ck" / "gen-0" / "packed" / "2.bin"
    p = parts(obj)
    raw = obj.read_bytes()
    at = len(p["body"]) + 5
    obj.write_bytes(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1 :])
    np.testing.assert_array_equal(rs.open(url)["stage.t0"].read(), full["stage.t0"])  # readers need no records
    report = rs.verify(url)
    assert not report.ok and "manifest" in report.kinds()
    assert any("packed/2.bin" in p and "tensor records" in p for p in report.problems), report.problems


def test_a_rank_naming_records_its_carrier_lacks_is_refused(tmp_path):
    """Ranks of one layout group that disagree on its tensors: the carrier does not carry what another names."""
    url = str(tmp_path / "ck")
    save(url, commit=False)
    obj = tmp_path / "ck" / "gen-0" / "packed" / "1.bin"
    p = parts(obj)
    head = json.loads(p["manifest"])
    head["groups"][0][0] = "0" * 64
    head.pop("sha256")
    body = with_digest(head)
    obj.write_bytes(b"".join([p["body"], p["records"], p["table"], body, len(p["records"]).to_bytes(8, "little"),
                              len(p["table"]).to_bytes(8, "little"), len(body).to_bytes(8, "little"),
                              references.TRAILER_MAGIC_V3]))
    with pytest.raises(rs.FormatError, match="does not carry"):
        rs.commit(url, ranks=list(range(RANKS)))


def test_a_damaged_shard_table_is_refused(tmp_path):
    url = str(tmp_path / "ck")
    save(url, commit=False)
    obj = tmp_path / "ck" / "gen-0" / "packed" / "3.bin"
    p = parts(obj)
    raw = obj.read_bytes()
    at = len(p["body"]) + len(p["records"]) + p["table"].index(b'"offset":"') + 10
    obj.write_bytes(raw[:at] + (b"B" if raw[at : at + 1] == b"A" else b"A") + raw[at + 1 :])
    with pytest.raises(rs.FormatError, match=r"packed/3\.bin: its shard table does not match"):
        rs.commit(url, ranks=list(range(RANKS)))


def old_trailer(path: pathlib.Path, storage: Storage, rank: int, version: int) -> None:
    """Rewrite a rank's trailer the way earlier writers did: RSHDMAN2 (records beside the manifest, named by
    ``tensors_sha256``) or RSHDMAN1 (records inline)."""
    p = parts(path)
    manifest = read_manifest(storage, rank, "packed")
    doc = {k: manifest[k] for k in ("format_version", "rank", "save_id", "expected_ranks", "leaves")}
    doc.update(packed=manifest["packed"], hashes=manifest["hashes"])
    if version == 1:
        body = with_digest({**doc, "tensors": manifest["tensors"]})
        path.write_bytes(p["body"] + body + len(body).to_bytes(8, "little") + references.TRAILER_MAGIC_V1)
        return
    records = json.dumps(manifest["tensors"], separators=(",", ":")).encode()
    body = with_digest({**doc, "tensors_sha256": hashlib.sha256(records).hexdigest()})
    path.write_bytes(p["body"] + references.trailer(body, records))


@pytest.mark.parametrize("version", [1, 2])
def test_saves_with_earlier_trailers_still_commit_open_and_verify(tmp_path, version):
    url = str(tmp_path / "ck")
    full, _ = save(url, commit=False)
    gen = Storage(url).child("gen-0")
    for r in range(RANKS):
        old_trailer(tmp_path / "ck" / "gen-0" / "packed" / f"{r}.bin", gen, r, version)
    rs.commit(url, ranks=list(range(RANKS)))
    check(url, full)
    from tests.test_packed import plain_zarr_group

    group = plain_zarr_group(url)
    np.testing.assert_array_equal(group["all/t3"][...], full["all.t3"])


def test_ranks_that_disagree_are_told_which_tensor_and_how(tmp_path):
    """Only the carrier stores a group's records; the others' tables (dtype, record digest per tensor) still let
    the commit name the tensor two ranks disagree on, and how."""
    lay = Layout.from_dtensor((2,), ["S(0)"], (4, 3))
    other = Layout.from_dtensor((2,), ["S(1)"], (4, 3))  # the same ranks, another split
    for name, (l1, extra, want) in {
        "layout": (other, {}, "ranks 0 and 1 disagree on the layout of 'w'"),
        "extra": (lay, {"x": np.ones((2, 3), np.float32)}, "rank 1 holds tensor 'x', which rank 0"),
    }.items():
        url = str(tmp_path / name)
        rs.create(url, {"w": lay}, durable=False).write(0, {"w": np.zeros((2, 3), np.float32)})
        mine = {"w": l1, **({"x": lay} if extra else {})}
        rs.create(url, mine, durable=False).write(1, {"w": np.zeros(l1.local_shape(1), np.float32), **extra})
        with pytest.raises(rs.FormatError, match=want):
            rs.commit(url, ranks=[0, 1])
        assert not (tmp_path / name / ".reshard" / "commit.json").exists()


@pytest.mark.parametrize("keep", [True, False])
def test_a_small_save_commits_reading_each_rank_once(tmp_path, monkeypatch, keep):
    """The commit keeps the shard table the manifest's read already fetched (KEEP_TABLES bytes in all): one read
    of a small save's rank object where two were made; with nothing kept, the table is read again (and the
    commit is the same)."""
    from reshard.store.commit import merge

    url = str(tmp_path / "ck")
    full, _ = save(url, commit=False)
    reads: list[str] = []
    real = Storage.read_tail

    def counted(self: Storage, key: str, nbytes: int) -> bytes:
        reads.append(key)
        return real(self, key, nbytes)

    monkeypatch.setattr(Storage, "read_tail", counted)
    if not keep:
        monkeypatch.setattr(merge, "KEEP_TABLES", 0)
    rs.commit(url, ranks=list(range(RANKS)))
    monkeypatch.undo()
    # ranks 1 and 3 carry no records: their objects are read for the manifest and the table only
    assert [reads.count(f"packed/{r}.bin") for r in (1, 3)] == ([1, 1] if keep else [2, 2])
    check(url, full)
