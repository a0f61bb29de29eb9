"""Read-once loads over a torch process group: each stored byte read by one rank, sent to the others.

:func:`read_once` runs on every rank of a group. The ranks first share, in one
``all_gather_object``, which box of which tensor each needs (and any error
met so far, and which save each opened); then each computes the same plan
(:func:`reshard.store.frontends.torch.readplan.plan`: who reads which stored part,
balanced over the ranks) and the plan runs in rounds. In a round every rank
reads its units through the checkpoint's one I/O path
(:meth:`reshard.store.read.checkpoint.Checkpoint.read_regions`, all of the
round's regions in one call), then one ``all_to_all_single`` of bytes hands
every part to the ranks that need it, and each rank copies what it received
into its tensors (``Tensor.copy_``: any dtype, any device).

The exchange buffers live on the device the group's backend talks through:
CPU for gloo, the current CUDA device for NCCL (the sender's bytes go through
one pinned staging copy, the receiver's land in device memory and are copied
to the device tensors there). Every pair of ranks also exchanges a 64-byte
header per round whose first byte says whether the sender failed: a rank whose
read fails still takes part in the round's collective, so every rank learns of
it in the same round and all raise (the failing rank its own error, the others
a ``RuntimeError`` naming it); a failure copying a round's parts into the
tensors is told in the next round's headers, or in one last small
``all_gather_object`` after the last round. A rank that dies makes the others'
collective fail (or time out, by the group's timeout) instead.

torch is imported inside the functions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ...format.torch_arrays import from_numpy, to_numpy
from ...io.stats import IOStats
from . import readplan
from .readplan import Box, Plan, slices, volume, within

if TYPE_CHECKING:
    from ...read.checkpoint import Checkpoint

#: Every part in an exchange buffer starts at a multiple of this (a header is this long).
ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def group_positions(process_group: Any) -> tuple[int, list[int]]:
    """This process's position in the group and the global rank at each position."""
    import torch.distributed as dist

    group: Any = process_group if process_group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    return dist.get_rank(group), [dist.get_global_rank(group, i) for i in range(size)]


def _comm_device(process_group: Any) -> Any:
    """Where exchange buffers go: the current CUDA device under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    backend = str(dist.get_backend(process_group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _saved(ckpt: Checkpoint | None) -> str | None:
    """What identifies the opened save: its marker's digest (or its save_id)."""
    if ckpt is None:
        return None
    if ckpt.marker is not None:
        return hashlib.sha256(ckpt.marker).hexdigest()
    return ckpt.save_id or ckpt.url


def read_once(ckpt: Checkpoint | None, targets: Mapping[str, tuple[Any, Box]], failure: BaseException | None,
              process_group: Any, budget: int = readplan.DEFAULT_BUDGET) -> IOStats:
    """Fill ``targets`` ``{name: (torch tensor, global box)}`` on every rank of ``process_group``.

    Call on every rank. ``failure``: what went wrong on this rank before (the
    checkpoint did not open, a name is missing): every rank then raises.

    Returns
    -------
    IOStats
        This rank's storage reads (what it read for the group).

    Raises
    ------
    RuntimeError
        Another rank failed (this rank's own failure is raised as it is), or the
        ranks opened different saves of the checkpoint.
    """
    import torch.distributed as dist

    me, order = group_positions(process_group)
    error = None if failure is None else f"{type(failure).__name__}: {failure}"
    needs = [(name, box) for name, (_, box) in targets.items()]
    shared: list[Any] = [None] * len(order)
    dist.all_gather_object(shared, (error, _saved(ckpt), needs if error is None else []), group=process_group)
    _raise_if_failed([e for e, _, _ in shared], order, failure)
    if len({s for _, s, _ in shared}) > 1:
        raise RuntimeError(f"reshard load: the ranks opened different saves of {ckpt.url if ckpt else '?'} "
                           "(it was committed anew meanwhile); load again")
    assert ckpt is not None
    wanted = [dict(n) for _, _, n in shared]
    metas = {name: ckpt.tensor(name).resolve() for need in wanted for name in need}
    plan = readplan.plan(wanted, metas, budget)
    device = _comm_device(process_group)
    stats = IOStats()
    late: BaseException | None = None  # a failure placing a round's parts: told in the next round's headers
    for r in range(len(plan.rounds)):
        got, late = _round(ckpt, plan, r, me, order, targets, metas, device, process_group, late)
        stats.add(**got.as_dict())
    errors: list[Any] = [None] * len(order)  # the last round's placing, agreed
    dist.all_gather_object(errors, None if late is None else f"{type(late).__name__}: {late}", group=process_group)
    _raise_if_failed(errors, order, late)
    return stats


def _raise_if_failed(errors: list[str | None], order: list[int], failure: BaseException | None) -> None:
    failed = [f"rank {rank}: {e}" for rank, e in zip(order, errors, strict=True) if e]
    if not failed:
        return
    if failure is not None:
        raise failure
    raise RuntimeError("reshard load failed on another rank; " + "; ".join(failed))


