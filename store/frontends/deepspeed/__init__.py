"""DeepSpeed ZeRO-1/2/3 saves (tensor-parallel too), in and out, without DeepSpeed.

* :mod:`.read`: :func:`import_deepspeed` (a ZeRO save -> a reshard checkpoint, flat ranges kept).
* :mod:`.write`: :func:`export_deepspeed` (back to a ZeRO save for any DP and TP size).
* :mod:`.tp`: how a parameter's tensor-parallel slices join, and the layout of the whole.

The ``.pt`` files are read with :mod:`reshard.store.frontends.torch.pt_files` (no unpickling of code).
"""

from __future__ import annotations

from .read import group_buffer, import_deepspeed
from .write import deepspeed_layouts, export_deepspeed

__all__ = ["deepspeed_layouts", "export_deepspeed", "group_buffer", "import_deepspeed"]
