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

import functools
import math
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


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _local(value: Any) -> Any:
    """The tensor this rank holds (a DTensor's local shard), detached, sharing memory."""
    return value.to_local().detach() if _is_dtensor(value) else value.detach()


def _placement(p: Any) -> str:
    """A placement as :meth:`Layout.from_dtensor` reads it (``_S(d, k)`` for FSDP2's strided shard)."""
    if type(p).__name__ == "_StridedShard":
        return f"_S({p.dim}, {int(p.split_factor)})"
    if p.is_shard():
        return f"S({p.dim})"
    if p.is_replicate():
        return "R"
    return str(p)  # Partial: the adapter names it and refuses


def layout_of(value: Any, ranks: list[int], *, widen: bool = False) -> Layout:
    """The layout of one state-dict tensor.

    A DTensor gives ``Layout.from_dtensor`` over its mesh's global ranks
    (FSDP2 + TP strided shards become a nested split, TP first); a plain
    tensor is replicated over ``ranks`` (its replica 0 writes it). With
    ``widen``, a DTensor on a submesh spans the root mesh, the sibling
    submeshes as replicas: only right when the siblings hold the same
    tensor, which :func:`save` checks across ranks before using it (pipeline
    stages' submeshes hold different ones).

    Raises
    ------
    UnsupportedError
        A strided placement reshard cannot represent exactly.
    """
    shape = tuple(value.shape)
    if _is_dtensor(value):
        mesh = value.device_mesh
        mesh_shape, replicas, mesh_ranks = _spanned(mesh) if widen else _own(mesh)
        placements = ["R"] * replicas + [_placement(p) for p in value.placements]
        return Layout.from_dtensor(mesh_shape, placements, shape, ranks=mesh_ranks)
    return Layout(shape, (len(ranks),), tuple(ranks))


def _own(mesh: Any) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    return tuple(mesh.mesh.shape), 0, tuple(mesh.mesh.flatten().tolist())


@functools.lru_cache(maxsize=64)
def _spanned(mesh: Any) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """``(mesh shape, leading replica axes, ranks)`` of a DTensor's mesh, widened to its root mesh.

    A submesh (``mesh["dp"]`` of a (dp, tp) mesh) holds one copy of a tensor
    that its sibling submeshes hold too: e.g. an FSDP-only parameter beside
    tensor-parallel ones. Every rank must describe it alike, so the layout
    spans the root mesh, the other root axes replicating (one leading axis
    of their product). A submesh that is not a plain slice of its root (a
    flattened one) keeps its own ranks.
    """
    sub = np.asarray(mesh.mesh.tolist(), dtype=np.int64).reshape(tuple(mesh.mesh.shape))
    own = _own(mesh)
    root_mesh = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    root = np.asarray(root_mesh.mesh.tolist(), dtype=np.int64).reshape(tuple(root_mesh.mesh.shape))
    if root.shape == sub.shape:
        return own
    where = {int(r): idx for idx, r in np.ndenumerate(root)}
    if any(int(r) not in where for r in sub.flat):
        return own
    origin = where[int(sub.flat[0])]
    axes: list[int] = []
    for i, n in enumerate(sub.shape):
        if n == 1:
            continue
        step = where[int(sub[tuple(1 if j == i else 0 for j in range(sub.ndim))])]
        moved = [d for d in range(root.ndim) if step[d] != origin[d]]
        if len(moved) != 1 or root.shape[moved[0]] != n or step[moved[0]] - origin[moved[0]] != 1:
            return own
        axes.append(moved[0])
    others = [d for d in range(root.ndim) if d not in axes]
    copies = math.prod(root.shape[d] for d in others)
    spanned = root.transpose(others + axes).reshape(copies, *sub.shape)
    if not any(np.array_equal(block, sub) for block in spanned):
        return own
    return (copies, *sub.shape), 1, tuple(spanned.flatten().tolist())


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


def _gather(names: list[str], process_group: Any, ranks: list[int]) -> list[set[str]]:
    """Every group rank's ``names``, in group rank order (just ours without torch.distributed)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [set(names)]
    out: list[Any] = [None] * len(ranks)
    dist.all_gather_object(out, names, group=process_group)
    return [set(n) for n in out]


def _narrow(layouts: dict[str, Layout], values: dict[str, Any], widened: list[str], held: list[set[str]],
            ranks: list[int]) -> None:
    """Keep a submesh DTensor on its own mesh unless every rank of its widened layout holds that name.

    Sibling submeshes of FSDP + TP hold the same parameter (one of them
    writes it); pipeline stages' submeshes hold different ones, and a widened
    layout would name a writer that lacks the tensor.
    """
    holders: dict[str, set[int]] = {}
    for r, names in zip(ranks, held, strict=True):
        for n in names:
            holders.setdefault(n, set()).add(r)
    for name in widened:
        if not set(layouts[name].ranks) <= holders.get(name, set()):
            layouts[name] = layout_of(values[name], ranks, widen=False)


# --------------------------------------------------------------- save/load
def save(state_dict: Mapping[str, Any], url: str, *, process_group: Any = None, **options: Any) -> None:
    """Save a (DTensor) state dict; call on every rank of the group.

    The ranks first exchange the names of their submesh DTensors (one
    ``all_gather_object``, see :func:`layout_of`); each rank then writes the
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
    layouts: dict[str, Layout] = {}
    local: dict[str, Any] = {}
    values: dict[str, Any] = {}
    widened: list[str] = []
    error = None
    try:
        for name, _, _, value in _walk(state_dict):
            values[name] = value
            if _is_tensor(value):
                layouts[name] = layout_of(value, ranks, widen=True)
                if _is_dtensor(value) and _spanned(value.device_mesh)[1]:
                    widened.append(name)
    except Exception as e:  # shared with the other ranks below, then raised everywhere
        error = f"{type(e).__name__}: {e}"
    held = _gather(widened, process_group, ranks)
    try:
        if error is None:
            _narrow(layouts, values, widened, held, ranks)
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
