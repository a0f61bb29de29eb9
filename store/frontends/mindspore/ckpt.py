"""MindSpore's ``checkpoint.proto`` files (``.ckpt``), read and written without MindSpore.

``checkpoint.proto`` (proto2)::

    Checkpoint{ message Value{ required string tag=1;
                               oneof value{ TensorProto tensor=2; MapTensorProto maptensor=3; } }
                repeated Value value=1; }
    TensorProto{ repeated int64 dims=1; required string tensor_type=2; required bytes tensor_content=3; }

A ``.ckpt`` file is a concatenation of one-``Value`` ``Checkpoint`` messages
(one parse of the whole file works). ``dims == [0]`` is a scalar; a ``str``
value holds UTF-32 text; a tensor over 512 MiB (:data:`SLICE_BYTES`) is split
along axis 0 into consecutive Values with the same tag and the full dims. An
optional trailer ``b"crc_num"`` + a 10-byte big-endian crc32 of everything
before it may end the file. Files are memory-mapped and decoded zero-copy;
nothing is ever unpickled. Map tensors (``MapParameter``) are not decoded: their
header is ``((), "map")`` and reading one raises :class:`FormatError` naming the
file, unless the caller skips them (``skip_maps``; the import does when its
``skip`` allows, and records them).

MindSpore >= 2.4 also writes per-rank safetensors files
(``save_checkpoint(..., format="safetensors")``,
``transform_checkpoints(..., output_format="safetensors")``): a standard
safetensors file with ``{"format": "ms"}`` metadata, whose other entries are the
file's ``str`` values. :func:`file_headers`, :func:`read_file` and :func:`write_file`
handle either kind by the file's suffix.
"""

from __future__ import annotations

import builtins
import math
import mmap
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from reshard.layouts import _protowire as pw
from reshard.layouts.errors import ChecksumError, DTypeMismatchError, FormatError, ShapeMismatchError

from ...format.dtypes import SAFETENSORS_DTYPES, dtype_name, numpy_dtype
from ..huggingface.read import read_header

#: MindSpore ``tensor_type`` -> reshard dtype name.
TYPES = {
    "Int8": "int8", "UInt8": "uint8", "Int16": "int16", "UInt16": "uint16",
    "Int32": "int32", "UInt32": "uint32", "Int64": "int64", "UInt64": "uint64",
    "Float16": "float16", "Float32": "float32", "Float64": "float64",
    "Bool": "bool", "BFloat16": "bfloat16",
}
_MS_TYPES = {v: k for k, v in TYPES.items()}
#: MindSpore splits a tensor larger than this into several Values (``SLICE_SIZE``).
SLICE_BYTES = 512 << 20
_CRC = b"crc_num"

Header = tuple[tuple[int, ...], str]  # (shape, reshard dtype name, "str", or "map": a MapParameter, not decoded)
#: The header dtype of a map tensor (``MapParameter``), which reshard does not decode.
MAP = "map"


# ------------------------------------------------------------ .ckpt codec
def _map(path: str | os.PathLike[str]) -> memoryview:
    """The file's bytes, memory-mapped read-only (pages load only when touched)."""
    with builtins.open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def _strip_crc(data: memoryview, check: bool, what: str) -> memoryview:
    if len(data) < 17 or bytes(data[-17:-10]) != _CRC:
        return data
    body = data[:-17]
    if check:
        want = int.from_bytes(data[-10:], "big")
        got = zlib.crc32(body)
        if got != want:
            raise ChecksumError(f"{what}: crc32 {got:#010x} does not match the trailer's {want:#010x}")
    return body


def _values(data: memoryview, what: str) -> list[tuple[str, tuple[int, ...], str, memoryview]]:
    """``(tag, dims, tensor_type, content)`` of every Value, in file order (zero-copy); errors name ``what``."""
    try:
        return _parse_values(data, what)
    except FormatError as e:
        if str(e).startswith(f"{what}: "):
            raise
        raise FormatError(f"{what}: {e}") from None  # the wire codec's errors know no file


