"""Write the OneFlow sample folders under tests/data/oneflow/ with OneFlow itself (``flow.save``).

Run with OneFlow 0.9.0 (Python 3.10; the CUDA wheel runs on CPU once cuDNN 8 and cuBLAS 11
are importable, e.g. ``pip install oneflow==0.9.0 "numpy<2" "nvidia-cudnn-cu11<9" nvidia-cublas-cu11``
and LD_LIBRARY_PATH pointing at their ``lib`` folders), from this folder::

    python -m oneflow.distributed.launch --nproc_per_node 2 make_samples.py

What it writes (every value is a deterministic function of its index, see ``expected.json``):

* ``local/``: ``flow.save`` of a nested, local state dict (a module's OrderedDict state dict,
  float16 and int64 tensors, a float leaf), saved by rank 0.
* ``rank_0/``, ``rank_1/``: seed 001's sharded save: the state dict moved onto the placement
  ``cpu, ranks=[0, 1]`` with ``get_sbp`` (``split(0)``, 5 rows -> 3 + 2; ``split(1)``;
  ``broadcast``), then each rank saves its ``to_local`` part with ``flow.save``.
* ``global_dst0/``: ``flow.save(global_state_dict, path, global_dst_rank=0)``: whole tensors
  (``half`` is float32 there and float16 in the others: OneFlow's CPU send/recv has no float16).
* ``module/``: ``flow.save`` of a whole ``nn.Linear`` module: a pickled Python object that
  reshard must refuse (it needs unpickling).
"""

import json
import shutil
from collections import OrderedDict
from pathlib import Path

import numpy as np
import oneflow as flow

HERE = Path(__file__).parent
rank = flow.env.get_rank()


def values():
    lin = flow.nn.Linear(4, 5)
    with flow.no_grad():
        lin.weight.copy_(flow.tensor(np.arange(20, dtype=np.float32).reshape(5, 4) / 10))
        lin.bias.copy_(flow.tensor(np.arange(5, dtype=np.float32) - 2))
    state = {
        "model": lin.state_dict(),
        "head": {"proj.weight": flow.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))},
        "step": flow.tensor(np.array([7], np.int64)),
        "half": flow.tensor(np.linspace(0, 1, 6, dtype=np.float16).reshape(3, 2)),
        "lr": 0.25,
    }
    return lin, state


def get_sbp(state, tensor):
    if tensor is state["head"]["proj.weight"]:
        return flow.sbp.split(1)
    if tensor is state["step"]:
        return flow.sbp.broadcast
    return flow.sbp.split(0)


lin, state = values()
state["half"] = state["half"].to(dtype=flow.float32)
placement = flow.placement("cpu", ranks=[0, 1])
# every rank holds the same whole values: as broadcast global tensors they are the state dict itself
whole = flow.utils.global_view.to_global(state, placement=placement, sbp=flow.sbp.broadcast)
global_state = flow.utils.global_view.to_global(whole, placement=placement, sbp=get_sbp)

local = flow.utils.global_view.to_local(global_state)
local["half"] = local["half"].to(dtype=flow.float16)  # after to_local: OneFlow's CPU send/recv has no float16
for name in ("local", "rank_0", "rank_1", "global_dst0", "module"):
    if rank == 0 and (HERE / name).exists():
        shutil.rmtree(HERE / name)
flow.comm.barrier()
flow.save(local, HERE / f"rank_{rank}")
flow.save(global_state, HERE / "global_dst0", global_dst_rank=0)
if rank == 0:
    state["half"] = state["half"].to(dtype=flow.float16)
    flow.save(state, HERE / "local")
    flow.save(lin, HERE / "module")
    expected = {
        "model.weight": (np.arange(20, dtype=np.float32).reshape(5, 4) / 10).tolist(),
        "model.bias": (np.arange(5, dtype=np.float32) - 2).tolist(),
        "head.proj.weight": np.arange(6, dtype=np.float32).reshape(2, 3).tolist(),
        "step": [7],
        "half": np.linspace(0, 1, 6, dtype=np.float16).reshape(3, 2).astype(np.float32).tolist(),
        "lr": 0.25,
        "oneflow": flow.__version__,
    }
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print({k: tuple(v.shape) for k, v in local["model"].items()}, type(state["model"]) is OrderedDict)
