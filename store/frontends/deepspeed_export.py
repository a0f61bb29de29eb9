"""Writing a DeepSpeed ZeRO save back, for any data-parallel size (``reshard export-deepspeed``).

:func:`export_deepspeed` takes a checkpoint imported by
:func:`reshard.store.frontends.deepspeed.import_deepspeed` (its ``deepspeed``
leaf says the groups, names, shapes, paddings and the model states' plain
entries; the tensors may since have been redivided to any layouts) and writes
``dst/<tag>``: DeepSpeed's partition of every group over ``dp`` ranks
(:func:`reshard.store.frontends.deepspeed.group_buffer`), each rank's fp32
partition and optimizer state read straight from the checkpoint with flat
target layouts (:meth:`reshard.store.Checkpoint.load`), one
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank, the model states and
``latest``. ``engine.load_checkpoint(dst)`` on ``dp`` ranks then resumes.

Written with ``torch.save``: tensors, plain containers, and the few DeepSpeed
objects its loader reads (the ``LossScaler`` with its saved state, the
``ZeroStageEnum`` stage), written by name (:class:`Foreign`, from an allow-list:
a checkpoint's leaf cannot name anything else) without importing DeepSpeed.
``fragment_address`` mappings are left out (only DeepSpeed's universal
checkpoint conversion reads them).
"""

from __future__ import annotations

import math
import os
import pickle  # to WRITE DeepSpeed's own file format (torch.save); reshard's format never pickles
from collections import OrderedDict
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import numpy as np
from reshard.layouts import FlatBuffer
from reshard.layouts.errors import FormatError

from ..format.torch_arrays import from_numpy
from ..format.tree import unflatten
from ..read.checkpoint import Checkpoint
from ..read.open import open as open_checkpoint
from .deepspeed import group_buffer
from .sources import local_path


