"""Register reshard's dtypes with zarr-python when zarr is imported, not before.

zarr-python releases before 3.4.1 collect the ``zarr.data_type`` entry points but never load
them, so a process reads reshard's ``bfloat16``/``float8`` arrays with plain zarr only after
:func:`reshard.store.format.zarr_dtypes.register_zarr_dtypes` ran. ``import reshard.store`` promises
that, without importing zarr itself (0.5 s: the command line's ``--help`` would pay it).
:func:`register_dtypes_with_zarr` registers at once when zarr is already imported, else it puts
a finder first on ``sys.meta_path`` that, the first time ``zarr`` is imported, lets zarr's own
loader run and then registers the dtypes, and removes itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any


def _register() -> None:
    module = sys.modules.get(f"{__package__}.zarr_dtypes")
    if module is not None and not hasattr(module, "register_zarr_dtypes"):
        return  # zarr is being imported by reshard's zarr_dtypes module, which registers when it is done
    from .zarr_dtypes import register_zarr_dtypes

    register_zarr_dtypes()


class _AfterZarr(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the loader of the ``zarr`` module so that registration follows it."""

    def find_spec(self, name: str, path: Any, target: ModuleType | None = None) -> ModuleSpec | None:
        if name != "zarr":
            return None
        sys.meta_path.remove(self)  # once, and never in the way of the lookup below
        spec = importlib.util.find_spec("zarr")
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _register()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def register_dtypes_with_zarr() -> None:
    """Register reshard's zarr dtypes now if zarr is imported, else right after zarr is (idempotent)."""
    if "zarr" in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterZarr) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterZarr())
