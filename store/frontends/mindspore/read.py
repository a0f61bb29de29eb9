"""MindSpore import: per-rank ``.ckpt`` / ``.safetensors`` files and a strategy -> a reshard checkpoint."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from reshard.layouts import OPTIMIZER_PREFIXES, Layout, layout_for, parse_strategy
from reshard.layouts.errors import (
    DTypeMismatchError,
    FormatError,
    ShapeMismatchError,
)

from ...format.dtypes import numpy_dtype
from ...read.checkpoint import Checkpoint
from ...read.open import open
from ...write.writer import create, single_process
from ..sources import refuse_empty
from .ckpt import (
    Header,
    file_headers,
    read_file,
)
from .files import StrategyLike, infer_shapes, load_strategy, rank_files


def _replicated(holders: Mapping[int, Header], name: str) -> Layout:
    shapes = {h[0] for h in holders.values()}
    if len(shapes) != 1:
        raise ShapeMismatchError(f"{name!r} is not in the strategy and its ranks hold different shapes "
                                 f"{ {r: list(h[0]) for r, h in sorted(holders.items())} }")
    ranks = tuple(sorted(holders))
    return Layout(shapes.pop(), (len(ranks),), ranks)


def _fits(layout: Layout, holders: Mapping[int, Header]) -> bool:
    return all(r in layout.ranks and layout.local_shape(r) == shape for r, (shape, _) in holders.items())


def _choose(name: str, strat: Layout | None, holders: Mapping[int, Header]) -> Layout:
    """The saving layout that explains every holder's local shape.

    Tried in order: the strategy's layout; the same without optimizer
    sharding (an aggregated save); whole copies (an integrated save).
    """
    candidates = []
    if strat is not None:
        candidates.append(strat)
        if strat.opt_shard is not None:
            origin = {**(strat.origin or {}), "opt_shard_size": 0}
            candidates.append(dataclasses.replace(strat, opt_shard=None, origin=origin))
    for layout in candidates:
        if _fits(layout, holders):
            return layout
    if strat is not None and {h[0] for h in holders.values()} != {tuple(strat.shape)}:
        r, (shape, _) = min(holders.items())
        want = strat.local_shape(r) if r in strat.ranks else "nothing (not among its ranks)"
        raise ShapeMismatchError(f"{name!r}: rank {r}'s file holds shape {list(shape)}, "
                                 f"strategy {strat.describe()} of shape {list(strat.shape)} gives it {want}")
    return _replicated(holders, name)


def _placeholder(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A zero-memory stand-in for a replica's piece: the writer skips replicas but checks shapes."""
    return np.broadcast_to(np.zeros((), numpy_dtype(dtype)), shape)


