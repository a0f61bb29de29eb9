"""DeepSpeed ZeRO checkpoints in and out, read in place (no DeepSpeed import, no offline conversion pass).

A ZeRO-1/2/3 checkpoint (``engine.save_checkpoint(dir, tag)``) is, in
``dir/tag``, the model states (``mp_rank_00_model_states.pt``; ZeRO-3:
``zero_pp_rank_<r>_mp_rank_00_model_states.pt``) and one optimizer file per
data-parallel rank, ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, whose
flat fp32 partition and Adam moments are that rank's part of each parameter
group's flat buffer. :func:`import_deepspeed` reads the parameter shapes and
the partition facts, gives every parameter a
:class:`~reshard.layouts.FlatLayout` (:class:`~reshard.layouts.FlatBuffer`:
DeepSpeed's own cut, see :mod:`reshard.layouts.flatbuf`) and writes

* ``module.<name>``: the module's weights and buffers as saved (ZeRO-1/2),
* ``optimizer.fp32.<name>``, ``optimizer.<state>.<name>`` (``exp_avg``,
  ``exp_avg_sq``...): each parameter's fp32 master copy and optimizer state, under
  its flat layout, so a load reads any rank's range of another DP size directly,
* the leaf ``deepspeed``: what :func:`export_deepspeed` needs to write the files
  back for another DP size (groups, names, shapes, paddings, steps, hyper-parameters,
  the model states' plain entries).

The ``.pt`` files are read with torch's restricted unpickler
(:func:`reshard.store.frontends.torch.pt_files.load_pt`): DeepSpeed's classes become
inert stand-ins, nothing of theirs runs. With bf16 training the optimizer files
are ``bf16_zero_pp_rank_*`` (ZeRO-1, DeepSpeed's ``BF16_Optimizer`` or its ZeRO
optimizer: the same partition rule); the prefix is kept for the export. With
model-parallel ranks (``mp_rank_01``...) each rank's partitions give its TP
slices, joined into whole tensors by :mod:`.tp` (how each parameter is
split: ``tp_split``, else the save's ``universal_checkpoint_info``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from reshard.layouts import FlatBuffer, FlatLayout, Layout
from reshard.layouts.errors import CheckpointNotFoundError, FormatError, ReshardError, UnsupportedError

from ...format.torch_arrays import to_numpy
from ...write.writer import create, single_process
from ..sources import Skips, refuse_empty, source_path
from ..torch.pt_files import Stub, load_pt, plain
from .tp import Rules, block_layout, full_shape, join, tp_layout

OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def tag_folder(src: str, tag: str | None = None) -> str:
    """The folder of one save: ``src/tag``, ``src/<latest>``, or ``src`` itself when it holds the files."""
    src = source_path(src)
    if tag is not None:
        return os.path.join(src, tag)
    latest = os.path.join(src, "latest")
    if not any(OPTIM.match(f) for f in _listdir(src)) and os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(src, f.read().strip())
    return src


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such folder") from None


def _stage(osd: Mapping[str, Any], where: str, bf16: bool = False) -> int:
    if bf16 and "zero_stage" not in osd:
        return 1  # BF16_Optimizer: ZeRO-1's partition, no stage recorded
    stage = osd.get("zero_stage")
    if isinstance(stage, Stub):
        stage = stage.field("value", 0)
    if stage not in (1, 2, 3):
        raise FormatError(f"{where}: zero_stage {stage!r} is not 1, 2 or 3")
    return int(stage)


def group_buffer(stage: int, shapes: list[tuple[int, ...]], dp: int, paddings: list[int] | None = None) -> FlatBuffer:
    """DeepSpeed's flat buffer of one parameter group over ``dp`` ranks (see :mod:`reshard.layouts.flatbuf`).

    ZeRO-1/2: parameters back to back (``paddings[i]`` elements after parameter
    ``i``, DeepSpeed's optional 16-byte alignment), the end padded to ``2 * dp``,
    equal parts. ZeRO-3: each parameter cut on its own.
    """
    if stage == 3:
        return FlatBuffer.per_tensor(shapes, range(dp))
    offsets, at = [], 0
    for shape, pad in zip(shapes, paddings or [0] * len(shapes), strict=True):
        offsets.append(at)
        at += math.prod(shape) + int(pad)
    return FlatBuffer.partitioned(shapes, range(dp), offsets=offsets, pad_to=2 * dp)


def scan(folder: str) -> tuple[str, dict[int, dict[int, str]]]:
    """The optimizer files of a save: their prefix (``"bf16_"`` or ``""``) and ``{mp rank: {dp rank: path}}``,
    checked complete."""
    files = _listdir(folder)
    grid: dict[int, dict[int, str]] = {}
    prefixes = set()
    for name in files:
        m = OPTIM.match(name)
        if m is not None:
            prefixes.add(m.group(1) or "")
            grid.setdefault(int(m.group(3)), {})[int(m.group(2))] = os.path.join(folder, name)
    if not grid:
        raise CheckpointNotFoundError(f"{folder}: no zero_pp_rank_*_mp_rank_*_optim_states.pt files: not a "
                                      "DeepSpeed ZeRO checkpoint (pass the tag folder, or a folder with 'latest')")
    if len(prefixes) > 1:
        raise FormatError(f"{folder}: both bf16_zero_pp_rank_* and zero_pp_rank_* optimizer files: two saves "
                          "mixed in one folder")
    if any(f.startswith("layer_") and f.endswith("model_states.pt") for f in files):
        raise UnsupportedError(f"{folder}: layer_*-model_states.pt files: a pipeline-parallel save, which reshard "
                               "does not import")
    if sorted(grid) != list(range(len(grid))):
        raise FormatError(f"{folder}: optimizer files of model-parallel ranks {sorted(grid)}: some are missing")
    dp = max(max(ranks) + 1 for ranks in grid.values())
    for mp, ranks in sorted(grid.items()):
        if sorted(ranks) != list(range(dp)):
            what = f"model-parallel rank {mp}'s" if len(grid) > 1 else "the"
            raise FormatError(f"{folder}: {what} optimizer files are of data-parallel ranks {sorted(ranks)[:16]} "
                              f"of {dp}: some are missing")
    return prefixes.pop(), grid


class DeepSpeedFiles:
    """The files of one model-parallel rank of a ZeRO save (all of a data-parallel save), read (each optimizer
    file once) and checked."""

    def __init__(self, folder: str, mp: int = 0, found: dict[int, str] | None = None, prefix: str | None = None,
                 tp: int = 1) -> None:
        self.folder = folder
        if found is None or prefix is None:
            prefix, grid = scan(folder)
            found = grid[mp]
        files = _listdir(folder)
        #: ``"bf16_"`` for the bf16 optimizer's file names, else ``""``.
        self.prefix = prefix
        self.mp = mp
        self.dp = len(found)
        states = [f for f in (f"mp_rank_{mp:02d}_model_states.pt", f"zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt")
                  if f in files]
        if not states:
            raise FormatError(f"{folder}: no model states file (mp_rank_{mp:02d}_model_states.pt)")
        #: The model states file and the optimizer files (by data-parallel rank), as paths.
        self.model_file, self.optim_files = os.path.join(folder, states[0]), dict(found)
        self.model = load_pt(self.model_file)
        if not isinstance(self.model, Mapping):
            raise FormatError(f"{folder}/{states[0]} holds a {type(self.model).__name__}, not a dict")
        self.optim = [load_pt(found[r]) for r in range(self.dp)]
        self.osd: list[Mapping[str, Any]] = []
        for r, o in enumerate(self.optim):
            osd = o.get("optimizer_state_dict") if isinstance(o, Mapping) else None
            if not isinstance(osd, Mapping):
                raise FormatError(f"{found[r]}: no 'optimizer_state_dict' in it")
            self.osd.append(osd)
        self.stage = _stage(self.osd[0], found[0], bf16=bool(self.prefix))
        if self.model.get("dp_world_size", self.dp) != self.dp:
            raise FormatError(f"{folder}: the model states say {self.model.get('dp_world_size')} data-parallel "
                              f"ranks, the folder holds {self.dp} optimizer files")
        if self.model.get("mp_world_size", tp) != tp:
            raise FormatError(f"{folder}: the model states say {self.model.get('mp_world_size')} model-parallel "
                              f"ranks, the folder holds optimizer files of {tp}")
        dims = self.model.get("checkpoint_parallel_dimensions")
        if isinstance(dims, Mapping) and dims.get("pp_degree", 1) not in (None, 1):
            raise UnsupportedError(f"{folder}: a pipeline-parallel save (pp_degree {dims.get('pp_degree')}), which "
                                   "reshard does not import")
        try:
            self.shapes = [[(str(n), tuple(int(x) for x in s)) for n, s in g.items()]
                           for g in self.model.get("param_shapes") or []]
        except (AttributeError, TypeError, ValueError):
            raise FormatError(f"{folder}: the model states' param_shapes are not lists of name -> shape") from None
        if not self.shapes:
            raise FormatError(f"{folder}: the model states hold no param_shapes")

    @property
    def _mp(self) -> str:
        return f" of model-parallel rank {self.mp}" if self.mp else ""

    def fp32(self, rank: int) -> list[Any]:
        osd = self.osd[rank]
        return list(osd["fp32_flat_groups"] if self.stage == 3 else osd["single_partition_of_fp32_groups"])

    def base(self, rank: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Per group: the optimizer state (``exp_avg``... and ``step``) and the hyper-parameters."""
        osd = self.osd[rank]
        base = osd["optimizer_state_dict" if self.stage == 3 else "base_optimizer_state"]
        if isinstance(base, list):  # an elastic checkpoint: per group, padding removed
            return base, [{} for _ in base]
        state = base.get("state", {})
        groups = base.get("param_groups", [])
        return [state.get(g, {}) for g in range(len(self.shapes))], [dict(g) for g in groups]

    def buffers(self) -> list[FlatBuffer]:
        """Each group's :class:`FlatBuffer`, checked against the partitions the files hold."""
        out = []
        paddings = self.osd[0].get("param_alignment_paddings") if self.stage != 3 else None
        for g, named in enumerate(self.shapes):
            pads = self._paddings(paddings[g], g, len(named)) if paddings and g < len(paddings) else None
            try:
                buf = group_buffer(self.stage, [s for _, s in named], self.dp, pads)
            except (ReshardError, ValueError) as e:
                raise FormatError(f"{self.folder}: group {g}{self._mp}: the model states' param_shapes do not make "
                                  f"DeepSpeed's flat buffer: {e}") from None
            for r in range(self.dp):
                fp32 = self.fp32(r)
                if g >= len(fp32):
                    raise FormatError(f"{self.folder}: rank {r}{self._mp} holds {len(fp32)} parameter groups, the "
                                      f"model states {len(self.shapes)}")
                need = max((off + b - a for off, _, a, b in buf.part(r).segments), default=0)
                if fp32[g].numel() < need or fp32[g].numel() > buf.part(r).size:
                    raise FormatError(f"{self.folder}: rank {r}{self._mp} group {g} holds {fp32[g].numel()} fp32 "
                                      f"elements; DeepSpeed's partition of {[list(s) for _, s in named]} over "
                                      f"{self.dp} ranks gives {need} to {buf.part(r).size}")
                self._check_mappings(r, g, named, buf)
            out.append(buf)
        return out

    def _paddings(self, raw: Any, g: int, n: int) -> list[int]:
        """Group ``g``'s ``param_alignment_paddings``: ``n`` counts of elements, none negative (a negative one would
        overlap two parameters' ranges)."""
        try:
            pads = [int(p) for p in raw]
        except (TypeError, ValueError):
            pads = []
        if len(pads) != n or min(pads, default=0) < 0:
            raise FormatError(f"{self.folder}: rank 0{self._mp}'s param_alignment_paddings of group {g} are "
                              f"{raw!r:.200}, not {n} counts of elements >= 0")
        return pads

    def _check_mappings(self, rank: int, g: int, named: list[tuple[str, tuple[int, ...]]], buf: FlatBuffer) -> None:
        maps = self.osd[rank].get("param_slice_mappings")
        if not maps or g >= len(maps):
            return
        want = {named[t][0]: (off, b - a) for off, t, a, b in buf.part(rank).segments}
        got = {str(k): (int(v.field("start", 1)), int(v.field("numel", 0))) if isinstance(v, Stub) else None
               for k, v in maps[g].items()}
        if got != want:
            raise FormatError(f"{self.folder}: rank {rank}{self._mp} group {g}: DeepSpeed's param_slice_mappings "
                              f"{got} differ from the partition reshard computes {want}")


def import_deepspeed(src: str, dst: str, *, tag: str | None = None, tp_split: Mapping[str, Any] | None = None,
                     skip: Sequence[str] = (), **options: Any) -> dict[str, Any]:
    """Convert a DeepSpeed ZeRO-1/2/3 checkpoint into a reshard checkpoint (see the module docstring).

    Parameters
    ----------
    src : str
        The folder given to ``save_checkpoint`` (its ``latest`` names the tag), or a tag folder.
    dst : str
        The new checkpoint.
    tag : str, optional
        The save to import (default: ``latest``).
    tp_split : mapping, optional
        With model-parallel ranks (``mp_rank_01``...): ``{pattern: rule}``, how the parameters whose names
        match ``pattern`` (:func:`re.match`, the first that matches wins) are split over the TP ranks: a
        dim, ``"replicated"`` or ``"average"`` (see :mod:`.tp`); before the save's own
        ``universal_checkpoint_info``.
    skip : sequence of str
        Model-state (and ``optimizer_state_dict``) entries that are not plain data which the
        import may leave out of the ``deepspeed`` leaf (globs or dotted prefixes,
        :class:`~reshard.store.frontends.sources.Skips`); any other raises :class:`FormatError`
        naming it and its file. What is skipped is recorded in the leaf ``reshard.skipped``.
    **options
        As for :func:`reshard.store.create`.

    Returns
    -------
    dict
        ``{"tensors", "bytes", "stage", "dp", "tp", "skipped"}``; ``skipped`` names what was left out.
    """
    folder = tag_folder(src, tag)
    prefix, grid = scan(folder)
    tp = len(grid)
    parts = [DeepSpeedFiles(folder, m, grid[m], prefix, tp) for m in range(tp)]
    ds = parts[0]
    for p in parts[1:]:
        if (p.stage, [[n for n, _ in g] for g in p.shapes]) != (ds.stage, [[n for n, _ in g] for g in ds.shapes]):
            raise FormatError(f"{folder}: model-parallel rank {p.mp}'s ZeRO stage or parameter groups differ from "
                              "rank 0's")
    rules = Rules(tp_split, _plain_info(ds.model.get("universal_checkpoint_info"))) if tp > 1 else None
    buffers = [p.buffers() for p in parts]
    origin: dict[str, Any] = {"framework": "deepspeed", "zero_stage": ds.stage}
    layouts: dict[str, Layout] = {}
    arrays: dict[str, Any] = {}  # name -> ("flat", rule, per mp rank (t, buffer, per-rank partitions)) or module
    groups: list[dict[str, Any]] = []
    resolved: dict[str, Any] = {}
    bases = [[p.base(r) for r in range(ds.dp)] for p in parts]
    fp32 = [[p.fp32(r) for r in range(ds.dp)] for p in parts]
    for g, named in enumerate(ds.shapes):
        state0, hyper = bases[0][0][0][g], bases[0][0][1]
        keys = sorted(k for k, v in state0.items() if getattr(v, "ndim", 0) == 1)
        step = {k: plain(v) for k, v in state0.items() if k not in keys}
        shapes = []
        for t, (name, local) in enumerate(named):
            slices = [p.shapes[g][t][1] for p in parts]
            got = 0 if rules is None else rules.of(name, optimized=True)
            assert got is not None  # an optimized parameter has a rule or is refused
            rule = got
            shape = local if rules is None else full_shape(name, rule, slices)
            shapes.append(shape)
            local_lays = [buffers[m][g].layout(t, origin) for m in range(tp)]
            lay = local_lays[0] if rules is None else tp_layout(shape, rule, slices, local_lays,
                                                                {**origin, "tp": tp, "tp_rule": rule})
            if rules is not None:
                resolved[name] = rule
            sources = {"fp32": [[fp32[m][r][g] for r in range(ds.dp)] for m in range(tp)]}
            sources.update({k: [[_state(bases[m][r][0], g, k, parts[m], r) for r in range(ds.dp)]
                                for m in range(tp)] for k in keys})
            for what, per_mp in sources.items():
                full = f"optimizer.{what}.{name}"
                layouts[full] = lay
                arrays[full] = ("flat", rule, [(t, buffers[m][g], per_mp[m]) for m in range(tp)])
        recorded = [p.osd[0].get("param_alignment_paddings") if ds.stage != 3 else None for p in parts]
        hyper_g = hyper[g] if g < len(hyper) else {}
        entry = {"names": [n for n, _ in named], "shapes": [list(s) for s in shapes],
                 "paddings": [int(x) for x in recorded[0][g]] if recorded[0] else [0] * len(named),
                 "states": keys, "scalars": step, "hyper": plain({k: v for k, v in hyper_g.items() if k != "params"})}
        if tp > 1:
            entry["tp_shapes"] = [[list(s) for _, s in p.shapes[g]] for p in parts]
            entry["tp_paddings"] = [[int(x) for x in r[g]] if r else [0] * len(named) for r in recorded]
        groups.append(entry)
    modules = [p.model.get("module") or {} for p in parts]
    wanted = {n: s for named in ds.shapes for n, s in named}
    for name, value in modules[0].items():
        values = [mod.get(name) for mod in modules]
        if any(not hasattr(v, "shape") or not hasattr(v, "detach") for v in values):
            raise FormatError(f"{folder}: module entry {name!r} is not a tensor in every model-parallel rank's states")
        if ds.stage == 3 and name in wanted and tuple(value.shape) != wanted[name]:
            continue  # ZeRO-3: a partitioned parameter's placeholder; its values are the fp32 copy
        arrs = [to_numpy(v.detach().contiguous()) for v in values]  # type: ignore[union-attr]
        if rules is None:
            layouts[f"module.{name}"] = Layout.single(arrs[0].shape)
            arrays[f"module.{name}"] = arrs[0]
            continue
        mrule = resolved[name] if name in resolved else rules.of(name, optimized=False)
        if mrule is None:
            mrule = "replicated"  # not an optimized parameter, no rule: replicated if the values agree (join checks)
        whole = join(f"module.{name}", mrule, arrs)
        layouts[f"module.{name}"] = block_layout(whole.shape, mrule, [a.shape for a in arrs])
        arrays[f"module.{name}"] = whole
        resolved.setdefault(name, mrule)
    refuse_empty("DeepSpeed", ds.folder, len(layouts))
    skips = Skips(skip)
    leaves = _leaves(ds, groups, skips)
    skips.check()
    leaves.update(skips.leaves())
    if tp > 1:
        leaves["deepspeed"].update(tp=tp, tp_rules=resolved)
    writer = create(dst, layouts, **single_process(options))
    metas = {}
    total = 0
    for name, lay in layouts.items():
        data = arrays.pop(name)
        if not isinstance(lay, FlatLayout):
            metas[name] = meta = writer.meta(name, lay, _dtype(data))
            writer.write_block(meta, tuple(slice(0, n) for n in data.shape), data)
            total += data.nbytes
            continue
        _, rule, per_mp = data
        parts_of = [_gather(name, buf.layout(t), t, buf, per_rank) for t, buf, per_rank in per_mp]
        whole = parts_of[0] if tp == 1 else join(name, rule, parts_of)
        metas[name] = meta = writer.meta(name, lay, _dtype(whole), single_writer=True)
        writer.write_block(meta, tuple(slice(0, n) for n in whole.shape), whole)
        total += whole.nbytes
    writer.write_manifests(metas, leaves)
    writer.commit()
    return {"tensors": len(layouts), "bytes": total, "stage": ds.stage, "dp": ds.dp, "tp": tp, "skipped": skips.names()}


def _state(states: list[dict[str, Any]], g: int, key: str, ds: DeepSpeedFiles, rank: int) -> Any:
    """Optimizer state ``key`` of group ``g`` in one rank's file, checked to be there."""
    value = states[g].get(key) if g < len(states) and isinstance(states[g], Mapping) else None
    if not hasattr(value, "numel"):
        raise FormatError(f"{ds.folder}: rank {rank}{ds._mp} holds no optimizer state {key!r} of group {g} "
                          "(rank 0 does)")
    return value


def _plain_info(info: Any) -> Any:
    """``universal_checkpoint_info`` as plain data (None when absent)."""
    if info is None:
        return None
    try:
        return plain(info)
    except TypeError as e:
        raise FormatError(f"the model states' universal_checkpoint_info holds {e}, not plain data") from None


def _dtype(arr: np.ndarray) -> str:
    from ...format.dtypes import dtype_name

    return dtype_name(arr.dtype)


def _gather(name: str, lay: FlatLayout, t: int, buf: FlatBuffer, per_rank: list[Any]) -> np.ndarray:
    """A parameter's whole array from each rank's flat partition (its segment of the group's buffer)."""
    first = to_numpy(per_rank[0].detach())
    out = np.empty(math.prod(lay.shape), dtype=first.dtype)
    for r in lay.ranks:
        local = to_numpy(per_rank[r].detach()).reshape(-1)
        segments = [s for s in buf.part(r).segments if s[1] == t]
        if not segments:
            continue  # an empty tensor's (empty) range
        (off, _, a, b), = segments
        if local.size < off + b - a or local.dtype != out.dtype:
            raise FormatError(f"{name}: rank {r}'s partition is {local.dtype}[{local.size}], its range needs "
                              f"{out.dtype}[{off + b - a}]")
        out[a:b] = local[off : off + b - a]
    return out.reshape(lay.shape)


def _leaves(ds: DeepSpeedFiles, groups: list[dict[str, Any]], skips: Skips) -> dict[str, Any]:
    model: dict[str, Any] = {}
    for key, value in ds.model.items():
        if key in ("module", "optimizer", "param_shapes"):
            continue
        try:
            model[key] = plain(value)
        except TypeError as e:
            skips.add(key, f"model states entry {key!r} (in {ds.model_file})", f"it holds {e}, not plain data")
    osd = ds.osd[0]
    optim = {}
    for key in ("dynamic_loss_scale", "overflow", "clip_grad", "ds_version", "loss_scaler"):
        if key in osd:
            try:
                optim[key] = plain(osd[key])
            except TypeError as e:
                skips.add(f"optimizer_state_dict.{key}", f"optimizer_state_dict entry {key!r} (in {ds.optim_files[0]})",
                          f"it holds {e}, not plain data")
    info = {"stage": ds.stage, "dp": ds.dp, "file_prefix": ds.prefix, "groups": groups, "model_states": model,
            "optimizer": optim,
            "ds_config": plain(ds.optim[0].get("ds_config")) if "ds_config" in ds.optim[0] else None,
            "ds_version": plain(ds.optim[0].get("ds_version"))}
    return {"deepspeed": info}
