"""Fuzzed metadata: every edit is refused with a clear error or reads back exactly.

Seeded random edits of one value of a JSON document (a number nudged or made
huge, a string swapped for another dtype or node name, a type changed, a key
dropped or added, a list shortened or lengthened), in every metadata document:
the marker, the root ``zarr.json``, array and group ``zarr.json``, and a rank's
manifest before the commit; in the packed form also the references file (its
inline documents and shard locations) and a rank's manifest and tensor records
inside the trailer of its data object (the carrier rank's shared layout-group records, every rank's
shard table). Two modes:

* ``raw``: the edit alone (corruption, or a hand edit). Open, read, commit must
  refuse it (ReshardError naming the file or tensor) or return the saved data
  exactly.
* ``consistent``: the marker's digests are recomputed after the edit (an edit
  that also fixes the marker, or a buggy writer). The typed checks must refuse
  what would read wrongly; what still reads differently (a valid dtype swapped
  for another of the same size) must be reported by ``verify``, which checks
  the metadata against the ranks' manifests.

A case is *silent* when a read returns other data and nothing reports it, or
when anything but a ReshardError escapes; the test fails on any silent case.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import random
from typing import Any

import pytest
import reshard.store as rs
from harness import RANKS, Backend, Tally, attempt, json_paths, make_state, read_back, rng_for, same, save, trials
from reshard.store.format.consolidated import summary_seal
from reshard.store.format.refs import REFS_KEY, TRAILER_MAGIC_V3
from reshard.store.format.schema import with_digest
from reshard.store.format.table import trailer_parts
from reshard.store.ops.verify import verify

STRINGS = ["", "x", "float32", "int32", "uint8", "float64", "bfloat16", "array", "group", "regular", "zstd",
           "bytes", "crc32c", "gen-base", "end", "little"]


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _replacements(value: Any, rng: random.Random) -> list[Any]:
    if isinstance(value, bool):
        return [not value, 0, "true", None]
    if isinstance(value, int):
        return [value + 1, value - 1, 0, -1, value * 2, 2**40, str(value), None, value + 0.5, True, [value]]
    if isinstance(value, float):
        return [value + 1, 0, -value, "x", None, int(value)]
    if isinstance(value, str):
        return [*rng.sample(STRINGS, 4), value + "x", value[:-1], None, 7, [value]]
    if value is None:
        return [0, "", {}, [], "zstd"]
    if isinstance(value, list):
        return [[], value[:-1], value + value[-1:], value[::-1], {}, None, "x", [value]]
    return [{}, [], None, "x"]


def mutate(doc: Any, rng: random.Random) -> tuple[Any, str]:
    """One random edit of a copy of ``doc``, and what it was."""
    doc = copy.deepcopy(doc)
    path = rng.choice(json_paths(doc)[1:])
    parent, last = _get(doc, path[:-1]), path[-1]
    op = rng.random()
    if isinstance(parent, dict) and op < 0.15:
        del parent[last]
        return doc, f"dropped {list(path)}"
    if isinstance(parent, dict) and op < 0.2:
        parent[f"extra{rng.randrange(9)}"] = rng.choice([1, "x", None, {}])
        return doc, f"added a key beside {list(path)}"
    new = rng.choice(_replacements(parent[last], rng))
    old = parent[last]
    parent[last] = new
    return doc, f"{list(path)}: {json.dumps(old)[:40]} -> {json.dumps(new)[:40]}"


# ---------------------------------------------------------------- docs
def _marker(backend: Backend) -> dict[str, Any]:
    return json.loads(backend.read(".reshard/commit.json"))


def _fix_marker(backend: Backend, marker: dict[str, Any], key: str | None = None) -> None:
    """Rewrite the marker with the digest of the document at ``key`` recomputed (the ``consistent`` mode)."""
    path = key.partition("#")[0] if key is not None else ""
    if path.endswith(("/zarr.json", "/.reshard/metadata.json")):  # the root document (directory, packed)
        marker["metadata_sha256"] = hashlib.sha256(backend.read(path)).hexdigest()
        marker.update(summary_seal(backend.read(path)))
    elif path.endswith(f"/{REFS_KEY}"):
        marker["references_sha256"] = hashlib.sha256(backend.read(path)).hexdigest()
    marker.pop("sha256", None)
    backend.write(".reshard/commit.json", with_digest(marker))


def _root_key(gen: str, form: str) -> str:
    """The root document's own object: ``zarr.json`` (directory form), ``.reshard/metadata.json`` (packed)."""
    return f"{gen}/.reshard/metadata.json" if form == "packed" else f"{gen}/zarr.json"


