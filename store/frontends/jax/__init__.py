"""JAX front end: ``jax.Array`` pytrees in and out, Orbax import.

:func:`save` writes every addressable shard of every array with rank = the
device id (replicas are written once), :func:`restore` builds arrays on any
mesh, reading only the regions the target devices hold (each distinct
region once, in batches). :func:`import_orbax` converts an Orbax checkpoint
(OCDBT or not) through Orbax's own metadata and TensorStore, one saved block
at a time.

jax and orbax are imported inside the functions, never when ``reshard.store`` loads.

Modules: :mod:`.arrays` (:func:`save`, :func:`restore`, :func:`layout_of`, :func:`key_name`) and
:mod:`.orbax` (:func:`import_orbax`, :func:`orbax_item`).
"""

from __future__ import annotations

from .arrays import key_name, layout_of, restore, save
from .orbax import import_orbax, orbax_item

__all__ = ["import_orbax", "key_name", "layout_of", "orbax_item", "restore", "save"]