def _parse_values(data: memoryview, what: str) -> list[tuple[str, tuple[int, ...], str, memoryview]]:
    out: list[tuple[str, tuple[int, ...], str, memoryview]] = []
    for number, wire, value in pw.decode(data, copy=False):
        if number != 1 or wire != pw.LEN or isinstance(value, int):
            raise FormatError(f"{what}: not a MindSpore checkpoint (field {number}, wire type {wire})")
        f = pw.fields(value, copy=False)
        tag = pw.text(f.get(1, []), "tag")
        tensor = f.get(2)
        if not tensor or isinstance(tensor[-1][1], int):
            out.append((tag, (), MAP, memoryview(b"")))  # a MapParameter (maptensor, field 3)
            continue
        t = pw.fields(tensor[-1][1], copy=False)
        dims = tuple(pw.ints(t.get(1, [])))
        ttype = pw.text(t.get(2, []), "tensor_type")
        content = t.get(3, [(pw.LEN, b"")])[-1][1]
        out.append((tag, dims, ttype, memoryview(content if not isinstance(content, int) else b"")))
    return out


def _decode(tag: str, dims: tuple[int, ...], ttype: str, parts: list[memoryview], what: str) -> np.ndarray | str:
    nbytes = sum(len(p) for p in parts)
    if ttype == "str":
        raw = b"".join(bytes(p) for p in parts)
        return str(np.frombuffer(raw, f"<U{len(raw) // 4}")[0]) if len(raw) >= 4 else ""
    if ttype not in TYPES:
        raise DTypeMismatchError(f"{what}: {tag!r} has tensor_type {ttype!r}; known: {sorted(TYPES)} and 'str'")
    dtype = numpy_dtype(TYPES[ttype])
    count = nbytes // dtype.itemsize
    shape: tuple[int, ...] = () if dims == (0,) and count == 1 else dims
    if math.prod(shape) != count or nbytes % dtype.itemsize:
        raise ShapeMismatchError(f"{what}: {tag!r} has dims {list(dims)} but {nbytes} bytes of {ttype}")
    buf = parts[0] if len(parts) == 1 else memoryview(b"".join(parts))
    return np.frombuffer(buf, dtype).reshape(shape)


def parse_ckpt(data: bytes | memoryview, *, check_crc: bool = True, what: str = "checkpoint",
               skip_maps: bool = False) -> dict[str, Any]:
    """Every value of a MindSpore ``.ckpt`` file's bytes.

    Parameters
    ----------
    data : bytes or memoryview
        The whole file (a memory map is read zero-copy).
    check_crc : bool
        Check the ``crc_num`` trailer when there is one (it is always stripped).
    what : str
        Name used in error messages.
    skip_maps : bool
        Leave map tensors (``MapParameter``) out; else they raise :class:`FormatError`.

    Returns
    -------
    dict
        ``{tag: numpy array (read-only, over data) or str}`` in file order;
        split values are joined.

    Raises
    ------
    FormatError, ChecksumError, DTypeMismatchError, ShapeMismatchError
    """
    body = _strip_crc(memoryview(data).cast("B"), check_crc, what)
    grouped: dict[str, tuple[tuple[int, ...], str, list[memoryview]]] = {}
    for tag, dims, ttype, content in _values(body, what):
        if ttype == MAP:
            if skip_maps:
                continue
            raise FormatError(f"{what}: {tag!r} is a map tensor (MapParameter), which reshard does not decode")
        if tag in grouped:
            grouped[tag][2].append(content)
        else:
            grouped[tag] = (dims, ttype, [content])
    return {tag: _decode(tag, dims, ttype, parts, what) for tag, (dims, ttype, parts) in grouped.items()}


def read_ckpt(path: str | os.PathLike[str], *, check_crc: bool = True, skip_maps: bool = False) -> dict[str, Any]:
    """:func:`parse_ckpt` of a file, memory-mapped."""
    return parse_ckpt(_map(path), check_crc=check_crc, what=str(path), skip_maps=skip_maps)


