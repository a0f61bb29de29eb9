"""OneFlow's own ``flow.save`` folders, read without OneFlow and without unpickling.

``flow.save(obj, path)`` (OneFlow 0.9) writes a folder::

    path/pickled_data          the object's structure, a pickle (protocol 4) whose
                               tensors are {"path": "tensor_N"} stand-ins
    path/tensor_N/meta         VariableMetaInfo in protobuf text form:
                               shape { dim: 5 dim: 4 } data_type: kFloat
    path/tensor_N/out          the tensor's bytes, C order, little-endian

Global tensors saved with ``global_dst_rank=r`` are written whole by rank r in
``global_tensor_<id>`` folders; the sharded save of seed 001 is one such folder
per rank of the model-file placement, each holding its ``to_local`` pieces.
Older OneFlow (and ``flow.save(graph)``) wrote no pickle: one ``<name>/meta`` +
``<name>/out`` folder per tensor, next to a ``snapshot_done`` marker.

Nothing is unpickled: ``pickled_data`` is read by :func:`decode_structure`, a
static reader of pickle opcodes (``pickletools.genops`` only parses them) that
understands exactly what ``flow.save`` writes for a state dict: dicts,
``collections.OrderedDict``, lists, tuples, strings, numbers, None, booleans,
and ``oneflow.Tensor`` / ``oneflow.nn.Parameter`` objects whose state is
``{"path": ...}``. Anything else (a pickled module, a numpy array, any other
class) is refused with :class:`~reshard.layouts.errors.FormatError` naming it:
it needs unpickling, which runs code. Tensor bytes are memory-mapped.
"""

from __future__ import annotations

import math
import pickletools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from reshard.layouts.errors import CheckpointNotFoundError, DTypeMismatchError, FormatError, ShapeMismatchError

from ...format.dtypes import numpy_dtype

PICKLE_FILE = "pickled_data"
META_FILE = "meta"
DATA_FILE = "out"
SNAPSHOT_DONE = "snapshot_done"
#: Largest ``pickled_data`` read: the structure of a state dict (names and nesting) of a million tensors.
MAX_PICKLE_BYTES = 256 << 20
#: Deepest nesting of the saved structure (state dicts of state dicts, lists of param groups...).
MAX_DEPTH = 64
#: Largest tensor ``meta`` read (a shape and a dtype in protobuf text).
MAX_META_BYTES = 1 << 20

#: OneFlow ``DataType`` (oneflow/core/common/data_type.proto) -> reshard dtype name.
DATA_TYPES = {
    "kChar": "int8", "kFloat": "float32", "kDouble": "float64", "kInt8": "int8", "kInt32": "int32",
    "kInt64": "int64", "kUInt8": "uint8", "kFloat16": "float16", "kBFloat16": "bfloat16", "kBool": "bool",
    "kUInt16": "uint16", "kUInt32": "uint32", "kUInt64": "uint64", "kInt16": "int16",
}
#: Classes ``flow.save`` pickles for tensors; their state is ``{"path": folder}``.
TENSOR_CLASSES = {("oneflow", "Tensor"), ("oneflow.nn", "Parameter"), ("oneflow.framework.tensor", "Tensor"),
                  ("oneflow.nn.parameter", "Parameter")}
_DICT_CLASSES = {("collections", "OrderedDict")}


class TensorRef:
    """A tensor of ``pickled_data``: the folder (relative to the save) holding its meta and out."""

    def __init__(self, cls: tuple[str, str]) -> None:
        self.cls = cls
        self.path: str | None = None

    def __repr__(self) -> str:
        return f"TensorRef({self.path!r})"


class _Global:
    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


class _Mark:
    pass


_MARK = _Mark()


def _refuse(what: str, detail: str) -> FormatError:
    return FormatError(f"{what}: {detail}; reshard reads flow.save state dicts (dicts of tensors and plain values) "
                       "and never unpickles (it runs code). Save model.state_dict(), not the module or other objects")


def decode_structure(data: bytes, what: str = PICKLE_FILE) -> Any:
    """The object ``flow.save`` pickled into ``pickled_data``, decoded without unpickling.

    Parameters
    ----------
    data : bytes
        The ``pickled_data`` file.
    what : str
        Name used in error messages.

    Returns
    -------
    Any
        ``obj["data"]`` of ``{"protocol_version": 1, "data": obj}``: nested dicts,
        lists and plain values, with :class:`TensorRef` for every tensor.

    Raises
    ------
    FormatError
        Any class other than OrderedDict and OneFlow's tensors (named), any
        opcode outside the subset ``flow.save`` uses, or a wrong protocol version.
    """
    try:
        ops = list(pickletools.genops(data))
    except Exception as e:
        raise FormatError(f"{what}: not a pickle written by flow.save ({e})") from None
    try:
        result = _run(ops, what)
    except FormatError:
        raise
    except Exception as e:  # a hostile pickle may break the decoder in any way; each is the file's fault
        raise FormatError(f"{what}: malformed flow.save pickle ({type(e).__name__}: {e})") from None
    if not isinstance(result, dict) or "data" not in result:
        raise FormatError(f"{what}: not a flow.save pickle (no {{'protocol_version', 'data'}} dict)")
    if result.get("protocol_version") != 1:
        raise FormatError(f"{what}: flow.save protocol_version {result.get('protocol_version')!r}; reshard reads 1")
    return result["data"]


