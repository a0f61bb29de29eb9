"""A checkpoint's commit marker and its save generations: which generation readers use, and how to read it.

A save is a **generation**: every object it writes lives under ``url/<generation>/``
(``gen-<save_id>``); the marker ``url/.reshard/commit.json`` names the committed one
and the sha256 of its metadata (:mod:`.protocol` writes it, last).
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import asdict, dataclass
from typing import Any

from reshard.layouts.errors import (
    BadNameError,
    FormatError,
)

from ..format.consolidated import OLD_PACKED_ROOT_KEY, PACKED_ROOT_KEY, ROOT_KEY
from ..format.meta import (
    COMMIT_KEY,
    FORMAT_VERSION,
    escape_component,
)
from ..format.refs import FORMS
from ..format.schema import (
    MAX_DOCUMENT_BYTES,
    MAX_MARKER_BYTES,
    check_component,
    loads_json,
    marker_fields,
    with_digest,
)
from ..io.storage import Storage

#: The save_id of a save that names none.
DEFAULT_SAVE_ID = "0"
#: Generation folders are named ``gen-<escaped save_id>``.
GENERATION_PREFIX = "gen-"


def save_id_of(save_id: Any) -> str:
    """The save_id as stored: a non-empty string (ints, e.g. the step, become their decimal form)."""
    if save_id is None:
        return DEFAULT_SAVE_ID
    if isinstance(save_id, bool) or not isinstance(save_id, str | int):
        raise BadNameError(f"save_id must be a string or an int (e.g. the training step), got {save_id!r}")
    text = str(save_id)
    if not text:
        raise BadNameError("save_id must not be empty")
    return text


def generation_of(save_id: Any) -> str:
    """The folder of a save's generation: ``gen-<save_id>``, escaped like tensor names."""
    sid = save_id_of(save_id)
    generation = GENERATION_PREFIX + escape_component(sid, f"save_id {sid!r}")
    check_component(generation, f"save_id {sid[:40]!r}", "generation")
    return generation


# -------------------------------------------------------------------- marker
@dataclass(frozen=True)
class Marker:
    """The commit marker ``url/.reshard/commit.json``: which generation readers use.

    Format version 1 markers (data at the URL's root, no generation) read with
    ``generation=""`` and no metadata digest.
    """

    format_version: int
    generation: str
    save_id: str | None
    time: float
    tensors: int
    ranks: list[int]
    metadata_sha256: str | None = None
    form: str = "directory"
    #: Packed form: the sha256 of the generation's references file.
    references_sha256: str | None = None
    #: Packed form: where readers find shard locations: ``"ranks"`` (each in the manifest of the rank that wrote
    #: it) or ``"references"`` (the references file); the root ``zarr.json`` is then an object of its own.
    #: None: the directory form, or a packed save whose root document lives inside its references only.
    locations: str | None = None
    #: The root ``zarr.json``'s summary prefix: its length and sha256 (see
    #: :func:`reshard.store.format.consolidated.summary_seal`); None in markers written before it existed.
    summary_bytes: int | None = None
    summary_sha256: str | None = None
    #: Packed form with parquet references: the digest of the ``refs.parq`` files
    #: (:func:`reshard.store.format.parquet.digest`); None when the save has none.
    parquet_sha256: str | None = None

    @classmethod
    def parse(cls, url: str, raw: bytes) -> Marker:
        """Parse marker bytes; a :class:`FormatError` naming the file for anything malformed."""
        where = f"{url}/{COMMIT_KEY}"
        doc = loads_json(where, raw)
        if not isinstance(doc, dict):
            raise FormatError(f"{where}: the commit marker is not a JSON object")
        version = doc.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise FormatError(f"{where}: bad format_version {version!r}")
        if version > FORMAT_VERSION:
            raise FormatError(f"{url}: format version {version} is newer than this reshard ({FORMAT_VERSION}); "
                              "upgrade reshard")
        marker = cls(format_version=version, **marker_fields(doc, where))
        if version >= 2 and (not marker.generation.startswith(GENERATION_PREFIX) or "/" in marker.generation
                             or not isinstance(marker.metadata_sha256, str)):
            raise FormatError(f"{where}: malformed commit marker (generation {marker.generation!r}, "
                              f"metadata_sha256 {marker.metadata_sha256!r})")
        if marker.form not in FORMS or (marker.form == "packed" and not isinstance(marker.references_sha256, str)):
            raise FormatError(f"{where}: malformed commit marker (form {marker.form!r}, "
                              f"references_sha256 {marker.references_sha256!r})")
        return marker

    def to_json(self) -> bytes:
        """The marker's bytes, with the sha256 of its own canonical JSON (any edit is detected).

        ``references_sha256`` is left out of directory-form markers (it has nothing to name), and the
        optional fields when unset.
        """
        optional = ("references_sha256", "locations", "summary_bytes", "summary_sha256", "parquet_sha256")
        doc = {k: v for k, v in asdict(self).items() if v is not None or k not in optional}
        return with_digest(doc)


def read_marker(root: Storage) -> tuple[Marker, bytes] | None:
    """The marker of the checkpoint at ``root`` and its raw bytes, or None if none is committed."""
    try:
        raw = root.read(COMMIT_KEY, limit=MAX_MARKER_BYTES)
    except FileNotFoundError:
        return None
    return Marker.parse(root.url, raw), raw


def generation_storage(root: Storage, marker: Marker) -> Storage:
    """Where the committed generation's objects live (the root itself for format version 1)."""
    return root.child(marker.generation) if marker.generation else root


def root_document_keys(marker: Marker) -> tuple[str, ...]:
    """Where a committed generation's root document is, in the order to look: the directory form's
    ``zarr.json``; the packed form's own object (:data:`~reshard.store.format.consolidated.PACKED_ROOT_KEY`),
    then where saves before 2026-11-27 kept it (a ``zarr.json`` that plain zarr opened as a hierarchy without
    chunks). Packed saves whose marker has no ``locations`` keep it inside their references only."""
    return (PACKED_ROOT_KEY, OLD_PACKED_ROOT_KEY) if marker.form == "packed" else (ROOT_KEY,)


def read_root_document(gen: Storage, marker: Marker) -> tuple[str, bytes]:
    """The committed generation's root document: its key and its bytes (unchecked: see ``metadata_sha256``).

    Raises
    ------
    FileNotFoundError
        If it is at none of :func:`root_document_keys`.
    """
    keys = root_document_keys(marker)
    for key in keys[:-1]:
        with contextlib.suppress(FileNotFoundError):
            return key, gen.read(key, limit=MAX_DOCUMENT_BYTES)
    return keys[-1], gen.read(keys[-1], limit=MAX_DOCUMENT_BYTES)


def metadata_digest(raw: bytes) -> str:
    """The digest of a generation's root ``zarr.json`` recorded in its marker."""
    return hashlib.sha256(raw).hexdigest()


def read_json(storage: Storage, key: str) -> Any:
    return loads_json(f"{storage.url}/{key}", storage.read(key))
