"""Writing a DeepSpeed ZeRO save back, for any data- and model-parallel size (``reshard export deepspeed``).

:func:`export_deepspeed` takes a checkpoint imported by
:func:`reshard.store.frontends.deepspeed.read.import_deepspeed` (its ``deepspeed``
leaf says the groups, names, shapes, paddings and the model states' plain
entries; the tensors may since have been redivided to any layouts) and writes
``dst/<tag>``: DeepSpeed's partition of every group over ``dp`` ranks
(:func:`reshard.store.frontends.deepspeed.read.group_buffer`), each rank's fp32
partition and optimizer state read straight from the checkpoint with flat
target layouts (:meth:`reshard.store.Checkpoint.load`), one
``zero_pp_rank_<r>_mp_rank_<m>_optim_states.pt`` per rank, the model states and
``latest``. ``engine.load_checkpoint(dst)`` on ``dp`` (x ``tp``) ranks then resumes.
With ``tp`` model-parallel ranks (:class:`TPPlan`), rank ``m``'s files hold
DeepSpeed's partition of its TP slices (the slices the import recorded, or even
cuts by the recorded or given rules, :mod:`.tp`), read from the whole
tensors under layouts over those slices (:func:`deepspeed_layouts`).

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
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import numpy as np
from reshard.layouts import FlatBuffer, FlatLayout
from reshard.layouts.errors import FormatError, UnsupportedError

from ...format.torch_arrays import from_numpy
from ...format.tree import unflatten
from ...io.replace import replacing
from ...read.checkpoint import Checkpoint
from ...read.open import open as open_checkpoint
from ..sources import local_path
from .read import group_buffer
from .tp import Rules, offsets, split_shapes, tp_layout


def export_deepspeed(src: str | Checkpoint, dst: str, dp: int, *, tag: str = "reshard", tp: int | None = None,
                     tp_split: Mapping[str, Any] | None = None,
                     storage_options: dict[str, Any] | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Write checkpoint ``src`` (imported from DeepSpeed) as a ZeRO save for ``dp`` data-parallel ranks.

    Parameters
    ----------
    src : str or Checkpoint
        A checkpoint :func:`~reshard.store.frontends.deepspeed.read.import_deepspeed` wrote (or a redivision of one).
    dst : str
        A local folder; the save goes to ``dst/tag`` and ``dst/latest`` names it. ``dst`` is the export's
        unit: written beside it and swapped in whole (:mod:`reshard.store.io.replace`), so it holds this
        save only (no file of an earlier export survives), and a kill leaves the old ``dst`` or the new.
    dp : int
        The data-parallel size to write for.
    tag : str
        The save's folder name.
    tp : int, optional
        The model-parallel size to write for (``mp_rank_<m>`` files; default: the imported save's). Another
        size than the save's cuts every split tensor evenly (Megatron's rule).
    tp_split : mapping, optional
        ``{pattern: rule}`` as for the import, before the rules the import recorded (needed to write a
        data-parallel save for ``tp > 1``).
    storage_options : dict, optional
        fsspec options of ``src``.
    overwrite : bool
        Replace a ``dst`` that is not empty (else :class:`~reshard.layouts.errors.CheckpointExistsError`).

    Returns
    -------
    dict
        ``{"folder", "dp", "tp", "stage", "files", "bytes"}``.
    """
    import torch

    if dp < 1:
        raise ValueError(f"dp must be at least 1, got {dp}")
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src, storage_options=storage_options)
    info = _info(ckpt)
    stage, groups = int(info["stage"]), info["groups"]
    plan = TPPlan(info, tp, tp_split)
    tp = plan.tp
    buffers = [[group_buffer(stage, plan.shapes(g, m), dp, plan.paddings(g, m)) for g in range(len(groups))]
               for m in range(tp)]
    root = local_path(dst)
    files, written = 0, 0
    prefix = "bf16_" if info.get("file_prefix") == "bf16_" else ""
    with replacing(root, overwrite=overwrite, folder=True) as staging:  # DIR whole: TAG and latest together
        folder = os.path.join(staging, tag)
        os.mkdir(folder)
        for m in range(tp):
            for rank in range(dp):
                state, nbytes = _optim_states(ckpt, info, plan, buffers, m, rank, dp)
                torch.save(state, os.path.join(folder, f"{prefix}zero_pp_rank_{rank}_mp_rank_{m:02d}_optim_states.pt"),
                           pickle_module=PICKLE)
                files, written = files + 1, written + nbytes
            model = _model_states(ckpt, info, plan, m, dp)
            names = [f"zero_pp_rank_{r}_mp_rank_{m:02d}_model_states.pt" for r in range(dp)] if stage == 3 \
                else [f"mp_rank_{m:02d}_model_states.pt"]
            for name in names:
                torch.save(model, os.path.join(folder, name))
            files += len(names)
        with open(os.path.join(staging, "latest"), "w") as f:
            f.write(tag)
    return {"folder": os.path.join(root, tag), "dp": dp, "tp": tp, "stage": stage, "files": files, "bytes": written}


