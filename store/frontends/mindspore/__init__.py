"""MindSpore front end: per-rank ``.ckpt`` files and a strategy file <-> a reshard checkpoint.

MindSpore itself is never imported. Its two file formats are read and written
with reshard's small protobuf wire codec:

* ``checkpoint.proto`` ``.ckpt`` files (crc trailer, >512 MiB split values):
  :mod:`reshard.store.frontends.mindspore.ckpt`, whose names are re-exported
  here (:func:`read_ckpt`, :func:`write_ckpt`, :func:`parse_ckpt`,
  :func:`ckpt_headers`).
* per-rank safetensors files (MindSpore >= 2.4, ``format="safetensors"``):
  the same module, by suffix (:func:`read_file`, :func:`file_headers`).
* the strategy file (``node_strategy.proto`` or its JSON form, pipeline-merged
  or not): parsed by :func:`reshard.layouts.parse_strategy`; finding the files:
  :mod:`reshard.store.frontends.mindspore.files`.

:func:`import_mindspore` turns ``rank_N/*.ckpt`` (or ``*.safetensors``) plus the
training strategy into one checkpoint (N -> zarr, one rank file mapped at a
time, each block read once from whichever replica's file holds it);
:func:`export_mindspore` writes ``rank_M/checkpoint_M.ckpt`` (or ``.safetensors``)
for any target strategy (what ``transform_checkpoints`` does, for any N -> M,
64 -> 56 included), each rank reading only its own region.

Optimizer state: a tensor named ``<prefix><param>`` (``moments.``, ``adam_m.``,
``adam_v.``, ... see :data:`OPTIMIZER_PREFIXES`) that the strategy does not
name itself uses ``<param>``'s entry, optimizer sharding included
(``opt_weight_shard_size``; the shard step is implied by the layout);
``accu_grads.<param>`` uses it without the optimizer sharding (docs/mindspore.md,
"Optimizer state"). Tensors the strategy does not cover are whole copies on the
ranks whose files hold them.
"""

from reshard.layouts import OPTIMIZER_PREFIXES, layout_for

from .ckpt import (
    SLICE_BYTES,
    TYPES,
    Header,
    ckpt_headers,
    file_headers,
    parse_ckpt,
    read_ckpt,
    read_file,
    write_ckpt,
    write_file,
)
from .files import StrategyLike, latest_file, load_strategy, rank_files
from .read import import_mindspore
from .write import export_mindspore

__all__ = ["OPTIMIZER_PREFIXES", "SLICE_BYTES", "TYPES", "Header", "StrategyLike", "ckpt_headers",
           "export_mindspore", "file_headers", "import_mindspore", "latest_file", "layout_for", "load_strategy",
           "parse_ckpt", "rank_files", "read_ckpt", "read_file", "write_ckpt", "write_file"]
