"""Megatron-Core ``dist_checkpointing`` saves (``torch_dist``), in and out, without Megatron.

* :mod:`.read`: :func:`import_megatron` (every form the distributed optimizer saves).
* :mod:`.buckets`: the ``dp_reshardable`` form's flat buckets -> each parameter's own shape.
* :mod:`.write`: :func:`export_megatron` (back to a ``fully_reshardable`` save).

A ``torch_dist`` save is a DCP folder: its metadata and ``common.pt`` are read with
:mod:`reshard.store.frontends.torch` (:mod:`~reshard.store.frontends.torch.dcp`,
:mod:`~reshard.store.frontends.torch.pt_files`).
"""

from __future__ import annotations

from .read import flat_layout, import_megatron, read_megatron_metadata
from .write import export_megatron

__all__ = ["export_megatron", "flat_layout", "import_megatron", "read_megatron_metadata"]
