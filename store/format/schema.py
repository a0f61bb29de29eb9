"""Strict, typed checks of every metadata document reshard reads or writes.

One place for the rules (docs/format.md lists them): the commit marker
``.reshard/commit.json``, the per-rank manifests ``.reshard/ranks/<rank>.json``,
a generation's root ``zarr.json`` (consolidated metadata), and tensor names
before anything is written; each array's and group's own ``zarr.json`` (its
``attributes.reshard`` and its layout JSON) in :mod:`.schema_array`, with the
helpers here. Every failure is a :class:`FormatError` (or
:class:`BadNameError` for names) whose message names the file (URL and key) or
the tensor; no ``KeyError``/``TypeError``/``ValueError`` of a malformed document
escapes.

The checks are cheap per document; the consolidated metadata is checked as a
whole at open (types, ``node_type``, the hierarchy), each array document when
its tensor is parsed, and everything again by ``reshard verify``.

This module imports no other part of ``store.format`` but :mod:`.dtypes`
(``meta`` and :mod:`.schema_array` import it), so any reader can use it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from reshard.layouts import Layout
from reshard.layouts.errors import BadNameError, FormatError

from .dtypes import SUPPORTED

#: Longest name component (bytes) a file system takes (ext4, xfs, APFS, NTFS: 255).
MAX_COMPONENT_BYTES = 255

# ------------------------------------------------------------------ limits
# A checkpoint is untrusted input (docs/reliability.md, "Untrusted checkpoints"): before reshard reads a
# document whole or allocates for what one describes, it checks these. Each is far above what any save
# reshard can write needs (the figures say how far), so only a malformed or hostile checkpoint meets one.
#: Bytes of a commit marker (``.reshard/commit.json``): its ``ranks`` list at a million ranks is 8 MB.
MAX_MARKER_BYTES = 64 << 20
#: Bytes of any other metadata document read whole: a root ``zarr.json`` (about 1.2 KB per tensor: 200,000
#: tensors), a rank's manifest or tensor records (about 300 bytes per tensor and shard it holds).
MAX_DOCUMENT_BYTES = 256 << 20
#: Bytes of a packed save's references (``refs.json``: about 80 bytes per shard of every tensor; reshard's own
#: reader locates shards through the ranks' manifests and reads this file only for block writers' saves).
MAX_REFERENCES_BYTES = 1 << 30
#: Ranks of one layout's mesh (262,144: above the largest jobs run; tools that describe a layout rank by rank
#: cost memory and time per rank).
MAX_RANKS = 1 << 18
#: Dimensions of a tensor (numpy's own limit is 64).
MAX_NDIM = 32
#: Elements of one tensor (2**50: a PiB at one byte each).
MAX_ELEMENTS = 1 << 50
#: Shards of one tensor (a shard per block of its layout: 16 M).
MAX_SHARDS = 1 << 24
#: Inner chunks of one shard (its index is 16 bytes per chunk: 256 MiB at this count; a writer's chunks are
#: at least 64 KiB, so a shard this finely chunked would hold a TiB).
MAX_CHUNKS_PER_SHARD = 1 << 24
#: Bytes of one inner chunk, decoded (a chunk is decoded whole: a writer's are 1 MiB by default).
MAX_CHUNK_BYTES = 4 << 30
#: Key under which a manifest and the marker carry the sha256 of their own canonical JSON.
SELF_DIGEST = "sha256"

_HEX64 = re.compile(r"[0-9a-f]{64}")


# -------------------------------------------------------------------- JSON
def loads_json(where: str, raw: bytes) -> Any:
    """JSON from bytes; a :class:`FormatError` naming ``where`` for anything that is not JSON."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise FormatError(f"{where} is not valid JSON: {e}") from None


