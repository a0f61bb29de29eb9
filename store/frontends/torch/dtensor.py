"""DTensor state dicts in and out, and the ``torch.save`` export.

Call :func:`save` and :func:`load` on every rank of a ``torch.distributed`` job
(or in one process without a process group). Values may be DTensors (any mesh,
``Shard``/``Replicate``, uneven ``torch.chunk`` pieces), plain tensors (taken
to be identical on every rank: one rank writes them) and JSON leaves. Loading
into DTensors of another mesh reads only each rank's own region, straight into
its local tensor. For optimizer state use the FQN-keyed dicts of
``torch.distributed.checkpoint.state_dict.get_state_dict`` (see docs/torch.md).

torch is imported inside the functions, never when ``reshard.store`` loads.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from reshard.layouts import Layout
from reshard.layouts.errors import ShapeMismatchError, TensorNotFoundError

from ...format.torch_arrays import from_numpy, to_numpy
from ...format.tree import to_json
from ...io.localfs import is_local_url
from ...io.replace import replacing
from ...io.stats import IOStats
from ...read.open import open
from ...write.writer import create
from .mapping import _is_dtensor, _is_tensor, layout_of, state_layouts


def _local(value: Any) -> Any:
    """The tensor this rank holds (a DTensor's local shard), detached, sharing memory."""
    return value.to_local().detach() if _is_dtensor(value) else value.detach()


# --------------------------------------------------------------- state dicts
def _holds_tensor(value: Any) -> bool:
    if _is_tensor(value):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _walk(node: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any, Any]]:
    """Yield ``(dotted name, container, key, value)`` for every tensor and JSON leaf.

    Mappings are walked; lists and tuples only when they hold tensors (a list
    of hyper-parameters, like ``param_groups``, is one JSON leaf).
    """
    items = node.items() if isinstance(node, Mapping) else enumerate(node)
    for key, value in items:
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) or (isinstance(value, (list, tuple)) and _holds_tensor(value)):
            yield from _walk(value, name)
        else:
            yield name, node, key, value


def _like(value: Any, template: Any) -> Any:
    """A JSON value shaped back like ``template`` (lists that were tuples become tuples)."""
    if isinstance(template, tuple) and isinstance(value, list):
        return tuple(_like(v, t) for v, t in zip(value, template, strict=False)) + tuple(value[len(template):])
    if isinstance(template, list) and isinstance(value, list):
        return [_like(v, t) for v, t in zip(value, template, strict=False)] + value[len(template):]
    if isinstance(template, dict) and isinstance(value, dict):
        return {k: _like(v, template[k]) if k in template else v for k, v in value.items()}
    return value