def _run(ops: list[Any], what: str) -> Any:
    """Run the whitelisted opcodes of :func:`decode_structure` on a stack; return what STOP pops."""
    stack: list[Any] = []
    memo: dict[int, Any] = {}

    def pop_mark() -> list[Any]:
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is _MARK:
                items = stack[i + 1:]
                del stack[i:]
                return items
        raise _refuse(what, "malformed pickle (no MARK)")

    result: Any = None
    for op, arg, _ in ops:
        name = op.name
        if name in ("PROTO", "FRAME"):
            continue
        if name == "STOP":
            result = stack.pop() if stack else None
            break
        if name == "MARK":
            stack.append(_MARK)
        elif name in ("EMPTY_DICT",):
            stack.append({})
        elif name in ("EMPTY_LIST",):
            stack.append([])
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = stack[-n:]
            del stack[-n:]
            stack.append(tuple(items))
        elif name == "TUPLE":
            stack.append(tuple(pop_mark()))
        elif name == "LIST":
            stack.append(pop_mark())
        elif name == "DICT":
            items = pop_mark()
            stack.append(dict(zip(items[::2], items[1::2], strict=True)))
        elif name == "APPEND":
            value = stack.pop()
            stack[-1].append(value)
        elif name == "APPENDS":
            items = pop_mark()
            stack[-1].extend(items)
        elif name == "SETITEM":
            value, key = stack.pop(), stack.pop()
            _setitem(stack[-1], key, value, what)
        elif name == "SETITEMS":
            items = pop_mark()
            for key, value in zip(items[::2], items[1::2], strict=True):
                _setitem(stack[-1], key, value, what)
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(str(arg))] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            if int(str(arg)) not in memo:
                raise _refuse(what, f"malformed pickle (memo {arg} unset)")
            stack.append(memo[int(str(arg))])
        elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
                      "SHORT_BINSTRING", "BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4",
                      "BINFLOAT", "FLOAT", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8"):
            stack.append(arg)
        elif name == "NONE":
            stack.append(None)
        elif name in ("NEWTRUE", "NEWFALSE"):
            stack.append(name == "NEWTRUE")
        elif name == "STACK_GLOBAL":
            attr, module = stack.pop(), stack.pop()
            stack.append(_Global(str(module), str(attr)))
        elif name == "GLOBAL":
            module, _, attr = str(arg).partition(" ")
            stack.append(_Global(module, attr))
        elif name in ("REDUCE", "NEWOBJ"):
            args, cls = stack.pop(), stack.pop()
            stack.append(_construct(cls, args, what))
        elif name == "BUILD":
            state = stack.pop()
            obj = stack[-1]
            if isinstance(obj, TensorRef):
                if not isinstance(state, Mapping) or not isinstance(state.get("path"), str):
                    keys = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
                    raise _refuse(what, f"a tensor saved in memory (state {keys}), not as a file")
                obj.path = state["path"]
            elif not isinstance(obj, dict):  # a dict's BUILD sets attributes (_metadata): no items
                raise _refuse(what, f"BUILD of {type(obj).__name__}")
        else:
            raise _refuse(what, f"pickle opcode {name} is outside what flow.save writes for a state dict")
    return result


def _setitem(target: Any, key: Any, value: Any, what: str) -> None:
    if not isinstance(target, dict):
        raise _refuse(what, f"items set on a {type(target).__name__}")
    target[key] = value


def _construct(cls: Any, args: Any, what: str) -> Any:
    if not isinstance(cls, _Global):
        raise _refuse(what, f"a call of {type(cls).__name__}")
    key = (cls.module, cls.name)
    if key in TENSOR_CLASSES and args == ():
        return TensorRef(key)
    if key in _DICT_CLASSES and args == ():
        return {}
    raise _refuse(what, f"it holds a pickled {cls} object")


# ------------------------------------------------------------ tensors
_DIM = re.compile(r"\bdim\s*:\s*(-?\d+)")
_DTYPE = re.compile(r"\bdata_type\s*:\s*(\w+)")


