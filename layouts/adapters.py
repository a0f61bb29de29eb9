"""Build a :class:`~reshard.layouts.Layout` from each framework's own description.

=========== ================================== ========== =====
framework   description                        split      axes
=========== ================================== ========== =====
MindSpore   dev_matrix + tensor_map (+ opt)    even       flat
OneFlow     placement rank array + N-d SBP     balanced   nested
DTensor     mesh shape + placements            ceil       nested
JAX         mesh axes + PartitionSpec          even       flat
Megatron    (rank, offset, shape, replica)     explicit   -
=========== ================================== ========== =====

Framework objects are never imported: pass their values (or their ``str``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._blocks import check_blocks, number_replicas
from .errors import LayoutError, ShapeMismatchError

if TYPE_CHECKING:
    from .core import Layout


def _check_ndim(shape: Sequence[int], n: int, what: str, value: Any) -> None:
    if len(shape) != n:
        raise ShapeMismatchError(
            f"{what} {value!r} has {n} entries but shape {list(shape)} has {len(shape)} dims"
        )


def from_mindspore(
    cls: type[Layout],
    dev_matrix: Sequence[int],
    tensor_map: Sequence[int | Sequence[int]],
    shape: Sequence[int],
    opt_shard_size: int | None = None,
    ranks: Sequence[int] | None = None,
    stage: int = 0,
) -> Layout:
    """Layout of a MindSpore parameter.

    Parameters
    ----------
    dev_matrix : sequence of int
        Device matrix; rank coordinates are row-major, last dim fastest.
    tensor_map : sequence of int or tuple of int
        Per tensor dim: ``-1`` (not split) or a device dim counted **from the
        right** (``m`` is mesh axis ``n-1-m``); a tuple names several device
        dims, the first listed outermost.
    shape : sequence of int
        Global shape.
    opt_shard_size : int, optional
        ``optimizer_weight_shard_size``: None or 0 off, -1 whole group, s > 0.
    ranks : sequence of int, optional
        Global ranks of the device matrix; default ``stage*prod(dev) + local``.
    stage : int
        Pipeline stage (only used when `ranks` is None).
    """
    dev = tuple(int(v) for v in dev_matrix)
    n = len(dev)
    _check_ndim(shape, len(tensor_map), "tensor_map", list(tensor_map))
    dims = []
    for d, m in enumerate(tensor_map):
        entries = tuple(m) if isinstance(m, (list, tuple)) else (m,)
        axes = []
        for x in entries:
            if int(x) == -1:
                continue
            if not 0 <= int(x) < n:
                raise LayoutError(
                    f"tensor_map {list(tensor_map)} maps dim {d} to device dim {x}, "
                    f"but dev_matrix {list(dev)} has only {n} dims"
                )
            axes.append(n - 1 - int(x))
        dims.append(tuple(axes))
    total = math.prod(dev)
    rank_ids = tuple(ranks) if ranks is not None else tuple(range(stage * total, (stage + 1) * total))
    opt = None if not opt_shard_size else int(opt_shard_size)
    origin = {
        "framework": "mindspore",
        "dev_matrix": list(dev),
        "tensor_map": [[int(x) for x in m] if isinstance(m, Sequence) else int(m) for m in tensor_map],
        "opt_shard_size": opt or 0,
        "stage": stage,
    }
    return cls(tuple(shape), dev, rank_ids, tuple(dims), "even", False, opt, None, origin)


def from_sharded_state_dict(
    cls: type[Layout],
    shard: Sequence[int],
    shape: Sequence[int],
    total_rank: int,
    stage_rank_size: int | None = None,
    stage: int = 0,
) -> Layout:
    """Layout of a MindSpore ``sharded_state_dict`` entry, as ``save_strategy_file`` writes it.

    ``dev_matrix = [repeat] + shard`` (repeat only when
    ``stage_rank_size // prod(shard) != 1``), ``tensor_map = [ndim-1, ..., 0]``.
    """
    shard = [int(s) for s in shard]
    _check_ndim(shape, len(shard), "shard", shard)
    size = stage_rank_size if stage_rank_size is not None else total_rank
    need = math.prod(shard)
    if need <= 0 or size % need:
        raise LayoutError(f"shard {shard} requires {need} devices, which does not divide {size}")
    if (stage + 1) * size > total_rank:
        raise LayoutError(f"stage {stage} of {size} ranks does not fit in total_rank {total_rank}")
    repeat = size // need
    dev = ([repeat] if repeat != 1 else []) + shard
    tmap = list(range(len(shape) - 1, -1, -1))
    ranks = range(stage * size, (stage + 1) * size)
    return from_mindspore(cls, dev, tmap, shape, None, ranks, stage)


def _sbp_name(x: Any) -> str:
    s = str(x).strip().lower().replace(" ", "")
    for prefix in ("oneflow.sbp.", "sbp.", "torch.distributed.tensor.", "placement."):
        s = s.removeprefix(prefix)
    return s


_SPLIT = re.compile(r"^(?:s|split|shard)\((?:dim=|axis=)?(-?\d+)\)$")


def _parse_placement(x: Any, ndim: int, framework: str) -> int | None:
    """Return the tensor dim split by one SBP/placement entry, or None if replicated."""
    s = _sbp_name(x)
    m = _SPLIT.match(s)
    if m:
        d = int(m.group(1))
        d = d + ndim if d < 0 else d
        if not 0 <= d < ndim:
            raise LayoutError(f"{framework} placement {x!r} splits dim {m.group(1)} of a {ndim}-d tensor")
        return d
    if re.match(r"^(?:b|broadcast|r|replicate)(?:\(\))?$", s):
        return None
    if re.match(r"^(?:p|partial|partial_sum|partialsum)(?:\(.*\))?$", s):
        what = "partial_sum" if framework == "OneFlow" else "Partial"
        raise LayoutError(
            f"{framework} placement {x!r} is {what}: a pending reduction cannot be saved; "
            "reduce it (to_global with broadcast/split, or redistribute) first"
        )
    raise LayoutError(f"unknown {framework} placement {x!r}")


def _nested_shape(ranks: Any) -> tuple[list[int], list[int]]:
    if hasattr(ranks, "tolist"):
        ranks = ranks.tolist()
    if isinstance(ranks, int):
        return [], [ranks]
    if not isinstance(ranks, (list, tuple)) or not ranks:
        raise LayoutError(f"placement ranks must be a non-empty (nested) list of ints, got {ranks!r}")
    parts = [_nested_shape(r) for r in ranks]
    inner = parts[0][0]
    if any(p[0] != inner for p in parts):
        raise LayoutError(f"placement ranks {ranks!r} is ragged")
    return [len(ranks), *inner], [r for p in parts for r in p[1]]


def _placements(value: Any, n: int, what: str) -> list[Any]:
    items = [value] if isinstance(value, str) or not isinstance(value, (list, tuple)) else list(value)
    if len(items) != n:
        raise LayoutError(f"{what} {value!r} has {len(items)} entries for a {n}-d mesh")
    return items


def _dims_of(split_dims: list[int | None], ndim: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(i for i, d in enumerate(split_dims) if d == t) for t in range(ndim))


def from_oneflow(cls: type[Layout], ranks: Any, sbp: Any, shape: Sequence[int]) -> Layout:
    """Layout of a OneFlow global tensor.

    Parameters
    ----------
    ranks : nested list of int
        ``placement.ranks``: its shape is the hierarchy.
    sbp : str or sequence of str
        One per hierarchy axis: ``"S(d)"``/``"split(d)"``, ``"B"``/
        ``"broadcast"``; a single value for a 1-d placement. ``partial_sum``
        raises LayoutError.
    shape : sequence of int
        Global shape.
    """
    hierarchy, flat = _nested_shape(ranks)
    if not hierarchy:
        hierarchy = [1]
    items = _placements(sbp, len(hierarchy), "sbp")
    split_dims = [_parse_placement(x, len(shape), "OneFlow") for x in items]
    origin = {"framework": "oneflow", "hierarchy": hierarchy, "sbp": [str(x) for x in items]}
    return cls(
        tuple(shape), tuple(hierarchy), tuple(flat), _dims_of(split_dims, len(shape)),
        "balanced", True, None, None, origin,
    )


_STRIDED = re.compile(r"^_(?:s|stridedshard)\((?:dim=)?(-?\d+),(?:sf=|split_factor=)?(\d+)\)$")


def _parse_dtensor(x: Any, ndim: int) -> tuple[int | None, int]:
    """``(split dim or None, split_factor)`` of one DTensor placement (factor 1 unless strided)."""
    m = _STRIDED.match(_sbp_name(x))
    if m is None:
        return _parse_placement(x, ndim, "DTensor"), 1
    d, factor = int(m.group(1)), int(m.group(2))
    d = d + ndim if d < 0 else d
    if not 0 <= d < ndim or factor < 1:
        raise LayoutError(f"DTensor placement {x!r} does not fit a {ndim}-d tensor")
    return d, factor


def from_dtensor(
    cls: type[Layout],
    mesh_shape: int | Sequence[int],
    placements: Any,
    shape: Sequence[int],
    ranks: Sequence[int] | None = None,
) -> Layout:
    """Layout of a torch DTensor: ``Shard(d)`` uses ``torch.chunk``; several nest in mesh order.

    ``_StridedShard(d, split_factor=k)`` (FSDP2 over tensor parallelism,
    written ``_S(d, k)``) splits inside the ``k`` pieces of the later axes on
    ``d``: those axes go first in the nested order (see :mod:`._strided`).

    Raises
    ------
    UnsupportedError
        A strided placement whose factor matches no later axes, or an uneven
        size where torch's strided indices are not the nested blocks.
    """
    from ._strided import check_torch_agrees, nested_order

    mesh = (int(mesh_shape),) if isinstance(mesh_shape, int) else tuple(int(v) for v in mesh_shape)
    items = _placements(placements, len(mesh), "placements")
    parsed = [_parse_dtensor(x, len(shape)) for x in items]
    dims = _dims_of([d for d, _ in parsed], len(shape))
    if any(f > 1 for _, f in parsed):
        names = tuple(str(x) for x in items)
        nested = []
        for d, axes in enumerate(dims):
            splits = tuple((a, parsed[a][1]) for a in axes)
            if any(f > 1 for _, f in splits):
                order = nested_order(d, splits, mesh, names)
                check_torch_agrees(int(shape[d]), d, splits, order, mesh, names)
                axes = order
            nested.append(axes)
        dims = tuple(nested)
    origin = {"framework": "dtensor", "mesh_shape": list(mesh), "placements": [str(x) for x in items]}
    return cls(tuple(shape), mesh, () if ranks is None else tuple(ranks), dims, "ceil", True, None, None, origin)


def from_jax(
    cls: type[Layout],
    mesh_axes: Mapping[str, int] | Sequence[tuple[str, int]],
    partition_spec: Sequence[Any],
    shape: Sequence[int],
    ranks: Sequence[int] | None = None,
) -> Layout:
    """Layout of a JAX ``NamedSharding``: each dim names None, an axis, or a tuple of axes."""
    pairs = mesh_axes.items() if isinstance(mesh_axes, Mapping) else mesh_axes
    axes = [(str(name), int(size)) for name, size in pairs]
    names = [name for name, _ in axes]
    spec = list(partition_spec)
    if len(spec) > len(shape):
        raise ShapeMismatchError(
            f"partition_spec {spec!r} has {len(spec)} entries but shape {list(shape)} has {len(shape)} dims"
        )
    spec += [None] * (len(shape) - len(spec))
    dims: list[tuple[int, ...]] = []
    used: dict[str, int] = {}
    for d, entry in enumerate(spec):
        group = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        idx = []
        for name in group:
            if name not in names:
                raise LayoutError(f"partition_spec names mesh axis {name!r}; the mesh has {names}")
            if name in used:
                raise LayoutError(f"mesh axis {name!r} splits both dim {used[name]} and dim {d}")
            used[name] = d
            idx.append(names.index(name))
        dims.append(tuple(idx))
    origin = {
        "framework": "jax",
        "mesh_axes": [[n, s] for n, s in axes],
        "partition_spec": [e if e is None or isinstance(e, str) else list(e) for e in spec],
    }
    mesh = tuple(s for _, s in axes)
    rank_ids = () if ranks is None else tuple(ranks)
    return cls(tuple(shape), mesh, rank_ids, tuple(dims), "even", False, None, None, origin)


def from_blocks(cls: type[Layout], shape: Sequence[int], blocks: Sequence[Sequence[Any]]) -> Layout:
    """Layout from explicit ``(rank, global_offset, local_shape, replica_id[, local_offset])`` blocks (Megatron).

    A rank listed in several blocks holds them all, each at its ``local_offset``
    in the rank's local array (:meth:`Layout.pieces`).

    A Megatron tuple ``replica_id`` is accepted: per region, ids are numbered
    0, 1, 2... in tuple order, so the all-zero main replica writes.
    """
    shp = tuple(int(v) for v in shape)
    explicit = check_blocks(shp, number_replicas(blocks))
    ranks = tuple(dict.fromkeys(b[0] for b in explicit))
    return cls(shp, (len(ranks),), ranks, ((),) * len(shp), "even", False, None, explicit, None)
