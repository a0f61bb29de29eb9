"""A tiny, generic protobuf wire-format codec (no ``protobuf`` package needed).

Enough for MindSpore's ``node_strategy.proto`` and ``checkpoint.proto``:

* :func:`decode` turns bytes into ``(field, wire_type, value)`` triples;
  varints come back as unsigned ints, length-delimited fields as bytes (or
  zero-copy ``memoryview`` slices with ``copy=False``), fixed32/fixed64 as
  unsigned ints. Nested messages are decoded by calling :func:`decode` again.
* :func:`encode` writes ``(field, value)`` pairs in order: an ``int`` becomes a
  varint (negative ints as 10-byte two's complement, as protobuf writes int32
  and int64), ``bytes``/``str`` become length-delimited. proto2 repeated scalars
  are written unpacked (one pair per value), as protobuf does by default; use
  :func:`packed` for a ``[packed=true]`` field.
* :func:`ints` reads a repeated integer field whichever way it was written.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from .errors import FormatError

VARINT, I64, LEN, I32 = 0, 1, 2, 5
Value = int | bytes | memoryview
_MASK64 = (1 << 64) - 1


def encode_varint(value: int) -> bytes:
    """Varint of `value`; negatives are sign-extended to 64 bits (10 bytes)."""
    value &= _MASK64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise FormatError(f"protobuf data truncated inside a varint at byte {pos}")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result & _MASK64, pos
        shift += 7
        if shift >= 70:
            raise FormatError(f"protobuf varint longer than 10 bytes at byte {pos}")


def packed(values: Iterable[int]) -> bytes:
    """Payload of a packed repeated varint field (pass it to :func:`encode` as bytes)."""
    return b"".join(encode_varint(v) for v in values)


def encode(fields: Iterable[tuple[int, int | bytes | bytearray | memoryview | str]]) -> bytes:
    """Serialise ``(field number, value)`` pairs in the given order.

    Parameters
    ----------
    fields : iterable of (int, int or bytes or str)
        ``int`` -> varint (wire type 0); ``bytes``/``str`` (UTF-8) ->
        length-delimited (wire type 2), e.g. a nested message from another
        :func:`encode` call.

    Returns
    -------
    bytes
    """
    out = bytearray()
    for number, value in fields:
        if isinstance(value, int):
            out += encode_varint(number << 3 | VARINT)
            out += encode_varint(int(value))
        else:
            data = value.encode() if isinstance(value, str) else value
            out += encode_varint(number << 3 | LEN)
            out += encode_varint(len(data))
            out += data
    return bytes(out)


def decode(data: bytes | bytearray | memoryview, copy: bool = True) -> list[tuple[int, int, Value]]:
    """Parse one message level into ``(field number, wire type, value)`` triples.

    Raises
    ------
    FormatError
        Truncated data, a bad wire type or a field number 0.
    """
    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    out: list[tuple[int, int, Value]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise FormatError(f"protobuf field number 0 at byte {pos}")
        value: Value
        if wire == VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire == LEN:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise FormatError(f"protobuf field {number} wants {size} bytes, {len(buf) - pos} left")
            value = bytes(buf[pos : pos + size]) if copy else buf[pos : pos + size]
            pos += size
        elif wire in (I64, I32):
            width = 8 if wire == I64 else 4
            if pos + width > len(buf):
                raise FormatError(f"protobuf fixed field {number} truncated")
            value = int.from_bytes(buf[pos : pos + width], "little")
            pos += width
        else:
            raise FormatError(f"protobuf wire type {wire} (field {number}) is not supported")
        out.append((number, wire, value))
    return out


def fields(data: bytes | bytearray | memoryview, copy: bool = True) -> dict[int, list[tuple[int, Value]]]:
    """:func:`decode`, grouped by field number: ``{number: [(wire, value), ...]}``."""
    grouped: dict[int, list[tuple[int, Value]]] = defaultdict(list)
    for number, wire, value in decode(data, copy):
        grouped[number].append((wire, value))
    return dict(grouped)


def signed(value: int, bits: int = 64) -> int:
    """Two's complement reading of an unsigned varint (int32 and int64 fields)."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def ints(items: Iterable[tuple[int, Value]], is_signed: bool = True) -> list[int]:
    """Values of a repeated integer field, packed or not (``items`` from :func:`fields`)."""
    out: list[int] = []
    for wire, value in items:
        if wire == LEN:
            buf = memoryview(value).cast("B") if not isinstance(value, int) else memoryview(b"")
            pos = 0
            while pos < len(buf):
                v, pos = _read_varint(buf, pos)
                out.append(signed(v) if is_signed else v)
        elif wire == VARINT and isinstance(value, int):
            out.append(signed(value) if is_signed else value)
        else:
            raise FormatError(f"expected an integer field, got wire type {wire}")
    return out


def text(items: list[tuple[int, Value]], what: str) -> str:
    """The last value of a string field, decoded as UTF-8."""
    value = items[-1][1] if items else 0
    if isinstance(value, int):
        raise FormatError(f"protobuf string field {what!r} is missing or not length-delimited")
    try:
        return bytes(value).decode()
    except UnicodeDecodeError:
        raise FormatError(f"protobuf string field {what!r} is not UTF-8") from None