def ckpt_headers(path: str | os.PathLike[str]) -> dict[str, Header]:
    """``{tag: (shape, dtype name or "str")}`` of a file, touching only its headers."""
    out: dict[str, Header] = {}
    data = _map(path)
    body = _strip_crc(data, False, str(path))
    sizes: dict[str, int] = {}
    for tag, dims, ttype, content in _values(body, str(path)):
        if ttype == MAP:
            out[tag] = ((), MAP)
            continue
        if ttype != "str" and ttype not in TYPES:
            raise DTypeMismatchError(f"{path}: {tag!r} has tensor_type {ttype!r}; known: {sorted(TYPES)} and 'str'")
        sizes[tag] = sizes.get(tag, 0) + len(content)
        itemsize = 4 if ttype == "str" else numpy_dtype(TYPES[ttype]).itemsize
        scalar = dims == (0,) and sizes[tag] == itemsize and ttype != "str"
        out[tag] = ((() if scalar or ttype == "str" else dims), "str" if ttype == "str" else TYPES[ttype])
    return out


def _header(tag: str, dims: Sequence[int], ttype: str, nbytes: int) -> bytes:
    """Bytes of a one-Value Checkpoint message up to (not including) its tensor_content."""
    tensor = pw.encode([*((1, d) for d in dims), (2, ttype)]) + pw.encode_varint(3 << 3 | pw.LEN)
    tensor += pw.encode_varint(nbytes)
    value = pw.encode([(1, tag)]) + pw.encode_varint(2 << 3 | pw.LEN) + pw.encode_varint(len(tensor) + nbytes)
    value += tensor
    return pw.encode_varint(1 << 3 | pw.LEN) + pw.encode_varint(len(value) + nbytes) + value


