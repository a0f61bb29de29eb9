"""TensorStore and zarr-python as alternative engines over the same files.

reshard's own reader (``engine="fast"``) is the default because it is several
times faster on the common case (see docs/performance.md). These engines read
(and, for the writer, write) the very same zarr v3 arrays through the general
libraries; the tests run every round trip through all of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from reshard.layouts.errors import FormatError

from .meta import ArrayMeta
from .refs import References

if TYPE_CHECKING:
    from ..io.storage import Storage
    from ..read.fetch import Fetcher

Region = tuple[slice, ...]


def kvstore_spec(storage: Storage, path: str) -> dict[str, Any]:
    """A TensorStore kvstore spec for ``path`` under a storage root."""
    proto = storage.fs.protocol if isinstance(storage.fs.protocol, str) else storage.fs.protocol[0]
    full = f"{storage.root}/{path}".lstrip("/") if not storage.local else f"{storage.root}/{path}"
    if storage.local:
        return {"driver": "file", "path": full}
    if proto in ("s3", "s3a"):
        bucket, _, key = full.partition("/")
        spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key + "/"}
        endpoint = (getattr(storage.fs, "client_kwargs", None) or {}).get("endpoint_url")
        if endpoint:
            spec["endpoint"] = endpoint
            spec["aws_region"] = "us-east-1"
        return spec
    if proto in ("gs", "gcs"):
        bucket, _, key = full.partition("/")
        return {"driver": "gcs", "bucket": bucket, "path": key + "/"}
    if proto in ("http", "https"):  # fsspec's HTTP roots keep their scheme (http://host/...)
        url = full if "://" in full else f"{proto}://{full}"
        return {"driver": "http", "base_url": url.rstrip("/") + "/"}
    raise FormatError(f"the tensorstore engine cannot reach {storage.url!r} ({proto}://); use engine='fast'")


def tensorstore_array(storage: Storage, meta: ArrayMeta, write: bool = False) -> Any:
    """Open one stored tensor with TensorStore (without touching its metadata on write).

    Raises
    ------
    FormatError
        For a tensor on a rectilinear chunk grid, which TensorStore's zarr3 driver cannot read.
    """
    if meta.edges is not None:
        raise FormatError(
            f"tensor {meta.name!r} of {storage.url}: its shards lie on zarr's rectilinear chunk grid (one shard per "
            "block of an uneven layout), which TensorStore cannot read or write; read it with engine='fast' (or "
            "zarr-python >= 3.2), or save with grid='regular' for TensorStore")
    import tensorstore as ts

    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": kvstore_spec(storage, meta.path)}
    if write:  # metadata is written at commit: write shards against the known metadata
        doc = meta.to_zarr_json()
        skip = ("zarr_format", "node_type", "storage_transformers")
        spec["metadata"] = {k: v for k, v in doc.items() if k not in skip}
        return ts.open(spec, write=True, assume_metadata=True).result()
    return ts.open(spec, read=True).result()


def references_store(root: Storage, refs: References) -> Any:
    """A read-only zarr store over a packed save's references (fsspec ``reference://``).

    fsspec gets the checked references (:func:`reshard.store.format.refs.parse`)
    with every url resolved against the checkpoint root
    (:meth:`~reshard.store.format.refs.References.document`), never the stored
    file: it requests nothing outside the checkpoint and its siblings' data objects.
    """
    import zarr

    options = dict(getattr(root.fs, "storage_options", None) or {})
    return zarr.storage.FsspecStore.from_url(
        "reference://", read_only=True,
        storage_options={"fo": refs.document(root.url, root.parent_url),
                         "remote_options": {**options, "asynchronous": True}, "target_options": options})


def directory_store(storage: Storage) -> Any:
    """A read-only zarr store over a directory-form save's folder."""
    import zarr

    if storage.local:
        return zarr.storage.LocalStore(storage.root, read_only=True)
    return zarr.storage.FsspecStore.from_url(storage.url, read_only=True,
                                             storage_options=getattr(storage.fs, "storage_options", None))


def zarr_array(storage: Storage, meta: ArrayMeta, fetcher: Fetcher) -> Any:
    """Open one stored tensor with zarr-python (read only); a packed save through its references.

    For a rectilinear tensor, call it inside :func:`zarr_config`.
    """
    import zarr

    return zarr.open_array(store=fetcher.general_store(), path=meta.path, mode="r")


@contextlib.contextmanager
def zarr_config(meta: ArrayMeta, url: str = "") -> Iterator[None]:
    """zarr-python's configuration for reading ``meta``'s array.

    A tensor on a rectilinear chunk grid needs zarr-python >= 3.2 and its
    ``array.rectilinear_chunks`` option (experimental there), turned on here.

    Raises
    ------
    FormatError
        For a rectilinear tensor with a zarr-python that cannot read it.
    """
    import zarr

    if meta.edges is None:
        yield
        return
    options = zarr.config.get("array", {})
    if not isinstance(options, dict) or "rectilinear_chunks" not in options:
        raise FormatError(
            f"tensor {meta.name!r}{' of ' + url if url else ''}: its shards lie on zarr's rectilinear chunk grid, "
            f"which zarr-python {zarr.__version__} cannot read (3.2 or newer can, on Python >= 3.12); "
            "read it with engine='fast'")
    with zarr.config.set({"array.rectilinear_chunks": True}):
        yield


def read_with_engine(ckpt: Fetcher, meta: ArrayMeta, region: Region) -> np.ndarray:
    """Read a region of a tensor with ``ckpt.engine`` (``"tensorstore"`` or ``"zarr"``)."""
    if ckpt.engine == "tensorstore":
        if ckpt.locator is not None:
            raise FormatError(f"{ckpt.url}: TensorStore reads the directory form only (its zarr3 driver cannot "
                              "follow byte-range references); convert with `reshard convert SRC DST --form "
                              "directory`, or use engine='fast' or 'zarr'")
        arr = tensorstore_array(ckpt.storage, meta)
        try:
            return np.asarray(arr[region].read().result())
        except ValueError as e:  # TensorStore's errors of malformed data
            raise FormatError(f"tensor {meta.name!r} of {ckpt.url}: TensorStore cannot read it: {e}") from None
    with zarr_config(meta, ckpt.url):
        try:
            return np.asarray(zarr_array(ckpt.storage, meta, ckpt)[region])
        except FileNotFoundError as e:  # fsspec's, for an object the references name
            raise FormatError(f"tensor {meta.name!r} of {ckpt.url}: {e.filename or e} is missing (deleted, or "
                              "the checkpoint was copied incompletely)") from None
        except (RuntimeError, ValueError) as e:  # zarr-python's codecs on malformed data (zstd, sizes)
            raise FormatError(f"tensor {meta.name!r} of {ckpt.url}: zarr-python cannot read it: {e}") from None


def write_with_tensorstore(storage: Storage, meta: ArrayMeta, region: Region, data: np.ndarray) -> None:
    """Write one rank's block through TensorStore (shard-aligned: one writer per shard)."""
    tensorstore_array(storage, meta, write=True)[region].write(data).result()
