"""Write tp2dp2/: a Megatron-Core dist_checkpointing save in the torch_dist format, by megatron-core itself.

4 gloo ranks, TP=2 x DP=2. The model weights are ShardedTensors split by TP
(``from_rank_offsets``); the optimizer state (``fp32_param``, ``exp_avg``,
``exp_avg_sq``) is what Megatron's distributed optimizer saves in its
``fully_sharded_model_space`` form: each DP rank holds a ``flattened_range`` of
every TP-local block (``from_rank_offsets_flat``), ranges cut at uneven points,
a layer norm weight replicated over TP. ``dist_checkpointing.save`` writes it:
DCP's ``.metadata`` (with Megatron's ``mcore_data``: each flattened tensor's
``nd_reformulated_orig_global_shape``), ``__R_0.distcp`` files, ``common.pt`` and
``metadata.json``. Flattened tensors are stored as ``[*TP fragments, prod(local
shape)]`` arrays whose last axis is cut by the ranges.

Values: element ``e`` of tensor (name, state) is ``e + 1000 * CODES[...]``
(tests/test_megatron.py recomputes them).

Run with megatron-core 0.12.1 (the last version writing flattened ranges; 0.16
refuses them) and torch 2.13 on CPU, ``python make_samples.py``. Megatron 0.12
was written for CUDA and an older torch; four shims below let its own writer run
on CPU (none changes what it writes).
"""

import datetime
import os
import shutil
import socket

import numpy as np

if not hasattr(np, "product"):
    np.product = np.prod  # megatron-core 0.12 calls np.product, gone in numpy 2
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if not torch.cuda.is_available():
    torch.cuda.synchronize = lambda *a, **k: None  # its writer synchronises CUDA; a CPU run has none
    torch.cuda.current_device = lambda: "cpu"  # and puts a liveness flag on the current CUDA device

# name: (global shape, TP axis or None)
SHAPES = {"embedding.word_embeddings.weight": ((12, 6), 0), "decoder.linear_fc1.weight": ((8, 10), 0),
          "decoder.linear_fc2.weight": ((6, 8), 1), "decoder.final_layernorm.weight": ((6,), None)}
STATES = ("param", "fp32_param", "exp_avg", "exp_avg_sq")
CODES = {(n, s): i * len(STATES) + j for i, n in enumerate(SHAPES) for j, s in enumerate(STATES)}
TP, DP = 2, 2
# where each TP-local block's flattening is cut among the DP ranks (uneven, mid-row)
CUTS = {"embedding.word_embeddings.weight": [0, 17, 36], "decoder.linear_fc1.weight": [0, 3, 40],
        "decoder.linear_fc2.weight": [0, 23, 24], "decoder.final_layernorm.weight": [0, 4, 6]}


def values(name, state):
    shape = SHAPES[name][0]
    return torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape) + 1000 * CODES[name, state]


def run(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP * DP, timeout=datetime.timedelta(seconds=120))
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint import filesystem

    queue = mp.get_context("fork").Queue()  # 0.12's Manager queue breaks under spawned ranks: a plain one
    filesystem_async._get_write_results_queue = lambda: queue

    def write_item(*args):  # 0.12 predates the serialization_format argument of torch's _write_item
        return filesystem._write_item(*args, filesystem.SerializationFormat.TORCH_SAVE)

    filesystem_async._write_item = write_item

    tp_rank, dp_rank = rank % TP, rank // TP
    sd = {}
    for name, (_, axis) in SHAPES.items():
        offs = () if axis is None else ((axis, tp_rank, TP),)

        def local(state, name=name, axis=axis):
            t = values(name, state)
            return t if axis is None else t.chunk(TP, axis)[tp_rank].contiguous()

        rid = (0, tp_rank, dp_rank) if axis is None else (0, 0, dp_rank)
        sd[name] = ShardedTensor.from_rank_offsets(name, local("param"), *offs, replica_id=rid)
        cut = CUTS[name]
        rng = slice(cut[dp_rank], cut[dp_rank + 1])
        for state in STATES[1:]:
            key = f"optimizer.state.{state}.{name}"
            t = local(state)
            sd[key] = ShardedTensor.from_rank_offsets_flat(key, t.reshape(-1)[rng].clone(), t.shape, *offs,
                                                           flattened_range=rng,
                                                           replica_id=(0, tp_rank, 0) if axis is None else (0, 0, 0))
    dist_checkpointing.save(sd, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp2dp2")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(port, out), nprocs=TP * DP)