def _optim_states(ckpt: Checkpoint, info: dict[str, Any], plan: TPPlan, buffers: list[list[FlatBuffer]], m: int,
                  rank: int, dp: int) -> tuple[dict[str, Any], int]:
    """One ``zero_pp_rank_<rank>_mp_rank_<m>_optim_states.pt`` file's contents, and its tensor bytes."""
    import torch

    stage, groups, tp = int(info["stage"]), info["groups"], plan.tp
    fp32, states = [], []
    for g, (group, buf) in enumerate(zip(groups, buffers[m], strict=True)):
        vectors = _rank_vectors(ckpt, group, buf, rank, plan.layouts(g, m, buffers), rank * tp + m)
        fp32.append(vectors.pop("fp32")[: _lean(stage, plan.shapes(g, m), plan.paddings(g, m), buf, rank)])
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
               "group_paddings": [_padding(plan.shapes(g, m), plan.paddings(g, m), buf, dp)
                                  if rank == dp - 1 else 0 for g, buf in enumerate(buffers[m])],
               "param_alignment_paddings": [plan.paddings(g, m) for g in range(len(groups))],
               "partition_count": [dp] * len(groups)}
    nbytes = sum(t.numel() * t.element_size() for t in fp32) + sum(
        v.numel() * v.element_size() for s in states for v in s.values() if isinstance(v, torch.Tensor))
    return {"optimizer_state_dict": osd, "ds_config": info.get("ds_config"), "ds_version": info.get("ds_version")}, \
        nbytes


def _model_states(ckpt: Checkpoint, info: dict[str, Any], plan: TPPlan, m: int, dp: int) -> dict[str, Any]:
    """Model-parallel rank ``m``'s model states file's contents."""
    import torch

    stage, groups, tp = int(info["stage"]), info["groups"], plan.tp
    model = {**dict(info.get("model_states") or {}), "module": _module(ckpt, groups, stage, plan, m),
             "optimizer": None, "dp_world_size": dp, "mp_world_size": tp,
             "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in
                                          zip(g["names"], plan.shapes(i, m), strict=True))
                              for i, g in enumerate(groups)]}
    if isinstance(model.get("checkpoint_parallel_dimensions"), dict):
        model["checkpoint_parallel_dimensions"] = {**model["checkpoint_parallel_dimensions"], "tp_degree": tp}
    for key in ("frozen_param_shapes", "frozen_param_fragments"):
        model[key] = OrderedDict(model.get(key) or {})
    return model