def canonical_digest(doc: Mapping[str, Any]) -> str:
    """sha256 of a document's canonical JSON, leaving out its own ``sha256`` field."""
    body = {k: v for k, v in doc.items() if k != SELF_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def with_digest(doc: dict[str, Any]) -> bytes:
    """The bytes of ``doc`` with its self-digest added (manifests, the marker)."""
    return json.dumps({**doc, SELF_DIGEST: canonical_digest(doc)}).encode()


def check_digest(doc: Mapping[str, Any], where: str, known: Iterable[str] = ()) -> None:
    """Check a document's self-digest.

    Older writers wrote none: a document without one is accepted if it holds
    only the ``known`` fields such writers wrote (a damaged ``sha256`` key, seen
    as an unknown field, is refused: it would otherwise turn the check off).
    """
    recorded = doc.get(SELF_DIGEST)
    if recorded is None:
        unknown = sorted(set(doc) - set(known))
        if unknown:
            raise FormatError(f"{where} has no sha256 but fields {unknown} that no writer without one wrote: "
                              "damaged or edited")
        return
    if not isinstance(recorded, str) or recorded != canonical_digest(doc):
        raise FormatError(f"{where} fails its sha256: the document was edited or corrupted after it was written")


# ------------------------------------------------------------------ values
def fail(where: str, field: str, want: str, got: Any) -> FormatError:
    shown = repr(got)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return FormatError(f"{where}: field {field!r} must be {want}, got {shown}")


def is_int(value: Any) -> bool:
    """A JSON integer (not a bool)."""
    return type(value) is int


def get(doc: Any, field: str, where: str) -> Any:
    """``doc[field]``, with a FormatError naming ``where`` if ``doc`` is no object or lacks it."""
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    if field not in doc:
        raise FormatError(f"{where}: field {field!r} is missing")
    return doc[field]


def int_list(value: Any, where: str, field: str, *, minimum: int = 0, length: int | None = None) -> tuple[int, ...]:
    """A list of ints ``>= minimum`` (of ``length`` items when given) as a tuple."""
    if type(value) is not list or not all(is_int(v) and v >= minimum for v in value):
        raise fail(where, field, f"a list of ints >= {minimum}", value)
    if length is not None and len(value) != length:
        raise fail(where, field, f"a list of {length} ints", value)
    return tuple(value)


def dtype_of(value: Any, where: str, field: str = "data_type") -> str:
    """A known dtype name."""
    if not isinstance(value, str) or value not in SUPPORTED:
        raise fail(where, field, f"one of {', '.join(SUPPORTED)}", value)
    return value


def layout_of(value: Any, where: str, shape: tuple[int, ...] | None = None) -> Layout:
    """A layout from its JSON, checked against the array's ``shape`` when given (a mesh of at most
    :data:`MAX_RANKS` ranks, counted before the layout is built)."""
    mesh = value.get("mesh") if isinstance(value, dict) else None
    if type(mesh) is list and all(is_int(n) for n in mesh) and math.prod(mesh) > MAX_RANKS:
        raise FormatError(f"{where}: its layout's mesh {mesh} has {math.prod(mesh)} ranks, over the limit of "
                          f"{MAX_RANKS}")
    ranges = value.get("ranges") if isinstance(value, dict) else None  # a flat layout: one range a rank
    even = value.get("even") if isinstance(value, dict) else None
    if isinstance(even, dict) and type(even.get("range")) is list and len(even["range"]) == 2 \
            and all(is_int(n) for n in even["range"]):
        even = range(*even["range"])
    for listed in (ranges, even):
        if isinstance(listed, (list, range)) and len(listed) > MAX_RANKS:
            raise FormatError(f"{where}: its flat layout has {len(listed)} ranks, over the limit of {MAX_RANKS}")
    try:
        layout = Layout.from_json(value)
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, MemoryError) as e:
        raise FormatError(f"{where}: malformed layout ({type(e).__name__}: {e})") from None
    if shape is not None and tuple(layout.shape) != shape:
        raise FormatError(f"{where}: shape {list(shape)} differs from its stored layout's {list(layout.shape)}")
    return layout


# ------------------------------------------------------------------- names
def check_names(names: Iterable[str], paths: Mapping[str, str], where: str) -> None:
    """Refuse names the format cannot hold, before anything is written.

    ``paths`` maps each name to its escaped zarr path. A name that is a prefix
    of another (``a`` and ``a.b``: zarr cannot have an array that is also a
    group) and a path component over :data:`MAX_COMPONENT_BYTES` bytes (no file
    system stores it) are refused, naming the tensors.
    """
    by_path: dict[str, str] = {}
    for name in names:
        path = paths[name]
        for part in path.split("/"):
            if len(part.encode()) > MAX_COMPONENT_BYTES:
                raise BadNameError(f"{where}: tensor {_short(name)}: the name component stored as {part[:40]!r}... is "
                                   f"{len(part.encode())} bytes, over the {MAX_COMPONENT_BYTES}-byte limit of "
                                   "file systems (escaping counts 3 bytes per character outside [A-Za-z0-9_-])")
        by_path[path] = name
    for path, name in by_path.items():
        parts = path.split("/")
        for i in range(1, len(parts)):
            other = by_path.get("/".join(parts[:i]))
            if other is not None:
                raise BadNameError(f"{where}: tensor {other!r} is a prefix of tensor {name!r}; a checkpoint cannot "
                                   "hold both (in zarr, an array cannot also be a group): rename one of them")


def _short(name: str) -> str:
    return repr(name) if len(name) <= 80 else repr(name[:60]) + f"... ({len(name)} characters)"


