"""A checkpoint -> a Hugging Face folder: ``model.safetensors``, or numbered shards and their index.

Each file is streamed by ``Checkpoint.export``; the folder's other files kept at
import are written back beside them (:mod:`.folder`), and the whole folder
replaces the target at once.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from reshard.layouts.errors import BadNameError, TensorNotFoundError
from reshard.layouts.views import View

from ...io.replace import replacing
from ...read.checkpoint import Checkpoint
from ...read.open import open as open_checkpoint
from .folder import INDEX_NAME, SHARD_NAME, SINGLE_NAME, kept_files, write_files

if TYPE_CHECKING:
    from ...io.stats import IOStats

#: Default shard size of :func:`export_safetensors`, as ``transformers`` (``save_pretrained``).
DEFAULT_SHARD_SIZE = "5GB"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, an int as is (``transformers``' units)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if not m:
            raise ValueError(f"size {size!r}: use bytes or a number with KB, MB, GB, KiB, MiB, GiB...")
        value = int(float(m.group(1)) * _UNITS[m.group(2)])
    if value <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return value


def plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Cut tensors, in order, into shards of at most ``max_bytes`` (a larger tensor is a shard alone)."""
    shards: list[list[str]] = []
    used = 0
    for name, nbytes in sizes:
        if not shards or (used + nbytes > max_bytes and shards[-1]):
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def export_safetensors(src: str | Checkpoint, folder: str | os.PathLike[str], *,
                       max_shard_size: int | str = DEFAULT_SHARD_SIZE, names: Iterable[str] | None = None,
                       metadata: Mapping[str, str] | None = None, storage_options: Mapping[str, Any] | None = None,
                       overwrite: bool = False, prefix: str = "", views: Mapping[str, View] | None = None,
                       files: Mapping[str, bytes] | None = None, **options: Any) -> dict[str, Any]:
    """Write a checkpoint as Hugging Face safetensors: one file, or shards and their index.

    Parameters
    ----------
    src : str or Checkpoint
        The checkpoint.
    folder : path
        Output folder. It gets ``model.safetensors`` when every tensor fits in
        one shard, else ``model-0000k-of-0000n.safetensors`` and
        ``model.safetensors.index.json`` (``metadata.total_size``,
        ``weight_map``), as ``transformers``' ``save_pretrained`` writes them,
        plus the files kept at import (``config.json``, tokenizer files...).
        Everything is written into a new folder beside it, which then replaces
        it whole (:mod:`reshard.store.io.replace`): the folder never mixes two
        exports, and a kill leaves the old folder or the new one.
    max_shard_size : int or str
        Largest shard (``"5GB"``, ``"500MiB"``, bytes); a tensor larger than
        this is a shard alone.
    names : iterable of str, optional
        The tensors to export, in this order (default: all, sorted by name).
    metadata : mapping of str to str, optional
        Extra ``__metadata__`` entries of every file (the imported
        ``"__metadata__"`` leaf is written back there too, as by ``Checkpoint.export``).
    storage_options : dict, optional
        fsspec options of ``src``.
    overwrite : bool
        Replace a folder that is not empty (else ``CheckpointExistsError``); an empty one is always replaced.
    prefix : str
        Export only the tensors whose names start with ``prefix``, named without it: ``"model."`` takes
        the model of a training checkpoint saved as ``{"model": ..., "optim": ...}`` and gives the names
        ``from_pretrained`` expects.
    views : mapping, optional
        Write these tensors instead of the stored ones: ``{name: View}``, each made of regions of stored
        tensors (:mod:`reshard.layouts.views`; e.g. :func:`reshard.layouts.megatron_hf.llama_views`), in
        this order; ``names`` and ``prefix`` are then not given.
    files : mapping of str to bytes, optional
        Files to write beside the weights (``{"config.json": ...}``), in place of kept files of those names.
    **options
        As for :func:`reshard.store.read.export.export` (``budget``, ``scheduler``...).

    Returns
    -------
    dict
        ``{"files": [paths], "index": path or None, "attached": [paths of kept files], "total_size": bytes,
        "stats": IOStats}``.
    """
    opts = dict(storage_options) if storage_options is not None else None
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(str(src), storage_options=opts)
    if views is not None:
        if names is not None or prefix:
            raise ValueError("views= gives the tensors and their names: names= and prefix= do not apply")
        return _write(ckpt, folder, list(views), {n: _view_bytes(ckpt, v) for n, v in views.items()},
                      max_shard_size, metadata, overwrite, "", dict(views), files, options)
    chosen = list(names) if names is not None else sorted(ckpt.arrays)
    if prefix:
        chosen = [n for n in chosen if n.startswith(prefix)]
        if not chosen:
            raise TensorNotFoundError(f"{ckpt.url} holds no tensor under {prefix!r}")
    for name in chosen:
        if name == "__metadata__":
            raise BadNameError("a tensor named '__metadata__' cannot be stored in safetensors")
        ckpt.tensor(name)  # a TensorNotFoundError (with close matches) for what is not a tensor
    return _write(ckpt, folder, chosen, {n: ckpt.arrays[n].nbytes for n in chosen}, max_shard_size, metadata,
                  overwrite, prefix, None, files, options)


def _view_bytes(ckpt: Checkpoint, view: View) -> int:
    dtypes = {ckpt.tensor(p.name).np_dtype.itemsize for p in view.pieces}
    return math.prod(view.shape) * (dtypes.pop() if len(dtypes) == 1 else 4)


def _write(ckpt: Checkpoint, folder: str | os.PathLike[str], chosen: list[str], sizes: dict[str, int],
           max_shard_size: int | str, metadata: Mapping[str, str] | None, overwrite: bool, prefix: str,
           views: dict[str, View] | None, files: Mapping[str, bytes] | None,
           options: dict[str, Any]) -> dict[str, Any]:
    rename = {n: n[len(prefix):] for n in chosen} if prefix else None
    shards = plan_shards(((n, sizes[n]) for n in chosen), parse_size(max_shard_size))
    extra = dict(files or {})
    kept = [(n, data) for n, data in kept_files(ckpt.leaves, ckpt.url) if n not in extra] + list(extra.items())
    out = os.fspath(folder)
    written, weight_map = [], {}
    total: IOStats | None = None
    with replacing(out, overwrite=overwrite, folder=True) as fresh:
        for k, part in enumerate(shards, 1):
            file = SINGLE_NAME if len(shards) == 1 else SHARD_NAME.format(k=k, n=len(shards))
            stats = ckpt.export(os.path.join(fresh, file), format="safetensors", names=part, metadata=metadata,
                                rename=rename, views=views, **options)
            total = stats if total is None else _add(total, stats)
            written.append(os.path.join(out, file))
            weight_map.update(dict.fromkeys((n[len(prefix):] for n in part), file))
        total_size = sum(sizes[n] for n in chosen)
        index = None
        if len(shards) > 1:
            index = os.path.join(out, INDEX_NAME)
            with open(os.path.join(fresh, INDEX_NAME), "w") as f:
                json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2,
                          sort_keys=True)
                f.write("\n")
        attached = [os.path.join(out, os.path.basename(p)) for p in write_files(kept, fresh)]
    return {"files": written, "index": index, "attached": attached, "total_size": total_size, "stats": total}


def _add(a: IOStats, b: IOStats) -> IOStats:
    a.add(**b.as_dict())
    return a


__all__ = ["DEFAULT_SHARD_SIZE", "export_safetensors", "parse_size", "plan_shards"]
