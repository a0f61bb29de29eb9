"""Presets: a framework's own parallel layouts, by tensor name (``reshard redivide --preset megatron``).

Pure math (names and shapes in, :class:`~reshard.layouts.Layout` out), so it
sits in ``layouts`` rather than beside one framework's reader: the ``megatron``
preset applies to Megatron-Core names and to Hugging Face names alike, and a
caller lays out a checkpoint it has not imported, or an in-memory state dict,
without the store.

* :mod:`.rules`: the name rules (column-, row-, vocab-parallel, whole, fused);
* :mod:`.core`: the mesh (Megatron's rank order ``tp-cp-ep-dp-pp``), the checks
  (heads, query groups, experts, layers) and the layouts.
"""

from .core import AXES, Counts, Mesh, PresetError, PresetResult, megatron_layouts
from .rules import Rule, match

__all__ = ["AXES", "Counts", "Mesh", "PresetError", "PresetResult", "Rule", "match", "megatron_layouts"]
