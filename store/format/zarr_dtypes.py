"""zarr-python data types for the ml_dtypes floats, under TensorStore's names.

Kept apart from :mod:`reshard.store.format.dtypes` so that only what needs zarr-python
imports it: importing this module imports zarr and registers the types with it
(:func:`register_zarr_dtypes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, TypeGuard

import ml_dtypes
import numpy as np
from zarr.core.dtype.npy.float import BaseFloat

#: The numpy dtypes of the types below (:mod:`.dtypes` has the same; this module imports nothing of reshard's).
_BY_NAME: dict[str, np.dtype[Any]] = {"bfloat16": np.dtype(ml_dtypes.bfloat16),
                                      "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
                                      "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}


class _MLFloat(BaseFloat):
    """A zarr-python data type for one ml_dtypes float, under TensorStore's name.

    Subclasses set ``dtype_cls``, ``_zarr_v3_name`` and ``_native``. They are
    module-level classes so that zarr-python can load them from reshard's
    ``zarr.data_type`` entry points (pyproject.toml) without ``import reshard.store``.
    """

    _native: ClassVar[np.dtype[Any]]
    _zarr_v2_names: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def _check_native_dtype(cls, dtype: Any) -> TypeGuard[Any]:
        return bool(np.dtype(dtype) == cls._native)

    def to_native_dtype(self) -> Any:
        return self._native

    @property
    def item_size(self) -> int:
        return int(self._native.itemsize)


@dataclass(frozen=True, kw_only=True)
class BFloat16(_MLFloat):
    """``bfloat16`` (ml_dtypes.bfloat16)."""

    dtype_cls = type(_BY_NAME["bfloat16"])
    _zarr_v3_name: ClassVar[str] = "bfloat16"
    _native: ClassVar[np.dtype[Any]] = _BY_NAME["bfloat16"]


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(_MLFloat):
    """``float8_e4m3fn`` (ml_dtypes.float8_e4m3fn)."""

    dtype_cls = type(_BY_NAME["float8_e4m3fn"])
    _zarr_v3_name: ClassVar[str] = "float8_e4m3fn"
    _native: ClassVar[np.dtype[Any]] = _BY_NAME["float8_e4m3fn"]


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(_MLFloat):
    """``float8_e5m2`` (ml_dtypes.float8_e5m2)."""

    dtype_cls = type(_BY_NAME["float8_e5m2"])
    _zarr_v3_name: ClassVar[str] = "float8_e5m2"
    _native: ClassVar[np.dtype[Any]] = _BY_NAME["float8_e5m2"]


#: The zarr-python data types reshard adds, by stored name (also declared as
#: ``zarr.data_type`` entry points in pyproject.toml).
ZARR_DTYPES: dict[str, type[_MLFloat]] = {c._zarr_v3_name: c for c in (BFloat16, Float8E4M3FN, Float8E5M2)}


def register_zarr_dtypes() -> None:
    """Teach zarr-python the ml_dtypes types under TensorStore's names (idempotent).

    Importing this module calls it; ``import reshard.store`` has it called when zarr is
    imported (:mod:`reshard.store.format.zarr_hook`). zarr-python >= 3.4.1 also finds these types
    by itself through reshard's ``zarr.data_type`` entry points; older zarr 3
    releases collect entry points of that group but never load them.
    """
    from zarr.core.dtype import data_type_registry

    for name, cls in ZARR_DTYPES.items():
        if data_type_registry.contents.get(name) is not cls:
            data_type_registry.register(name, cls)


register_zarr_dtypes()