def export_deepspeed(src: str | Checkpoint, dst: str, dp: int, *, tag: str = "reshard",
                     storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write checkpoint ``src`` (imported from DeepSpeed) as a ZeRO save for ``dp`` data-parallel ranks.

    Parameters
    ----------
    src : str or Checkpoint
        A checkpoint :func:`~reshard.store.frontends.deepspeed.import_deepspeed` wrote (or a redivision of one).
    dst : str
        A local folder; the save goes to ``dst/tag`` and ``dst/latest`` names it.
    dp : int
        The data-parallel size to write for.
    tag : str
        The save's folder name.

    Returns
    -------
    dict
        ``{"folder", "dp", "stage", "files", "bytes"}``.
    """
    import torch

    if dp < 1:
        raise ValueError(f"dp must be at least 1, got {dp}")
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src, storage_options=storage_options)
    info = ckpt.leaves.get("deepspeed")
    if info is None:  # a state saved again with rs.save: its nested leaves were stored by dotted name
        info = unflatten({k: v for k, v in ckpt.leaves.items() if k.startswith("deepspeed.")}).get("deepspeed")
    if not isinstance(info, dict) or "groups" not in info or info.get("stage") not in (1, 2, 3):
        raise FormatError(f"{ckpt.url}: no 'deepspeed' leaf: not a checkpoint imported from DeepSpeed "
                          "(reshard import deepspeed)")
    stage, groups = int(info["stage"]), info["groups"]
    buffers = [group_buffer(stage, [tuple(s) for s in g["shapes"]], dp, g.get("paddings")) for g in groups]
    folder = os.path.join(local_path(dst), tag)
    os.makedirs(folder, exist_ok=True)
    files, written = [], 0
    for rank in range(dp):
        fp32, states = [], []
        for group, buf in zip(groups, buffers, strict=True):
            vectors = _rank_vectors(ckpt, group, buf, rank)
            fp32.append(vectors.pop("fp32")[: _lean(stage, group, buf, rank)])
            scalars = {k: torch.tensor(float(v)) if k == "step" else v for k, v in group.get("scalars", {}).items()}
            states.append({**scalars, **vectors})
        param_groups = [{**_hyper(group.get("hyper", {})), "params": [g]} for g, group in enumerate(groups)]
        base = {"state": dict(enumerate(states)), "param_groups": param_groups}
        optim = dict(info.get("optimizer") or {})
        optim["loss_scaler"] = foreign(optim.get("loss_scaler"), LOSS_SCALER)
        optim.setdefault("dynamic_loss_scale", False)
        optim.setdefault("overflow", False)
        optim.setdefault("ds_version", info.get("ds_version"))
        zero_stage = _named(STAGE_ENUM, (stage,), None)
        if stage == 3:
            osd = {**optim, "zero_stage": zero_stage, "partition_count": dp, "optimizer_state_dict": base,
                   "fp32_flat_groups": fp32}
        else:
            osd = {**optim, "zero_stage": zero_stage, "base_optimizer_state": base,
                   "single_partition_of_fp32_groups": fp32,
                   "group_paddings": [_padding(group, buf, dp) if rank == dp - 1 else 0
                                      for group, buf in zip(groups, buffers, strict=True)],
                   "param_alignment_paddings": [list(g.get("paddings") or [0] * len(g["names"])) for g in groups],
                   "partition_count": [dp] * len(groups)}
        prefix = "bf16_" if info.get("file_prefix") == "bf16_" else ""
        path = os.path.join(folder, f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        torch.save({"optimizer_state_dict": osd, "ds_config": info.get("ds_config"),
                    "ds_version": info.get("ds_version")}, path, pickle_module=PICKLE)
        files.append(path)
        written += sum(t.numel() * t.element_size() for t in fp32) + sum(
            v.numel() * v.element_size() for s in states for v in s.values() if isinstance(v, torch.Tensor))
    module = _module(ckpt, groups, stage)
    model = {**dict(info.get("model_states") or {}), "module": module, "optimizer": None,
             "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in zip(g["names"], g["shapes"], strict=True))
                              for g in groups], "dp_world_size": dp}
    for key in ("frozen_param_shapes", "frozen_param_fragments"):
        model[key] = OrderedDict(model.get(key) or {})
    names = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(dp)] if stage == 3 \
        else ["mp_rank_00_model_states.pt"]
    for name in names:
        torch.save(model, os.path.join(folder, name))
        files.append(os.path.join(folder, name))
    with open(os.path.join(local_path(dst), "latest"), "w") as f:
        f.write(tag)
    return {"folder": folder, "dp": dp, "stage": stage, "files": len(files), "bytes": written}


LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"
STAGE_ENUM = "deepspeed.runtime.zero.config.ZeroStageEnum"
#: The DeepSpeed classes an exported file may name (what its loader reads back as objects).
ALLOWED = frozenset({LOSS_SCALER, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler", STAGE_ENUM})


@dataclass(frozen=True)
class Foreign:
    """A DeepSpeed object written by name: ``module.name`` called with ``args`` (``__new__``), then ``state``."""

    module: str
    name: str
    args: tuple[Any, ...]
    state: Any


def foreign(stored: Any, default: str) -> Foreign:
    """A :class:`Foreign` from what the import kept of a stand-in (``{"stub", "args", "state"}``), checked:
    an allowed class, plain JSON arguments and state; ``default()`` with no state when nothing was kept."""
    if not isinstance(stored, dict):
        return _named(default, (), {"cur_scale": 1.0, "dynamic": False})
    qualname, args, state = stored.get("stub"), stored.get("args") or [], stored.get("state")
    if qualname not in ALLOWED:
        raise FormatError(f"the 'deepspeed' leaf names {qualname!r}, which is not a class reshard writes")
    if not _plain_json(args) or not _plain_json(state):
        raise FormatError(f"the 'deepspeed' leaf's {qualname} holds values that are not plain JSON")
    return _named(qualname, tuple(args), state)


def _named(qualname: str, args: tuple[Any, ...], state: Any) -> Foreign:
    module, name = qualname.rsplit(".", 1)
    return Foreign(module, name, args, state)


def _plain_json(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_json(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain_json(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


_PythonPickler: Any = pickle._Pickler  # the Python one: its dispatch table extends


class _Pickler(_PythonPickler):
    """Python's pickler, plus :class:`Foreign` objects written as ``GLOBAL module name``, ``NEWOBJ``, ``BUILD``."""

    dispatch: ClassVar[dict[Any, Any]] = dict(_PythonPickler.dispatch)

    def save_foreign(self, obj: Foreign) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.save(tuple(obj.args))
        self.write(pickle.NEWOBJ)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)
        self.memoize(obj)

    dispatch[Foreign] = save_foreign


