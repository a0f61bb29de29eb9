"""reshard.store: checkpoints as zarr v3 arrays whose shards follow the device layout.

Write from every rank with :func:`create` / ``write`` / ``commit`` (or :func:`save`
in one process), read lazily with :func:`open`, load any rank of any layout
with ``Checkpoint.load``, redivide with :func:`redivide`, change the storage form
with :func:`convert`.

The public names are imported on first use (PEP 562), so that ``import reshard.store`` and the
command line start quickly (``reshard --help`` imports neither zarr nor numpy). zarr-python
releases before 3.4.1 do not load reshard's ``zarr.data_type`` entry points: reshard registers
its dtypes with zarr the moment zarr is imported in a process that imported ``reshard.store``
(:mod:`reshard.store.format.zarr_hook`), or at once when zarr was imported before.
"""

from typing import TYPE_CHECKING, Any

from reshard.layouts.errors import *  # noqa: F403  (one errors module for the project)
from reshard.layouts.errors import __all__ as _errors

from . import commit as _commit_folder  # noqa: F401
from .format.zarr_hook import register_dtypes_with_zarr

# ``commit`` names both a subpackage and the function exported here: the subpackage is imported
# above and its binding dropped, so that ``reshard.store.commit`` resolves (``__getattr__``) to
# the function, as when this package imported everything at once.
del globals()["commit"]

__version__ = "0.1.0"

#: Where each public name lives (module under reshard.store, name there).
_HOMES = {
    "FORMAT_VERSION": ("format.meta", "FORMAT_VERSION"),
    "SUPPORTED_DTYPES": ("format.dtypes", "SUPPORTED"),
    "register_zarr_dtypes": ("format.zarr_dtypes", "register_zarr_dtypes"),
    "Checkpoint": ("read.checkpoint", "Checkpoint"),
    "LazyTensor": ("read.checkpoint", "LazyTensor"),
    "CheckpointManager": ("manager", "CheckpointManager"),
    "CheckpointWriter": ("write.writer", "CheckpointWriter"),
    "create": ("write.writer", "create"),
    "IOStats": ("io.stats", "IOStats"),
    "LoadResult": ("read.graph", "LoadResult"),
    "load_many": ("read.graph", "load_many"),
    "commit": ("commit.protocol", "commit"),
    "convert": ("ops.redivide", "convert"),
    "redivide": ("ops.redivide", "redivide"),
    "save": ("ops.redivide", "save"),
    "save_pieces": ("ops.redivide", "save_pieces"),
    "export": ("read.export", "export"),
    "gc": ("commit.gc", "gc"),
    "open": ("read.open", "open"),
    "unlock": ("commit.locks", "unlock"),
    "verify": ("ops.verify", "verify"),
    "VerifyReport": ("ops.verify", "VerifyReport"),
}

if TYPE_CHECKING:
    from .commit.gc import gc
    from .commit.locks import unlock
    from .commit.protocol import commit
    from .format.dtypes import SUPPORTED as SUPPORTED_DTYPES
    from .format.meta import FORMAT_VERSION
    from .format.zarr_dtypes import register_zarr_dtypes
    from .io.stats import IOStats
    from .manager import CheckpointManager
    from .ops.redivide import convert, redivide, save, save_pieces
    from .ops.verify import VerifyReport, verify
    from .read.checkpoint import Checkpoint, LazyTensor
    from .read.export import export
    from .read.graph import LoadResult, load_many
    from .read.open import open
    from .write.writer import CheckpointWriter, create


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, attr = _HOMES[name]
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


register_dtypes_with_zarr()

__all__ = [
    *_errors,
    "FORMAT_VERSION",
    "SUPPORTED_DTYPES",
    "Checkpoint",
    "CheckpointManager",
    "CheckpointWriter",
    "IOStats",
    "LazyTensor",
    "LoadResult",
    "commit",
    "convert",
    "create",
    "export",
    "gc",
    "load_many",
    "open",
    "redivide",
    "register_zarr_dtypes",
    "save",
    "save_pieces",
    "unlock",
    "verify",
    "VerifyReport",
]
