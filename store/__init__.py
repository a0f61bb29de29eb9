"""reshard.store: checkpoints as zarr v3 arrays whose shards follow the device layout.

Write from every rank with :func:`create` / ``write`` / ``commit`` (or :func:`save`
in one process), read lazily with :func:`open`, load any rank of any layout
with ``Checkpoint.load``, redivide with :func:`redivide`, change the storage form
with :func:`convert`.
"""

from reshard.layouts.errors import *  # noqa: F403  (one errors module for the project)
from reshard.layouts.errors import __all__ as _errors

from .commit.gc import gc
from .commit.locks import unlock
from .commit.protocol import commit
from .format.dtypes import SUPPORTED as SUPPORTED_DTYPES
from .format.dtypes import register_zarr_dtypes
from .format.meta import FORMAT_VERSION
from .io.stats import IOStats
from .manager import CheckpointManager
from .ops.redivide import convert, redivide, save, save_pieces
from .ops.verify import VerifyReport, verify
from .read.checkpoint import Checkpoint, LazyTensor
from .read.export import export
from .read.graph import LoadResult, load_many
from .read.open import open
from .write.writer import CheckpointWriter, create

__version__ = "0.1.0"

register_zarr_dtypes()

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
    "save",
    "save_pieces",
    "unlock",
    "verify",
    "VerifyReport",
]
