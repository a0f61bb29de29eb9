"""The root ``zarr.json`` of a save: consolidated metadata plus reshard's compact summary.

The root document is a zarr v3 group whose ``consolidated_metadata`` holds every
array's and group's ``zarr.json`` (zarr-python's ``open_consolidated`` reads it).
For 5,000 tensors that is megabytes of JSON, and parsing it all is most of the
cost of opening. So the document starts with reshard's attributes, which carry a
compact summary of every array, ``attributes.reshard.arrays = {name: [shape,
dtype]}``, and :func:`parse_root` decodes only that prefix: opening a
checkpoint costs the summary, not the metadata. The full documents are parsed
on first need (a tensor's layout, grid or codecs), once per checkpoint.

The bytes are exactly what the commit wrote (the marker records their sha256),
so the reader may rely on the key order :func:`root_document` writes; a root
document in any other shape (an older save, a tool that rewrote it) is read
by parsing it whole.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable
from typing import Any

from reshard.layouts.errors import FormatError

from .dtypes import SUPPORTED
from .meta import FORMAT_VERSION, META_DIR, ArrayMeta, dimension_names, group_json, stored_name, tensor_path
from .schema import check_root, dtype_of, int_list, loads_json

#: The root document of a directory-form save: the generation's ``zarr.json``, a real zarr hierarchy's root.
ROOT_KEY = "zarr.json"
#: The packed form's copy of its root document, an object of its own for ``open`` (the references hold it as
#: their ``zarr.json``). Not named ``zarr.json``: the packed generation's folder holds no chunk objects, so a
#: ``zarr.json`` there would make zarr-python open a hierarchy that reads every array as its fill value.
PACKED_ROOT_KEY = f"{META_DIR}/metadata.json"
#: Where packed saves committed before 2026-11-27 kept that copy (still read, after :data:`PACKED_ROOT_KEY`).
OLD_PACKED_ROOT_KEY = ROOT_KEY

#: How every root document written by :func:`root_document` begins.
_PREFIX = '{"zarr_format": 3, "node_type": "group", "attributes": '


def root_document(metas: dict[str, ArrayMeta], docs: dict[str, str], leaves: dict[str, Any]) -> bytes:
    """The root ``zarr.json`` bytes of a save.

    Parameters
    ----------
    metas : dict
        The arrays, by dotted name.
    docs : dict
        Every array's and group's ``zarr.json`` document as JSON text (``json.dumps``), by zarr path:
        spliced in as they are, not encoded a second time.
    leaves : dict
        The non-tensor leaves (JSON).
    """
    summary = {name: [list(m.shape), m.dtype] for name, m in sorted(metas.items())}
    rs: dict[str, Any] = {"format_version": FORMAT_VERSION, "leaves": leaves, "arrays": summary}
    rs.update(_records(metas, docs, list(summary)))
    head = json.dumps(group_json({"reshard": rs}))
    inline = ", ".join(f"{json.dumps(path)}: {text}" for path, text in sorted(docs.items()))
    # the text json.dumps gives the group with "consolidated_metadata" added last, built without re-encoding docs
    raw = (f'{head[:-1]}, "consolidated_metadata": {{"kind": "inline", "must_understand": false, '
           f'"metadata": {{{inline}}}}}}}').encode()
    assert raw.decode()[: len(_PREFIX)] == _PREFIX  # what parse_root relies on
    return raw


#: How an array document written by :meth:`ArrayMeta.to_zarr_json` ends: its dimension names, the only part that
#: names the tensor.
_NAMES = ', "dimension_names": '
#: The most distinct array documents the summary repeats (each ~1 KB, parsed at open); more: none repeated.
MAX_RECORDS = 256


def _records(metas: dict[str, ArrayMeta], docs: dict[str, str], names: list[str]) -> dict[str, Any]:
    """``records`` (the distinct array documents without their dimension names) and ``record_of`` (each
    tensor's index into them, in the summary's order), for the summary: a reader then resolves 10,000 tensors
    of a few shapes and layouts from those few documents, without parsing the ~1 KB of consolidated JSON each
    tensor has (issue 26: most of a rank's restore). Two keys of their own, which earlier readers ignore.
    Empty where there would be more than :data:`MAX_RECORDS`, or fewer than twice as many tensors (nothing
    repeats enough to pay for the copies)."""
    index: dict[str, int] = {}
    of: list[int] = []
    for name in names:
        text = docs[metas[name].path]
        cut = text.rfind(_NAMES)
        if cut < 0:
            return {}
        of.append(index.setdefault(text[:cut], len(index)))
        if len(index) > MAX_RECORDS:
            return {}
    if 2 * len(index) > len(names):
        return {}
    return {"records": [json.loads(key + "}") for key in index], "record_of": of}


def summary_seal(raw: bytes) -> dict[str, Any]:
    """The marker fields that seal a root document's summary: ``summary_bytes`` (the length of the prefix
    through its attributes, which hold the summary) and ``summary_sha256``; none for a document without one.

    With them a reader checks and parses that prefix alone at open (a small hash, not one of megabytes),
    and checks the whole document against ``metadata_sha256`` when it first needs a full record.
    """
    if not raw.startswith(_PREFIX.encode()):
        return {}
    try:  # json.dumps writes ASCII: character offsets are byte offsets
        _, end = json.JSONDecoder().raw_decode(raw.decode("ascii"), len(_PREFIX))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return {"summary_bytes": end, "summary_sha256": hashlib.sha256(raw[:end]).hexdigest()}


class RootMetadata:
    """A parsed root document: leaves and array summary now, full documents on demand.

    Parameters
    ----------
    where : str
        The document's URL (for messages).
    raw : bytes
        Its bytes, or only its sealed summary prefix (see :func:`summary_seal`) when ``whole`` is given.
    whole : callable, optional
        Returns the whole document, checked against its marker, on first need of a full record.
    """

    def __init__(self, where: str, raw: bytes, whole: Callable[[], bytes] | None = None) -> None:
        self.where = where
        self._whole = whole
        #: The distinct array documents without dimension names (:func:`_records`), each parsed once, and each
        #: tensor's index into them (both empty: the save has none).
        self.records: list[dict[str, Any]] = []
        self.record_of: dict[str, int] = {}
        self._parsed: dict[int, ArrayMeta] = {}
        if whole is None:
            self.raw = raw
        attrs: Any = None
        if raw.startswith(_PREFIX.encode()):
            try:
                attrs, _ = json.JSONDecoder().raw_decode(raw.decode(), len(_PREFIX))
            except (ValueError, UnicodeDecodeError, RecursionError):
                attrs = None
        rs = attrs.get("reshard") if isinstance(attrs, dict) else None
        if isinstance(rs, dict) and isinstance(rs.get("arrays"), dict) and isinstance(rs.get("leaves"), dict):
            #: The non-tensor leaves.
            self.leaves: dict[str, Any] = rs["leaves"]
            #: ``{name: [shape, dtype]}``, or None for a save written before the summary existed.
            self.summary: dict[str, Any] | None = rs["arrays"]
            records, of = rs.get("records", []), rs.get("record_of", [])
            if (type(records) is not list or not all(isinstance(r, dict) for r in records) or type(of) is not list
                    or len(of) not in (0, len(rs["arrays"])) or (of and not records)
                    or not all(type(i) is int and 0 <= i < len(records) for i in of)):
                raise FormatError(f"{where}: malformed summary records (a list of array documents and an index "
                                  "into it for every tensor expected)")
            self.records = records
            self.record_of = dict(zip(rs["arrays"], of, strict=False))
        else:  # no summary: the whole document, checked now
            self.leaves, _ = self.checked
            self.summary = None

    @functools.cached_property
    def raw(self) -> bytes:
        """The whole document (when given only its summary prefix: fetched and checked on first use)."""
        assert self._whole is not None
        return self._whole()

    @functools.cached_property
    def checked(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Leaves and every node's ``zarr.json`` by zarr path: the whole document parsed and checked
        (:func:`reshard.store.format.schema.check_root`) on first use, and its arrays matched with the summary."""
        leaves, docs = check_root(loads_json(self.where, self.raw), self.where)
        if self.__dict__.get("summary") is not None:
            listed = {tensor_path(n) for n in self.summary or {}}
            stored = {p for p, d in docs.items() if d["node_type"] == "array"}
            if listed != stored:
                odd = sorted(listed ^ stored)[:5]
                raise FormatError(f"{self.where}: the summary and the consolidated metadata list different arrays "
                                  f"(e.g. {odd})")
        return leaves, docs

    def documents(self) -> dict[str, Any]:
        """Every node's ``zarr.json`` by zarr path (parsed and checked on first call)."""
        return self.checked[1]

    def arrays(self) -> dict[str, ArrayMeta]:
        """Every array's record by dotted name, sorted.

        With a summary the records are lazy (name, shape and dtype now; the rest
        from the full documents on first use); without one they are built now.
        """
        if self.summary is None:
            found = {}
            for path, doc in self.documents().items():
                if doc["node_type"] == "array":
                    name = stored_name(path, self.where)
                    found[name] = ArrayMeta.from_zarr_json(name, doc, self.where)
                    found[name].validate()
            return dict(sorted(found.items()))
        out = {}
        for name, entry in self.summary.items():
            if type(entry) is not list or len(entry) != 2:
                raise FormatError(f"{self.where}: malformed summary of tensor {name!r}: {entry!r:.80}")
            shape, dtype = entry
            if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape) or dtype not in SUPPORTED:
                at = f"{self.where}: summary of tensor {name!r}"  # the checks again, to name what is wrong
                int_list(shape, at, "shape"), dtype_of(dtype, at, "dtype")
            out[name] = ArrayMeta.deferred(name, tuple(shape), dtype, functools.partial(self.array, name), self.where)
        return out

    def _record(self, name: str, index: int) -> dict[str, Any]:
        """A tensor's array document from the summary's records: its record, its dimension names."""
        shape = self.records[index].get("shape")
        return {**self.records[index], "dimension_names": dimension_names(name, len(shape) if type(shape) is list
                                                                            else 0)}

    def array(self, name: str) -> ArrayMeta:
        """The full record of one array: from the summary's records where it has them (each distinct one
        checked once), else from its consolidated document."""
        index = self.record_of.get(name)
        if index is not None:
            parsed = self._parsed.get(index)
            if parsed is None:
                parsed = self._parsed[index] = ArrayMeta.from_zarr_json(name, self._record(name, index), self.where)
            return dataclasses.replace(parsed, name=name) if parsed.name != name else parsed
        doc = self.documents().get(tensor_path(name))
        if not isinstance(doc, dict) or doc.get("node_type") != "array":
            raise FormatError(f"{self.where}: tensor {name!r} is in the summary but has no array metadata")
        return ArrayMeta.from_zarr_json(name, doc, self.where)
