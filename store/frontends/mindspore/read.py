"""MindSpore import: per-rank ``.ckpt`` / ``.safetensors`` files and a strategy -> a reshard checkpoint.

Nothing is written before every piece is checked: each rank file's piece of a
tensor has the shape the chosen layout gives that rank, every block is held by
some file, and every copy of a block (replicas, or the whole copies of an
integrated save) holds the same bytes as the first. Map tensors are not decoded:
refused unless ``skip`` names them (then recorded, ``reshard.skipped``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from reshard.layouts import OPTIMIZER_PREFIXES, Layout, layout_for
from reshard.layouts.errors import (
    DTypeMismatchError,
    FormatError,
    ShapeMismatchError,
)

from ...format.dtypes import numpy_dtype
from ...read.checkpoint import Checkpoint
from ...read.open import open
from ...write.writer import create, single_process
from ..sources import Skips, refuse_empty
from .ckpt import (
    MAP,
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


def _choose(name: str, strat: Layout | None, holders: Mapping[int, Header], files: Mapping[int, Path]) -> Layout:
    """The saving layout that explains every holder's local shape.

    Tried in order: the strategy's layout; the same without optimizer
    sharding (an aggregated save); whole copies (an integrated save, whose
    copies :func:`_check_copies` then compares).
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
        want = list(strat.local_shape(r)) if r in strat.ranks else "nothing (not among its ranks)"
        raise ShapeMismatchError(f"{name!r}: rank {r}'s file holds shape {list(shape)} ({files[r]}), "
                                 f"strategy {strat.describe()} of shape {list(strat.shape)} gives it {want}")
    return _replicated(holders, name)


