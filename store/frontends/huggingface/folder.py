"""A Hugging Face model folder around its weights: the files kept with a checkpoint, and replacing a folder whole.

``from_pretrained`` needs more than the weights: ``config.json``,
``generation_config.json``, the tokenizer's files. :func:`collect_files` keeps
the small regular files beside the weights of an imported folder as the leaf
``"__files__"`` (a list of ``{"name", "sha256", "data"}``; ``data`` is stored as
bytes, never pickled), and :func:`write_files` writes them back on export after
checking each digest.

The export writes the folder through :func:`reshard.store.io.replace.replacing`,
which swaps it in whole when complete, so a folder never mixes the files of two
exports (``transformers`` would load whichever weights it finds).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from reshard.layouts.errors import FormatError

from ...format.tree import FILES_LEAF

#: The index file of a sharded folder, and its shards' names (as ``save_pretrained`` writes them).
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SHARD_NAME = "model-{k:05d}-of-{n:05d}.safetensors"

#: Files never kept: weights (of any framework) and safetensors indexes.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".ckpt",
                   ".h5", ".msgpack", ".onnx", ".gguf", ".npz")
#: Largest file kept, and largest total: configurations and tokenizers, not data.
MAX_FILE_BYTES = 32 * 2**20
MAX_TOTAL_BYTES = 64 * 2**20


def _keepable(name: str) -> bool:
    return not name.startswith(".") and not name.endswith(WEIGHT_SUFFIXES)


def collect_files(folder: str, fs: Any, path: str) -> list[dict[str, Any]]:
    """The regular files of a model folder other than weights, as the ``"__files__"`` leaf.

    ``fs``/``path``: the folder on an fsspec file system (``folder`` names it in
    messages). Links and subfolders are skipped; a file over
    :data:`MAX_FILE_BYTES`, or past :data:`MAX_TOTAL_BYTES` in all, is skipped
    with a warning naming it.
    """
    kept: list[dict[str, Any]] = []
    total = 0
    for info in sorted(fs.ls(path, detail=True), key=lambda i: str(i["name"])):
        name = PurePosixPath(str(info["name"])).name
        if info.get("type") != "file" or info.get("islink") or not _keepable(name):
            continue
        size = int(info.get("size") or 0)
        if size > MAX_FILE_BYTES or total + size > MAX_TOTAL_BYTES:
            warnings.warn(f"{folder}/{name} ({size} bytes) is not kept with the checkpoint: files beside the "
                          f"weights are kept up to {MAX_FILE_BYTES} bytes each, {MAX_TOTAL_BYTES} in all",
                          stacklevel=3)
            continue
        with fs.open(f"{path.rstrip('/')}/{name}", "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:  # grew since it was listed
            continue
        total += len(data)
        kept.append({"name": name, "sha256": hashlib.sha256(data).hexdigest(), "data": data})
    return kept


def kept_files(leaves: Mapping[str, Any], where: str) -> list[tuple[str, bytes]]:
    """``(name, bytes)`` of the ``"__files__"`` leaf, each name and digest checked.

    Raises
    ------
    FormatError
        A malformed entry, a name that is not a plain file name (or names a
        weight file), or bytes whose sha256 differs from the recorded one.
    """
    out = []
    for entry in leaves.get(FILES_LEAF) or []:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str) \
                or not isinstance(entry.get("data"), bytes) or not isinstance(entry.get("sha256"), str):
            raise FormatError(f"{where}: leaf {FILES_LEAF!r} holds a malformed entry")
        name, data = entry["name"], entry["data"]
        if PurePosixPath(name).name != name or name in ("", ".", "..") or "\\" in name or not _keepable(name):
            raise FormatError(f"{where}: leaf {FILES_LEAF!r} names {name!r}, which is not a plain non-weight file name")
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise FormatError(f"{where}: kept file {name!r} does not match its sha256")
        out.append((name, data))
    return out


def write_files(files: list[tuple[str, bytes]], folder: str) -> list[str]:
    """Write kept files into ``folder``; their paths."""
    paths = []
    for name, data in files:
        path = os.path.join(folder, name)
        with open(path, "wb") as f:
            f.write(data)
        paths.append(path)
    return paths