def import_mindspore(src_dir: str | os.PathLike[str] | Mapping[int, Any], dst_url: str, strategy: StrategyLike,
                     *, shapes: Mapping[str, Sequence[int]] | None = None, file_name: str | None = None,
                     check_crc: bool = True, prefixes: Sequence[str] = OPTIMIZER_PREFIXES,
                     **options: Any) -> Checkpoint:
    """Integrate MindSpore's per-rank checkpoint files into one reshard checkpoint.

    Parameters
    ----------
    src_dir : path or mapping
        Folder of ``rank_N/*.ckpt`` (or ``*.safetensors``) files, a
        single-device folder or file, or ``{rank: path}``; see :func:`rank_files`.
    dst_url : str
        Where the checkpoint goes (local path or fsspec URL).
    strategy : path, bytes, dict, {name: Layout} or None
        The training strategy file (protobuf or JSON, pipeline-merged if
        pipelined). None: every file holds whole tensors.
    shapes : mapping, optional
        Global shapes for a protobuf strategy (inferred from the files if absent).
    file_name : str, optional
        See :func:`rank_files`.
    check_crc : bool
        Check the crc trailer of every file whose data is read.
    prefixes : sequence of str
        Optimizer-state prefixes; see :func:`layout_for`.
    **options
        As for :func:`reshard.store.create` (``overwrite``, ``compression``...).

    Returns
    -------
    Checkpoint
        The new checkpoint, opened.

    Notes
    -----
    Every file's headers are scanned first (nothing is written if anything
    disagrees); then the ranks are written one at a time, each file memory
    mapped while its rank writes. Each block is read once, from the first
    replica (in replica order) whose file holds the tensor: with
    ``remove_redundancy=True`` MindSpore saves each block in one replica's file
    only, and any replica's file may lack it or be missing.
    """
    files = rank_files(src_dir, file_name)
    headers = {r: file_headers(p) for r, p in sorted(files.items())}
    try:
        layouts = load_strategy(strategy, shapes)
    except FormatError as e:
        if "shape" not in str(e) or not isinstance(strategy, (str, os.PathLike, bytes)):
            raise
        data = Path(strategy).read_bytes() if not isinstance(strategy, bytes) else strategy
        layouts = parse_strategy(data, {**infer_shapes(data, headers), **(shapes or {})})
    holders: dict[str, dict[int, Header]] = {}
    for rank, h in headers.items():
        for tag, head in h.items():
            if head[1] != "str":
                holders.setdefault(tag, {})[rank] = head
    chosen: dict[str, Layout] = {}
    dtypes: dict[str, str] = {}
    donors: dict[str, dict[int, int]] = {}
    for name, held in holders.items():
        kinds = {h[1] for h in held.values()}
        if len(kinds) != 1:
            raise DTypeMismatchError(f"{name!r} has dtypes { {r: h[1] for r, h in held.items()} } across ranks")
        dtypes[name] = kinds.pop()
        chosen[name] = _choose(name, layout_for(name, layouts, prefixes), held)
        donors[name] = _donors(name, chosen[name], held, src_dir)
    refuse_empty("MindSpore", src_dir if isinstance(src_dir, Mapping) else Path(src_dir).absolute(), len(chosen),
                 f" ({len(files)} rank files found)")
    writer = create(dst_url, chosen, **single_process(options))
    for rank in sorted(set().union(*(lay.ranks for lay in chosen.values()), files)):
        _import_rank(writer, rank, files, headers.get(rank, {}), chosen, dtypes, donors, check_crc)
    writer.commit()
    return open(dst_url, storage_options=options.get("storage_options"))


def _donors(name: str, lay: Layout, held: Mapping[int, Header], src_dir: Any) -> dict[int, int]:
    """``{writing rank: rank whose file holds its block}`` for every block of ``name``.

    A block is written by its replica 0; with ``remove_redundancy=True``
    MindSpore spreads the blocks over the replicas, so the copy may be in any
    replica's file: the first (in replica order) whose file holds the tensor.
    """
    out: dict[int, int] = {}
    lost = []
    for block in lay.blocks():
        donor = next((r for r in block.ranks if r in held), None)
        if donor is None:
            lost.append(list(block.ranks))
        else:
            out[block.ranks[0]] = donor
    if lost:
        raise FormatError(f"{name!r}: no file of the replicas {lost[0]} holds its block "
                          f"{[(s.start, s.stop) for s in lay.region(lost[0][0])]}"
                          + (f" ({len(lost)} blocks lost)" if len(lost) > 1 else "") + f" (under {src_dir})")
    return out


def _import_rank(writer: Any, rank: int, files: Mapping[int, Path], header: Mapping[str, Header],
                 chosen: Mapping[str, Layout], dtypes: Mapping[str, str], donors: Mapping[str, Mapping[int, int]],
                 check_crc: bool) -> None:
    needed = {n: donors[n][rank] for n, lay in chosen.items()
              if rank in lay.ranks and lay.replica_id(rank) == 0 and rank in donors[n]}
    strings = [t for t, h in header.items() if h[1] == "str"]
    opened: dict[int, dict[str, Any]] = {}

    def values(r: int) -> dict[str, Any]:  # this rank's file, and a replica's when it holds the copy
        if r not in opened:
            opened[r] = read_file(files[r], check_crc=check_crc) if r in files else {}
        return opened[r]

    state: dict[str, Any] = {t: str(values(rank)[t]) for t in strings}
    for name, lay in chosen.items():
        if rank not in lay.ranks:
            continue
        if name in needed:
            got = values(needed[name]).get(name)
            if got is None:
                raise FormatError(f"{name!r}: {files.get(needed[name], f'rank_{needed[name]}')} does not hold it")
            state[name] = got
        else:
            state[name] = _placeholder(lay.local_shape(rank), dtypes[name])
    writer.write(rank, state)