def deepspeed_layouts(src: str | Checkpoint | dict[str, Any], dp: int, *, tp: int | None = None,
                      tp_split: Mapping[str, Any] | None = None) -> dict[str, FlatLayout]:
    """DeepSpeed's layouts of every ``optimizer.*`` tensor for ``dp`` data-parallel x ``tp`` model-parallel
    ranks (global rank ``d * tp + m``), e.g. for :func:`reshard.store.redivide` before an export.

    ``src`` is a checkpoint imported from DeepSpeed (or its ``deepspeed`` leaf); ``tp`` and ``tp_split``
    as for :func:`export_deepspeed`.
    """
    info = src if isinstance(src, dict) else _info(src if isinstance(src, Checkpoint) else open_checkpoint(src))
    stage, groups = int(info["stage"]), info["groups"]
    plan = TPPlan(info, tp, tp_split)
    buffers = [[group_buffer(stage, plan.shapes(g, m), dp, plan.paddings(g, m)) for g in range(len(groups))]
               for m in range(plan.tp)]
    out = {}
    for g, group in enumerate(groups):
        if plan.tp == 1:
            lays = list(buffers[0][g].layouts())
        else:
            lays = [tp_layout(tuple(shape), plan.rules[name], [plan.shapes(g, k)[t] for k in range(plan.tp)],
                              [buffers[k][g].layout(t) for k in range(plan.tp)])
                    for t, (name, shape) in enumerate(zip(group["names"], group["shapes"], strict=True))]
        for name, lay in zip(group["names"], lays, strict=True):
            out.update({f"optimizer.{what}.{name}": lay for what in ("fp32", *group.get("states", []))})
    return out


def _info(ckpt: Checkpoint) -> dict[str, Any]:
    """The ``deepspeed`` leaf of a checkpoint imported from DeepSpeed, checked."""
    info = ckpt.leaves.get("deepspeed")
    if info is None:  # a state saved again with rs.save: its nested leaves were stored by dotted name
        info = unflatten({k: v for k, v in ckpt.leaves.items() if k.startswith("deepspeed.")}).get("deepspeed")
    if not isinstance(info, dict) or "groups" not in info or info.get("stage") not in (1, 2, 3):
        raise FormatError(f"{ckpt.url}: no 'deepspeed' leaf: not a checkpoint imported from DeepSpeed "
                          "(reshard import deepspeed)")
    return info


class TPPlan:
    """The model-parallel side of an export: each rank's slice shapes, paddings and the layouts to read them."""

    def __init__(self, info: dict[str, Any], tp: int | None, tp_split: Mapping[str, Any] | None) -> None:
        self.source = int(info.get("tp") or 1)
        self.tp = self.source if tp is None else int(tp)
        if self.tp < 1:
            raise ValueError(f"tp must be at least 1, got {tp}")
        self.groups = info["groups"]
        self.user = Rules(tp_split, None)
        self.recorded = dict(info.get("tp_rules") or {})
        self.rules: dict[str, int | str] = {}
        self._layouts: dict[tuple[int, int], list[FlatLayout]] = {}
        for group in self.groups:
            if self.tp != self.source and any(group.get("paddings") or []):
                raise ValueError(f"parameters {group['names'][:4]} have DeepSpeed alignment paddings "
                                 f"{group['paddings'][:4]}: reshard writes them for the imported TP size only")
            for name in group["names"]:
                self.rules[name] = self.rule(name) if self.tp > 1 else 0

    def rule(self, name: str) -> int | str:
        got = self.user.of(name, optimized=False) if self.user.user else None
        if got is None:
            got = self.recorded.get(name)
        if got is None:
            raise UnsupportedError(f"{name}: writing {self.tp} tensor-parallel ranks, and nothing says along which "
                                   "dim it splits (the imported save had one model-parallel rank): pass "
                                   "tp_split={pattern: dim | 'replicated' | 'average'}")
        return got

    def shapes(self, g: int, m: int) -> list[tuple[int, ...]]:
        group = self.groups[g]
        if self.tp == self.source and "tp_shapes" in group:
            return [tuple(s) for s in group["tp_shapes"][m]]
        return [split_shapes(n, self.rules[n], s, self.tp)[m] for n, s in zip(group["names"], group["shapes"],
                                                                               strict=True)]

    def paddings(self, g: int, m: int) -> list[int]:
        group = self.groups[g]
        if self.tp == self.source and "tp_paddings" in group:
            return [int(p) for p in group["tp_paddings"][m]]
        return [int(p) for p in group.get("paddings") or [0] * len(group["names"])]

    def layouts(self, g: int, m: int, buffers: list[list[FlatBuffer]]) -> list[FlatLayout]:
        """The layouts, over the whole tensors, under which DP rank ``d`` of model-parallel rank ``m`` (global
        rank ``d * tp + m``) holds its ranges of group ``g``'s tensors."""
        if self.tp == 1:
            return list(buffers[0][g].layouts())
        key = (g, m)
        if key not in self._layouts:
            group = self.groups[g]
            out = []
            for t, (name, shape) in enumerate(zip(group["names"], group["shapes"], strict=True)):
                rule = self.rules[name]
                slices = [self.shapes(g, k)[t] for k in range(self.tp)]
                out.append(tp_layout(tuple(shape), rule, slices, [buffers[k][g].layout(t) for k in range(self.tp)],
                                     only=m))
            self._layouts[key] = out
        return self._layouts[key]

    def module_region(self, name: str, shape: tuple[int, ...], m: int) -> tuple[slice, ...]:
        """Model-parallel rank ``m``'s slice of module tensor ``name``."""
        if self.tp == 1:
            return tuple(slice(0, n) for n in shape)
        rule = self.rules[name] if name in self.rules else self.rule(name)
        for g, group in enumerate(self.groups):
            if name in group["names"] and self.tp == self.source:  # the recorded slices (uneven ones too)
                t = group["names"].index(name)
                shapes = [self.shapes(g, k)[t] for k in range(self.tp)]
                break
        else:
            shapes = split_shapes(name, rule, shape, self.tp)
        start = offsets(rule, shapes)[m]
        return tuple(slice(o, o + n) for o, n in zip(start, shapes[m], strict=True))


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