def _group(process_group: Any) -> tuple[int, list[int]]:
    """This process's global rank and the global ranks of the group (``0, [0]`` without torch.distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, [0]
    group = process_group or dist.group.WORLD
    return dist.get_rank(), sorted(dist.get_process_group_ranks(group))


def _agree(error: str | None, process_group: Any, ranks: list[int]) -> None:
    """Barrier that also shares failures: every rank raises if any rank failed."""
    import torch.distributed as dist

    if len(ranks) == 1 and not dist.is_initialized():
        if error:
            raise RuntimeError(error)
        return
    errors: list[Any] = [None] * len(ranks)
    dist.all_gather_object(errors, error, group=process_group)
    failed = [f"rank {r}: {e}" for r, e in zip(ranks, errors, strict=True) if e]
    if failed:
        raise RuntimeError("reshard save failed; " + "; ".join(failed))


# --------------------------------------------------------------- save/load
def save(state_dict: Mapping[str, Any], url: str, *, process_group: Any = None, **options: Any) -> None:
    """Save a (DTensor) state dict; call on every rank of the group.

    The ranks first agree on the layouts (:func:`.mapping.state_layouts`: the
    names of their submesh DTensors, see :func:`layout_of`, and a digest of
    every layout; ranks that disagree raise on every rank, naming the tensor
    and both layouts, before anything is written); each rank then writes the
    blocks it holds as replica 0 (no communication), the ranks meet once,
    the group's first rank commits, and they meet again, so the checkpoint
    is committed when this returns on any rank.

    Parameters
    ----------
    state_dict : mapping
        Nested ``{name: DTensor | Tensor | JSON leaf}``, e.g.
        ``{"model": model_sd, "optim": optim_sd}`` from ``get_state_dict``.
    url : str
        Destination (local path or fsspec URL).
    process_group : ProcessGroup, optional
        The ranks taking part (default: the whole job).
    **options
        As for :func:`reshard.store.create` (``overwrite``, ``compression``,
        ``chunk_bytes``, ``storage_options``...).
    """
    rank, ranks = _group(process_group)
    values = {name: value for name, _, _, value in _walk(state_dict)}
    layouts = state_layouts(values, process_group, rank, ranks)  # the same on every rank, or raised on every rank
    local: dict[str, Any] = {}
    error = None
    try:
        for name, value in values.items():
            if not _is_tensor(value):
                local[name] = to_json(value, name)
            elif rank in layouts[name].ranks:
                local[name] = to_numpy(_local(value))
        writer = create(url, layouts, **options)
        writer.write(rank, local)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    _agree(error, process_group, ranks)
    if rank == ranks[0]:
        try:
            # every rank of the group wrote a manifest: commit reads them all, not only the ranks of the
            # tensors this rank knows (with pipeline stages, other ranks hold tensors this one never saw)
            writer.commit(ranks=ranks)
        except Exception as e:
            error = f"commit: {type(e).__name__}: {e}"
    _agree(error, process_group, ranks)


def load(state_dict: Mapping[str, Any], url: str, *, strict: bool = True, process_group: Any = None,
         storage_options: dict[str, Any] | None = None, engine: str = "fast",
         read_once: bool | None = None) -> IOStats:
    """Fill a (DTensor) state dict in place from a checkpoint; call on every rank.

    Each DTensor's local tensor receives its own region under its own mesh
    and placements (any mesh, any world size). Plain tensors receive the whole
    stored tensor, JSON leaves are replaced by the stored values. Stored values
    of another dtype are cast as by ``Tensor.copy_``.

    Without ``process_group`` every rank reads its own regions from storage,
    with no collective. With one, on an object store (or with
    ``read_once=True``), the load is read-once: every stored byte
    some ranks of the group need is read from storage by one of them (the
    reading balanced over the ranks) and handed to the others with
    ``all_to_all_single`` (gloo on CPU; with NCCL into device memory), in
    rounds of at most 256 MiB staged, sent and received per rank; a rank that
    fails makes every rank raise (see :mod:`reshard.store.frontends.torch.exchange`).

    Parameters
    ----------
    state_dict : mapping
        The target, e.g. ``{"model": ..., "optim": ...}`` from ``get_state_dict``
        on the new mesh; pass the filled dicts to ``set_state_dict`` afterwards.
    url : str
        The checkpoint.
    strict : bool
        Raise :class:`TensorNotFoundError` for names the checkpoint lacks
        (otherwise they keep their values).
    process_group : ProcessGroup, optional
        The ranks that load together and share their reads (e.g.
        ``dist.group.WORLD``); every rank of it must call ``load``. None:
        independent reads (also when torch.distributed is not initialized).
    read_once : bool, optional
        With a group: share the reads (True) or read independently (False).
        Default: read-once when ``url`` is an object store (``s3://``, ``gs://``...),
        independent reads for local paths, where the ranks of one host share
        the page cache (each byte comes from the disk once anyway) and the
        exchange over loopback costs more than it saves (docs/torch.md). Pass
        True for a file system shared by several hosts (Lustre, NFS).
    storage_options, engine
        As for :func:`reshard.store.open`.

    Returns
    -------
    IOStats
        This rank's read counters (with a group: what this rank read for the group).
    """
    rank, ranks = _group(process_group)
    if read_once is None:  # the same on every rank: no collective needed to agree
        read_once = not is_local_url(url)
    if read_once and process_group is not None and len(ranks) > 1:
        from .exchange import read_once as exchange

        ckpt, failure = None, None
        targets: dict[str, tuple[Any, tuple[tuple[int, int], ...]]] = {}
        updates: list[tuple[Any, Any, Any]] = []
        try:
            ckpt = open(url, storage_options=storage_options, engine=engine)
            layouts, values, updates = _targets(ckpt, state_dict, rank, strict)
            for name, layout in layouts.items():
                want = layout.local_shape(rank)
                if tuple(values[name].shape) != want:
                    raise ShapeMismatchError(f"tensor {name!r}: local tensor is {list(values[name].shape)}, "
                                             f"rank {rank} needs {list(want)}")
                targets[name] = (values[name], tuple((s.start, s.stop) for s in layout.region(rank)))
        except Exception as e:  # every rank of the group raises (this one its own error)
            failure = e
        stats = exchange(ckpt, targets, failure, process_group)
    else:
        ckpt = open(url, storage_options=storage_options, engine=engine)
        layouts, values, updates = _targets(ckpt, state_dict, rank, strict)
        # CPU contiguous tensors of the stored dtype are read into in place; others get a (pinned, for a GPU)
        # staged copy
        ckpt.load(layouts, rank, as_="torch", out=values)
        stats = ckpt.last_stats
    for container, key, leaf in updates:
        container[key] = leaf
    return stats


def _targets(ckpt: Any, state_dict: Mapping[str, Any], rank: int,
             strict: bool) -> tuple[dict[str, Layout], dict[str, Any], list[tuple[Any, Any, Any]]]:
    """What ``rank`` loads: ``({name: layout}, {name: local tensor}, [(container, key, JSON leaf)])``.

    Raises
    ------
    TensorNotFoundError
        With ``strict``, for names the checkpoint lacks.
    """
    layouts: dict[str, Layout] = {}
    targets: dict[str, Any] = {}
    updates: list[tuple[Any, Any, Any]] = []
    missing = []
    for name, container, key, value in _walk(state_dict):
        if not _is_tensor(value):
            if name in ckpt.leaves:
                updates.append((container, key, _like(ckpt.leaves[name], value)))
            elif name not in ckpt.arrays:
                missing.append(name)
            continue
        if name not in ckpt.arrays:
            missing.append(name)
            continue
        layout = layout_of(value, [rank])
        if layout.has_rank(rank):
            layouts[name] = layout
            targets[name] = _local(value)
    if missing and strict:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise TensorNotFoundError(f"{ckpt.url} holds no tensor or leaf named {shown}")
    return layouts, targets, updates


# -------------------------------------------------------------- export
def export_torch(url: str, path: str, *, prefix: str = "", storage_options: dict[str, Any] | None = None,
                 overwrite: bool = False) -> IOStats:
    """Write a checkpoint's tensors as one ``torch.save`` file of a flat ``{name: tensor}`` dict.

    For inference: ``prefix="model."`` keeps the tensors under ``model`` and
    strips the prefix, so the file loads with ``model.load_state_dict``.
    ``torch.save`` needs every tensor in memory at once; for a file written
    with bounded memory use ``ckpt.export(path, "safetensors")``. An existing
    ``path`` is refused (:class:`~reshard.layouts.errors.CheckpointExistsError`)
    unless ``overwrite``; the file is replaced whole (:mod:`reshard.store.io.replace`).

    Returns
    -------
    IOStats
        The read counters.
    """
    import torch

    ckpt = open(url, storage_options=storage_options)
    names = [n for n in ckpt.arrays if n.startswith(prefix)]
    if not names:
        raise TensorNotFoundError(f"{ckpt.url} holds no tensor under {prefix!r}")
    with replacing(os.fspath(path), overwrite=overwrite, folder=False) as out:
        arrays = {n: np.empty(ckpt.arrays[n].shape, ckpt.arrays[n].np_dtype) for n in names}
        stats = ckpt.read_regions([(ckpt.arrays[n], tuple(slice(0, s) for s in a.shape), a)
                                   for n, a in arrays.items()])
        torch.save({n[len(prefix):]: from_numpy(a) for n, a in arrays.items()}, out)
    return stats