def _round(ckpt: Checkpoint, plan: Plan, r: int, me: int, order: list[int],
           targets: Mapping[str, tuple[Any, Box]], metas: Mapping[str, Any], device: Any,
           process_group: Any, late: BaseException | None) -> tuple[IOStats, BaseException | None]:
    """One round: read this rank's units, exchange, place; every rank learns whether any failed.

    ``late``: a failure of this rank placing the previous round's parts. Returns the
    round's read counters and a failure placing this round's parts (None if none).
    """
    import torch
    import torch.distributed as dist

    n = len(order)
    transfers = plan.transfers(r)

    def size(parts: list[tuple[int, int]]) -> int:
        return ALIGN + sum(_aligned(volume(plan.units[u].cells[c].box) * plan.units[u].itemsize) for u, c in parts)

    send_sizes = [size(transfers.get((me, dst), [])) for dst in range(n)]
    recv_sizes = [size(transfers.get((src, me), [])) for src in range(n)]
    data: dict[int, np.ndarray] = {}
    direct: set[int] = set()
    stats = IOStats()
    failure = late
    send = torch.zeros(sum(send_sizes), dtype=torch.uint8, pin_memory=device.type == "cuda")
    try:
        if failure is not None:
            raise failure
        jobs = []
        for u in plan.rounds[r]:
            unit = plan.units[u]
            if unit.reader != me:
                continue
            meta = metas[unit.name]
            view = _direct_view(unit, me, targets, meta.np_dtype)
            if view is not None:
                direct.add(u)
            data[u] = view if view is not None else np.empty(tuple(b - a for a, b in unit.box), meta.np_dtype)
            jobs.append((meta, slices(unit.box), data[u]))
        if jobs:
            stats = ckpt.read_regions(jobs)
        _pack(send.numpy(), plan, transfers, me, send_sizes, data, metas)
    except Exception as e:  # told to every rank through the headers, then raised below
        failure = e
    buf = send.numpy()
    for at in np.cumsum([0, *send_sizes[:-1]]):
        buf[at] = 1 if failure is not None else 0
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send.to(device, non_blocking=True), recv_sizes, send_sizes, group=process_group)
    starts = np.cumsum([0, *recv_sizes[:-1]])
    flags = recv[torch.as_tensor(starts, device=device)].cpu().tolist()
    if failure is not None or any(flags):
        errors: list[Any] = [None] * n
        mine = None if failure is None else f"{type(failure).__name__}: {failure}"
        dist.all_gather_object(errors, mine, group=process_group)
        _raise_if_failed(errors, order, failure)
    try:
        _place_own(plan, r, me, data, direct, targets)
        _place_received(recv, plan, transfers, me, starts, targets, metas)
    except Exception as e:
        return stats, e
    return stats, None


def _direct_view(unit: readplan.Unit, me: int, targets: Mapping[str, tuple[Any, Box]],
                 dtype: np.dtype[Any]) -> np.ndarray | None:
    """The target's memory for a unit that is one cell this rank needs, if the read can land there
    (a CPU, contiguous tensor of the stored dtype)."""
    if len(unit.cells) != 1 or me not in unit.cells[0].needers or unit.name not in targets:
        return None
    tensor, box = targets[unit.name]
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or _torch_dtype(dtype) != tensor.dtype:
        return None
    return to_numpy(tensor)[within(unit.box, box)]


def _pack(buf: np.ndarray, plan: Plan, transfers: dict[tuple[int, int], list[tuple[int, int]]], me: int,
          send_sizes: list[int], data: dict[int, np.ndarray], metas: Mapping[str, Any]) -> None:
    """Copy each part this rank sends into its place in the send buffer (after each peer's header)."""
    at = 0
    for dst, size in enumerate(send_sizes):
        pos = at + ALIGN
        for u, c in transfers.get((me, dst), ()):
            unit = plan.units[u]
            cell = unit.cells[c]
            shape = tuple(b - a for a, b in cell.box)
            nbytes = volume(cell.box) * unit.itemsize
            buf[pos:pos + nbytes].view(metas[unit.name].np_dtype).reshape(shape)[...] = \
                data[u][within(cell.box, unit.box)]
            pos += _aligned(nbytes)
        at += size


def _place_own(plan: Plan, r: int, me: int, data: dict[int, np.ndarray], direct: set[int],
               targets: Mapping[str, tuple[Any, Box]]) -> None:
    """Copy the parts this rank read for itself into its tensors (those read in place are there already)."""
    import torch

    with torch.no_grad():
        for u, array in data.items():
            if u in direct:
                continue
            unit = plan.units[u]
            for cell in unit.cells:
                if me in cell.needers:
                    tensor, box = targets[unit.name]
                    tensor[within(cell.box, box)].copy_(from_numpy(array[within(cell.box, unit.box)]))


def _place_received(recv: Any, plan: Plan, transfers: dict[tuple[int, int], list[tuple[int, int]]], me: int,
                    starts: Any, targets: Mapping[str, tuple[Any, Box]], metas: Mapping[str, Any]) -> None:
    """Copy every part received into this rank's tensors (on the receive buffer's device, cast as needed)."""
    import torch

    with torch.no_grad():
        for src, start in enumerate(starts):
            pos = int(start) + ALIGN
            for u, c in transfers.get((src, me), ()):
                unit = plan.units[u]
                cell = unit.cells[c]
                nbytes = volume(cell.box) * unit.itemsize
                part = recv[pos:pos + nbytes].view(_torch_dtype(metas[unit.name].np_dtype)).view(
                    tuple(b - a for a, b in cell.box))
                tensor, box = targets[unit.name]
                tensor[within(cell.box, box)].copy_(part, non_blocking=part.device.type == "cuda")
                pos += _aligned(nbytes)
    if recv.device.type == "cuda":
        torch.cuda.synchronize(recv.device)  # the receive buffer is freed when this returns


def _torch_dtype(dtype: np.dtype[Any]) -> Any:
    """The torch dtype of a stored numpy dtype (bfloat16 and float8 included)."""
    return from_numpy(np.empty(0, dtype)).dtype
