"""Host staging buffers for async saves: copy a rank's tensors once, write from the copy.

``save`` copies each tensor into a host buffer and returns; the background
writer encodes and writes straight from those buffers, so the caller may
change its state the moment ``save`` returns. The buffers of a rank are kept
and reused by its next save when the tensors' shapes and dtypes are the same
(no allocation, no page faults on the critical path: first touch of fresh
memory costs more than the copy itself). ``max_pending`` sets of buffers exist
per rank at most; a save that finds every set still being written waits for one.

Sources: numpy arrays (``np.copyto``), torch tensors (``Tensor.copy_``; CUDA
tensors into pinned buffers with ``non_blocking=True``, the writer waits for the
copy's event), jax arrays (``copy_to_host_async`` for all first, then one copy
each), anything else ``np.asarray`` accepts.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..io import pool
from ..read.checkpoint import allocate

#: States from this many bytes are copied by the I/O pool's threads (one per core), in pieces of
#: ``PIECE_BYTES``, on machines of at least ``PARALLEL_CORES`` cores. Threads help when cores are free,
#: as the host's are while a GPU trains: 128 MiB on 2 idle cores, 23 ms by one thread, 11 ms by two;
#: on 2 cores busy with other work they cost a little (34 ms serially, 40 ms by two).
PARALLEL_BYTES = 16 << 20
PARALLEL_CORES = 2
PIECE_BYTES = 8 << 20


def _is_torch(value: Any) -> bool:
    mod = type(value).__module__
    return mod.startswith("torch") and hasattr(value, "detach")


def _is_jax(value: Any) -> bool:
    return type(value).__module__.startswith("jax") and hasattr(value, "copy_to_host_async")


def as_host(value: Any) -> Any:
    """A value the writer can take as a numpy array (torch through its bit-exact view)."""
    if _is_torch(value):
        from ..format.torch_arrays import to_numpy

        return to_numpy(value)
    if _is_jax(value):
        return np.asarray(value)
    return value


def host_dtype(value: Any) -> np.dtype[Any]:
    """The numpy dtype a tensor is stored with (torch bfloat16/float8 through ml_dtypes)."""
    if _is_torch(value):
        import torch

        from ..format.torch_arrays import to_numpy

        return to_numpy(torch.empty(0, dtype=value.dtype)).dtype
    return np.dtype(value.dtype)


@dataclass
class Staged:
    """One rank's copies for one save: ``arrays`` by name, and what to wait for before reading them."""

    arrays: dict[str, np.ndarray]
    nbytes: int
    waits: list[Callable[[], None]] = field(default_factory=list)
    release: Callable[[], None] = lambda: None

    def ready(self) -> None:
        """Block until every asynchronous copy (CUDA) has landed."""
        for wait in self.waits:
            wait()
        self.waits.clear()


class _Slot:
    """One set of buffers of one rank, reused while the tensors keep their shapes and dtypes."""

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None
        self.arrays: list[np.ndarray] = []
        self.pinned: list[Any] = []

    def buffers(self, key: tuple[Any, ...], specs: list[tuple[tuple[int, ...], np.dtype[Any]]],
                pinned: bool) -> list[np.ndarray]:
        if key != self.key:
            self.arrays, self.pinned = [], []
            self.arrays = _pinned(specs, self.pinned) if pinned else allocate(specs)
            if not pinned:
                for a in self.arrays:  # fault the pages in now, not in the next save's copy
                    a.reshape(-1).view(np.uint8)[::4096] = 0
            self.key = key
        return self.arrays


