"""Writing a Megatron-Core ``torch_dist`` save back, in the ``fully_reshardable`` form (``reshard export megatron``).

:func:`export_megatron` takes a checkpoint imported by
:func:`reshard.store.frontends.megatron.read.import_megatron` (any of its forms; the
tensors may since have been redivided to any layouts) and writes a
``dist_checkpointing`` folder that Megatron-Core loads at any tensor- or
data-parallel size with ``metadata={"distrib_optim_sharding_type":
"fully_reshardable"}``: every tensor whole under its name (the optimizer state
``optimizer.state.<param|exp_avg|exp_avg_sq>.<key>`` in each parameter's shape;
the ``fully_sharded_model_space`` name ``fp32_param`` becomes ``param``), the
model's ShardedObjects (``<key>/shard_<i>_<n>`` leaves) as DCP byte items,
``common.pt`` with the optimizer's param groups and
``param_state_sharding_type``, and ``metadata.json``.

torch DCP writes the folder (``.metadata``, ``__0_0.distcp``) in one process;
each tensor is read from the checkpoint when DCP writes it, so one tensor is
in memory at a time. ``common.pt`` and the byte items are ``torch.save`` d
(Megatron's own format; reshard's never pickles): only plain values, the JSON
leaves of the import.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

from reshard.layouts.errors import FormatError

from ...format.torch_arrays import from_numpy
from ...io.replace import refuse_existing, replacing
from ...read.checkpoint import Checkpoint
from ...read.open import open as open_checkpoint
from ..sources import local_path

STATE = re.compile(r"optimizer\.state\.(fp32_param|param|exp_avg|exp_avg_sq)\.(.+)")
OBJECT = re.compile(r".+/shard_[0-9_.]+")
DIST_OPT = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.optimizer(/shard_.*)?")
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}


def export_megatron(src: str | Checkpoint, dst: str, *, storage_options: dict[str, Any] | None = None,
                    overwrite: bool = False) -> dict[str, Any]:
    """Write checkpoint ``src`` (imported from Megatron-Core) as a ``torch_dist`` save, ``fully_reshardable`` form.

    Parameters
    ----------
    src : str or Checkpoint
        A checkpoint :func:`~reshard.store.frontends.megatron.read.import_megatron` wrote (or a redivision of one).
    dst : str
        A local folder, written beside it and swapped in whole (:mod:`reshard.store.io.replace`): a kill
        leaves the old folder or the new one.
    storage_options : dict, optional
        fsspec options of ``src``.
    overwrite : bool
        Replace a ``dst`` that is not empty (else :class:`~reshard.layouts.errors.CheckpointExistsError`).

    Returns
    -------
    dict
        ``{"tensors", "states", "objects", "folder"}``.

    Raises
    ------
    FormatError
        When ``src`` holds no optimizer param groups (not a Megatron import).
    CheckpointExistsError
        ``dst`` is not empty and ``overwrite`` is False.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src, storage_options=storage_options)
    folder = local_path(dst)
    refuse_existing(folder, overwrite)
    names: dict[str, str] = {}  # DCP key -> checkpoint tensor
    states = 0
    for name in sorted(ckpt.arrays):
        m = STATE.fullmatch(name)
        key = f"optimizer.state.{'param' if m.group(1) == 'fp32_param' else m.group(1)}.{m.group(2)}" if m else name
        if key in names:
            raise FormatError(f"{ckpt.url}: tensors {names[key]!r} and {name!r} would both be written as {key!r}")
        names[key] = name
        states += m is not None
    leaves = ckpt.leaves
    objects = {k: v for k, v in leaves.items() if OBJECT.fullmatch(k) and not DIST_OPT.fullmatch(k)}
    common = _common(ckpt.url, leaves)
    state_dict: dict[str, Any] = {}
    for key, name in names.items():
        meta = ckpt.tensor(name)
        state_dict[key] = torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device="meta")
    state_dict.update(objects)

    class Planner(DefaultSavePlanner):
        """Reads each tensor from the checkpoint when DCP writes it (the state dict holds meta tensors)."""

        def lookup_object(self, index: Any) -> Any:
            if index.fqn in names:
                return from_numpy(ckpt[names[index.fqn]].read())
            return super().lookup_object(index)

    with replacing(folder, overwrite=overwrite, folder=True) as staging, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)  # no_dist
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(staging, thread_count=1, single_file_per_rank=True),
                 planner=Planner(flatten_state_dict=False), no_dist=True)
        torch.save(common, os.path.join(staging, "common.pt"))
        with open(os.path.join(staging, "metadata.json"), "w") as f:
            json.dump(BACKEND, f)
    return {"tensors": len(names), "states": states, "objects": len(objects), "folder": folder}


def _common(url: str, leaves: dict[str, Any]) -> dict[str, Any]:
    """``common.pt``: the imported ``common.*`` leaves, the optimizer's param groups, the sharding type."""
    common: dict[str, Any] = {k.removeprefix("common."): v for k, v in leaves.items() if k.startswith("common.")}
    optimizer = dict(common.get("optimizer") or {})
    inner = optimizer.get("optimizer")
    if not isinstance(inner, dict) or "param_groups" not in inner:
        groups = sorted((int(m.group(1)), v) for k, v in leaves.items() if (m := DIST_OPT.fullmatch(k)))
        if not groups:
            raise FormatError(f"{url}: no optimizer param groups (common.optimizer or optimizer.distributed."
                              "dp_group_idx_<g>.optimizer): not a Megatron-Core import with a distributed optimizer")
        inner = groups[0][1]
        while isinstance(inner, list) and len(inner) == 1:
            inner = inner[0]  # a ShardedObject is saved as a list of its ranks' values
        if not isinstance(inner, dict) or "param_groups" not in inner:
            raise FormatError(f"{url}: optimizer.distributed.dp_group_idx_{groups[0][0]}.optimizer holds no "
                              "param_groups")
    optimizer["optimizer"] = inner
    optimizer["param_state_sharding_type"] = "fully_reshardable"
    common["optimizer"] = optimizer
    return common