def _rank_vectors(ckpt: Checkpoint, group: dict[str, Any], buf: FlatBuffer, rank: int, layouts: list[FlatLayout],
                  load_rank: int) -> dict[str, Any]:
    """The rank's flat partition of each of ``fp32`` and the group's states: its ranges read from the
    checkpoint under ``layouts`` (rank ``load_rank``) straight into their places in the partition, padding zero."""
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
        ckpt.load(targets, load_rank, out=into)
    return {what: from_numpy(vec) for what, vec in out.items()}


def _padding(shapes: list[tuple[int, ...]], paddings: list[int], buf: FlatBuffer, dp: int) -> int:
    """DeepSpeed's ``group_paddings`` entry of the last rank: the group's padded length minus its content."""
    end = sum(math.prod(s) for s in shapes) + sum(paddings[:-1])
    return buf.part(dp - 1).size * dp - end


def _lean(stage: int, shapes: list[tuple[int, ...]], paddings: list[int], buf: FlatBuffer, rank: int) -> int:
    """The length DeepSpeed saves of a rank's fp32 partition (ZeRO-1/2 drop the last rank's padding)."""
    size = buf.part(rank).size
    last = len(buf.parts) - 1
    return size if stage == 3 or rank != last else size - _padding(shapes, paddings, buf, len(buf.parts))


def _hyper(hyper: dict[str, Any]) -> dict[str, Any]:
    """Hyper-parameters as torch optimizers keep them (``betas`` a tuple)."""
    return {k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in hyper.items()}


def _module(ckpt: Checkpoint, groups: list[dict[str, Any]], stage: int, plan: TPPlan, m: int
            ) -> OrderedDict[str, Any]:
    """Model-parallel rank ``m``'s weights and buffers (``module.*``); ZeRO-3 keeps empty placeholders for its
    parameters."""
    import torch

    out: OrderedDict[str, Any] = OrderedDict()
    for name in ckpt:
        if name.startswith("module."):
            short = name[len("module."):]
            region = plan.module_region(short, ckpt.tensor(name).shape, m)
            out[short] = from_numpy(np.ascontiguousarray(ckpt.read(name, region)))
    if stage == 3:
        for g in groups:
            for name in g["names"]:
                dtype = ckpt.tensor(f"optimizer.fp32.{name}").np_dtype
                out.setdefault(name, torch.empty(0, dtype=from_numpy(np.zeros(0, dtype)).dtype))
    return out
