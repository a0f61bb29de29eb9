"""State dicts <-> flat ``{dotted name: value}`` mappings.

Nested mappings and dotted names address the same tensor: ``{"a": {"b": x}}``
and ``{"a.b": x}`` both give ``"a.b"``. Arrays (anything with ``__array__``,
``shape`` and ``dtype``) are tensors; everything else is a JSON leaf.

Bytes-like leaves (``bytes``, ``bytearray``, ``io.BytesIO``, alone or inside a
list or dict leaf) are stored as ``{"__reshard_bytes__": base64, "type": name}``
and come back as the type that was saved (:func:`from_json`). Nothing is ever
pickled: any other object is refused, naming the leaf.
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from reshard.layouts import Layout
from reshard.layouts.errors import BadNameError, LayoutError, ShapeMismatchError

LayoutSpec = Mapping[str, Layout] | Callable[[str, tuple[int, ...]], Layout]


def is_tensor(value: Any) -> bool:
    return isinstance(value, np.ndarray) or (
        not isinstance(value, np.generic)
        and hasattr(value, "__array__") and hasattr(value, "shape") and hasattr(value, "dtype")
    )


def flatten(state: Mapping[str, Any], tensor_names: Any = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a (nested) state dict into ``(tensors, leaves)``, both keyed by dotted name.

    A numpy scalar is a leaf unless its name is in ``tensor_names`` (a 0-d
    tensor's piece, e.g. ``arr[()]``).

    Raises
    ------
    BadNameError
        For non-string keys, empty names, or a name given twice.
    TypeError
        For a leaf that JSON cannot hold.
    """
    tensors: dict[str, Any] = {}
    leaves: dict[str, Any] = {}
    _walk(state, "", tensors, leaves, tensor_names)
    return tensors, leaves


def _walk(node: Mapping[str, Any], prefix: str, tensors: dict[str, Any], leaves: dict[str, Any],
          tensor_names: Any) -> None:
    for key, value in node.items():
        if isinstance(key, int) and not isinstance(key, bool):
            key = str(key)
        if not isinstance(key, str) or not key:
            raise BadNameError(
                f"state dict key {key!r} under {prefix or 'the root'!r} is empty or not a string"
            )
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping) and not _is_bytes(value):
            _walk(value, name, tensors, leaves, tensor_names)
            continue
        if name in tensors or name in leaves:
            raise BadNameError(f"name {name!r} is given twice (nested and dotted)")
        if is_tensor(value) or (isinstance(value, np.generic) and name in tensor_names):
            tensors[name] = np.asarray(value) if isinstance(value, np.generic) else value
        else:
            leaves[name] = to_json(value, name)


#: The key of a stored bytes-like leaf, and the types it gives back.
BYTES_TAG = "__reshard_bytes__"
_BYTES_TYPES: dict[str, Callable[[bytes], Any]] = {"bytes": bytes, "bytearray": bytearray, "BytesIO": io.BytesIO}


def to_json(value: Any, name: str) -> Any:
    """A JSON-safe copy of a leaf: numpy scalars become Python numbers, bytes-like values tagged base64.

    Idempotent: a value this returned comes back unchanged.

    Raises
    ------
    TypeError
        For a value JSON cannot hold (naming the leaf and what to store instead).
    """
    value = _encode(value)
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"leaf {name!r} of type {type(value).__name__} is not JSON ({e}): store it as JSON values "
            "(numbers, strings, lists, dicts), bytes or io.BytesIO, or an array; reshard never pickles") from None
    return value


#: The leaf where an import records what it left out, undecoded (``[{"name", "what", "why"}, ...]``; see
#: :class:`reshard.store.frontends.sources.Skips`); ``reshard inspect`` shows it.
SKIPPED_LEAF = "reshard.skipped"
#: The leaf where an import records the save it read: ``{"format": "DCP", "ranks": <ranks that wrote its data>}``.
#: The layouts of an import number the saved pieces (a rank may have saved several, e.g. flat optimizer
#: ranges), so ``reshard inspect`` shows the job's ranks from here (:func:`reshard.store.read.display.saved_by`).
SOURCE_LEAF = "reshard.source"
#: Leaves of an imported Hugging Face folder: its files' ``__metadata__``, and the files kept beside the
#: weights (:mod:`reshard.store.frontends.huggingface.folder`). safetensors exports write them back as such.
METADATA_LEAF = "__metadata__"
FILES_LEAF = "__files__"


def json_leaves(leaves: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: to_json(value)}``: leaves as they are stored (what every JSON document of a save holds)."""
    return {name: to_json(value, name) for name, value in leaves.items()}


def _encode(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (bytes, bytearray, io.BytesIO)):
        raw = value.getvalue() if isinstance(value, io.BytesIO) else bytes(value)
        return {BYTES_TAG: base64.b64encode(raw).decode("ascii"), "type": type(value).__name__}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


def _is_bytes(value: Mapping[str, Any]) -> bool:
    return set(value) == {BYTES_TAG, "type"} and value["type"] in _BYTES_TYPES and isinstance(value[BYTES_TAG], str)


def from_json(value: Any) -> Any:
    """A leaf as it was saved: the inverse of :func:`to_json` for bytes-like values (others unchanged)."""
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if _is_bytes(value):
            return _BYTES_TYPES[value["type"]](base64.b64decode(value[BYTES_TAG], validate=True))
        return {k: from_json(v) for k, v in value.items()}
    return value


def unflatten(flat: Mapping[str, Any], paths: Mapping[str, Sequence[str]] | None = None) -> dict[str, Any]:
    """Nest a ``{dotted name: value}`` mapping back into dicts.

    ``paths`` gives some names' key paths explicitly (keys that contain dots,
    e.g. ``["module_pipeline", "m_stage3.linear.weight"]``); other names split
    at every dot.
    """
    out: dict[str, Any] = {}
    for name, value in flat.items():
        node = out
        *parents, last = (paths or {}).get(name) or name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise BadNameError(f"{name!r} lies under {p!r}, which is a tensor or leaf")
        node[last] = value
    return out


def resolve_layout(layouts: LayoutSpec, name: str, shape: tuple[int, ...] | None) -> Layout:
    """The layout of one tensor, from a mapping or a ``(name, shape) -> Layout`` rule."""
    if isinstance(layouts, Mapping):
        if name in layouts:
            layout = layouts[name]
        else:
            raise LayoutError(f"no layout given for tensor {name!r}")
    elif callable(layouts):
        if shape is None:
            raise LayoutError(
                f"layouts is a rule (callable): the global shape of {name!r} is needed; "
                "pass shapes= when writing per-rank pieces"
            )
        layout = layouts(name, tuple(shape))
    else:
        raise LayoutError(f"layouts must be a mapping or a callable, got {type(layouts).__name__}")
    if not isinstance(layout, Layout):
        raise LayoutError(f"layout for {name!r} is a {type(layout).__name__}, not a Layout")
    if shape is not None and tuple(layout.shape) != tuple(shape):
        raise ShapeMismatchError(
            f"tensor {name!r}: layout is for shape {tuple(layout.shape)} but the tensor is {tuple(shape)}"
        )
    return layout


def nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def suggest(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'x' or 'y'?"`` for the close matches of a mistyped name, else ``""``."""
    import difflib

    known = list(known)
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    if not close:  # the same last component elsewhere in the tree (``layers.0.w`` for ``0.w``)
        last = name.rsplit(".", 1)[-1]
        close = [k for k in known if k.rsplit(".", 1)[-1] == last][:3]
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
