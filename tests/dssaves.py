"""DeepSpeed ZeRO saves built here to DeepSpeed's documented layout (no DeepSpeed needed), for the tests.

:func:`build_save` writes ZeRO-1/2 and ZeRO-3 saves with ``torch.save``, following DeepSpeed's rules
(stated in reshard.layouts.flatbuf and below, computed here with numpy independently of reshard's
layouts), DeepSpeed's classes named in the pickles as DeepSpeed writes them.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from reshard.store.frontends.deepspeed.write import PICKLE, Foreign

RNG = np.random.default_rng(27)
GROUPS = [[("embed.weight", (37, 12)), ("proj.weight", (7, 12)), ("head.weight", (5, 7))],
          [("proj.bias", (7,)), ("norm.weight", (7,)), ("norm.bias", (7,))]]
STATES = ("exp_avg", "exp_avg_sq")


def stub(qualname: str, args: tuple = (), state: object = None) -> Foreign:
    module, name = qualname.rsplit(".", 1)
    return Foreign(module, name, args, state)


def reference_parts(stage: int, shapes: list[tuple[int, ...]], dp: int) -> list[list[tuple[int, int, int, int]]]:
    """DeepSpeed's partition, from its rules: per rank, (local offset, tensor, start, stop) segments, and the
    partition size as a last entry (-1, size, 0, 0)."""
    numels = [math.prod(s) for s in shapes]
    out: list[list[tuple[int, int, int, int]]] = [[] for _ in range(dp)]
    if stage == 3:  # each parameter alone: ceil(numel / dp) per rank, concatenated, padded
        for r in range(dp):
            at = 0
            for t, n in enumerate(numels):
                step = -(-n // dp)
                a, b = min(r * step, n), min((r + 1) * step, n)
                if a < b:
                    out[r].append((at, t, a, b))
                at += step
            out[r].append((-1, at, 0, 0))
        return out
    total = sum(numels)
    total += -total % (2 * dp)  # nccl_start_alignment_factor (2) * dp
    size = total // dp
    starts = np.cumsum([0, *numels])
    for r in range(dp):
        lo, hi = r * size, (r + 1) * size
        for t in range(len(shapes)):
            a, b = max(lo, starts[t]), min(hi, starts[t + 1])
            if a < b:
                out[r].append((int(a - lo), t, int(a - starts[t]), int(b - starts[t])))
        out[r].append((-1, size, 0, 0))
    return out


def build_save(folder: Path, stage: int, dp: int, prefix: str = "", *, groups: list | None = None, mp: int = 0,
               tp: int = 1, values: dict[str, np.ndarray] | None = None, extra: dict | None = None
               ) -> dict[str, np.ndarray]:
    """A ZeRO save as DeepSpeed lays it out; returns every tensor by the name reshard gives it. ``prefix="bf16_"``:
    the bf16 optimizer's files (ZeRO-1, no ``zero_stage`` recorded). With ``tp`` > 1 this writes model-parallel
    rank ``mp``'s files: ``groups`` its (TP-local) parameter shapes, ``values`` its tensors by reshard's names
    (``optimizer.<what>.<name>``, ``module.<name>``; random where absent), ``extra`` model-state entries."""
    groups = GROUPS if groups is None else groups
    folder.mkdir(parents=True, exist_ok=True)
    full = {}
    for named in groups:
        for name, shape in named:
            for what in ("fp32", *STATES):
                key = f"optimizer.{what}.{name}"
                full[key] = values[key] if values and key in values else \
                    RNG.standard_normal(shape).astype(np.float32)
            full[f"module.{name}"] = values[f"module.{name}"] if values and f"module.{name}" in values else \
                full[f"optimizer.fp32.{name}"]
    for r in range(dp):
        fp32, state, maps, paddings = [], {}, [], []
        for g, named in enumerate(groups):
            parts = reference_parts(stage, [s for _, s in named], dp)[r]
            size = parts[-1][1]
            vec = {w: np.zeros(size, np.float32) for w in ("fp32", *STATES)}
            mapping = {}
            for off, t, a, b in parts[:-1]:
                for w in vec:
                    vec[w][off:off + b - a] = full[f"optimizer.{w}.{named[t][0]}"].reshape(-1)[a:b]
                mapping[named[t][0]] = stub("deepspeed.utils.tensor_fragment.fragment_address", (),
                                            {"numel": b - a, "start": off})
            content = sum(math.prod(s) for _, s in named)
            pad = size * dp - content if (stage != 3 and r == dp - 1) else 0
            fp32.append(torch.from_numpy(vec["fp32"][:size - pad]))
            state[g] = {"step": torch.tensor(2.0), **{w: torch.from_numpy(vec[w]) for w in STATES}}
            maps.append(mapping)
            paddings.append(pad)
        hyper = [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1 * (g == 0), "params": [g]}
                 for g in range(len(groups))]
        common = {"loss_scaler": stub("deepspeed.runtime.fp16.loss_scaler.LossScaler", (),
                                      {"cur_scale": 1.0, "dynamic": False}),
                  "dynamic_loss_scale": False, "overflow": False,
                  "zero_stage": stub("deepspeed.runtime.zero.config.ZeroStageEnum", (stage,))}
        if stage == 3:
            osd = {**common, "partition_count": dp, "optimizer_state_dict": {"state": state, "param_groups": hyper},
                   "fp32_flat_groups": fp32}
        else:
            osd = {**common, "clip_grad": 1.0, "base_optimizer_state": {"state": state, "param_groups": hyper},
                   "single_partition_of_fp32_groups": fp32, "group_paddings": paddings,
                   "param_alignment_paddings": [[0] * len(n) for n in groups],
                   "partition_count": [dp] * len(groups), "ds_version": "0.19.8", "param_slice_mappings": maps}
        if prefix:
            del osd["zero_stage"]
        torch.save({"optimizer_state_dict": osd, "ds_config": {"zero_optimization": {"stage": stage}},
                    "ds_version": "0.19.8"}, folder / f"{prefix}zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt",
                   pickle_module=PICKLE)
    shapes = [{n: torch.Size(s) for n, s in named} for named in groups]
    module = {n: torch.from_numpy(full[f"module.{n}"]) if stage != 3 else torch.empty(0)
              for named in groups for n, _ in named}
    running = values.get("module.norm.running", np.arange(3.0, dtype=np.float32)) if values else \
        np.arange(3.0, dtype=np.float32)
    module["norm.running"] = torch.from_numpy(running)  # a buffer
    full["module.norm.running"] = running
    model = {"module": module, "buffer_names": ["norm.running"], "optimizer": None, "param_shapes": shapes,
             "frozen_param_shapes": {}, "shared_params": {}, "global_steps": 2, "skipped_steps": 0,
             "dp_world_size": dp, "mp_world_size": tp, "ds_version": "0.19.8", **(extra or {})}
    names = [f"zero_pp_rank_{r}_mp_rank_{mp:02d}_model_states.pt" for r in range(dp)] if stage == 3 else \
        [f"mp_rank_{mp:02d}_model_states.pt"]
    for name in names:
        torch.save(model, folder / name)
    (folder.parent / "latest").write_text(folder.name)
    if stage == 3:
        full = {k: v for k, v in full.items() if not k.startswith("module.") or k == "module.norm.running"}
    return full
