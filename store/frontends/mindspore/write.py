"""MindSpore export: a reshard checkpoint -> per-rank ``.ckpt`` / ``.safetensors`` files for a target strategy."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from reshard.layouts import OPTIMIZER_PREFIXES, Layout, strategy_layouts
from reshard.layouts.errors import FormatError, LayoutError

from ...format.tree import flatten
from ...io.replace import replacing
from ...read.checkpoint import Checkpoint
from ...read.open import open
from .ckpt import (
    write_file,
)
from .files import StrategyLike, load_strategy


def export_mindspore(src_url: str | Checkpoint, dst_dir: str | os.PathLike[str], strategy: StrategyLike = None,
                     *, ranks: Iterable[int] | None = None, shapes: Mapping[str, Sequence[int]] | None = None,
                     file_name: str | None = None, format: str = "ckpt", crc: bool = False,
                     prefixes: Sequence[str] = OPTIMIZER_PREFIXES, storage_options: dict[str, Any] | None = None,
                     overwrite: bool = False) -> dict[int, Path]:
    """Write ``dst_dir/rank_M/checkpoint_M.ckpt`` for a target strategy, from a reshard checkpoint.

    Parameters
    ----------
    src_url : str or Checkpoint
        The checkpoint to divide.
    dst_dir : path
        Output folder, the export's unit: written beside it, then swapped in whole
        (:mod:`reshard.store.io.replace`), so a kill leaves the old export or the new one.
        With ``ranks``, each ``rank_M`` folder written is a unit of its own and other
        entries of ``dst_dir`` are left alone (an export split over hosts).
    strategy : path, bytes, dict, {name: Layout} or None
        The target strategy. Tensors it does not cover (directly or through
        their parameter, see :func:`layout_for`) go whole into every target
        rank's file. None: integration, one file with every tensor whole.
    ranks : iterable of int, optional
        Write only these ranks' files (default: every rank of the strategy).
    shapes : mapping, optional
        Global shapes for a protobuf strategy (default: the checkpoint's).
    file_name : str, optional
        File name in each folder; ``{rank}`` is replaced by the rank (default
        ``checkpoint_{rank}.ckpt``, or ``.safetensors``).
    format : {"ckpt", "safetensors"}
        ``.ckpt`` files (``checkpoint.proto``), or safetensors files as
        MindSpore >= 2.4 writes them (``{"format": "ms"}`` metadata; ``str``
        leaves go into the metadata).
    crc : bool
        Append MindSpore's ``crc_num`` trailer (``.ckpt`` only).
    prefixes : sequence of str
        Optimizer-state prefixes.
    storage_options : dict, optional
        fsspec options for ``src_url``.
    overwrite : bool
        Replace a ``dst_dir`` (with ``ranks``: ``rank_M`` folders) that is not empty (else
        :class:`~reshard.layouts.errors.CheckpointExistsError`, before anything is written).

    Returns
    -------
    dict of int to Path
        The file written for each rank.

    Notes
    -----
    Each rank reads only its own region of each tensor (one rank's pieces in
    memory at a time). Non-tensor leaves become 0-d tensors (int -> Int64,
    float -> Float32, bool -> Bool) or ``str`` values; others are skipped.
    """
    if format not in ("ckpt", "safetensors"):
        raise ValueError(f"format {format!r} must be 'ckpt' or 'safetensors'")
    file_name = file_name or f"checkpoint_{{rank}}.{format}"
    ckpt = src_url if isinstance(src_url, Checkpoint) else open(src_url, storage_options=storage_options)
    given = dict(shapes or {})
    given.update({n: m.shape for n, m in ckpt.arrays.items() if n not in given})
    try:
        strat = load_strategy(strategy, given)
    except FormatError as e:  # a strategy entry of no tensor the checkpoint holds, and no shape of its own
        if "; pass it in shapes" not in str(e):
            raise
        raise FormatError(f"{str(e).replace('; pass it in shapes', '')}, and {ckpt.url} holds no tensor of that "
                          "name: is the strategy this checkpoint's?") from None
    all_ranks = sorted(set().union(*(lay.ranks for lay in strat.values()))) if strat else [0]
    mapped = strategy_layouts(strat, {n: m.shape for n, m in ckpt.arrays.items()}, prefixes)
    targets = {name: mapped.get(name) or Layout(meta.shape, (len(all_ranks),), tuple(all_ranks))
               for name, meta in ckpt.arrays.items()}
    leaves = {n: _leaf(v) for n, v in ckpt.leaves.items()}
    chosen = sorted(ranks) if ranks is not None else all_ranks
    for rank in chosen:
        if rank not in all_ranks:
            raise LayoutError(f"rank {rank} is not in the target strategy's ranks {all_ranks[0]}..{all_ranks[-1]}")
    names = {rank: file_name.replace("{rank}", str(rank)) for rank in chosen}
    if format == "safetensors":
        names = {rank: str(Path(n).with_suffix(".safetensors")) if n.endswith(".ckpt") else n
                 for rank, n in names.items()}
    written = {rank: Path(dst_dir) / f"rank_{rank}" / names[rank] for rank in chosen}
    with contextlib.ExitStack() as stack:
        if ranks is None:  # the whole export: dst_dir is its unit, so old and new rank folders never mix
            staging = Path(stack.enter_context(replacing(os.fspath(dst_dir), overwrite=overwrite, folder=True)))
            staged = {rank: staging / f"rank_{rank}" for rank in chosen}
        else:  # some ranks (say, one host's): each rank folder is a unit, staged, then each swapped in whole
            staged = {rank: Path(stack.enter_context(replacing(os.fspath(path.parent), overwrite=overwrite,
                                                               folder=True))) for rank, path in written.items()}
        for rank in chosen:
            tensors, _ = flatten(ckpt.load(targets, rank, names=[n for n, t in targets.items() if rank in t.ranks]),
                                 ckpt.arrays)
            values = {**tensors, **{n: v for n, v in leaves.items() if v is not None}}
            staged[rank].mkdir(exist_ok=True)
            write_file(staged[rank] / names[rank], values, crc=crc)
    return written


def _leaf(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return np.array(value)
    if isinstance(value, int):
        return np.array(value, np.int64)
    if isinstance(value, float):
        return np.array(value, np.float32)
    return None
