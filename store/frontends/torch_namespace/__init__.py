"""``reshard.torch``: the torch front end under a short name (pyproject maps the package here).

``dcp.save(sd, storage_writer=reshard.torch.StorageWriter(url))`` and
``dcp.load(sd, storage_reader=reshard.torch.StorageReader(url))``: the DCP
storage plugin (docs/torch.md), plus the front end's functions. Everything is
:mod:`reshard.store.frontends.torch`; torch itself loads on first use of the plugin.
"""

from __future__ import annotations

from typing import Any

from reshard.store.frontends import torch as _front
from reshard.store.frontends.torch import (
    export_torch,
    from_numpy,
    import_dcp,
    layout_of,
    load,
    read_dcp_metadata,
    save,
    to_numpy,
)

__all__ = ["StorageReader", "StorageWriter", "export_torch", "from_numpy", "import_dcp", "layout_of", "load",
           "read_dcp_metadata", "save", "to_numpy"]


def __getattr__(name: str) -> Any:
    """``StorageWriter``/``StorageReader`` import torch: loaded on first use."""
    return getattr(_front, name)
