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

from reshard.layouts.errors import FormatError, UnsupportedError

from ...format.torch_arrays import from_numpy
from ...io.replace import refuse_existing, replacing
from ...read.checkpoint import Checkpoint
from ...read.open import open as open_checkpoint
from ..sources import local_path

STATE = re.compile(r"(chained_\d+\.)?optimizer\.state\.(fp32_param|param|exp_avg|exp_avg_sq)\.(.+)")
OBJECT = re.compile(r".+/shard_[0-9_.]+")
DIST_OPT = re.compile(r"(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.optimizer(/shard_.*)?")
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}


def export_megatron(src: str | Checkpoint, dst: str, *, storage_options: dict[str, Any] | None = None,
                    overwrite: bool = False, ep: int | None = None) -> dict[str, Any]:
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
    ep : int, optional
        The expert-parallel size of the job that loads it, when it changes the optimizer's structure:
        Megatron-Core gives expert parameters an optimizer of their own (a ``ChainedOptimizer``) only when
        expert parallelism is above 1. ``ep=1`` writes a chained import for one optimizer (each state
        without its ``chained_<i>.`` prefix; the param groups of the optimizers merged, refused unless each
        expert group equals a dense one but for ``is_expert_parallel``). Default: the import's structure.

    Returns
    -------
    dict
        ``{"tensors", "states", "objects", "folder"}``.

    Raises
    ------
    FormatError
        When ``src`` holds no optimizer param groups (not a Megatron import), or ``ep=1`` and its optimizers'
        param groups cannot be merged.
    UnsupportedError
        ``ep`` > 1 for an import of one optimizer (which parameters the expert optimizer holds is not recorded).
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
    leaves = ckpt.leaves
    common = _common(ckpt.url, leaves)
    unprefixed = bool((common.get("content_metadata") or {}).get("chained_optim_avoid_prefix"))
    chained = all(isinstance(k, int) for k in common["optimizer"])
    if ep is not None and ep < 1:
        raise ValueError(f"ep={ep}: an expert-parallel size is 1 or more")
    if ep == 1 and chained:
        common["optimizer"] = _merged(ckpt.url, common["optimizer"])
        unprefixed = True
    elif ep is not None and ep > 1 and not chained:
        raise UnsupportedError(f"{ckpt.url}: ep={ep}: the import holds one optimizer, and a job with expert "
                               "parallelism above 1 chains two (dense, experts); which parameters go to which is "
                               "not recorded, so this export is not written")
    for name in sorted(ckpt.arrays):
        m = STATE.fullmatch(name)
        key = (f"{'' if unprefixed else m.group(1) or ''}optimizer.state."
               f"{'param' if m.group(2) == 'fp32_param' else m.group(2)}.{m.group(3)}") if m else name
        if key in names:
            raise FormatError(f"{ckpt.url}: tensors {names[key]!r} and {name!r} would both be written as {key!r}")
        names[key] = name
        states += m is not None
    objects = {k: v for k, v in leaves.items() if OBJECT.fullmatch(k) and not DIST_OPT.fullmatch(k)}
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
    """``common.pt``: the imported ``common.*`` leaves, each optimizer's param groups, the sharding type.

    A ``ChainedOptimizer``'s (``common.optimizer`` keyed ``"0"``, ``"1"``, ..., or buckets' param groups under
    ``chained_<i>.``) becomes ``{0: {...}, 1: {...}}`` as Megatron saves it. A ``content_metadata`` entry (what
    Megatron-LM builds its load from) is told the new ``distrib_optim_sharding_type``.
    """
    common: dict[str, Any] = {k.removeprefix("common."): v for k, v in leaves.items() if k.startswith("common.")}
    optimizer = dict(common.get("optimizer") or {})
    chained = {int(m.group(1)[len("chained_"):-1]) for k in leaves if (m := DIST_OPT.fullmatch(k)) and m.group(1)}
    if optimizer and all(str(k).isdigit() for k in optimizer):
        chained |= {int(k) for k in optimizer}
    if chained:
        common["optimizer"] = {i: _optimizer(url, leaves, dict(optimizer.get(str(i)) or optimizer.get(i) or {}),
                                             f"chained_{i}.") for i in sorted(chained)}
    else:
        common["optimizer"] = _optimizer(url, leaves, optimizer, "")
    content = common.get("content_metadata")
    if isinstance(content, dict) and "distrib_optim_sharding_type" in content:
        common["content_metadata"] = {**content, "distrib_optim_sharding_type": "fully_reshardable"}
    return common


def _optimizer(url: str, leaves: dict[str, Any], optimizer: dict[str, Any], prefix: str) -> dict[str, Any]:
    """One optimizer's entry of ``common.pt``: its param groups (from ``common`` or its buckets' objects)."""
    inner = optimizer.get("optimizer")
    if not isinstance(inner, dict) or "param_groups" not in inner:
        groups = sorted((int(m.group(2)), v) for k, v in leaves.items()
                        if (m := DIST_OPT.fullmatch(k)) and (m.group(1) or "") == prefix)
        if not groups:
            raise FormatError(f"{url}: no optimizer param groups (common.optimizer or {prefix}optimizer.distributed."
                              "dp_group_idx_<g>.optimizer): not a Megatron-Core import with a distributed optimizer")
        inner = groups[0][1]
        while isinstance(inner, list) and len(inner) == 1:
            inner = inner[0]  # a ShardedObject is saved as a list of its ranks' values
        if not isinstance(inner, dict) or "param_groups" not in inner:
            raise FormatError(f"{url}: {prefix}optimizer.distributed.dp_group_idx_{groups[0][0]}.optimizer holds no "
                              "param_groups")
    return {**optimizer, "optimizer": inner, "param_state_sharding_type": "fully_reshardable"}


def _merged(url: str, optimizers: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """A ``ChainedOptimizer``'s entries as one optimizer's (``ep=1``): the first one's param groups, which
    every other group must equal but for ``is_expert_parallel`` (then the one optimizer holds them all)."""
    first = min(optimizers)

    def plain(group: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in group.items() if k not in ("params", "is_expert_parallel")}

    groups = [{**g, "is_expert_parallel": False} if "is_expert_parallel" in g else dict(g)
              for g in optimizers[first]["optimizer"]["param_groups"]]
    for i, entry in sorted(optimizers.items()):
        for group in entry["optimizer"]["param_groups"]:
            if plain(group) not in [plain(g) for g in groups]:
                raise FormatError(f"{url}: ep=1: a param group of chained optimizer {i} ({plain(group)}) equals none "
                                  f"of optimizer {first}'s, so one optimizer cannot hold both")
    return {**optimizers[first], "optimizer": {**optimizers[first]["optimizer"], "param_groups": groups}}
