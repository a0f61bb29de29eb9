"""FSDP1 ``FlatParameter`` state saved as it sits on the ranks: each rank writes its flat ranges, no gather.

FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) flattens the
parameters of each wrapped module into one ``FlatParameter``: the parameters
back to back, with the padding FSDP records (``_numels_with_padding``,
``_is_padding_mask``: 16-byte alignment under ``use_orig_params=True``, and the
end up to a multiple of the world size), cut with ``torch.chunk`` into one
part per rank (the last parts shorter, padded). :func:`flat_param_buffer`
describes that as a :class:`~reshard.layouts.FlatBuffer`, and
:func:`fsdp1_layouts` / :func:`fsdp1_local` give, for a whole model, every
parameter's :class:`~reshard.layouts.FlatLayout` (named as in the model's full
state dict) and this rank's 1-d pieces of it. Any per-rank flat tensor of the
same shape (the optimizer's ``exp_avg`` of a ``FlatParameter`` with
``use_orig_params=False``) splits the same way (:func:`split_flat`)::

    layouts = fsdp1_layouts(model)                     # the same on every rank
    writer = rs.create(url, layouts, save_id=step)
    writer.write(rank, fsdp1_local(model))             # this rank's ranges: no communication
    # barrier, then one rank: writer.commit()

A load of any layout, flat or block, of any world size reads only what it needs
(docs/layouts.md, docs/format.md). The ``FlatParameter`` attributes are read as
they are; torch is imported only to ask a process group for its ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from reshard.layouts import FlatBuffer, FlatLayout
from reshard.layouts.errors import FormatError

from ...format.torch_arrays import to_numpy

#: The name segment FSDP1 inserts for a wrapped module (left out of parameter names).
WRAPPED = "_fsdp_wrapped_module"


def flat_param_buffer(flat_param: Any, ranks: Sequence[int] | Sequence[Sequence[int]]) -> FlatBuffer:
    """The :class:`FlatBuffer` of one FSDP1 ``FlatParameter`` over its sharding group's ``ranks``
    (global ids in group-rank order; a rank a tuple of replicas under hybrid sharding)."""
    numels, padding = list(flat_param._numels_with_padding), list(flat_param._is_padding_mask)
    if len(numels) != len(padding):
        raise FormatError("FlatParameter: _numels_with_padding and _is_padding_mask differ in length")
    offsets, at = [], 0
    for n, pad in zip(numels, padding, strict=True):
        if not pad:
            offsets.append(at)
        at += int(n)
    shapes = [tuple(int(x) for x in s) for s in flat_param._shapes]
    if len(shapes) != len(offsets):
        raise FormatError(f"FlatParameter: {len(shapes)} shapes for {len(offsets)} parameters")
    return FlatBuffer.partitioned(shapes, ranks, offsets=offsets, total=at)


def _handles(model: Any) -> list[tuple[str, Any, Any]]:
    """``(name prefix, FlatParameter, its handle)`` of every FSDP1 unit of ``model`` that holds parameters."""
    out = []
    for name, module in model.named_modules():
        handle = getattr(module, "_handle", None)
        flat = getattr(handle, "flat_param", None)
        if flat is None or not hasattr(flat, "_fqns"):
            continue
        parts = [p for p in name.split(".") if p and p != WRAPPED]
        out.append((".".join(parts) + "." if parts else "", flat, handle))
    if not out:
        raise FormatError("the model has no FSDP1 FlatParameter (wrap it with FullyShardedDataParallel, "
                          "torch.distributed.fsdp)")
    return out


def fsdp1_layouts(model: Any, ranks: Sequence[int] | None = None) -> dict[str, FlatLayout]:
    """Every parameter of an FSDP1 model under its flat layout, by its full-state-dict name.

    ``ranks``: the global ranks of the sharding group in group order (default:
    each unit's process group's ranks; under hybrid sharding pass tuples of replicas).
    """
    layouts = {}
    for prefix, flat, handle in _handles(model):
        buf = flat_param_buffer(flat, list(ranks) if ranks is not None else _group_ranks(handle))
        for t, fqn in enumerate(flat._fqns):
            layouts[prefix + fqn] = buf.layout(t, {"framework": "fsdp1"})
    return layouts


def fsdp1_local(model: Any, rank: int | None = None, ranks: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """This rank's 1-d piece of every parameter of an FSDP1 model (views of its sharded ``FlatParameter``s),
    for the parameters :func:`fsdp1_layouts` gives it."""
    out: dict[str, np.ndarray] = {}
    for prefix, flat, handle in _handles(model):
        group = list(ranks) if ranks is not None else _group_ranks(handle)
        me = rank if rank is not None else group[int(handle.rank)]
        pieces = split_flat(flat_param_buffer(flat, group), me, flat.detach(), flat._fqns)
        out.update({prefix + name: arr for name, arr in pieces.items()})
    return out


def split_flat(buf: FlatBuffer, rank: int, local: Any, names: Sequence[str]) -> dict[str, np.ndarray]:
    """A rank's 1-d flat shard (``local``: numpy or torch) cut into its tensors' ranges, ``{names[t]: 1-d}``."""
    arr = np.asarray(to_numpy(local) if hasattr(local, "detach") else local).reshape(-1)
    out = {}
    for off, t, a, b in buf.part(rank).segments:
        if off + b - a > arr.size:
            raise FormatError(f"rank {rank}'s flat shard has {arr.size} elements; {names[t]!r} needs "
                              f"[{off}, {off + b - a})")
        out[names[t]] = arr[off : off + b - a]
    return out


def _group_ranks(handle: Any) -> list[int]:
    """The global ranks of a handle's sharding group, in group order."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [0]
    return [int(r) for r in dist.get_process_group_ranks(handle.process_group)]