def write_ckpt(path: str | os.PathLike[str], values: Mapping[str, Any], *, crc: bool = False,
               slice_bytes: int = SLICE_BYTES) -> int:
    """Write a MindSpore ``.ckpt`` file, as ``mindspore.save_checkpoint`` does.

    Parameters
    ----------
    path : str or PathLike
        The file (its folder is created).
    values : mapping
        ``{tag: numpy array or str}``, written in order; a 0-d array gets
        ``dims=[0]``; ``str`` values are stored as UTF-32, like MindSpore.
    crc : bool
        Append the ``crc_num`` trailer (MindSpore >= 2.3 reads it; older
        versions do not understand it).
    slice_bytes : int
        Tensors larger than this are split along axis 0 into several Values.

    Returns
    -------
    int
        Bytes written.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    total = checksum = 0
    with builtins.open(path, "wb") as f:
        for tag, value in values.items():
            for head, content in _pieces(tag, value, slice_bytes):
                for chunk in (head, content):
                    f.write(chunk)
                    checksum = zlib.crc32(chunk, checksum)
                    total += len(chunk)
        if crc:
            f.write(_CRC + checksum.to_bytes(10, "big"))
            total += 17
    return total


def _pieces(tag: str, value: Any, slice_bytes: int) -> Iterable[tuple[bytes, memoryview]]:
    if isinstance(value, str):
        content = memoryview(np.array(value, dtype=f"<U{max(1, len(value))}").tobytes())  # UTF-32, as numpy
        yield _header(tag, [0], "str", len(content)), content
        return
    arr = np.asarray(value)
    arr = arr if arr.flags.c_contiguous else arr.copy()  # (ascontiguousarray would make a 0-d array 1-d)
    name = dtype_name(arr.dtype)
    if name not in _MS_TYPES:
        raise DTypeMismatchError(f"{tag!r}: dtype {name} has no MindSpore tensor_type; known: {sorted(_MS_TYPES)}")
    dims = list(arr.shape) or [0]
    parts = [arr]
    if arr.ndim and arr.nbytes > slice_bytes:
        parts = np.array_split(arr, math.ceil(arr.nbytes / slice_bytes), axis=0)
    for part in parts:
        content = np.ascontiguousarray(part).reshape(-1).view(np.uint8).data
        yield _header(tag, dims, _MS_TYPES[name], len(content)), content


# ------------------------------------------------------------ safetensors files (MindSpore >= 2.4)
SUFFIXES = (".ckpt", ".safetensors")
#: The ``__metadata__`` MindSpore writes in its safetensors files.
MS_METADATA = {"format": "ms"}


def is_safetensors(path: str | os.PathLike[str]) -> bool:
    """Whether a rank file is a safetensors file (by its suffix), not a ``.ckpt``."""
    return str(path).endswith(".safetensors")


def _strings(metadata: Mapping[str, str]) -> dict[str, str]:
    """A safetensors rank file's ``str`` values: its ``__metadata__`` but MindSpore's own ``format``."""
    return {k: v for k, v in metadata.items() if k not in MS_METADATA}


def file_headers(path: str | os.PathLike[str]) -> dict[str, Header]:
    """``{name: (shape, dtype name or "str")}`` of a ``.ckpt`` or ``.safetensors`` rank file, headers only."""
    if not is_safetensors(path):
        return ckpt_headers(path)
    header = read_header(path)
    strings: dict[str, Header] = {k: ((), "str") for k in _strings(header.metadata)}
    return {**{e.name: (e.shape, e.dtype) for e in header.entries}, **strings}


def read_file(path: str | os.PathLike[str], *, check_crc: bool = True, skip_maps: bool = False) -> dict[str, Any]:
    """Every value of a ``.ckpt`` or ``.safetensors`` rank file (memory-mapped, read-only arrays; see
    :func:`parse_ckpt` for ``skip_maps``)."""
    if not is_safetensors(path):
        return read_ckpt(path, check_crc=check_crc, skip_maps=skip_maps)
    data = _map(path)
    header = read_header(path)
    out: dict[str, Any] = {}
    for e in header.entries:
        out[e.name] = np.frombuffer(data[e.start:e.start + e.nbytes], numpy_dtype(e.dtype)).reshape(e.shape)
    return {**out, **_strings(header.metadata)}


def write_safetensors(path: str | os.PathLike[str], values: Mapping[str, Any],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Write ``{name: array}`` as one safetensors file, as MindSpore's ``format="safetensors"`` does.

    ``str`` values have no safetensors form and go into ``__metadata__``.
    Returns the bytes written.
    """
    import json

    arrays = {k: np.asarray(v) for k, v in values.items() if not isinstance(v, str)}
    meta = {**MS_METADATA, **(metadata or {}), **{k: v for k, v in values.items() if isinstance(v, str)}}
    doc: dict[str, Any] = {"__metadata__": meta}
    pos = 0
    for name, arr in arrays.items():
        dname = dtype_name(arr.dtype)
        if dname not in SAFETENSORS_DTYPES:
            raise DTypeMismatchError(f"{name!r}: dtype {dname} has no safetensors dtype")
        doc[name] = {"dtype": SAFETENSORS_DTYPES[dname], "shape": list(arr.shape),
                     "data_offsets": [pos, pos + arr.nbytes]}
        pos += arr.nbytes
    head = json.dumps(doc, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with builtins.open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for arr in arrays.values():
            f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
    return 8 + len(head) + pos


def write_file(path: str | os.PathLike[str], values: Mapping[str, Any], *, crc: bool = False) -> int:
    """:func:`write_safetensors` for a ``.safetensors`` path, else :func:`write_ckpt`."""
    if is_safetensors(path):
        return write_safetensors(path, values)
    return write_ckpt(path, values, crc=crc)


__all__ = ["MAP", "MS_METADATA", "SLICE_BYTES", "SUFFIXES", "TYPES", "Header", "ckpt_headers", "file_headers",
           "is_safetensors", "parse_ckpt", "read_ckpt", "read_file", "write_ckpt", "write_file",
           "write_safetensors"]
