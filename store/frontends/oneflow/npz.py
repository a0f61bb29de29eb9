"""One rank's OneFlow state dict as plain numpy files: the input of ``reshard import oneflow``.

OneFlow's ``flow.save`` writes pickles, which reshard never reads (unpickling
runs code). In the OneFlow job, :func:`save_npz` writes a rank's local state
dict as ``tensors.npz`` (keys are the key paths joined by ``/``, so a module's
dotted keys stay whole) plus ``leaves.json``; :func:`load_npz` reads it back
with ``allow_pickle=False``. :func:`walk` is the state-dict traversal both
this module and :mod:`reshard.store.frontends.oneflow.placement` use.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from reshard.layouts.errors import BadNameError, CheckpointNotFoundError, FormatError

from ...format.tree import is_tensor

KeyPath = tuple[str, ...]


def key_str(key: Any, path: KeyPath) -> str:
    """A state dict key as a name component (ints as decimal strings); refuses empty or odd keys."""
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    if not isinstance(key, str) or not key:
        raise BadNameError(f"state dict key {key!r} under {'.'.join(path) or 'the root'!r} is empty or not a string")
    return key


def walk(state: Mapping[Any, Any], path: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """``(key path, value)`` of every tensor and leaf of a nested state dict, in order.

    Mappings nest; everything else (arrays, numbers, lists...) is a value.
    """
    for key, value in state.items():
        sub = (*path, key_str(key, path))
        if isinstance(value, Mapping):
            yield from walk(value, sub)
        else:
            yield sub, value


TENSORS_FILE = "tensors.npz"
LEAVES_FILE = "leaves.json"


def save_npz(state: Mapping[Any, Any], folder: str | Path) -> Path:
    """Write one rank's local state dict as ``folder/tensors.npz`` + ``folder/leaves.json``.

    Run it in the OneFlow job instead of ``flow.save`` (tensors with
    ``.numpy()`` are converted; key paths are joined with ``/`` so dotted keys
    stay as they are). ``reshard import oneflow`` reads these folders; numpy
    reads them with ``allow_pickle=False``.

    Parameters
    ----------
    state : mapping
        Nested state dict: arrays (numpy, or objects with ``.numpy()``) and
        JSON leaves.
    folder : str or Path
        Created if absent.

    Returns
    -------
    Path
        The folder.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    leaves: dict[str, Any] = {}
    for path, value in walk(state):
        if any("/" in p for p in path):
            raise BadNameError(f"key path {list(path)} holds '/', which save_npz uses to join keys")
        key = "/".join(path)
        if hasattr(value, "numpy") and not isinstance(value, np.ndarray):
            value = value.numpy()
        if is_tensor(value):
            arrays[key] = np.asarray(value)
        else:
            leaves[key] = value.item() if isinstance(value, np.generic) else value
    np.savez(folder / TENSORS_FILE, **arrays)  # type: ignore[arg-type]
    (folder / LEAVES_FILE).write_text(json.dumps(leaves))
    return folder


def load_npz(folder: str | Path, *, headers_only: bool = False) -> dict[str, Any]:
    """Read a :func:`save_npz` folder (or a bare ``.npz`` file) back into a nested state dict.

    Parameters
    ----------
    folder : str or Path
        The folder (every ``*.npz`` in it is read, plus ``leaves.json``) or one ``.npz`` file.
    headers_only : bool
        Read only the array headers: every tensor is then a zero-memory
        read-only stand-in of the right shape and dtype (for planning).

    Returns
    -------
    dict
        Keys split on ``/`` into nested dicts. Arrays are read with
        ``allow_pickle=False``: nothing in the files can run code.
    """
    folder = Path(folder)
    files = [folder] if folder.is_file() else sorted(folder.glob("*.npz"))
    if not files:
        raise CheckpointNotFoundError(f"{folder.absolute()}: no .npz file (write one with reshard's save_npz)")
    flat: dict[str, Any] = {}
    for f in files:
        with np.load(f, allow_pickle=False) as data:
            for key in data.files:
                try:
                    flat[key] = _npz_header(data, key) if headers_only else data[key]
                except (TypeError, ValueError) as e:  # object arrays: numpy refuses to unpickle them
                    raise FormatError(f"{f}: array {key!r}: {e}") from None
    if folder.is_dir() and (folder / LEAVES_FILE).exists():
        flat.update(json.loads((folder / LEAVES_FILE).read_text()))
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, last = key.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def _npz_header(data: Any, key: str) -> np.ndarray:
    with data.zip.open(f"{key}.npy") as fp:
        version = np.lib.format.read_magic(fp)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(fp)
    if dtype.hasobject:
        raise TypeError(f"{key!r} holds Python objects (pickles); reshard reads plain arrays only")
    return np.broadcast_to(np.zeros((), dtype), shape)


__all__ = ["KeyPath", "LEAVES_FILE", "TENSORS_FILE", "key_str", "load_npz", "save_npz", "walk"]