def _pinned(specs: list[tuple[tuple[int, ...], np.dtype[Any]]], keep: list[Any]) -> list[np.ndarray]:
    """Page-locked host buffers (CUDA sources): one pinned torch buffer, numpy views of it."""
    import torch

    sizes = [int(np.prod(shape)) * dtype.itemsize for shape, dtype in specs]
    starts, total = [], 0
    for n in sizes:
        starts.append(total)
        total += -(-n // 64) * 64
    buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
    keep.append(buf)
    flat = buf.numpy()
    return [flat[s : s + n].view(dtype).reshape(shape)
            for s, n, (shape, dtype) in zip(starts, sizes, specs, strict=True)]


class StagingPool:
    """``max_pending`` buffer sets per rank; :meth:`stage` copies into a free one (waiting for one if none is)."""

    def __init__(self, max_pending: int = 1) -> None:
        if not isinstance(max_pending, int) or isinstance(max_pending, bool) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        self.max_pending = max_pending
        self._free: dict[int, list[_Slot]] = {}
        self._cond = threading.Condition()

    def _take(self, rank: int, timeout: float | None, check: Callable[[], None]) -> _Slot:
        with self._cond:
            free = self._free.setdefault(rank, [_Slot() for _ in range(self.max_pending)])
            while not free:
                check()  # a failed background write must not leave us waiting forever
                self._cond.wait(timeout if timeout is not None else 1.0)
            return free.pop()

    def _give(self, rank: int, slot: _Slot) -> None:
        with self._cond:
            self._free[rank].append(slot)
            self._cond.notify_all()

    def stage(self, rank: int, tensors: Mapping[str, Any], check: Callable[[], None] = lambda: None) -> Staged:
        """Copy ``tensors`` into one of ``rank``'s buffer sets; the result's ``release`` gives the set back."""
        names = list(tensors)
        values = [tensors[n] for n in names]
        cuda = [_is_torch(v) and v.device.type == "cuda" for v in values]
        specs = [(tuple(int(s) for s in v.shape), host_dtype(v)) for v in values]
        key = (tuple(names), tuple(specs), any(cuda))
        slot = self._take(rank, None, check)
        try:
            buffers = slot.buffers(key, specs, pinned=any(cuda))
            waits = _copy_all(values, buffers, cuda)
        except BaseException:
            self._give(rank, slot)
            raise
        nbytes = sum(b.nbytes for b in buffers)
        return Staged(dict(zip(names, buffers, strict=True)), nbytes, waits, lambda: self._give(rank, slot))


def _copy_all(values: list[Any], buffers: list[np.ndarray], cuda: list[bool]) -> list[Callable[[], None]]:
    for v in values:
        if _is_jax(v):
            v.copy_to_host_async()  # all transfers in flight before the first wait
    waits: list[Callable[[], None]] = []
    jobs: list[Callable[[], None]] = []
    for value, dst, on_gpu in zip(values, buffers, cuda, strict=True):
        if _is_torch(value):
            _copy_torch(value, dst, on_gpu)  # torch parallelises large copies itself
        else:
            jobs += _copy_jobs(np.asarray(value), dst)
    if sum(dst.nbytes for dst in buffers) >= PARALLEL_BYTES and (os.cpu_count() or 1) >= PARALLEL_CORES:
        pool.run_all(jobs, True)  # np.copyto releases the GIL: a few threads copy faster than one
    else:
        for job in jobs:
            job()
    if any(cuda):
        import torch

        event = torch.cuda.Event()
        event.record()
        waits.append(event.synchronize)
    return waits


def _copy_jobs(src: np.ndarray, dst: np.ndarray) -> list[Callable[[], None]]:
    """Copies of ``src`` into ``dst`` in pieces of about ``PIECE_BYTES`` (contiguous arrays are cut flat)."""
    if src.dtype != dst.dtype or src.shape != dst.shape:
        raise TypeError(f"staging: {src.dtype}{list(src.shape)} does not fit a {dst.dtype}{list(dst.shape)} buffer")
    if not (src.flags.c_contiguous and dst.flags.c_contiguous) or src.nbytes <= PIECE_BYTES:
        return [functools.partial(np.copyto, dst, src)]
    flat_src, flat_dst = src.reshape(-1), dst.reshape(-1)
    step = max(1, PIECE_BYTES // src.itemsize)
    return [functools.partial(np.copyto, flat_dst[i : i + step], flat_src[i : i + step])
            for i in range(0, flat_src.size, step)]


def _copy_torch(value: Any, dst: np.ndarray, on_gpu: bool) -> None:
    import torch

    from ..format.torch_arrays import from_numpy

    with torch.no_grad():
        from_numpy(dst).copy_(value.detach(), non_blocking=on_gpu)
