"""Write glu/ and glu_singleton/: a tiny SwiGLU GPT's Megatron-Core torch_dist saves at TP=2, and what each rank held.

2 gloo ranks on CPU, TP=2: a 2-layer GPTModel (local layer spec, ``gated_linear_unit=True`` with SiLU, hidden
8, 2 heads, ffn 12, no linear biases) in fp32, model weights only. Megatron-Core saves the gated
``linear_fc1`` through ``apply_swiglu_sharded_factory`` (megatron/core/transformer/mlp.py):

* ``glu/``: the default, one tensor ``decoder.layers.mlp.linear_fc1.weight`` ``[2, 24, 8]`` (layers stacked)
  whose rows are ``[gate of every rank; up of every rank]``: TP rank r writes two chunks, gate rows r and up
  rows r;
* ``glu_singleton/``: ``metadata={"singleton_local_shards": True}``: layers apart
  (``decoder.layers.<i>.``) and the halves as two tensors, ``linear_fc1.weight_w`` and ``linear_fc1.weight_v``,
  each split over TP like any column-parallel weight.

``reference_glu.npz`` holds each rank's local ``linear_fc1`` weight per layer (``rank<r>/<layer>``, Megatron's
``[gate_r; up_r]``). Run with megatron-core 0.16 and torch 2.13 on CPU: ``python make_glu.py [OUT]``.
"""

import datetime
import os
import shutil
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_forms import cpu_shims, free_port

WORLD = 2


def run(rank, port, out):
    cpu_shims()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    filesystem_async._process_memory = lambda: 0  # its debug log's memory probe needs psutil
    ps.initialize_model_parallel(tensor_model_parallel_size=WORLD)
    torch.manual_seed(1234)
    cfg = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, ffn_hidden_size=12,
                            gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
                            use_cpu_initialization=True, tensor_model_parallel_size=WORLD)
    model = GPTModel(cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=16, max_sequence_length=8,
                     share_embeddings_and_output_weights=False)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):  # distinct values everywhere (the init leaves zeros and ones)
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * rank + i)))
    held = {f"rank{rank}/{i}": layer.mlp.linear_fc1.weight.detach().numpy().copy()
            for i, layer in enumerate(model.decoder.layers)}
    for name, metadata in (("glu", None), ("glu_singleton", {"singleton_local_shards": True})):
        folder = os.path.join(out, name)
        if rank == 0:
            os.makedirs(folder)
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(metadata=metadata), folder)
        dist.barrier()
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, held)
    if rank == 0:
        np.savez(os.path.join(out, "reference_glu.npz"), **{k: v for h in gathered for k, v in h.items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    for name in ("glu", "glu_singleton"):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    mp.spawn(run, args=(free_port(), out), nprocs=WORLD)
