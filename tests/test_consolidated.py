"""Fast open: the root document's summary, deferred array records, older root documents."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import reshard.store as rs
from reshard.layouts import Layout
from reshard.layouts.errors import FormatError
from reshard.store.format.consolidated import summary_seal
from reshard.store.format.schema import with_digest

from tests.reliability.harness import json_paths

pytestmark = pytest.mark.directory_form  # these tests look at or damage the directory form's files


def _save(tmp_path: Path) -> str:
    url = str(tmp_path / "ck")
    state = {f"block{i}.w": np.arange(6 * (i + 1), dtype="float32").reshape(2, -1) for i in range(5)}
    state["b"] = np.ones(7, dtype="int64")
    rs.save(state, url)
    return url


def _rewrite_root(url: str, edit) -> None:  # type: ignore[no-untyped-def]
    """Change the committed root zarr.json with ``edit(doc)`` and re-sign it in the marker."""
    marker_path = Path(url, ".reshard", "commit.json")
    marker = json.loads(marker_path.read_text())
    root = Path(url, marker["generation"], "zarr.json")
    doc = json.loads(root.read_bytes())
    edit(doc)
    raw = json.dumps(doc).encode()
    root.write_bytes(raw)
    marker["metadata_sha256"] = hashlib.sha256(raw).hexdigest()
    marker.update(summary_seal(raw))
    marker.pop("sha256", None)
    marker_path.write_bytes(with_digest(marker))  # re-sealed with the marker's own digest


def test_open_reads_two_objects_and_defers_records(tmp_path: Path) -> None:
    url = _save(tmp_path)
    ckpt = rs.open(url)
    assert ckpt.stats.requests == 2  # the marker and the root zarr.json
    assert sorted(ckpt) == ["b", *(f"block{i}.w" for i in range(5))]
    assert ckpt["block3.w"].shape == (2, 12) and ckpt["b"].dtype == np.dtype("int64")
    assert ckpt.nbytes == sum(6 * (i + 1) * 4 for i in range(5)) + 7 * 8
    assert not any(m.resolved for m in ckpt.arrays.values())  # names, shapes, dtypes: from the summary
    assert ckpt["block3.w"].layout == Layout.single((2, 12))
    assert ckpt.arrays["block3.w"].resolved and not ckpt.arrays["block2.w"].resolved
    np.testing.assert_array_equal(ckpt.read("block2.w"), np.arange(18, dtype="float32").reshape(2, 9))
    assert ckpt.stats.requests == 2 + 1 + 1  # + the shard, + the replaced-check of the marker


def test_root_document_keeps_zarr_consolidated_metadata(tmp_path: Path) -> None:
    import zarr

    url = _save(tmp_path)
    group = zarr.open_consolidated(rs.open(url).zarr_url, mode="r")
    np.testing.assert_array_equal(group["block1"]["w"][...], np.arange(12, dtype="float32").reshape(2, 6))
    doc = json.loads(Path(rs.open(url).zarr_url, "zarr.json").read_bytes())
    assert doc["attributes"]["reshard"]["arrays"]["block1.w"] == [[2, 6], "float32"]


def test_summary_disagreeing_with_metadata_names_tensor(tmp_path: Path) -> None:
    url = _save(tmp_path)
    _rewrite_root(url, lambda doc: doc["attributes"]["reshard"]["arrays"]["block1.w"].__setitem__(0, [3, 6]))
    ckpt = rs.open(url)
    assert ckpt["block1.w"].shape == (3, 6)  # what the summary says, until the record is used
    with pytest.raises(FormatError, match=r"/zarr\.json: tensor 'block1\.w': its metadata says float32\[2, 6\], "
                       r"the summary float32\[3, 6\]"):
        ckpt.read("block1.w")
    _rewrite_root(url, lambda doc: doc["attributes"]["reshard"]["arrays"]["b"].__setitem__(1, "float16"))
    with pytest.raises(FormatError, match=r"/zarr\.json: tensor 'b': its metadata says int64\[7\], the summary "
                       r"float16\[7\]"):
        rs.open(url).arrays["b"].resolve()


def test_malformed_summary_and_missing_document(tmp_path: Path) -> None:
    url = _save(tmp_path)
    _rewrite_root(url, lambda doc: doc["attributes"]["reshard"]["arrays"].__setitem__("b", "nonsense"))
    with pytest.raises(FormatError, match=r"zarr\.json: malformed summary of tensor 'b'"):
        rs.open(url)
    url2 = _save(tmp_path / "two")
    _rewrite_root(url2, lambda doc: doc["consolidated_metadata"]["metadata"].pop("b"))
    ckpt = rs.open(url2)
    with pytest.raises(FormatError, match=r"zarr\.json: the summary and the consolidated metadata list different"):
        _ = ckpt["b"].layout


def test_root_document_without_summary_still_opens(tmp_path: Path) -> None:
    """A save committed before the summary existed: parsed whole, records complete at once."""
    url = _save(tmp_path)
    _rewrite_root(url, lambda doc: doc["attributes"]["reshard"].pop("arrays"))
    ckpt = rs.open(url)
    assert all(m.resolved for m in ckpt.arrays.values()) and len(ckpt) == 6
    np.testing.assert_array_equal(ckpt.read("b"), np.ones(7, dtype="int64"))


def test_deferred_record_equals_eager_one(tmp_path: Path) -> None:
    url = _save(tmp_path)
    lazy = rs.open(url).arrays["block4.w"]
    eager = rs.open(url, allow_uncommitted=True).arrays["block4.w"]  # built from the manifests
    assert lazy == eager and hash(lazy) == hash(eager)


def test_root_document_is_the_json_of_the_group_with_every_document(tmp_path: Path) -> None:
    """The root is spliced from the documents' JSON text: it must be exactly what encoding the whole gives."""
    url = _save(tmp_path)
    ckpt = rs.open(url)
    raw = Path(ckpt.zarr_url, "zarr.json").read_bytes()
    doc = json.loads(raw)
    assert raw == json.dumps(doc).encode()  # same text, same key order as one json.dumps of the dict
    inline = doc["consolidated_metadata"]["metadata"]
    assert sorted(inline) == sorted(["b", "block0", "block1", "block2", "block3", "block4",
                                     *(f"block{i}/w" for i in range(5))])
    for path, sub in inline.items():
        assert json.loads(Path(ckpt.zarr_url, path, "zarr.json").read_bytes()) == sub


