"""torch tensors <-> numpy arrays, every bit kept (bfloat16 and float8 included).

torch is imported inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .dtypes import dtype_name

#: torch dtypes numpy lacks, moved bit for bit through a same-width integer view.
_VIEWS = {
    "bfloat16": ("int16", ml_dtypes.bfloat16),
    "float8_e4m3fn": ("uint8", ml_dtypes.float8_e4m3fn),
    "float8_e5m2": ("uint8", ml_dtypes.float8_e5m2),
}


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy array of a torch tensor's values (a view, without copy, for contiguous CPU tensors).

    bfloat16 and float8 go through an integer view of the same width: no
    float round trip, every bit kept.
    """
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name in _VIEWS:
        int_name, np_dtype = _VIEWS[name]
        return t.view(getattr(torch, int_name)).numpy().view(np_dtype)
    return t.numpy()


def from_numpy(array: np.ndarray) -> Any:
    """A CPU torch tensor sharing ``array``'s memory (inverse of :func:`to_numpy`)."""
    import torch

    name = dtype_name(array.dtype)
    if name in _VIEWS:
        int_name, _ = _VIEWS[name]
        return torch.from_numpy(array.view(int_name)).view(getattr(torch, name))
    return torch.from_numpy(array)