#: What ``torch.save(..., pickle_module=)`` takes: a module whose ``Pickler`` is :class:`_Pickler`.
PICKLE = ModuleType("reshard_deepspeed_pickle")
PICKLE.Pickler = _Pickler  # type: ignore[attr-defined]


def _rank_vectors(ckpt: Checkpoint, group: dict[str, Any], buf: FlatBuffer, rank: int) -> dict[str, Any]:
    """The rank's flat partition of each of ``fp32`` and the group's states: its ranges read from the
    checkpoint under the new flat layouts straight into their places in the partition, padding zero."""
    layouts = buf.layouts()
    whats = ["fp32", *group.get("states", [])]
    part = buf.part(rank)
    out, into, targets = {}, {}, {}
    for what in whats:
        names = [f"optimizer.{what}.{name}" for name in group["names"]]
        for name in names:
            if name not in ckpt:
                raise FormatError(f"{ckpt.url}: tensor {name!r} is missing (the 'deepspeed' leaf names it)")
        vec = np.empty(part.size, dtype=ckpt.tensor(names[0]).np_dtype)
        at = 0
        for off, t, a, b in sorted(part.segments):
            vec[at:off] = 0  # padding before the segment
            into[names[t]] = vec[off : off + b - a]
            targets[names[t]] = layouts[t]
            at = off + b - a
        vec[at:] = 0
        out[what] = vec
    if targets:
        ckpt.load(targets, rank, out=into)
    return {what: from_numpy(vec) for what, vec in out.items()}


def _padding(group: dict[str, Any], buf: FlatBuffer, dp: int) -> int:
    """DeepSpeed's ``group_paddings`` entry of the last rank: the group's padded length minus its content."""
    shapes = [tuple(s) for s in group["shapes"]]
    paddings = group.get("paddings") or [0] * len(shapes)
    end = sum(math.prod(s) for s in shapes) + sum(paddings[:-1])
    return buf.part(dp - 1).size * dp - end


def _lean(stage: int, group: dict[str, Any], buf: FlatBuffer, rank: int) -> int:
    """The length DeepSpeed saves of a rank's fp32 partition (ZeRO-1/2 drop the last rank's padding)."""
    size = buf.part(rank).size
    last = len(buf.parts) - 1
    return size if stage == 3 or rank != last else size - _padding(group, buf, len(buf.parts))


def _hyper(hyper: dict[str, Any]) -> dict[str, Any]:
    """Hyper-parameters as torch optimizers keep them (``betas`` a tuple)."""
    return {k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in hyper.items()}


def _module(ckpt: Checkpoint, groups: list[dict[str, Any]], stage: int) -> OrderedDict[str, Any]:
    """The model's weights and buffers (``module.*``); ZeRO-3 keeps empty placeholders for its parameters."""
    import torch

    out: OrderedDict[str, Any] = OrderedDict()
    for name in ckpt:
        if name.startswith("module."):
            out[name[len("module."):]] = from_numpy(ckpt.read(name))
    if stage == 3:
        for g in groups:
            for name in g["names"]:
                dtype = ckpt.tensor(f"optimizer.fp32.{name}").np_dtype
                out.setdefault(name, torch.empty(0, dtype=from_numpy(np.zeros(0, dtype)).dtype))
    return out
