"""One DTensor -> Layout mapping for every torch writer, agreed among the ranks.

:func:`state_layouts` gives the layouts of a state dict's tensors as both
:func:`reshard.store.frontends.torch.dtensor.save` and
:class:`reshard.store.manager.TorchCheckpointManager` write them: a DTensor on
a submesh (FSDP2's ``mesh["dp"]`` beside TP's 2-d mesh, an expert-parallel
``mesh["ep"]``) spans its root mesh, the sibling submeshes as replicas, when
every rank of that widened layout holds the tensor; otherwise (pipeline
stages) it keeps its own mesh's global ranks. Then the ranks check that every
tensor has one layout on all the ranks that hold it, and raise on every rank,
naming the tensor and both layouts, if not: the manager's commit runs in the
background, and a disagreement found there only surfaced at a later save.

Collectives, on every rank of the group: one ``all_gather_object`` of the
names of widened tensors (and of any rank's failure), one ``gather_object``
of ``{name: 8-byte digest}`` to the group's first rank and one
``broadcast_object_list`` of its verdict; one more ``all_gather_object`` only
when the ranks disagree (each rank's layout of the first disputed tensor).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from reshard.layouts import Layout
from reshard.layouts.errors import LayoutError


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


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


def describe(layout: Layout) -> str:
    """A layout for messages: shape, mesh, the DTensor placements it came from, its global ranks."""
    origin = layout.origin or {}
    placed = f" placements {origin['placements']}" if origin.get("framework") == "dtensor" else ""
    ranks = list(layout.ranks) if len(layout.ranks) <= 16 else f"[{layout.ranks[0]}, ... {layout.ranks[-1]}]"
    return f"shape {list(layout.shape)} mesh {list(layout.mesh)}{placed} ({layout.describe()}) over ranks {ranks}"


def state_layouts(values: Mapping[str, Any], process_group: Any, rank: int, ranks: list[int], *,
                  check: bool = True) -> dict[str, Layout]:
    """``{name: Layout}`` of the tensors of a flat ``{name: value}`` walk, the same on every rank holding each.

    Call on every rank of the group at once (collectives: see the module).

    Parameters
    ----------
    values : mapping
        ``{dotted name: DTensor | Tensor | JSON leaf}`` (``dtensor._walk``'s names).
    process_group : ProcessGroup or None
        The ranks taking part (None: the whole job).
    rank, ranks : int, list of int
        This process's global rank and the group's, as ``dtensor._group`` gives them.
    check : bool
        Also check that the ranks agree (:class:`LayoutError` on every rank if not).

    Raises
    ------
    LayoutError
        On every rank: some rank could not map a tensor (e.g. an unsupported
        strided placement), or two ranks give one tensor different layouts
        (naming the tensor, both ranks and both layouts).
    """
    layouts: dict[str, Layout] = {}
    widened: list[str] = []
    own: Exception | None = None
    try:
        for name, value in values.items():
            if _is_tensor(value):
                layouts[name] = layout_of(value, ranks, widen=True)
                if _is_dtensor(value) and _spanned(value.device_mesh)[1]:
                    widened.append(name)
    except Exception as e:  # shared with the other ranks below, then raised everywhere
        own = e
    shared = _all_gather((widened, None if own is None else f"{type(own).__name__}: {own}"), process_group, ranks)
    failed = [f"rank {r}: {e}" for r, (_, e) in zip(ranks, shared, strict=True) if e]
    if own is not None:  # this rank's own error, of its own type (UnsupportedError...), the others' noted
        if len(failed) > 1:
            own.add_note("the ranks that failed: " + "; ".join(failed))
        raise own
    if failed:
        raise LayoutError("reshard: other ranks could not map their tensors to layouts; " + "; ".join(failed))
    holders: dict[str, set[int]] = {}
    for r, (names, _) in zip(ranks, shared, strict=True):
        for n in names:
            holders.setdefault(n, set()).add(r)
    for name in widened:
        # sibling submeshes of FSDP + TP hold the same tensor (one of them writes it); pipeline stages'
        # submeshes hold different ones, and a widened layout would name a writer that lacks the tensor
        if not set(layouts[name].ranks) <= holders.get(name, set()):
            layouts[name] = layout_of(values[name], ranks, widen=False)
    if check:
        check_agree(layouts, process_group, rank, ranks)
    return layouts


def check_agree(layouts: Mapping[str, Layout], process_group: Any, rank: int, ranks: list[int]) -> None:
    """Raise :class:`LayoutError` on every rank of the group unless all ranks holding a tensor give it one layout.

    Call on every rank of the group at once.
    """
    if len(ranks) == 1:
        return
    import torch.distributed as dist

    digests = {name: _digest(layout) for name, layout in layouts.items()}
    first = ranks[0]
    gathered: list[Any] | None = [None] * len(ranks) if rank == first else None
    dist.gather_object(digests, gathered, dst=first, group=process_group)
    verdict: list[Any] = [None]
    if gathered is not None:
        verdict[0] = _first_dispute(ranks, gathered)
    dist.broadcast_object_list(verdict, src=first, group=process_group)
    if verdict[0] is None:
        return
    name, a, b = verdict[0]
    shown = _all_gather(describe(layouts[name]) if name in layouts else None, process_group, ranks)
    by_rank = dict(zip(ranks, shown, strict=True))
    raise LayoutError(f"ranks {a} and {b} disagree on the layout of {name!r}: rank {a} has {by_rank[a]}; "
                      f"rank {b} has {by_rank[b]} (every rank must map a tensor to the same layout; "
                      "nothing was saved)")


def _digest(layout: Layout) -> bytes:
    return hashlib.blake2b(layout.to_json_text().encode(), digest_size=8).digest()


def _first_dispute(ranks: list[int], gathered: list[dict[str, bytes]]) -> tuple[str, int, int] | None:
    """``(name, rank, other rank)`` of the first tensor two ranks give different layouts, or None."""
    seen: dict[str, tuple[int, bytes]] = {}
    for r, digests in zip(ranks, gathered, strict=True):
        for name, d in digests.items():
            found = seen.setdefault(name, (r, d))
            if found[1] != d:
                return name, found[0], r
    return None


def _all_gather(obj: Any, process_group: Any, ranks: list[int]) -> list[Any]:
    """Every group rank's ``obj``, in group rank order (just ours without torch.distributed)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * len(ranks)
    dist.all_gather_object(out, obj, group=process_group)
    return out
