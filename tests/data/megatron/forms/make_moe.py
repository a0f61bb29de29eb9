"""Write moe_dp_reshardable/: a tiny MoE GPT's Megatron-Core torch_dist save whose optimizer is chained.

2 gloo ranks on CPU, TP=1 x DP=2, expert parallelism 2 (one expert per rank): a 1-layer GPTModel (local
layer spec, 2 experts, ``moe_router_topk=1`` with ``moe_router_pre_softmax`` as Megatron asks, no linear
biases) in bf16 (Float16Module) under DistributedDataParallel with the distributed optimizer
(``overlap_grad_reduce``, bucket_size=300). Megatron gives the expert-parallel parameters an optimizer of
their own, so ``get_megatron_optimizer`` returns a ``ChainedOptimizer`` of two, and the ``dp_reshardable``
save holds each one's flat buckets under ``chained_0.`` / ``chained_1.``. One optimizer step on seeded
gradients, then ``dist_checkpointing.save`` as make_forms.py does.

Run with megatron-core 0.16 and torch 2.13 on CPU: ``python make_moe.py [OUT]`` (make_forms.py's CPU shims;
without psutil, the save's memory probe for a debug log is stubbed).
"""

import datetime
import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_forms import cpu_shims, free_port

WORLD = 2
FORM = "dp_reshardable"


def build():
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2)
    torch.manual_seed(1234)
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=12,
                            add_bias_linear=False, use_cpu_initialization=True, num_moe_experts=2,
                            expert_model_parallel_size=2, moe_router_topk=1, moe_router_pre_softmax=True,
                            moe_ffn_hidden_size=12, bf16=True, params_dtype=torch.bfloat16,
                            pipeline_dtype=torch.bfloat16)
    model = GPTModel(cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=2), vocab_size=16,
                     max_sequence_length=8, share_embeddings_and_output_weights=False)
    model = Float16Module(cfg, model)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=300, grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.01, bf16=True, use_distributed_optimizer=True,
                                                 clip_grad=0.0), [ddp])
    assert len(getattr(opt, "chained_optimizers", ())) == 2, type(opt)
    return model, opt


def run(rank, port, out):
    cpu_shims()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._process_memory = lambda: 0  # its debug log's memory probe needs psutil, absent here
    model, opt = build()
    for i, p in enumerate(model.parameters()):
        p.main_grad.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    opt.step()
    msd = model.sharded_state_dict()
    osd = opt.sharded_state_dict(msd, metadata={"distrib_optim_sharding_type": FORM})
    folder = os.path.join(out, f"moe_{FORM}")
    if rank == 0:
        os.makedirs(folder)
    dist.barrier()
    dist_checkpointing.save({"model": msd, "optimizer": osd}, folder)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    shutil.rmtree(os.path.join(out, f"moe_{FORM}"), ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    mp.spawn(run, args=(free_port(), out), nprocs=WORLD)