def _edit_unsigned(url: str, edit) -> None:  # type: ignore[no-untyped-def]
    """Change the committed root zarr.json without telling the marker."""
    marker = json.loads(Path(url, ".reshard", "commit.json").read_bytes())
    root = Path(url, marker["generation"], "zarr.json")
    doc = json.loads(root.read_bytes())
    edit(doc)
    root.write_bytes(json.dumps(doc).encode())


def test_open_checks_the_sealed_summary_the_rest_on_first_use(tmp_path: Path) -> None:
    url = _save(tmp_path)
    marker = json.loads(Path(url, ".reshard", "commit.json").read_bytes())
    raw = Path(url, marker["generation"], "zarr.json").read_bytes()
    assert marker["summary_bytes"] < len(raw) // 4 and marker["summary_sha256"] == summary_seal(raw)["summary_sha256"]
    _edit_unsigned(url, lambda doc: doc["consolidated_metadata"]["metadata"]["b"].update(data_type="int32"))
    ckpt = rs.open(url)  # names, shapes and dtypes come from the sealed summary, which is intact
    assert ckpt["b"].dtype == np.dtype("int64")
    with pytest.raises(FormatError, match="does not match the digest in its commit marker"):
        ckpt.read("b")  # the first full record checks the whole document
    _edit_unsigned(url, lambda doc: doc["attributes"]["reshard"]["arrays"]["b"].__setitem__(0, [8]))
    with pytest.raises(FormatError, match="its summary does not match the digest"):
        rs.open(url)


def test_a_marker_without_a_summary_seal_checks_everything_at_open(tmp_path: Path) -> None:
    """Markers written before the seal: the whole document is checked against metadata_sha256 at open."""
    url = _save(tmp_path)
    marker_path = Path(url, ".reshard", "commit.json")
    marker = json.loads(marker_path.read_bytes())
    for key in ("summary_bytes", "summary_sha256", "sha256"):
        marker.pop(key)
    marker_path.write_bytes(with_digest(marker))
    np.testing.assert_array_equal(rs.open(url).read("b"), np.ones(7, dtype="int64"))
    _edit_unsigned(url, lambda doc: doc["consolidated_metadata"]["metadata"]["b"].update(data_type="int32"))
    with pytest.raises(FormatError, match="does not match the digest in its commit marker"):
        rs.open(url)