def _node_keys(backend: Backend, gen: str, node: str, form: str) -> list[str]:
    """Array or group documents: files (directory form), or ``refs.json#<key>`` inline in the references."""
    root = json.loads(backend.read(_root_key(gen, form)))
    docs = root["consolidated_metadata"]["metadata"]
    where = f"{gen}/{REFS_KEY}#" if form == "packed" else f"{gen}/"
    return [f"{where}{p}/zarr.json" for p, d in sorted(docs.items()) if d["node_type"] == node]


def _trailer(path: str, raw: bytes) -> dict[str, bytes]:
    """A packed data object's parts: its shards (``body``), the tensor ``records`` it carries, its shard
    ``table`` and ``manifest`` (third form; :mod:`reshard.store.format.table`)."""
    footer, n_records, n_table, n_manifest = trailer_parts(path, raw)
    manifest = len(raw) - footer - n_manifest
    table = manifest - n_table
    records = raw[table - n_records : table]
    carried = json.loads(raw[manifest : len(raw) - footer])["carried"]
    first = carried[0][1] if carried else 0  # the first layout group's records; the others after them
    return {"body": raw[: table - n_records], "records": records[:first], "others": records[first:],
            "table": raw[table:manifest], "manifest": raw[manifest : len(raw) - footer]}


def _pack(parts: dict[str, bytes]) -> bytes:
    """The inverse of :func:`_trailer`."""
    records, table, manifest = parts["records"] + parts["others"], parts["table"], parts["manifest"]
    return b"".join([parts["body"], records, table, manifest, *(len(p).to_bytes(8, "little") for p in
                                                                (records, table, manifest)), TRAILER_MAGIC_V3])


def read_doc(backend: Backend, key: str) -> bytes:
    """A document: a file, or ``<file>#<part>`` inside one (an inline document of refs.json, a trailer's part)."""
    path, _, part = key.partition("#")
    raw = backend.read(path)
    if not part:
        return raw
    if path.endswith(REFS_KEY):
        return str(json.loads(raw)["refs"][part]).encode()
    return _trailer(path, raw)[part]


def write_doc(backend: Backend, key: str, doc: bytes) -> None:
    """Replace a document read by :func:`read_doc` (the rest of its file unchanged)."""
    path, _, part = key.partition("#")
    if not part:
        backend.write(path, doc)
    elif path.endswith(REFS_KEY):
        refs = json.loads(backend.read(path))
        refs["refs"][part] = doc.decode()
        backend.write(path, json.dumps(refs).encode())
    else:
        parts = {**_trailer(path, backend.read(path)), part: doc}
        backend.write(path, _pack(parts))


def _manifest_keys(gen: str, form: str) -> list[str]:
    if form == "packed":
        return [f"{gen}/packed/{r}.bin#manifest" for r in range(RANKS)]
    return [f"{gen}/.reshard/ranks/{r}.json" for r in range(RANKS)]


CASES = [("marker", "raw"), ("marker", "consistent"), ("root-json", "raw"), ("root-json", "consistent"),
         ("array-json", "raw"), ("group-json", "raw"), ("manifest", "raw"), ("references", "raw"),
         ("references", "consistent"), ("records", "raw"), ("table", "raw")]
#: Documents only the packed form has.
PACKED_ONLY = {"references", "records", "table"}
#: Documents reshard's reader does not read (it reads the consolidated root; the packed form locates shards
#: through the ranks' manifests), which zarr-python, TensorStore or fsspec do, or (tensor records) that a
#: committer takes from its cache of the same sha256: an edit there must be reported by ``verify``.
NOT_READ = {"array-json", "group-json", "references", "records"}


