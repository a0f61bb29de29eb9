"""Data types: the names written to zarr metadata and their numpy twins.

Names follow the zarr v3 core spec and, for the types the spec lacks
(``bfloat16``, ``float8_e4m3fn``, ``float8_e5m2``), the names TensorStore uses,
so TensorStore reads the files natively. numpy gets these types from
``ml_dtypes``; zarr-python gets them from
:func:`reshard.store.format.zarr_dtypes.register_zarr_dtypes` (``import reshard.store``
arranges that when zarr is imported: :mod:`reshard.store.format.zarr_hook`). This module
does not import zarr (0.4 s): reshard's own reads and writes, and the importers, do not
need it. ``register_zarr_dtypes``, ``ZARR_DTYPES`` and the dtype classes are still found
here (the ``zarr.data_type`` entry points of earlier installs name this module).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
from reshard.layouts.errors import DTypeMismatchError

_BY_NAME: dict[str, np.dtype[Any]] = {
    "bool": np.dtype(np.bool_),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}
_BY_DTYPE = {dt: name for name, dt in _BY_NAME.items()}

#: Every dtype name a checkpoint may hold.
SUPPORTED = tuple(_BY_NAME)

#: safetensors dtype names of the stored dtypes.
SAFETENSORS_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "int32": "I32",
    "uint32": "U32", "int64": "I64", "uint64": "U64", "float16": "F16", "bfloat16": "BF16",
    "float32": "F32", "float64": "F64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}


def dtype_name(dtype: Any) -> str:
    """Return the stored name of a numpy dtype (native byte order assumed).

    Raises
    ------
    DTypeMismatchError
        If reshard cannot store the dtype.
    """
    dt = np.dtype(dtype).newbyteorder("=")
    try:
        return _BY_DTYPE[dt]
    except KeyError:
        raise DTypeMismatchError(
            f"dtype {dt} is not supported; supported: {', '.join(SUPPORTED)}"
        ) from None


def numpy_dtype(name: str) -> np.dtype[Any]:
    """Return the numpy dtype for a stored dtype name."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise DTypeMismatchError(
            f"stored dtype {name!r} is unknown; known: {', '.join(SUPPORTED)}"
        ) from None


#: Names of :mod:`reshard.store.format.zarr_dtypes` also found here (imported, with zarr, on first use).
_ZARR_NAMES = ("register_zarr_dtypes", "ZARR_DTYPES", "BFloat16", "Float8E4M3FN", "Float8E5M2")


def __getattr__(name: str) -> Any:
    if name in _ZARR_NAMES:
        from . import zarr_dtypes

        return getattr(zarr_dtypes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