def check_component(part: str, what: str, where: str) -> None:
    """Refuse one stored name component (e.g. a save's generation) over the file-system limit."""
    if len(part.encode()) > MAX_COMPONENT_BYTES:
        raise BadNameError(f"{where}: {what} makes a name of {len(part.encode())} bytes, over the "
                           f"{MAX_COMPONENT_BYTES}-byte limit of file systems")


# ------------------------------------------------------------------ marker
_MARKER_FIELDS = {"format_version", "generation", "save_id", "time", "tensors", "ranks", "metadata_sha256", "form"}
_MANIFEST_FIELDS = {"format_version", "rank", "save_id", "expected_ranks", "tensors", "leaves"}

def marker_fields(doc: Any, where: str) -> dict[str, Any]:
    """The typed fields of a commit marker (format version checked by the caller)."""
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: the commit marker is not a JSON object")
    check_digest(doc, where, _MARKER_FIELDS)
    out: dict[str, Any] = {}
    generation = doc.get("generation", "")
    save_id = doc.get("save_id")
    time = doc.get("time", 0.0)
    tensors = doc.get("tensors", -1)
    ranks = doc.get("ranks", [])
    digest = doc.get("metadata_sha256")
    form = doc.get("form", "directory")
    refs_digest = doc.get("references_sha256")
    if not isinstance(generation, str):
        raise fail(where, "generation", "a string", generation)
    if (save_id is not None and not isinstance(save_id, str | int)) or isinstance(save_id, bool):
        raise fail(where, "save_id", "a string or null", save_id)
    if isinstance(time, bool) or not isinstance(time, int | float):
        raise fail(where, "time", "a number", time)
    if not is_int(tensors) or tensors < -1:
        raise fail(where, "tensors", "an int >= 0", tensors)
    if digest is not None and (not isinstance(digest, str) or not _HEX64.fullmatch(digest)):
        raise fail(where, "metadata_sha256", "64 lowercase hex digits", digest)
    if not isinstance(form, str):
        raise fail(where, "form", "a string", form)
    if refs_digest is not None and (not isinstance(refs_digest, str) or not _HEX64.fullmatch(refs_digest)):
        raise fail(where, "references_sha256", "64 lowercase hex digits", refs_digest)
    seal: tuple[Any, Any] = (doc.get("summary_bytes"), doc.get("summary_sha256"))
    if seal != (None, None) and not (is_int(seal[0]) and seal[0] >= 1 and isinstance(seal[1], str)
                                     and _HEX64.fullmatch(seal[1])):
        raise fail(where, "summary_bytes/summary_sha256", "an int >= 1 and 64 lowercase hex digits, or absent",
                    list(seal))
    parquet = doc.get("parquet_sha256")
    if parquet is not None and (not isinstance(parquet, str) or not _HEX64.fullmatch(parquet) or form != "packed"):
        raise fail(where, "parquet_sha256", "64 lowercase hex digits (packed form only), or absent", parquet)
    locations = doc.get("locations")
    if locations not in (None, "ranks", "references") or (locations is not None and form != "packed"):
        raise fail(where, "locations", "'ranks' or 'references' (packed form only), or absent", locations)
    out.update(generation=generation, save_id=None if save_id is None else str(save_id), time=float(time),
               tensors=tensors, ranks=list(int_list(ranks, where, "ranks")), metadata_sha256=digest, form=form,
               references_sha256=refs_digest, locations=locations, summary_bytes=seal[0], summary_sha256=seal[1],
               parquet_sha256=parquet)
    return out


# ---------------------------------------------------------------- manifest
_MANIFEST_TENSOR = {"dtype", "chunk", "shard", "checksums", "compressor", "layout"}


def check_manifest(doc: Any, where: str) -> dict[str, Any]:
    """A rank's manifest, typed: ``rank``, ``save_id``, ``expected_ranks``, ``tensors``, ``leaves``.

    ``tensors`` is inline (checked with :func:`check_tensors`), or, in a packed
    data object's trailer, a separate document named by ``tensors_sha256`` that
    the caller reads, checks and attaches (ranks that agree write identical
    bytes: it is parsed and checked once per distinct document, not per rank).
    """
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: a manifest must be a JSON object, got {type(doc).__name__}")
    check_digest(doc, where, _MANIFEST_FIELDS)
    rank, expected = get(doc, "rank", where), get(doc, "expected_ranks", where)
    if not is_int(rank) or rank < 0:
        raise fail(where, "rank", "an int >= 0", rank)
    int_list(expected, where, "expected_ranks")
    save_id = doc.get("save_id")
    if save_id is not None and not isinstance(save_id, str):
        raise fail(where, "save_id", "a string", save_id)
    fence = doc.get("fence")  # the writing job's fencing token (reshard.store.commit.fence); absent before
    if fence is not None and (not is_int(fence) or fence < 1):
        raise fail(where, "fence", "an int >= 1", fence)
    leaves = get(doc, "leaves", where)
    if not isinstance(leaves, dict):
        raise fail(where, "leaves", "an object", leaves)
    if "groups" in doc and "tensors" not in doc:  # a third-form trailer's (reshard.store.format.table)
        _check_groups(doc, where)
        return doc
    if "tensors_sha256" in doc and "tensors" not in doc:
        sha = doc["tensors_sha256"]
        if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
            raise fail(where, "tensors_sha256", "a sha256 hex digest", sha)
        return doc
    check_tensors(get(doc, "tensors", where), where)
    return doc


