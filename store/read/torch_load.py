"""``Checkpoint.load(..., as_="torch", device=..., pin_memory=...)``: torch tensors straight from the reads.

Fresh tensors are cut from one byte buffer (as :func:`reshard.store.read.checkpoint.allocate`
does for numpy), pinned when asked or when they go to an accelerator, and
the reads land in it directly. For an accelerator device each tensor is then
copied with ``non_blocking=True`` and the stream synchronised before
returning, so the pinned staging can be dropped safely. Given ``out`` tensors
that are CPU, contiguous and of the stored dtype are read into in place; any
other (another device or dtype) receives a staged copy (``Tensor.copy_``).

torch is imported inside the functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from reshard.layouts.errors import ShapeMismatchError

from ..format.torch_arrays import to_numpy

ALIGN = 64


def can_pin() -> bool:
    """Whether page-locked host memory is available (an accelerator torch can use is present)."""
    import torch

    return bool(torch.cuda.is_available())


def host_tensors(specs: list[tuple[tuple[int, ...], np.dtype[Any]]], pin: bool = False) -> list[tuple[Any, np.ndarray]]:
    """``(tensor, numpy view)`` pairs cut from one CPU byte buffer, pinned if ``pin`` and possible.

    Both members of a pair share memory: reading into the numpy view fills
    the tensor. bfloat16 and float8 included (see :mod:`.torch_arrays`).
    """
    import torch

    from ..format.dtypes import dtype_name

    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    starts, total = [], 0
    for n in sizes:
        starts.append(total)
        total += -(-n // ALIGN) * ALIGN
    buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin and can_pin())
    out = []
    for at, n, (shape, dtype) in zip(starts, sizes, specs, strict=True):
        tensor = buf[at:at + n].view(getattr(torch, dtype_name(dtype))).view(shape)
        out.append((tensor, to_numpy(tensor)))
    return out


def _flat(node: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        out.update(_flat(value, name) if isinstance(value, Mapping) else {name: value})
    return out


def load_torch(ckpt: Any, wanted: list[tuple[str, Any, tuple[int, ...], Any]], out: Mapping[str, Any] | None,
               device: Any, pin_memory: bool) -> dict[str, Any]:
    """Read ``wanted`` ``(name, meta, local shape, region)`` into torch tensors; return them by dotted name.

    Sets ``ckpt.last_stats``.
    """
    import torch

    dev = torch.device(device) if device is not None else torch.device("cpu")
    given = _flat(out) if out is not None else {}
    fresh = [w for w in wanted if w[0] not in given]
    pieces = iter(host_tensors([(shape, meta.np_dtype) for _, meta, shape, _ in fresh],
                               pin=pin_memory or dev.type != "cpu"))
    jobs: list[tuple[Any, Any, np.ndarray]] = []
    result: dict[str, Any] = {}
    staged: list[tuple[Any, Any]] = []
    moved: list[str] = []
    for name, meta, shape, region in wanted:
        if name not in given:
            tensor, view = next(pieces)
            jobs.append((meta, region, view))
            result[name] = tensor
            if dev.type != "cpu":
                moved.append(name)
            continue
        target = given[name]
        if not isinstance(target, torch.Tensor) or tuple(target.shape) != shape:
            raise ShapeMismatchError(f"tensor {meta.name!r}: out value is {type(target).__name__}"
                                     f"{list(getattr(target, 'shape', []))}, rank needs {list(shape)}")
        direct = to_numpy(target) if target.device.type == "cpu" and target.is_contiguous() else None
        if direct is not None and direct.dtype == meta.np_dtype:
            jobs.append((meta, region, direct))
        else:
            [(stage, stage_view)] = host_tensors([(shape, meta.np_dtype)], pin=target.device.type != "cpu")
            jobs.append((meta, region, stage_view))
            staged.append((target, stage))
        result[name] = target
    ckpt.last_stats = ckpt.read_regions(jobs)
    with torch.no_grad():
        for target, stage in staged:
            target.copy_(stage, non_blocking=target.device.type == "cuda")
        for name in moved:
            result[name] = result[name].to(dev, non_blocking=dev.type == "cuda")
    if torch.cuda.is_available() and (moved or any(t.device.type == "cuda" for t, _ in staged)):
        torch.cuda.synchronize()  # the pinned staging may be freed once we return
    return result