def read_meta(folder: Path) -> tuple[tuple[int, ...], str]:
    """``(shape, dtype name)`` of a tensor folder's ``meta`` (VariableMetaInfo, protobuf text form)."""
    path = folder / META_FILE
    if not path.is_file():
        raise FormatError(f"{folder}: no {META_FILE} file, so the tensor's shape and dtype are unknown")
    if path.stat().st_size > MAX_META_BYTES:
        raise FormatError(f"{path} is {path.stat().st_size} bytes, over the {MAX_META_BYTES}-byte limit of a "
                          "tensor's meta")
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: not protobuf text ({e})") from None
    shape_block = re.search(r"shape\s*\{([^}]*)\}", text)
    dtype = _DTYPE.search(text)
    if dtype is None:
        raise FormatError(f"{path}: no data_type in {text[:80]!r}")
    if dtype.group(1) not in DATA_TYPES:
        raise DTypeMismatchError(f"{path}: data_type {dtype.group(1)} is not one reshard reads ({sorted(DATA_TYPES)})")
    shape = tuple(int(d) for d in _DIM.findall(shape_block.group(1))) if shape_block else ()
    return shape, DATA_TYPES[dtype.group(1)]


def read_tensor(folder: Path, *, header_only: bool = False) -> np.ndarray:
    """One tensor folder (``meta`` + ``out``) as a read-only memory-mapped array.

    With ``header_only`` a zero-memory stand-in of the right shape and dtype.
    """
    shape, dtype_name = read_meta(folder)
    dtype = numpy_dtype(dtype_name)
    out = folder / DATA_FILE
    if not out.is_file():
        raise FormatError(f"{folder}: no {DATA_FILE} file")
    want = math.prod(shape) * dtype.itemsize  # Python ints: 2**32 x 2**32 does not wrap to 0
    size = out.stat().st_size
    if size != want:
        raise ShapeMismatchError(f"{out}: {size} bytes, but {list(shape)} of {dtype_name} is {want}")
    if header_only:
        return np.broadcast_to(np.zeros((), dtype), shape)
    if want == 0:
        return np.zeros(shape, dtype)
    return np.memmap(out, dtype=dtype.newbyteorder("<"), mode="r", shape=shape)


def is_flow_save(folder: str | Path) -> bool:
    """Whether ``folder`` looks like ``flow.save`` output (a pickled_data file, or legacy tensor folders)."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    return (folder / PICKLE_FILE).is_file() or (folder / SNAPSHOT_DONE).is_file() or any(
        (d / DATA_FILE).is_file() for d in folder.iterdir() if d.is_dir())


def load_flow_save(folder: str | Path, *, headers_only: bool = False) -> dict[str, Any]:
    """Read a ``flow.save`` folder into a nested state dict of numpy arrays and plain values.

    Parameters
    ----------
    folder : str or Path
        What ``flow.save(obj, folder)`` wrote (``obj`` a dict, possibly nested,
        of tensors and plain values), or a legacy folder of ``<name>/meta`` +
        ``<name>/out`` tensor folders.
    headers_only : bool
        Tensors become zero-memory stand-ins of the right shape and dtype.

    Returns
    -------
    dict
        The saved dict's structure; tensors are read-only memory-mapped arrays.

    Raises
    ------
    CheckpointNotFoundError
        No such folder, or nothing ``flow.save`` writes in it.
    FormatError
        A pickled object other than a state dict (named), or a broken tensor folder.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"{folder.absolute()}: no such flow.save folder")
    pickled = folder / PICKLE_FILE
    if not pickled.is_file():
        found = {d.name: read_tensor(d, header_only=headers_only)
                 for d in sorted(folder.iterdir()) if d.is_dir() and (d / DATA_FILE).is_file()}
        if not found:
            raise CheckpointNotFoundError(f"{folder.absolute()}: no {PICKLE_FILE} and no tensor folders "
                                          f"(<name>/{META_FILE} + <name>/{DATA_FILE}): not a flow.save folder")
        return found
    size = pickled.stat().st_size
    if size > MAX_PICKLE_BYTES:
        raise FormatError(f"{pickled} is {size} bytes, over the {MAX_PICKLE_BYTES}-byte limit of a state dict's "
                          "structure (its tensors are files of their own)")
    data = decode_structure(pickled.read_bytes(), str(pickled))
    if not isinstance(data, dict):
        raise FormatError(f"{pickled}: flow.save'd a {type(data).__name__}, not a dict of tensors")
    return _resolve(data, folder, headers_only)


def _resolve(value: Any, folder: Path, headers_only: bool, depth: int = 0) -> Any:
    """``value`` with every tensor read from its folder (``depth``: how deep in the saved structure)."""
    if depth > MAX_DEPTH:
        raise FormatError(f"{folder / PICKLE_FILE}: nested more than {MAX_DEPTH} levels deep: not a state dict")
    if isinstance(value, TensorRef):
        if value.path is None or Path(value.path).name != value.path or value.path in (".", ".."):
            raise FormatError(f"{folder / PICKLE_FILE}: tensor folder {value.path!r} is not a plain name")
        return read_tensor(folder / value.path, header_only=headers_only)
    if isinstance(value, dict):
        return {k: _resolve(v, folder, headers_only, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_resolve(v, folder, headers_only, depth + 1) for v in value)
    return value


__all__ = ["DATA_TYPES", "TENSOR_CLASSES", "TensorRef", "decode_structure", "is_flow_save", "load_flow_save",
           "read_meta", "read_tensor"]