def _check_groups(doc: dict[str, Any], where: str) -> None:
    """``groups`` (``[[sha256, carrier rank, tensors], ...]``), ``carried`` (``[[sha256, length], ...]``) and
    ``table_sha256`` of a third-form trailer's manifest."""
    groups, carried, table = doc["groups"], doc.get("carried", []), doc.get("table_sha256")
    if type(groups) is not list or not all(
            type(g) is list and len(g) == 3 and isinstance(g[0], str) and _HEX64.fullmatch(g[0])
            and is_int(g[1]) and g[1] >= 0 and is_int(g[2]) and g[2] >= 0 for g in groups):
        raise fail(where, "groups", "a list of [sha256, carrier rank, tensors]", groups)
    if type(carried) is not list or not all(
            type(c) is list and len(c) == 2 and isinstance(c[0], str) and _HEX64.fullmatch(c[0])
            and is_int(c[1]) and c[1] >= 0 for c in carried):
        raise fail(where, "carried", "a list of [sha256, length]", carried)
    if not isinstance(table, str) or not _HEX64.fullmatch(table):
        raise fail(where, "table_sha256", "a sha256 hex digest", table)


def check_tensors(tensors: Any, where: str) -> dict[str, Any]:
    """A manifest's ``tensors`` object, typed: each entry's layout parsed, its chunk and shard checked
    against it (same number of dims; the chunk divides the shard)."""
    if not isinstance(tensors, dict):
        raise fail(where, "tensors", "an object", tensors)
    for name, t in tensors.items():
        at = f"{where}: tensor {name!r}"
        if not isinstance(t, dict) or not {"dtype", "chunk", "checksums", "compressor", "layout"} <= set(t):
            raise FormatError(f"{at}: entry must be an object with {sorted(_MANIFEST_TENSOR)}, got {t!r:.80}")
        dtype_of(t["dtype"], at, "dtype")
        layout = layout_of(t["layout"], at)
        ndim = len(layout.shape)
        chunk = int_list(t["chunk"], at, "chunk", minimum=1, length=ndim)
        if t.get("shard") is not None:
            shard = int_list(t["shard"], at, "shard", minimum=1, length=ndim)
            if any(s % c for s, c in zip(shard, chunk, strict=True)):
                raise FormatError(f"{at}: chunk {list(chunk)} does not divide shard {list(shard)}")
        if not isinstance(t["checksums"], bool):
            raise fail(at, "checksums", "true or false", t["checksums"])
        if t["compressor"] not in (None, "zstd"):
            raise fail(at, "compressor", "null or 'zstd'", t["compressor"])
    return tensors


# -------------------------------------------------------------------- root
def check_root(doc: Any, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A generation's root ``zarr.json``: its leaves and consolidated documents, typed.

    Checks the root is a zarr v3 group carrying ``attributes.reshard.leaves``
    and inline consolidated metadata; every entry is an object whose
    ``node_type`` is ``"array"`` or ``"group"``; every array's parents are
    groups listed there, and no array lies under another array. Array
    documents themselves are checked when their tensor is parsed
    (:func:`.schema_array.check_array`).
    """
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise FormatError(f"{where}: not a zarr v3 group document")
    try:
        leaves = doc["attributes"]["reshard"]["leaves"]
        docs = doc["consolidated_metadata"]["metadata"]
    except (KeyError, TypeError):
        raise FormatError(f"{where} lacks reshard's consolidated metadata") from None
    if not isinstance(leaves, dict) or not isinstance(docs, dict):
        raise FormatError(f"{where}: leaves and consolidated metadata must be JSON objects")
    for path, node in docs.items():
        kind = node.get("node_type") if type(node) is dict else None
        if kind != "array" and kind != "group":
            raise FormatError(f"{where}: consolidated entry {path!r} is not an array or group document "
                              f"(node_type {kind!r})")
        parent = path.rpartition("/")[0]
        if parent and (docs.get(parent) or {}).get("node_type") != "group":  # and so on up: every node is checked
            raise FormatError(f"{where}: {path!r} lies under {parent!r}, which is "
                              f"{'an array' if parent in docs else 'not listed as a group'}")
    return leaves, docs
