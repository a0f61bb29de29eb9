"""Issue 11, defects 6 and 7: strict metadata checks and a ``verify`` that reads every metadata file.

Edits of the consolidated metadata are tried two ways: as they are (the marker's
digest catches them at open) and with the digest recomputed (a hand edit that
also fixes the marker, or a buggy writer): then the typed checks must refuse
what would read wrongly, and ``verify`` must catch the rest against the ranks'
manifests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import reshard.store as rs
from paths import zarr_root
from reshard.layouts import Layout
from reshard.store.cli import main
from reshard.store.commit.marker import Marker
from reshard.store.format.consolidated import summary_seal
from reshard.store.ops.verify import KINDS, verify

pytestmark = pytest.mark.directory_form  # these tests look at or damage the directory form's files

W = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    url = tmp_path / "ck"
    rs.save({"model": {"w": W, "b": np.ones(32, np.float32)}, "step": 3}, url,
            {"model.w": Layout.from_dtensor((4,), ["S(0)"], W.shape), "model.b": Layout.single((32,))})
    return url


def rewrite_root(url: Path, edit: Any, fix_digest: bool = True, summary: Any = None) -> None:
    """Edit the consolidated metadata and the summary of arrays (and, with ``fix_digest``, make the marker agree)."""
    root = url / json.loads((url / ".reshard" / "commit.json").read_text())["generation"] / "zarr.json"
    doc = json.loads(root.read_text())
    edit(doc["consolidated_metadata"]["metadata"])
    if summary is not None:
        summary(doc["attributes"]["reshard"]["arrays"])
    raw = json.dumps(doc).encode()
    root.write_bytes(raw)
    if fix_digest:
        marker_path = url / ".reshard" / "commit.json"
        marker = Marker.parse(str(url), marker_path.read_bytes())
        marker = dataclasses.replace(marker, metadata_sha256=hashlib.sha256(raw).hexdigest(), **summary_seal(raw),
                                     tensors=sum(1 for d in doc["consolidated_metadata"]["metadata"].values()
                                                 if isinstance(d, dict) and d.get("node_type") == "array"))
        marker_path.write_bytes(marker.to_json())


def w_doc(docs: dict[str, Any]) -> dict[str, Any]:
    return docs["model/w"]


EDITS = {
    "node_type dropped": lambda d: w_doc(d).pop("node_type"),
    "shape 64 -> 48": lambda d: w_doc(d).update(shape=[48, 32]),
    "dtype unknown": lambda d: w_doc(d).update(data_type="float33"),
    "shape a string": lambda d: w_doc(d).update(shape="64,32"),
    "chunk grid changed": lambda d: w_doc(d)["chunk_grid"]["configuration"].update(chunk_shape=[8, 32]),
    "layout dropped": lambda d: w_doc(d)["attributes"]["reshard"].pop("layout"),
    "codecs emptied": lambda d: w_doc(d).update(codecs=[]),
    "group entry dropped": lambda d: d.pop("model"),
    "group turned array": lambda d: d["model"].update(node_type="array"),
}


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_consolidated_edits_are_refused_at_first_use(ckpt, edit):
    """Defect 6: these edits made tensors vanish or read with a wrong shape, and verify said VERIFIED.

    Open checks the sealed summary only; the whole document is checked on the first record it gives."""
    rewrite_root(ckpt, edit, fix_digest=False)
    with pytest.raises(rs.FormatError, match="digest"):
        rs.open(ckpt).read_all()
    rewrite_root(ckpt, lambda d: None)  # the digest made to agree: the typed checks refuse, at open or first read
    with pytest.raises(rs.FormatError, match=r"zarr\.json"):
        rs.open(ckpt).read_all()
    assert main(["verify", str(ckpt)]) == 1


def test_a_consistent_dtype_edit_reads_but_verify_catches_it(ckpt, capsys):
    """float32 -> int32 with the digest fixed is a valid document; the manifests disagree."""
    rewrite_root(ckpt, lambda d: w_doc(d).update(data_type="int32"))
    with pytest.raises(rs.FormatError, match=r"int32.*summary float32"):  # the summary of arrays disagrees
        rs.open(ckpt).read("model.w")
    rewrite_root(ckpt, lambda d: None, summary=lambda s: s["model.w"].__setitem__(1, "int32"))
    assert rs.open(ckpt).read("model.w").dtype == np.int32  # what the (edited) metadata says
    report = verify(str(ckpt))
    # against the manifests, and against model/w/zarr.json (which the edit did not touch)
    assert report.kinds() == {"metadata", "array-json"}
    (problem,) = [d.message for d in report.damage if d.kind == "metadata"]
    assert "'model.w'" in problem and "dtype" in problem
    assert main(["verify", str(ckpt)]) == 1
    assert "[metadata]" in capsys.readouterr().out


def test_tensor_count_is_checked_against_the_marker(ckpt):
    rewrite_root(ckpt, lambda d: d.pop("model/b"))
    with pytest.raises(rs.FormatError, match="describes 2 tensors, its commit marker 1"):  # the summary lists 2
        rs.open(ckpt)
    rewrite_root(ckpt, lambda d: None, summary=lambda s: s.pop("model.b"))
    marker_path = ckpt / ".reshard" / "commit.json"
    marker = Marker.parse(str(ckpt), marker_path.read_bytes())
    marker_path.write_bytes(dataclasses.replace(marker, tensors=2).to_json())
    with pytest.raises(rs.FormatError, match="describes 1 tensors, its commit marker 2"):
        rs.open(ckpt)


# ------------------------------------------------------------- defect 7
NODE_DAMAGE = {
    "array dtype": ("model/w", lambda d: d.update(data_type="int32"), "array-json"),
    "array shape": ("model/w", lambda d: d.update(shape=[48, 32]), "array-json"),
    "array attributes": ("model/b", lambda d: d["attributes"]["reshard"].update(origin={"x": 1}), "array-json"),
    "array not JSON": ("model/w", None, "array-json"),
    "array missing": ("model/b", "delete", "array-json"),
    "group node_type": ("model", lambda d: d.update(node_type="array"), "group-json"),
    "group attributes": ("model", lambda d: d.update(attributes={"x": 1}), "group-json"),
    "group missing": ("model", "delete", "group-json"),
}


@pytest.mark.parametrize("case", NODE_DAMAGE.values(), ids=NODE_DAMAGE.keys())
def test_verify_reads_every_array_and_group_zarr_json(ckpt, case, capsys):
    """Defect 7: verify never read these files (what zarr-python and TensorStore read): 35/35 passed."""
    path, edit, kind = case
    target = zarr_root(ckpt) / path / "zarr.json"
    if edit == "delete":
        target.unlink()
    elif edit is None:
        target.write_bytes(target.read_bytes()[:-7])
    else:
        doc = json.loads(target.read_text())
        edit(doc)
        target.write_text(json.dumps(doc))
    np.testing.assert_array_equal(rs.open(ckpt).read("model.w"), W)  # reshard itself reads the consolidated copy
    assert main(["verify", str(ckpt), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert [d["kind"] for d in out["damage"]] == [kind]
    assert f"{path}/zarr.json" in out["damage"][0]["message"]
    assert kind in KINDS


def test_verify_reports_damaged_manifests_and_a_clean_checkpoint(ckpt, capsys):
    assert main(["verify", str(ckpt)]) == 0
    assert "VERIFIED" in capsys.readouterr().out
    manifest = zarr_root(ckpt) / ".reshard" / "ranks" / "2.json"
    manifest.write_text(manifest.read_text().replace('"float32"', '"int32"'))
    report = verify(str(ckpt))
    assert report.kinds() == {"manifest"} and "ranks/2.json" in report.problems[0] and "sha256" in report.problems[0]


def test_a_damaged_self_digest_key_does_not_turn_the_check_off(ckpt):
    """A flip inside the key ``sha256`` made it an unknown field: the marker then read as an old, unchecked one."""
    marker = ckpt / ".reshard" / "commit.json"
    marker.write_bytes(marker.read_bytes().replace(b'"sha256"', b'"sha2V6"'))
    with pytest.raises(rs.FormatError, match=r"no sha256 but fields \['sha2V6',"):
        rs.open(ckpt)
    assert verify(str(ckpt)).kinds() == {"marker"}