@pytest.mark.parametrize(("doc", "mode"), CASES, ids=[f"{d}-{m}" for d, m in CASES])
def test_fuzzed_metadata_is_refused_or_reads_exactly(backend: Backend, form: str, doc: str, mode: str) -> None:
    if backend.name == "s3" and not trials(ci=0, soak=1):
        pytest.skip("fuzzing parses documents the same on every backend; S3 (slow on moto) only with RESHARD_SOAK=1")
    if doc in PACKED_ONLY and form != "packed":
        pytest.skip(f"the {form} form has no {doc} document")
    rng = rng_for("fuzz", backend.name, form, doc, mode)
    tally = Tally(f"fuzz[{backend.name}-{form}-{doc}-{mode}]")
    state = make_state(rng)
    committed = doc not in ("manifest", "records", "table")
    save(state, backend, form, "base", commit=committed)
    gen = _marker(backend)["generation"] if committed else "gen-base"
    keys = {"marker": [".reshard/commit.json"], "root-json": [_root_key(gen, form)],
            "manifest": _manifest_keys(gen, form), "references": [f"{gen}/{REFS_KEY}"],
            "records": [f"{gen}/packed/0.bin#records"],  # the carrier of the one layout group: rank 0
            "table": [f"{gen}/packed/{r}.bin#table" for r in range(RANKS)]}
    if committed:
        keys.update({"array-json": _node_keys(backend, gen, "array", form),
                     "group-json": _node_keys(backend, gen, "group", form)})
    files = {k.partition("#")[0] for k in keys[doc]} | ({".reshard/commit.json"} if committed else set())
    originals = {k: backend.read(k) for k in files}
    for i in range(trials(ci=12, soak=20 if backend.name == "s3" else 150)):
        key = rng.choice(keys[doc])
        original = json.loads(read_doc(backend, key))
        edited, what = mutate(original, rng)
        case = f"case {i}: {key}: {what}"
        raw = json.dumps(edited).encode()
        try:
            if doc == "marker" and mode == "consistent":
                _fix_marker(backend, edited)
            else:
                write_doc(backend, key, raw)
                if mode == "consistent":
                    _fix_marker(backend, json.loads(originals[".reshard/commit.json"]), key)
            if not committed:
                outcome, got = attempt(lambda: rs.commit(backend.url, save_id="base", ranks=list(range(RANKS)),
                                                         storage_options=backend.storage_options))
                if outcome == "ok":
                    outcome, got = attempt(lambda: read_back(backend))
            else:
                outcome, got = attempt(lambda: read_back(backend))
            if outcome == "crash":
                tally.add("silent", doc, f"{case}: {type(got).__name__}: {got}")
            elif outcome == "refused":
                named = backend.url in str(got) or "tensor" in str(got)
                tally.add("refused" if named else "unnamed", doc, None if named else f"{case}: {got}")
            elif same(got, state) and doc in NOT_READ and edited != original:
                # reshard does not read it; zarr-python, TensorStore or fsspec do: verify must see it
                report = verify(backend.url, storage_options=backend.storage_options)
                tally.add("correct; verify reports it" if not report.ok else "silent", doc,
                          None if not report.ok else f"{case}: verify says OK")
            elif same(got, state):
                tally.add("correct", doc)
            elif mode == "raw":
                tally.add("silent", doc, f"{case}: read other data without an error")
            else:
                v_outcome, report = attempt(lambda: verify(backend.url, storage_options=backend.storage_options))
                if v_outcome == "ok" and not report.ok:
                    tally.add("caught by verify", doc)
                else:
                    tally.add("silent", doc, f"{case}: read other data and verify says {v_outcome} {report}")
        finally:
            for k, v in originals.items():
                backend.write(k, v)
            if not committed:  # undo a commit the case made (nothing else is at this URL)
                made = ("zarr.json", ".reshard/metadata.json", REFS_KEY, ".reshard/commit.lock")
                for k in (".reshard/commit.json", *(f"{gen}/{m}" for m in made)):
                    with contextlib.suppress(FileNotFoundError):
                        backend.delete(k)
    tally.check()