def _placeholder(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A zero-memory stand-in for a replica's piece: the writer skips replicas but checks shapes."""
    return np.broadcast_to(np.zeros((), numpy_dtype(dtype)), shape)


def import_mindspore(src_dir: str | os.PathLike[str] | Mapping[int, Any], dst_url: str, strategy: StrategyLike,
                     *, shapes: Mapping[str, Sequence[int]] | None = None, file_name: str | None = None,
                     check_crc: bool = True, prefixes: Sequence[str] = OPTIMIZER_PREFIXES,
                     skip: Sequence[str] = (), **options: Any) -> Checkpoint:
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
    skip : sequence of str
        Map tensors (``MapParameter``, not decoded) the import may leave out (globs or dotted
        prefixes, :class:`~reshard.store.frontends.sources.Skips`); any other raises
        :class:`FormatError` naming it and its files. What is skipped is recorded in the leaf
        ``reshard.skipped``.
    **options
        As for :func:`reshard.store.create` (``overwrite``, ``compression``...).

    Returns
    -------
    Checkpoint
        The new checkpoint, opened.

    Notes
    -----
    Every file's headers are scanned first, and every copy of a block compared
    (nothing is written if anything disagrees); then the ranks are written one
    at a time, each file memory mapped while its rank writes. Each block is
    written once, from the first replica (in replica order) whose file holds
    the tensor: with
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
        layouts = load_strategy(strategy, {**infer_shapes(data, headers), **(shapes or {})})
    holders: dict[str, dict[int, Header]] = {}
    maps: dict[str, list[int]] = {}
    for rank, h in headers.items():
        for tag, head in h.items():
            if head[1] == MAP:
                maps.setdefault(tag, []).append(rank)
            elif head[1] != "str":
                holders.setdefault(tag, {})[rank] = head
    skips = Skips(skip)
    for tag, ranks in maps.items():
        skips.add(tag, f"map tensor {tag!r} (a MapParameter) in {', '.join(str(files[r]) for r in ranks)}",
                  "reshard does not decode map tensors")
    chosen: dict[str, Layout] = {}
    dtypes: dict[str, str] = {}
    donors: dict[str, dict[int, int]] = {}
    for name, held in holders.items():
        kinds = {h[1] for h in held.values()}
        if len(kinds) != 1:
            raise DTypeMismatchError(f"{name!r} has dtypes { {r: h[1] for r, h in held.items()} } across ranks")
        dtypes[name] = kinds.pop()
        strat = layout_for(name, layouts, prefixes)
        chosen[name] = _choose(name, strat, held, files)
        donors[name] = _donors(name, chosen[name], held, src_dir)
    refuse_empty("MindSpore", src_dir if isinstance(src_dir, Mapping) else Path(src_dir).absolute(), len(chosen),
                 f" ({len(files)} rank files found)")
    skips.check()
    named = os.fspath(strategy) if isinstance(strategy, (str, os.PathLike)) else "the strategy"
    _check_copies(chosen, holders, files, check_crc, layouts, prefixes, named)
    writer = create(dst_url, chosen, **single_process(options))
    leaves = skips.leaves()
    for rank in sorted(set().union(*(lay.ranks for lay in chosen.values()), files)):
        _import_rank(writer, rank, files, headers.get(rank, {}), chosen, dtypes, donors, check_crc, leaves)
        leaves = {}  # with the first rank
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


def _check_copies(chosen: Mapping[str, Layout], holders: Mapping[str, Mapping[int, Header]],
                  files: Mapping[int, Path], check_crc: bool, layouts: Mapping[str, Layout],
                  prefixes: Sequence[str], strategy: str) -> None:
    """Refuse copies of a block that differ (replicas, or an integrated save's whole tensors).

    ``strategy`` names the strategy file in the hint that it may not be this save's.

    Only blocks that several rank files hold are compared (sha256 of each copy,
    one file in memory at a time); a save without redundancy reads nothing here.

    Raises
    ------
    FormatError
        Naming the tensor, the block and the two ranks (and files) that differ.
    """
    copies: dict[int, list[tuple[str, tuple[tuple[int, int], ...]]]] = {}
    for name, lay in chosen.items():
        by_block: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for r in holders[name]:
            by_block.setdefault(tuple((s.start, s.stop) for s in lay.region(r)), []).append(r)
        for block, ranks in by_block.items():
            for r in ranks if len(ranks) > 1 else ():
                copies.setdefault(r, []).append((name, block))
    first: dict[tuple[str, tuple[tuple[int, int], ...]], tuple[int, bytes]] = {}
    for r in sorted(copies):
        values = read_file(files[r], check_crc=check_crc, skip_maps=True)
        for name, block in copies[r]:
            digest = hashlib.sha256(np.ascontiguousarray(values[name]).reshape(-1).view(np.uint8).data).digest()
            seen = first.setdefault((name, block), (r, digest))
            if seen[1] != digest:
                strat = layout_for(name, layouts, prefixes)
                hint = (f"; not in {strategy}: each file's copy is taken for the whole tensor" if strat is None else
                        f"; {strategy} makes them copies ({strat.describe()}): is it this save's?"
                        if strat == chosen[name] else
                        f"; the files hold shape {list(holders[name][r][0])}, which {strategy}'s "
                        f"{strat.describe()} of shape {list(strat.shape)} does not give them: is it this save's?")
                raise FormatError(f"{name!r}: its copies of the block {[list(b) for b in block]} differ: rank "
                                  f"{seen[0]}'s {files[seen[0]]} and rank {r}'s {files[r]} (copies of a block must "
                                  f"be equal){hint}")
        del values


def _import_rank(writer: Any, rank: int, files: Mapping[int, Path], header: Mapping[str, Header],
                 chosen: Mapping[str, Layout], dtypes: Mapping[str, str], donors: Mapping[str, Mapping[int, int]],
                 check_crc: bool, leaves: Mapping[str, Any]) -> None:
    needed = {n: donors[n][rank] for n, lay in chosen.items()
              if rank in lay.ranks and lay.replica_id(rank) == 0 and rank in donors[n]}
    strings = [t for t, h in header.items() if h[1] == "str"]
    opened: dict[int, dict[str, Any]] = {}

    def values(r: int) -> dict[str, Any]:  # this rank's file, and a replica's when it holds the copy
        if r not in opened:
            opened[r] = read_file(files[r], check_crc=check_crc, skip_maps=True) if r in files else {}
        return opened[r]

    state: dict[str, Any] = {**leaves, **{t: str(values(rank)[t]) for t in strings}}
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