def _save_repeated(tmp_path: Path) -> tuple[str, dict[str, np.ndarray]]:
    """Twelve tensors of two shapes: the summary repeats the two array documents (``records``)."""
    url = str(tmp_path / "rep")
    state = {f"layer{i}.{k}": np.full(shape, i, dtype="float32") for i in range(6)
             for k, shape in (("w", (4, 3)), ("b", (3,)))}
    rs.save(state, url)
    return url, state


def test_repeated_documents_resolve_from_the_summary_records(tmp_path: Path) -> None:
    """Tensors of one shape, dtype and layout share one summary record: resolving every tensor parses neither
    the consolidated metadata nor more than one document per record, and gives what zarr reads."""
    url, state = _save_repeated(tmp_path)
    ckpt = rs.open(url)
    doc = json.loads(Path(ckpt.zarr_url, "zarr.json").read_bytes())
    summary = doc["attributes"]["reshard"]
    assert len(summary["records"]) == 2 and len(summary["record_of"]) == 12
    assert all(len(e) == 2 for e in summary["arrays"].values())  # as earlier readers expect: they ignore the rest
    root = next(iter(ckpt.arrays.values())).source.func.__self__  # the deferred records' RootMetadata
    got = {name: ckpt.read(name) for name in ckpt}
    assert "checked" not in root.__dict__  # the consolidated documents were never parsed
    for name, value in state.items():
        np.testing.assert_array_equal(got[name], value)
        eager = rs.open(url, allow_uncommitted=True).arrays[name]  # built from the manifests
        assert ckpt.arrays[name] == eager
        sub = doc["consolidated_metadata"]["metadata"][name.replace(".", "/")]
        assert ckpt.arrays[name].to_zarr_json() == sub


def test_summary_records_that_disagree_with_zarr_are_refused(tmp_path: Path) -> None:
    """What reshard reads (the summary's records) and what zarr reads (the consolidated documents) must agree:
    verify names the tensor where they differ; malformed records are refused at open."""
    url, _ = _save_repeated(tmp_path)
    _rewrite_root(url, lambda doc: doc["attributes"]["reshard"]["records"][0]["attributes"]["reshard"]
                  .__setitem__("origin", {"framework": "edited"}))
    report = rs.verify(url)
    assert report.kinds() == {"metadata"}, report.problems
    assert "the record reshard reads (the summary's) and its consolidated document" in report.problems[0]
    url2, _ = _save_repeated(tmp_path / "two")
    _rewrite_root(url2, lambda doc: doc["attributes"]["reshard"]["record_of"].__setitem__(3, 7))
    with pytest.raises(FormatError, match="malformed summary records"):
        rs.open(url2)
    url3, _ = _save_repeated(tmp_path / "three")
    _rewrite_root(url3, lambda doc: doc["attributes"]["reshard"].__setitem__("records", {"a": 1}))
    with pytest.raises(FormatError, match="malformed summary records"):
        rs.open(url3)


def test_fuzzed_summary_records_read_exact_or_refused(tmp_path: Path) -> None:
    """Hostile values anywhere in ``records`` / ``record_of`` (re-signed, so only the checks stand between them
    and the reader): every read gives the saved values or a ReshardError, never another exception."""
    rng = random.Random(26)
    junk = [None, -1, 0, 7, 2**62, "x", "float32", [], {}, [1, 2], {"name": "bytes"}, True, 1.5]
    url, state = _save_repeated(tmp_path)
    doc = json.loads(Path(rs.open(url).zarr_url, "zarr.json").read_bytes())
    spots = [p for key in ("records", "record_of") for p in json_paths(doc["attributes"]["reshard"][key], (key,))]
    for trial in range(60):
        where, value = rng.choice(spots), rng.choice(junk)
        trial_url = str(tmp_path / f"t{trial}")
        shutil.copytree(url, trial_url)

        def edit(d: dict, where: tuple = where, value: object = value) -> None:
            node = d["attributes"]["reshard"]
            for k in where[:-1]:
                node = node[k]
            node[where[-1]] = value

        _rewrite_root(trial_url, edit)
        try:
            ckpt = rs.open(trial_url)
            got = {name: ckpt.read(name) for name in state}
        except rs.ReshardError:
            continue
        for name, want in state.items():  # read without an error: then exactly what was saved
            np.testing.assert_array_equal(got[name], want, err_msg=f"{where} = {value!r}")
