"""PyTorch: DTensor state dicts in and out, the DCP plugin, DCP import, FSDP1 flat parameters, ``.pt`` files.

Modules, by step:

* :mod:`.dtensor`: :func:`save` / :func:`load` of DTensor state dicts on every rank, :func:`export_torch`.
* :mod:`.plugin`: ``StorageWriter`` / ``StorageReader``, the DCP storage plugin (loaded on first use: it
  imports torch).
* :mod:`.dcp`: :func:`import_dcp`, :func:`read_dcp_metadata` (DCP's pickled ``.metadata``, restricted).
* :mod:`.fsdp_flat`: FSDP1 ``FlatParameter`` state as it sits on the ranks.
* :mod:`.pt_files`: other frameworks' pickled ``.pt`` files read without running their code
  (DeepSpeed and Megatron-Core build on it).
* :mod:`.exchange`, :mod:`.readplan`: the read-once load over a process group and its plan.

torch is imported inside the functions, never when ``reshard.store`` loads.
"""

from __future__ import annotations

from typing import Any

from ...format.torch_arrays import from_numpy, to_numpy
from .dcp import import_dcp, read_dcp_metadata
from .dtensor import export_torch, layout_of, load, save

# (also StorageWriter and StorageReader, through __getattr__: they import torch)
__all__ = ["export_torch", "from_numpy", "import_dcp", "layout_of", "load", "read_dcp_metadata", "save", "to_numpy"]


def __getattr__(name: str) -> Any:
    """``StorageWriter``/``StorageReader`` (the DCP plugin) import torch, so they load on first use."""
    if name in ("StorageWriter", "StorageReader"):
        from .plugin import StorageReader, StorageWriter

        return StorageReader if name == "StorageReader" else StorageWriter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
